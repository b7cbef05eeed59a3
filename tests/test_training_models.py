"""The two networks: shapes, parameter counts and analytic FLOPs against hand-derived tables."""

from __future__ import annotations

import numpy as np
import pytest

from training import flops
from training.models import build_model
from workflow.errors import PipelineError

PAPER_FLOPS_128 = 69.33e9  # Mathuriya et al. 2018, Sec. V-A

# The SC18 network at 128^3 x 1, worked out by hand with 'valid' padding:
# (kernel, C_in, C_out, output voxels per side)
PAPER_CONVOLUTIONS_128 = [
    (3, 1, 16, 126),    # 128 - 2, then average pool -> 63
    (4, 16, 32, 60),    # 63 - 3, pool -> 30
    (4, 32, 64, 27),    # 30 - 3, pool -> 13
    (3, 64, 128, 6),    # (13 - 3) // 2 + 1 (stride 2)
    (3, 128, 256, 4),
    (2, 256, 256, 3),
    (2, 256, 256, 2),   # flatten: 2^3 x 256 = 2048
]
PAPER_DENSE = [(2048, 2048), (2048, 256), (256, 3)]

# MLPerf network at 128^3 x 4: 'same' convolutions, 2x max pooling after each
MLPERF_CONVOLUTIONS_128 = [(3, 4, 32, 128), (3, 32, 64, 64), (3, 64, 128, 32), (3, 128, 256, 16),
                           (3, 256, 512, 8)]
MLPERF_DENSE = [(4**3 * 512, 128), (128, 64), (64, 3)]


def table_costs(convolutions, dense):
    """(parameters, forward flops) summed over a hand-written layer table."""
    parameters = sum(k**3 * cin * cout + cout for k, cin, cout, _ in convolutions)
    parameters += sum(n_in * n_out + n_out for n_in, n_out in dense)
    forward = sum(2 * k**3 * cin * cout * n**3 for k, cin, cout, n in convolutions)
    forward += sum(2 * n_in * n_out for n_in, n_out in dense)
    return parameters, forward


def test_paper_network_at_128_has_the_papers_size_and_our_flop_table():
    model = build_model("cosmoflow_paper", (128, 128, 128, 1), 3)
    parameters, forward = table_costs(PAPER_CONVOLUTIONS_128, PAPER_DENSE)
    summary = flops.summary(model)
    assert summary["parameters"] == model.count_params() == parameters == 7_041_443
    assert 4 * parameters / 1e6 == pytest.approx(28.15, abs=0.05)  # paper: 28.15 MB of weights
    assert summary["forward_flops_per_sample"] == forward
    assert summary["training_flops_per_sample"] == 3 * forward
    # Our analytic count (multiply-adds only) is 8% below the paper's 69.33 Gflop per sample.
    assert 0.85 < 3 * forward / PAPER_FLOPS_128 < 1.0
    layer_shapes = [tuple(model.get_layer(f"conv{i}").output.shape[1:]) for i in range(1, 8)]
    assert layer_shapes == [(n, n, n, cout) for _, _, cout, n in PAPER_CONVOLUTIONS_128]
    per_layer = [layer["forward_flops"] for layer in summary["layers"]]
    assert per_layer[:7] == [2 * k**3 * cin * cout * n**3 for k, cin, cout, n in PAPER_CONVOLUTIONS_128]
    assert model.output.shape == (None, 3)


def test_mlperf_network_at_128_matches_the_reference_size():
    model = build_model("mlperf", (128, 128, 128, 4), 3)
    parameters, forward = table_costs(MLPERF_CONVOLUTIONS_128, MLPERF_DENSE)
    assert model.count_params() == parameters == 8_907_491  # "8.9 M parameters"
    assert flops.summary(model)["forward_flops_per_sample"] == forward
    assert model.get_layer("dense1_dropout").rate == 0.5
    x = np.random.default_rng(0).normal(0, 30, (2, 128, 128, 128, 4)).astype(np.float32)
    assert np.abs(model.predict(x, verbose=0)).max() <= 1.2  # tanh x 1.2


@pytest.mark.parametrize("name", ["cosmoflow_paper", "mlperf"])
def test_both_networks_adapt_to_32_cubed_inputs(name):
    model = build_model(name, (32, 32, 32, 2), 3)
    summary = flops.summary(model)
    assert summary["parameters"] == model.count_params()
    assert summary["forward_flops_per_sample"] == sum(layer["forward_flops"] for layer in summary["layers"])
    out = model(np.zeros((2, 32, 32, 32, 2), np.float32))
    assert out.shape == (2, 3) and np.isfinite(out.numpy()).all()
    if name == "cosmoflow_paper":
        # 32 -> conv1 30 -> pool 15 -> conv2 12 -> pool 6 -> conv3 3 (pool would leave 1: skipped);
        # conv4 and conv5 would leave 1 ('same' instead), conv6 k=2 -> 2, conv7 'same' -> 2.
        sizes = [model.get_layer(f"conv{i}").output.shape[1] for i in range(1, 8)]
        assert sizes == [30, 12, 3, 3, 3, 2, 2]
        assert model.get_layer("flatten").output.shape[1] == 2048  # the same dense head as at 128^3


def test_mixed_bfloat16_computes_in_bfloat16_with_float32_output():
    model = build_model("cosmoflow_paper", (16, 16, 16, 1), 3, precision="mixed_bfloat16")
    conv = model.get_layer("conv1")
    assert conv.compute_dtype == "bfloat16" and conv.kernel.dtype == "float32"
    assert model(np.ones((1, 16, 16, 16, 1), np.float32)).dtype == "float32"


def test_unknown_model_is_refused():
    with pytest.raises(PipelineError, match="training.model = 'resnet'"):
        build_model("resnet", (16, 16, 16, 1), 3)


@pytest.mark.parametrize("name", ["cosmoflow_paper", "mlperf"])
def test_width_multiplies_every_convolutions_channels(name):
    """training.width (a sweep knob): the convolutions' channels scale, the dense head does not."""
    def channels(model):
        return [layer.filters for layer in model.layers if layer.name.startswith("conv") and
                hasattr(layer, "filters")]

    base, half = (build_model(name, (16, 16, 16, 1), 3, width=w) for w in (1.0, 0.5))
    assert channels(half) == [c // 2 for c in channels(base)]
    assert half.count_params() < base.count_params()
    assert channels(build_model(name, (16, 16, 16, 1), 3, width=0.001)) == [1] * len(channels(base))
