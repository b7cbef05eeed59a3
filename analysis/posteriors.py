"""Calibrated Gaussian posteriors: combining sub-volumes, the prior box, calibration diagnostics.

The network's Gaussian head gives, per sample (sub-volume), a mean (P,) and a covariance (P, P)
over the sampled parameters, in the caller's units; arrays hold N posteriors: means (N, P),
covariances (N, P, P), truths (N, P); posterior draws are (L, N, P), the layout of the ``tarp``
package. The prior is uniform in the sampling box (lower, upper per parameter), so a posterior
is the Gaussian truncated to the box, drawn by rejection, or by Gibbs sampling where the box
holds little of the Gaussian (:func:`sample_truncated`).

:func:`diagnostics` tests N posteriors against their truths from L draws each:

* coverage of the a = 68% and 95% credible regions, per parameter (equal-tailed 1-D intervals)
  and joint (highest density), with the binomial 2-sigma band a +/- 2 sqrt(a (1 - a) / N);
* TARP expected coverage (Lemos et al. 2023, arXiv:2302.03026, Sec. 3) with a bootstrap band;
* SBC ranks (Talts et al. 2018, arXiv:1804.06788, Algorithm 1) with a chi^2 uniformity test;
* the mean log density of the truths under the (untruncated) Gaussians, i.e. minus the Gaussian
  negative log-likelihood, and the RMS of error / sigma per parameter.

Each test's ``calibrated`` is True when none of its p-values falls below 0.01 / (its number of
p-values) (Bonferroni: a calibrated posterior fails a test with probability <= 1%).

:func:`information_gain` compares the widths of calibrated posteriors of two models of the same
simulations: per parameter the ratio of their standard deviations, and the ratio of their
figures of merit (det Sigma)^-1/2, with bootstrap intervals over the simulations.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
from scipy import special, stats

from analysis.metrics import BOOTSTRAP_INTERVAL

LEVELS = (0.68, 0.95)
"""Credibility levels of the coverage test."""
SIGNIFICANCE = 0.01
"""Family-wise false-alarm probability of each test's ``calibrated`` flag."""


def _mahalanobis2(x: np.ndarray, means: np.ndarray, covariances: np.ndarray) -> np.ndarray:
    """(x - mu)^T Sigma^-1 (x - mu) for x of shape (..., N, P): shape (..., N)."""
    d = x - means
    return np.einsum("...ni,nij,...nj->...n", d, np.linalg.inv(covariances), d)


def combine_subvolumes(means, covariances, groups, inflation: float = 1.0):
    """Per-simulation posteriors from its sub-volumes': the product of their Gaussians.

    Sub-volumes of one box are treated as independent pieces of data, and with a uniform prior
    each piece's posterior is its likelihood (within the box), so the simulation's posterior
    N(mu, Sigma) has Sigma^-1 = sum_k Sigma_k^-1 and mu = Sigma sum_k Sigma_k^-1 mu_k (precision-
    weighted; e.g. Bishop 2006, Sec. 2.3); exact for independent Gaussian pieces. Sub-volumes of one box are
    correlated, which makes the product over-confident: ``inflation`` s multiplies Sigma (fit it
    with :func:`fit_inflation`). Returns the sorted group ids (G,), means (G, P), covariances
    (G, P, P).
    """
    means, covariances, groups = np.asarray(means, float), np.asarray(covariances, float), np.asarray(groups)
    precisions = np.linalg.inv(covariances)
    weighted = np.einsum("nij,nj->ni", precisions, means)
    ids, index = np.unique(groups, return_inverse=True)
    precision = np.zeros((len(ids),) + precisions.shape[1:])
    np.add.at(precision, index, precisions)
    eta = np.zeros((len(ids), means.shape[1]))
    np.add.at(eta, index, weighted)
    covariance = np.linalg.inv(precision)
    return ids, np.einsum("gij,gj->gi", covariance, eta), covariance * inflation


def fit_inflation(means, covariances, truths) -> float:
    """The scale s of the covariances that calibrates them on a validation split.

    s = mean_n d_n^2 / P with d_n^2 the squared Mahalanobis distance of truth n: under
    N(mu_n, s Sigma_n) the mean of d_n^2 / s is P (chi^2_P calibration), and the same s
    maximises the Gaussian likelihood prod_n N(theta_n; mu_n, s Sigma_n) (d/ds of
    -sum_n (d_n^2 / s + P ln s) / 2 vanishes there). This is temperature scaling of the
    covariance; the truncation to the prior box is neglected in the fit.
    """
    return float(np.mean(_mahalanobis2(truths, means, covariances)) / means.shape[1])


def _standard_truncnorm(a, b, rng):
    """Standard normal draws truncated to [a, b] by inverting its CDF (Devroye 1986, Ch. II.2),
    on the side of 0 where the interval's CDF values keep their precision (the lower tail)."""
    flip = a > 0
    a, b = np.where(flip, -b, a), np.where(flip, -a, b)
    low, high = special.ndtr(a), special.ndtr(b)
    x = np.clip(special.ndtri(low + rng.uniform(size=low.shape) * (high - low)), a, b)
    return np.where(flip, -x, x)


def _gibbs_truncated(means, covariances, lower, upper, n_draws, rng, burn_in=100, thin=5):
    """Gibbs sampling of Gaussians truncated to the box (Geweke 1991): each coordinate in turn
    from its 1-D truncated normal conditional, mean mu_i - sum_{j != i} Lambda_ij (x_j - mu_j) /
    Lambda_ii and variance 1 / Lambda_ii (Lambda = Sigma^-1); every thin-th sweep after burn_in
    is kept. Returns (L, M, P)."""
    precision = np.linalg.inv(covariances)
    sd = 1 / np.sqrt(np.diagonal(precision, axis1=1, axis2=2))
    x, kept = np.clip(means, lower, upper), []
    for sweep in range(burn_in + n_draws * thin):
        for i in range(means.shape[1]):
            offset = x - means
            pull = np.einsum("mj,mj->m", precision[:, i], offset) - precision[:, i, i] * offset[:, i]
            mean = means[:, i] - pull * sd[:, i] ** 2
            x[:, i] = mean + sd[:, i] * _standard_truncnorm(
                (lower[i] - mean) / sd[:, i], (upper[i] - mean) / sd[:, i], rng)
        if sweep >= burn_in and (sweep - burn_in) % thin == 0:
            kept.append(x.copy())
    return np.array(kept)


def sample_truncated(means, covariances, lower, upper, n_draws: int, rng: np.random.Generator,
                     min_acceptance: float = 1e-3):
    """n_draws draws (L, N, P) of each Gaussian truncated to the box [lower, upper] (P,) each.

    Rejection from the Gaussian (Robert & Casella 2004, Sec. 2.3), in batches sized by the
    acceptance so far (the Gaussian's mass in the box): independent, exact draws. A posterior
    whose acceptance is below ``min_acceptance`` after 10 / min_acceptance proposals (an
    over-confident one centred outside the box) is drawn by Gibbs sampling instead
    (:func:`_gibbs_truncated`: exact in the limit, correlated draws thinned). Also returns which
    posteriors were (N,) bool.
    """
    lower, upper = np.asarray(lower, dtype=float), np.asarray(upper, dtype=float)
    draws = np.empty((n_draws,) + means.shape)
    gibbs = np.zeros(len(means), dtype=bool)
    largest = math.ceil(10 / min_acceptance)
    for n, (mean, root) in enumerate(zip(means, np.linalg.cholesky(covariances))):
        kept, proposed, accepted, batch = [], 0, 0, 2 * n_draws
        while accepted < n_draws and not gibbs[n]:
            x = mean + rng.standard_normal((batch, len(mean))) @ root.T
            kept.append(x[np.all((x >= lower) & (x <= upper), axis=1)])
            proposed, accepted = proposed + batch, accepted + len(kept[-1])
            gibbs[n] = proposed >= largest and accepted < min_acceptance * proposed
            batch = min(largest, math.ceil(1.5 * (n_draws - accepted) * proposed / max(accepted, 1)))
        if not gibbs[n]:
            draws[:, n] = np.concatenate(kept)[:n_draws]
    if gibbs.any():
        draws[:, gibbs] = _gibbs_truncated(means[gibbs], covariances[gibbs], lower, upper, n_draws, rng)
    return draws, gibbs


def tarp_credibility(draws, truths, references) -> np.ndarray:
    """TARP credibility f_n (N,) of each truth (Lemos et al. 2023, Sec. 3).

    f_n is the fraction of the posterior draws closer (Euclidean) to the reference point r_n
    than the truth is: the credibility of the smallest ball around r_n holding the truth. For
    calibrated posteriors f is uniform in [0, 1] whatever the references (ibid.).
    """
    reach = np.linalg.norm(truths - references, axis=-1)
    return np.mean(np.linalg.norm(draws - references, axis=-1) < reach, axis=0)


def tarp_coverage(credibility, alpha) -> np.ndarray:
    """Expected coverage probability ECP(alpha) = mean_n 1[f_n < alpha] (Lemos et al. 2023)."""
    return np.mean(np.asarray(credibility)[:, None] < np.asarray(alpha), axis=0)


def _coverage(levels_1d, level_joint, names) -> dict:
    """Coverage of credible regions from each truth's credibility levels, with binomial tests."""
    n = len(level_joint)
    inside = {name: [np.abs(levels_1d[:, p] - 0.5) < a / 2 for a in LEVELS] for p, name in enumerate(names)}
    inside["joint"] = [level_joint < a for a in LEVELS]
    p_values = [stats.binomtest(int(k.sum()), n, a).pvalue for hits in inside.values()
                for k, a in zip(hits, LEVELS)]
    return {"levels": list(LEVELS),
            "coverage": {name: [float(k.mean()) for k in hits] for name, hits in inside.items()},
            "band_2sigma": [[a - 2 * math.sqrt(a * (1 - a) / n), a + 2 * math.sqrt(a * (1 - a) / n)]
                            for a in LEVELS],
            "min_p_value": float(min(p_values)),
            "calibrated": bool(min(p_values) > SIGNIFICANCE / len(p_values))}


def _tarp(draws, truths, lower, upper, rng, n_alpha: int = 50, n_bootstrap: int = 200) -> dict:
    """TARP on the box mapped to the unit cube, one uniform reference per posterior; the test
    statistic is the largest distance of ECP from the diagonal, D = sup |ECP(alpha) - alpha|
    (Kolmogorov-Smirnov against uniform credibilities), with its 99% band under calibration."""
    width = upper - lower
    references = rng.uniform(size=truths.shape)
    f = tarp_credibility((draws - lower) / width, (truths - lower) / width, references)
    alpha = np.linspace(0.0, 1.0, n_alpha + 1)
    boot = [tarp_coverage(f[rng.integers(len(f), size=len(f))], alpha) for _ in range(n_bootstrap)]
    ks = stats.kstest(f, "uniform")
    return {"alpha": alpha.tolist(), "ecp": tarp_coverage(f, alpha).tolist(),
            "ecp_band_95": np.percentile(boot, [2.5, 97.5], axis=0).tolist(),
            "distance": float(ks.statistic),
            "distance_band": float(stats.kstwo.ppf(1 - SIGNIFICANCE, len(f))),
            "p_value": float(ks.pvalue), "calibrated": bool(ks.pvalue > SIGNIFICANCE)}


def _sbc(ranks, n_draws: int, names, n_bins: int = 20) -> dict:
    """SBC rank histograms and chi^2 tests of their uniformity over 0..L (Talts et al. 2018).

    Rank r goes to bin floor(r B / (L + 1)); each bin expects N x (its share of the L + 1 ranks).
    """
    n_bins = min(n_bins, n_draws + 1)
    share = np.bincount(np.arange(n_draws + 1) * n_bins // (n_draws + 1), minlength=n_bins) / (n_draws + 1)
    counts = [np.bincount(r * n_bins // (n_draws + 1), minlength=n_bins) for r in ranks.T]
    p_values = [stats.chisquare(c, share * len(ranks)).pvalue for c in counts]
    return {"n_bins": n_bins, "histograms": {name: c.tolist() for name, c in zip(names, counts)},
            "p_values": {name: float(p) for name, p in zip(names, p_values)},
            "calibrated": bool(min(p_values) > SIGNIFICANCE / len(names))}


def _sigma_vs_error(means, covariances, truths, names) -> dict:
    """RMS of z = (mu - theta) / sigma per parameter (1 when calibrated); sum z^2 ~ chi^2_N tested
    two-sided. Uses the Gaussian's mean and sigma, untruncated."""
    sigma = np.sqrt(np.diagonal(covariances, axis1=1, axis2=2))
    error = means - truths
    chi2 = np.sum((error / sigma) ** 2, axis=0)
    p_values = 2 * np.minimum(stats.chi2.cdf(chi2, len(truths)), stats.chi2.sf(chi2, len(truths)))
    return {"rms_z": dict(zip(names, np.sqrt(chi2 / len(truths)).tolist())),
            "rms_error": dict(zip(names, np.sqrt(np.mean(error**2, axis=0)).tolist())),
            "rms_sigma": dict(zip(names, np.sqrt(np.mean(sigma**2, axis=0)).tolist())),
            "p_values": dict(zip(names, p_values.tolist())),
            "calibrated": bool(p_values.min() > SIGNIFICANCE / len(names))}


def diagnostics(means, covariances, truths, lower, upper, names: Sequence[str],
                rng: np.random.Generator, n_draws: int = 500) -> dict:
    """Calibration of N Gaussian posteriors truncated to the prior box, against their truths.

    From n_draws draws per posterior: a truth's 1-D level is its rank r among the draws over L
    (the SBC rank), inside the equal-tailed a-interval when |r / L - 1/2| < a / 2; its joint level
    is the fraction of draws of smaller Mahalanobis distance, inside the highest-density a-region
    when below a (untruncated this is the chi^2_P quantile rule d^2 < chi^2_P^-1(a); the box
    keeps the order of density). ``n_gibbs`` counts the posteriors drawn by Gibbs sampling
    (:func:`sample_truncated`). Returns a dict for json.dumps (module docstring).
    """
    lower, upper = np.asarray(lower, dtype=float), np.asarray(upper, dtype=float)
    draws, gibbs = sample_truncated(means, covariances, lower, upper, n_draws, rng)
    ranks = np.sum(draws < truths, axis=0)
    d2_truth = _mahalanobis2(truths, means, covariances)
    level_joint = np.mean(_mahalanobis2(draws, means, covariances) < d2_truth, axis=0)
    log_gauss = -0.5 * (d2_truth + np.linalg.slogdet(covariances)[1] + means.shape[1] * math.log(2 * math.pi))
    return {"n_posteriors": len(means), "n_draws": n_draws,
            "coverage": _coverage(ranks / n_draws, level_joint, names),
            "tarp": _tarp(draws, truths, lower, upper, rng),
            "sbc": _sbc(ranks, n_draws, names),
            "n_gibbs": int(gibbs.sum()), "mean_log_density": float(np.mean(log_gauss)),
            "sigma_vs_error": _sigma_vs_error(means, covariances, truths, names)}


def temperature_scaling(validation, test, lower, upper, names: Sequence[str], rng: np.random.Generator,
                        n_draws: int = 500) -> dict:
    """Fit the covariance scale s on the validation split (:func:`fit_inflation`) and diagnose the
    test split before (s = 1) and after; ``validation`` and ``test`` are (means, covariances,
    truths)."""
    inflation = fit_inflation(*validation)
    means, covariances, truths = test
    return {"inflation": inflation,
            "before": diagnostics(means, covariances, truths, lower, upper, names, rng, n_draws),
            "after": diagnostics(means, covariances * inflation, truths, lower, upper, names, rng, n_draws)}


CALIBRATION_TESTS = ("coverage", "tarp", "sbc", "sigma_vs_error")
"""The tests of :func:`diagnostics` a posterior must pass to be called calibrated."""


def failed_tests(diagnosed: Mapping) -> list[str]:
    """The calibration tests (:data:`CALIBRATION_TESTS`) that a :func:`diagnostics` result
    fails, each with its smallest p-value, e.g. 'sbc (p = 0.0003)'; empty when calibrated."""
    def smallest(test: Mapping) -> float:
        if "min_p_value" in test:
            return test["min_p_value"]
        return min(test["p_values"].values()) if isinstance(test.get("p_values"), dict) else test["p_value"]

    return [f"{name} (p = {smallest(diagnosed[name]):.2g})" for name in CALIBRATION_TESTS
            if not diagnosed[name]["calibrated"]]


def information_gain(covariances: Mapping[str, np.ndarray], names: Sequence[str],
                     failures: Mapping[str, Sequence[str]], reference: str = "network",
                     n_resamples: int = 1000, seed: int = 0) -> dict:
    """How much narrower the ``reference`` model's posteriors are than every other model's.

    covariances: {model: (G, P, P)}, the posteriors of the same G simulations (the calibrated
    ones: inflated, :func:`fit_inflation`); failures: {model: the tests it fails
    (:func:`failed_tests`)}. Per other model and parameter p, the ratio of RMS posterior
    standard deviations over the simulations,

        sigma_ratio_p = sqrt(mean_g Sigma_pp^model / mean_g Sigma_pp^reference),

    and the ratio of the figures of merit FoM = (det Sigma)^-1/2 (Albrecht et al. 2006, the
    Dark Energy Task Force's, here over all P parameters), their geometric means over the
    simulations, fom_ratio = exp(mean_g (log det Sigma^model - log det Sigma^reference) / 2):
    both above 1 where the reference's posteriors are the tighter. Intervals (the
    ``interval`` percentiles, :data:`analysis.metrics.BOOTSTRAP_INTERVAL`) from ``n_resamples``
    resamples of the simulations with replacement, the same for every model (paired). A width
    means something only for calibrated posteriors: where the model or the reference fails a
    test, its ratios are None and ``excluded`` names who fails what.
    """
    ids = np.random.default_rng(seed).integers(0, len(covariances[reference]),
                                               size=(n_resamples, len(covariances[reference])))
    low, high = BOOTSTRAP_INTERVAL

    def variances_and_logdet(model):
        matrices = np.asarray(covariances[model], np.float64)
        return np.diagonal(matrices, axis1=1, axis2=2), np.linalg.slogdet(matrices)[1]

    def estimate(values, resampled):
        return {"ratio": float(values), "ratio_low": float(np.percentile(resampled, low)),
                "ratio_high": float(np.percentile(resampled, high))}

    variances, logdet = variances_and_logdet(reference)
    gain = {"reference": reference, "n_simulations": len(logdet), "n_resamples": int(n_resamples),
            "interval": [low, high], "models": {}}
    for model in covariances:
        if model == reference:
            continue
        excluded = {who: list(failures[who]) for who in (model, reference) if failures[who]}
        if excluded:
            empty = {"ratio": None, "ratio_low": None, "ratio_high": None}
            gain["models"][model] = {"sigma_ratio": {name: dict(empty) for name in names},
                                     "fom_ratio": dict(empty), "excluded": excluded}
            continue
        their_variances, their_logdet = variances_and_logdet(model)
        sigma_ratio = np.sqrt(their_variances.mean(axis=0) / variances.mean(axis=0))
        resampled = np.sqrt(their_variances[ids].mean(axis=1) / variances[ids].mean(axis=1))  # (B, P)
        half_log = (their_logdet - logdet) / 2
        gain["models"][model] = {
            "sigma_ratio": {name: estimate(sigma_ratio[p], resampled[:, p]) for p, name in enumerate(names)},
            "fom_ratio": estimate(np.exp(half_log.mean()), np.exp(half_log[ids].mean(axis=1))),
            "excluded": None}
    return gain
