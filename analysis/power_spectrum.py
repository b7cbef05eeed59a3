"""Binned power spectrum of density grids and particle counts, and per-sample summary statistics.

Estimator (e.g. Jing 2005, ApJ 620, 559; Feldman, Kaiser & Peacock 1994 for the shot noise):
for a periodic box of side L (Mpc/h) on an n^3 mesh of cells of side H = L / n,

    delta_k   = sum_x delta(x) exp(-i k.x)                      (numpy's unnormalised FFT)
    P_raw(k)  = |delta_k|^2 L^3 / n^6                           ((Mpc/h)^3)
    P(k)      = [P_raw(k) - S C(k)] / W^2(k)

with delta = counts / mean(counts) - 1 for particle counts (or the given overdensity), S the
shot noise (1/nbar for a Poisson sample of nbar particles per (Mpc/h)^3), and, for a mass
assignment of order p (NGP p = 1, CIC p = 2, TSC p = 3), the window and the alias sum of the
Poisson shot noise per axis (Jing 2005 eqs. 18-20; s = sin(k_d H / 2)):

    W(k) = prod_d sinc(k_d H / 2)^p,
    C(k) = prod_d {1 (NGP),  1 - 2/3 s^2 (CIC),  1 - s^2 + 2/15 s^4 (TSC)}.

P is averaged over the modes of each k bin (the k = 0 mode is never used) and every mode is
counted over the full sphere (both members of a Hermitian pair), so the Gaussian (cosmic-
variance) error of a bin is P sqrt(2 / n_modes). Bins are logarithmic or linear in k (h/Mpc).

The spectrum is taken with ``scipy.fft.rfftn``; the binning is a numba kernel (one pass over
the half-complex spectrum, no temporaries: numpy's ``abs`` + ``bincount`` route costs about 0.6
of the FFT on a 128^3 grid, this about 0.1; ``bench/analysis_throughput.py`` times the whole
estimator). The bin of each mode comes from a lookup table of the integer |m|^2, and the window
from per-axis factors, so the memory besides the spectrum is O(n^2), not a per-mode table.

Summary statistics (:func:`summary_statistics`): per channel of a sample, log10 of its binned
P(k) (shot noise included, so every bin is positive) and the one-point statistics of
log(1 + counts) (mean, variance, skewness, excess kurtosis, percentiles). A sample's sub-volume
is not periodic; its FFT treats it as periodic, which adds the same edge leakage to every sample,
harmless for a regression feature but not a physical P(k): use whole boxes for physics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import numba
import numpy as np
import scipy.fft
import scipy.stats

from workflow.errors import PipelineError

ASSIGNMENTS = {"none": 0, "ngp": 1, "cic": 2, "tsc": 3}
"""Mass-assignment schemes and their window order p (W = prod sinc^p); 'none': no window."""
BINNINGS = ("log", "linear")
LOG_BINS_PER_DECADE = 8
"""Default logarithmic bins per decade of k: ratio 1.33 between edges, below the sqrt(2)
between the two first shells |m| = 1, sqrt(2), so that no default bin is empty."""
PERCENTILES = (5.0, 25.0, 50.0, 75.0, 95.0)
_EDGE_SLACK = 1e-9  # default outer edges are widened by this fraction so k_f and k_Ny are inside


@dataclasses.dataclass(frozen=True)
class PowerSpectrum:
    """A binned power spectrum.

    k_edges: (n_bins + 1,) bin edges, h/Mpc (a mode is in bin b if edges[b] <= |k| < edges[b+1]);
    k: (n_bins,) mean |k| of the modes in each bin, h/Mpc (NaN for a bin without modes);
    power: (n_bins,) P(k) in (Mpc/h)^3, shot noise subtracted and window deconvolved as
    requested (NaN for an empty bin); n_modes: (n_bins,) modes per bin, full sphere;
    shot_noise: the S subtracted, (Mpc/h)^3 (0 if none); box_size (Mpc/h); n_mesh; assignment.
    """

    k_edges: np.ndarray
    k: np.ndarray
    power: np.ndarray
    n_modes: np.ndarray
    shot_noise: float
    box_size: float
    n_mesh: int
    assignment: str

    @property
    def k_fundamental(self) -> float:
        """2 pi / L, h/Mpc."""
        return 2.0 * math.pi / self.box_size

    @property
    def k_nyquist(self) -> float:
        """pi n / L, h/Mpc."""
        return math.pi * self.n_mesh / self.box_size

    def gaussian_error(self, expected: np.ndarray | None = None) -> np.ndarray:
        """Cosmic-variance error of each bin, expected * sqrt(2 / n_modes), (Mpc/h)^3.

        ``expected`` defaults to the measured power (plus the subtracted shot noise, which
        also fluctuates); pass the model spectrum for a test against it.
        """
        base = self.power + self.shot_noise if expected is None else np.asarray(expected)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.abs(base) * np.sqrt(2.0 / self.n_modes)


# --------------------------------------------------------------------------------------------
# Bins


def k_bin_edges(
    n_mesh: int,
    box_size: float,
    binning: str = "log",
    n_bins: int | None = None,
    k_min: float | None = None,
    k_max: float | None = None,
) -> np.ndarray:
    """Edges (h/Mpc) of ``n_bins`` logarithmic or linear bins for an n_mesh^3 mesh of side L.

    Defaults: 'log' from the fundamental k_f = 2 pi / L to the Nyquist frequency pi n / L with
    ``LOG_BINS_PER_DECADE`` bins per decade; 'linear' bins k_f wide centred on k_f, 2 k_f, ...,
    up to the Nyquist frequency (edges (i + 1/2) k_f).
    """
    _check_positive("box_size", box_size)
    if not (isinstance(n_mesh, (int, np.integer)) and n_mesh >= 2):
        raise PipelineError(f"Power spectrum n_mesh = {n_mesh!r} must be an integer >= 2.")
    k_f = 2.0 * math.pi / box_size
    k_ny = math.pi * n_mesh / box_size
    if binning == "log":
        low = k_f * (1.0 - _EDGE_SLACK) if k_min is None else k_min
        high = k_ny * (1.0 + _EDGE_SLACK) if k_max is None else k_max
        _check_range(low, high)
        if n_bins is None:
            n_bins = max(1, math.ceil(LOG_BINS_PER_DECADE * math.log10(high / low)))
        _check_n_bins(n_bins)
        return np.geomspace(low, high, n_bins + 1)
    if binning == "linear":
        if n_bins is None and k_min is None and k_max is None:
            return k_f * (np.arange(n_mesh // 2 + 1) + 0.5)
        low = 0.5 * k_f if k_min is None else k_min
        high = k_ny + 0.5 * k_f if k_max is None else k_max
        _check_range(low, high)
        n_bins = max(1, round((high - low) / k_f)) if n_bins is None else n_bins
        _check_n_bins(n_bins)
        return np.linspace(low, high, n_bins + 1)
    raise PipelineError(f"Power spectrum binning = {binning!r} is not one of {BINNINGS}.")


def summary_k_edges(n_mesh: int, box_size: float, n_bins: int | None = None) -> np.ndarray:
    """The log bins of :func:`k_bin_edges` with every bin that holds no mode of an n_mesh^3
    mesh merged into its neighbour above, so that each bin of a small sample has a P(k)."""
    edges = k_bin_edges(n_mesh, box_size, "log", n_bins)
    half = np.arange(n_mesh // 2 + 1)
    m2 = np.unique(np.add.outer(np.add.outer(half**2, half**2), half**2))[1:]
    counts = np.histogram(2.0 * math.pi / box_size * np.sqrt(m2), edges)[0]
    return np.array([edges[0]] + [edges[i + 1] for i in range(len(counts)) if counts[i]])


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float, np.number)) and value > 0 and math.isfinite(value)):
        raise PipelineError(f"Power spectrum {name} = {value!r} must be a positive number.")


def _check_range(low: float, high: float) -> None:
    if not (0 < low < high and math.isfinite(high)):
        raise PipelineError(
            f"Power spectrum k range ({low!r}, {high!r}) h/Mpc must satisfy 0 < k_min < k_max.")


def _check_n_bins(n_bins: int) -> None:
    if not (isinstance(n_bins, (int, np.integer)) and n_bins >= 1):
        raise PipelineError(f"Power spectrum n_bins = {n_bins!r} must be a positive integer.")


def _checked_edges(edges: Sequence[float]) -> np.ndarray:
    edges = np.asarray(edges, dtype=float)
    if edges.ndim != 1 or len(edges) < 2 or not np.all(np.isfinite(edges)) or edges[0] <= 0 \
            or np.any(np.diff(edges) <= 0):
        raise PipelineError(
            f"Power spectrum k_edges = {edges.tolist()} must be at least two finite, positive, "
            f"strictly increasing wavenumbers (h/Mpc).")
    return edges


# --------------------------------------------------------------------------------------------
# Per-axis window factors and the geometry of the bins (cached: they depend on the mesh only)


def _signed_modes(n: int) -> np.ndarray:
    """Integer wavenumber m of each FFT index on an axis of n cells (Nyquist as -n/2)."""
    return np.fft.fftfreq(n, 1.0 / n)


def _axis_factors(n: int, assignment: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis 1 / W_d^2 and C_d / W_d^2 for the full axis (length n), float64.

    W_d = sinc(pi m / n)^p, C_d the Poisson alias sum of Jing (2005) for order p.
    """
    order = ASSIGNMENTS[assignment]
    x = np.pi * _signed_modes(n) / n
    window_sq = np.sinc(x / np.pi) ** (2 * order)
    s2 = np.sin(x) ** 2
    alias = {0: np.ones_like(x), 1: np.ones_like(x), 2: 1.0 - 2.0 / 3.0 * s2,
             3: 1.0 - s2 + 2.0 / 15.0 * s2**2}[order]
    return 1.0 / window_sq, alias / window_sq


@dataclasses.dataclass(frozen=True)
class _BinGeometry:
    bin_of_m2: np.ndarray  # int64 bin index of each integer |m|^2 (-1: outside every bin)
    inverse_window: np.ndarray  # (n,) per-axis 1 / W_d^2
    n_modes: np.ndarray  # (n_bins,) float64
    k_mean: np.ndarray  # (n_bins,) h/Mpc, NaN where empty
    shot_factor: np.ndarray  # (n_bins,) mean of C / W^2 over the bin's modes


@functools.lru_cache(maxsize=32)
def _bin_geometry(n: int, box_size: float, edges: tuple[float, ...], assignment: str) -> _BinGeometry:
    k_f = 2.0 * math.pi / box_size
    m2_max = 3 * (n // 2) ** 2
    k_of_m2 = k_f * np.sqrt(np.arange(m2_max + 1, dtype=float))
    edges_array = np.asarray(edges)
    bin_of_m2 = np.searchsorted(edges_array, k_of_m2, side="right") - 1
    bin_of_m2[(bin_of_m2 >= len(edges) - 1) | (k_of_m2 == 0.0)] = -1
    inverse_window, shot_window = _axis_factors(n, assignment)
    n_bins = len(edges) - 1
    n_modes = np.zeros(n_bins)
    k_sum = np.zeros(n_bins)
    shot_sum = np.zeros(n_bins)
    _bin_geometry_kernel(n, bin_of_m2.astype(np.int64), shot_window, k_f, n_modes, k_sum, shot_sum)
    with np.errstate(invalid="ignore", divide="ignore"):
        k_mean = np.where(n_modes > 0, k_sum / n_modes, np.nan)
        shot_factor = np.where(n_modes > 0, shot_sum / n_modes, np.nan)
    return _BinGeometry(bin_of_m2.astype(np.int64), inverse_window, n_modes, k_mean, shot_factor)


@numba.njit(cache=True, nogil=True)
def _bin_geometry_kernel(n, bin_of_m2, shot_window, k_f, n_modes, k_sum, shot_sum):
    n_last = n // 2 + 1
    for i in range(n):
        mi = i if 2 * i < n else i - n
        for j in range(n):
            mj = j if 2 * j < n else j - n
            m2_ij = mi * mi + mj * mj
            s_ij = shot_window[i] * shot_window[j]
            for l in range(n_last):
                b = bin_of_m2[m2_ij + l * l]
                if b < 0:
                    continue
                multiplicity = 1.0 if (l == 0 or 2 * l == n) else 2.0
                n_modes[b] += multiplicity
                k_sum[b] += multiplicity * k_f * math.sqrt(m2_ij + l * l)
                shot_sum[b] += multiplicity * s_ij * shot_window[l]


@numba.njit(cache=True, nogil=True)
def _bin_power_kernel(spectrum, bin_of_m2, inverse_window, power_sum):
    """power_sum[b] += multiplicity |F|^2 / W^2 over the modes of bin b (serial, one pass)."""
    n = spectrum.shape[0]
    n_last = spectrum.shape[2]
    for i in range(n):
        mi = i if 2 * i < n else i - n
        for j in range(n):
            mj = j if 2 * j < n else j - n
            m2_ij = mi * mi + mj * mj
            w_ij = inverse_window[i] * inverse_window[j]
            for l in range(n_last):
                b = bin_of_m2[m2_ij + l * l]
                if b < 0:
                    continue
                c = spectrum[i, j, l]
                weight = w_ij * inverse_window[l]
                if not (l == 0 or 2 * l == n):
                    weight *= 2.0
                power_sum[b] += weight * (c.real * c.real + c.imag * c.imag)


# --------------------------------------------------------------------------------------------
# Estimator


def _check_grid(grid: np.ndarray) -> np.ndarray:
    grid = np.asarray(grid)
    n = grid.shape[0] if grid.ndim else 0
    if grid.ndim != 3 or grid.shape != (n, n, n) or n < 2 or n % 2:
        raise PipelineError(
            f"Power spectrum grid has shape {grid.shape}; expected a cubic (n, n, n) mesh with n "
            f"even and >= 2.")
    if grid.dtype.kind not in "iuf":
        raise PipelineError(f"Power spectrum grid has dtype {grid.dtype}; expected numbers.")
    return grid


def _mean_free(grid: np.ndarray, kind: str) -> tuple[np.ndarray, float]:
    """The grid minus its mean in float32 (float64 for float64 input), and the mean.

    Removing the mean before a single-precision FFT keeps the rounding of the k = 0 mode out of
    the others.
    """
    dtype = np.float64 if grid.dtype == np.float64 else np.float32
    # Integers sum exactly in int64; floats in their own precision with numpy's pairwise
    # summation (relative error ~1e-7 in float32, half the time of a float64 accumulation).
    total = np.sum(grid, dtype=np.int64 if grid.dtype.kind in "iu" else grid.dtype)
    mean = float(total) / grid.size
    if kind == "counts" and not (mean > 0 and math.isfinite(mean)):
        raise PipelineError(
            f"Power spectrum of particle counts needs a positive mean count; the grid's mean is "
            f"{mean!r}.")
    if not math.isfinite(mean):
        raise PipelineError("Power spectrum grid holds values that are not finite.")
    return np.subtract(grid, dtype(mean), dtype=dtype), mean


def power_spectrum(
    grid: np.ndarray,
    box_size: float,
    *,
    kind: str = "counts",
    assignment: str = "none",
    shot_noise: str | float = "none",
    binning: str = "log",
    n_bins: int | None = None,
    k_min: float | None = None,
    k_max: float | None = None,
    k_edges: Sequence[float] | None = None,
    workers: int = 1,
) -> PowerSpectrum:
    """Binned power spectrum P(k), (Mpc/h)^3, of a periodic cubic grid of side ``box_size`` (Mpc/h).

    kind: 'counts' (particle counts or masses per cell; delta = counts / mean - 1) or
    'overdensity' (the grid is delta itself). assignment: the mass-assignment window to divide
    out, one of ``ASSIGNMENTS`` ('none' for a field sampled at the cell centres). shot_noise:
    'none', 'poisson' (S = 1/nbar with nbar = sum(counts) / L^3, for Poisson-sampled counts;
    kind 'counts' only) or a number S in (Mpc/h)^3; it is subtracted with the alias factor C(k)
    of the assignment before deconvolution (module docstring). Bins: ``k_edges`` (h/Mpc) if
    given, else :func:`k_bin_edges` (binning, n_bins, k_min, k_max). workers: FFT threads.
    """
    grid = _check_grid(grid)
    _check_positive("box_size", box_size)
    if kind not in ("counts", "overdensity"):
        raise PipelineError(f"Power spectrum kind = {kind!r} is not 'counts' or 'overdensity'.")
    if assignment not in ASSIGNMENTS:
        raise PipelineError(
            f"Power spectrum assignment = {assignment!r} is not one of {list(ASSIGNMENTS)}.")
    n = grid.shape[0]
    edges = (k_bin_edges(n, box_size, binning, n_bins, k_min, k_max) if k_edges is None
             else _checked_edges(k_edges))
    geometry = _bin_geometry(n, float(box_size), tuple(float(e) for e in edges), assignment)

    if kind == "counts":
        centred, mean = _mean_free(grid, kind)
        scale = 1.0 / mean**2  # delta_k = F / mean for k != 0
    else:
        centred, mean = (grid if grid.dtype.kind == "f" else grid.astype(np.float32)), None
        scale = 1.0
    spectrum = scipy.fft.rfftn(centred, workers=workers, overwrite_x=centred is not grid)
    power_sum = np.zeros(len(edges) - 1)
    _bin_power_kernel(spectrum, geometry.bin_of_m2, geometry.inverse_window, power_sum)

    volume = float(box_size) ** 3
    with np.errstate(invalid="ignore", divide="ignore"):
        power = np.where(geometry.n_modes > 0, power_sum / geometry.n_modes, np.nan)
    power *= scale * volume / float(n) ** 6

    noise = _shot_noise(shot_noise, kind, mean, n, volume)
    if noise:
        power = power - noise * geometry.shot_factor
    return PowerSpectrum(
        k_edges=edges, k=geometry.k_mean.copy(), power=power,
        n_modes=geometry.n_modes.astype(np.int64), shot_noise=noise,
        box_size=float(box_size), n_mesh=n, assignment=assignment)


def _shot_noise(shot_noise: str | float, kind: str, mean: float | None, n: int,
                volume: float) -> float:
    """S in (Mpc/h)^3: 1/nbar = L^3 / (n^3 mean count) for 'poisson', else the given value."""
    if isinstance(shot_noise, str):
        if shot_noise == "none":
            return 0.0
        if shot_noise == "poisson":
            if kind != "counts":
                raise PipelineError(
                    "Power spectrum shot_noise = 'poisson' needs kind = 'counts' (the number of "
                    "particles gives nbar); give the shot noise in (Mpc/h)^3 instead.")
            return volume / (mean * float(n) ** 3)
        raise PipelineError(
            f"Power spectrum shot_noise = {shot_noise!r} is not 'none', 'poisson' or a number.")
    value = float(shot_noise)
    if not (value >= 0 and math.isfinite(value)):
        raise PipelineError(
            f"Power spectrum shot_noise = {shot_noise!r} must be a non-negative number of "
            f"(Mpc/h)^3.")
    return value


def fourier_overdensity(
    grid: np.ndarray, box_size: float, *, kind: str = "counts", assignment: str = "none",
    workers: int = 1,
) -> np.ndarray:
    """Window-deconvolved delta_k = sum_x delta(x) e^{-ik.x} / W(k) in ``rfftn`` layout.

    Same conventions as :func:`power_spectrum` (whose bins average |delta_k|^2 L^3 / n^6 of
    these modes); the k = 0 mode is set to 0. For diagnostics and tests of single modes.
    """
    grid = _check_grid(grid)
    _check_positive("box_size", box_size)
    if assignment not in ASSIGNMENTS:
        raise PipelineError(
            f"Power spectrum assignment = {assignment!r} is not one of {list(ASSIGNMENTS)}.")
    n = grid.shape[0]
    if kind == "counts":
        centred, mean = _mean_free(grid, kind)
        modes = scipy.fft.rfftn(centred, workers=workers) / mean
    elif kind == "overdensity":
        modes = scipy.fft.rfftn(grid.astype(np.float64), workers=workers)
    else:
        raise PipelineError(f"Power spectrum kind = {kind!r} is not 'counts' or 'overdensity'.")
    inverse_window, _ = _axis_factors(n, assignment)
    root = np.sqrt(inverse_window)
    modes = modes * (root[:, None, None] * root[None, :, None] * root[None, None, : n // 2 + 1])
    modes[0, 0, 0] = 0.0
    return modes


def bin_average(
    function: Callable[[np.ndarray], np.ndarray], n_mesh: int, box_size: float,
    k_edges: Sequence[float],
) -> np.ndarray:
    """Mean of ``function(|k|)`` over the modes of each bin (mode-count weighted), NaN if empty.

    The model prediction for exactly the modes :func:`power_spectrum` averages, e.g. a linear
    P(k) in (Mpc/h)^3 of k in h/Mpc, which matters in the first, sparsely filled bins.
    """
    edges = _checked_edges(k_edges)
    geometry = _bin_geometry(int(n_mesh), float(box_size), tuple(float(e) for e in edges), "none")
    k_f = 2.0 * math.pi / box_size
    m2 = np.arange(len(geometry.bin_of_m2))
    inside = geometry.bin_of_m2 >= 0
    # Modes per |m|^2 shell (full sphere): count the lattice points once per shell.
    shell_count = _shell_counts(int(n_mesh))
    values = np.asarray(function(k_f * np.sqrt(m2[inside].astype(float))), dtype=float)
    weights = shell_count[inside]
    sums = np.bincount(geometry.bin_of_m2[inside], weights=weights * values,
                       minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(geometry.n_modes > 0, sums / geometry.n_modes, np.nan)


@functools.lru_cache(maxsize=8)
def _shell_counts(n: int) -> np.ndarray:
    """Number of modes (full sphere, FFT index ranges of an n^3 mesh) with each integer |m|^2."""
    m = _signed_modes(n).astype(np.int64)
    m_last = np.arange(n // 2 + 1)
    multiplicity = np.where((m_last == 0) | (2 * m_last == n), 1, 2)
    m2_ij = (m[:, None] ** 2 + m[None, :] ** 2).ravel()
    counts = np.zeros(3 * (n // 2) ** 2 + 1)
    for l, weight in zip(m_last, multiplicity):
        counts += weight * np.bincount(m2_ij + l * l, minlength=len(counts))[: len(counts)]
    return counts


# --------------------------------------------------------------------------------------------
# Summary statistics of samples (features of the regression baselines)


def one_point_statistics(counts: np.ndarray, percentiles: Sequence[float] = PERCENTILES) -> np.ndarray:
    """Mean, variance, skewness, excess kurtosis and ``percentiles`` of log(1 + counts).

    counts: any shape of non-negative particle counts. Returns float64 (4 + len(percentiles),).
    A constant field has skewness and kurtosis 0 (instead of scipy's NaN).
    """
    values = np.log1p(np.asarray(counts, dtype=np.float64).ravel())
    if values.size == 0:
        raise PipelineError("One-point statistics of an empty sample are undefined.")
    variance = float(values.var())
    if variance > 0:
        skewness = float(scipy.stats.skew(values))
        kurtosis = float(scipy.stats.kurtosis(values))  # Fisher: 0 for a Gaussian
    else:
        skewness = kurtosis = 0.0
    return np.concatenate([[values.mean(), variance, skewness, kurtosis],
                           np.percentile(values, percentiles)])


def summary_statistics(
    sample: np.ndarray,
    box_size: float,
    *,
    n_bins: int | None = None,
    k_edges: Sequence[float] | None = None,
    assignment: str = "ngp",
    percentiles: Sequence[float] = PERCENTILES,
) -> np.ndarray:
    """Feature vector of one sample: per channel, log10 P(k) of its counts, then the
    one-point statistics of log(1 + counts) (:func:`one_point_statistics`).

    sample: (n, n, n) or (n, n, n, C) particle counts (the TFRecord ``x``); box_size: the
    sample's side in Mpc/h (sub-volume voxels x voxel size). P(k) in the log bins of
    :func:`summary_k_edges` (``n_bins``; or ``k_edges``), deconvolved for ``assignment``, shot
    noise not subtracted (so every bin is positive). Names in :func:`summary_names`.
    """
    sample = np.asarray(sample)
    channels = sample[..., None] if sample.ndim == 3 else sample
    if channels.ndim != 4:
        raise PipelineError(
            f"Summary statistics need a (n, n, n) or (n, n, n, C) sample; got shape {sample.shape}.")
    n = channels.shape[0]
    edges = summary_k_edges(n, box_size, n_bins) if k_edges is None else k_edges
    features = []
    for c in range(channels.shape[-1]):
        counts = np.ascontiguousarray(channels[..., c])
        spectrum = power_spectrum(counts, box_size, kind="counts", assignment=assignment,
                                  k_edges=edges)
        with np.errstate(divide="ignore", invalid="ignore"):
            features.append(np.log10(spectrum.power))
        features.append(one_point_statistics(counts, percentiles))
    return np.concatenate(features)


def summary_names(
    n_mesh: int, box_size: float, n_channels: int = 1, *, n_bins: int | None = None,
    k_edges: Sequence[float] | None = None, percentiles: Sequence[float] = PERCENTILES,
) -> list[str]:
    """Names of the :func:`summary_statistics` features, e.g. 'c0_log10P_k0.049', 'c1_skew'."""
    edges = summary_k_edges(n_mesh, box_size, n_bins) if k_edges is None else k_edges
    edges = np.asarray(edges)
    centres = np.sqrt(edges[:-1] * edges[1:])
    point = ["mean", "var", "skew", "kurt", *(f"p{q:g}" for q in percentiles)]
    names = []
    for c in range(n_channels):
        names += [f"c{c}_log10P_k{k:.3g}" for k in centres]
        names += [f"c{c}_log1p_{name}" for name in point]
    return names


def summary_features(
    samples: np.ndarray, box_size: float, **options
) -> np.ndarray:
    """:func:`summary_statistics` of each of ``samples`` (N, n, n, n[, C]): (N, n_features)."""
    samples = np.asarray(samples)
    if samples.ndim not in (4, 5) or len(samples) == 0:
        raise PipelineError(
            f"Summary features need a non-empty stack of samples (N, n, n, n[, C]); got shape "
            f"{samples.shape}.")
    return np.stack([summary_statistics(sample, box_size, **options) for sample in samples])
