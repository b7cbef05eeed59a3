"""Linear power spectrum and growth factors against independent references."""

import dataclasses
import importlib.util
import math
import sys

import numpy as np
import pytest
from scipy import integrate

from conftest import FIXED_COSMOLOGY, skip_unless_ci
from simulations.cosmology import (
    Background,
    Cosmology,
    eisenstein_hu_transfer,
    linear_power,
    tophat_window,
)
from workflow.errors import PipelineError

FIDUCIAL = Cosmology(Omega_m=0.3, sigma_8=0.8, n_s=0.96, **FIXED_COSMOLOGY)


def sigma_by_quadrature(cosmo, radius):
    """sigma(R) by adaptive quadrature in k (not ln k), independent of sigma_tophat's grid."""
    def integrand(k):
        return k**2 * linear_power(cosmo, np.array([k]))[0] * tophat_window(k * radius) ** 2
    edges = np.geomspace(1e-6, 1e4, 61)
    total = sum(integrate.quad(integrand, lo, hi, epsrel=1e-10, limit=500)[0]
                for lo, hi in zip(edges[:-1], edges[1:]))
    return math.sqrt(total / (2 * math.pi**2))


@pytest.mark.parametrize("transfer", ["eisenstein_hu", "eisenstein_hu_nowiggle"])
@pytest.mark.parametrize("omega_m, sigma_8, n_s", [(0.25, 0.78, 0.9), (0.35, 0.95, 1.0)])
def test_normalised_spectrum_reproduces_sigma_8(transfer, omega_m, sigma_8, n_s):
    cosmo = dataclasses.replace(FIDUCIAL, Omega_m=omega_m, sigma_8=sigma_8, n_s=n_s, transfer=transfer)
    assert sigma_by_quadrature(cosmo, 8.0) == pytest.approx(sigma_8, rel=1e-4)


def carroll_press_turner_growth(omega_m0, a):
    """D1(a) from the Carroll, Press & Turner (1992) eq. (29) fit, normalised to D1(1) = 1."""
    def g(a_):
        e2 = omega_m0 * a_**-3 + 1 - omega_m0
        om, ol = omega_m0 * a_**-3 / e2, (1 - omega_m0) / e2
        return 2.5 * om / (om ** (4 / 7) - ol + (1 + om / 2) * (1 + ol / 70))
    return a * g(a) / g(1.0)


@pytest.mark.parametrize("omega_m", [0.2, 0.25, 0.3, 0.35, 0.5, 1.0])
def test_growth_factors_follow_standard_approximations(omega_m):
    # Measured worst cases over 1e-3 <= a <= 1: D1 vs CPT 0.6% (Omega_m = 0.2), D2 vs
    # Bouchet 0.02%, f1 vs Linder 1.3%, f2 0.4%. (CPT degrades to 2.1% at Omega_m = 0.1.)
    background = Background(dataclasses.replace(FIDUCIAL, Omega_m=omega_m, Omega_b=0.04))
    a = np.geomspace(1e-3, 1.0, 40)
    d1 = background.D1(a)
    np.testing.assert_allclose(d1, carroll_press_turner_growth(omega_m, a), rtol=0.02)
    # Bouchet et al. 1995: D2 ≈ -3/7 D1^2 Omega_m(a)^(-1/143)
    np.testing.assert_allclose(
        background.D2(a), -3 / 7 * d1**2 * background.Omega_m_a(a) ** (-1 / 143), rtol=0.02)
    # growth rates: f1 ≈ Omega_m(a)^0.55 (Linder 2005), f2 ≈ 2 Omega_m(a)^(6/11)
    np.testing.assert_allclose(background.f1(a), background.Omega_m_a(a) ** 0.55, rtol=0.015)
    np.testing.assert_allclose(background.f2(a), 2 * background.Omega_m_a(a) ** (6 / 11),
                               rtol=0.01)
    assert background.D1(1.0) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("omega_m", [0.1, 0.3])
def test_linear_growth_matches_exact_lcdm_integral(omega_m):
    """Heath (1977): D1 ∝ E(a) ∫_0^a da' / (a' E(a'))^3, exact for flat ΛCDM."""
    background = Background(dataclasses.replace(FIDUCIAL, Omega_m=omega_m, Omega_b=0.04))

    def heath(a):
        def e(x):
            return math.sqrt(omega_m * x**-3 + 1 - omega_m)
        return e(a) * integrate.quad(lambda x: (x * e(x)) ** -3, 0, a, epsrel=1e-12)[0]

    a = np.array([0.01, 0.1, 0.5, 2.0])
    np.testing.assert_allclose(background.D1(a), [heath(x) / heath(1.0) for x in a],
                               rtol=1e-6)


def test_einstein_de_sitter_growth_is_exact():
    background = Background(dataclasses.replace(FIDUCIAL, Omega_m=1.0))
    a = np.array([1e-4, 0.02, 0.5, 1.0, 3.0])
    np.testing.assert_allclose(background.D1(a), a, rtol=1e-8)
    np.testing.assert_allclose(background.D2(a), -3 / 7 * a**2, rtol=1e-8)
    np.testing.assert_allclose(background.f1(a), 1.0, rtol=1e-8)
    np.testing.assert_allclose(background.f2(a), 2.0, rtol=1e-8)
    np.testing.assert_allclose(background.E(a), a**-1.5, rtol=1e-12)


def test_growth_factor_at_z49_matches_music():
    # MUSIC2 reports D+_start = 0.0256745 for this cosmology (reference/music2-generic).
    background = Background(dataclasses.replace(FIDUCIAL, T_cmb=2.726))
    assert background.D1(1 / 50) == pytest.approx(0.0256745, rel=1e-5)


def test_growth_outside_solved_range_raises():
    with pytest.raises(ValueError, match="scale factor"):
        Background(FIDUCIAL).D1(np.array([1e-7, 0.5]))


def test_eisenstein_hu_matches_camb():
    if importlib.util.find_spec("camb") is None:
        skip_unless_ci("camb (the test extra) is not installed")
    k = np.geomspace(0.01, 1.0, 300)
    ratio = (linear_power(FIDUCIAL, k)
             / linear_power(dataclasses.replace(FIDUCIAL, transfer="camb"), k))
    # Measured: 0.975 <= EH98 / CAMB <= 1.040 over 0.01-1 h/Mpc (EH98's fitting accuracy,
    # plus CAMB's radiation and neutrinos that the fit leaves out).
    np.testing.assert_allclose(ratio, 1.0, atol=0.05)
    assert abs(np.mean(ratio) - 1.0) < 0.02


def test_camb_missing_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "camb", None)  # makes `import camb` fail
    cosmo = dataclasses.replace(FIDUCIAL, Omega_m=0.31, transfer="camb")
    with pytest.raises(PipelineError, match="transfer = 'camb'"):
        linear_power(cosmo, np.array([0.1]))


def test_nowiggle_is_smooth_and_close_to_wiggle():
    k = np.geomspace(0.01, 1.0, 2000)
    wiggle = linear_power(FIDUCIAL, k)
    smooth = linear_power(dataclasses.replace(FIDUCIAL, transfer="eisenstein_hu_nowiggle"), k)
    # The no-wiggle logarithmic slope decreases monotonically; with wiggles it does not.
    slope_smooth = np.gradient(np.log(smooth), np.log(k))
    slope_wiggle = np.gradient(np.log(wiggle), np.log(k))
    assert np.all(np.diff(slope_smooth) < 0)
    assert np.sum(np.diff(np.sign(np.diff(slope_wiggle))) != 0) >= 6  # >= 3 acoustic peaks
    ratio = wiggle / smooth
    np.testing.assert_allclose(ratio, 1.0, atol=0.08)
    assert np.ptp(ratio[(k > 0.05) & (k < 0.3)]) > 0.05  # baryon acoustic oscillations present


def test_transfer_tends_to_one_on_large_scales():
    assert eisenstein_hu_transfer(FIDUCIAL, np.array([1e-5]))[0] == pytest.approx(1.0, abs=1e-4)


def test_table_transfer_reproduces_tabulated_function(tmp_path):
    k_table = np.geomspace(1e-4, 50.0, 400)
    table = tmp_path / "transfer.txt"
    np.savetxt(table, np.column_stack([k_table, eisenstein_hu_transfer(FIDUCIAL, k_table)]))
    tabulated = dataclasses.replace(FIDUCIAL, transfer="table", transfer_table=str(table))
    k = np.geomspace(1e-3, 10.0, 100)
    np.testing.assert_allclose(linear_power(tabulated, k), linear_power(FIDUCIAL, k),
                               rtol=1e-3)


@pytest.mark.parametrize("contents, message", [
    (None, "does not exist"),
    ("0.1 1.0 3\n0.2 0.9 3\n0.3 0.8 3\n0.4 0.7 3\n", "two"),
    ("0.1 1.0\n0.2 oops\n", "numeric"),
    ("0.3 1.0\n0.2 0.9\n0.1 0.8\n0.05 0.7\n", "increasing"),
])
def test_bad_transfer_table_raises(tmp_path, contents, message):
    table = tmp_path / "transfer.txt"
    if contents is not None:
        table.write_text(contents)
    cosmo = dataclasses.replace(FIDUCIAL, transfer="table", transfer_table=str(table))
    with pytest.raises(PipelineError, match=message) as error:
        linear_power(cosmo, np.array([0.1]))
    assert str(table) in str(error.value)


@pytest.mark.parametrize("changes, name", [
    ({"Omega_m": 0.0}, "Omega_m"),
    ({"Omega_m": 1.2}, "Omega_m"),
    ({"Omega_m": float("nan")}, "Omega_m"),
    ({"Omega_b": 0.4}, "Omega_b"),
    ({"Omega_b": 0.0}, "Omega_b"),
    ({"sigma_8": -0.8}, "sigma_8"),
    ({"n_s": 0.0}, "n_s"),
    ({"h": 0.0}, "h"),
    ({"T_cmb": -1.0}, "T_cmb"),
    ({"transfer": "bbks"}, "transfer"),
    ({"transfer": "table"}, "transfer_table"),
    ({"transfer_table": "t.txt"}, "transfer_table"),
])
def test_bad_parameters_raise(changes, name):
    with pytest.raises(PipelineError, match=name):
        dataclasses.replace(FIDUCIAL, **changes)


def test_omega_lambda_closes_flat_universe():
    assert FIDUCIAL.Omega_L == pytest.approx(0.7)
