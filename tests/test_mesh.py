"""Tests of the particle-mesh kernels against exact results (CIC weights, plane waves, Parseval)."""

from __future__ import annotations


import numpy as np
import pytest
import scipy.fft

from simulations import mesh

BOX = 100.0  # Mpc/h


def plane_wave(n: int, modes: tuple[int, int, int], amplitude: float = 1.0) -> np.ndarray:
    """amplitude * cos(k.x) on the cell centres of an n^3 mesh, k = 2 pi modes / BOX."""
    x = (np.arange(n) + 0.5) * BOX / n
    k = 2 * np.pi * np.asarray(modes) / BOX
    phase = k[0] * x[:, None, None] + k[1] * x[None, :, None] + k[2] * x[None, None, :]
    return amplitude * np.cos(phase)


# ------------------------------------------------------------------------------------------
# CIC painting and readout


def test_paint_conserves_mass_for_any_positions():
    rng = np.random.default_rng(1)
    positions = rng.uniform(-1.5 * BOX, 2.5 * BOX, size=(10_000, 3)).astype(np.float32)
    counts = mesh.paint_cic(positions, BOX, 16)
    assert counts.dtype == np.float32 and counts.shape == (16, 16, 16)
    assert counts.sum(dtype=np.float64) == pytest.approx(10_000, rel=1e-6)
    assert counts.min() >= 0.0


@pytest.mark.parametrize("n_slabs", [2, 3, 16])
def test_paint_in_slabs_gives_the_serial_counts_bit_for_bit(n_slabs):
    # paint_cic gives each thread a slab of x-planes; 3 slabs of 16 planes are uneven, 16 are
    # one plane each (every particle then straddles two slabs).
    rng = np.random.default_rng(2)
    positions = rng.uniform(-0.5 * BOX, 1.5 * BOX, size=(20_000, 3)).astype(np.float32)
    serial, slabs = np.empty((2, 16, 16, 16), dtype=np.float32)
    mesh._paint_cic(positions, 16 / BOX, serial, 1)
    mesh._paint_cic(positions, 16 / BOX, slabs, n_slabs)
    assert np.array_equal(slabs, serial)


def test_particle_at_cell_centre_fills_one_cell():
    n, h = 8, BOX / 8
    counts = mesh.paint_cic(np.array([[2.5 * h, 0.5 * h, 7.5 * h]], np.float32), BOX, n)
    assert counts[2, 0, 7] == pytest.approx(1.0)
    assert np.count_nonzero(counts) == 1


def test_particle_at_box_corner_is_shared_by_eight_periodic_cells():
    counts = mesh.paint_cic(np.zeros((1, 3), np.float32), BOX, 8)
    corner = counts[np.ix_([7, 0], [7, 0], [7, 0])]
    np.testing.assert_allclose(corner, 1 / 8)
    assert counts.sum() == pytest.approx(1.0)


def test_particle_on_cell_edge_is_shared_by_four_cells():
    n, h = 8, BOX / 8
    counts = mesh.paint_cic(np.array([[3 * h, 5 * h, 4.5 * h]], np.float32), BOX, n)
    np.testing.assert_allclose(counts[2:4, 4:6, 4], 1 / 4)
    assert np.count_nonzero(counts) == 4


@pytest.mark.parametrize("x", [BOX, BOX + 1e-4, -1e-4, np.nextafter(np.float32(BOX), 0)])
def test_positions_on_the_periodic_boundary_wrap(x):
    """x = L and x slightly outside the box deposit like their periodic images."""
    n = 8
    counts = mesh.paint_cic(np.array([[x, 0.5 * BOX / n, 0.5 * BOX / n]], np.float32), BOX, n)
    image = mesh.paint_cic(np.array([[x % BOX, 0.5 * BOX / n, 0.5 * BOX / n]], np.float32),
                           BOX, n)
    np.testing.assert_allclose(counts, image, atol=1e-5)
    np.testing.assert_allclose(counts[[7, 0], 0, 0], 0.5, atol=1e-4)


def test_paint_into_a_strided_view_and_reuse():
    rng = np.random.default_rng(2)
    positions = rng.uniform(0, BOX, size=(500, 3)).astype(np.float32)
    buffer = mesh.FFTMesh(8)
    buffer.real[...] = 7.0  # painting must overwrite, not add
    mesh.paint_cic(positions, BOX, 8, out=buffer.real)
    np.testing.assert_allclose(buffer.real, mesh.paint_cic(positions, BOX, 8), atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        mesh.paint_cic(positions, BOX, 4, out=buffer.real)


def test_readout_interpolates_a_linear_field_exactly():
    n, h = 16, BOX / 16
    centres = (np.arange(n) + 0.5) * h
    field = (3.0 + 0.25 * centres[None, :, None] - 0.5 * centres[None, None, :]
             + np.zeros((n, 1, 1))).astype(np.float32)
    rng = np.random.default_rng(3)
    # Away from the periodic seam, where a linear function cannot be periodic.
    positions = rng.uniform(h, BOX - h, size=(1000, 3)).astype(np.float32)
    values = mesh.readout_cic(field, positions, BOX)
    expected = 3.0 + 0.25 * positions[:, 1] - 0.5 * positions[:, 2]
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-4)


def test_readout_is_the_transpose_of_paint():
    """sum_p f(x_p) = sum_cells counts * f, for any field: no self-force with CIC both ways."""
    rng = np.random.default_rng(4)
    positions = rng.uniform(0, BOX, size=(2000, 3)).astype(np.float32)
    field = rng.standard_normal((8, 8, 8)).astype(np.float32)
    readout_total = mesh.readout_cic(field, positions, BOX).sum(dtype=np.float64)
    paint_total = (mesh.paint_cic(positions, BOX, 8).astype(np.float64) * field).sum()
    assert readout_total == pytest.approx(paint_total, rel=1e-5)


def test_readout_into_a_column_of_a_force_array():
    rng = np.random.default_rng(5)
    positions = rng.uniform(0, BOX, size=(300, 3)).astype(np.float32)
    field = rng.standard_normal((8, 8, 8)).astype(np.float32)
    forces = np.zeros((300, 3), np.float32)
    mesh.readout_cic(field, positions, BOX, out=forces[:, 1])
    np.testing.assert_array_equal(forces[:, 1], mesh.readout_cic(field, positions, BOX))
    assert not forces[:, [0, 2]].any()


# ------------------------------------------------------------------------------------------
# FFTs and Fourier kernels


def test_in_place_fft_matches_scipy_and_round_trips():
    rng = np.random.default_rng(6)
    field = rng.standard_normal((32, 32, 32)).astype(np.float32)
    buffer = mesh.FFTMesh(32, workers=2)
    buffer.real[...] = field
    spectrum = buffer.forward()
    reference = scipy.fft.rfftn(field.astype(np.float64))
    np.testing.assert_allclose(spectrum, reference, atol=2e-4 * np.abs(reference).max())
    np.testing.assert_allclose(buffer.inverse(), field, atol=1e-5)


def test_inverse_fft_of_a_modified_spectrum_matches_scipy():
    # 20 is not a multiple of the 8 x-slabs transformed per call: the last call is partial
    rng = np.random.default_rng(7)
    buffer = mesh.FFTMesh(20, workers=2)
    buffer.real[...] = rng.standard_normal((20, 20, 20))
    mesh.inverse_laplacian(buffer.forward(), BOX)
    expected = scipy.fft.irfftn(buffer.fourier.astype(np.complex128), s=(20, 20, 20))
    np.testing.assert_allclose(buffer.inverse(), expected, atol=1e-5 * np.abs(expected).max())


def test_fft_mesh_rejects_odd_sizes():
    with pytest.raises(ValueError, match="even"):
        mesh.FFTMesh(15)


def test_gradient_and_inverse_laplacian_of_a_plane_wave():
    n, modes = 32, (3, -2, 5)
    k = 2 * np.pi * np.array(modes) / BOX
    field = plane_wave(n, modes)
    spectrum = scipy.fft.rfftn(field)
    potential = mesh.inverse_laplacian(spectrum.copy(), BOX)
    np.testing.assert_allclose(scipy.fft.irfftn(potential, s=field.shape), -field / (k @ k),
                               atol=1e-10)
    x = (np.arange(n) + 0.5) * BOX / n
    sine = np.sin(k[0] * x[:, None, None] + k[1] * x[None, :, None] + k[2] * x[None, None, :])
    for axis in range(3):
        derivative = scipy.fft.irfftn(mesh.gradient(spectrum, axis, BOX), s=field.shape)
        np.testing.assert_allclose(derivative, -k[axis] * sine, atol=1e-10)


def test_inverse_laplacian_zeroes_the_mean_and_scales():
    spectrum = scipy.fft.rfftn(1.0 + plane_wave(16, (1, 0, 0)))
    before = spectrum[1, 0, 0]
    mesh.inverse_laplacian(spectrum, BOX, factor=2.0)
    assert spectrum[0, 0, 0] == 0
    assert spectrum[1, 0, 0] == pytest.approx(-2.0 / (2 * np.pi / BOX) ** 2 * before)


def test_gradient_drops_the_nyquist_mode():
    n = 16
    alternating = np.broadcast_to((-1.0) ** np.arange(n)[:, None, None], (n, n, n))
    nyquist = scipy.fft.rfftn(alternating)
    assert np.abs(nyquist[n // 2, 0, 0]) == pytest.approx(n**3)
    assert np.abs(mesh.gradient(nyquist, 0, BOX)).max() < 1e-12 * n**3
    with pytest.raises(ValueError, match="axis"):
        mesh.gradient(nyquist, 3, BOX)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_four_point_gradient_has_its_theoretical_response(axis):
    n, h, m = 32, BOX / 32, 5
    modes = tuple(m if a == axis else 0 for a in range(3))
    k = 2 * np.pi * m / BOX
    coordinate = (np.arange(n) + 0.5) * h
    sine = np.sin(k * coordinate).reshape([n if a == axis else 1 for a in range(3)])
    derivative = mesh.gradient_fd4(plane_wave(n, modes).astype(np.float32), axis, BOX)
    response = (8 * np.sin(k * h) - np.sin(2 * k * h)) / (6 * h)
    np.testing.assert_allclose(derivative, -response * np.broadcast_to(sine, (n, n, n)),
                               atol=2e-6)
    assert response == pytest.approx(k, rel=(k * h) ** 4 / 30 * 1.01)


def test_fused_gradient_readout_equals_gradient_mesh_then_readout():
    """readout_gradient_fd4 = readout_cic of gradient_fd4 per axis, without the mesh."""
    rng = np.random.default_rng(4)
    n = 16
    field = rng.standard_normal((n, n, n)).astype(np.float32)
    positions = (rng.random((500, 3)) * BOX).astype(np.float32)
    positions[:3] = [[0.0, 0.0, 0.0], [BOX * (1 - 1e-7), 0.5, BOX / 2], [1e-3, BOX - 1e-3, 3.0]]
    fused = mesh.readout_gradient_fd4(field, positions, BOX)
    for axis in range(3):
        two_pass = mesh.readout_cic(mesh.gradient_fd4(field, axis, BOX), positions, BOX)
        np.testing.assert_allclose(fused[:, axis], two_pass, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Power spectrum


def test_power_of_a_plane_wave():
    n, amplitude = 32, 0.3
    k, power, n_modes = mesh.power_spectrum(plane_wave(n, (3, 4, 0), amplitude), BOX)
    peak = np.argmin(np.abs(k - 5 * 2 * np.pi / BOX))
    # Parseval: the bin holds the variance amplitude^2 / 2 times the volume.
    assert power[peak] * n_modes[peak] == pytest.approx(BOX**3 * amplitude**2 / 2, rel=1e-9)
    others = np.delete(power * n_modes, peak)
    assert np.abs(others).max() < 1e-12 * BOX**3


def test_power_of_white_noise_is_the_cell_volume_times_variance():
    n, sigma = 64, 2.0
    rng = np.random.default_rng(7)
    field = sigma * rng.standard_normal((n, n, n))
    k, power, n_modes = mesh.power_spectrum(field, BOX)
    expected = sigma**2 * (BOX / n) ** 3
    assert np.average(power, weights=n_modes) == pytest.approx(expected, rel=0.01)
    crowded = n_modes > 2000  # relative scatter ~ sqrt(2 / n_modes) < 3.2 %
    np.testing.assert_allclose(power[crowded], expected, rtol=0.15)


def test_mode_counts_and_bins_match_a_direct_count():
    n = 16
    k, _, n_modes = mesh.power_spectrum(np.ones((n, n, n)), BOX)
    m = np.fft.fftfreq(n, 1 / n)
    norm = np.sqrt(m[:, None, None] ** 2 + m[None, :, None] ** 2 + m[None, None, :] ** 2)
    expected = [np.count_nonzero(np.rint(norm) == i) for i in range(1, n // 2 + 1)]
    np.testing.assert_array_equal(n_modes, expected)
    k_f = 2 * np.pi / BOX
    assert np.all(np.abs(k / k_f - np.arange(1, n // 2 + 1)) <= 0.5)
    assert len(mesh.power_spectrum(np.ones((n, n, n)), BOX, n_bins=4)[0]) == 4


def test_cic_deconvolution_corrects_the_window():
    """A lattice dense along x, displaced by a plane wave: delta = -eps cos(k x) at k = k_N / 2."""
    n, per_cell, eps = 32, 8, 1e-3
    m = n // 4
    k = 2 * np.pi * m / BOX
    q = (np.arange(n * per_cell) + 0.5) * BOX / (n * per_cell)
    x = q + eps / k * np.sin(k * q)
    centres = (np.arange(n) + 0.5) * BOX / n
    grid = np.stack(np.meshgrid(x, centres, centres, indexing="ij"), axis=-1)
    counts = mesh.paint_cic(grid.reshape(-1, 3).astype(np.float32), BOX, n).astype(np.float64)
    delta = counts / counts.mean() - 1.0
    target = BOX**3 * eps**2 / 2  # power times modes in the bin of k, as for a plane wave
    window = np.sinc(m / n) ** 2  # numpy's sinc(x) = sin(pi x) / (pi x)
    for deconvolve, expected in ((False, window**2 * target), (True, target)):
        kk, power, n_modes = mesh.power_spectrum(delta, BOX, deconvolve_cic=deconvolve)
        peak = np.argmin(np.abs(kk - k))
        assert power[peak] * n_modes[peak] == pytest.approx(expected, rel=5e-3)
    assert window**2 < 0.7  # the correction is large: the test can tell the two apart
