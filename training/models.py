"""The two CosmoFlow networks, built for the sample shape recorded in the manifest.

* ``cosmoflow_paper``: the SC18 network (Mathuriya et al. 2018, Sec. III-A, Fig. 2): seven
  Conv3D layers (output channels multiples of 16, 'valid' padding), stride-2 average pooling
  after the first three, leaky ReLU (slope 0.01) after every hidden layer, no batch-norm, and
  three dense layers (2048, 256, n_targets). At 128^3 x 1 it has 7,041,443 parameters (paper:
  "slightly more than seven million", 28.15 MB).
* ``mlperf``: the MLPerf HPC CosmoFlow reference: five Conv3D (k = 3, 'same', 32 * 2^i
  channels) each followed by 2x max pooling, leaky ReLU (0.3), dense 128 and 64 with dropout,
  and a tanh output multiplied by 1.2, so that the targets, scaled to [-1, 1] over their
  sampling ranges, are reached without saturating tanh. 8.9 M parameters at 128^3 x 4.

Both adapt to the input: a layer whose output would be smaller than ``MIN_SIZE`` voxels per
side runs with 'same' padding and stride 1 instead, and a pooling that would do so is skipped;
for inputs larger than 128^3 the paper network average-pools after its last convolution until
at most 3 voxels per side remain, which keeps the first dense layer's size bounded.
Every layer but the output takes the precision policy (``float32`` or ``mixed_bfloat16``); the
output is float32. ``width`` (config ``training.width``, a sweep knob) multiplies every
convolution's output channels; 1 gives the published networks.

The posterior head (config ``training.head``, :data:`HEADS`):

* ``point`` (the default, the published networks): the output layer gives the P scaled targets
  (each parameter mapped to [-1, 1] over its sampling range), trained on their mean squared error.
* ``gaussian``: per sample a Gaussian posterior N(mu, Sigma) over the P parameters. The last
  Dense layer gives P + P(P+1)/2 numbers: the means mu (through the network's own output
  function: 1.2 tanh for ``mlperf``, linear for ``cosmoflow_paper``) and the lower-triangular
  Cholesky factor L of Sigma = L L^T, row by row, its diagonal through softplus plus a floor of
  :data:`training.layers.CHOLESKY_FLOOR` (:class:`training.layers.GaussianPosterior`). Softplus is exp(x) for
  small entries (a log-standard-deviation) but linear for large ones, so a large activation
  never overflows; the floor keeps Sigma invertible in float32. The loss is the negative
  log-likelihood (:class:`training.layers.GaussianNLL`; Nix & Weigend 1994 with one parameter,
  here with the full covariance through its Cholesky factor),

      -log N(y; mu, L L^T) = 0.5 |L^-1 (y - mu)|^2 + sum_p log L_pp + 0.5 P log(2 pi),

  per sample, in float32 whatever the precision policy. The network built for training outputs
  the packed P + P(P+1)/2 numbers (:func:`posterior_moments` unpacks them);
  :func:`mean_network` gives the same network with the means as its only output: what
  ``training/model.keras`` holds and the validation figures and the analysis stage read, so a
  posterior network is a drop-in point estimator. :func:`posterior_network` recovers the packed
  output from it (model.keras keeps the whole last layer), and :func:`physical_moments`
  converts the moments from scaled targets to physical units.

Every leaky ReLU is :class:`training.layers.LeakyReLU`: Keras's function and gradient, the
gradient taken from its output, so that TensorFlow fuses each convolution with its bias and
activation in training too.
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
from keras import layers

from training.layers import GaussianNLL, GaussianPosterior, LeakyReLU, PosteriorMean, cholesky_index
from workflow.errors import PipelineError

HEADS = ("point", "gaussian")
"""What the network outputs per sample (config ``training.head``; see the module docstring)."""
POSTERIOR_LAYER = "posterior"
"""Name of the gaussian head's output layer (packed means and Cholesky entries)."""

MIN_SIZE = 2
"""Fewest voxels per side a convolution or pooling may leave."""

PAPER_CONVOLUTIONS = (  # (output channels, kernel, stride, average pooling after it)
    (16, 3, 1, True), (32, 4, 1, True), (64, 4, 1, True), (128, 3, 2, False),
    (256, 3, 1, False), (256, 2, 1, False), (256, 2, 1, False),
)
PAPER_DENSE = (2048, 256)
PAPER_LEAK = 0.01  # NERSC/CosmoFlow hyper-parameters (LEAK_PARAMETER)

MLPERF_BASE_CHANNELS = 32
MLPERF_CONVOLUTIONS = 5
MLPERF_DENSE = (128, 64)
MLPERF_LEAK = 0.3
MLPERF_OUTPUT_SCALE = 1.2

DEFAULT_DROPOUT = {"cosmoflow_paper": 0.0, "mlperf": 0.5}  # config training.dropout: null


def _channels(filters: int, width: float) -> int:
    """Output channels of a convolution of ``filters`` channels at ``width`` (at least 1)."""
    return max(1, round(filters * width))


def _valid_output(size: int, kernel: int, stride: int) -> int:
    """Voxels per side after a 'valid' convolution or pooling of ``size`` voxels."""
    return (size - kernel) // stride + 1


def _dense_head(x, units: Sequence[int], leak: float, dropout: float, dtype):
    for index, n in enumerate(units, 1):
        x = layers.Dense(n, name=f"dense{index}", dtype=dtype)(x)
        x = LeakyReLU(leak, name=f"dense{index}_act", dtype=dtype)(x)
        if dropout > 0:
            x = layers.Dropout(dropout, name=f"dense{index}_dropout", dtype=dtype)(x)
    return x


def _gaussian_output(x, n_targets: int, mean_scale: float | None):
    """The gaussian head: one float32 Dense layer of P + P(P+1)/2 units, then GaussianPosterior."""
    x = layers.Dense(n_targets + n_targets * (n_targets + 1) // 2, name="posterior_dense",
                     dtype="float32")(x)
    return GaussianPosterior(n_targets, mean_scale, name=POSTERIOR_LAYER, dtype="float32")(x)


def cosmoflow_paper(input_shape: Sequence[int], n_targets: int, dropout: float = 0.0,
                    dtype: str = "float32", width: float = 1.0, head: str = "point") -> keras.Model:
    """The SC18 CosmoFlow network for samples of ``input_shape`` (n, n, n, channels)."""
    inputs = keras.Input(shape=tuple(input_shape), name="density")
    x, size = inputs, int(input_shape[0])
    for index, (filters, kernel, stride, pool) in enumerate(PAPER_CONVOLUTIONS, 1):
        padding = "valid"
        if _valid_output(size, kernel, stride) >= MIN_SIZE:
            size = _valid_output(size, kernel, stride)
        else:
            padding, stride = "same", 1
        x = layers.Conv3D(_channels(filters, width), kernel, strides=stride, padding=padding,
                          name=f"conv{index}", dtype=dtype)(x)
        x = LeakyReLU(PAPER_LEAK, name=f"conv{index}_act", dtype=dtype)(x)
        if pool and size // 2 >= MIN_SIZE:
            x = layers.AveragePooling3D(2, name=f"pool{index}", dtype=dtype)(x)
            size //= 2
    extra = 0
    while size > 3:
        extra += 1
        x = layers.AveragePooling3D(2, name=f"pool_extra{extra}", dtype=dtype)(x)
        size //= 2
    x = layers.Flatten(name="flatten", dtype=dtype)(x)
    x = _dense_head(x, PAPER_DENSE, PAPER_LEAK, dropout, dtype)
    if head == "gaussian":
        outputs = _gaussian_output(x, n_targets, None)
    else:
        outputs = layers.Dense(n_targets, name="targets", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="cosmoflow_paper")


def mlperf(input_shape: Sequence[int], n_targets: int, dropout: float = 0.5,
           dtype: str = "float32", width: float = 1.0, head: str = "point") -> keras.Model:
    """The MLPerf HPC CosmoFlow network for samples of ``input_shape`` (n, n, n, channels)."""
    inputs = keras.Input(shape=tuple(input_shape), name="density")
    x, size = inputs, int(input_shape[0])
    for index in range(1, MLPERF_CONVOLUTIONS + 1):
        x = layers.Conv3D(_channels(MLPERF_BASE_CHANNELS * 2 ** (index - 1), width), 3, padding="same",
                          name=f"conv{index}", dtype=dtype)(x)
        x = LeakyReLU(MLPERF_LEAK, name=f"conv{index}_act", dtype=dtype)(x)
        if size // 2 >= MIN_SIZE:
            x = layers.MaxPooling3D(2, name=f"pool{index}", dtype=dtype)(x)
            size //= 2
    x = layers.Flatten(name="flatten", dtype=dtype)(x)
    x = _dense_head(x, MLPERF_DENSE, MLPERF_LEAK, dropout, dtype)
    if head == "gaussian":
        return keras.Model(inputs, _gaussian_output(x, n_targets, MLPERF_OUTPUT_SCALE), name="mlperf")
    x = layers.Dense(n_targets, activation="tanh", name="targets_tanh", dtype="float32")(x)
    outputs = layers.Rescaling(MLPERF_OUTPUT_SCALE, name="targets", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="mlperf")


def build_model(name: str, input_shape: Sequence[int], n_targets: int,
                dropout: float | None = None, precision: str = "float32",
                width: float = 1.0, head: str = "point") -> keras.Model:
    """Build model ``name`` (config ``training.model``) for samples of ``input_shape``.

    ``dropout`` None takes the model's own default (DEFAULT_DROPOUT); ``precision`` is a Keras
    dtype policy, 'float32' or 'mixed_bfloat16'; ``width`` multiplies the convolutions' channels;
    ``head`` (one of :data:`HEADS`) what it outputs: P scaled targets, or with 'gaussian' the
    packed P + P(P+1)/2 posterior moments (train it on :func:`loss` (head)).
    """
    builders = {"cosmoflow_paper": cosmoflow_paper, "mlperf": mlperf}
    if name not in builders:
        raise PipelineError(f"training.model = {name!r} is not one of {list(builders)}.")
    if head not in HEADS:
        raise PipelineError(f"training.head = {head!r} is not one of {list(HEADS)}.")
    if len(input_shape) != 4 or len(set(input_shape[:3])) != 1:
        raise PipelineError(f"Sample shape {list(input_shape)} is not [n, n, n, channels].")
    rate = DEFAULT_DROPOUT[name] if dropout is None else float(dropout)
    return builders[name](input_shape, n_targets, rate, keras.DTypePolicy(precision), width, head)


def loss(head: str):
    """The training loss of a network with ``head``: mean squared error or :class:`GaussianNLL`."""
    return GaussianNLL() if head == "gaussian" else "mse"


def _is_posterior(network: keras.Model) -> bool:
    return isinstance(network.layers[-1], GaussianPosterior)


def mean_network(network: keras.Model) -> keras.Model:
    """``network`` with the posterior means as its only output (N, P), the same layers and
    weights: a point estimator, what ``model.keras`` holds. A point network as it is."""
    if not _is_posterior(network):
        return network
    n_targets = network.layers[-1].n_targets
    means = PosteriorMean(n_targets, name="targets", dtype="float32")(network.output)
    return keras.Model(network.inputs, means, name=network.name)


def posterior_network(network: keras.Model) -> keras.Model:
    """The packed posterior moments (N, P + P(P+1)/2) of a gaussian-head network, or of its
    :func:`mean_network` (a loaded ``model.keras``): feed its outputs to :func:`posterior_moments`."""
    return keras.Model(network.inputs, network.get_layer(POSTERIOR_LAYER).output, name=network.name)


def posterior_moments(outputs) -> tuple[np.ndarray, np.ndarray]:
    """(means (N, P), covariances (N, P, P)) of packed posterior outputs (N, P + P(P+1)/2),
    float64, in scaled target units: Sigma = L L^T (training.layers, Gaussian posterior)."""
    outputs = np.asarray(outputs, np.float64)
    width = outputs.shape[-1]
    n_targets = round((np.sqrt(9 + 8 * width) - 3) / 2)  # P + P(P+1)/2 = width
    if n_targets + n_targets * (n_targets + 1) // 2 != width:
        raise ValueError(f"{width} outputs are not P means and P(P+1)/2 Cholesky entries.")
    entries = np.concatenate([outputs[:, n_targets:], np.zeros((len(outputs), 1))], axis=1)
    factor = entries[:, cholesky_index(n_targets)]
    return outputs[:, :n_targets], factor @ np.swapaxes(factor, 1, 2)


def physical_moments(means, covariances, low, high) -> tuple[np.ndarray, np.ndarray]:
    """:func:`posterior_moments` in physical units, for parameters sampled in [``low``, ``high``]
    (``Manifest.target_bounds()``). The scaling is affine per parameter, y = low + (s + 1) h with
    h = (high - low) / 2, so means map as the targets do (``Manifest.unscale_targets``) and
    Sigma_pq by h_p h_q."""
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    half = (high - low) / 2
    return low + (np.asarray(means) + 1) * half, np.asarray(covariances) * np.outer(half, half)
