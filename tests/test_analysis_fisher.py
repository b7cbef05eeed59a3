"""The Fisher forecast against the analytic errors of a linear-Gaussian toy model, the Hartlap
correction against the known inverse-Wishart bias, and the convergence test against noisy
derivatives (which bias the errors low)."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import fisher
from simulations.sampling import fiducial_derivative_points, sample_ensemble
from workflow.errors import PipelineError

NAMES = ("Omega_m", "sigma_8", "n_s")
FIDUCIAL = {"Omega_m": 0.3, "sigma_8": 0.8, "n_s": 0.96}
STEPS = {"Omega_m": 0.01, "sigma_8": 0.015, "n_s": 0.02}


def toy_model(n_features: int, seed: int):
    """mu(theta) = mu0 + A theta with noise covariance C (both random but fixed)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n_features, len(NAMES))) * 20.0
    root = rng.normal(size=(n_features, n_features))
    covariance = root @ root.T / n_features + 0.5 * np.eye(n_features)
    mu0 = rng.normal(size=n_features)
    return mu0, a, covariance


def analytic_errors(a, covariance):
    information = a.T @ np.linalg.inv(covariance) @ a
    return np.sqrt(np.diag(np.linalg.inv(information)))


def toy_ensemble(n_repetitions, mu0, a, covariance, seed, shared_noise=True):
    """Rows of the design with summaries mu0 + A theta + noise; one noise draw per repetition
    (shared seeds) or per row."""
    rng = np.random.default_rng(seed)
    points = fiducial_derivative_points(NAMES, FIDUCIAL, STEPS)
    values = np.tile(points, (n_repetitions, 1))
    seeds = np.repeat(np.arange(100, 100 + n_repetitions), len(points))
    noise = rng.multivariate_normal(np.zeros(len(mu0)), covariance,
                                    size=n_repetitions if shared_noise else len(values))
    if shared_noise:
        noise = np.repeat(noise, len(points), axis=0)
    summaries = mu0 + values @ a.T + noise
    return values, seeds, summaries


def test_design_from_the_sampling_stage_is_classified():
    ensemble = sample_ensemble(21, "fiducial_derivatives", list(NAMES), {},
                               {"train": 1.0, "val": 0.0, "test": 0.0},
                               sims_per_job=7, master_seed=3, fiducial=FIDUCIAL,
                               derivative_steps=STEPS)
    design = fisher.derivative_design(ensemble.values, NAMES, ensemble.seeds)
    np.testing.assert_allclose(design.fiducial, [0.3, 0.8, 0.96])
    np.testing.assert_allclose(design.steps, [0.01, 0.015, 0.02])
    assert len(design.repetitions) == 3
    np.testing.assert_array_equal(design.fiducial_rows, [0, 7, 14])
    # sim 1 is the -Omega_m point and sim 2 the +Omega_m point of repetition 0 (sampling order)
    assert design.minus_rows[0][0].tolist() == [1] and design.plus_rows[0][0].tolist() == [2]
    assert design.plus_rows[2][2].tolist() == [20]


def test_linear_gaussian_toy_model_gives_the_analytic_errors():
    mu0, a, covariance = toy_model(6, seed=0)
    values, seeds, summaries = toy_ensemble(2000, mu0, a, covariance, seed=1)
    design = fisher.derivative_design(values, NAMES, seeds)
    forecast = fisher.fisher_forecast(summaries, design)
    # Shared seeds: the paired differences are exact, so only the covariance is estimated
    # (2000 rows: ~3% scatter on the errors).
    np.testing.assert_allclose(forecast.derivatives, a.T, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(forecast.marginal_errors, analytic_errors(a, covariance), rtol=0.05)
    information = a.T @ np.linalg.inv(covariance) @ a
    np.testing.assert_allclose(forecast.conditional_errors, 1 / np.sqrt(np.diag(information)), rtol=0.05)
    assert forecast.hartlap_factor == pytest.approx((2000 - 6 - 2) / (2000 - 1))
    assert np.all(forecast.marginal_errors > forecast.conditional_errors)  # correlated params
    assert set(forecast.summary()["marginal_errors"]) == set(NAMES)


def test_several_rows_per_simulation_and_per_repetition_average():
    """Rows may be sub-volumes: several rows per point; the derivative averages them."""
    mu0, a, covariance = toy_model(4, seed=2)
    values, seeds, summaries = toy_ensemble(300, mu0, a, covariance, seed=3)
    values, seeds = np.repeat(values, 2, axis=0), np.repeat(seeds, 2)
    summaries = np.repeat(summaries, 2, axis=0) + np.tile([[1e-3], [-1e-3]], (len(summaries), 1))
    design = fisher.derivative_design(values, NAMES, seeds)
    assert all(len(rows) == 2 for rows in design.plus_rows[1])
    forecast = fisher.fisher_forecast(summaries, design)
    np.testing.assert_allclose(forecast.derivatives, a.T, rtol=1e-9, atol=1e-9)


def test_hartlap_correction_removes_the_inverse_covariance_bias():
    """E[C_hat^-1] = (n - 1) / (n - p - 2) C^-1 for Gaussian samples; the corrected mean is C^-1."""
    rng = np.random.default_rng(4)
    n, p = 24, 10
    covariance = np.diag(np.linspace(1.0, 3.0, p))
    corrected, raw = [], []
    for _ in range(400):
        samples = rng.multivariate_normal(np.zeros(p), covariance, size=n)
        _, precision, factor = fisher.hartlap_precision(samples)
        corrected.append(np.trace(precision @ covariance) / p)
        raw.append(np.trace(precision / factor @ covariance) / p)
    assert np.mean(corrected) == pytest.approx(1.0, rel=0.03)
    assert np.mean(raw) == pytest.approx((n - 1) / (n - p - 2), rel=0.03)


def test_noisy_derivatives_bias_errors_low_and_the_convergence_test_says_so():
    mu0, a, covariance = toy_model(6, seed=5)
    weak = a / 20.0  # a weak response, so that the noise of the differences matters
    truth = analytic_errors(weak, covariance)
    # Independent noise on every row: derivatives from few repetitions are noisy.
    values, seeds, summaries = toy_ensemble(40, mu0, weak, covariance, seed=6, shared_noise=False)
    design = fisher.derivative_design(values, NAMES, seeds)
    result = fisher.fisher_convergence(summaries, design, fractions=(0.1, 0.25, 0.5, 1.0))
    assert result["derivatives"]["n"] == [4, 10, 20, 40]
    curve = np.array([result["derivatives"]["marginal_errors"][name] for name in NAMES])
    assert np.all(curve[:, 0] < curve[:, -1])  # fewer derivative sims: smaller (biased) errors
    assert np.all(curve[:, -1] < truth)  # and 40 repetitions are still below the truth
    assert not result["converged"]

    # Shared seeds, many repetitions: the derivatives are exact and the errors stable.
    values, seeds, summaries = toy_ensemble(400, mu0, a, covariance, seed=7)
    design = fisher.derivative_design(values, NAMES, seeds)
    result = fisher.fisher_convergence(summaries, design)
    assert result["converged"], result["change"]
    assert max(result["change"]["derivatives"].values()) < 1e-6


def test_bad_designs_are_refused():
    points = fiducial_derivative_points(NAMES, FIDUCIAL, STEPS)
    values = np.tile(points, (2, 1))
    seeds = np.repeat([1, 2], len(points))
    two_moved = values.copy()
    two_moved[3, 0] += 0.01
    with pytest.raises(PipelineError, match="more than one parameter"):
        fisher.derivative_design(two_moved, NAMES, seeds)
    with pytest.raises(PipelineError, match=r"seed 2 has no \+sigma_8 point"):
        fisher.derivative_design(np.delete(values, 11, axis=0), NAMES, np.delete(seeds, 11))
    design = fisher.derivative_design(values, NAMES, seeds)
    with pytest.raises(PipelineError, match="p \\+ 2 = 7"):
        fisher.fisher_forecast(np.random.default_rng(0).normal(size=(len(values), 5)), design)
