"""Simulation validation: each snapshot's matter power spectrum against linear theory and halofit.

For every redshift z of a ``snapshot.h5`` (particle positions (n_z, N^3, 3) in Mpc/h, attrs
``box_size``, ``n_particles``, the cosmology; :func:`simulations.cola.run_simulation`), the
particles are painted with CIC on an n_mesh^3 mesh and :func:`analysis.power_spectrum.power_spectrum`
gives P(k) in (Mpc/h)^3 (CIC window deconvolved; no shot noise subtracted: particles displaced
from a lattice are far from a Poisson sample on large scales). Checks, with bins k_f wide:

* **amplitude** against linear theory, P_lin(k, z) = P_lin(k, 0) (D1(z) / D1(0))^2
  (:func:`simulations.cosmology.linear_power`, :class:`simulations.cosmology.Background`),
  averaged over exactly the modes of each bin, on large scales: bins with k below
  ``k_max_fraction`` x the particle Nyquist frequency pi N / L (and ``k_max`` if set) where
  the linear dimensionless power Delta^2(k, z) = k^3 P_lin / (2 pi^2) is at most
  ``delta2_max``. The amplitude A = sum_b n_b (P_b / P_lin,b) / sum_b n_b is the
  inverse-variance mean of the bins' ratios (var(P_b / P_lin,b) = 2 / n_b for a Gaussian field
  of n_b modes), with error sigma_A = sqrt(2 / sum_b n_b). The snapshot is flagged at that
  redshift if |A - 1| > ``tolerance`` + ``n_sigma`` sigma_A: the tolerance absorbs the
  non-linear boost still present at Delta^2 <= delta2_max and COLA's few-percent large-scale
  error, sigma_A the cosmic variance of a small box, so a correct small box is not flagged.
* **growth** between snapshots: G = mean_b [P_b(z) / P_b(z_ref)] / (D1(z) / D1(z_ref))^2 over
  the same large-scale bins (mode-weighted), z_ref the highest redshift. Both snapshots share
  their initial phases, so the linear cosmic variance cancels; what remains is the random
  mode coupling of non-linear growth, bounded here by the same sigma_A (on twelve correct COLA
  runs of 32^3 and 64^3 particles in 256 Mpc/h, G scattered by 0.03, a third of sigma_A).
  Flagged if |G - 1| > ``growth_tolerance`` + ``n_sigma`` sigma_A.
* **halofit** (when CAMB is installed, ``halofit`` 'auto' or True): the non-linear reference
  P_lin(k, z) x [P_halofit / P_lin]_CAMB(k, z), the Takahashi et al. (2012) halofit boost for the
  snapshot's cosmology with sigma_8 matched, for every bin up to k_max_fraction x the particle
  Nyquist frequency; reported as the mode-weighted mean ratio P / P_halofit, flagged only if
  ``halofit_tolerance`` is set (COLA with few steps is expected to fall below halofit on small
  scales). Without CAMB the halofit columns are absent and nothing fails.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import h5py
import numpy as np

from analysis.power_spectrum import PowerSpectrum, bin_average, k_bin_edges, power_spectrum
from simulations.cosmology import Background, Cosmology, linear_power
from simulations.mesh import paint_cic
from workflow.errors import PipelineError

log = logging.getLogger(__name__)

COSMOLOGY_ATTRS = ("Omega_m", "sigma_8", "n_s", "h", "Omega_b")
_CAMB_ACCURACY = 0.5
"""CAMB's AccuracyBoost for the halofit reference, with its high-precision transfer off: the
halofit boost moves by < 0.3% at k <= 0.4 h/Mpc against CAMB's defaults, in a quarter of the
time (0.8 s instead of 3.6 s per cosmology on one core of a 2-vCPU KVM machine whose CPU model
was not recorded; the ratio is the point)."""


@dataclasses.dataclass(frozen=True)
class ValidationSettings:
    """The checks' settings: the keys of the config section ``analysis.validation`` (the schema
    documents each, its default and range), and the linear theory's transfer function and CMB
    temperature (K) from section ``cosmology``."""

    k_max_fraction: float
    delta2_max: float
    tolerance: float
    n_sigma: float
    growth_tolerance: float
    halofit: str | bool
    halofit_tolerance: float | None
    transfer: str
    transfer_table: str | None
    T_cmb: float

    @classmethod
    def from_mapping(cls, validation: Mapping, cosmology: Mapping) -> "ValidationSettings":
        """Settings from the sections ``analysis.validation`` and ``cosmology`` of a validated
        configuration (workflow.config.validate_config: every key present and allowed)."""
        return cls(**validation, **{key: cosmology[key] for key in ("transfer", "transfer_table", "T_cmb")})


@dataclasses.dataclass(frozen=True)
class RedshiftCheck:
    """One redshift of one snapshot.

    spectrum: the measured P(k); linear: P_lin(k, z) averaged over each bin's modes, (Mpc/h)^3;
    halofit: the halofit reference per bin or None; large_scale: bins of the linear checks;
    amplitude, amplitude_error: A and sigma_A; growth: G (None at z_ref or for one redshift)
    with the allowance it was held to in ``growth_allowed``;
    halofit_ratio: mode-weighted mean P / P_halofit up to k_max_fraction x Nyquist, or None;
    reasons: why this redshift is flagged (empty if it is not).
    """

    redshift: float
    spectrum: PowerSpectrum
    linear: np.ndarray
    halofit: np.ndarray | None
    large_scale: np.ndarray
    amplitude: float
    amplitude_error: float
    growth: float | None
    growth_allowed: float | None
    halofit_ratio: float | None
    reasons: tuple[str, ...]

    def summary(self) -> dict:
        return {
            "redshift": self.redshift, "amplitude": self.amplitude,
            "amplitude_error": self.amplitude_error, "growth": self.growth,
            "growth_allowed": self.growth_allowed,
            "halofit_ratio": self.halofit_ratio,
            "k_max_linear": float(self.spectrum.k[self.large_scale].max())
            if self.large_scale.any() else None,
            "large_scale_modes": int(self.spectrum.n_modes[self.large_scale].sum()),
            "reasons": list(self.reasons),
        }


@dataclasses.dataclass(frozen=True)
class SimulationCheck:
    """All redshifts of one snapshot; ``flagged`` if any redshift has a reason."""

    path: str
    sim_id: int
    box_size: float
    n_particles: int
    cosmology: dict
    redshifts: tuple[RedshiftCheck, ...]

    @property
    def reasons(self) -> list[str]:
        return [reason for check in self.redshifts for reason in check.reasons]

    @property
    def checked(self) -> bool:
        """Whether any redshift had large-scale bins for the linear-theory check (a box too
        small for it, where even the largest scales are non-linear, is not checked)."""
        return any(check.large_scale.any() for check in self.redshifts)

    @property
    def flagged(self) -> bool:
        return bool(self.reasons)

    def summary(self) -> dict:
        """JSON-ready summary: identity, cosmology, per-redshift figures, flag and reasons."""
        return {"sim_id": self.sim_id, "path": self.path, "box_size": self.box_size,
                "n_particles": self.n_particles, "cosmology": self.cosmology,
                "flagged": self.flagged, "reasons": self.reasons,
                "redshifts": [check.summary() for check in self.redshifts]}


# --------------------------------------------------------------------------------------------
# Theory


def camb_available() -> bool:
    """Whether the optional ``camb`` package can be imported."""
    try:
        import camb  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _halofit_interpolators(cosmo: Cosmology, redshifts: tuple[float, ...], k_max: float):
    import camb
    from camb import model

    def results(a_s: float, nonlinear: bool):
        params = camb.CAMBparams()
        params.set_cosmology(
            H0=100.0 * cosmo.h, ombh2=cosmo.Omega_b * cosmo.h**2,
            omch2=(cosmo.Omega_m - cosmo.Omega_b) * cosmo.h**2, mnu=0.0,
            num_massive_neutrinos=0, omk=0.0, TCMB=cosmo.T_cmb)
        params.WantCls = False
        params.InitPower.set_params(ns=cosmo.n_s, As=a_s)
        params.set_matter_power(redshifts=sorted(set(redshifts) | {0.0}, reverse=True),
                                kmax=k_max * cosmo.h, nonlinear=nonlinear, silent=True)
        params.Transfer.high_precision = False
        params.set_accuracy(AccuracyBoost=_CAMB_ACCURACY)
        if nonlinear:
            params.NonLinearModel.set_params(halofit_version="takahashi")
            params.NonLinear = model.NonLinear_pk
        return camb.get_results(params)

    a_s = 2e-9 * (cosmo.sigma_8 / results(2e-9, False).get_sigma8_0()) ** 2
    matched = results(a_s, True)
    linear = matched.get_matter_power_interpolator(nonlinear=False, hubble_units=True, k_hunit=True)
    halofit = matched.get_matter_power_interpolator(nonlinear=True, hubble_units=True, k_hunit=True)
    return linear, halofit


def halofit_boost(cosmo: Cosmology, redshift: float, k: np.ndarray,
                  redshifts: Sequence[float] = ()) -> np.ndarray:
    """P_halofit / P_lin from CAMB (Takahashi et al. 2012) at ``redshift`` for k in h/Mpc.

    sigma_8 of CAMB's linear spectrum is matched to the cosmology's. ``redshifts``: all
    redshifts that will be asked for this cosmology (one CAMB run serves them). Raises
    PipelineError if CAMB is not installed.
    """
    if not camb_available():
        raise PipelineError("Halofit needs the camb package (extra 'camb'), which is not installed.")
    k = np.asarray(k, dtype=float)
    zs = tuple(sorted({float(redshift), *map(float, redshifts)}))
    # Halofit integrates the linear P(k) to find the non-linear scale: CAMB asks for
    # kmax >= 5/Mpc (20/Mpc above z = 4), whatever k is wanted.
    k_max = max(float(k.max()) * 1.5, (20.0 if max(zs) > 4 else 5.0) / cosmo.h)
    linear, halofit = _halofit_interpolators(cosmo, zs, math.ceil(k_max))
    return halofit.P(redshift, k) / linear.P(redshift, k)


# --------------------------------------------------------------------------------------------
# Snapshots


def _read_snapshot_header(handle: h5py.File, path: Path) -> tuple[dict, np.ndarray]:
    for name in ("positions", "redshifts"):
        if name not in handle:
            raise PipelineError(f"Snapshot {path} has no dataset '{name}'.")
    missing = [key for key in ("box_size", "n_particles", *COSMOLOGY_ATTRS) if key not in handle.attrs]
    if missing:
        raise PipelineError(f"Snapshot {path} lacks attribute(s) {', '.join(missing)}.")
    attrs = {key: handle.attrs[key] for key in handle.attrs}
    redshifts = np.asarray(handle["redshifts"][()], dtype=float)
    n = int(attrs["n_particles"])
    shape = handle["positions"].shape
    if shape != (len(redshifts), n**3, 3):
        raise PipelineError(
            f"Snapshot {path} has positions of shape {shape}; expected "
            f"{(len(redshifts), n**3, 3)} (n_redshifts, n_particles**3, 3).")
    return attrs, redshifts


def snapshot_power_spectra(
    snapshot_path: str | os.PathLike, n_mesh: int | None = None, workers: int = 1,
    k_edges: Sequence[float] | None = None,
) -> tuple[dict, np.ndarray, list[PowerSpectrum]]:
    """(attrs, redshifts, spectra): CIC P(k) of every redshift of a snapshot, linear bins k_f
    wide by default (or ``k_edges``, h/Mpc); n_mesh defaults to the particle lattice N."""
    path = Path(snapshot_path)
    if not path.is_file():
        raise PipelineError(f"Snapshot {path} does not exist; run the simulate stage first.")
    try:
        with h5py.File(path, "r") as handle:
            attrs, redshifts = _read_snapshot_header(handle, path)
            box = float(attrs["box_size"])
            mesh = int(n_mesh or attrs["n_particles"])
            mesh += mesh % 2
            edges = k_bin_edges(mesh, box, "linear") if k_edges is None else k_edges
            spectra = []
            for index in range(len(redshifts)):
                positions = handle["positions"][index]
                if not np.all(np.isfinite(positions)):
                    raise PipelineError(
                        f"Snapshot {path} has positions that are not finite at z = "
                        f"{redshifts[index]:g}.")
                counts = paint_cic(positions, box, mesh)
                spectra.append(power_spectrum(counts, box, kind="counts", assignment="cic",
                                              k_edges=edges, workers=workers))
    except OSError as error:
        raise PipelineError(f"Snapshot {path} cannot be read (truncated or corrupt?): {error}.") from error
    return attrs, redshifts, spectra


def histogram_power_spectra(
    histogram_path: str | os.PathLike, workers: int = 1, k_edges: Sequence[float] | None = None,
) -> tuple[dict, np.ndarray, list[PowerSpectrum]]:
    """(attrs, redshifts, spectra): the P(k) of every channel of a ``histograms/<sim_id>.h5``
    (counts (n_z, G, G, G); preprocessing.histogram), its mass-assignment window (NGP or CIC)
    deconvolved, linear bins k_f wide by default (or ``k_edges``, h/Mpc)."""
    path = Path(histogram_path)
    if not path.is_file():
        raise PipelineError(f"Histogram {path} does not exist; run the histogram stage first.")
    try:
        with h5py.File(path, "r") as handle:
            missing = [key for key in ("box_size", "n_particles", "redshifts", "assignment",
                                       *COSMOLOGY_ATTRS) if key not in handle.attrs]
            if "counts" not in handle or missing:
                raise PipelineError(f"Histogram {path} lacks {', '.join(missing or ['counts'])}.")
            attrs = {key: handle.attrs[key] for key in handle.attrs}
            counts = handle["counts"][()]
    except OSError as error:
        raise PipelineError(f"Histogram {path} cannot be read (truncated or corrupt?): {error}.") from error
    box, grid = float(attrs["box_size"]), counts.shape[1]
    assignment = attrs["assignment"]
    assignment = assignment.decode() if isinstance(assignment, bytes) else str(assignment)
    edges = k_bin_edges(grid, box, "linear") if k_edges is None else k_edges
    spectra = [power_spectrum(channel, box, kind="counts", assignment=assignment, k_edges=edges,
                              workers=workers) for channel in counts]
    return attrs, np.asarray(attrs["redshifts"], dtype=float), spectra


def _cosmology(attrs: dict, settings: ValidationSettings) -> Cosmology:
    return Cosmology(**{key: float(attrs[key]) for key in COSMOLOGY_ATTRS}, T_cmb=settings.T_cmb,
                     transfer=settings.transfer, transfer_table=settings.transfer_table)


def validate_snapshot(snapshot_path: str | os.PathLike, settings: ValidationSettings,
                      n_mesh: int | None = None, workers: int = 1) -> SimulationCheck:
    """Check every redshift of one snapshot, its particles painted with CIC on ``n_mesh``^3
    (default: the particle lattice); see the module docstring."""
    attrs, redshifts, spectra = snapshot_power_spectra(snapshot_path, n_mesh, workers)
    return check_spectra(Path(snapshot_path), attrs, redshifts, spectra, settings)


def validate_histogram(histogram_path: str | os.PathLike, settings: ValidationSettings,
                       workers: int = 1) -> SimulationCheck:
    """Check every redshift (channel) of one simulation's histogram, the field the data set is
    cut from; k up to ``k_max_fraction`` of the histogram's Nyquist frequency at most."""
    attrs, redshifts, spectra = histogram_power_spectra(histogram_path, workers)
    return check_spectra(Path(histogram_path), attrs, redshifts, spectra, settings)


def check_spectra(path: Path, attrs: dict, redshifts: np.ndarray, spectra: Sequence[PowerSpectrum],
                  settings: ValidationSettings) -> SimulationCheck:
    """The checks of the module docstring on one simulation's measured spectra; never raises
    for a bad P(k): a bad simulation is a flag with its reasons."""
    cosmo = _cosmology(attrs, settings)
    background = Background(cosmo)
    box, n_particles = float(attrs["box_size"]), int(attrs["n_particles"])
    nyquist = math.pi * min(n_particles, spectra[0].n_mesh) / box  # particles' or the grid's
    k_limit = settings.k_max_fraction * nyquist
    use_halofit = settings.halofit is True or (settings.halofit == "auto" and camb_available())
    if settings.halofit is True and not camb_available():
        raise PipelineError("Simulation validation halofit = true needs the camb package, which "
                            "is not installed; set halofit to 'auto' or false.")

    growth = [float(background.D1(1.0 / (1.0 + z))) for z in redshifts]
    linear_today = bin_average(lambda k: linear_power(cosmo, k), spectra[0].n_mesh, box,
                               spectra[0].k_edges)
    reference = int(np.argmax(redshifts))
    checks = []
    for index, (z, spectrum) in enumerate(zip(redshifts, spectra)):
        linear = linear_today * growth[index] ** 2
        delta2 = spectrum.k**3 * linear / (2 * math.pi**2)
        filled = spectrum.n_modes > 0
        large = filled & (spectrum.k <= k_limit) & (delta2 <= settings.delta2_max)
        reasons = []
        if not large.any():  # box too small for a linear-theory check at this redshift
            amplitude = error = math.nan
        else:
            weights = spectrum.n_modes[large]
            amplitude = float(np.sum(weights * spectrum.power[large] / linear[large]) / weights.sum())
            error = math.sqrt(2.0 / weights.sum())
            allowed = settings.tolerance + settings.n_sigma * error
            if not abs(amplitude - 1.0) <= allowed:
                reasons.append(
                    f"z = {z:g}: P(k) / linear theory = {amplitude:.3f} +/- {error:.3f} on "
                    f"k <= {spectrum.k[large].max():.3g} h/Mpc, beyond 1 +/- {allowed:.3f}")
        growth_ratio = growth_allowed = None
        if index != reference and large.any():
            expected = (growth[index] / growth[reference]) ** 2
            ratio = spectrum.power[large] / spectra[reference].power[large] / expected
            growth_ratio = float(np.sum(spectrum.n_modes[large] * ratio) / spectrum.n_modes[large].sum())
            growth_allowed = settings.growth_tolerance + settings.n_sigma * error
            if not abs(growth_ratio - 1.0) <= growth_allowed:
                reasons.append(
                    f"z = {z:g}: growth of P(k) since z = {redshifts[reference]:g} is "
                    f"{growth_ratio:.3f} of linear theory's (D1 ratio squared {expected:.3f}), "
                    f"beyond 1 +/- {growth_allowed:.3f}")
        halofit, halofit_ratio = None, None
        if use_halofit:
            halofit = np.full_like(linear, np.nan)
            nonlinear_bins = filled & (spectrum.k <= k_limit)
            halofit[nonlinear_bins] = linear[nonlinear_bins] * halofit_boost(
                cosmo, float(z), spectrum.k[nonlinear_bins], tuple(redshifts))
            weights = spectrum.n_modes[nonlinear_bins]
            halofit_ratio = float(np.sum(weights * spectrum.power[nonlinear_bins]
                                         / halofit[nonlinear_bins]) / weights.sum())
            if settings.halofit_tolerance is not None and \
                    not abs(halofit_ratio - 1.0) <= settings.halofit_tolerance:
                reasons.append(
                    f"z = {z:g}: P(k) / halofit = {halofit_ratio:.3f} up to {k_limit:.3g} h/Mpc, "
                    f"beyond 1 +/- {settings.halofit_tolerance:g}")
        checks.append(RedshiftCheck(float(z), spectrum, linear, halofit, large, amplitude,
                                    error, growth_ratio, growth_allowed, halofit_ratio,
                                    tuple(reasons)))
    result = SimulationCheck(str(path), int(attrs.get("sim_id", -1)), box, n_particles,
                             {key: float(attrs[key]) for key in COSMOLOGY_ATTRS}, tuple(checks))
    if result.flagged:
        log.warning("sim %d (%s) flagged: %s", result.sim_id, path, "; ".join(result.reasons))
    return result


def validate_histograms(histogram_paths: Iterable[str | os.PathLike], settings: ValidationSettings,
                        workers: int = 1) -> list[SimulationCheck]:
    """:func:`validate_histogram` of each path, in order."""
    return [validate_histogram(path, settings, workers) for path in histogram_paths]


def flagged_simulations(checks: Iterable[SimulationCheck]) -> list[dict]:
    """The flagged ones as {"sim_id", "path", "reasons"} (for metrics.json and the report)."""
    return [{"sim_id": check.sim_id, "path": check.path, "reasons": check.reasons}
            for check in checks if check.flagged]


# --------------------------------------------------------------------------------------------
# The check of one simulation on disk: validation/<sim_id>.h5 (stage validate_simulations)

def write_simulation_check(path: str | os.PathLike, check: SimulationCheck, provenance: str = "") -> None:
    """``check`` as HDF5, atomically and with reproducible bytes (no timestamps): identity and
    cosmology as attributes, and for redshift i the measured spectrum (``z<i>_spectrum_<field>``),
    the theory per bin (``z<i>_linear``, ``z<i>_halofit``), the large-scale bins and the figures;
    :func:`read_simulation_check` gives it back equal."""
    from workflow.io import atomic_path

    attrs = {"path": check.path, "sim_id": check.sim_id, "box_size": check.box_size,
             "n_particles": check.n_particles, "n_redshifts": len(check.redshifts), "provenance": provenance,
             **{f"cosmology_{key}": value for key, value in check.cosmology.items()}}
    arrays = {}
    for index, entry in enumerate(check.redshifts):
        fields = {f"spectrum_{field.name}": getattr(entry.spectrum, field.name)
                  for field in dataclasses.fields(PowerSpectrum)}
        fields |= {"linear": entry.linear, "large_scale": entry.large_scale, "halofit": entry.halofit,
                   "redshift": entry.redshift, "amplitude": entry.amplitude,
                   "amplitude_error": entry.amplitude_error, "reasons": list(entry.reasons) or [""]}
        fields |= {key: np.nan if value is None else value  # not computed: NaN
                   for key, value in (("growth", entry.growth), ("growth_allowed", entry.growth_allowed),
                                      ("halofit_ratio", entry.halofit_ratio))}
        for name, value in fields.items():
            if value is not None:
                (arrays if isinstance(value, np.ndarray) else attrs)[f"z{index}_{name}"] = value
    with atomic_path(path, ".h5") as tmp, h5py.File(tmp, "w") as handle:
        for name, value in arrays.items():
            handle.create_dataset(name, data=value, track_times=False)
        handle.attrs.update(attrs)


def read_simulation_check(path: str | os.PathLike) -> SimulationCheck:
    """The :class:`SimulationCheck` that :func:`write_simulation_check` wrote to ``path``."""

    def optional(value):
        return None if np.isnan(value) else float(value)

    try:
        with h5py.File(path, "r") as handle:
            attrs = dict(handle.attrs)
            stored = {name: handle[name][()] for name in handle} | attrs
    except OSError as error:
        raise PipelineError(f"simulation check {path} is unreadable ({error}); rerun "
                            f"validate_simulations for it") from None
    try:
        redshifts = []
        for index in range(int(attrs["n_redshifts"])):
            z = {name.removeprefix(f"z{index}_"): value for name, value in stored.items()
                 if name.startswith(f"z{index}_")}
            spectrum = PowerSpectrum(*(z[f"spectrum_{field.name}"]
                                       for field in dataclasses.fields(PowerSpectrum)))
            spectrum = dataclasses.replace(
                spectrum, shot_noise=float(spectrum.shot_noise), box_size=float(spectrum.box_size),
                n_mesh=int(spectrum.n_mesh), assignment=str(spectrum.assignment))
            redshifts.append(RedshiftCheck(
                redshift=float(z["redshift"]), spectrum=spectrum, linear=z["linear"],
                halofit=z.get("halofit"), large_scale=z["large_scale"], amplitude=float(z["amplitude"]),
                amplitude_error=float(z["amplitude_error"]), growth=optional(z["growth"]),
                growth_allowed=optional(z["growth_allowed"]), halofit_ratio=optional(z["halofit_ratio"]),
                reasons=tuple(str(reason) for reason in z["reasons"] if reason)))
        return SimulationCheck(
            path=str(attrs["path"]), sim_id=int(attrs["sim_id"]), box_size=float(attrs["box_size"]),
            n_particles=int(attrs["n_particles"]),
            cosmology={key.removeprefix("cosmology_"): float(value) for key, value in attrs.items()
                       if key.startswith("cosmology_")},
            redshifts=tuple(redshifts))
    except KeyError as error:
        raise PipelineError(f"simulation check {path} is unreadable (no {error}); rerun "
                            f"validate_simulations for it") from None
