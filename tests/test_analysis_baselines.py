"""Baselines on synthetic data whose answer is known: a linear relation (ridge recovers it),
a non-linear one (boosted trees beat ridge), an over-parametrised one (validation picks a
real penalty), and the training mean; the network's combination with a baseline on estimators
whose errors are known."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import baselines
from workflow.config import schema_enum
from workflow.errors import PipelineError

NAMES = ("Omega_m", "sigma_8", "n_s")
SMALL_GRID = {"learning_rate": (0.1,), "max_iter": (100, 300), "max_leaf_nodes": (7, 15)}


def split(x, y, n_train, n_val):
    return (x[:n_train], y[:n_train], x[n_train:n_train + n_val], y[n_train:n_train + n_val],
            x[n_train + n_val:], y[n_train + n_val:])


@pytest.fixture(scope="module")
def linear_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8)) * np.array([1, 10, 0.1, 1, 5, 1, 1, 2])  # mixed feature scales
    coefficients = rng.normal(size=(8, 3)) / np.array([1, 10, 0.1, 1, 5, 1, 1, 2])[:, None]
    y = np.array([0.3, 0.8, 0.96]) + 0.01 * x @ coefficients + 1e-5 * rng.normal(size=(400, 3))
    return split(x, y, 250, 75)


def test_ridge_recovers_a_linear_relation(linear_data, caplog):
    x_train, y_train, x_val, y_val, x_test, y_test = linear_data
    with caplog.at_level("INFO", logger="analysis.baselines"):
        fit = baselines.fit_ridge(x_train, y_train, x_val, y_val, NAMES)
    # nearly noise-free: the smallest penalty wins for some parameters; that is least squares,
    # said at INFO, not a warning
    smallest = [n for n, a in fit.hyperparameters["alpha"].items() if a == min(baselines.RIDGE_ALPHAS)]
    assert smallest and [r.levelname for r in caplog.records] == ["INFO"] * len(smallest)
    assert all(name in r.getMessage() for name, r in zip(smallest, caplog.records))
    residual = fit.predict(x_test) - y_test
    assert np.sqrt(np.mean(residual**2, axis=0)).max() < 5e-5  # the 1e-5 noise, not the signal
    assert fit.validation_score < 1e-4
    assert set(fit.hyperparameters["alpha"]) == set(NAMES)


def test_mean_baseline_predicts_the_training_mean(linear_data):
    x_train, y_train, x_val, y_val, x_test, _ = linear_data
    fit = baselines.fit_mean(y_train, y_val, NAMES)
    np.testing.assert_allclose(fit.predict(x_test), np.tile(y_train.mean(0), (len(x_test), 1)))
    expected = np.mean((y_val - y_train.mean(0)) ** 2, axis=0)
    np.testing.assert_allclose(list(fit.validation_mse.values()), expected)
    assert fit.validation_score == pytest.approx(np.mean(expected / y_train.var(0)))


def test_gradient_boosting_beats_ridge_on_a_non_linear_relation():
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, size=(900, 4))
    y = np.stack([np.sin(2 * x[:, 0]), x[:, 1] ** 2, np.abs(x[:, 2]) * x[:, 3]], axis=1)
    y += 0.02 * rng.normal(size=y.shape)
    x_train, y_train, x_val, y_val, x_test, y_test = split(x, y, 600, 150)
    fits = baselines.fit_baselines(x_train, y_train, x_val, y_val, NAMES, seed=3)
    assert list(fits) == list(schema_enum("analysis.baselines"))
    test_mse = {name: np.mean((fit.predict(x_test) - y_test) ** 2, axis=0) for name, fit in fits.items()}
    assert np.all(test_mse["gradient_boosting"] < 0.3 * test_mse["ridge"]), test_mse
    assert np.all(test_mse["ridge"] <= 1.05 * test_mse["mean"])
    assert baselines.best_baseline(fits) == "gradient_boosting"
    assert fits["gradient_boosting"].validation_score < fits["ridge"].validation_score


def test_validation_chooses_a_real_penalty_when_features_outnumber_information():
    """25 features, 40 training samples, one informative feature: least squares overfits."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(440, 25))
    y = (0.5 * x[:, :1] + 0.5 * rng.normal(size=(440, 1)))
    x_train, y_train, x_val, y_val, x_test, y_test = split(x, y, 40, 200)
    fit = baselines.fit_ridge(x_train, y_train, x_val, y_val, ("n_s",))
    alpha = fit.hyperparameters["alpha"]["n_s"]
    assert alpha > 1.0
    nearly_ols = baselines.fit_ridge(x_train, y_train, x_val, y_val, ("n_s",), alphas=(1e-6,))
    chosen_error = np.mean((fit.predict(x_test) - y_test) ** 2)
    ols_error = np.mean((nearly_ols.predict(x_test) - y_test) ** 2)
    assert chosen_error < 0.9 * ols_error


def test_fits_are_deterministic_given_the_seed(linear_data):
    x_train, y_train, x_val, y_val, x_test, _ = linear_data
    first = baselines.fit_gradient_boosting(x_train, y_train, x_val, y_val, NAMES, seed=5, grid=SMALL_GRID)
    second = baselines.fit_gradient_boosting(x_train, y_train, x_val, y_val, NAMES, seed=5, grid=SMALL_GRID)
    np.testing.assert_array_equal(first.predict(x_test), second.predict(x_test))
    assert first.hyperparameters == second.hyperparameters
    assert first.summary()["name"] == "gradient_boosting"


def test_bad_input_is_refused(linear_data):
    x_train, y_train, x_val, y_val, _, _ = linear_data
    with pytest.raises(PipelineError, match="one row per target row"):
        baselines.fit_ridge(x_train[:-1], y_train, x_val, y_val, NAMES)
    bad = x_val.copy()
    bad[3, 2] = np.nan
    with pytest.raises(PipelineError, match=r"validation features .* column\(s\) \[2\]"):
        baselines.fit_ridge(x_train, y_train, bad, y_val, NAMES)
    with pytest.raises(PipelineError, match="non-empty"):
        baselines.fit_mean(y_train[:0], y_val, NAMES)
    with pytest.raises(PipelineError, match="training split has 3"):
        baselines.fit_mean(y_train, y_val[:, :2], NAMES)


def test_combination_weighs_each_estimator_by_what_it_adds():
    """Independent errors of equal size: equal weights halve the MSE; a 'network' that is the
    baseline plus noise adds nothing and gets weight 0; a perfect one gets weight 1."""
    rng = np.random.default_rng(3)
    y_train, y_val = rng.uniform(0.7, 1.0, size=(200, 3)), rng.uniform(0.7, 1.0, size=(4000, 3))
    baseline = y_val + 0.02 * rng.normal(size=y_val.shape)
    network = np.column_stack([
        y_val[:, 0] + 0.02 * rng.normal(size=len(y_val)),      # independent errors, same size
        baseline[:, 1] + 0.02 * rng.normal(size=len(y_val)),   # the baseline's errors and more
        y_val[:, 2]])                                          # exact
    fit = baselines.fit_combination(network, baseline, y_val, y_train, NAMES, "ridge")
    weights = fit.hyperparameters["network_weight"]
    assert weights["Omega_m"] == pytest.approx(0.5, abs=0.05)
    assert weights["sigma_8"] == pytest.approx(0.0, abs=1e-12)  # clipped at 0
    assert weights["n_s"] == pytest.approx(1.0)
    assert fit.name == "network+ridge"
    combined = fit.predict(np.hstack([network, baseline]))
    assert np.mean((combined[:, 0] - y_val[:, 0]) ** 2) == pytest.approx(0.5 * 0.02**2, rel=0.1)
    np.testing.assert_allclose(combined[:, 1], baseline[:, 1])
    for p, name in enumerate(NAMES):  # never worse on validation than either estimator alone
        assert fit.validation_mse[name] <= min(np.mean((network[:, p] - y_val[:, p]) ** 2),
                                               np.mean((baseline[:, p] - y_val[:, p]) ** 2)) + 1e-15
    with pytest.raises(PipelineError, match="shape"):
        baselines.fit_combination(network[:, :2], baseline, y_val, y_train, NAMES, "ridge")


def test_ridge_warns_when_the_largest_penalty_wins(caplog):
    """Features that carry nothing about the targets: validation wants the largest penalty,
    which may still be too small, and the fit is close to the mean; that is a warning."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(300, 20)), rng.uniform(size=(300, 3))
    with caplog.at_level("INFO", logger="analysis.baselines"):
        fit = baselines.fit_ridge(x[:200], y[:200], x[200:], y[200:], NAMES)
    largest = [n for n, a in fit.hyperparameters["alpha"].items() if a == max(baselines.RIDGE_ALPHAS)]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert largest and len(warned) == len(largest)
    assert all(name in message and "largest" in message for name, message in zip(largest, warned))


LOW, HIGH = np.array([0.15, 0.4, 0.75]), np.array([0.45, 1.15, 1.1])
NOISE = np.array([0.015, 0.04, 0.012])  # the targets' scatter about the linear map


@pytest.fixture(scope="module")
def noisy_linear_data():
    """Targets a known linear function of four features plus Gaussian noise of known sigma,
    inside the sampling box [LOW, HIGH] by a wide margin (so the box truncates nothing)."""
    rng = np.random.default_rng(7)
    x = rng.uniform(size=(3400, 4))
    weights = np.array([[0.05, 0.1, 0.0], [0.05, -0.05, 0.08], [0.0, 0.08, 0.04], [0.0, 0.0, 0.0]])
    y = np.array([0.25, 0.7, 0.86]) + x @ weights + NOISE * rng.normal(size=(3400, 3))
    return split(x, y, 2400, 600)


def test_posterior_baseline_is_calibrated_with_the_noise_as_its_sigma(noisy_linear_data):
    """The exact posterior of a target given its features is N(linear map, NOISE^2): the fitted
    posterior's sigma is near NOISE and its credible regions cover the test targets as they claim."""
    from analysis import posteriors

    x_train, y_train, x_val, y_val, x_test, y_test = noisy_linear_data
    fit = baselines.fit_posterior(x_train, y_train, x_val, y_val, NAMES, LOW, HIGH, columns=[0, 1, 2],
                                  seed=3, name="toy")
    means, covariances = fit.predict(x_test)
    assert means.shape == (len(x_test), 3) and covariances.shape == (len(x_test), 3, 3)
    sigma = np.sqrt(np.diagonal(covariances, axis1=1, axis2=2))
    np.testing.assert_allclose(np.sqrt(np.mean(sigma**2, axis=0)), NOISE, rtol=0.2)
    report = posteriors.diagnostics(means, covariances, y_test, LOW, HIGH, NAMES,
                                    np.random.default_rng(0), n_draws=300)
    assert report["coverage"]["calibrated"] and report["sigma_vs_error"]["calibrated"]
    assert fit.hyperparameters["best_epoch"] <= fit.hyperparameters["epochs_run"]
    assert fit.summary()["n_features"] == 3 and np.isfinite(fit.validation_nll)


def test_posterior_baseline_is_repeatable(noisy_linear_data):
    """Seeded initialisation and shuffling, deterministic ops: the same fit twice, bit for bit."""
    x_train, y_train, x_val, y_val, x_test, _ = noisy_linear_data
    settings = {**baselines.POSTERIOR_TRAINING, "max_epochs": 5}
    first, second = (baselines.fit_posterior(x_train[:300], y_train[:300], x_val[:100], y_val[:100], NAMES,
                                             LOW, HIGH, seed=5, settings=settings) for _ in range(2))
    for one, other in zip(first.predict(x_test), second.predict(x_test)):
        np.testing.assert_array_equal(one, other)


def test_posterior_baselines_read_their_summary_statistics():
    """P(k) alone reads the log10P columns; with the one-point statistics, every column."""
    from analysis.power_spectrum import summary_names

    names = summary_names(16, 100.0, 2, n_bins=4)
    alone = baselines.posterior_columns("power_spectrum", names)
    both = baselines.posterior_columns("power_spectrum_one_point", names)
    assert [names[i] for i in alone] == [n for n in names if "log10P" in n] and len(alone) == 8
    assert both == list(range(len(names)))
    with pytest.raises(PipelineError, match="Unknown posterior baseline"):
        baselines.posterior_columns("bispectrum", names)
