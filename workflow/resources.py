"""Per-job memory and run-time estimates of the batch rules, from measurements.

The constants were measured on the 2-core development machine (numbers and commands in
README.md, "Resource estimates"): peak resident memory per particle of one simulation, and
wall time per particle (and per particle and time step for the N-body solver) on one core.
Snakemake passes the estimates to the executor as ``mem_mb`` and ``runtime``.
"""

from __future__ import annotations

import math

# initial_conditions: 256^3 particles in 5.4 s on 2 threads, 2.2 GB peak;
# simulate: bench/cola.py, 128^3 particles on a 256^3 mesh, extrapolated to 512^3 / 1024^3.
PEAK_BYTES_PER_PARTICLE = {"initial_conditions": 131.0, "simulate": 136.0}
CORE_SECONDS_PER_PARTICLE = {"initial_conditions": 6.5e-7}
CORE_SECONDS_PER_PARTICLE_STEP = {"simulate": 5.4e-7}
BASE_MEMORY_MB = 500  # the interpreter, numpy, scipy, numba and h5py
SAFETY = 1.5  # headroom over the measured peak / time


def job_memory_mb(stage: str, config: dict) -> int:
    """Memory of one batch job: simulations run one after another, so one simulation's peak."""
    particles = config["simulation"]["n_particles"] ** 3
    return math.ceil(BASE_MEMORY_MB + SAFETY * PEAK_BYTES_PER_PARTICLE[stage] * particles / 1e6)


def job_runtime_min(stage: str, config: dict) -> int:
    """Wall-clock minutes of one batch job on ``simulation.threads`` cores."""
    simulation = config["simulation"]
    particles = simulation["n_particles"] ** 3
    if stage == "simulate":
        core_seconds = CORE_SECONDS_PER_PARTICLE_STEP[stage] * particles * simulation["n_steps"]
    else:
        core_seconds = CORE_SECONDS_PER_PARTICLE[stage] * particles
    seconds = SAFETY * simulation["batch_size"] * core_seconds / simulation["threads"]
    return max(5, math.ceil(seconds / 60))
