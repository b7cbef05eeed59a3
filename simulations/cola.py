"""COLA particle-mesh N-body solver (rule ``simulate``).

Evolves the 2LPT initial conditions of ``sims/<sim_id>/ic.h5`` to the configured redshifts
with the COmoving Lagrangian Acceleration method of Tassev, Zaldarriaga & Eisenstein (2013,
JCAP 06, 036; "TZE13"), as implemented in pycola (Tassev et al. 2015):

* Time variable: the scale factor a, with the operator T[X] = Q(a) dX/da, Q(a) = a^3 E(a)
  (TZE13 eq. A.1). A particle's momentum is p = T[x] = a^2 dx/dt / H0 (Mpc/h; time in 1/H0),
  and gravity reads T^2[x] = a g with g = -3/2 Omega_m grad(laplacian^-1 delta) (Mpc/h).
* COLA (``cola=True``) integrates the residual x_res = x - x_LPT about the 2LPT trajectory
  x_LPT(a) = q + D1(a)/D1(a_i) psi1 + D2(a)/D2(a_i) psi2, with the LPT acceleration
  T^2[x_LPT] = 3/2 Omega_m a [D1 psi1/D1(a_i) + (D2 - D1^2) psi2/D2(a_i)] subtracted from the
  PM force (the COLA equation of motion of TZE13). The kick and drift use the modified time
  stepping of TZE13
  Appendix A.3, eq. (A.15), with u(a) = a^n_cola (pycola's default n_cola = -2.5):
      kick   p_res += [u(a_f) - u(a_i)] / [Q(a_c) u'(a_c)] * (T^2[x] - T^2[x_LPT])(a_c)
      drift  x_res += p_res(a_c) / u(a_c) * int_{a_i}^{a_f} u(a) / Q(a) da.
* Plain PM (``cola=False``): the same kick-drift-kick leapfrog for p and x with the exact
  operators for frozen positions / momenta (Quinn et al. 1997):
      kick   p += g * int a / Q(a) da,   drift   x += p * int da / Q(a).
* PM force: CIC painting on a mesh of (mesh_factor N)^3 cells, the -1/k^2 Poisson kernel and
  the gradient as a four-point finite difference of the real-space potential (one inverse
  FFT, as pycola and FastPM), read back with CIC. A Fourier-space gradient (i k, three inverse
  FFTs) was offered too and has been removed: on a mesh finer than the particle lattice it
  feeds the lattice's mesh-scale images back to the particles. In a linear run (32^3
  particles, 256 Mpc/h, 10 COLA steps) its displacements grew 5-11 % too fast for
  k <= k_Ny/2 with mesh_factor 2 and turned over (negative growth from k = k_Ny/2) with
  mesh_factor 3, where the finite difference stays within 3 % (2) and 2 % (3) of linear
  theory. Band-limiting it to the particle Nyquist cube made it slower than the finite
  difference (18 % low at k_Ny/2 with mesh_factor 2); deconvolving the CIC windows as well
  overshot near the particle Nyquist with mesh_factor 3 (+11 % at k_Ny, +24 % beyond).
* Kick-drift-kick with synchronised positions and momenta at every step boundary; each
  requested redshift is a step boundary (:func:`time_steps`), so snapshots need no
  interpolation.

Output (run directory): ``sims/<sim_id>/snapshot.h5`` with datasets ``positions`` (n_z, N^3, 3)
float32 Mpc/h in [0, L), ``velocities`` (n_z, N^3, 3) float32 peculiar km/s and ``redshifts``
(n_z,) float64 in the configured order; particles in the C order of the lattice; attributes as
in :data:`SNAPSHOT_ATTRIBUTES`. Written to a temporary file and renamed when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import h5py
import numba
import numpy as np
from scipy import integrate

from simulations import mesh
from simulations.cosmology import Background
from simulations.initial_conditions import InitialConditions, read_initial_conditions
from workflow.errors import PipelineError
from workflow.io import atomic_path
from workflow.version import CODE_VERSION

logger = logging.getLogger(__name__)

SNAPSHOT_ATTRIBUTES = (
    "sim_id", "seed", "n_particles", "box_size", "Omega_m", "Omega_b", "h", "sigma_8", "n_s",
    "z_init", "n_steps", "stepping", "cola", "n_cola", "mesh_factor", "gradient", "backend",
    "backend_version", "code_version", "units_position", "units_velocity",
)
GRADIENT = "finite_difference"
"""The force's gradient, recorded in every snapshot: the four-point finite difference (above)."""
HUBBLE_KM_S = 100.0
"""H0 in km/s per Mpc/h: converts momenta (Mpc/h, time in 1/H0) to km/s."""

Monitor = Callable[[int, float, "ParticleState"], None]


# --------------------------------------------------------------------------------------------
# State and schedule


@dataclasses.dataclass
class ParticleState:
    """Particles at one moment of the leapfrog; each field records the scale factor it is at.

    positions: (M, 3) float32 comoving positions in [0, L), Mpc/h.
    momentum: (M, 3) float32 p = T[x] in Mpc/h; with COLA the residual p - T[x_LPT].
    force: (M, 3) float32 g = -3/2 Omega_m grad(laplacian^-1 delta) at ``positions``, Mpc/h.
    """

    positions: np.ndarray
    momentum: np.ndarray
    force: np.ndarray
    a_positions: float
    a_momentum: float
    a_force: float

    @property
    def synchronous(self) -> bool:
        """True when positions, momenta and forces all refer to the same time."""
        return self.a_positions == self.a_momentum == self.a_force


def time_steps(
    a_init: float, a_outputs: Sequence[float], n_steps: int, stepping: str
) -> np.ndarray:
    """Step boundaries (scale factors) from ``a_init`` to the latest output, every output included.

    The ``n_steps`` steps are shared among the intervals between consecutive outputs in
    proportion to their length in a (``linear_a``) or ln a (``log_a``), at least one each
    (largest-remainder rounding), and are uniform in that variable within an interval.
    With one output (e.g. z = 0) this is a plain uniform grid.
    """
    nodes = np.concatenate([[a_init], np.sort(np.asarray(a_outputs, dtype=float))])
    variable = np.log(nodes) if stepping == "log_a" else nodes
    lengths = np.diff(variable)
    if n_steps < len(lengths):
        raise PipelineError(
            f"Simulation n_steps = {n_steps} must be at least the number of output redshifts "
            f"({len(lengths)}): every output is a step boundary."
        )
    share = lengths / lengths.sum() * (n_steps - len(lengths))
    counts = 1 + np.floor(share).astype(int)
    by_remainder = np.argsort(-(share - np.floor(share)), kind="stable")
    counts[by_remainder[: n_steps - counts.sum()]] += 1
    grid = np.concatenate(
        [np.linspace(lo, hi, count + 1)[:-1]
         for lo, hi, count in zip(variable, variable[1:], counts)]
        + [variable[-1:]]
    )
    steps = np.exp(grid) if stepping == "log_a" else grid
    steps[np.concatenate([[0], np.cumsum(counts)])] = nodes  # outputs exactly, not exp(log(a))
    return steps


def leapfrog(steps: np.ndarray, stepping: str) -> Iterator[tuple[str, float, float]]:
    """Kick-drift-kick schedule over the step boundaries ``steps``: (action, a_from, a_to).

    A force at the first time, then per step: kick to the step's midpoint (arithmetic in a for
    ``linear_a``, geometric for ``log_a``), drift over the step, force at its end, kick to its
    end. Positions and momenta are synchronous after each step's second kick.
    """
    yield "force", steps[0], steps[0]
    for a_from, a_to in zip(steps[:-1], steps[1:]):
        a_mid = math.sqrt(a_from * a_to) if stepping == "log_a" else 0.5 * (a_from + a_to)
        yield "kick", a_from, a_mid
        yield "drift", a_from, a_to
        yield "force", a_to, a_to
        yield "kick", a_mid, a_to


# --------------------------------------------------------------------------------------------
# Element-wise particle updates


@numba.njit(parallel=True, cache=True)
def _add_terms(target, term, weight, psi1, weight_1, psi2, weight_2, box_size):
    """target += weight term + weight_1 psi1 + weight_2 psi2, wrapped into [0, box) if box > 0."""
    for p in numba.prange(target.shape[0]):
        for d in range(3):
            value = (np.float64(target[p, d]) + weight * term[p, d]
                     + weight_1 * psi1[p, d] + weight_2 * psi2[p, d])
            if box_size > 0.0:
                value -= box_size * np.floor(value / box_size)
                if np.float32(value) >= box_size:  # rounding of values just below L
                    value = 0.0
            target[p, d] = value


def _particle_major(field: np.ndarray) -> np.ndarray:
    """(3, N, N, N) component-major field -> (N^3, 3) float32, particles in lattice C order."""
    return np.ascontiguousarray(field.reshape(3, -1).T, dtype=np.float32)


def _lattice_positions(psi1: np.ndarray, psi2: np.ndarray, box_size: float) -> np.ndarray:
    """x = q + psi1 + psi2 in [0, L) with cell-centred q = (i + 1/2) L / N (Mpc/h), (N^3, 3)."""
    n = round(psi1.shape[0] ** (1.0 / 3.0))
    axis = ((np.arange(n) + 0.5) * (box_size / n)).astype(np.float32)
    positions = np.empty((n**3, 3), dtype=np.float32)
    lattice = positions.reshape(n, n, n, 3)
    lattice[..., 0] = axis[:, None, None]
    lattice[..., 1] = axis[None, :, None]
    lattice[..., 2] = axis[None, None, :]
    _add_terms(positions, psi1, 0.0, psi1, 1.0, psi2, 1.0, box_size)  # no momentum term
    return positions


# --------------------------------------------------------------------------------------------
# Forces


class ParticleMeshForce:
    """PM gravity g = -3/2 Omega_m grad(laplacian^-1 delta) in Mpc/h, for comoving positions.

    Owns one :class:`~simulations.mesh.FFTMesh` of n_mesh^3 cells (density, then potential),
    reused at every call; the four-point gradient is read out to the particles directly
    (:func:`~simulations.mesh.readout_gradient_fd4`), without a mesh per component.
    """

    def __init__(self, n_mesh: int, box_size: float, omega_m: float, n_particles_total: int,
                 threads: int):
        self.n_mesh = n_mesh
        self.box_size = box_size
        self.density = mesh.FFTMesh(n_mesh, workers=threads)
        # delta_k = (n_mesh^3 / M) counts_k for k != 0; the minus sign makes -phi, so that
        # the gradient is the force g = -grad(phi).
        self.poisson_factor = -1.5 * omega_m * n_mesh**3 / n_particles_total

    def __call__(self, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (M, 3) with g at ``positions`` (M, 3), both float32 in Mpc/h."""
        mesh.paint_cic(positions, self.box_size, self.n_mesh, out=self.density.real)
        self.density.forward()
        mesh.inverse_laplacian(self.density.fourier, self.box_size, self.poisson_factor)
        self.density.inverse()
        return mesh.readout_gradient_fd4(self.density.real, positions, self.box_size, out=out)


# --------------------------------------------------------------------------------------------
# Time integration


class Integrator:
    """Kick, drift and force operators of COLA (or plain PM), checked against the state's times.

    psi1, psi2: (M, 3) float32 LPT displacements at a_init (Mpc/h); growth factors are taken
    relative to a_init, so x_LPT(a_init) = q + psi1 + psi2 is the initial position.
    """

    def __init__(self, background: Background, a_init: float, psi1: np.ndarray,
                 psi2: np.ndarray, force: ParticleMeshForce, cola: bool, n_cola: float):
        self.background = background
        self.omega_m = background.cosmo.Omega_m
        self.psi1, self.psi2 = psi1, psi2
        self.d1_init = float(background.D1(a_init))
        self.d2_init = float(background.D2(a_init))
        self.pm_force = force
        self.cola = cola
        self.n_cola = n_cola

    # Growth-dependent coefficients of psi1 and psi2 in the LPT trajectory -------------------

    def lpt_displacement(self, a: float) -> tuple[float, float]:
        """x_LPT - q = c1 psi1 + c2 psi2: returns (D1(a)/D1(a_i), D2(a)/D2(a_i))."""
        d1, d2 = float(self.background.D1(a)), float(self.background.D2(a))
        return d1 / self.d1_init, d2 / self.d2_init

    def lpt_momentum(self, a: float) -> tuple[float, float]:
        """T[x_LPT] = c1 psi1 + c2 psi2 with T[D] = Q dD/da = a^2 E f D (Mpc/h)."""
        b = self.background
        scale = a**2 * float(b.E(a))
        c1, c2 = self.lpt_displacement(a)
        return scale * float(b.f1(a)) * c1, scale * float(b.f2(a)) * c2

    def lpt_acceleration(self, a: float) -> tuple[float, float]:
        """T^2[x_LPT] = c1 psi1 + c2 psi2 from the growth equations (TZE13 eqs. A.1-A.2):
        T^2[D1] = 3/2 Omega_m a D1 and T^2[D2] = 3/2 Omega_m a (D2 - D1^2)."""
        d1, d2 = float(self.background.D1(a)), float(self.background.D2(a))
        scale = 1.5 * self.omega_m * a
        return scale * d1 / self.d1_init, scale * (d2 - d1**2) / self.d2_init

    def _q(self, a: float) -> float:
        """Q(a) = a^3 E(a) (TZE13 eq. A.1)."""
        return a**3 * float(self.background.E(a))

    # Operators -------------------------------------------------------------------------------

    def force(self, state: ParticleState, a_from: float, a_to: float) -> None:
        """Compute the PM force at the current positions."""
        _require(state.a_positions == a_from == a_to, "force", a_from, state)
        self.pm_force(state.positions, state.force)
        state.a_force = a_to

    def kick(self, state: ParticleState, a_from: float, a_to: float) -> None:
        """Advance the momenta from a_from to a_to with the force at the positions' time a_c."""
        _require(state.a_momentum == a_from and state.a_force == state.a_positions, "kick",
                 a_from, state)
        a_c = state.a_force
        if self.cola:  # TZE13 eq. (A.15); u(a) = a^n
            n = self.n_cola
            factor = (a_to**n - a_from**n) / (self._q(a_c) * n * a_c ** (n - 1.0))
            lpt_1, lpt_2 = self.lpt_acceleration(a_c)
            _add_terms(state.momentum, state.force, factor * a_c, self.psi1, -factor * lpt_1,
                       self.psi2, -factor * lpt_2, 0.0)
        else:
            factor = integrate.quad(lambda a: a / self._q(a), a_from, a_to)[0]
            _add_terms(state.momentum, state.force, factor, self.psi1, 0.0, self.psi2, 0.0, 0.0)
        state.a_momentum = a_to

    def drift(self, state: ParticleState, a_from: float, a_to: float) -> None:
        """Advance the positions from a_from to a_to with the momenta at their time a_c."""
        _require(state.a_positions == a_from, "drift", a_from, state)
        a_c = state.a_momentum
        if self.cola:  # TZE13 eq. (A.15): the LPT part moves exactly, the residual with u(a)
            n = self.n_cola
            factor = integrate.quad(lambda a: a**n / self._q(a), a_from, a_to)[0] / a_c**n
            start_1, start_2 = self.lpt_displacement(a_from)
            end_1, end_2 = self.lpt_displacement(a_to)
            _add_terms(state.positions, state.momentum, factor, self.psi1, end_1 - start_1,
                       self.psi2, end_2 - start_2, self.pm_force.box_size)
        else:
            factor = integrate.quad(lambda a: 1.0 / self._q(a), a_from, a_to)[0]
            _add_terms(state.positions, state.momentum, factor, self.psi1, 0.0, self.psi2, 0.0,
                       self.pm_force.box_size)
        state.a_positions = a_to

    def peculiar_velocity(self, state: ParticleState) -> np.ndarray:
        """Peculiar velocities a dx/dt = H0 p / a in km/s, (M, 3) float32 (COLA adds T[x_LPT])."""
        a = state.a_momentum
        c1, c2 = self.lpt_momentum(a) if self.cola else (0.0, 0.0)
        velocity = np.zeros_like(state.momentum)
        _add_terms(velocity, state.momentum, HUBBLE_KM_S / a, self.psi1, HUBBLE_KM_S * c1 / a,
                   self.psi2, HUBBLE_KM_S * c2 / a, 0.0)
        return velocity

    def initial_state(self, positions: np.ndarray, velocity: np.ndarray,
                      a_init: float) -> ParticleState:
        """State at a_init from positions (Mpc/h) and peculiar velocities (km/s), both (M, 3).

        ``velocity`` is overwritten by the momentum p = a v / H0 (minus T[x_LPT] for COLA,
        which leaves the small difference between the IC velocities and the 2LPT ones).
        """
        momentum = velocity
        momentum *= np.float32(a_init / HUBBLE_KM_S)
        if self.cola:
            c1, c2 = self.lpt_momentum(a_init)
            _add_terms(momentum, self.psi1, 0.0, self.psi1, -c1, self.psi2, -c2, 0.0)
        return ParticleState(positions=positions, momentum=momentum,
                             force=np.zeros_like(positions), a_positions=a_init,
                             a_momentum=a_init, a_force=math.nan)


def _require(condition: bool, action: str, a_from: float, state: ParticleState) -> None:
    if not condition:
        raise RuntimeError(
            f"leapfrog {action} from a = {a_from} does not match the state (positions at "
            f"{state.a_positions}, momenta at {state.a_momentum}, force at {state.a_force})"
        )


# --------------------------------------------------------------------------------------------
# Evolution


def load_particles(ic: InitialConditions) -> tuple[np.ndarray, ...]:
    """(positions, velocity, psi1, psi2) of the IC particles, each (N^3, 3) float32.

    Positions x = q + psi1 + psi2 in [0, L) (Mpc/h), peculiar velocities in km/s,
    displacements in Mpc/h; particles in the C order of the lattice.
    """
    psi1, psi2 = _particle_major(ic.psi1), _particle_major(ic.psi2)
    return _lattice_positions(psi1, psi2, ic.box_size), _particle_major(ic.velocity), psi1, psi2


def setup_solver(particles: tuple[np.ndarray, ...], background: Background, a_init: float,
                 box_size: float, cola: bool, n_cola: float, mesh_factor: int,
                 threads: int = 1) -> tuple[Integrator, ParticleState]:
    """Integrator and initial state for ``particles`` from :func:`load_particles`.

    The arrays are used in place (the velocity array becomes the momentum). The PM meshes
    are allocated here, so free the IC's own arrays before calling this to bound the peak
    memory.
    """
    positions, velocity, psi1, psi2 = particles
    n_particles = round(len(positions) ** (1.0 / 3.0))
    force = ParticleMeshForce(mesh_factor * n_particles, box_size, background.cosmo.Omega_m,
                              len(positions), threads)
    integrator = Integrator(background, a_init, psi1, psi2, force, cola, n_cola)
    return integrator, integrator.initial_state(positions, velocity, a_init)


def _evolve_native(ic: InitialConditions, a_outputs: np.ndarray, n_steps: int, stepping: str,
                   cola: bool, n_cola: float, mesh_factor: int, threads: int,
                   monitor: Monitor | None) -> Iterator[tuple[float, np.ndarray, np.ndarray]]:
    """Yield (a, positions, peculiar velocities) at each output time, in time order."""
    a_init, box_size, sim_id, n_particles = ic.a_init, ic.box_size, ic.sim_id, ic.n_particles
    background = Background(ic.cosmology)
    particles = load_particles(ic)
    del ic  # with the caller's reference gone, the (3, N, N, N) arrays are freed here
    integrator, state = setup_solver(particles, background, a_init, box_size, cola, n_cola,
                                     mesh_factor, threads)
    del particles
    steps = time_steps(a_init, a_outputs, n_steps, stepping)
    outputs = set(a_outputs.tolist())
    logger.info("sim %d: %d^3 particles, %d^3 mesh, %d %s steps from z = %.4g (%s, %s gradient)",
                sim_id, n_particles, integrator.pm_force.n_mesh, len(steps) - 1, stepping,
                1 / a_init - 1,
                f"COLA n = {n_cola:g}" if cola else "plain PM", GRADIENT)
    step, started = 0, time.perf_counter()
    for action, a_from, a_to in leapfrog(steps, stepping):
        getattr(integrator, action)(state, a_from, a_to)
        if action != "kick" or not state.synchronous:
            continue
        step += 1
        logger.info("sim %d: step %d/%d to a = %.4f (z = %.4f) in %.2f s", sim_id, step,
                    len(steps) - 1, a_to, 1 / a_to - 1, time.perf_counter() - started)
        if a_to in outputs:
            yield a_to, state.positions, integrator.peculiar_velocity(state)
        if monitor is not None:
            monitor(step, a_to, state)
        started = time.perf_counter()


def _evolve_pycola(ic: InitialConditions, a_outputs: np.ndarray, n_steps: int, stepping: str,
                   n_cola: float, mesh_factor: int, threads: int, ic_path: Path,
                   workdir: Path, pycola_python: str | None
                   ) -> Iterator[tuple[float, np.ndarray, np.ndarray]]:
    """Yield (a, positions, peculiar velocities) at each output time from the real pyCOLA.

    pyCOLA runs in its own interpreter (:mod:`simulations.pycola_backend`), reading
    ``ic_path`` itself and writing into ``workdir``; one evolve() per output, with as many
    steps from a_init as our schedule (:func:`time_steps`) puts before that output.
    """
    from simulations import pycola_backend

    sim_id, a_init = ic.sim_id, ic.a_init
    del ic  # pyCOLA reads ic.h5 itself: free our copy before it starts
    order = np.sort(a_outputs)
    steps = time_steps(a_init, order, n_steps, stepping)
    counts = pycola_backend.steps_to_outputs(steps, order)
    result = workdir / "pycola_result.h5"
    logger.info("sim %d: pyCOLA evolve() to a = %s in %s steps from z = %.4g (mesh factor "
                "%d, nCola = %g)", sim_id, ", ".join(f"{a:.4f}" for a in order),
                ", ".join(map(str, counts)), 1 / a_init - 1, mesh_factor, n_cola)
    pycola_backend.run_pycola(ic_path, result, sim_id, order, counts, n_cola, mesh_factor,
                              threads, pycola_python)
    with h5py.File(result, "r") as handle:
        for index, a in enumerate(order):
            yield float(a), handle["positions"][index], handle["velocities"][index]


def solver_version(backend: str, pycola_python: str | None) -> str:
    """The snapshot's ``backend_version``: pycola3's version for the 'pycola' backend (a missing
    or broken pyCOLA environment fails here), else this code's."""
    if backend == "pycola":
        from simulations import pycola_backend

        return f"pycola3 {pycola_backend.check_environment(pycola_python)['pycola3']}"
    return f"cosmoflow {CODE_VERSION}"


def check_redshifts(ic: InitialConditions, ic_path: str | Path, redshifts: np.ndarray) -> None:
    """Refuse snapshot redshifts at or above the initial conditions' z_init (which must be
    positive): what the configuration cannot check without ic.h5."""
    if not (ic.z_init > 0 and ic.z_init > redshifts.max()):
        raise PipelineError(
            f"Initial conditions {ic_path} have z_init = {ic.z_init:g}; it must be positive and "
            f"above the highest snapshot redshift ({redshifts.max():g})."
        )


def snapshot_attributes(ic: InitialConditions, *, n_steps: int, stepping: str, cola: bool,
                        n_cola: float, mesh_factor: int, backend: str, backend_version: str,
                        provenance: str) -> dict:
    """The snapshot's attributes (:data:`SNAPSHOT_ATTRIBUTES`, in that order, and
    ``provenance`` when given): the simulation, its cosmology and lattice from the initial
    conditions, the solver's settings and versions, the units."""
    cosmo = ic.cosmology
    attrs = {
        "sim_id": ic.sim_id, "seed": ic.seed, "n_particles": ic.n_particles,
        "box_size": ic.box_size, "Omega_m": cosmo.Omega_m, "Omega_b": cosmo.Omega_b,
        "h": cosmo.h, "sigma_8": cosmo.sigma_8, "n_s": cosmo.n_s, "z_init": ic.z_init,
        "n_steps": int(n_steps), "stepping": stepping, "cola": bool(cola),
        "n_cola": float(n_cola), "mesh_factor": int(mesh_factor), "gradient": GRADIENT,
        "backend": backend, "backend_version": backend_version, "code_version": CODE_VERSION,
        "units_position": "Mpc/h", "units_velocity": "km/s",
    }
    if provenance:
        attrs["provenance"] = provenance
    return attrs


def write_snapshot(path: Path, redshifts: np.ndarray, attrs: dict,
                   snapshots: Iterator[tuple[float, np.ndarray, np.ndarray]]) -> None:
    """Write ``snapshot.h5`` atomically and without timestamps (the same run, the same bytes).

    ``snapshots`` yields (a, positions, peculiar velocities) as a solver reaches each output;
    each is stored at every index of ``redshifts`` with that scale factor. The file is laid
    out (datasets, then ``attrs``) before the first one is taken, so the solver's arrays are
    written as they come and an interrupted run leaves no file.
    """
    a_outputs = 1.0 / (1.0 + redshifts)
    shape = (len(redshifts), attrs["n_particles"] ** 3, 3)
    with atomic_path(path) as tmp, h5py.File(tmp, "w", track_order=False) as handle:
        positions = handle.create_dataset("positions", shape, np.float32, track_times=False)
        velocities = handle.create_dataset("velocities", shape, np.float32, track_times=False)
        handle.create_dataset("redshifts", data=redshifts, dtype=np.float64, track_times=False)
        for key, value in attrs.items():
            handle.attrs[key] = value
        written = 0
        for a, particle_positions, particle_velocities in snapshots:
            for index in np.flatnonzero(a_outputs == a):
                positions[index] = particle_positions
                velocities[index] = particle_velocities
                written += 1
        if written != len(redshifts):
            raise RuntimeError(f"wrote {written} of {len(redshifts)} snapshots")


def run_simulation(
    ic_path: str | Path,
    snapshot_path: str | Path,
    redshifts: Sequence[float],
    n_steps: int,
    *,
    stepping: str,
    cola: bool,
    n_cola: float,
    mesh_factor: int,
    backend: str,
    threads: int = 1,
    monitor: Monitor | None = None,
    provenance: str = "",
    pycola_python: str | None = None,
) -> Path:
    """Evolve ``ic_path`` (ic.h5) and write the particles at ``redshifts`` to ``snapshot_path``.

    redshifts: output redshifts, each >= 0 and below the IC's z_init, stored in this order;
    n_steps: number of time steps from z_init to the lowest redshift; stepping: 'linear_a' or
    'log_a'; cola: COLA (True) or plain PM; n_cola: exponent of the COLA time stepping;
    mesh_factor: PM mesh cells per particle per side; threads: numba and FFT threads (pyCOLA's
    OpenMP threads); backend: 'native' (this module) or 'pycola' (the real pyCOLA in its own
    environment, whose interpreter is ``pycola_python``, default that of ``python -m
    simulations.pycola_backend setup``; see :mod:`simulations.pycola_backend`).
    monitor(step, a, state) is called after every native step (for tests and diagnostics);
    pyCOLA has no such hook.
    provenance: stored as the attribute of that name (workflow.batch).
    sim_id, seed and the cosmology are taken from ic.h5. The file is written atomically, so an
    interrupted run leaves no snapshot.h5. Returns the snapshot path.

    The settings are keys of the configuration's simulation section, which
    :func:`workflow.config.validate_config` checks; here only what needs the initial conditions
    (z_init above every redshift, pyCOLA's limits).
    """
    backend_version = solver_version(backend, pycola_python)  # before any work
    ic = read_initial_conditions(ic_path)
    z = np.asarray(redshifts, dtype=float)
    check_redshifts(ic, ic_path, z)
    if backend == "pycola":
        from simulations import pycola_backend

        pycola_backend.check_arguments(cola, stepping, ic.n_particles, mesh_factor, threads,
                                       ic.a_init)
    attrs = snapshot_attributes(ic, n_steps=n_steps, stepping=stepping, cola=cola, n_cola=n_cola,
                                mesh_factor=mesh_factor, backend=backend,
                                backend_version=backend_version, provenance=provenance)
    a_outputs = 1.0 / (1.0 + z)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    snapshot_path = Path(snapshot_path)
    with contextlib.ExitStack() as stack:
        if backend == "pycola":
            snapshot_path.parent.mkdir(parents=True, exist_ok=True)
            workdir = stack.enter_context(tempfile.TemporaryDirectory(
                dir=snapshot_path.parent, prefix=f".{snapshot_path.stem}.pycola-"))
            snapshots = _evolve_pycola(ic, a_outputs, n_steps, stepping, n_cola, mesh_factor,
                                       threads, Path(ic_path), Path(workdir), pycola_python)
        else:
            snapshots = _evolve_native(ic, a_outputs, n_steps, stepping, cola, n_cola,
                                       mesh_factor, threads, monitor)
        del ic  # the solvers free (native) or never need (pyCOLA) the IC arrays from here on
        write_snapshot(snapshot_path, z, attrs, snapshots)
    logger.info("sim %d: wrote %s (z = %s)", attrs["sim_id"], snapshot_path,
                ", ".join(f"{value:g}" for value in z))
    return snapshot_path
