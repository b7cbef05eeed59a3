"""Density histograms: particle counts per voxel, one grid per snapshot redshift.

CosmoFlow (Mathuriya et al. 2018, Sec. III-A) turns each simulation's dark-matter particles into
a 3D histogram of particle counts (512^3 particles on 256^3 voxels of 2 Mpc/h in the paper);
the network learns from these counts. Assignment is nearest-grid-point (NGP: each particle adds
1 to the voxel containing it, giving integer counts) or cloud-in-cell (CIC: a particle's unit
mass is shared among the 8 nearest voxel centres, giving fractional counts).

Outputs (run directory; docs/formats.md, "Histograms"): ``histograms/<sim_id>.h5`` with

* dataset ``counts``, shape ``(n_z, G, G, G)``, index ``[redshift, ix, iy, iz]``, dtype int16
  (int32 if configured; float32 for CIC), particles per voxel;
* attrs ``grid``, ``box_size`` (Mpc/h), ``redshifts``, ``assignment`` ('ngp' | 'cic'),
  ``sim_id``, ``dtype``, plus ``n_particles``, the snapshot's cosmology (``Omega_m``,
  ``Omega_b``, ``h``, ``sigma_8``, ``n_s``), ``seed``, ``code_version`` and ``units_counts``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import numbers
import os
from pathlib import Path
from typing import Iterator

import h5py
import numba
import numpy as np

from preprocessing.manifest import VOXEL_DTYPES
from workflow.errors import PipelineError
from workflow.io import atomic_path
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

#: Snapshot attributes copied into the histogram file.
COPIED_ATTRS = ("n_particles", "seed", "Omega_m", "Omega_b", "h", "sigma_8", "n_s")
#: Particles read from a snapshot per chunk: 3 MiB of float32 positions, small enough to be
#: still in cache when the kernel reads what the reader thread has just written.
CHUNK_PARTICLES = 1 << 18
#: Particles per block of the NGP kernel (index buffers stay in L1 cache).
_BLOCK = 1024


@numba.njit(inline="always")
def _voxel_index(x, box_size, cells_per_length, grid):
    """Voxel index in [0, grid) of coordinate ``x`` (Mpc/h), periodic; -1 if not finite.

    Coordinates outside [0, L) are wrapped first, so x = L lands in voxel 0 and a tiny negative
    x (float rounding of a periodic wrap) in voxel grid - 1; the final ``min`` guards against
    x * grid / L rounding up to ``grid`` for x just below L.
    """
    if not np.isfinite(x):
        return -1
    if not (0.0 <= x < box_size):
        x = x % box_size
    return min(int(x * cells_per_length), grid - 1)


@numba.njit(cache=True, nogil=True)
def _add_ngp_counts_exact(positions, box_size, counts):
    """Per-particle NGP with periodic wrapping; returns the number of non-finite particles."""
    grid = counts.shape[0]
    cells_per_length = grid / box_size
    n_not_finite = 0
    for p in range(positions.shape[0]):
        i = _voxel_index(np.float64(positions[p, 0]), box_size, cells_per_length, grid)
        j = _voxel_index(np.float64(positions[p, 1]), box_size, cells_per_length, grid)
        k = _voxel_index(np.float64(positions[p, 2]), box_size, cells_per_length, grid)
        if i < 0 or j < 0 or k < 0:
            n_not_finite += 1
            continue
        counts[i, j, k] += 1
    return n_not_finite


@numba.njit(cache=True, nogil=True)
def _add_ngp_counts(positions, box_size, counts):
    """Add 1 to ``counts[i, j, k]`` for the voxel of every particle; return the non-finite count.

    ``positions`` (M, 3) C-contiguous, Mpc/h; ``counts`` (G, G, G) integer grid, updated in
    place. Works in blocks of particles: when all coordinates of a block lie in [0, L), their
    voxel indices are computed in branch-free loops that the compiler vectorises, then
    scattered (about twice as fast as one loop per particle); blocks with any coordinate
    outside [0, L) or not finite take the per-particle path with periodic wrapping. Serial: the
    scatter has write conflicts, and ``nogil`` lets the caller read the next chunk meanwhile.
    """
    grid = counts.shape[0]
    cells_per_length = grid / box_size
    flat_counts = counts.reshape(-1)
    coordinates = positions.reshape(-1)
    cells = np.empty(3 * _BLOCK, np.int32)
    voxels = np.empty(_BLOCK, np.int64)
    n_not_finite = 0
    for start in range(0, positions.shape[0], _BLOCK):
        n_block = min(_BLOCK, positions.shape[0] - start)
        block = coordinates[3 * start:3 * (start + n_block)]
        n_outside = 0
        for q in range(3 * n_block):
            n_outside += not (0.0 <= block[q] < box_size)  # NaN counts as outside
            cells[q] = min(int(block[q] * cells_per_length), grid - 1)
        if n_outside:
            n_not_finite += _add_ngp_counts_exact(
                positions[start:start + n_block], box_size, counts)
            continue
        for p in range(n_block):
            voxels[p] = (cells[3 * p] * grid + cells[3 * p + 1]) * grid + cells[3 * p + 2]
        for p in range(n_block):
            flat_counts[voxels[p]] += 1
    return n_not_finite


def count_ngp(
    positions: np.ndarray, box_size: float, grid: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Nearest-grid-point particle counts on a periodic ``grid``^3 mesh.

    Parameters
    ----------
    positions : (M, 3) float array, comoving positions in Mpc/h (wrapped periodically).
    box_size : box side L in Mpc/h; voxel (i, j, k) covers [i, i+1) * L / grid along x, etc.
    grid : voxels per side G.
    out : optional (G, G, G) int32/int64 array to add the counts into (for chunked reading).

    Returns the (G, G, G) int32 counts (``out`` when given). Raises ValueError if any position is
    not finite.
    """
    positions = np.ascontiguousarray(positions)
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(f"positions must have shape (M, 3), got {positions.shape}")
    counts = np.zeros((grid,) * 3, np.int32) if out is None else out
    n_not_finite = _add_ngp_counts(positions, float(box_size), counts)
    if n_not_finite:
        raise ValueError(f"{n_not_finite} of {len(positions)} particle positions are not finite")
    return counts


def count_cic(
    positions: np.ndarray, box_size: float, grid: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Cloud-in-cell particle counts (unit mass per particle) on a periodic ``grid``^3 mesh.

    Reuses the simulation's CIC kernel (:func:`simulations.mesh.paint_cic`, cells centred on
    (i + 0.5) L / grid like the NGP voxels), so the histogram and the N-body force use one
    mass-assignment scheme. Units and arguments as :func:`count_ngp`; returns float64 counts
    (``out`` when given, added into) whose total equals the number of particles.
    """
    from simulations.mesh import paint_cic

    positions = np.ascontiguousarray(positions)
    if not np.isfinite(positions).all():
        n_not_finite = int((~np.isfinite(positions).all(axis=1)).sum())
        raise ValueError(f"{n_not_finite} of {len(positions)} particle positions are not finite")
    counts = np.zeros((grid,) * 3, np.float64) if out is None else out
    counts += paint_cic(positions, box_size, grid)
    return counts


ASSIGNMENTS = {"ngp": (count_ngp, np.int32), "cic": (count_cic, np.float64)}
"""The mass-assignment schemes, each with its counter and the dtype it accumulates in."""


def _position_chunks(dataset: h5py.Dataset, z_index: int) -> Iterator[np.ndarray]:
    """Yield ``dataset[z_index]`` in chunks of particles, reading the next while one is used.

    Two buffers alternate: a background thread fills one while the caller counts the other.
    For overlap, neither side may hold the GIL: the numba kernel releases it, and a contiguous
    native-float32 dataset (how the simulate stage writes snapshots) is read with ``os.preadv``
    from its byte offset in the file, which releases it too; any other layout (chunked,
    compressed, big-endian) is read through h5py.
    """
    n_total = dataset.shape[1]
    starts = range(0, n_total, CHUNK_PARTICLES)
    size = min(CHUNK_PARTICLES, n_total)
    buffers = [np.empty((size, 3), np.float32) for _ in range(2)]
    offset = dataset.id.get_offset()
    raw = offset is not None and dataset.dtype == np.dtype(np.float32)

    with contextlib.ExitStack() as stack:
        file = stack.enter_context(open(dataset.file.filename, "rb", buffering=0)) if raw else None

        def read(chunk: int) -> np.ndarray:
            start = starts[chunk]
            stop = min(start + CHUNK_PARTICLES, n_total)
            buffer = buffers[chunk % 2][: stop - start]
            if file is None:
                dataset.read_direct(buffer, source_sel=np.s_[z_index, start:stop, :])
            else:
                _pread_exactly(file.fileno(), buffer, offset + (z_index * n_total + start) * 12)
            return buffer

        reader = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        pending = reader.submit(read, 0) if starts else None
        for chunk in range(len(starts)):
            current = pending.result()
            pending = reader.submit(read, chunk + 1) if chunk + 1 < len(starts) else None
            yield current


def _pread_exactly(fd: int, buffer: np.ndarray, position: int) -> None:
    """Fill ``buffer`` with the file's bytes from ``position``; OSError if the file ends first."""
    view = memoryview(buffer).cast("B")
    while view:
        n_read = os.preadv(fd, [view], position)
        if n_read == 0:
            raise OSError(f"the file ends at byte {position}, inside the positions dataset")
        view, position = view[n_read:], position + n_read


def _open_snapshot(snapshot_path: Path) -> h5py.File:
    if not snapshot_path.is_file():
        raise PipelineError(f"Snapshot {snapshot_path} does not exist; run the simulate stage first.")
    try:
        return h5py.File(snapshot_path, "r")
    except OSError as error:
        raise PipelineError(
            f"Snapshot {snapshot_path} cannot be opened as HDF5 (truncated or corrupt?): {error}."
        ) from error


def _check_snapshot(snapshot: h5py.File, snapshot_path: Path) -> None:
    """Raise PipelineError unless the snapshot has the datasets and attrs of the contract."""
    for name in ("positions", "redshifts"):
        if name not in snapshot:
            raise PipelineError(f"Snapshot {snapshot_path} has no dataset '{name}'.")
    for name in ("box_size", "n_particles", "sim_id"):
        if name not in snapshot.attrs:
            raise PipelineError(f"Snapshot {snapshot_path} has no attribute '{name}'.")
    n_z = snapshot["redshifts"].shape[0]
    n_expected = int(snapshot.attrs["n_particles"]) ** 3
    shape = snapshot["positions"].shape
    if shape != (n_z, n_expected, 3):
        raise PipelineError(
            f"Snapshot {snapshot_path} has positions of shape {shape}; expected "
            f"{(n_z, n_expected, 3)} (n_redshifts, n_particles**3, 3)."
        )


def histogram_snapshot(
    snapshot_path: str | os.PathLike,
    out_path: str | os.PathLike,
    grid: int,
    assignment: str,
    dtype: str,
    provenance: str = "",
) -> Path:
    """Histogram every redshift of a ``snapshot.h5`` and write ``histograms/<sim_id>.h5``.

    Parameters
    ----------
    snapshot_path : the simulation's snapshot (docs/formats.md, "snapshot.h5").
    out_path : the histogram file to write (atomically).
    grid : voxels per side G; voxel side L / G in Mpc/h.
    assignment : one of :data:`ASSIGNMENTS`, 'ngp' (integer counts) or 'cic' (fractional
        counts, dtype 'float32').
    dtype : stored dtype of ``counts``, one of :data:`~preprocessing.manifest.VOXEL_DTYPES`.
    provenance : stored as the attribute of that name (workflow.batch).

    Returns ``out_path``. Raises PipelineError if the snapshot is missing, truncated or not per
    contract, or if a count does not fit in ``dtype``.
    """
    snapshot_path, out_path = Path(snapshot_path), Path(out_path)
    _check_arguments(grid, assignment, dtype)
    count, accumulator_dtype = ASSIGNMENTS[assignment]
    with _open_snapshot(snapshot_path) as snapshot:
        _check_snapshot(snapshot, snapshot_path)
        attrs = dict(snapshot.attrs)
        box_size = float(attrs["box_size"])
        positions = snapshot["positions"]
        n_particles = positions.shape[1]
        try:
            redshifts = snapshot["redshifts"][()]
            counts = np.zeros((len(redshifts),) + (grid,) * 3, accumulator_dtype)
            for z_index, redshift in enumerate(redshifts):
                for chunk in _position_chunks(positions, z_index):
                    count(chunk, box_size, grid, out=counts[z_index])
                log.debug("sim %s: histogrammed z = %g", attrs["sim_id"], redshift)
        except OSError as error:
            raise PipelineError(
                f"Snapshot {snapshot_path} could not be read (truncated or corrupt?): {error}."
            ) from error
        except ValueError as error:
            raise PipelineError(f"Snapshot {snapshot_path}: {error}.") from error
    _check_total(counts, n_particles, snapshot_path)
    stored = _to_stored_dtype(counts, dtype, attrs["sim_id"], snapshot_path)
    write_histogram(
        out_path, stored, box_size, redshifts, assignment, int(attrs["sim_id"]),
        {name: attrs[name] for name in COPIED_ATTRS if name in attrs}
        | ({"provenance": provenance} if provenance else {}),
    )
    log.info("sim %s: wrote %s (%d redshifts, %d^3 voxels, %s)",
             attrs["sim_id"], out_path, len(redshifts), grid, assignment)
    return out_path


def _check_arguments(grid: int, assignment: str, dtype: str) -> None:
    """Raise PipelineError naming the first argument that histogram_snapshot cannot take."""
    checks = [
        (isinstance(grid, numbers.Integral) and not isinstance(grid, bool) and grid >= 1, "grid",
         grid, "a positive integer"),
        (assignment in ASSIGNMENTS, "assignment", assignment, f"one of {', '.join(ASSIGNMENTS)}"),
        (dtype in VOXEL_DTYPES, "dtype", dtype, f"one of {', '.join(VOXEL_DTYPES)}"),
    ]
    for ok, name, value, expected in checks:
        if not ok:
            raise PipelineError(f"Histogram: {name} = {value!r} must be {expected}.")


def _check_total(counts: np.ndarray, n_particles: int, snapshot_path: Path) -> None:
    """Every particle must be counted once per redshift (mass conservation)."""
    totals = counts.reshape(len(counts), -1).sum(axis=1, dtype=np.float64)
    if not np.allclose(totals, n_particles, rtol=1e-6, atol=0):
        raise PipelineError(
            f"Histogram of {snapshot_path} holds {totals.tolist()} particles per redshift; "
            f"expected {n_particles}."
        )


def _to_stored_dtype(counts: np.ndarray, dtype: str, sim_id: int, snapshot_path: Path) -> np.ndarray:
    """Cast the counts to ``dtype``, refusing integer overflow."""
    target = VOXEL_DTYPES[dtype]
    if target.kind == "i" and counts.dtype.kind == "f" and not np.all(counts == np.round(counts)):
        raise PipelineError(
            f"Histogram dtype '{dtype}' cannot hold the fractional (CIC) counts of sim {sim_id} "
            f"({snapshot_path}); use float32."
        )
    if target.kind == "i":
        largest = int(counts.max())
        if largest > np.iinfo(target).max:
            raise PipelineError(
                f"Sim {sim_id} ({snapshot_path}) has a voxel with {largest} particles, more than "
                f"{dtype} holds ({np.iinfo(target).max}); set the histogram dtype to int32 in the "
                f"config."
            )
    return counts.astype(target)


def write_histogram(
    out_path: str | os.PathLike,
    counts: np.ndarray,
    box_size: float,
    redshifts: np.ndarray,
    assignment: str,
    sim_id: int,
    extra_attrs: dict | None = None,
) -> Path:
    """Write ``counts`` (n_z, G, G, G) and its attrs to ``out_path`` per the histogram contract.

    ``box_size`` in Mpc/h; ``extra_attrs`` (e.g. the snapshot's cosmology) are stored as well.
    """
    out_path = Path(out_path)
    counts = np.asarray(counts)
    redshifts = np.asarray(redshifts, np.float64)
    if counts.ndim != 4 or len(set(counts.shape[1:])) != 1 or len(counts) != len(redshifts):
        raise ValueError(
            f"counts must have shape (n_z, G, G, G) with n_z = {len(redshifts)}, got {counts.shape}"
        )
    with atomic_path(out_path) as tmp, h5py.File(tmp, "w") as out:
        out.create_dataset("counts", data=counts, track_times=False)  # reproducible bytes
        out.attrs.update(extra_attrs or {})
        out.attrs.update(
            grid=counts.shape[1], box_size=float(box_size), redshifts=redshifts,
            assignment=assignment, sim_id=int(sim_id), dtype=str(counts.dtype),
            code_version=CODE_VERSION, units_counts="particles per voxel",
        )
    return out_path
