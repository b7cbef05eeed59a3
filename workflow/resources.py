"""Per-job memory and run-time estimates of the batch rules, from measurements.

The constants were measured on a 2-vCPU KVM machine whose CPU model was not recorded (numbers
and commands in docs/presets.md, "Resource estimates"): peak resident memory per particle of one
simulation, and wall time per particle (and per particle and time step for the N-body solver)
on one core.
Snakemake passes the estimates to the executor as ``mem_mb`` and ``runtime``.
"""

from __future__ import annotations

import math

from workflow.config import sample_voxels, split_samples

# initial_conditions: 256^3 particles in 5.4 s on 2 threads, 2.2 GB peak;
# simulate: bench/cola.py, 128^3 particles on a 256^3 mesh, extrapolated to 512^3 / 1024^3.
PEAK_BYTES_PER_PARTICLE = {"initial_conditions": 131.0, "simulate": 136.0}
CORE_SECONDS_PER_PARTICLE = {"initial_conditions": 6.5e-7}
CORE_SECONDS_PER_PARTICLE_STEP = {"simulate": 5.4e-7}
BASE_MEMORY_MB = 500  # the interpreter, numpy, scipy, numba and h5py
SAFETY = 1.5  # headroom over the measured peak / time


def simulation_job(stage: str, config: dict) -> dict:
    """threads, mem_mb and runtime of one batch job of ``stage`` (initial_conditions or simulate)."""
    return {"threads": config["simulation"]["threads"], "mem_mb": job_memory_mb(stage, config),
            "runtime": job_runtime_min(stage, config)}


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
    seconds = SAFETY * simulation["sims_per_job"] * core_seconds / simulation["threads"]
    return max(5, math.ceil(seconds / 60))


# Training: the paper model's 69.3 Gflop per 128^3 sample (training/flops.py), scaled by voxels
# and channels; at 128^3 a rank sustains about 40 Gflop/s per core with TensorFlow's oneDNN
# kernels on AVX2 (bench/training_throughput.py: 82 Gflop/s on 2 AMD EPYC cores), taken as 30
# for margin.
# (Tiny samples run at far less, ~7 Gflop/s per core, but their jobs take the 10-minute floor.)
# Activations: ~16 float32 channels per input voxel over the layer
# pyramid, kept for the backward pass (x 3).
PAPER_TRAINING_FLOPS_PER_VOXEL = 69.33e9 / 128**3
GFLOPS_PER_CORE = 30.0
TRAINING_BASE_MEMORY_MB = 2000  # TensorFlow, Keras, the tf.data buffers
ACTIVATION_BYTES_PER_VOXEL_CHANNEL = 16 * 4 * 1.5 * 3


def staging_job(config: dict) -> dict:
    """runtime of the stage job (preprocessing.staging.staging_runtime_min)."""
    from preprocessing.jobs import staging_runtime_min

    return {"runtime": staging_runtime_min(config)}


def training_job(config: dict) -> dict:
    """threads (all ranks), MPI tasks and nodes, cores per task, launcher, mem_mb, runtime, and
    the sbatch options of burst-buffer staging, of the training job."""
    from preprocessing.jobs import burst_buffer_sbatch_options

    training = config["training"]
    return {"threads": training_cores(config), "tasks": training["ranks"], "nodes": training["nodes"],
            "cpus_per_task": max(1, training["threads"]), "mpi": "mpiexec",
            "mem_mb": training_memory_mb(config), "runtime": training_runtime_min(config),
            "slurm_extra": burst_buffer_sbatch_options(config)}


def training_cores(config: dict) -> int:
    """Cores of the training job, all ranks together (threads 0 counts as one per rank)."""
    return config["training"]["ranks"] * max(1, config["training"]["threads"])


def training_memory_mb(config: dict) -> int:
    """Memory per node of the training job: its ranks' model, batch and activations."""
    training = config["training"]
    activations = training["batch_size"] * sample_voxels(config) * ACTIVATION_BYTES_PER_VOXEL_CHANNEL
    per_rank = TRAINING_BASE_MEMORY_MB + activations / 1e6
    ranks_per_node = math.ceil(training["ranks"] / training["nodes"])
    return math.ceil(SAFETY * ranks_per_node * per_rank)


def training_runtime_min(config: dict) -> int:
    """Wall-clock minutes of the training job at GFLOPS_PER_CORE on every core."""
    training = config["training"]
    samples = split_samples(config)[training["train_split"]]
    flops = training["epochs"] * samples * sample_voxels(config) * PAPER_TRAINING_FLOPS_PER_VOXEL
    seconds = SAFETY * flops / (GFLOPS_PER_CORE * 1e9 * training_cores(config))
    return max(10, math.ceil(seconds / 60))
