"""Sampling the cosmological parameters of the ensemble (rule ``sample_parameters``).

The CosmoFlow paper (Mathuriya et al. 2018, Sec. III-A) varies Omega_m in (0.25, 0.35),
sigma_8 in (0.78, 0.95) and n_s in (0.9, 1.0) in flat LCDM; the MLPerf HPC data set adds h as a
fourth target. Designs:

- ``latin_hypercube``, ``sobol``: space-filling designs from :mod:`scipy.stats.qmc`;
- ``uniform``: independent uniform draws;
- ``grid``: a regular grid, ends included;
- ``fiducial_derivatives``: a fiducial point and a -/+ step in each parameter (for finite-
  difference derivatives and Fisher forecasts), repeated; all points of one repetition share
  one seed, so that differences between them are free of cosmic variance.

Output (run directory): ``params.csv`` with columns ``sim_id, batch, <parameters in config
order>, seed, split`` (read back by :func:`workflow.params_table.read_params_csv`).
"""

from __future__ import annotations

import csv
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workflow.config import SPLITS, split_counts
from workflow.errors import PipelineError
from workflow.io import atomic_write_text
from workflow.logs import PROGRESS

log = logging.getLogger(__name__)

# Independent random streams drawn from the master seed (numpy SeedSequence spawn keys).
_STREAM_DESIGN, _STREAM_SPLITS, _STREAM_SEEDS = 1, 2, 3
# Seeds live in [1, 2^31 - 2], which MUSIC's `seed[level]` and every common RNG accept.
# Multiplication modulo the Mersenne prime 2^31 - 1 permutes that range, so seeds are unique.
_SEED_PRIME = 2**31 - 1


@dataclass(frozen=True)
class Ensemble:
    """The sampled ensemble: one row per simulation."""

    parameter_names: tuple[str, ...]
    values: np.ndarray  # (n_simulations, n_parameters)
    seeds: np.ndarray  # (n_simulations,) int64
    splits: tuple[str, ...]
    sims_per_job: int  # the batch of a simulation: sim_id // sims_per_job

    @property
    def n_simulations(self) -> int:
        return len(self.values)


def _rng(master_seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(master_seed, spawn_key=(stream,)))


def unit_design(design: str, n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` points of ``design`` in the unit cube [0, 1]^d (not for fiducial_derivatives)."""
    from scipy.stats import qmc  # imported here: planning a workflow needs only assign_splits

    if design == "latin_hypercube":
        return qmc.LatinHypercube(d, rng=rng).random(n)
    if design == "sobol":
        with warnings.catch_warnings():
            # scipy warns when n is not a power of two (balance is then only approximate).
            warnings.simplefilter("ignore", UserWarning)
            if n & (n - 1):
                log.warning("Sobol design with n = %d, not a power of two: balance is approximate", n)
            return qmc.Sobol(d, rng=rng).random(n)
    if design == "uniform":
        return rng.random((n, d))
    if design == "grid":
        per_axis = round(n ** (1 / d))
        axis = np.linspace(0.0, 1.0, per_axis) if per_axis > 1 else np.array([0.5])
        return np.stack(np.meshgrid(*[axis] * d, indexing="ij"), axis=-1).reshape(-1, d)
    raise PipelineError(f"unknown sampling design {design!r}")


def fiducial_derivative_points(names, fiducial: dict, steps: dict) -> np.ndarray:
    """The fiducial point, then for each parameter its -step and +step point: (1 + 2d, d)."""
    centre = np.array([fiducial[name] for name in names], dtype=float)
    points = [centre]
    for i, name in enumerate(names):
        for sign in (-1.0, 1.0):
            point = centre.copy()
            point[i] += sign * steps[name]
            points.append(point)
    return np.array(points)


def simulation_seeds(master_seed: int, indices: np.ndarray) -> np.ndarray:
    """Per-simulation seeds derived from the master seed and each index (sim_id or repetition).

    seed = a * ((index + b) mod (p - 1) + 1) mod p with p = 2^31 - 1 and a, b drawn from the
    master seed: a permutation of [1, p - 1], so distinct indices get distinct seeds, and any
    simulation's seed follows from (master seed, index) alone.
    """
    a, b = _rng(master_seed, _STREAM_SEEDS).integers(1, _SEED_PRIME - 1, size=2)
    indices = np.asarray(indices, dtype=np.int64)
    return (int(a) * ((indices + int(b)) % (_SEED_PRIME - 1) + 1)) % _SEED_PRIME


def assign_splits(n: int, fractions: dict, master_seed: int) -> tuple[str, ...]:
    """Train/val/test label of each simulation: a seeded permutation cut into split_counts."""
    counts = split_counts(n, fractions)
    order = _rng(master_seed, _STREAM_SPLITS).permutation(n)
    labels = np.empty(n, dtype=object)
    start = 0
    for split in SPLITS:
        labels[order[start : start + counts[split]]] = split
        start += counts[split]
    return tuple(labels)


def sample_ensemble(
    n_simulations: int,
    design: str,
    parameters: list[str],
    ranges: dict,
    splits: dict,
    sims_per_job: int,
    master_seed: int,
    fiducial: dict | None = None,
    derivative_steps: dict | None = None,
) -> Ensemble:
    """Draw the ensemble's parameters, seeds and splits; deterministic in ``master_seed``."""
    names = tuple(parameters)
    sim_ids = np.arange(n_simulations)
    if design == "fiducial_derivatives":
        points = fiducial_derivative_points(names, fiducial, derivative_steps)
        values = np.tile(points, (n_simulations // len(points), 1))
        seeds = simulation_seeds(master_seed, sim_ids // len(points))
    else:
        unit = unit_design(design, n_simulations, len(names), _rng(master_seed, _STREAM_DESIGN))
        low = np.array([ranges[name][0] for name in names])
        high = np.array([ranges[name][1] for name in names])
        values = low + unit * (high - low)
        seeds = simulation_seeds(master_seed, sim_ids)
    return Ensemble(names, values, seeds, assign_splits(n_simulations, splits, master_seed), sims_per_job)


def ensemble_csv(ensemble: Ensemble) -> str:
    """The text of params.csv; floats written with repr() so they read back exactly."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["sim_id", "batch", *ensemble.parameter_names, "seed", "split"])
    for sim_id, (row, seed, split) in enumerate(zip(ensemble.values, ensemble.seeds, ensemble.splits)):
        writer.writerow(
            [sim_id, sim_id // ensemble.sims_per_job, *(repr(float(v)) for v in row), int(seed), split]
        )
    return buffer.getvalue()


def write_params_csv(path: str | Path, ensemble: Ensemble) -> Path:
    """Write params.csv atomically and return its path."""
    atomic_write_text(path, ensemble_csv(ensemble))
    counts = {split: ensemble.splits.count(split) for split in SPLITS}
    log.info(
        "wrote %s: %d simulations (%s), parameters %s",
        path, ensemble.n_simulations, ", ".join(f"{k} {v}" for k, v in counts.items()),
        ", ".join(ensemble.parameter_names), extra=PROGRESS)
    return Path(path)
