"""The two networks: shapes, parameter counts and analytic FLOPs against hand-derived tables."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from training import flops
from training.layers import LeakyReLU
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
    x = tf.ones((1, 16, 16, 16, 1))
    with tf.GradientTape() as tape:
        y = model(x, training=True)
    assert y.dtype == "float32"
    gradients = tape.gradient(y, model.trainable_variables)  # our LeakyReLU's, in bfloat16
    assert all(np.isfinite(g).all() and np.any(g != 0) for g in gradients)


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


def keras_leaky_relu_copy(model):
    """``model`` with Keras's own LeakyReLU (gradient from its input) in place of ours, same weights."""
    def clone(layer):
        cls = keras.layers.LeakyReLU if isinstance(layer, LeakyReLU) else type(layer)
        return cls.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone)
    copy.set_weights(model.get_weights())
    return copy


def test_leaky_relu_gradient_from_its_output_equals_keras_gradient_from_its_input():
    x = tf.constant([-3.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.nan])
    for slope in (0.0, 0.01, 0.3, 2.0):
        ours, theirs = LeakyReLU(slope), keras.layers.LeakyReLU(slope)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y_ours, y_theirs = ours(x), theirs(x)
        np.testing.assert_array_equal(y_ours, y_theirs)
        np.testing.assert_array_equal(tape.gradient(y_ours, x), tape.gradient(y_theirs, x))


def fused_convolutions(network) -> list[list[str]]:
    """What grappler fused into each Conv3D of the graph that computes ``network``'s gradients:
    the ``fused_ops`` of its ``_FusedConv3D`` nodes, as optimised (run metadata)."""
    from tensorflow.python.eager import context

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(network(x, training=True) ** 2)
        return tape.gradient(loss, network.trainable_variables)

    context.enable_run_metadata()
    gradients(tf.ones((2,) + tuple(network.input.shape[1:])))
    graphs = context.export_run_metadata().function_graphs
    context.disable_run_metadata()
    return [[op.decode() for op in node.attr["fused_ops"].list.s]
            for graph in graphs for node in graph.post_optimization_graph.node
            if node.op == "_FusedConv3D"]


@pytest.mark.parametrize("name", ["cosmoflow_paper", "mlperf"])
def test_the_training_step_fuses_each_convolution_with_its_bias_and_activation(name):
    """With TensorFlow's oneDNN kernels on, grappler's remapper turns Conv3D + BiasAdd +
    LeakyRelu into one operation in training too; with Keras's LeakyReLU, whose gradient reads
    the BiasAdd output, it gives up ("remapper failed")."""
    ours = build_model(name, (16, 16, 16, 1), 3)
    n_convolutions = sum(isinstance(layer, keras.layers.Conv3D) for layer in ours.layers)
    assert fused_convolutions(ours) == [["BiasAdd", "LeakyRelu"]] * n_convolutions
    assert ["BiasAdd", "LeakyRelu"] not in fused_convolutions(keras_leaky_relu_copy(ours))


def test_a_short_training_run_matches_keras_leaky_relu():
    """The paper network at 16^3, float32: gradients of the fused training graph and the losses of
    four Adam steps agree with the network built with Keras's LeakyReLU, to float32 rounding."""
    keras.utils.set_random_seed(0)
    ours = build_model("cosmoflow_paper", (16, 16, 16, 1), 3)
    theirs = keras_leaky_relu_copy(ours)
    rng = np.random.default_rng(0)
    x = np.log1p(rng.poisson(8.0, (8, 16, 16, 16, 1))).astype(np.float32)
    y = rng.uniform(-1, 1, (8, 3)).astype(np.float32)

    def gradients(network):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((network(x, training=True) - y) ** 2)
            return tape.gradient(loss, network.trainable_variables)
        return step(x[:2], y[:2])

    for g_ours, g_theirs in zip(gradients(ours), gradients(theirs), strict=True):
        scale = float(np.abs(g_theirs).max())
        assert scale > 0
        np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-4, atol=1e-5 * scale)
    losses = []
    for network in (ours, theirs):
        network.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=False)
        losses.append([network.train_on_batch(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    assert losses[0][-1] != losses[0][0]  # the weights moved
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_a_saved_network_loads_with_our_leaky_relu(tmp_path):
    """training/model.keras, as analysis loads it: our registered layer comes back, same outputs."""
    network = build_model("mlperf", (16, 16, 16, 1), 3)
    network.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras", compile=False)
    activations = [layer for layer in loaded.layers if layer.name.endswith("_act")]
    assert len(activations) == 7 and all(type(layer) is LeakyReLU for layer in activations)
    assert {layer.negative_slope for layer in activations} == {0.3}
    x = np.random.default_rng(0).normal(0, 1, (2, 16, 16, 16, 1)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), network.predict(x, verbose=0))
