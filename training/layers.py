"""A leaky ReLU layer that TensorFlow can fuse with the convolution before it during training.

f(x) = x for x > 0, slope * x otherwise; f'(x) = 1 for x > 0, slope otherwise. Keras's
``LeakyReLU`` takes its gradient from the input x, the output of the preceding BiasAdd, which
must then be kept for the backward pass. TensorFlow's graph optimiser (grappler's remapper) can
replace Conv3D + BiasAdd + LeakyRelu by one oneDNN operation only when nothing else reads the
BiasAdd output, so in training it gives up ("remapper failed: ... fanout LeakyReluGrad exist for
missing node BiasAdd") and runs the activation and its gradient as separate passes over memory.

:class:`LeakyReLU` computes the same function and the same gradient, from the output y instead:
for a slope >= 0, y > 0 exactly where x > 0, so f'(x) = 1 where y > 0 and slope elsewhere.
It is registered with Keras (``cosmoflow>LeakyReLU``); a saved network (``model.keras``) loads
once this module is imported (``training.models`` imports it).
"""

from __future__ import annotations

import keras
import tensorflow as tf


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
