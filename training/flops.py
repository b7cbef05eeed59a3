"""Analytic parameter and floating-point-operation counts of a built Keras network.

A convolution or dense layer costs 2 flops (one multiply, one add) per multiply-accumulate in
the forward pass: ``2 * k^3 * C_in * C_out * D_out H_out W_out`` for Conv3D and
``2 * n_in * n_out`` for Dense. Training one sample costs the forward pass plus the backward
pass, whose gradients with respect to the inputs and to the weights each cost one more forward
pass: 3x forward (the convention of the paper's "69.33 Gflop per sample", Mathuriya et al.
2018, Sec. V-A). Element-wise work (biases, activations, pooling) is under 1% and not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import keras

TRAINING_PASSES = 3
"""Forward + backward-data + backward-weights, each one forward pass's multiply-adds."""


@dataclass(frozen=True)
class LayerCost:
    """One layer's parameters and forward flops per sample."""

    name: str
    kind: str
    parameters: int
    forward_flops: int


def layer_costs(model: keras.Model) -> list[LayerCost]:
    """Per-layer cost of every Conv3D and Dense layer of ``model``, in network order."""
    costs = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv3D):
            kernel_volume_times_cin = math.prod(layer.kernel.shape[:-1])
            output_elements = math.prod(layer.output.shape[1:])  # D H W C_out
            flops = 2 * kernel_volume_times_cin * output_elements
        elif isinstance(layer, keras.layers.Dense):
            flops = 2 * math.prod(layer.kernel.shape)
        else:
            continue
        costs.append(LayerCost(layer.name, type(layer).__name__, layer.count_params(), flops))
    return costs


def summary(model: keras.Model) -> dict:
    """Parameter count, forward and training flops per sample, and the per-layer table."""
    costs = layer_costs(model)
    forward = sum(cost.forward_flops for cost in costs)
    return {
        "parameters": int(model.count_params()),
        "forward_flops_per_sample": int(forward),
        "training_flops_per_sample": int(TRAINING_PASSES * forward),
        "layers": [vars(cost) for cost in costs],
    }
