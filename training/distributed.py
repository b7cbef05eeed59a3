"""Synchronous data parallelism over MPI (mpi4py) inside Keras ``fit()``.

* :class:`DataParallelModel` wraps a network; its ``train_step`` sums the weighted gradients
  of all ranks with one fused ``Allreduce`` per step on a reused NumPy buffer, so every rank
  applies the gradient of the global batch and the weights stay identical on all ranks.
* :func:`broadcast_variables` copies rank 0's variables to all ranks (``Bcast`` on one buffer
  per dtype), at the start and after a restore.
* :class:`AverageMetrics` replaces each epoch's logged metrics by their sample-weighted mean
  over ranks before any other callback sees them.

The communicator comes from :mod:`training.mpi` (mpi4py's, or a one-rank stand-in).
"""

from __future__ import annotations

import time
from typing import Sequence

import keras
import numpy as np


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
        gradients, loss_sum, weight_sum = summed_loss_gradients(self, data)
        *gradient_sums, loss_sum, weight_sum = self.allreduce(gradients + [loss_sum, weight_sum])
        self.optimizer.apply_gradients(
            zip([g / weight_sum for g in gradient_sums], self.trainable_variables))
        self._loss_tracker.update_state(loss_sum / weight_sum, sample_weight=weight_sum)
        return {"loss": self._loss_tracker.result()}


def summed_loss_gradients(model, data) -> tuple:
    """(graph) One rank's batch ``(x, y, w)``: the gradients of sum_i w_i l_i with respect to
    ``model``'s trainable variables, that loss sum and sum_i w_i, so that ranks (or updates)
    can add theirs before dividing (padding samples have w = 0)."""
    import tensorflow as tf

    x, y, weight = data
    batch = tf.cast(tf.shape(x)[0], tf.float32)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        # Keras's "sum over batch size" reduction times the batch: sum_i w_i l_i
        loss_sum = batch * model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weight,
                                               training=True)
    return tape.gradient(loss_sum, model.trainable_variables), loss_sum, tf.reduce_sum(weight)


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
