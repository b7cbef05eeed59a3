"""Sub-volumes: cut each histogram into k^3 non-overlapping cubes of n voxels per side.

CosmoFlow (Mathuriya et al. 2018, Sec. III-A) splits every 256^3 histogram into 8 sub-volumes
of 128^3 voxels (256 Mpc/h), each a training sample with the simulation's parameters as target.

Sub-volume ``s`` of a grid with k = G / n blocks per side is the block at offsets
``(a, b, c) * n`` with ``s = (a * k + b) * k + c`` (C order of the blocks). Samples are stored
channels-last, ``(n, n, n, channels)``, channels being the snapshot redshifts. This module
writes no files.
"""

from __future__ import annotations

import numpy as np


def blocks_per_side(grid: int, subvolume: int) -> int:
    """k = grid / subvolume; raises ValueError unless ``subvolume`` divides ``grid``."""
    if subvolume < 1 or grid % subvolume:
        raise ValueError(
            f"sub-volume size {subvolume} does not divide the histogram grid {grid}; "
            f"choose a divisor of {grid}"
        )
    return grid // subvolume


def subvolume_slices(grid: int, subvolume: int, index: int) -> tuple[slice, slice, slice]:
    """Slices (x, y, z) of sub-volume ``index`` (0 <= index < k^3) in a ``grid``^3 array."""
    k = blocks_per_side(grid, subvolume)
    if not 0 <= index < k**3:
        raise ValueError(f"sub-volume index {index} is outside [0, {k**3})")
    a, b, c = np.unravel_index(index, (k, k, k))
    return tuple(slice(o * subvolume, (o + 1) * subvolume) for o in (a, b, c))


def split_subvolumes(grids: np.ndarray, subvolume: int) -> np.ndarray:
    """Split ``grids`` (C, G, G, G) into sub-volumes (k^3, n, n, n, C), channels last."""
    grids = np.asarray(grids)
    if grids.ndim != 4 or len(set(grids.shape[1:])) != 1:
        raise ValueError(f"grids must have shape (channels, G, G, G), got {grids.shape}")
    grid = grids.shape[1]
    k = blocks_per_side(grid, subvolume)
    return np.stack(
        [np.moveaxis(grids[(slice(None),) + subvolume_slices(grid, subvolume, s)], 0, -1)
         for s in range(k**3)]
    )


def assemble_subvolumes(subvolumes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`split_subvolumes`: (k^3, n, n, n, C) back to (C, G, G, G)."""
    subvolumes = np.asarray(subvolumes)
    n_blocks, n = subvolumes.shape[:2] if subvolumes.ndim == 5 else (0, 0)
    k = round(n_blocks ** (1 / 3))
    if n_blocks == 0 or k**3 != n_blocks or len(set(subvolumes.shape[1:4])) != 1:
        raise ValueError(
            f"sub-volumes must have shape (k^3, n, n, n, channels), got {subvolumes.shape}"
        )
    grid = k * n
    grids = np.empty((subvolumes.shape[-1],) + (grid,) * 3, subvolumes.dtype)
    for s in range(n_blocks):
        grids[(slice(None),) + subvolume_slices(grid, n, s)] = np.moveaxis(subvolumes[s], -1, 0)
    return grids
