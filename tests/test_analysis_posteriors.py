"""Posterior calibration against a linear-Gaussian toy with a known posterior: y = A theta + noise,
theta uniform in the prior box, so the exact posterior is N(mu(y), (A^T C^-1 A)^-1) truncated to
the box. Exact posteriors pass every diagnostic, over- and under-confident ones fail them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from analysis import posteriors

NAMES = ("Omega_m", "sigma_8", "n_s")
LOWER = np.array([0.25, 0.75, 0.90])
UPPER = np.array([0.35, 0.90, 1.00])
TESTS = ("coverage", "tarp", "sbc", "sigma_vs_error")


def linear_model(seed: int):
    """A fixed design matrix A (3 data, 3 parameters) and data-noise covariance C."""
    rng = np.random.default_rng(seed)
    a = np.eye(3) + 0.3 * rng.normal(size=(3, 3))
    root = 0.7 * rng.normal(size=(3, 3))
    noise = (root @ root.T + np.eye(3)) * 4e-5
    return a, noise


def gaussian_posteriors(a, noise, thetas, rng):
    """The untruncated posterior (uniform prior) of one draw of y per truth: means (N, P), covs."""
    y = thetas @ a.T + rng.multivariate_normal(np.zeros(len(noise)), noise, size=len(thetas))
    precision = a.T @ np.linalg.inv(noise) @ a
    covariance = np.linalg.inv(precision)
    means = y @ np.linalg.solve(noise, a) @ covariance
    return means, np.broadcast_to(covariance, (len(thetas), 3, 3)).copy()


def toy(n: int, seed: int, lower=LOWER, upper=UPPER):
    """n truths from the box and their exact posteriors (before truncation)."""
    rng = np.random.default_rng(seed)
    thetas = rng.uniform(lower, upper, size=(n, 3))
    means, covariances = gaussian_posteriors(*linear_model(0), thetas, rng)
    return means, covariances, thetas


def run(means, covariances, thetas, seed=1, lower=LOWER, upper=UPPER):
    return posteriors.diagnostics(means, covariances, thetas, lower, upper, NAMES,
                                  np.random.default_rng(seed), n_draws=400)


def test_toy_posteriors_are_truncated_by_the_box():
    means, covariances, _ = toy(400, 2)
    sigma = np.sqrt(np.diagonal(covariances[0]))
    assert np.all(sigma > 0.05 * (UPPER - LOWER)) and np.all(sigma < 0.2 * (UPPER - LOWER))


def test_exact_posteriors_pass_every_diagnostic():
    report = run(*toy(400, 2))
    json.dumps(report, allow_nan=False)
    assert all(report[name]["calibrated"] for name in TESTS), {n: report[n]["calibrated"] for n in TESTS}
    for name in NAMES + ("joint",):
        coverage = report["coverage"]
        for value, (low, high) in zip(coverage["coverage"][name], coverage["band_2sigma"]):
            assert low - 0.03 < value < high + 0.03
    assert report["tarp"]["distance"] < report["tarp"]["distance_band"]
    assert all(0.8 < z < 1.2 for z in report["sigma_vs_error"]["rms_z"].values())


@pytest.mark.parametrize("scale", [0.25, 4.0])
def test_miscalibrated_posteriors_fail(scale):
    """Covariance / 4 (over-confident) and x 4 (under-confident)."""
    means, covariances, thetas = toy(400, 2)
    exact, wrong = run(means, covariances, thetas), run(means, covariances * scale, thetas)
    assert not any(wrong[name]["calibrated"] for name in TESTS)
    joint = [exact["coverage"]["coverage"]["joint"], wrong["coverage"]["coverage"]["joint"]]
    assert (np.array(joint[1]) < joint[0]).all() if scale < 1 else (np.array(joint[1]) > joint[0]).all()
    assert wrong["mean_log_density"] < exact["mean_log_density"]


def test_joint_coverage_follows_the_chi2_rule_in_a_wide_box():
    """Box far wider than the posteriors: theta is in the a-region of N(mu, Sigma / 4) when
    4 d^2 < chi^2_3^-1(a), with d^2 ~ chi^2_3, so the coverage is chi^2_3(chi^2_3^-1(a) / 4)."""
    lower, upper = LOWER - 1.0, UPPER + 1.0
    means, covariances, thetas = toy(600, 3)
    report = run(means, covariances / 4, thetas, lower=lower, upper=upper)
    for a, value in zip(posteriors.LEVELS, report["coverage"]["coverage"]["joint"]):
        expected = stats.chi2.cdf(stats.chi2.ppf(a, 3) / 4, 3)
        assert abs(value - expected) < 3 * np.sqrt(expected * (1 - expected) / 600) + 1 / 400


def test_same_seed_same_numbers():
    means, covariances, thetas = toy(50, 4)
    first, again, other = (json.dumps(run(means, covariances, thetas, seed=seed)) for seed in (7, 7, 8))
    assert first == again and first != other


def test_combine_subvolumes_is_the_posterior_of_all_pieces():
    """Four independent sub-volumes per simulation, each with its own noise, against the
    posterior of the stacked linear model; groups given out of order."""
    rng = np.random.default_rng(5)
    a, noise = linear_model(0)
    thetas = rng.uniform(LOWER, UPPER, size=(6, 3))
    noises = [noise * f for f in (1.0, 2.0, 0.5, 3.0)]
    pieces = [gaussian_posteriors(a, c, thetas, rng) for c in noises]
    groups = np.tile(np.array([12, 3, 7, 9, 0, 5]), 4)
    order = rng.permutation(len(groups))
    means = np.concatenate([m for m, _ in pieces])[order]
    covariances = np.concatenate([c for _, c in pieces])[order]
    ids, combined_means, combined_covariances = posteriors.combine_subvolumes(
        means, covariances, groups[order], inflation=1.5)
    np.testing.assert_array_equal(ids, np.sort(groups[:6]))
    expected_cov = np.linalg.inv(sum(a.T @ np.linalg.inv(c) @ a for c in noises))
    for g, sim in enumerate(np.argsort(groups[:6])):
        # stacked model: y_k = A theta + e_k; mu = Sigma sum_k A^T C_k^-1 y_k, y_k from piece k's mean
        y = [a @ m[sim] for m, _ in pieces]
        expected_mean = expected_cov @ sum(a.T @ np.linalg.solve(c, yk) for c, yk in zip(noises, y))
        np.testing.assert_allclose(combined_means[g], expected_mean, rtol=1e-9)
        np.testing.assert_allclose(combined_covariances[g], 1.5 * expected_cov, rtol=1e-9)


def test_fitted_inflation_recovers_a_known_misscaling():
    """Posteriors reporting half their covariance: s ~ 2 from the validation split, and the test
    split fails before the scaling and passes after."""
    (m1, c1, t1), (m2, c2, t2) = toy(600, 6), toy(400, 7)
    report = posteriors.temperature_scaling((m1, c1 / 2, t1), (m2, c2 / 2, t2), LOWER, UPPER, NAMES,
                                            np.random.default_rng(8), n_draws=400)
    assert report["inflation"] == pytest.approx(2.0, rel=0.1)
    assert not report["before"]["coverage"]["calibrated"] and not report["before"]["sbc"]["calibrated"]
    assert all(report["after"][name]["calibrated"] for name in TESTS)


def test_tarp_matches_the_tarp_package():
    tarp = pytest.importorskip("tarp")
    means, covariances, thetas = toy(300, 9)
    rng = np.random.default_rng(10)
    draws, _ = posteriors.sample_truncated(means, covariances * 2, LOWER, UPPER, 200, rng)
    width = UPPER - LOWER
    samples, truths = (draws - LOWER) / width, (thetas - LOWER) / width
    references = rng.uniform(size=truths.shape)
    ecp, alpha = tarp.get_tarp_coverage(samples.copy(), truths.copy(), references=references.copy(),
                                        num_alpha_bins=30, norm=False)
    mine = posteriors.tarp_coverage(posteriors.tarp_credibility(samples, truths, references), alpha)
    # the package sets ECP = 1 at the largest credibility; below it both are mean(f < alpha)
    np.testing.assert_allclose(mine[:-1], ecp[:-1], atol=1e-12)
    assert ecp[-1] == pytest.approx(1.0) and mine[-1] < 1.0


def test_truncated_draws_stay_in_the_box():
    rng = np.random.default_rng(11)
    means = np.array([[0.26, 0.80, 0.99], [0.30, 0.95, 0.95]])
    sigma = np.array([0.02, 0.05, 0.03])
    covariances = np.broadcast_to(np.diag(sigma**2), (2, 3, 3))
    draws, gibbs = posteriors.sample_truncated(means, covariances, LOWER, UPPER, 4000, rng)
    assert draws.shape == (4000, 2, 3) and not gibbs.any()
    assert np.all((draws >= LOWER) & (draws <= UPPER))
    # independent coordinates: each marginal is the 1-D truncated normal
    for n, p in np.ndindex(2, 3):
        a, b = (LOWER[p] - means[n, p]) / sigma[p], (UPPER[p] - means[n, p]) / sigma[p]
        expected = stats.truncnorm(a, b, loc=means[n, p], scale=sigma[p])
        assert stats.kstest(draws[:, n, p], expected.cdf).pvalue > 1e-3


def draw(means, covariances, n_draws, seed, **kwargs):
    return posteriors.sample_truncated(means, covariances, LOWER, UPPER, n_draws, np.random.default_rng(seed),
                                       **kwargs)


def test_posterior_centred_outside_the_box_is_drawn_by_gibbs_sampling():
    """Its Gaussian puts ~1e-6 of its mass in the box; the Gibbs draws agree with rejection
    draws of the same truncated Gaussian (made cheap by a large min_acceptance)."""
    means = np.array([[0.36, 0.72, 0.95]])
    covariances = np.array([[[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 1.0]]]) * 0.004**2
    draws, gibbs = draw(means, covariances, 200, 0)
    assert gibbs.all() and np.all((draws >= LOWER) & (draws <= UPPER))
    means, covariances = np.array([[0.355, 0.745, 0.95]]), covariances * 6
    exact, gibbs = draw(means, covariances, 1000, 1)
    assert not gibbs.any()
    chain, gibbs = draw(means, covariances, 1000, 2, min_acceptance=0.9)
    assert gibbs.all()
    for p in range(3):
        assert stats.ks_2samp(exact[:, 0, p], chain[:, 0, p]).pvalue > 1e-3


def test_information_gain_of_posteriors_half_as_wide():
    """A model whose posteriors are exactly 2x as wide as the reference's (covariances 4x),
    simulation by simulation: sigma ratio 2 per parameter, FoM ratio 2^P, each in its interval;
    a model whose width scatters from simulation to simulation gets the geometric mean of its
    FoM ratios, inside an interval of finite width; a model failing calibration gets no ratio
    and is named, as is a failing reference."""
    rng = np.random.default_rng(4)
    roots = rng.normal(size=(40, 3, 3)) * 0.01
    reference = roots @ np.swapaxes(roots, 1, 2) + 1e-5 * np.eye(3)
    scatter = rng.lognormal(0.0, 0.3, size=(40, 1, 1))
    covariances = {"network": reference, "wide": 4 * reference, "scattered": scatter * reference,
                   "failing": reference}
    failures = {"network": [], "wide": [], "scattered": [], "failing": ["sbc (p = 0.0001)"]}
    gain = posteriors.information_gain(covariances, NAMES, failures, n_resamples=300, seed=1)
    json.dumps(gain, allow_nan=False)
    assert gain["n_simulations"] == 40 and list(gain["models"]) == ["wide", "scattered", "failing"]
    wide = gain["models"]["wide"]
    for estimate in [*wide["sigma_ratio"].values(), wide["fom_ratio"]]:
        assert estimate["ratio_low"] <= estimate["ratio"] <= estimate["ratio_high"]
    for name in NAMES:
        assert wide["sigma_ratio"][name]["ratio"] == pytest.approx(2.0)
    assert wide["fom_ratio"]["ratio"] == pytest.approx(8.0) and wide["excluded"] is None
    scattered = gain["models"]["scattered"]
    fom = scattered["fom_ratio"]
    assert fom["ratio"] == pytest.approx(np.exp(1.5 * np.mean(np.log(scatter))))  # (det)^1/2: s^(3/2)
    assert fom["ratio_low"] < fom["ratio"] < fom["ratio_high"]
    failing = gain["models"]["failing"]
    assert failing["excluded"] == {"failing": ["sbc (p = 0.0001)"]}
    assert failing["fom_ratio"]["ratio"] is None and failing["sigma_ratio"]["n_s"]["ratio"] is None
    failures["network"] = ["tarp (p = 0.001)"]
    everything = posteriors.information_gain(covariances, NAMES, failures, n_resamples=50)
    assert everything["models"]["wide"]["excluded"] == {"network": ["tarp (p = 0.001)"]}


def test_failed_tests_name_each_failing_test_with_its_p_value():
    report = run(*toy(400, 2))
    assert posteriors.failed_tests(report) == []
    means, covariances, thetas = toy(400, 2)
    failed = posteriors.failed_tests(run(means, covariances / 9, thetas))
    assert failed and all(f.split(" (p = ")[0] in posteriors.CALIBRATION_TESTS for f in failed)
    assert any(f.startswith("coverage (p = ") for f in failed)
