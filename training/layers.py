"""The project's own Keras layers and loss: a leaky ReLU that TensorFlow can fuse with the
convolution before it during training, and the Gaussian posterior head and its loss.

Leaky ReLU
----------

f(x) = x for x > 0, slope * x otherwise; f'(x) = 1 for x > 0, slope otherwise. Keras's
``LeakyReLU`` takes its gradient from the input x, the output of the preceding BiasAdd, which
must then be kept for the backward pass. TensorFlow's graph optimiser (grappler's remapper) can
replace Conv3D + BiasAdd + LeakyRelu by one oneDNN operation only when nothing else reads the
BiasAdd output, so in training it gives up ("remapper failed: ... fanout LeakyReluGrad exist for
missing node BiasAdd") and runs the activation and its gradient as separate passes over memory.

:class:`LeakyReLU` computes the same function and the same gradient, from the output y instead:
for a slope >= 0, y > 0 exactly where x > 0, so f'(x) = 1 where y > 0 and slope elsewhere.

Gaussian posterior (config ``training.head: gaussian``, training.models)
----------------------------------------------------------------------
Per sample, P means mu and the P(P+1)/2 entries of the lower-triangular Cholesky factor L of the
covariance Sigma = L L^T, packed as [mu_1 .. mu_P, L_11, L_21, L_22, L_31, L_32, L_33, ...]
(L row by row, :func:`cholesky_index`), in scaled target units. :class:`GaussianPosterior` turns
a Dense layer's P + P(P+1)/2 outputs into that vector (mean through ``mean_scale`` x tanh or
linear, diagonal through softplus + :data:`CHOLESKY_FLOOR`, off-diagonal as they are);
:class:`PosteriorMean` keeps the means; :class:`GaussianNLL` is the negative log-likelihood of
the targets under N(mu, Sigma), through a triangular solve (no inverse, no determinant).

Every class here is registered with Keras (``cosmoflow>...``); a saved network
(``model.keras``) loads once this module is imported (``training.models`` imports it).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

CHOLESKY_FLOOR = 1e-3
"""Smallest diagonal entry of the Cholesky factor, in scaled target units (a standard deviation
of 1e-3 of half a parameter's sampling range): keeps Sigma invertible and the loss's gradient,
which grows as 1 / L_pp^2, bounded in float32."""


@keras.saving.register_keras_serializable(package="cosmoflow")
class LeakyReLU(keras.layers.LeakyReLU):
    """Keras's ``LeakyReLU`` (same arguments, same outputs and gradients) whose gradient reads
    its output, not its input."""

    def call(self, inputs):
        return leaky_relu(inputs, self.negative_slope)


def leaky_relu(x, slope: float):
    """``tf.nn.leaky_relu(x, slope)`` for a slope >= 0, differentiated through its output."""

    @tf.custom_gradient
    def forward(x):
        y = tf.nn.leaky_relu(x, alpha=slope)

        def gradient(dy):  # dy where y > 0, slope * dy elsewhere
            return tf.raw_ops.LeakyReluGrad(gradients=dy, features=y, alpha=slope)

        return y, gradient

    return forward(x)


def cholesky_index(n_targets: int) -> np.ndarray:
    """(P, P) positions in the packed Cholesky entries [L_11, L_21, L_22, L_31, ...] of each
    L_ij; above the diagonal, P(P+1)/2: one past the entries, where a zero is appended."""
    rows, columns = np.tril_indices(n_targets)
    index = np.full((n_targets, n_targets), len(rows))
    index[rows, columns] = np.arange(len(rows))
    return index


def cholesky_factor(entries, n_targets: int):
    """(..., P, P) lower-triangular L from its packed entries (..., P(P+1)/2), TensorFlow."""
    padded = tf.concat([entries, tf.zeros_like(entries[..., :1])], axis=-1)
    return tf.gather(padded, cholesky_index(n_targets), axis=-1)


@keras.saving.register_keras_serializable(package="cosmoflow")
class GaussianPosterior(keras.layers.Layer):
    """A Dense layer's P + P(P+1)/2 outputs -> packed [mu, Cholesky entries] (module docstring):
    mu = ``mean_scale`` tanh(z) (None: mu = z), L_pp = softplus(z) + ``floor``, L_ij (i > j) = z."""

    def __init__(self, n_targets: int, mean_scale: float | None = None,
                 floor: float = CHOLESKY_FLOOR, **kwargs):
        super().__init__(**kwargs)
        self.n_targets, self.mean_scale, self.floor = int(n_targets), mean_scale, float(floor)
        rows, columns = np.tril_indices(self.n_targets)
        self.diagonal = rows == columns  # which packed entries are L_pp

    def call(self, inputs):
        mean, entries = inputs[..., :self.n_targets], inputs[..., self.n_targets:]
        if self.mean_scale is not None:
            mean = self.mean_scale * tf.tanh(mean)
        entries = tf.where(self.diagonal, tf.nn.softplus(entries) + self.floor, entries)
        return tf.concat([mean, entries], axis=-1)

    def get_config(self) -> dict:
        return {**super().get_config(), "n_targets": self.n_targets,
                "mean_scale": self.mean_scale, "floor": self.floor}


@keras.saving.register_keras_serializable(package="cosmoflow")
class PosteriorMean(keras.layers.Layer):
    """The means mu, the first ``n_targets`` entries of a :class:`GaussianPosterior` output."""

    def __init__(self, n_targets: int, **kwargs):
        super().__init__(**kwargs)
        self.n_targets = int(n_targets)

    def call(self, inputs):
        return inputs[..., :self.n_targets]

    def get_config(self) -> dict:
        return {**super().get_config(), "n_targets": self.n_targets}


@keras.saving.register_keras_serializable(package="cosmoflow")
class GaussianNLL(keras.losses.Loss):
    """-log N(y; mu, L L^T) per sample of targets y (..., P) and a :class:`GaussianPosterior`
    output (..., P + P(P+1)/2), in nats, float32:

        0.5 |z|^2 + sum_p log L_pp + 0.5 P log(2 pi),   L z = y - mu (triangular solve).

    The constant makes it the exact negative log-density (scipy.stats.multivariate_normal)."""

    def __init__(self, name: str = "gaussian_nll", reduction: str = "sum_over_batch_size", **kwargs):
        super().__init__(name=name, reduction=reduction, dtype="float32")

    def call(self, y_true, y_pred):
        y, packed = tf.cast(y_true, tf.float32), tf.cast(y_pred, tf.float32)
        n = y.shape[-1]
        factor = cholesky_factor(packed[..., n:], n)
        z = tf.linalg.triangular_solve(factor, (y - packed[..., :n])[..., None], lower=True)[..., 0]
        return (0.5 * tf.reduce_sum(tf.square(z), axis=-1)
                + tf.reduce_sum(tf.math.log(tf.linalg.diag_part(factor)), axis=-1)
                + 0.5 * n * math.log(2 * math.pi))
