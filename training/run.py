"""The training stage: :func:`train_network` fits a CosmoFlow network to the run's TFRecords over MPI.

Launch one process per rank (``mpiexec -n N`` or ``srun``); every rank calls :func:`train_network` with
the same arguments. Outputs (the run's ``training/`` directory, written by rank 0 only, named
by :class:`workflow.paths.TrainingFiles`):

* ``checkpoints/epoch<E>-step<S>.h5``: weights, optimiser state, metric state and input
  position after every epoch (and every ``checkpoint_every_steps`` steps), written atomically;
  a rerun resumes from the newest one (training.checkpoints);
* ``history.csv``: one row per epoch (Keras CSVLogger): loss, val_loss, learning_rate,
  samples_per_second, epoch_seconds, step_seconds (the mean time of a training step, over all
  steps of all ranks, from Keras's on_train_batch_begin to its on_train_batch_end: fetching the
  batch, the gradient, communication and update, not the callbacks or the epoch's end); rows
  of epochs redone after a resume are replaced;
* ``tensorboard/``: TensorBoard event files (per-epoch scalars);
* ``model.keras``: the trained network (plain functional Keras model, built-in layers only);
* ``run.json``: settings, seeds, versions, ranks and threads, parameters and analytic FLOPs per
  layer, samples/s and achieved Gflop/s, allreduce time, resume position, full history, and
  ``validation``: each parameter's validation MSE against the predict-the-training-mean
  baseline's (training.validation).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

import keras
import numpy as np

from preprocessing.manifest import Manifest, load_manifest
from training import asynchronous, checkpoints, flops
from training.distributed import AverageMetrics, DataParallelModel, broadcast_variables
from training.mpi import abort_on_failure, collectively, mpi_library_version, world_communicator
from training.models import build_model
from training.optimizers import make_optimizer
from training.pipeline import (
    TrainingPlan, check_split, make_plan, training_dataset, validation_dataset, validation_file_indices,
)
from training.settings import TUNING_KEYS, TrainingSettings, straggler_delay_s
from training.validation import validation_against_mean
from workflow.errors import PipelineError
from workflow.io import atomic_path, atomic_write_text
from workflow.logs import PROGRESS
from workflow.paths import TrainingFiles
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

PAPER_TRAINING_FLOPS_128 = 69.33e9  # Mathuriya et al. 2018, Sec. V-A, batch size one


def train_network(manifest_path: str | os.PathLike, output_dir: str | os.PathLike,
          settings: TrainingSettings, comm=None,
          stage_locally: Callable[[Path, list[str]], dict] | None = None,
          supersede_other_runs: bool = False) -> dict:
    """Train ``settings.model`` on the manifest's data; return the content of ``run.json``.

    Parameters
    ----------
    manifest_path : the run's ``tfrecords/manifest.json``.
    output_dir : the run's ``training/`` directory (created).
    settings : the ``training`` section of the configuration.
    comm : mpi4py communicator; None = COMM_WORLD (a single rank without mpi4py).
    stage_locally : node-local staging (preprocessing.staging): called on every rank with the
        manifest path and the manifest-relative paths of the files that rank reads, it copies
        them and returns its report, whose ``manifest`` is the local copy's manifest.json.
        Each rank then keeps its epoch-0 shard of files for every epoch.
    supersede_other_runs : if the newest checkpoint belongs to other settings or data (the
        workflow reruns ``train`` because its inputs changed), move ``checkpoints/`` to
        ``checkpoints.superseded/`` and train afresh instead of refusing.

    Every rank must call it. Problems found before training (bad manifest, missing split, records
    that disagree with the manifest, a batch larger than a rank's shard, a checkpoint of another
    run) raise PipelineError on every rank; a failure during training on any rank aborts all.
    """
    comm = world_communicator(comm)
    manifest_path, output_dir = Path(manifest_path), Path(output_dir)
    _configure_tensorflow(settings)
    with abort_on_failure(comm):
        manifest, plan = collectively(comm, lambda: _prepare(
            manifest_path, settings, comm.Get_size(), fixed_shards=stage_locally is not None))
        staged = None
        if stage_locally is not None:
            staged = collectively(comm, lambda: stage_locally(
                manifest_path, _local_files(manifest, plan, settings, comm.Get_rank())))
            manifest = dataclasses.replace(manifest, root=Path(staged["manifest"]).parent)
        return _Training(manifest_path, manifest, plan, output_dir, settings, comm, staged,
                         supersede_other_runs).run()


def _local_files(manifest: Manifest, plan: TrainingPlan, settings: TrainingSettings, rank: int) -> list[str]:
    """Manifest-relative paths of every file ``rank`` reads: its fixed training shard and its
    validation files."""
    train = [f.path for f in manifest.files if f.split == settings.train_split]
    names = [train[i] for i in plan.files_of_rank(settings.seed, 0, rank)]
    if settings.validation_split:
        validation = [f.path for f in manifest.files if f.split == settings.validation_split]
        names += [validation[i] for i in validation_file_indices(len(validation), rank, plan.n_ranks)]
    return names


def set_tensorflow_threads(intra: int, inter: int = 0,
                           keys=("training.threads", "training.inter_op_threads")) -> None:
    """TensorFlow's intra- and inter-op threads (0: leave TensorFlow's default); they can be set
    only before TensorFlow runs anything, so otherwise a warning names the config ``keys``."""
    import tensorflow as tf

    threading = tf.config.threading
    for value, getter, setter, key in (
        (intra, threading.get_intra_op_parallelism_threads, threading.set_intra_op_parallelism_threads,
         keys[0]),
        (inter, threading.get_inter_op_parallelism_threads, threading.set_inter_op_parallelism_threads,
         keys[1]),
    ):
        if value and getter() != value:
            try:
                setter(value)
            except RuntimeError:
                log.warning("TensorFlow is already running; %s = %d not applied", key, value)


def _configure_tensorflow(settings: TrainingSettings) -> None:
    import tensorflow as tf

    set_tensorflow_threads(settings.threads, settings.inter_op_threads)
    if not _onednn_enabled() and os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0":
        log.warning("TensorFlow's oneDNN kernels are off, so Conv3D gradients run several "
                    "times slower: call workflow.process.configure_process() before importing "
                    "TensorFlow, or export TF_ENABLE_ONEDNN_OPTS=1")
    if settings.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(settings.seed)


def _prepare(manifest_path: Path, settings: TrainingSettings, n_ranks: int,
             fixed_shards: bool) -> tuple[Manifest, TrainingPlan]:
    manifest = load_manifest(manifest_path)
    for split in filter(None, (settings.train_split, settings.validation_split)):
        check_split(manifest, split, manifest_path)
    # a learning-curve point: the first simulations of the training split, as whole files
    manifest = manifest.subset(settings.train_split, settings.train_fraction, manifest_path)
    if settings.validation_split and manifest.n_samples(settings.validation_split) < n_ranks:
        raise PipelineError(
            f"Split '{settings.validation_split}' of {manifest_path} has "
            f"{manifest.n_samples(settings.validation_split)} samples, fewer than the {n_ranks} "
            f"ranks; use fewer ranks or set training.validation_split to null."
        )
    return manifest, make_plan(manifest, settings.train_split, n_ranks, settings.batch_size, fixed_shards)


class _Training:
    """State of one :func:`train_network` call (one object per rank)."""

    def __init__(self, manifest_path, manifest, plan, output_dir, settings, comm, staged=None,
                 supersede_other_runs=False):
        self.manifest_path, self.manifest, self.plan = manifest_path, manifest, plan
        self.staged, self.supersede_other_runs = staged, supersede_other_runs
        self.settings, self.comm = settings, comm
        self.rank, self.n_ranks = comm.Get_rank(), comm.Get_size()
        self.is_writer = self.rank == 0
        self.files = TrainingFiles(output_dir)

    def run(self) -> dict:
        started = _now()
        if self.is_writer:
            self.files.directory.mkdir(parents=True, exist_ok=True)
        network, model = self._build()
        cost = flops.summary(network)
        if self.is_writer:
            log.info("%s: %d parameters, %.3g Gflop per training sample (paper, 128^3: %.2f); "
                     "%d ranks x batch %d, %d steps per epoch", self.settings.model,
                     cost["parameters"], cost["training_flops_per_sample"] / 1e9,
                     PAPER_TRAINING_FLOPS_128 / 1e9, self.n_ranks, self.settings.batch_size,
                     self.plan.steps_per_epoch)
        start_epoch, start_step = self._restore(model)
        if self.is_writer:
            checkpoints.truncate_history(self.files.history, start_epoch)
        shared = isinstance(model, asynchronous.AsyncDataParallelModel)
        if shared:
            model.share(start_epoch, start_step)
        self._fit(model, start_epoch, start_step)
        asynchronous_record = model.close() if shared else None
        return self._finish(network, model, cost, started, (start_epoch, start_step),
                            asynchronous_record)

    def _build(self):
        """The network and its data-parallel, compiled wrapper, with all variables created."""
        settings = self.settings
        network = build_model(settings.model, self.manifest.shape, len(self.manifest.parameters),
                              settings.dropout, settings.precision, settings.width)
        if settings.mode == "async":
            model = asynchronous.AsyncDataParallelModel(
                network, self.comm, settings.max_staleness, settings.batch_size, self.plan,
                settings.epochs)
            optimizer = make_optimizer(settings, self.plan.steps_per_epoch, model.wrap_schedule)
        else:
            model = DataParallelModel(network, self.comm)
            optimizer = make_optimizer(settings, self.plan.steps_per_epoch)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        model(np.zeros((1,) + self.manifest.shape, np.float32))
        model.optimizer.build(model.trainable_variables)
        return network, model

    def _fit(self, model, start_epoch: int, start_step: int) -> None:
        """Run fit() from (start_epoch, start_step) to the last epoch, with the callbacks."""
        import tensorflow as tf

        settings, plan = self.settings, self.plan
        validation, n_validation = None, 0
        if settings.validation_split:
            validation, n_validation = validation_dataset(
                self.manifest, settings.validation_split, settings.batch_size, self.rank, self.n_ranks)
        self.progress = _Progress(self, model, start_epoch, start_step)
        shared = isinstance(model, asynchronous.AsyncDataParallelModel)
        callbacks = [AverageMetrics(self.comm, model.samples_of if shared else self._train_samples,
                                    n_validation), self.progress]
        if shared:  # first: the epoch's shared state, before validation and the other callbacks
            callbacks.insert(0, asynchronous.EpochBoundary(model))
        delay = straggler_delay_s()
        if delay and self.rank == self.n_ranks - 1:
            callbacks.append(asynchronous.StragglerDelay(delay))
        if self.is_writer:
            callbacks += [keras.callbacks.CSVLogger(str(self.files.history), append=True),
                          keras.callbacks.TensorBoard(str(self.files.tensorboard),
                                                      write_graph=False, update_freq="epoch")]
        metric_values = [v.numpy() for v in model.metrics_variables]
        callbacks.append(_Checkpointer(self, model, start_epoch, start_step, metric_values))
        claims = shared and model.claims_files
        try:
            for epochs, skipped in self._segments(start_epoch, start_step, claims):
                if claims:  # files handed out as the ranks ask: an epoch's length is not known
                    data, steps = model.claimed_dataset(
                        self.manifest, settings.train_split, epochs.start, settings.seed,
                        settings.shuffle_buffer, settings.augment), None
                else:
                    data = training_dataset(self.manifest, plan, settings.train_split, self.rank,
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
            epoch = self.progress.epoch
            files = self._files_of(epoch, model)
            listed = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
            raise PipelineError(
                f"Rank {self.rank} read a corrupt TFRecord in epoch {epoch} ({_reason(error)}); "
                f"its files that epoch were {listed}; run `cosmoflow verify-data` to locate it."
            ) from error

    def _segments(self, start_epoch: int, start_step: int, per_epoch: bool = False):
        """(epochs, steps skipped in the first) of each fit() call: the rest of an interrupted
        epoch first (it runs fewer steps), then the remaining whole epochs (one per call if
        ``per_epoch``)."""
        end = self.settings.epochs
        if start_step and start_epoch < end:
            yield range(start_epoch, start_epoch + 1), start_step
            start_epoch += 1
        if per_epoch:
            yield from ((range(epoch, epoch + 1), 0) for epoch in range(start_epoch, end))
        elif start_epoch < end:
            yield range(start_epoch, end), 0

    def _train_samples(self, epoch: int) -> int:
        return self.plan.shard_samples(self.settings.seed, epoch, self.rank)

    def _files_of(self, epoch: int, model=None) -> list[str]:
        files = self.manifest.files_of(self.settings.train_split)
        if getattr(model, "claims_files", False):
            return [files[i].name for i in model.files_of(epoch)]
        return [files[i].name for i in self.plan.files_of_rank(self.settings.seed, epoch, self.rank)]

    def identity(self) -> dict:
        """What a checkpoint must share with this run to be resumed by it."""
        digest = hashlib.sha256()
        for entry in self.manifest.files:
            if entry.split == self.settings.train_split:
                digest.update(entry.sha256.encode())
        return {**{f"training.{k}": v for k, v in self.settings.to_dict().items() if k not in TUNING_KEYS},
                "ranks": self.n_ranks, "fixed_shards": self.plan.fixed_shards,
                "training_data_sha256": digest.hexdigest()}

    def state(self, model) -> dict[str, list]:
        return {"model": model.variables, "optimizer": model.optimizer.variables,
                "metrics": model.metrics_variables}

    def _restore(self, model) -> tuple[int, int]:
        """Load the newest checkpoint on rank 0, then broadcast all state from rank 0."""
        def load():
            if not self.is_writer:
                return None
            try:
                return checkpoints.load_latest(self.files.checkpoints, self.identity())
            except checkpoints.OtherRunCheckpoint as error:
                if not self.supersede_other_runs:
                    raise
                superseded = self.files.superseded_checkpoints
                shutil.rmtree(superseded, ignore_errors=True)
                self.files.checkpoints.rename(superseded)
                log.warning("the checkpoints in %s belong to another run (%s); moved them to %s "
                            "and training afresh", self.files.checkpoints, error, superseded)
                return None

        checkpoint = collectively(self.comm, load)
        if checkpoint is not None:
            for group, variables in self.state(model).items():
                for variable, value in zip(variables, checkpoint.values[group], strict=True):
                    variable.assign(value)
            log.info("resuming from %s (epoch %d, step %d)", checkpoint.path, checkpoint.epoch,
                     checkpoint.step, extra=PROGRESS)
        position = self.comm.bcast((checkpoint.epoch, checkpoint.step) if checkpoint else (0, 0))
        broadcast_variables([v for vs in self.state(model).values() for v in vs], self.comm)
        return position

    def _finish(self, network, model, cost, started, resumed, asynchronous_record=None) -> dict:
        rows = self.progress.rows
        rates = [row["samples_per_second"] for row in rows]
        mean_rate = float(np.mean(rates)) if rates else None
        train_seconds = sum(row["epoch_seconds"] for row in rows)
        record = {
            "code_version": CODE_VERSION,
            "manifest": str(self.manifest_path),
            "settings": self.settings.to_dict(),
            "seed": self.settings.seed,
            "ranks": self.n_ranks,
            "threads": _threads(),
            "versions": _versions(self.comm),
            "model": {"name": self.settings.model, "input_shape": list(self.manifest.shape), **cost},
            "paper_training_flops_per_sample_128": PAPER_TRAINING_FLOPS_128,
            "global_batch": self.settings.batch_size * self.n_ranks,
            "steps_per_epoch": self.plan.steps_per_epoch,
            "train_samples": self.plan.n_samples,
            "train_simulations": len(self.manifest.simulations(self.settings.train_split)),
            "samples_per_second": mean_rate,
            "achieved_gflops": mean_rate * cost["training_flops_per_sample"] / 1e9 if rates else None,
            "mode": self.settings.mode,
            "allreduce_seconds": None if asynchronous_record else model.allreduce.seconds,
            "allreduce_fraction": (model.allreduce.seconds / train_seconds
                                   if train_seconds and not asynchronous_record else None),
            "async": asynchronous_record,
            "weights_sha256_per_rank": self.comm.allgather(_weights_digest(network)),
            "node_local_staging": self.comm.allgather(self.staged) if self.staged else None,
            "resumed_from": {"epoch": resumed[0], "step": resumed[1]} if any(resumed) else None,
            "started": started,
            "finished": _now(),
        }
        if self.settings.validation_split:
            record["validation"] = validation_against_mean(
                network, self.manifest, self.settings.train_split, self.settings.validation_split,
                self.settings.batch_size, self.comm)
            if self.is_writer:
                log.info("%s MSE / predict-the-training-mean MSE: %s; mean %.3f",
                         self.settings.validation_split, ", ".join(
                             f"{name} {score['ratio']:.3f}"
                             for name, score in record["validation"]["parameters"].items()),
                         record["validation"]["mean_ratio"], extra=PROGRESS)
        if len(set(record["weights_sha256_per_rank"])) > 1:
            log.error("the ranks' weights differ after training: %s", record["weights_sha256_per_rank"])
        if self.is_writer:
            record["history"] = _read_history(self.files.history)
            _save_network(network, self.files.model)
            atomic_write_text(self.files.run_record, json.dumps(record, indent=1) + "\n")
            log.info("training done: %s", self.files.directory, extra=PROGRESS)
        self.comm.Barrier()
        return record


class _Progress(keras.callbacks.Callback):
    """Times each epoch (without validation) and its steps, adds samples/s, the mean step time
    over all ranks and the learning rate to the logs, and logs one line per epoch on rank 0."""

    def __init__(self, training: _Training, model, start_epoch: int, start_step: int):
        super().__init__()
        self.training, self.dp_model = training, model
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
        plan, settings = self.training.plan, self.training.settings
        seconds = time.perf_counter() - self.began - self.validation_seconds
        skipped = self.start_step if epoch == self.start_epoch else 0
        samples = plan.n_samples * (plan.steps_per_epoch - skipped) / plan.steps_per_epoch
        logs["samples_per_second"] = samples / seconds
        logs["epoch_seconds"] = seconds
        step_times = np.empty(2)
        self.training.comm.Allreduce(self.step_times, step_times)
        logs["step_seconds"] = step_times[0] / step_times[1]
        logs["learning_rate"] = float(self.dp_model.optimizer.learning_rate)
        self.rows.append({"epoch": epoch, **{k: float(v) for k, v in logs.items()}})
        if self.training.is_writer:
            metrics = ", ".join(f"{k} {float(v):.4g}" for k, v in sorted(logs.items())
                                if k not in ("samples_per_second", "epoch_seconds", "step_seconds"))
            done = [row["epoch_seconds"] for row in self.rows]
            left = (settings.epochs - epoch - 1) * sum(done) / len(done)
            log.info("epoch %d/%d: %s; %.1f samples/s (%.1f s), about %s left", epoch + 1,
                     settings.epochs, metrics, logs["samples_per_second"], seconds,
                     _duration(left), extra=PROGRESS)


class _Checkpointer(keras.callbacks.Callback):
    """Checkpoint at each epoch end and every ``checkpoint_every_steps`` optimiser steps;
    restore the metric state of an epoch resumed in the middle."""

    def __init__(self, training: _Training, model, start_epoch, start_step, metric_values):
        super().__init__()
        self.training, self.dp_model = training, model
        self.start_epoch, self.start_step, self.metric_values = start_epoch, start_step, metric_values
        self.every = training.settings.checkpoint_every_steps

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.step = epoch, 0
        if epoch == self.start_epoch and self.start_step:
            self.step = self.start_step
            for variable, value in zip(self.dp_model.metrics_variables, self.metric_values):
                variable.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        iterations = int(self.dp_model.optimizer.iterations.numpy())
        if self.every and iterations % self.every == 0 and self.step < self.training.plan.steps_per_epoch:
            self._save(self.epoch, self.step)

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1, 0)

    def _save(self, epoch: int, step: int) -> None:
        if self.training.is_writer:
            state = {group: [v.numpy() for v in variables]
                     for group, variables in self.training.state(self.dp_model).items()}
            checkpoints.save(self.training.files.checkpoints, epoch, step, state,
                             self.training.identity())


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


def _save_network(network: keras.Model, path: Path) -> None:
    """``network.save`` written atomically (Keras wants the ``.keras`` suffix)."""
    with atomic_path(path, suffix=".tmp.keras") as tmp:
        keras.Model(network.inputs, network.outputs, name=network.name).save(tmp)


def _weights_digest(network: keras.Model) -> str:
    """SHA-256 of the network's weights (equal on all ranks if they stayed synchronised)."""
    digest = hashlib.sha256()
    for weight in network.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()


def _read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as handle:
        return [{k: float(v) if v not in ("", "NA") else None for k, v in row.items()}
                for row in csv.DictReader(handle)]


def _onednn_enabled() -> bool:
    """Whether TensorFlow runs its oneDNN kernels (see workflow/process.py)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def _threads() -> dict:
    import tensorflow as tf

    return {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            "cpu_count": os.cpu_count(), "onednn": _onednn_enabled()}


def _versions(comm) -> dict:
    import h5py
    import tensorflow as tf

    try:
        import mpi4py
        mpi4py_version = mpi4py.__version__
    except ImportError:
        mpi4py_version = None
    return {"python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras.__version__, "numpy": np.__version__, "h5py": h5py.__version__,
            "mpi4py": mpi4py_version, "mpi": mpi_library_version(comm)}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
