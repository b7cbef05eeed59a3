"""2LPT initial conditions on the particle lattice (rule ``initial_conditions``).

A Gaussian random field with the linear power spectrum of :mod:`simulations.cosmology` is drawn
on the N^3 particle lattice and turned into Zel'dovich (first-order) and second-order
displacements and peculiar velocities at z_init, following Scoccimarro (1998, MNRAS 299, 1097,
Appendix D) and Bouchet et al. (1995, A&A 296, 575):

    x = q + psi1 + psi2,   psi1 = -D1 grad(phi1),   psi2 = D2 grad(phi2),
    laplacian(phi1) = delta_0(q),
    laplacian(phi2) = sum_{i<j} [phi1_ii phi1_jj - phi1_ij^2],
    v = a H(a) (f1 psi1 + f2 psi2),

with delta_0 the linear density contrast extrapolated to z = 0 and D2 < 0 (D2 ≈ -3/7 D1^2).
Lagrangian positions are cell centred, q = (i + 1/2, j + 1/2, k + 1/2) L / N, as in MUSIC.

Random field: real-space white noise from ``numpy.random.default_rng(seed)`` (N^3 standard
normals in C order of the lattice), Fourier transformed and scaled by sqrt(P(k) / cell volume).
With ``fixed_amplitude`` every mode keeps the white noise's phase but gets |delta_k|^2 = P(k)
exactly (Angulo & Pontzen 2016); ``phase_flip`` multiplies the field by -1 (the paired
simulation). Derivatives are spectral (:func:`simulations.mesh.gradient`, which drops the
Nyquist wavenumber so that every field stays real).

Output (run directory): ``sims/<sim_id>/ic.h5`` with datasets ``psi1``, ``psi2`` (Mpc/h) and
``velocity`` (km/s), float32, shape (3, N, N, N) indexed [component, ix, iy, iz], and the
attributes listed in :data:`IC_ATTRIBUTES` (cosmology, grid, growth factors, units).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import scipy.fft

from simulations import mesh
from simulations.cosmology import Background, Cosmology, linear_power
from workflow.errors import PipelineError
from workflow.io import atomic_path
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

IC_DATASETS = ("psi1", "psi2", "velocity")
IC_ATTRIBUTES = (
    "sim_id", "seed", "n_particles", "box_size", "z_init", "a_init", "Omega_m", "Omega_b", "h",
    "sigma_8", "n_s", "T_cmb", "transfer", "lpt_order", "fixed_amplitude", "phase_flip",
    "backend", "D1_init", "D2_init", "f1_init", "f2_init", "code_version",
    "units_displacement", "units_velocity",
)
LPT_ORDERS = (1, 2)
"""The perturbation orders implemented: Zel'dovich (1) and 2LPT (2)."""
_POWER_TABLE_POINTS = 8192  # P(k) is tabulated in log k and interpolated onto the FFT grid


@dataclasses.dataclass(frozen=True, eq=False)
class InitialConditions:
    """Displacements and velocities of the N^3 lattice particles at z_init.

    psi1, psi2: first- and second-order displacements, Mpc/h; velocity: peculiar velocity,
    km/s; all float32 arrays of shape (3, N, N, N) indexed [component, ix, iy, iz].
    D1_init, D2_init, f1_init, f2_init: growth factors and rates at a_init.
    """

    psi1: np.ndarray
    psi2: np.ndarray
    velocity: np.ndarray
    cosmology: Cosmology
    box_size: float
    z_init: float
    seed: int
    sim_id: int
    lpt_order: int
    fixed_amplitude: bool
    phase_flip: bool
    backend: str
    D1_init: float
    D2_init: float
    f1_init: float
    f2_init: float

    @property
    def n_particles(self) -> int:
        """Particles per side, N."""
        return self.psi1.shape[1]

    @property
    def a_init(self) -> float:
        return 1.0 / (1.0 + self.z_init)

    def positions(self) -> np.ndarray:
        """Eulerian particle positions q + psi1 + psi2 in [0, L), Mpc/h, (N^3, 3) float64."""
        return eulerian_positions(self.psi1.astype(np.float64) + self.psi2, self.box_size)


# ---------------------------------------------------------------------------------------------
# Lattice and Fourier grid
# ---------------------------------------------------------------------------------------------

def lagrangian_positions(n_particles: int, box_size: float) -> np.ndarray:
    """Cell-centred lattice q = (i + 1/2) L / N per axis, Mpc/h, shape (3, N, N, N)."""
    axis = (np.arange(n_particles) + 0.5) * (box_size / n_particles)
    return np.stack(np.meshgrid(axis, axis, axis, indexing="ij"))


def eulerian_positions(displacement: np.ndarray, box_size: float) -> np.ndarray:
    """q + displacement (shape (3, N, N, N), Mpc/h) wrapped into [0, L): (N^3, 3) float64.

    Particle order is the C order of the lattice (ix, iy, iz).
    """
    n = displacement.shape[1]
    positions = lagrangian_positions(n, box_size) + displacement
    positions = np.ascontiguousarray(np.mod(positions.reshape(3, -1).T, box_size))
    positions[positions >= box_size] = 0.0  # np.mod can round tiny negatives up to L
    return positions


def _wavenumber_magnitude(n: int, box_size: float) -> np.ndarray:
    """|k| (h/Mpc) of every mode of the rfftn layout of an n^3 mesh, shape (n, n, n//2 + 1)."""
    k_axis = 2.0 * np.pi * scipy.fft.fftfreq(n, d=box_size / n)
    k_last = 2.0 * np.pi * scipy.fft.rfftfreq(n, d=box_size / n)
    return np.sqrt(k_axis[:, None, None] ** 2 + k_axis[None, :, None] ** 2
                   + k_last[None, None, :] ** 2)


# ---------------------------------------------------------------------------------------------
# Gaussian random field
# ---------------------------------------------------------------------------------------------

def linear_density_modes(
    power: Callable[[np.ndarray], np.ndarray],
    n: int,
    box_size: float,
    seed: int,
    fixed_amplitude: bool,
    phase_flip: bool,
    threads: int = 1,
) -> np.ndarray:
    """Fourier modes of a Gaussian linear density field on an n^3 grid (rfftn layout).

    power: P(k) in (Mpc/h)^3 of k in h/Mpc. Convention delta_k = sum_x delta(x) e^{-i k.x}
    (numpy's unnormalised forward FFT), so <|delta_k|^2> = n^6 P(k) / L^3; the k = 0 mode is
    zero. Real-space white noise from ``default_rng(seed)`` sets the phases (and, unless
    ``fixed_amplitude``, the Rayleigh-distributed amplitudes).
    """
    noise = np.random.default_rng(seed).standard_normal((n, n, n))
    modes = scipy.fft.rfftn(noise, workers=threads)
    del noise
    k = _wavenumber_magnitude(n, box_size)
    k_table = np.geomspace(2.0 * np.pi / box_size * 0.5, k.max() * 1.01, _POWER_TABLE_POINTS)
    log_power = np.interp(np.log(np.where(k > 0, k, k_table[0])), np.log(k_table),
                          np.log(power(k_table)))
    del k
    cell_volume = (box_size / n) ** 3
    amplitude = np.exp(0.5 * log_power) / math.sqrt(cell_volume)  # sqrt(P / cell volume)
    del log_power
    amplitude[0, 0, 0] = 0.0
    if fixed_amplitude:
        modes[0, 0, 0] = 1.0
        modes /= np.abs(modes)
        amplitude *= n**1.5  # |delta_k|^2 = n^6 P / L^3 exactly
    modes *= -amplitude if phase_flip else amplitude
    return modes


# ---------------------------------------------------------------------------------------------
# Lagrangian perturbation theory
# ---------------------------------------------------------------------------------------------

def _potential(density_modes: np.ndarray, box_size: float) -> np.ndarray:
    """Modes of phi with laplacian(phi) = density (phi_k = -density_k / k^2, k = 0 zeroed)."""
    return mesh.inverse_laplacian(density_modes.copy(), box_size)


def _real_gradient(potential_modes: np.ndarray, axis: int, box_size: float,
                   threads: int) -> np.ndarray:
    n = potential_modes.shape[0]
    return scipy.fft.irfftn(mesh.gradient(potential_modes, axis, box_size), s=(n, n, n),
                            workers=threads)


def zeldovich_displacement(delta_modes: np.ndarray, box_size: float,
                           threads: int = 1) -> np.ndarray:
    """First-order displacement -grad(phi1) for unit growth, Mpc/h, shape (3, n, n, n).

    phi1 solves laplacian(phi1) = delta, so psi_k = i k delta_k / k^2 (Zel'dovich 1970).
    delta_modes: rfftn modes of the density contrast (see :func:`linear_density_modes`).
    """
    phi1 = _potential(delta_modes, box_size)
    return -np.stack([_real_gradient(phi1, axis, box_size, threads) for axis in range(3)])


def second_order_displacement(delta_modes: np.ndarray, box_size: float,
                              threads: int = 1) -> np.ndarray:
    """Second-order displacement grad(phi2) for unit D2, Mpc/h, shape (3, n, n, n).

    laplacian(phi2) = sum_{i<j} [phi1_ii phi1_jj - phi1_ij^2] (Scoccimarro 1998 eq. D6), with
    the Hessian phi1_ij taken as two spectral first derivatives. Multiply by D2 (negative) for
    psi2. The source is accumulated one Hessian component at a time to bound memory.
    """
    n = delta_modes.shape[0]
    phi1 = _potential(delta_modes, box_size)

    def hessian(i: int, j: int) -> np.ndarray:
        first = mesh.gradient(phi1, i, box_size)  # noqa: F821 (deleted after the last call, below)
        return scipy.fft.irfftn(mesh.gradient(first, j, box_size), s=(n, n, n),
                                workers=threads)

    diagonal = [hessian(i, i) for i in range(3)]
    source = (diagonal[0] * diagonal[1] + diagonal[0] * diagonal[2]
              + diagonal[1] * diagonal[2])
    del diagonal
    for i, j in ((0, 1), (0, 2), (1, 2)):
        source -= hessian(i, j) ** 2
    del phi1
    phi2 = mesh.inverse_laplacian(scipy.fft.rfftn(source, workers=threads), box_size)
    del source
    return np.stack([_real_gradient(phi2, axis, box_size, threads) for axis in range(3)])


def lpt_velocity(background: Background, a: float, psi1: np.ndarray,
                 psi2: np.ndarray) -> np.ndarray:
    """Peculiar velocity a H(a) (f1 psi1 + f2 psi2) in km/s for displacements in Mpc/h."""
    a_h = a * float(background.H(a))
    return a_h * (float(background.f1(a)) * psi1 + float(background.f2(a)) * psi2)


# ---------------------------------------------------------------------------------------------
# One simulation
# ---------------------------------------------------------------------------------------------

def _is_count(value, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def check_ic_arguments(n_particles, box_size, z_init, seed, sim_id, lpt_order,
                       threads=1) -> None:
    """Raise PipelineError naming the first argument the generator cannot take."""
    z_max = 1.0 / Background.A_MIN - 1
    checks = [
        (_is_count(n_particles, 4) and n_particles % 2 == 0, "n_particles", n_particles,
         "an even integer of at least 4 (the spectral derivatives drop the Nyquist plane)"),
        (isinstance(box_size, numbers.Real) and 0.0 < box_size < math.inf, "box_size", box_size,
         "a positive, finite length in Mpc/h"),
        (isinstance(z_init, numbers.Real) and 0.0 < z_init < z_max, "z_init", z_init,
         f"positive and below {z_max:g}, where the growth tables start"),
        (lpt_order in LPT_ORDERS, "lpt_order", lpt_order,
         f"one of {', '.join(map(str, LPT_ORDERS))}"),
        (_is_count(seed, 0), "seed", seed, "a non-negative integer"),
        (_is_count(sim_id, 0), "sim_id", sim_id, "a non-negative integer"),
        (_is_count(threads, 1), "threads", threads, "a positive integer"),
    ]
    for ok, name, value, expected in checks:
        if not ok:
            raise PipelineError(f"Initial conditions: {name} = {value!r} must be {expected}.")


def growth_attributes(background: Background, a: float) -> dict[str, float]:
    """D1, D2, f1, f2 at scale factor ``a``, keyed as the ic.h5 attributes D1_init ... f2_init."""
    return {f"{name}_init": float(getattr(background, name)(a)) for name in ("D1", "D2", "f1", "f2")}


def compute_initial_conditions(
    cosmo: Cosmology,
    n_particles: int,
    box_size: float,
    z_init: float,
    seed: int,
    sim_id: int,
    lpt_order: int,
    fixed_amplitude: bool,
    phase_flip: bool,
    threads: int = 1,
) -> InitialConditions:
    """2LPT (or Zel'dovich, lpt_order = 1) initial conditions in memory; see module docstring.

    box_size in Mpc/h; n_particles per side; threads: FFT worker threads.
    """
    check_ic_arguments(n_particles, box_size, z_init, seed, sim_id, lpt_order, threads)
    background = Background(cosmo)
    a_init = 1.0 / (1.0 + z_init)
    growth = growth_attributes(background, a_init)
    d1, d2 = growth["D1_init"], growth["D2_init"]
    log.info("sim %d: %d^3 particles, L = %g Mpc/h, z_init = %g (D1 = %.6g), seed %d",
             sim_id, n_particles, box_size, z_init, d1, seed)

    modes = linear_density_modes(lambda k: linear_power(cosmo, k), n_particles, box_size,
                                 seed, fixed_amplitude, phase_flip, threads)
    # Fields are stored as float32 as soon as they are computed, to bound peak memory.
    psi1 = (d1 * zeldovich_displacement(modes, box_size, threads)).astype(np.float32)
    if lpt_order == 2:
        psi2 = (d2 * second_order_displacement(modes, box_size, threads)).astype(np.float32)
    else:
        psi2 = np.zeros_like(psi1)
    del modes
    velocity = lpt_velocity(background, a_init, psi1, psi2).astype(np.float32)

    spacing = box_size / n_particles
    rms = [math.sqrt(3 * np.mean(psi**2, dtype=np.float64)) / spacing for psi in (psi1, psi2)]
    log.info("sim %d: rms |psi1| = %.3g, rms |psi2| = %.3g of the particle spacing",
             sim_id, *rms)
    if np.abs(psi1 + psi2).max() > spacing:
        log.warning("sim %d: displacements exceed the particle spacing at z_init = %g; "
                    "consider a higher z_init", sim_id, z_init)
    return InitialConditions(
        psi1=psi1, psi2=psi2, velocity=velocity, cosmology=cosmo, box_size=float(box_size),
        z_init=float(z_init), seed=int(seed), sim_id=int(sim_id), lpt_order=int(lpt_order),
        fixed_amplitude=bool(fixed_amplitude), phase_flip=bool(phase_flip), backend="native",
        **growth)


def generate_initial_conditions(
    out_path: str | Path,
    cosmo: Cosmology,
    n_particles: int,
    box_size: float,
    z_init: float,
    seed: int,
    sim_id: int,
    lpt_order: int,
    fixed_amplitude: bool,
    phase_flip: bool,
    threads: int = 1,
    provenance: str = "",
) -> InitialConditions:
    """Compute one simulation's initial conditions and write them to ``out_path`` (ic.h5).

    Deterministic: the same arguments give a byte-identical file. ``provenance`` is stored as
    the attribute of that name (workflow.batch).
    """
    ic = compute_initial_conditions(cosmo, n_particles, box_size, z_init, seed, sim_id,
                                    lpt_order, fixed_amplitude, phase_flip, threads)
    write_initial_conditions(out_path, ic, provenance)
    return ic


# ---------------------------------------------------------------------------------------------
# ic.h5
# ---------------------------------------------------------------------------------------------

def write_initial_conditions(path: str | Path, ic: InitialConditions, provenance: str = "") -> Path:
    """Write ``ic`` to ``path`` (HDF5, atomically, without timestamps so bytes are reproducible),
    with ``provenance`` as an attribute when given."""
    path = Path(path)
    cosmo = ic.cosmology
    attrs = {
        "sim_id": ic.sim_id, "seed": ic.seed, "n_particles": ic.n_particles,
        "box_size": ic.box_size, "z_init": ic.z_init, "a_init": ic.a_init,
        "Omega_m": cosmo.Omega_m, "Omega_b": cosmo.Omega_b, "h": cosmo.h,
        "sigma_8": cosmo.sigma_8, "n_s": cosmo.n_s, "T_cmb": cosmo.T_cmb,
        "transfer": cosmo.transfer, "lpt_order": ic.lpt_order,
        "fixed_amplitude": ic.fixed_amplitude, "phase_flip": ic.phase_flip,
        "backend": ic.backend, "D1_init": ic.D1_init, "D2_init": ic.D2_init,
        "f1_init": ic.f1_init, "f2_init": ic.f2_init, "code_version": CODE_VERSION,
        "units_displacement": "Mpc/h", "units_velocity": "km/s",
    }
    if cosmo.transfer_table is not None:
        attrs["transfer_table"] = cosmo.transfer_table
    if provenance:
        attrs["provenance"] = provenance
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w", track_order=False) as handle:
            for name in IC_DATASETS:
                handle.create_dataset(name, data=getattr(ic, name), dtype=np.float32,
                                      track_times=False)
            for key, value in attrs.items():
                handle.attrs[key] = value
    log.info("wrote %s", path)
    return path


def read_initial_conditions(path: str | Path) -> InitialConditions:
    """Read an ic.h5 written by :func:`write_initial_conditions`.

    Raises PipelineError naming the file when it is missing, not a complete HDF5 file, or
    lacks a dataset or attribute of the contract.
    """
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"Initial-conditions file {path} does not exist; run the "
                            f"initial_conditions stage first.")
    try:
        with h5py.File(path, "r") as handle:
            missing = ([name for name in IC_DATASETS if name not in handle]
                       + [key for key in IC_ATTRIBUTES if key not in handle.attrs])
            if missing:
                raise PipelineError(f"Initial-conditions file {path} is incomplete: it lacks "
                                    f"{', '.join(missing)}.")
            attrs = {key: handle.attrs[key] for key in handle.attrs}
            n = int(attrs["n_particles"])
            fields = {}
            for name in IC_DATASETS:
                if handle[name].shape != (3, n, n, n):
                    raise PipelineError(
                        f"Initial-conditions file {path}: dataset {name} has shape "
                        f"{handle[name].shape}; expected (3, {n}, {n}, {n}).")
                fields[name] = handle[name][...]
    except OSError as error:
        raise PipelineError(f"Initial-conditions file {path} is not a readable HDF5 file "
                            f"(truncated or corrupt): {error}.") from error

    def text(key: str) -> str:
        value = attrs[key]
        return value.decode() if isinstance(value, bytes) else str(value)

    try:
        cosmo = Cosmology(
            Omega_m=float(attrs["Omega_m"]), sigma_8=float(attrs["sigma_8"]),
            n_s=float(attrs["n_s"]), h=float(attrs["h"]), Omega_b=float(attrs["Omega_b"]),
            T_cmb=float(attrs["T_cmb"]), transfer=text("transfer"),
            transfer_table=text("transfer_table") if "transfer_table" in attrs else None)
    except PipelineError as error:
        raise PipelineError(f"Initial-conditions file {path}: {error}") from error
    return InitialConditions(
        **fields, cosmology=cosmo, box_size=float(attrs["box_size"]),
        z_init=float(attrs["z_init"]), seed=int(attrs["seed"]), sim_id=int(attrs["sim_id"]),
        lpt_order=int(attrs["lpt_order"]), fixed_amplitude=bool(attrs["fixed_amplitude"]),
        phase_flip=bool(attrs["phase_flip"]), backend=text("backend"),
        D1_init=float(attrs["D1_init"]), D2_init=float(attrs["D2_init"]),
        f1_init=float(attrs["f1_init"]), f2_init=float(attrs["f2_init"]))
