"""Synchronous data parallelism over MPI (mpi4py) inside Keras ``fit()``.

* :class:`DataParallelModel` wraps a network; its ``train_step`` sums the weighted gradients
  of all ranks with one fused ``Allreduce`` per step on a reused NumPy buffer, so every rank
  applies the gradient of the global batch and the weights stay identical on all ranks.
* :func:`broadcast_variables` copies rank 0's variables to all ranks (``Bcast`` on one buffer
  per dtype), at the start and after a restore.
* :class:`AverageMetrics` replaces each epoch's logged metrics by their sample-weighted mean
  over ranks before any other callback sees them.
* :func:`collectively` runs a set-up step on every rank and, if it raised PipelineError on
  any, raises it on all (:class:`AllRanksError`), so bad input ends every rank cleanly.
* :func:`abort_on_failure` ends every rank (``comm.Abort(1)``) when one rank raises anything
  else, so a failure cannot leave the others waiting forever in a collective.

Without mpi4py, :class:`SerialCommunicator` stands in with one rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Iterator, Sequence, TypeVar

import keras
import numpy as np

from workflow.errors import PipelineError

log = logging.getLogger(__name__)
T = TypeVar("T")

# MPI_Abort makes the launcher kill every rank at once, and what the failing rank wrote to stderr
# just before can still sit in the pipe to the launcher's forwarder and be lost (seen with MPICH's
# Hydra, `mpiexec -n 2`, in 1 run of 16 under load). Waiting this long before aborting lets it through.
ABORT_GRACE_S = 1.0


class SerialCommunicator:
    """The subset of an mpi4py communicator that training uses, for a single process."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Allreduce(self, sendbuf, recvbuf, op=None) -> None:
        np.copyto(recvbuf, sendbuf)

    def bcast(self, obj, root: int = 0):
        return obj

    def allgather(self, obj) -> list:
        return [obj]

    def Barrier(self) -> None:
        pass


def world_communicator(comm=None):
    """``comm`` itself, else mpi4py's COMM_WORLD, else a :class:`SerialCommunicator`."""
    if comm is not None:
        return comm
    try:
        from mpi4py import MPI
    except ImportError:
        world = SerialCommunicator()
    else:
        world = MPI.COMM_WORLD
    _check_launcher_agrees(world.Get_size())
    return world


# Variables in which launchers state the number of processes they started.
LAUNCHER_SIZE_VARIABLES = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _check_launcher_agrees(world_size: int) -> None:
    """Refuse N separate one-rank worlds where the launcher started N tasks.

    ``srun`` without a PMI plugin that the MPI library understands (Slurm's default
    ``--mpi=none`` with the mpich wheel) starts N processes that each see a world of size 1;
    they would train N independent copies, each believing it is rank 0 of 1.
    """
    if world_size > 1:
        return
    for variable in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            raise PipelineError(
                f"{variable}={value} tasks were launched but this process's MPI world has size 1: "
                f"the launcher and the MPI library do not share a process-management interface "
                f"(with Slurm and the mpich wheel use `srun --mpi=pmi2`, or MpiDefault=pmi2)."
            )


def mpi_library_version(comm) -> str:
    """The MPI library's version line, or 'none' without mpi4py."""
    if isinstance(comm, SerialCommunicator):
        return "none"
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


class GradientAllreduce:
    """Sum float32 tensors over ranks with one fused Allreduce into a buffer reused every step."""

    def __init__(self, comm):
        self.comm = comm
        self._buffer: np.ndarray | None = None
        self.seconds = 0.0

    def _allreduce_into_buffer(self, flat: np.ndarray) -> np.ndarray:
        # TensorFlow may wrap the returned buffer without copying; that is safe because each
        # step consumes the sums before the next step calls this again.
        if self._buffer is None or self._buffer.shape != flat.shape:
            self._buffer = np.empty_like(flat)
        start = time.perf_counter()
        self.comm.Allreduce(flat, self._buffer)
        self.seconds += time.perf_counter() - start
        return self._buffer

    def __call__(self, tensors: Sequence):
        """The element-wise sums over ranks of ``tensors`` (graph-compatible)."""
        import tensorflow as tf

        if self.comm.Get_size() == 1:  # the sums over one rank are its own values: no copies
            return list(tensors)
        sizes = [int(np.prod(t.shape)) for t in tensors]
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)
        summed = tf.numpy_function(self._allreduce_into_buffer, [flat], tf.float32, stateful=True)
        summed = tf.ensure_shape(summed, flat.shape)
        return [tf.reshape(part, t.shape)
                for part, t in zip(tf.split(summed, sizes), tensors)]


class DataParallelModel(keras.Model):
    """``network`` trained synchronously over the ranks of ``comm``.

    Each batch is (x, y, weight). A step computes the local gradient of sum_i w_i l_i, sums it,
    the loss sum and sum_i w_i over ranks, and applies the summed gradient divided by the
    summed weight: the gradient of the weighted mean loss over the union of all ranks' batches.
    The logged loss is that same global mean.
    """

    def __init__(self, network: keras.Model, comm, **kwargs):
        super().__init__(name=f"data_parallel_{network.name}", **kwargs)
        self.network = network
        self.comm = comm
        self.allreduce = GradientAllreduce(comm)

    def call(self, inputs, training=False):
        return self.network(inputs, training=training)

    def train_step(self, data):
        import tensorflow as tf

        x, y, weight = data
        batch = tf.cast(tf.shape(x)[0], tf.float32)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            # Keras's "sum over batch size" reduction times the batch: sum_i w_i l_i
            loss_sum = batch * self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weight,
                                                  training=True)
        gradients = tape.gradient(loss_sum, self.trainable_variables)
        *gradient_sums, loss_sum, weight_sum = self.allreduce(
            gradients + [loss_sum, tf.reduce_sum(weight)])
        self.optimizer.apply_gradients(
            zip([g / weight_sum for g in gradient_sums], self.trainable_variables))
        self._loss_tracker.update_state(loss_sum / weight_sum, sample_weight=weight_sum)
        return {"loss": self._loss_tracker.result()}


def broadcast_variables(variables: Sequence, comm, root: int = 0) -> None:
    """Overwrite ``variables`` on every rank with their values on ``root`` (one Bcast per dtype)."""
    if comm.Get_size() == 1:
        return
    by_dtype: dict[np.dtype, list] = {}
    for variable in variables:
        by_dtype.setdefault(np.dtype(variable.dtype), []).append(variable)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        buffer = np.concatenate([np.asarray(v.numpy(), dtype).ravel() for v in group])
        comm.Bcast(buffer, root=root)
        offset = 0
        for variable in group:
            size = int(np.prod(variable.shape))
            variable.assign(buffer[offset:offset + size].reshape(variable.shape))
            offset += size


class AverageMetrics(keras.callbacks.Callback):
    """At each epoch's end, replace every logged value by its sample-weighted mean over ranks.

    ``train_samples(epoch)`` and ``validation_samples`` are this rank's numbers of (real)
    samples, the weights of its training and ``val_`` values. Must be the first callback.
    """

    def __init__(self, comm, train_samples, validation_samples: int = 0):
        super().__init__()
        self.comm = comm
        self.train_samples = train_samples
        self.validation_samples = validation_samples

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(logs)
        weights = np.array([self.validation_samples if k.startswith("val_")
                            else self.train_samples(epoch) for k in keys], np.float64)
        values = np.array([float(logs[k]) for k in keys], np.float64)
        local = np.concatenate([np.where(weights > 0, values * weights, 0.0), weights])
        total = np.empty_like(local)
        self.comm.Allreduce(local, total)
        for key, weighted, weight in zip(keys, total[:len(keys)], total[len(keys):]):
            logs[key] = float(weighted / weight) if weight > 0 else float("nan")


class AllRanksError(PipelineError):
    """A PipelineError raised on every rank at the same point (no rank is left waiting)."""


def collectively(comm, step: Callable[[], T]) -> T:
    """Run ``step`` on every rank; if it raises PipelineError on any, raise it on all.

    A rank that failed raises its own message; the others raise the first rank's.
    """
    try:
        result, error = step(), None
    except PipelineError as exc:
        result, error = None, str(exc)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise AllRanksError(error or errors[0])
    return result


@contextlib.contextmanager
def abort_on_failure(comm) -> Iterator[None]:
    """Run the block; if it raises on one rank of several (anything but an
    :class:`AllRanksError`), log the error and abort all ranks."""
    try:
        yield
    except AllRanksError:
        raise
    except (Exception, KeyboardInterrupt) as error:
        if comm.Get_size() > 1:
            log.critical("rank %d of %d failed, aborting all ranks: %s",
                         comm.Get_rank(), comm.Get_size(), error)
            logging.shutdown()
            time.sleep(ABORT_GRACE_S)
            comm.Abort(1)
        raise
