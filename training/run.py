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
* ``model.keras``: the trained network (a functional Keras model; its leaky ReLU is
  ``training.layers.LeakyReLU``, registered when ``training.models`` is imported), which
  outputs the P scaled targets; with ``training.head: gaussian`` these are the posterior means
  and ``training.models.posterior_network`` gives the covariances too;
* ``run.json``: settings, seeds, versions, ranks and threads, parameters and analytic FLOPs per
  layer, samples/s and achieved Gflop/s, allreduce time, resume position, full history, and
  ``validation``: each parameter's validation MSE against the predict-the-training-mean
  baseline's (training.validation).

Here: the data plan and each rank's files, the network, and the run's course; resuming from a
checkpoint in training.resume, the fit loop in training.fit, ``run.json`` and ``model.keras`` in
training.record.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Callable

import keras
import numpy as np

from preprocessing.manifest import Manifest, load_manifest
from training import asynchronous, checkpoints, flops
from training.distributed import DataParallelModel
from training.fit import fit
from training.models import build_model, loss
from training.mpi import abort_on_failure, collectively, world_communicator
from training.optimizers import make_optimizer
from training.pipeline import TrainingPlan, check_split, make_plan, validation_file_indices
from training.record import PAPER_TRAINING_FLOPS_128, now, onednn_enabled, write_run_record
from training.resume import restore
from training.settings import TrainingSettings
from workflow.errors import PipelineError
from workflow.paths import TrainingFiles

log = logging.getLogger(__name__)


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
        run = TrainingRun(manifest_path, manifest, plan, settings, comm, TrainingFiles(output_dir),
                          staged)
        return _train(run, supersede_other_runs)


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
    if not onednn_enabled() and os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0":
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


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """One rank's view of one :func:`train_network` call: what it trains on, how, with which
    ranks, and where rank 0 writes (training.resume, training.fit and training.record read it)."""

    manifest_path: Path
    manifest: Manifest
    plan: TrainingPlan
    settings: TrainingSettings
    comm: object  # mpi4py communicator (training.mpi.world_communicator)
    files: TrainingFiles
    staged: dict | None = None  # this rank's node-local staging report

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def n_ranks(self) -> int:
        return self.comm.Get_size()

    @property
    def is_writer(self) -> bool:
        return self.rank == 0


def _train(run: TrainingRun, supersede_other_runs: bool) -> dict:
    """Build the network, restore the newest checkpoint, fit, and write the run record."""
    started = now()
    if run.is_writer:
        run.files.directory.mkdir(parents=True, exist_ok=True)
    network, model = _build(run)
    cost = flops.summary(network)
    if run.is_writer:
        log.info("%s: %d parameters, %.3g Gflop per training sample (paper, 128^3: %.2f); "
                 "%d ranks x batch %d, %d steps per epoch", run.settings.model,
                 cost["parameters"], cost["training_flops_per_sample"] / 1e9,
                 PAPER_TRAINING_FLOPS_128 / 1e9, run.n_ranks, run.settings.batch_size,
                 run.plan.steps_per_epoch)
    start_epoch, start_step = restore(run, model, supersede_other_runs)
    if run.is_writer:
        checkpoints.truncate_history(run.files.history, start_epoch)
    shared = isinstance(model, asynchronous.AsyncDataParallelModel)
    if shared:
        model.share(start_epoch, start_step)
    rows = fit(run, model, start_epoch, start_step)
    asynchronous_record = model.close() if shared else None
    return write_run_record(run, network, model, cost, rows, started, (start_epoch, start_step),
                            asynchronous_record)


def _build(run: TrainingRun):
    """The network and its data-parallel, compiled wrapper, with all variables created."""
    settings, manifest = run.settings, run.manifest
    network = build_model(settings.model, manifest.shape, len(manifest.parameters),
                          settings.dropout, settings.precision, settings.width, settings.head)
    if settings.mode == "async":
        model = asynchronous.AsyncDataParallelModel(
            network, run.comm, settings.max_staleness, settings.batch_size, run.plan,
            settings.epochs)
        optimizer = make_optimizer(settings, run.plan.steps_per_epoch, model.wrap_schedule)
    else:
        model = DataParallelModel(network, run.comm)
        optimizer = make_optimizer(settings, run.plan.steps_per_epoch)
    model.compile(optimizer=optimizer, loss=loss(settings.head), jit_compile=False)
    model(np.zeros((1,) + manifest.shape, np.float32))
    model.optimizer.build(model.trainable_variables)
    return network, model
