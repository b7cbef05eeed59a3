"""The ``train`` rule's job: read the config and ``staged/staged.json``, then :func:`training.run.train`.

Run one process per MPI rank (``mpiexec -n N cosmoflow train`` or ``srun --mpi=pmi2 ...``).
For the in-job staging modes (DESIGN.md, "Execution") the copy happens here, inside the job
that owns the burst buffer or the node-local disk: ``burst_buffer`` is staged by rank 0 into
$DW_JOB_STRIPED (or the configured target) before training starts; ``node_local`` by every rank,
each copying only the files of its fixed shard.
"""

from __future__ import annotations

import logging
from pathlib import Path

from preprocessing import staging
from training.distributed import collectively, world_communicator
from training.run import train
from training.settings import TrainingSettings
from workflow.config import run_directory
from workflow.paths import RunLayout

log = logging.getLogger(__name__)

LAUNCH_KEYS = ("ranks", "nodes")  # training config keys that the job launcher uses


def training_settings(config: dict) -> TrainingSettings:
    """The :class:`TrainingSettings` of a validated configuration."""
    section = {k: v for k, v in config["training"].items() if k not in LAUNCH_KEYS}
    return TrainingSettings.from_mapping(section)


def run_training_stage(config: dict) -> dict:
    """Train on the data set that the ``stage`` rule recorded; return run.json's content."""
    run = RunLayout(run_directory(config))
    settings = training_settings(config)
    comm = world_communicator()
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    if n_ranks != config["training"]["ranks"] and rank == 0:
        log.warning("training.ranks = %d but %d MPI ranks were started; training with %d",
                    config["training"]["ranks"], n_ranks, n_ranks)
    record = staging.load_staged_record(run.staged_record)
    manifest = Path(record["manifest"])
    stage_locally = None
    if record["mode"] == "burst_buffer":
        # collectively() returns once rank 0's copy is complete on every rank
        manifest = Path(collectively(comm, lambda: _stage_burst_buffer(config, rank))["manifest"])
    elif record["mode"] == "node_local":
        def stage_locally(manifest_path: Path, names: list[str]) -> dict:
            return staging.stage_files(manifest_path, staging.resolve_target(config, rank=rank),
                                       names=names, workers=config["staging"]["workers"],
                                       progress=False)
    # Snakemake reruns train after a kill (resume) or because its inputs changed (start afresh)
    return train(manifest, run.training, settings, comm, stage_locally=stage_locally,
                 supersede_other_runs=True)


def _stage_burst_buffer(config: dict, rank: int) -> dict:
    """Rank 0 copies (or verifies what ``#DW stage_in`` put there); every rank gets the report."""
    if rank != 0:
        return {"manifest": str(staging.resolve_target(config) / "manifest.json")}
    run = RunLayout(run_directory(config))
    return staging.stage_files(run.manifest, staging.resolve_target(config),
                               workers=config["staging"]["workers"])
