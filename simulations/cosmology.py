"""Flat ΛCDM background, linear growth and the linear matter power spectrum at z = 0.

Used by the initial-conditions generator (P(k), D1, D2, f1, f2 at z_init) and by the COLA
integrator (E(a), growth factors). Writes no files.

Units: wavenumbers k in h/Mpc, lengths in Mpc/h, P(k) in (Mpc/h)^3, H0 = 100 h km/s/Mpc.
Radiation is neglected in the background, so E(a)^2 = Omega_m a^-3 + Omega_L (as in MUSIC
with ``ZeroRadiation = true`` and in pycola).

References
----------
EH98: Eisenstein & Hu 1998, ApJ 496, 605 ("Baryonic features in the matter transfer function").
Bouchet et al. 1995, A&A 296, 575 (second-order growth); Carroll, Press & Turner 1992, ARA&A 30,
499 (growth-factor fit used in the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Callable

import numpy as np
from scipy import integrate, interpolate

from workflow.errors import PipelineError


SIGMA8_RADIUS = 8.0
"""Top-hat radius (Mpc/h) at which the spectrum is normalised to sigma_8."""

_SIGMA_K_RANGE = (1e-5, 1e3)  # h/Mpc; the top-hat integrand is < 1e-10 of its peak outside
_CAMB_K_MAX = 30.0  # h/Mpc; CAMB's P(k) is extrapolated as a power law beyond this


@dataclasses.dataclass(frozen=True)
class Cosmology:
    """Flat ΛCDM cosmology (immutable, hashable).

    Omega_m, Omega_b: matter and baryon density parameters today; sigma_8: rms linear density
    contrast in 8 Mpc/h top-hat spheres at z = 0; n_s: primordial spectral index; h: H0 / (100
    km/s/Mpc); T_cmb: CMB temperature in K; transfer: one of :data:`TRANSFERS`;
    transfer_table: path of a two-column text file (k [h/Mpc], T(k)) when transfer = 'table',
    else None. No defaults: the configuration's section ``cosmology`` holds them.
    """

    Omega_m: float
    sigma_8: float
    n_s: float
    h: float
    Omega_b: float
    T_cmb: float
    transfer: str
    transfer_table: str | None

    def __post_init__(self) -> None:
        checks = [
            (0.0 < self.Omega_m <= 1.0, "Omega_m", self.Omega_m, "in (0, 1]"),
            (0.0 < self.Omega_b < self.Omega_m, "Omega_b", self.Omega_b,
             f"in (0, Omega_m = {self.Omega_m})"),
            (0.0 < self.sigma_8 < 10.0, "sigma_8", self.sigma_8, "in (0, 10)"),
            (0.0 < self.n_s < 3.0, "n_s", self.n_s, "in (0, 3)"),
            (0.0 < self.h < 3.0, "h", self.h, "in (0, 3)"),
            (0.0 < self.T_cmb < 10.0, "T_cmb", self.T_cmb, "in (0, 10) K"),
            (self.transfer in TRANSFERS, "transfer", self.transfer,
             f"one of {', '.join(TRANSFERS)}"),
        ]
        for ok, name, value, expected in checks:
            # NaN fails every comparison, so it is rejected here too.
            if not ok:
                raise PipelineError(f"Cosmology parameter {name} = {value!r} must be {expected}.")
        if (self.transfer == "table") != (self.transfer_table is not None):
            raise PipelineError(
                f"Cosmology transfer_table = {self.transfer_table!r} must be given exactly when "
                f"transfer = 'table' (transfer is {self.transfer!r})."
            )

    @property
    def Omega_L(self) -> float:
        """Cosmological-constant density parameter today, 1 - Omega_m (flat, no radiation)."""
        return 1.0 - self.Omega_m


# ---------------------------------------------------------------------------------------------
# Transfer functions
# ---------------------------------------------------------------------------------------------

def eisenstein_hu_transfer(cosmo: Cosmology, k: np.ndarray) -> np.ndarray:
    """CDM + baryon transfer function with acoustic oscillations, EH98 eqs. (2)-(24).

    k in h/Mpc; returns T(k), dimensionless, T -> 1 as k -> 0.
    """
    k_mpc = np.asarray(k, dtype=float) * cosmo.h  # EH98 works in 1/Mpc
    omh2 = cosmo.Omega_m * cosmo.h**2
    obh2 = cosmo.Omega_b * cosmo.h**2
    f_b = cosmo.Omega_b / cosmo.Omega_m
    f_c = 1.0 - f_b
    theta = cosmo.T_cmb / 2.7

    z_eq = 2.50e4 * omh2 * theta**-4  # eq. (2)
    k_eq = 7.46e-2 * omh2 * theta**-2  # eq. (3), 1/Mpc
    b1 = 0.313 * omh2**-0.419 * (1.0 + 0.607 * omh2**0.674)  # eq. (4)
    b2 = 0.238 * omh2**0.223
    z_d = 1291.0 * omh2**0.251 / (1.0 + 0.659 * omh2**0.828) * (1.0 + b1 * obh2**b2)

    def baryon_to_photon(z: float) -> float:  # eq. (5)
        return 31.5 * obh2 * theta**-4 * (z / 1e3) ** -1

    r_d, r_eq = baryon_to_photon(z_d), baryon_to_photon(z_eq)
    sound_horizon = (2.0 / (3.0 * k_eq) * math.sqrt(6.0 / r_eq)  # eq. (6), Mpc
                     * math.log((math.sqrt(1 + r_d) + math.sqrt(r_d + r_eq))
                                / (1 + math.sqrt(r_eq))))
    k_silk = 1.6 * obh2**0.52 * omh2**0.73 * (1.0 + (10.4 * omh2) ** -0.95)  # eq. (7), 1/Mpc

    q = k_mpc / (13.41 * k_eq)  # eq. (10)
    ks = k_mpc * sound_horizon

    def t0_tilde(alpha: float, beta: float) -> np.ndarray:  # eqs. (19)-(20)
        log_term = np.log(math.e + 1.8 * beta * q)
        c = 14.2 / alpha + 386.0 / (1.0 + 69.9 * q**1.08)
        return log_term / (log_term + c * q**2)

    # Cold dark matter, eqs. (11), (12), (17), (18).
    a1 = (46.9 * omh2) ** 0.670 * (1.0 + (32.1 * omh2) ** -0.532)
    a2 = (12.0 * omh2) ** 0.424 * (1.0 + (45.0 * omh2) ** -0.582)
    alpha_c = a1**-f_b * a2 ** -(f_b**3)
    bb1 = 0.944 / (1.0 + (458.0 * omh2) ** -0.708)
    bb2 = (0.395 * omh2) ** -0.0266
    beta_c = 1.0 / (1.0 + bb1 * (f_c**bb2 - 1.0))
    f = 1.0 / (1.0 + (ks / 5.4) ** 4)
    t_cdm = f * t0_tilde(1.0, beta_c) + (1.0 - f) * t0_tilde(alpha_c, beta_c)

    # Baryons, eqs. (14), (15), (21)-(24).
    y = (1.0 + z_eq) / (1.0 + z_d)
    sqrt_1y = math.sqrt(1.0 + y)
    g_y = y * (-6.0 * sqrt_1y + (2.0 + 3.0 * y) * math.log((sqrt_1y + 1.0) / (sqrt_1y - 1.0)))
    alpha_b = 2.07 * k_eq * sound_horizon * (1.0 + r_d) ** -0.75 * g_y
    beta_b = 0.5 + f_b + (3.0 - 2.0 * f_b) * math.sqrt((17.2 * omh2) ** 2 + 1.0)
    beta_node = 8.41 * omh2**0.435
    with np.errstate(divide="ignore"):
        s_tilde = sound_horizon / (1.0 + (beta_node / ks) ** 3) ** (1.0 / 3.0)
        t_baryon = (t0_tilde(1.0, 1.0) / (1.0 + (ks / 5.2) ** 2)
                    + alpha_b / (1.0 + (beta_b / ks) ** 3) * np.exp(-((k_mpc / k_silk) ** 1.4)))
    t_baryon = t_baryon * np.sinc(k_mpc * s_tilde / np.pi)  # j0(x) = sin(x)/x

    return f_b * t_baryon + f_c * t_cdm  # eq. (16)


def eisenstein_hu_nowiggle_transfer(cosmo: Cosmology, k: np.ndarray) -> np.ndarray:
    """Zero-baryon-oscillation ("no-wiggle") transfer function, EH98 eqs. (26)-(31).

    k in h/Mpc; returns T(k), dimensionless. Same broadband shape as
    :func:`eisenstein_hu_transfer` with the acoustic oscillations removed.
    """
    k_h = np.asarray(k, dtype=float)
    omh2 = cosmo.Omega_m * cosmo.h**2
    obh2 = cosmo.Omega_b * cosmo.h**2
    f_b = cosmo.Omega_b / cosmo.Omega_m
    theta = cosmo.T_cmb / 2.7

    sound_horizon = 44.5 * math.log(9.83 / omh2) / math.sqrt(1.0 + 10.0 * obh2**0.75)  # (26)
    alpha_gamma = (1.0 - 0.328 * math.log(431.0 * omh2) * f_b  # eq. (31)
                   + 0.38 * math.log(22.3 * omh2) * f_b**2)
    gamma_eff = cosmo.Omega_m * cosmo.h * (  # eq. (30)
        alpha_gamma + (1.0 - alpha_gamma) / (1.0 + (0.43 * k_h * cosmo.h * sound_horizon) ** 4))
    q = k_h * theta**2 / gamma_eff  # eq. (28)
    l0 = np.log(2.0 * math.e + 1.8 * q)  # eq. (29)
    c0 = 14.2 + 731.0 / (1.0 + 62.5 * q)
    return l0 / (l0 + c0 * q**2)


@functools.lru_cache(maxsize=8)
def _table_transfer(path: str) -> Callable[[np.ndarray], np.ndarray]:
    """Interpolator of log T in log k for a two-column text table (k [h/Mpc], T(k)).

    Below the table's first k, T keeps its first value (T is flat on large scales); above its
    last k, log T is extrapolated linearly in log k from the last two rows.
    """
    file = Path(path)
    if not file.is_file():
        raise PipelineError(f"Transfer table {file} does not exist (transfer = 'table').")
    try:
        table = np.loadtxt(file, ndmin=2)
    except ValueError as error:
        raise PipelineError(
            f"Transfer table {file} is not a numeric two-column text file "
            f"(k [h/Mpc], T(k)): {error}."
        ) from error
    if table.shape[1] != 2 or table.shape[0] < 4:
        raise PipelineError(
            f"Transfer table {file} has shape {table.shape}; expected at least 4 rows of two "
            f"columns (k [h/Mpc], T(k))."
        )
    k, t = table[:, 0], table[:, 1]
    if not (np.all(np.isfinite(table)) and np.all(k > 0) and np.all(t > 0)
            and np.all(np.diff(k) > 0)):
        raise PipelineError(
            f"Transfer table {file} must hold finite, positive k (strictly increasing, h/Mpc) "
            f"and positive T(k)."
        )
    log_k, log_t = np.log(k), np.log(t)
    slope = (log_t[-1] - log_t[-2]) / (log_k[-1] - log_k[-2])
    spline = interpolate.CubicSpline(log_k, log_t)

    def transfer(k_eval: np.ndarray) -> np.ndarray:
        lk = np.log(np.asarray(k_eval, dtype=float))
        inside = np.clip(lk, log_k[0], log_k[-1])
        beyond = np.maximum(lk - log_k[-1], 0.0)
        return np.exp(spline(inside) + slope * beyond)

    return transfer


def _camb_power(cosmo: Cosmology) -> Callable[[np.ndarray], np.ndarray]:
    """Linear matter P(k) at z = 0 from CAMB (arbitrary amplitude), k in h/Mpc.

    Interpolated in log-log; a power law in k from the last two points beyond k = 30 h/Mpc.
    """
    try:
        import camb
    except ImportError as error:
        raise PipelineError(
            "Cosmology transfer = 'camb' needs the camb package, which is not installed; "
            "install camb or use transfer = 'eisenstein_hu'."
        ) from error
    params = camb.CAMBparams()
    params.set_cosmology(
        H0=100.0 * cosmo.h, ombh2=cosmo.Omega_b * cosmo.h**2,
        omch2=(cosmo.Omega_m - cosmo.Omega_b) * cosmo.h**2,
        mnu=0.0, num_massive_neutrinos=0, omk=0.0, TCMB=cosmo.T_cmb)
    params.WantCls = False
    params.InitPower.set_params(ns=cosmo.n_s, As=2e-9)
    params.set_matter_power(redshifts=[0.0], kmax=_CAMB_K_MAX * cosmo.h, nonlinear=False)
    results = camb.get_results(params)
    k_h, _, power = results.get_matter_power_spectrum(
        minkh=_SIGMA_K_RANGE[0], maxkh=_CAMB_K_MAX, npoints=800)
    log_k, log_p = np.log(k_h), np.log(power[0])
    slope = (log_p[-1] - log_p[-2]) / (log_k[-1] - log_k[-2])
    spline = interpolate.CubicSpline(log_k, log_p)

    def camb_power(k_eval: np.ndarray) -> np.ndarray:
        lk = np.log(np.asarray(k_eval, dtype=float))
        inside = np.clip(lk, log_k[0], log_k[-1])
        return np.exp(spline(inside) + slope * np.maximum(lk - log_k[-1], 0.0)
                      + cosmo.n_s * np.minimum(lk - log_k[0], 0.0))

    return camb_power


def _transfer_power(cosmo: Cosmology, transfer: Callable[[np.ndarray], np.ndarray]
                    ) -> Callable[[np.ndarray], np.ndarray]:
    """P(k) up to a constant, k^n_s T(k)^2, for the transfer function T of k in h/Mpc."""
    return lambda k: np.asarray(k, dtype=float) ** cosmo.n_s * transfer(k) ** 2


TRANSFERS: dict[str, Callable[[Cosmology], Callable[[np.ndarray], np.ndarray]]] = {
    "eisenstein_hu": lambda cosmo: _transfer_power(
        cosmo, functools.partial(eisenstein_hu_transfer, cosmo)),
    "eisenstein_hu_nowiggle": lambda cosmo: _transfer_power(
        cosmo, functools.partial(eisenstein_hu_nowiggle_transfer, cosmo)),
    "camb": _camb_power,
    "table": lambda cosmo: _transfer_power(cosmo, _table_transfer(str(cosmo.transfer_table))),
}
"""The linear transfer functions (config ``cosmology.transfer``), each as the P(k) it gives up
to a constant, of k in h/Mpc: k^n_s T(k)^2 for the fitted and tabulated T, CAMB's own P(k)."""


# ---------------------------------------------------------------------------------------------
# Normalisation and the linear power spectrum
# ---------------------------------------------------------------------------------------------

def tophat_window(x: np.ndarray) -> np.ndarray:
    """Fourier transform of a spherical top hat, W(x) = 3 (sin x - x cos x) / x^3, W(0) = 1."""
    x = np.asarray(x, dtype=float)
    small = x < 1e-3
    xs = np.where(small, 1.0, x)
    return np.where(small, 1.0 - x**2 / 10.0, 3.0 * (np.sin(xs) - xs * np.cos(xs)) / xs**3)


def sigma_tophat(power: Callable[[np.ndarray], np.ndarray], radius: float) -> float:
    """rms linear density contrast in top-hat spheres of ``radius`` (Mpc/h).

    sigma^2(R) = 1/(2 pi^2) ∫ k^3 P(k) W^2(kR) d ln k, with P in (Mpc/h)^3 of k in h/Mpc,
    integrated with Simpson's rule on 2^14 + 1 points evenly spaced in ln k over
    1e-5 < k < 1e3 h/Mpc (converged to better than 1e-8 for ΛCDM spectra).
    """
    log_k = np.linspace(*np.log(_SIGMA_K_RANGE), 2**14 + 1)
    k = np.exp(log_k)
    integrand = k**3 * power(k) * tophat_window(k * radius) ** 2
    return math.sqrt(integrate.simpson(integrand, x=log_k) / (2.0 * math.pi**2))


@functools.lru_cache(maxsize=64)
def _power_shape(cosmo: Cosmology) -> Callable[[np.ndarray], np.ndarray]:
    return TRANSFERS[cosmo.transfer](cosmo)


@functools.lru_cache(maxsize=64)
def _power_amplitude(cosmo: Cosmology) -> float:
    return (cosmo.sigma_8 / sigma_tophat(_power_shape(cosmo), SIGMA8_RADIUS)) ** 2


def linear_power(cosmo: Cosmology, k: np.ndarray) -> np.ndarray:
    """Linear matter power spectrum P(k) at z = 0, (Mpc/h)^3, of k in h/Mpc (k > 0).

    P(k) = A k^n_s T(k)^2 with A fixed so that sigma(8 Mpc/h) = cosmo.sigma_8 (for 'camb',
    CAMB's linear P(k) rescaled the same way). Multiply by D1(a)^2 for other epochs.
    """
    k = np.asarray(k, dtype=float)
    return _power_amplitude(cosmo) * _power_shape(cosmo)(k)


# ---------------------------------------------------------------------------------------------
# Background and growth
# ---------------------------------------------------------------------------------------------

class Background:
    """Expansion rate and linear growth of a flat ΛCDM cosmology, as functions of a.

    D1 and D2 solve the first- and second-order growth equations in ln a (Bouchet et al.
    1995; e.g. Scoccimarro 1998 eq. (A2)-(A3)), with Omega_m(a) = Omega_m a^-3 / E(a)^2:

        D1'' + (2 + dlnE/dlna) D1' = 3/2 Omega_m(a) D1
        D2'' + (2 + dlnE/dlna) D2' = 3/2 Omega_m(a) (D2 - D1^2)

    started in the matter era on the growing modes D1 = a, D2 = -3/7 a^2. D1 is normalised to
    D1(1) = 1 and D2 by the same factor squared, so D2 -> -3/7 D1^2 at early times (negative).
    Valid for 1e-5 <= a <= 10; all methods accept scalars or arrays.
    """

    A_MIN = 1e-5
    A_MAX = 10.0

    def __init__(self, cosmo: Cosmology) -> None:
        self.cosmo = cosmo
        solution = integrate.solve_ivp(
            self._growth_rhs, (math.log(self.A_MIN), math.log(self.A_MAX)),
            [self.A_MIN, self.A_MIN, -3.0 / 7.0 * self.A_MIN**2, -6.0 / 7.0 * self.A_MIN**2],
            method="DOP853", rtol=1e-11, atol=1e-30, dense_output=True)
        if not solution.success:
            raise RuntimeError(f"growth ODE failed for {cosmo}: {solution.message}")
        self._solution = solution.sol
        self._d1_today = float(self._solution(0.0)[0])

    def Omega_m_a(self, a: np.ndarray) -> np.ndarray:
        """Matter density parameter at scale factor a, Omega_m a^-3 / E(a)^2."""
        a = np.asarray(a, dtype=float)
        return self.cosmo.Omega_m * a**-3 / self.E(a) ** 2

    def E(self, a: np.ndarray) -> np.ndarray:
        """Dimensionless Hubble rate H(a)/H0 = sqrt(Omega_m a^-3 + Omega_L)."""
        a = np.asarray(a, dtype=float)
        return np.sqrt(self.cosmo.Omega_m * a**-3 + self.cosmo.Omega_L)

    def H(self, a: np.ndarray) -> np.ndarray:
        """Hubble rate in km/s per Mpc/h, i.e. 100 E(a) (multiply lengths in Mpc/h)."""
        return 100.0 * self.E(a)

    def D1(self, a: np.ndarray) -> np.ndarray:
        """Linear growth factor, D1(1) = 1."""
        return self._growth(a)[0] / self._d1_today

    def D2(self, a: np.ndarray) -> np.ndarray:
        """Second-order growth factor, D2 -> -3/7 D1^2 at early times."""
        return self._growth(a)[2] / self._d1_today**2

    def f1(self, a: np.ndarray) -> np.ndarray:
        """Linear growth rate dlnD1/dlna."""
        y = self._growth(a)
        return y[1] / y[0]

    def f2(self, a: np.ndarray) -> np.ndarray:
        """Second-order growth rate dlnD2/dlna (-> 2 at early times)."""
        y = self._growth(a)
        return y[3] / y[2]

    def _growth(self, a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, dtype=float)
        if np.any(~((a >= self.A_MIN) & (a <= self.A_MAX))):
            raise ValueError(
                f"scale factor a must lie in [{self.A_MIN}, {self.A_MAX}]; got "
                f"min {np.min(a)}, max {np.max(a)}")
        return self._solution(np.log(a))

    def _growth_rhs(self, log_a: float, y: np.ndarray) -> list[float]:
        a = math.exp(log_a)
        omega_m_a = float(self.Omega_m_a(a))
        dlne_dlna = -1.5 * omega_m_a
        d1, d1_prime, d2, d2_prime = y
        return [
            d1_prime,
            -(2.0 + dlne_dlna) * d1_prime + 1.5 * omega_m_a * d1,
            d2_prime,
            -(2.0 + dlne_dlna) * d2_prime + 1.5 * omega_m_a * (d2 - d1**2),
        ]
