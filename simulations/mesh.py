"""Particle-mesh kernels: CIC painting and readout, in-place FFTs, Fourier kernels, P(k).

Shared by the initial conditions, the COLA solver and the preprocessing stage. Writes no files.

Conventions
-----------
* A cubic periodic box of side ``box_size`` (Mpc/h) holds ``n_mesh**3`` cells of side
  ``h = box_size / n_mesh``; mesh value ``[i, j, l]`` belongs to the cell centred on
  ``((i, j, l) + 0.5) * h`` (the same cells as the density histograms, so nearest-grid-point
  assignment and CIC agree on which cell a particle sits in).
* Wavenumbers are in h/Mpc: ``k = 2 pi m / box_size`` with integer ``m`` in
  ``[-n/2, n/2)`` on the first two axes and ``[0, n/2]`` on the last (real-FFT half space).
* Forward transforms are unnormalised sums over cells (numpy convention); inverse transforms
  divide by ``n_mesh**3``.

CIC is the cloud-in-cell scheme of Hockney & Eastwood (1988), "Computer Simulation Using
Particles", sect. 5-3; its window is ``W(k) = prod_d sinc^2(k_d h / 2)``.
"""

from __future__ import annotations

import logging

import numba
import numpy as np
import scipy.fft

logger = logging.getLogger(__name__)

_SLABS_PER_FFT_CALL = 8


class FFTMesh:
    """One buffer that holds a real field on a cubic mesh or, after :meth:`forward`, its spectrum.

    ``real`` is a float32 view of shape ``(n, n, n)`` and ``fourier`` a complex64 view of shape
    ``(n, n, n // 2 + 1)`` of the same memory (the padded layout of in-place real FFTs), so a
    mesh costs ``4 n^2 (n + 2)`` bytes instead of twice that. The transforms run scipy.fft: along
    y and z a few x-slabs at a time, along x in place on the whole spectrum, so their temporary
    memory is a few slabs, and they are deterministic (unlike planned FFTW transforms, whose
    algorithm, and so whose rounding, can change from run to run).
    """

    def __init__(self, n_mesh: int, workers: int = 1):
        if n_mesh < 2 or n_mesh % 2:
            raise ValueError(f"n_mesh must be an even integer >= 2, got {n_mesh}")
        self.n_mesh = n_mesh
        self.workers = workers
        n_half = n_mesh // 2 + 1
        self.fourier = np.zeros((n_mesh, n_mesh, n_half), dtype=np.complex64)
        self.real = self.fourier.view(np.float32)[:, :, :n_mesh]

    def forward(self) -> np.ndarray:
        """Replace the real field by its unnormalised half-complex spectrum; return ``fourier``."""
        n, step = self.n_mesh, _SLABS_PER_FFT_CALL
        for start in range(0, n, step):
            slabs = slice(start, start + step)
            # Each x-slab of the spectrum occupies exactly the bytes of the same real x-slab.
            self.fourier[slabs] = scipy.fft.rfft2(self.real[slabs], workers=self.workers)
        self._transform_in_place(scipy.fft.fft, self.fourier, axis=0)
        return self.fourier

    def inverse(self) -> np.ndarray:
        """Replace the spectrum by its real field (divided by ``n_mesh**3``); return ``real``."""
        n, step = self.n_mesh, _SLABS_PER_FFT_CALL
        self._transform_in_place(scipy.fft.ifft, self.fourier, axis=0)
        for start in range(0, n, step):
            slabs = slice(start, start + step)
            # One axis at a time, y in place: irfft2 allocates a temporary spectrum slab
            # besides its output, and glibc, freeing the two together, can give them back to
            # the system, so that every call faults its 4 MB in afresh (seen: ~32k page faults
            # per inverse of a 256^3 mesh, half its time). The same transforms: on power-of-two
            # meshes, where each 1/n scaling is exact, bitwise the same result.
            self._transform_in_place(scipy.fft.ifft, self.fourier[slabs], axis=1)
            self.real[slabs] = scipy.fft.irfft(
                self.fourier[slabs], n=n, axis=2, workers=self.workers, overwrite_x=True
            )
        return self.real

    def _transform_in_place(self, transform, spectrum: np.ndarray, axis: int) -> None:
        """Complex transform of ``spectrum`` (``fourier`` or an x-slab of it) along ``axis``, in
        place: scipy.fft writes a contiguous complex input's result into it with overwrite_x
        (along x twice as fast as column blocks, and no temporary mesh); should it not, the
        result is copied back."""
        result = transform(spectrum, axis=axis, workers=self.workers, overwrite_x=True)
        if not np.shares_memory(result, spectrum):
            spectrum[...] = result


# --------------------------------------------------------------------------------------------
# Cloud-in-cell assignment


@numba.njit(cache=True)
def _cic_cell(coordinate, cells_per_length, n_mesh):
    """Lower cell index, upper cell index and upper weight of one coordinate (periodic)."""
    u = coordinate * cells_per_length - 0.5
    lower = np.floor(u)
    i = int(lower)
    if i < 0 or i >= n_mesh:  # rare: only particles in the outer half cells or outside the box
        i %= n_mesh
    upper = i + 1 if i + 1 < n_mesh else 0
    return i, upper, u - lower


@numba.njit(parallel=True, cache=True)
def _paint_cic(positions, cells_per_length, mesh, n_slabs):
    # Owner computes: each thread owns a slab of x-planes and adds, in particle order, only the
    # weights that land in its planes, so there are no write conflicts and every cell sums the
    # same terms in the same order as one thread would: the counts are bitwise independent of
    # the number of threads. Each thread reads every particle's x (12 B of 8 adds' work).
    n = mesh.shape[0]
    for slab in numba.prange(n_slabs):
        first, last = slab * n // n_slabs, (slab + 1) * n // n_slabs
        mesh[first:last] = 0.0
        for p in range(positions.shape[0]):
            i0, i1, wx = _cic_cell(np.float64(positions[p, 0]), cells_per_length, n)
            owns0, owns1 = first <= i0 < last, first <= i1 < last
            if not (owns0 or owns1):
                continue
            j0, j1, wy = _cic_cell(np.float64(positions[p, 1]), cells_per_length, n)
            l0, l1, wz = _cic_cell(np.float64(positions[p, 2]), cells_per_length, n)
            for i, wi, owned in ((i0, 1.0 - wx, owns0), (i1, wx, owns1)):
                if owned:
                    for j, wj in ((j0, 1.0 - wy), (j1, wy)):
                        wij = wi * wj
                        mesh[i, j, l0] += wij * (1.0 - wz)
                        mesh[i, j, l1] += wij * wz


@numba.njit(parallel=True, cache=True)
def _readout_cic(mesh, positions, cells_per_length, out):
    n = mesh.shape[0]
    for p in numba.prange(positions.shape[0]):
        i0, i1, wx = _cic_cell(np.float64(positions[p, 0]), cells_per_length, n)
        j0, j1, wy = _cic_cell(np.float64(positions[p, 1]), cells_per_length, n)
        l0, l1, wz = _cic_cell(np.float64(positions[p, 2]), cells_per_length, n)
        value = 0.0
        for i, wi in ((i0, 1.0 - wx), (i1, wx)):
            for j, wj in ((j0, 1.0 - wy), (j1, wy)):
                value += wi * wj * ((1.0 - wz) * mesh[i, j, l0] + wz * mesh[i, j, l1])
        out[p] = value


def paint_cic(
    positions: np.ndarray, box_size: float, n_mesh: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Cloud-in-cell particle counts on a periodic mesh.

    positions: (M, 3) float32 comoving positions in Mpc/h (any value; wrapped periodically).
    Returns ``out`` (float32, shape (n_mesh,)*3, may be a strided view such as
    ``FFTMesh.real``), overwritten with the CIC counts; they sum to M. Uses numba's threads
    (one slab of x-planes each); the counts do not depend on how many.
    """
    if out is None:
        out = np.empty((n_mesh,) * 3, dtype=np.float32)
    elif out.shape != (n_mesh,) * 3:
        raise ValueError(f"out has shape {out.shape}, expected {(n_mesh,) * 3}")
    _paint_cic(positions, n_mesh / box_size, out, min(numba.get_num_threads(), n_mesh))
    return out


def readout_cic(
    mesh: np.ndarray, positions: np.ndarray, box_size: float, out: np.ndarray | None = None
) -> np.ndarray:
    """Interpolate a periodic mesh field to particle positions with CIC weights.

    mesh: (n, n, n) field; positions: (M, 3) in Mpc/h. Returns ``out`` (float32, shape (M,);
    may be a strided view such as one column of an (M, 3) array). The transpose of
    :func:`paint_cic`, so a PM force read out this way has no self-force.
    """
    if out is None:
        out = np.empty(positions.shape[0], dtype=np.float32)
    _readout_cic(mesh, positions, mesh.shape[0] / box_size, out)
    return out


# --------------------------------------------------------------------------------------------
# Fourier kernels, applied to the half-complex spectrum of an (n, n, n) mesh


@numba.njit(cache=True)
def _signed_mode(index, n):
    """Integer wavenumber of FFT index ``index`` on an axis of length ``n``."""
    return index if 2 * index < n else index - n


@numba.njit(parallel=True, cache=True)
def _inverse_laplacian(field_k, fundamental, factor):
    n = field_k.shape[0]
    for i in numba.prange(n):
        kx = _signed_mode(i, n) * fundamental
        for j in range(n):
            ky = _signed_mode(j, n) * fundamental
            for l in range(field_k.shape[2]):
                kz = l * fundamental
                k2 = kx * kx + ky * ky + kz * kz
                field_k[i, j, l] *= -factor / k2 if k2 > 0.0 else 0.0


@numba.njit(parallel=True, cache=True)
def _gradient(field_k, axis, fundamental, out):
    n = field_k.shape[0]
    # The Nyquist mode has no resolvable derivative: zero it (odd operator).
    k_axis = np.array([_signed_mode(m, n) * fundamental for m in range(n)])
    k_axis[n // 2] = 0.0
    for i in numba.prange(n):
        for j in range(n):
            for l in range(field_k.shape[2]):
                k = k_axis[i] if axis == 0 else (k_axis[j] if axis == 1 else k_axis[l])
                out[i, j, l] = 1j * k * field_k[i, j, l]


@numba.njit(parallel=True, cache=True)
def _deconvolve_cic(field_k):
    n = field_k.shape[0]
    for i in numba.prange(n):
        wx = _sinc_squared(np.pi * _signed_mode(i, n) / n)
        for j in range(n):
            wxy = wx * _sinc_squared(np.pi * _signed_mode(j, n) / n)
            for l in range(field_k.shape[2]):
                field_k[i, j, l] /= wxy * _sinc_squared(np.pi * l / n)


@numba.njit(cache=True)
def _sinc_squared(x):
    return 1.0 if x == 0.0 else (np.sin(x) / x) ** 2


def inverse_laplacian(field_k: np.ndarray, box_size: float, factor: float = 1.0) -> np.ndarray:
    """Multiply a spectrum in place by ``-factor / k^2`` (k in h/Mpc); the k = 0 mode is zeroed.

    With ``factor = 1.5 * Omega_m`` this turns the density contrast into the potential of the
    comoving Poisson equation (the -1/k^2 kernel of PM codes). Returns ``field_k``.
    """
    _inverse_laplacian(field_k, 2 * np.pi / box_size, factor)
    return field_k


def gradient(
    field_k: np.ndarray, axis: int, box_size: float, out: np.ndarray | None = None
) -> np.ndarray:
    """Spectrum of the derivative along ``axis`` (0, 1, 2 = x, y, z): ``out = i k_axis field_k``.

    k in h/Mpc, so a potential in (Mpc/h)^2 gives a gradient in Mpc/h. ``out`` may be another
    buffer of the same shape (not ``field_k`` itself, which is left unchanged).
    """
    if axis not in (0, 1, 2):
        raise ValueError(f"axis must be 0, 1 or 2, got {axis}")
    if out is None:
        out = np.empty_like(field_k)
    _gradient(field_k, axis, 2 * np.pi / box_size, out)
    return out


def deconvolve_cic(field_k: np.ndarray) -> np.ndarray:
    """Divide a spectrum in place by the CIC window ``prod_d sinc^2(pi m_d / n)``; return it."""
    _deconvolve_cic(field_k)
    return field_k


# --------------------------------------------------------------------------------------------
# Real-space finite-difference gradient


@numba.njit(parallel=True, cache=True)
def _gradient_fd4(field, axis, inverse_spacing, out):
    n = field.shape[0]
    c1 = 8.0 * inverse_spacing / 12.0
    c2 = inverse_spacing / 12.0
    cells = np.arange(n)
    up1, up2 = np.roll(cells, -1), np.roll(cells, -2)
    dn1, dn2 = np.roll(cells, 1), np.roll(cells, 2)
    for i in numba.prange(n):
        for j in range(n):
            for l in range(n):
                if axis == 0:
                    d1 = field[up1[i], j, l] - field[dn1[i], j, l]
                    d2 = field[up2[i], j, l] - field[dn2[i], j, l]
                elif axis == 1:
                    d1 = field[i, up1[j], l] - field[i, dn1[j], l]
                    d2 = field[i, up2[j], l] - field[i, dn2[j], l]
                else:
                    d1 = field[i, j, up1[l]] - field[i, j, dn1[l]]
                    d2 = field[i, j, up2[l]] - field[i, j, dn2[l]]
                out[i, j, l] = c1 * d1 - c2 * d2


def gradient_fd4(
    field: np.ndarray, axis: int, box_size: float, out: np.ndarray | None = None
) -> np.ndarray:
    """Four-point central difference along ``axis`` of a periodic real mesh field.

    ``out_i = [8 (f_{i+1} - f_{i-1}) - (f_{i+2} - f_{i-2})] / (12 h)`` with h = box_size / n
    (Mpc/h); its Fourier response is ``i [8 sin(k h) - sin(2 k h)] / (6 h)``, exact to O(k^5 h^4).
    """
    if axis not in (0, 1, 2):
        raise ValueError(f"axis must be 0, 1 or 2, got {axis}")
    if out is None:
        out = np.empty(field.shape, dtype=np.float32)
    _gradient_fd4(field, axis, field.shape[0] / box_size, out)
    return out


@numba.njit(cache=True)
def _six_cells(lower, n):
    """Periodic cell indices lower - 2 ... lower + 3 (a tuple, so no allocation)."""
    if 2 <= lower < n - 3:
        return (lower - 2, lower - 1, lower, lower + 1, lower + 2, lower + 3)
    return ((lower - 2) % n, (lower - 1) % n, lower % n, (lower + 1) % n, (lower + 2) % n,
            (lower + 3) % n)


@numba.njit(parallel=True, cache=True)
def _readout_gradient_fd4(field, positions, cells_per_length, out):
    n = field.shape[0]
    c1 = 8.0 * cells_per_length / 12.0  # four-point weights, 1/h = cells_per_length
    c2 = cells_per_length / 12.0
    for p in numba.prange(positions.shape[0]):
        i0, _, wx = _cic_cell(np.float64(positions[p, 0]), cells_per_length, n)
        j0, _, wy = _cic_cell(np.float64(positions[p, 1]), cells_per_length, n)
        l0, _, wz = _cic_cell(np.float64(positions[p, 2]), cells_per_length, n)
        # cells i0 - 2 ... i0 + 3 along each axis (periodic): the two CIC nodes i0, i0 + 1 and
        # the four-point stencils around them; node a of the pair is index 2 + a
        xs, ys, zs = _six_cells(i0, n), _six_cells(j0, n), _six_cells(l0, n)
        wxs = (1.0 - wx, wx)
        wys = (1.0 - wy, wy)
        wzs = (1.0 - wz, wz)
        gx = 0.0
        gy = 0.0
        gz = 0.0
        for b in range(2):
            for c in range(2):
                j, l = ys[2 + b], zs[2 + c]
                v0, v1, v2 = field[xs[0], j, l], field[xs[1], j, l], field[xs[2], j, l]
                v3, v4, v5 = field[xs[3], j, l], field[xs[4], j, l], field[xs[5], j, l]
                gx += wys[b] * wzs[c] * (wxs[0] * (c1 * (v3 - v1) - c2 * (v4 - v0))
                                         + wxs[1] * (c1 * (v4 - v2) - c2 * (v5 - v1)))
        for a in range(2):
            for c in range(2):
                i, l = xs[2 + a], zs[2 + c]
                v0, v1, v2 = field[i, ys[0], l], field[i, ys[1], l], field[i, ys[2], l]
                v3, v4, v5 = field[i, ys[3], l], field[i, ys[4], l], field[i, ys[5], l]
                gy += wxs[a] * wzs[c] * (wys[0] * (c1 * (v3 - v1) - c2 * (v4 - v0))
                                         + wys[1] * (c1 * (v4 - v2) - c2 * (v5 - v1)))
        for a in range(2):
            for b in range(2):
                i, j = xs[2 + a], ys[2 + b]
                v0, v1, v2 = field[i, j, zs[0]], field[i, j, zs[1]], field[i, j, zs[2]]
                v3, v4, v5 = field[i, j, zs[3]], field[i, j, zs[4]], field[i, j, zs[5]]
                gz += wxs[a] * wys[b] * (wzs[0] * (c1 * (v3 - v1) - c2 * (v4 - v0))
                                         + wzs[1] * (c1 * (v4 - v2) - c2 * (v5 - v1)))
        out[p, 0] = gx
        out[p, 1] = gy
        out[p, 2] = gz


def readout_gradient_fd4(
    field: np.ndarray, positions: np.ndarray, box_size: float, out: np.ndarray | None = None
) -> np.ndarray:
    """The four-point gradient of a periodic mesh field (:func:`gradient_fd4`, all three axes)
    interpolated to particle positions with CIC weights (:func:`readout_cic`), in one pass.

    The same values as ``readout_cic(gradient_fd4(field, axis), positions)`` for each axis, up
    to float32 rounding of the intermediate mesh, without that mesh: the differences at the 8
    CIC nodes of each particle are formed on the fly (pycola's PM also interpolates finite
    differences to particles directly). field: (n, n, n), e.g. a potential in (Mpc/h)^2;
    positions: (M, 3) in Mpc/h. Returns ``out`` (M, 3) float32, field units per Mpc/h.
    """
    n = field.shape[0]
    if field.shape != (n, n, n):
        raise ValueError(f"field must be a cubic mesh, got shape {field.shape}")
    if out is None:
        out = np.empty((positions.shape[0], 3), dtype=np.float32)
    _readout_gradient_fd4(field, positions, n / box_size, out)
    return out


# --------------------------------------------------------------------------------------------
# Power spectrum


def power_spectrum(
    field: np.ndarray,
    box_size: float,
    deconvolve_cic: bool = False,
    n_bins: int | None = None,
    workers: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spherically averaged power spectrum of an overdensity field delta on a periodic mesh.

    field: (n, n, n) real delta (dimensionless); box_size in Mpc/h. Bins are ``k_f`` wide
    (fundamental frequency ``k_f = 2 pi / box_size``), the i-th centred on ``(i + 1) k_f``;
    by default ``n / 2`` bins, up to the Nyquist frequency ``pi n / box_size``. With
    ``deconvolve_cic`` each mode is divided by the CIC window first. The k = 0 mode is
    excluded. Returns (k, P, n_modes): the mean |k| of the modes in each bin (h/Mpc),
    ``P = <|delta_k|^2> / V`` in (Mpc/h)^3, and the number of modes counted over the full
    sphere (both members of each Hermitian pair). Bins without modes are dropped.
    """
    n = field.shape[0]
    if field.shape != (n, n, n):
        raise ValueError(f"field must be a cubic mesh, got shape {field.shape}")
    n_bins = n // 2 if n_bins is None else n_bins
    field_k = scipy.fft.rfftn(field, workers=workers)
    if deconvolve_cic:
        _deconvolve_cic(field_k)
    fundamental = 2 * np.pi / box_size
    m = np.fft.fftfreq(n, 1.0 / n)
    m_half = np.arange(n // 2 + 1)
    k = fundamental * np.sqrt(
        m[:, None, None] ** 2 + m[None, :, None] ** 2 + m_half[None, None, :] ** 2
    )
    # Modes with 0 < m_z < n/2 stand for themselves and their Hermitian partner.
    multiplicity = np.where((m_half == 0) | (2 * m_half == n), 1.0, 2.0)
    multiplicity = np.broadcast_to(multiplicity, k.shape)
    bin_index = np.rint(k / fundamental).astype(np.int64) - 1
    keep = (bin_index >= 0) & (bin_index < n_bins)
    bin_index, weight = bin_index[keep], multiplicity[keep]
    power = (np.abs(field_k[keep]) ** 2) * box_size**3 / float(n) ** 6
    n_modes = np.bincount(bin_index, weights=weight, minlength=n_bins)
    sum_k = np.bincount(bin_index, weights=weight * k[keep], minlength=n_bins)
    sum_power = np.bincount(bin_index, weights=weight * power, minlength=n_bins)
    filled = n_modes > 0
    return (
        sum_k[filled] / n_modes[filled],
        sum_power[filled] / n_modes[filled],
        n_modes[filled].astype(np.int64),
    )
