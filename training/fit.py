"""The fit loop of :func:`training.run.train_network`: Keras ``fit`` from the resumed position to
the last epoch, synchronous (training.distributed) or asynchronous (training.asynchronous), with
the callbacks that average the metrics over the ranks, time the epochs (:class:`Progress`), write
``history.csv``, TensorBoard events and checkpoints (training.resume.Checkpointer).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import TYPE_CHECKING

import keras
import numpy as np

from training import asynchronous
from training.distributed import AverageMetrics
from training.pipeline import training_dataset, validation_dataset
from training.resume import Checkpointer
from training.settings import straggler_delay_s
from workflow.errors import PipelineError
from workflow.logs import PROGRESS

if TYPE_CHECKING:
    from training.run import TrainingRun

log = logging.getLogger(__name__)


def fit(run: TrainingRun, model, start_epoch: int, start_step: int) -> list[dict]:
    """Run fit() from (start_epoch, start_step) to the last epoch, with the callbacks; return
    the epochs' rows of :class:`Progress` (each epoch's logs, samples/s and timings)."""
    import tensorflow as tf

    settings, plan = run.settings, run.plan
    validation, n_validation = None, 0
    if settings.validation_split:
        validation, n_validation = validation_dataset(
            run.manifest, settings.validation_split, settings.batch_size, run.rank, run.n_ranks)
    progress = Progress(run, model, start_epoch, start_step)
    shared = isinstance(model, asynchronous.AsyncDataParallelModel)

    def shard_samples(epoch: int) -> int:
        return plan.shard_samples(settings.seed, epoch, run.rank)

    callbacks = [AverageMetrics(run.comm, model.samples_of if shared else shard_samples,
                                n_validation), progress]
    if shared:  # first: the epoch's shared state, before validation and the other callbacks
        callbacks.insert(0, asynchronous.EpochBoundary(model))
    delay = straggler_delay_s()
    if delay and run.rank == run.n_ranks - 1:
        callbacks.append(asynchronous.StragglerDelay(delay))
    if run.is_writer:
        callbacks += [keras.callbacks.CSVLogger(str(run.files.history), append=True),
                      keras.callbacks.TensorBoard(str(run.files.tensorboard),
                                                  write_graph=False, update_freq="epoch")]
    callbacks.append(Checkpointer(run, model, start_epoch, start_step))
    claims = shared and model.claims_files
    try:
        for epochs, skipped in _segments(settings.epochs, start_epoch, start_step, claims):
            if claims:  # files handed out as the ranks ask: an epoch's length is not known
                data, steps = model.claimed_dataset(
                    run.manifest, settings.train_split, epochs.start, settings.seed,
                    settings.shuffle_buffer, settings.augment), None
            else:
                data = training_dataset(run.manifest, plan, settings.train_split, run.rank,
                                        settings.seed, settings.shuffle_buffer,
                                        settings.augment, epochs, skipped)
                steps = plan.steps_per_epoch - skipped
            with warnings.catch_warnings():
                if claims:  # Keras warns at the end of a data set of unknown length
                    warnings.filterwarnings("ignore", "Your input ran out of data")
                model.fit(data, initial_epoch=epochs.start, epochs=epochs.stop, verbose=0,
                          shuffle=False, steps_per_epoch=steps, validation_data=validation,
                          validation_steps=math.ceil(n_validation / settings.batch_size) or None,
                          callbacks=callbacks)
    except tf.errors.DataLossError as error:
        epoch = progress.epoch
        files = _files_of(run, epoch, model)
        listed = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        raise PipelineError(
            f"Rank {run.rank} read a corrupt TFRecord in epoch {epoch} ({_reason(error)}); "
            f"its files that epoch were {listed}; run `cosmoflow verify-data` to locate it."
        ) from error
    return progress.rows


def _segments(end: int, start_epoch: int, start_step: int, per_epoch: bool = False):
    """(epochs, steps skipped in the first) of each fit() call up to epoch ``end``: the rest of an
    interrupted epoch first (it runs fewer steps), then the remaining whole epochs (one per call
    if ``per_epoch``)."""
    if start_step and start_epoch < end:
        yield range(start_epoch, start_epoch + 1), start_step
        start_epoch += 1
    if per_epoch:
        yield from ((range(epoch, epoch + 1), 0) for epoch in range(start_epoch, end))
    elif start_epoch < end:
        yield range(start_epoch, end), 0


def _files_of(run: TrainingRun, epoch: int, model) -> list[str]:
    """Names of the training files this rank read in ``epoch``."""
    files = run.manifest.files_of(run.settings.train_split)
    if getattr(model, "claims_files", False):
        return [files[i].name for i in model.files_of(epoch)]
    return [files[i].name for i in run.plan.files_of_rank(run.settings.seed, epoch, run.rank)]


class Progress(keras.callbacks.Callback):
    """Times each epoch (without validation) and its steps, adds samples/s, the mean step time
    over all ranks and the learning rate to the logs, and logs one line per epoch on rank 0."""

    def __init__(self, run: TrainingRun, model, start_epoch: int, start_step: int):
        super().__init__()
        self.run, self.dp_model = run, model
        self.start_epoch, self.start_step = start_epoch, start_step
        self.epoch, self.rows = start_epoch, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.began, self.validation_seconds = epoch, time.perf_counter(), 0.0
        self.step_times = np.zeros(2)  # seconds inside steps, steps

    def on_train_batch_begin(self, batch, logs=None):
        self.step_began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step_times += (time.perf_counter() - self.step_began, 1)

    def on_test_begin(self, logs=None):
        self.test_began = time.perf_counter()

    def on_test_end(self, logs=None):
        self.validation_seconds += time.perf_counter() - self.test_began

    def on_epoch_end(self, epoch, logs=None):
        plan, settings = self.run.plan, self.run.settings
        seconds = time.perf_counter() - self.began - self.validation_seconds
        skipped = self.start_step if epoch == self.start_epoch else 0
        samples = plan.n_samples * (plan.steps_per_epoch - skipped) / plan.steps_per_epoch
        logs["samples_per_second"] = samples / seconds
        logs["epoch_seconds"] = seconds
        step_times = np.empty(2)
        self.run.comm.Allreduce(self.step_times, step_times)
        logs["step_seconds"] = step_times[0] / step_times[1]
        logs["learning_rate"] = float(self.dp_model.optimizer.learning_rate)
        self.rows.append({"epoch": epoch, **{k: float(v) for k, v in logs.items()}})
        if self.run.is_writer:
            metrics = ", ".join(f"{k} {float(v):.4g}" for k, v in sorted(logs.items())
                                if k not in ("samples_per_second", "epoch_seconds", "step_seconds"))
            done = [row["epoch_seconds"] for row in self.rows]
            left = (settings.epochs - epoch - 1) * sum(done) / len(done)
            log.info("epoch %d/%d: %s; %.1f samples/s (%.1f s), about %s left", epoch + 1,
                     settings.epochs, metrics, logs["samples_per_second"], seconds,
                     _duration(left), extra=PROGRESS)


def _duration(seconds: float) -> str:
    """'42 s', '7 min', '2.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _reason(error) -> str:
    """The operating message of a TensorFlow error, without the graph trace around it."""
    lines = [line.strip() for line in error.message.splitlines()]
    useful = [line for line in lines if line and not line.startswith(
        ("File ", "Graph execution error", "Detected at node", "[["))]
    return useful[0] if useful else lines[-1]
