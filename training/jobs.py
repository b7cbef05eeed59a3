"""The ``train`` stage's job: the data set that the ``stage`` job recorded, then
:func:`training.run.train_network`.

Run one process per MPI rank (``mpiexec -n N cosmoflow train ...`` or ``srun --mpi=pmi2 ...``).
For the in-job staging modes (docs/execution.md, "Staging modes") the copy happens here, inside the job
that owns the burst buffer or the node-local disk: ``burst_buffer`` is staged by rank 0 into
$DW_JOB_STRIPED (or the configured target) before training starts; ``node_local`` by every rank,
each copying only the files of its fixed shard.

Keras and TensorFlow are imported only once the launch has been checked, so a job started the
wrong way (``srun --mpi=none``) fails in a second, not after TensorFlow's start-up.
"""

from __future__ import annotations

import logging
from pathlib import Path

from training.settings import TUNING_KEYS as TUNING_KEYS  # the train stage's tuning keys
from workflow.paths import DatasetFiles, RunLayout

log = logging.getLogger(__name__)


def train(run: RunLayout, config) -> dict:
    """Train on the data set that the ``stage`` job recorded; return run.json's content."""
    from preprocessing import staging
    from training.mpi import collectively, world_communicator

    comm = world_communicator()
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    if n_ranks != config["training"]["ranks"] and rank == 0:
        log.warning("training.ranks = %d but %d MPI ranks were started; training with %d",
                    config["training"]["ranks"], n_ranks, n_ranks)
    from training.run import train_network
    from training.settings import TrainingSettings

    settings = TrainingSettings.from_mapping(config["training"].plain())
    section = config["staging"]
    record = staging.load_staged_record(run.staged_record)
    manifest = Path(record["manifest"])
    if record["mode"] == "burst_buffer":
        # collectively() returns once rank 0's copy is complete on every rank
        manifest = Path(collectively(comm, lambda: _stage_burst_buffer(run, section, rank))["manifest"])

    def stage_locally(manifest_path: Path, names: list[str]) -> dict:
        """Node-local staging: this rank's own files, to its own directory."""
        target = staging.resolve_target(section, run, rank=rank, mode="node_local")
        return staging.stage_files(manifest_path, target, names=names, workers=section["workers"],
                                   progress=False)

    # Snakemake reruns train after a kill (resume) or because its inputs changed (start afresh)
    return train_network(manifest, run.training, settings, comm, supersede_other_runs=True,
               stage_locally=stage_locally if record["mode"] == "node_local" else None)


def _stage_burst_buffer(run: RunLayout, section, rank: int) -> dict:
    """Rank 0 copies (or verifies what ``#DW stage_in`` put there); every rank gets the report."""
    from preprocessing import staging

    target = staging.resolve_target(section, run, mode="burst_buffer")
    if rank != 0:
        return {"manifest": str(DatasetFiles(target).manifest)}
    return staging.stage_files(run.manifest, target, workers=section["workers"])
