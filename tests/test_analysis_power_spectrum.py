"""The P(k) estimator against fields of known spectrum: Gaussian random fields, Poisson samples
(shot noise and its alias sum, Jing 2005) and Poisson-sampled plane waves (the window)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft

from analysis import power_spectrum as ps
from preprocessing.histogram import count_ngp
from simulations.mesh import paint_cic
from workflow.errors import PipelineError


def gaussian_field(n: int, box: float, power, seed: int) -> np.ndarray:
    """A real Gaussian field with <|delta_k|^2> L^3 / n^6 = power(|k|) on every mode k != 0."""
    noise = np.random.default_rng(seed).standard_normal((n, n, n))
    k_axis = 2 * np.pi * scipy.fft.fftfreq(n, box / n)
    k_last = 2 * np.pi * scipy.fft.rfftfreq(n, box / n)
    k = np.sqrt(k_axis[:, None, None] ** 2 + k_axis[None, :, None] ** 2 + k_last ** 2)
    amplitude = np.zeros_like(k)
    amplitude[k > 0] = np.sqrt(power(k[k > 0]) * n**3 / box**3)
    return scipy.fft.irfftn(scipy.fft.rfftn(noise) * amplitude, s=(n, n, n))


def mode_table(n: int, box: float):
    """|k| (h/Mpc), full-sphere multiplicity and the per-axis sin^2(pi m / n), rfftn layout."""
    m = scipy.fft.fftfreq(n, 1 / n)
    m_last = np.arange(n // 2 + 1)
    k = 2 * np.pi / box * np.sqrt(m[:, None, None] ** 2 + m[None, :, None] ** 2 + m_last**2)
    multiplicity = np.broadcast_to(np.where((m_last == 0) | (2 * m_last == n), 1, 2), k.shape)
    s2 = [np.sin(np.pi * m / n)[:, None, None] ** 2, np.sin(np.pi * m / n)[None, :, None] ** 2,
          np.sin(np.pi * m_last / n)[None, None, :] ** 2]
    return k, multiplicity, s2


def binned_mean(values, k, multiplicity, edges):
    """Multiplicity-weighted mean of ``values`` over the modes in each bin (numpy, independent)."""
    index = np.digitize(k.ravel(), edges) - 1
    inside = (index >= 0) & (index < len(edges) - 1) & (k.ravel() > 0)
    weight = np.broadcast_to(multiplicity, k.shape).ravel()[inside]
    sums = np.bincount(index[inside], weights=weight * np.broadcast_to(values, k.shape).ravel()[inside],
                       minlength=len(edges) - 1)
    counts = np.bincount(index[inside], weights=weight, minlength=len(edges) - 1)
    return sums / counts, counts


def uniform_particles(n_particles: int, box: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, box, (n_particles, 3)).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Gaussian random fields


def power_law_with_cutoff(k):
    """A smooth spectrum in (Mpc/h)^3 of k in h/Mpc, varying by 10^3 over the box's modes."""
    return 2.0e4 * (k / 0.05) ** -1.5 * np.exp(-((k / 0.6) ** 2))


@pytest.mark.parametrize("binning", ["log", "linear"])
def test_gaussian_field_spectrum_is_recovered_within_cosmic_variance(binning):
    n, box = 64, 400.0
    delta = gaussian_field(n, box, power_law_with_cutoff, seed=4)
    spectrum = ps.power_spectrum(delta, box, kind="overdensity", binning=binning)
    expected = ps.bin_average(power_law_with_cutoff, n, box, spectrum.k_edges)
    sigma = expected * np.sqrt(2.0 / spectrum.n_modes)
    pull = (spectrum.power - expected) / sigma
    assert np.all(np.abs(pull) < 4.0), pull
    # The scatter itself is the cosmic variance: chi^2 per bin near 1, not far below.
    chi2 = float(np.mean(pull**2))
    assert 0.4 < chi2 < 2.0, chi2
    # The bins span the box: first bin at the fundamental mode, last at the Nyquist frequency.
    assert spectrum.k[0] == pytest.approx(2 * np.pi / box, rel=0.3)
    assert spectrum.k[-1] <= np.pi * n / box * 1.01
    assert spectrum.n_modes.sum() > 0.5 * 4 / 3 * np.pi * (n / 2) ** 3


def test_bin_average_and_mode_counts_agree_with_a_direct_count():
    n, box = 32, 100.0
    k, multiplicity, _ = mode_table(n, box)
    edges = ps.k_bin_edges(n, box, "log", n_bins=9)
    spectrum = ps.power_spectrum(np.random.default_rng(0).standard_normal((n,) * 3), box,
                                 kind="overdensity", k_edges=edges)
    mean_k, counts = binned_mean(k, k, multiplicity, edges)
    np.testing.assert_array_equal(spectrum.n_modes, counts)
    np.testing.assert_allclose(spectrum.k, mean_k, rtol=1e-12)
    np.testing.assert_allclose(ps.bin_average(lambda x: x**2, n, box, edges),
                               binned_mean(k**2, k, multiplicity, edges)[0], rtol=1e-12)


def test_default_log_bins_are_never_empty():
    for n in (4, 8, 16, 32, 64, 128):
        for box in (50.0, 128.0, 512.0):
            counts = np.ones((n,) * 3)
            counts[0, 0, 0] = 2.0
            assert np.all(ps.power_spectrum(counts, box).n_modes > 0), (n, box)


def test_a_single_precision_grid_gives_the_double_precision_spectrum():
    n, box = 64, 256.0
    counts = np.random.default_rng(2).poisson(8.0, (n,) * 3)
    single = ps.power_spectrum(counts.astype(np.float32), box, assignment="cic")
    double = ps.power_spectrum(counts.astype(np.float64), box, assignment="cic")
    np.testing.assert_allclose(single.power, double.power, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# Poisson samples: shot noise 1/nbar and its alias sum C(k)


@pytest.fixture(scope="module")
def poisson_sample():
    n, box, n_particles = 32, 100.0, 32**3 * 4
    positions = uniform_particles(n_particles, box, seed=9)
    return n, box, n_particles, positions


def test_ngp_counts_of_a_poisson_sample_have_flat_shot_noise(poisson_sample):
    """NGP's alias sum is exactly 1 (Jing 2005): the raw P(k) is 1/nbar at every k."""
    n, box, n_particles, positions = poisson_sample
    counts = count_ngp(positions, box, n)
    spectrum = ps.power_spectrum(counts, box, binning="linear")
    shot = box**3 / n_particles
    sigma = shot * np.sqrt(2.0 / spectrum.n_modes)
    pull = (spectrum.power - shot) / sigma
    assert np.all(np.abs(pull) < 4.0), pull
    assert 0.4 < np.mean(pull**2) < 2.0
    subtracted = ps.power_spectrum(counts, box, binning="linear", shot_noise="poisson")
    assert subtracted.shot_noise == pytest.approx(shot, rel=1e-12)
    assert np.all(np.abs(subtracted.power / sigma) < 4.0)


def test_cic_counts_of_a_poisson_sample_follow_the_alias_sum(poisson_sample):
    """CIC's raw shot noise is S prod_d (1 - 2/3 sin^2(pi m_d / n)); deconvolved and subtracted,
    nothing is left."""
    n, box, n_particles, positions = poisson_sample
    counts = paint_cic(positions, box, n)
    shot = box**3 / n_particles
    k, multiplicity, s2 = mode_table(n, box)
    alias = np.prod(np.broadcast_arrays(*(1 - 2 / 3 * s for s in s2)), axis=0)

    raw = ps.power_spectrum(counts, box, binning="linear")
    expected_raw, _ = binned_mean(shot * alias, k, multiplicity, raw.k_edges)
    pull = (raw.power - expected_raw) / (expected_raw * np.sqrt(2.0 / raw.n_modes))
    assert np.all(np.abs(pull) < 4.0), pull
    assert expected_raw[-1] < 0.5 * shot  # the alias sum is far from flat near Nyquist

    m = scipy.fft.fftfreq(n, 1 / n)
    m_last = np.arange(n // 2 + 1)
    sinc_sq = [np.sinc(m / n)[:, None, None] ** 4, np.sinc(m / n)[None, :, None] ** 4,
               np.sinc(m_last / n)[None, None, :] ** 4]
    window_sq = np.prod(np.broadcast_arrays(*sinc_sq), axis=0)
    deconvolved_noise, _ = binned_mean(shot * alias / window_sq, k, multiplicity, raw.k_edges)
    subtracted = ps.power_spectrum(counts, box, binning="linear", assignment="cic",
                                   shot_noise="poisson")
    sigma = deconvolved_noise * np.sqrt(2.0 / subtracted.n_modes)
    assert np.all(np.abs(subtracted.power / sigma) < 4.0)
    unsubtracted = ps.power_spectrum(counts, box, binning="linear", assignment="cic")
    np.testing.assert_allclose(unsubtracted.power - subtracted.power, deconvolved_noise,
                               rtol=1e-10)


# ------------------------------------------------------------------------------------------
# The window: Poisson-sampled plane waves


@pytest.fixture(scope="module")
def plane_wave_sample():
    """Particles drawn from 1 + A [cos(k0 x) + cos(k0 y) + cos(k0 z)] + B cos(k0 (x + y)),
    k0 = k_Nyquist / 2 on a 32^3 mesh."""
    n, box, n_particles = 32, 64.0, 2_000_000
    amplitude, diagonal = 0.2, 0.2
    k0 = 2 * np.pi * (n // 4) / box
    rng = np.random.default_rng(5)
    accepted = []
    total = 0
    while total < n_particles:
        x = rng.uniform(0, box, (n_particles, 3))
        density = 1 + amplitude * np.cos(k0 * x).sum(axis=1) + diagonal * np.cos(k0 * (x[:, 0] + x[:, 1]))
        keep = rng.uniform(0, 1 + 3 * amplitude + diagonal, len(x)) < density
        accepted.append(x[keep])
        total += keep.sum()
    positions = np.concatenate(accepted)[:n_particles].astype(np.float32)
    return n, box, positions, amplitude, diagonal


@pytest.mark.parametrize("assignment, order", [("ngp", 1), ("cic", 2)])
def test_window_deconvolution_recovers_plane_wave_amplitudes(plane_wave_sample, assignment, order):
    n, box, positions, amplitude, diagonal = plane_wave_sample
    counts = count_ngp(positions, box, n) if assignment == "ngp" else paint_cic(positions, box, n)
    m0 = n // 4
    axis_modes = [(m0, 0, 0), (0, m0, 0), (0, 0, m0)]
    diagonal_mode = (m0, m0, 0)
    raw = ps.fourier_overdensity(counts, box, assignment="none")
    deconvolved = ps.fourier_overdensity(counts, box, assignment=assignment)
    window_axis = np.sinc(m0 / n) ** order  # sinc(pi m / n)^p, numpy's sinc(x) = sin(pi x)/(pi x)
    for mode, expected, window in [*((m, amplitude / 2, window_axis) for m in axis_modes),
                                   (diagonal_mode, diagonal / 2, window_axis**2)]:
        measured_raw = abs(raw[mode]) / n**3
        measured = abs(deconvolved[mode]) / n**3
        assert measured == pytest.approx(expected, rel=0.03), (mode, measured)
        assert measured_raw == pytest.approx(expected * window, rel=0.03), (mode, measured_raw)
    # The window matters here: 10% (NGP) to 34% (CIC, diagonal) in amplitude.
    assert window_axis**2 < 0.92


def test_binned_power_of_a_plane_wave_shell(plane_wave_sample):
    """The |m| = n/4 shell holds exactly the six axis modes, so its power is (A/2)^2 L^3."""
    n, box, positions, amplitude, _ = plane_wave_sample
    counts = paint_cic(positions, box, n)
    k0 = 2 * np.pi * (n // 4) / box
    edges = [k0 * 0.999, k0 * 1.001]
    spectrum = ps.power_spectrum(counts, box, assignment="cic", shot_noise="poisson", k_edges=edges)
    assert spectrum.n_modes.tolist() == [6]
    assert spectrum.power[0] == pytest.approx((amplitude / 2) ** 2 * box**3, rel=0.05)
    no_window = ps.power_spectrum(counts, box, shot_noise="poisson", k_edges=edges)
    assert no_window.power[0] < 0.7 * spectrum.power[0]


# ------------------------------------------------------------------------------------------
# Summary statistics


def test_one_point_statistics_by_hand():
    counts = np.array([0, 1, 3, 3])
    values = np.log([1.0, 2.0, 4.0, 4.0])
    mean = values.mean()
    central = values - mean
    variance = np.mean(central**2)
    skewness = np.mean(central**3) / variance**1.5
    kurtosis = np.mean(central**4) / variance**2 - 3
    stats = ps.one_point_statistics(counts, percentiles=(50.0,))
    median = (np.log(2.0) + np.log(4.0)) / 2  # between the 2nd and 3rd of 4 values
    np.testing.assert_allclose(stats, [mean, variance, skewness, kurtosis, median], rtol=1e-12)
    constant = ps.one_point_statistics(np.full(8, 2), percentiles=())
    np.testing.assert_allclose(constant, [np.log(3.0), 0, 0, 0])


def test_summary_statistics_of_a_two_channel_sample():
    n, box = 16, 128.0
    rng = np.random.default_rng(3)
    sample = rng.poisson(8.0, (n, n, n, 2)).astype(np.int16)
    features = ps.summary_statistics(sample, box)
    names = ps.summary_names(n, box, n_channels=2)
    assert features.shape == (len(names),) and np.all(np.isfinite(features))
    n_power = sum(name.startswith("c0_log10P") for name in names)
    first = ps.power_spectrum(np.ascontiguousarray(sample[..., 0]), box, assignment="ngp")
    np.testing.assert_allclose(features[:n_power], np.log10(first.power))
    second = len(names) // 2
    np.testing.assert_allclose(features[second + n_power:],
                               ps.one_point_statistics(sample[..., 1]))
    stack = ps.summary_features(np.stack([sample, sample[::-1]]), box)
    assert stack.shape == (2, len(names))


# ------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("grid, options, message", [
    (np.ones((8, 8, 4)), {}, "shape"),
    (np.ones((7, 7, 7)), {}, "even"),
    (np.zeros((8, 8, 8)), {}, "positive mean"),
    (np.ones((8, 8, 8)), {"assignment": "pcs"}, "assignment"),
    (np.ones((8, 8, 8)), {"kind": "overdensity", "shot_noise": "poisson"}, "kind = 'counts'"),
    (np.ones((8, 8, 8)), {"k_edges": [0.2, 0.1]}, "increasing"),
    (np.ones((8, 8, 8)), {"binning": "octave"}, "binning"),
    (np.ones((8, 8, 8)), {"shot_noise": -1.0}, "non-negative"),
])
def test_bad_input_is_refused_with_a_clear_error(grid, options, message):
    with pytest.raises(PipelineError, match=message):
        ps.power_spectrum(grid, 100.0, **options)
    with pytest.raises(PipelineError, match="box_size"):
        ps.power_spectrum(np.ones((8, 8, 8)), -1.0)
    assert math.isfinite(ps.k_bin_edges(8, 100.0)[-1])
