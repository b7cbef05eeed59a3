"""The posterior head (training.head): the gaussian head's loss is the Gaussian negative
log-likelihood, recovers a known linear-Gaussian model, saves as a point estimator that still
carries its covariance; the point head is the published network; sync (2 ranks), async and
resume train the gaussian head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy.stats import multivariate_normal

from mpi_training import training_settings, write_dataset
from training.checkpoints import list_checkpoints
from training.layers import GaussianNLL, GaussianPosterior
from training.models import (build_model, loss, mean_network, physical_moments, posterior_moments,
                             posterior_network)
from training.run import train_network
from workflow.errors import PipelineError

SCRIPT = Path(__file__).with_name("mpi_training.py")
GAUSSIAN = {"head": "gaussian", "shuffle_buffer": 0, "augment": False, "deterministic": True,
            "threads": 1, "validation_split": None, "epochs": 1, "batch_size": 8}


def packed_posterior(rng, n: int, p: int) -> np.ndarray:
    """Random valid packed outputs (n, P + P(P+1)/2): a GaussianPosterior of normal draws."""
    return GaussianPosterior(p)(rng.normal(0, 1, (n, p + p * (p + 1) // 2)).astype(np.float32)).numpy()


@pytest.mark.parametrize("p", [1, 2, 4])
def test_the_loss_is_the_negative_log_density_of_the_multivariate_normal(p):
    rng = np.random.default_rng(p)
    outputs = packed_posterior(rng, 16, p)
    y = rng.uniform(-1.5, 1.5, (16, p)).astype(np.float32)
    means, covariances = posterior_moments(outputs)
    expected = [-multivariate_normal.logpdf(y[i], means[i], covariances[i]) for i in range(16)]
    np.testing.assert_allclose(GaussianNLL().call(y, outputs).numpy(), expected, rtol=2e-5, atol=2e-5)
    assert float(GaussianNLL()(y, outputs)) == pytest.approx(np.mean(expected), rel=2e-5)


def test_a_linear_gaussian_model_is_recovered_with_its_correlated_noise():
    """y = W x + b + noise, noise ~ N(0, C) with correlations 0.6 and -0.5: a Dense layer with
    the gaussian head, fitted by Keras on the NLL, learns W, b and C, and its held-out NLL is the
    true model's entropy, below that of the true means with the correlations left out."""
    rng = np.random.default_rng(0)
    w = np.array([[0.5, -0.3, 0.2], [0.1, 0.4, -0.6], [-0.2, 0.0, 0.3]])
    b = np.array([0.1, -0.2, 0.05])
    std = np.array([0.2, 0.1, 0.3])
    correlation = np.array([[1.0, 0.6, 0.0], [0.6, 1.0, -0.5], [0.0, -0.5, 1.0]])
    c = correlation * np.outer(std, std)

    def draw(n):
        x = rng.normal(0, 1, (n, 3))
        y = x @ w.T + b + rng.multivariate_normal(np.zeros(3), c, n)
        return x.astype(np.float32), y.astype(np.float32)

    x, y = draw(8192)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    outputs = GaussianPosterior(3)(keras.layers.Dense(9)(inputs))
    model = keras.Model(inputs, outputs)
    steps = 100 * len(x) // 512  # 100 epochs, the learning rate decaying to 0
    model.compile(optimizer=keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(0.02, steps)),
                  loss=loss("gaussian"), steps_per_execution=16)
    model.fit(x, y, batch_size=512, epochs=100, verbose=0)

    x_test, y_test = draw(4096)
    means, covariances = posterior_moments(model.predict(x_test, verbose=0))
    np.testing.assert_allclose(means, x_test @ w.T + b, atol=0.03)
    np.testing.assert_allclose(covariances, np.broadcast_to(c, covariances.shape), atol=0.01)
    nll = float(model.evaluate(x_test, y_test, verbose=0))
    entropy = 0.5 * np.linalg.slogdet(2 * np.pi * np.e * c)[1]  # the true model's expected NLL
    assert nll == pytest.approx(entropy, abs=0.03)
    # a head whose covariance is fixed wrong (no correlations), even with the true means
    wrong = np.hstack([x_test @ w.T + b, np.tile(np.diag(std)[np.tril_indices(3)], (len(x_test), 1))])
    assert float(GaussianNLL()(y_test, wrong.astype(np.float32))) > nll + 0.2


@pytest.mark.parametrize("name,parameters,last", [("mlperf", 5_234_883, 64),
                                                   ("cosmoflow_paper", 7_041_443, 256)])
def test_the_point_head_is_the_published_network_and_the_gaussian_adds_only_its_last_layer(
        name, parameters, last):
    point = build_model(name, (16, 16, 16, 1), 3)
    assert point.count_params() == parameters and point.output.shape == (None, 3)
    assert point.layers[-1].name == "targets" and mean_network(point) is point and loss("point") == "mse"
    gaussian = build_model(name, (16, 16, 16, 1), 3, head="gaussian")
    assert gaussian.output.shape == (None, 3 + 6)
    assert gaussian.count_params() - parameters == (last + 1) * 6  # the Cholesky entries' weights
    with pytest.raises(PipelineError, match="training.head = 'laplace'"):
        build_model(name, (16, 16, 16, 1), 3, head="laplace")


def test_mlperf_means_stay_within_tanh_times_1_2_and_the_covariance_is_positive_definite():
    network = build_model("mlperf", (16, 16, 16, 1), 3, head="gaussian", precision="mixed_bfloat16")
    x = np.random.default_rng(0).normal(0, 30, (4, 16, 16, 16, 1)).astype(np.float32)
    outputs = network(x)
    assert outputs.dtype == "float32"
    means, covariances = posterior_moments(outputs)
    assert np.abs(means).max() <= 1.2
    assert np.linalg.eigvalsh(covariances).min() > 0


def test_a_saved_gaussian_network_loads_as_its_means_and_keeps_its_covariance(tmp_path):
    """model.keras as training writes it: analysis reads P means; posterior_network gives the rest."""
    keras.utils.set_random_seed(0)
    network = build_model("mlperf", (16, 16, 16, 1), 3, head="gaussian")
    mean_network(network).save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras", compile=False)
    x = np.random.default_rng(0).normal(0, 1, (2, 16, 16, 16, 1)).astype(np.float32)
    packed = network.predict(x, verbose=0)
    assert loaded.output_shape == (None, 3)
    np.testing.assert_array_equal(loaded.predict_on_batch(x), packed[:, :3])
    np.testing.assert_array_equal(posterior_network(loaded).predict(x, verbose=0), packed)


def test_physical_moments_follow_the_affine_target_scaling():
    rng = np.random.default_rng(0)
    means, covariances = posterior_moments(packed_posterior(rng, 5, 2))
    low, high = np.array([0.25, 0.78]), np.array([0.35, 0.95])
    samples = rng.multivariate_normal(means[0], covariances[0], 200_000)
    physical = low + (samples + 1) * (high - low) / 2  # Manifest.unscale_targets
    mean, covariance = physical_moments(means, covariances, low, high)
    np.testing.assert_allclose((mean[0] - physical.mean(0)) / (high - low), 0, atol=3e-3)
    np.testing.assert_allclose(covariance[0], np.cov(physical.T), rtol=0.02,
                               atol=1e-3 * np.abs(covariance[0]).max())


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """6 training simulations (48 samples of 16^3 in 6 files of 8) and 2 validation ones."""
    return write_dataset(tmp_path_factory.mktemp("small"), {"train": 6, "val": 2})


def run_script(manifest, output_dir, settings: dict, ranks: int):
    command = ["mpiexec", "-n", str(ranks), sys.executable, str(SCRIPT), str(manifest),
               str(output_dir), json.dumps(settings)]
    return subprocess.run(command, capture_output=True, text=True, timeout=420)


def weights(output_dir: Path) -> list[np.ndarray]:
    return [w.numpy() for w in keras.saving.load_model(output_dir / "model.keras").weights]


@pytest.fixture(scope="module")
def sync_run(small, tmp_path_factory) -> Path:
    """One epoch of the gaussian head on 2 ranks (mpiexec), with validation."""
    out = tmp_path_factory.mktemp("sync") / "training"
    result = run_script(small, out, GAUSSIAN | {"validation_split": "val"}, ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_two_ranks_train_the_gaussian_head(sync_run, small):
    record = json.loads((sync_run / "run.json").read_text())
    assert record["settings"]["head"] == "gaussian" and record["ranks"] == 2
    assert len(set(record["weights_sha256_per_rank"])) == 1
    assert np.isfinite(record["history"][0]["loss"]) and np.isfinite(record["history"][0]["val_loss"])
    assert record["validation"]["samples"] == 16  # against the posterior means
    loaded = keras.saving.load_model(sync_run / "model.keras", compile=False)
    assert loaded.output_shape == (None, 3)
    x = np.random.default_rng(0).normal(0, 1, (2, 16, 16, 16, 1)).astype(np.float32)
    _, covariances = posterior_moments(posterior_network(loaded).predict(x, verbose=0))
    assert np.linalg.eigvalsh(covariances).min() > 0


def test_async_without_staleness_trains_the_gaussian_head_as_sync_does(sync_run, small, tmp_path):
    result = run_script(small, tmp_path / "async", GAUSSIAN | {"validation_split": "val", "mode": "async",
                                                               "max_staleness": 0}, ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    for a, b in zip(weights(sync_run), weights(tmp_path / "async"), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_the_gaussian_head_resumes_mid_epoch_and_ends_like_the_uninterrupted_run(small, tmp_path):
    settings = training_settings(GAUSSIAN | {"epochs": 2, "batch_size": 16, "checkpoint_every_steps": 2})
    out = tmp_path / "training"
    train_network(small, out, settings)  # 3 steps per epoch: checkpoints (1, 1) and (2, 0) kept
    uninterrupted = weights(out)
    (out / "model.keras").unlink()
    assert max(list_checkpoints(out / "checkpoints"))[:2] == (2, 0)
    max(list_checkpoints(out / "checkpoints"))[2].unlink()  # as if killed after step 1 of epoch 1
    record = train_network(small, out, settings)
    assert record["resumed_from"] == {"epoch": 1, "step": 1}
    for a, b in zip(weights(out), uninterrupted, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_the_gaussian_loss_gradient_is_finite_at_the_floor():
    """A collapsed Cholesky diagonal (softplus -> 0) stays at the floor, with finite gradients."""
    raw = tf.Variable(np.tile([0.0, -80.0], (4, 1)).astype(np.float32))  # P = 1: mean, L_11
    with tf.GradientTape() as tape:
        value = GaussianNLL()(np.full((4, 1), 0.01, np.float32), GaussianPosterior(1)(raw))
    assert np.isfinite(float(value)) and np.isfinite(tape.gradient(value, raw).numpy()).all()
