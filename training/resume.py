"""Resuming a run of :func:`training.run.train_network` from its checkpoints.

What a checkpoint must share with the run that resumes it (:func:`identity`), the state it holds
(:func:`training_state`), restoring that state on every rank (:func:`restore`), and the callback
that writes a checkpoint after every epoch and every ``checkpoint_every_steps`` optimiser steps
(:class:`Checkpointer`). The files themselves are written and read by training.checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from typing import TYPE_CHECKING

import keras

from training import checkpoints
from training.distributed import broadcast_variables
from training.mpi import collectively
from training.settings import TUNING_KEYS
from workflow.logs import PROGRESS

if TYPE_CHECKING:
    from training.run import TrainingRun

log = logging.getLogger(__name__)


def identity(run: TrainingRun) -> dict:
    """What a checkpoint must share with this run to be resumed by it."""
    digest = hashlib.sha256()
    for entry in run.manifest.files:
        if entry.split == run.settings.train_split:
            digest.update(entry.sha256.encode())
    return {**{f"training.{k}": v for k, v in run.settings.to_dict().items() if k not in TUNING_KEYS},
            "ranks": run.n_ranks, "fixed_shards": run.plan.fixed_shards,
            "training_data_sha256": digest.hexdigest()}


def training_state(model) -> dict[str, list]:
    """The variables a checkpoint holds, by group (training.checkpoints.GROUPS)."""
    return {"model": model.variables, "optimizer": model.optimizer.variables,
            "metrics": model.metrics_variables}


def restore(run: TrainingRun, model, supersede_other_runs: bool) -> tuple[int, int]:
    """Load the newest checkpoint on rank 0, then broadcast all state from rank 0; return the
    (epoch, step) to resume from ((0, 0) without a checkpoint).

    A checkpoint of another run raises training.checkpoints.OtherRunCheckpoint, unless
    ``supersede_other_runs``: then ``checkpoints/`` moves to ``checkpoints.superseded/``, with
    that run's ``history.csv``.
    """
    files = run.files

    def load():
        if not run.is_writer:
            return None
        try:
            return checkpoints.load_latest(files.checkpoints, identity(run))
        except checkpoints.OtherRunCheckpoint as error:
            if not supersede_other_runs:
                raise
            superseded = files.superseded_checkpoints
            shutil.rmtree(superseded, ignore_errors=True)
            files.checkpoints.rename(superseded)
            if files.history.exists():  # its rows would go on under the other run's header
                files.history.rename(superseded / files.history.name)
            log.warning("the checkpoints in %s belong to another run (%s); moved them to %s "
                        "and training afresh", files.checkpoints, error, superseded)
            return None

    checkpoint = collectively(run.comm, load)
    if checkpoint is not None:
        for group, variables in training_state(model).items():
            for variable, value in zip(variables, checkpoint.values[group], strict=True):
                variable.assign(value)
        log.info("resuming from %s (epoch %d, step %d)", checkpoint.path, checkpoint.epoch,
                 checkpoint.step, extra=PROGRESS)
    position = run.comm.bcast((checkpoint.epoch, checkpoint.step) if checkpoint else (0, 0))
    broadcast_variables([v for vs in training_state(model).values() for v in vs], run.comm)
    return position


class Checkpointer(keras.callbacks.Callback):
    """Checkpoint at each epoch end and every ``checkpoint_every_steps`` optimiser steps;
    restore the metric state of an epoch resumed in the middle (the state :func:`restore` left
    in ``model`` when this callback is made)."""

    def __init__(self, run: TrainingRun, model, start_epoch: int, start_step: int):
        super().__init__()
        self.run, self.dp_model = run, model
        self.start_epoch, self.start_step = start_epoch, start_step
        self.metric_values = [v.numpy() for v in model.metrics_variables]
        self.every = run.settings.checkpoint_every_steps

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.step = epoch, 0
        if epoch == self.start_epoch and self.start_step:
            self.step = self.start_step
            for variable, value in zip(self.dp_model.metrics_variables, self.metric_values):
                variable.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        iterations = int(self.dp_model.optimizer.iterations.numpy())
        if self.every and iterations % self.every == 0 and self.step < self.run.plan.steps_per_epoch:
            self._save(self.epoch, self.step)

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1, 0)

    def _save(self, epoch: int, step: int) -> None:
        if self.run.is_writer:
            state = {group: [v.numpy() for v in variables]
                     for group, variables in training_state(self.dp_model).items()}
            checkpoints.save(self.run.files.checkpoints, epoch, step, state, identity(self.run))
