"""2LPT initial conditions: spectrum, perturbation theory, determinism and the ic.h5 contract."""

import dataclasses
import time

import h5py
import numpy as np
import pytest

from conftest import FIXED_COSMOLOGY, IC_SETTINGS
from simulations.cosmology import Background, Cosmology, linear_power
from simulations.initial_conditions import (
    IC_ATTRIBUTES,
    compute_initial_conditions,
    generate_initial_conditions,
    lagrangian_positions,
    linear_density_modes,
    read_initial_conditions,
    second_order_displacement,
    zeldovich_displacement,
)
from simulations.mesh import paint_cic, power_spectrum
from workflow.errors import PipelineError
from workflow.io import sha256_file

COSMO = Cosmology(Omega_m=0.3, sigma_8=0.8, n_s=0.96, **FIXED_COSMOLOGY)
N, BOX, Z_INIT = 32, 128.0, 49.0


def particle_power(positions, box_size, n_mesh):
    """Binned P(k) of particles: CIC on n_mesh^3, window deconvolved (simulations.mesh)."""
    counts = paint_cic(positions.astype(np.float32), box_size, n_mesh)
    return power_spectrum(counts / counts.mean() - 1.0, box_size, deconvolve_cic=True)


def binned_theory(power, box_size, n_mesh):
    """P(k) averaged over the modes of each bin of simulations.mesh.power_spectrum."""
    m = np.fft.fftfreq(n_mesh, 1.0 / n_mesh)
    m_norm = np.sqrt(m[:, None, None] ** 2 + m[None, :, None] ** 2 + m[None, None, :] ** 2)
    bins = np.rint(m_norm).astype(int).ravel() - 1
    keep = (bins >= 0) & (bins < n_mesh // 2)
    k = 2 * np.pi / box_size * m_norm.ravel()[keep]
    totals = np.bincount(bins[keep], weights=power(k), minlength=n_mesh // 2)
    return totals / np.bincount(bins[keep], minlength=n_mesh // 2)


@pytest.fixture(scope="module")
def fixed_ic():
    return compute_initial_conditions(COSMO, 64, 256.0, Z_INIT, seed=11, sim_id=3,
                                      **(IC_SETTINGS | {"fixed_amplitude": True}))


def test_fixed_amplitude_spectrum_follows_linear_theory(fixed_ic):
    k, power, n_modes = particle_power(fixed_ic.positions(), 256.0, 128)
    d1 = Background(COSMO).D1(1 / (1 + Z_INIT))
    theory = binned_theory(lambda q: linear_power(COSMO, q) * d1**2, 256.0, 128)
    low = k < np.pi * 64 / 256.0 / 2  # half the particle Nyquist frequency
    # Measured: every bin within 1.1 %, mode-weighted sum 1.004 (4 % high at Nyquist).
    np.testing.assert_allclose(power[low], theory[low], rtol=0.02)
    assert np.sum(n_modes[low] * power[low]) / np.sum(n_modes[low] * theory[low]) == \
        pytest.approx(1.0, abs=0.01)


def test_gaussian_spectrum_within_cosmic_variance():
    ic = compute_initial_conditions(COSMO, 64, 256.0, Z_INIT, seed=5, sim_id=0, **IC_SETTINGS)
    k, power, n_modes = particle_power(ic.positions(), 256.0, 128)
    theory = linear_power(COSMO, k) * ic.D1_init**2
    low = k < np.pi * 64 / 256.0 / 2
    ratio = np.sum(n_modes[low] * power[low]) / np.sum(n_modes[low] * theory[low])
    # ~8000 modes dominated by the highest bins: 1-sigma scatter of the sum is ~2 %.
    assert ratio == pytest.approx(1.0, abs=0.06)


def test_fixed_amplitude_modes_have_exact_power():
    modes = linear_density_modes(lambda k: linear_power(COSMO, k), 16, 100.0, seed=2,
                                 fixed_amplitude=True, phase_flip=False)
    k_axis = 2 * np.pi * np.fft.fftfreq(16, 100.0 / 16)
    k = np.sqrt(k_axis[:, None, None] ** 2 + k_axis[None, :, None] ** 2
                + k_axis[None, None, :9] ** 2)
    measured = np.abs(modes) ** 2 * 100.0**3 / 16**6
    k[0, 0, 0] = 1.0
    expected = linear_power(COSMO, k)
    expected[0, 0, 0] = 0.0
    np.testing.assert_allclose(measured, expected, rtol=1e-4)


def test_gaussian_modes_have_expected_mean_power():
    n, box = 32, 200.0
    modes = linear_density_modes(lambda k: np.full_like(k, 50.0), n, box, seed=9,
                                 fixed_amplitude=False, phase_flip=False)
    ratio = np.abs(modes[1:, 1:, 1:-1]) ** 2 * box**3 / n**6 / 50.0
    # |delta_k|^2 / P is exponentially distributed with mean 1 (~13000 modes here).
    assert ratio.mean() == pytest.approx(1.0, abs=0.03)
    assert np.median(ratio) == pytest.approx(np.log(2), abs=0.03)


def plane_waves(n, box, amplitude_x, amplitude_y, mx=2, my=3):
    """rfftn modes of delta = A cos(k1 x) + B cos(k2 y) sampled at x_i = i L / n."""
    x = np.arange(n) * box / n
    k1, k2 = 2 * np.pi * mx / box, 2 * np.pi * my / box
    delta = (amplitude_x * np.cos(k1 * x)[:, None, None]
             + amplitude_y * np.cos(k2 * x)[None, :, None]) * np.ones((n, n, n))
    return np.fft.rfftn(delta), x, k1, k2


def test_displacements_of_plane_waves_match_perturbation_theory():
    n, box, a_x, a_y = 16, 64.0, 0.3, 0.2
    modes, x, k1, k2 = plane_waves(n, box, a_x, a_y)
    X, Y = np.meshgrid(x, x, indexing="ij")
    psi1 = zeldovich_displacement(modes, box)
    np.testing.assert_allclose(psi1[0], (-a_x * np.sin(k1 * X) / k1)[:, :, None]
                               * np.ones(n), atol=1e-12)
    np.testing.assert_allclose(psi1[1], (-a_y * np.sin(k2 * Y) / k2)[:, :, None]
                               * np.ones(n), atol=1e-12)
    # Source phi1_xx phi1_yy = A B cos(k1 x) cos(k2 y), so
    # phi2 = -A B cos(k1 x) cos(k2 y) / (k1^2 + k2^2) and psi2 / D2 = grad(phi2).
    psi2 = second_order_displacement(modes, box)
    scale = a_x * a_y / (k1**2 + k2**2)
    expected_x = scale * k1 * np.sin(k1 * X) * np.cos(k2 * Y)
    expected_y = scale * k2 * np.cos(k1 * X) * np.sin(k2 * Y)
    np.testing.assert_allclose(psi2[0], expected_x[:, :, None] * np.ones(n), atol=1e-12)
    np.testing.assert_allclose(psi2[1], expected_y[:, :, None] * np.ones(n), atol=1e-12)
    np.testing.assert_allclose(psi2[2], 0.0, atol=1e-12)


def test_one_dimensional_wave_has_no_second_order_displacement():
    modes, *_ = plane_waves(16, 64.0, 0.3, 0.0)  # Zel'dovich is exact in 1D
    np.testing.assert_allclose(second_order_displacement(modes, 64.0), 0.0, atol=1e-14)


def test_displacements_scale_with_growth_factors():
    early = compute_initial_conditions(COSMO, N, BOX, 99.0, seed=4, sim_id=0, **IC_SETTINGS)
    late = compute_initial_conditions(COSMO, N, BOX, 19.0, seed=4, sim_id=0, **IC_SETTINGS)
    background = Background(COSMO)
    d1_ratio = background.D1(1 / 20) / background.D1(1 / 100)
    d2_ratio = background.D2(1 / 20) / background.D2(1 / 100)
    np.testing.assert_allclose(late.psi1, d1_ratio * early.psi1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(late.psi2, d2_ratio * early.psi2, rtol=1e-5, atol=1e-9)
    # D2 ≈ -3/7 D1^2 (Omega_m(a) ≈ 1 at z >= 19): psi2 grows as the square of psi1.
    assert d2_ratio == pytest.approx(d1_ratio**2, rel=0.01)
    assert late.D2_init < 0


def test_mean_displacement_vanishes(fixed_ic):
    for field in (fixed_ic.psi1, fixed_ic.psi2):
        rms = np.sqrt(np.mean(field.astype(np.float64) ** 2))
        assert rms > 0
        assert np.all(np.abs(field.mean(axis=(1, 2, 3), dtype=np.float64)) < 1e-6 * rms)


def test_velocity_is_growing_mode_in_einstein_de_sitter():
    eds = dataclasses.replace(COSMO, Omega_m=1.0)
    ic = compute_initial_conditions(eds, 16, 64.0, 24.0, seed=1, sim_id=0, **IC_SETTINGS)
    a = 1 / 25
    # EdS: H = 100 a^-1.5 km/s/(Mpc/h), f1 = 1, f2 = 2, so v = 100 a^-0.5 (psi1 + 2 psi2).
    expected = 100 * a**-0.5 * (ic.psi1.astype(np.float64) + 2 * ic.psi2)
    np.testing.assert_allclose(ic.velocity, expected, rtol=1e-5, atol=1e-5)


def test_phase_flip_negates_first_order_and_keeps_second_order():
    base = compute_initial_conditions(COSMO, N, BOX, Z_INIT, seed=8, sim_id=0, **IC_SETTINGS)
    flipped = compute_initial_conditions(COSMO, N, BOX, Z_INIT, seed=8, sim_id=0,
                                         **(IC_SETTINGS | {"phase_flip": True}))
    np.testing.assert_array_equal(flipped.psi1, -base.psi1)
    np.testing.assert_allclose(flipped.psi2, base.psi2, rtol=1e-5, atol=1e-10)


def test_first_order_has_zero_second_order_term():
    ic = compute_initial_conditions(COSMO, N, BOX, Z_INIT, seed=8, sim_id=0,
                                    **(IC_SETTINGS | {"lpt_order": 1}))
    assert not np.any(ic.psi2)
    assert np.any(ic.psi1)


def test_same_inputs_give_identical_bytes_and_seeds_differ(tmp_path):
    paths = [tmp_path / name / "ic.h5" for name in ("a", "b", "c")]
    for path, seed in zip(paths, (21, 21, 22)):
        generate_initial_conditions(path, COSMO, 16, 64.0, Z_INIT, seed=seed, sim_id=7, **IC_SETTINGS)
        if path == paths[0]:
            time.sleep(1.1)  # HDF5 timestamps have 1 s resolution: none may be stored
    assert sha256_file(paths[0]) == sha256_file(paths[1])
    first, other = read_initial_conditions(paths[0]), read_initial_conditions(paths[2])
    assert np.corrcoef(first.psi1.ravel(), other.psi1.ravel())[0, 1] < 0.2


def test_file_round_trip_follows_contract(tmp_path):
    path = tmp_path / "sims" / "00003" / "ic.h5"
    table = tmp_path / "transfer.txt"
    k = np.geomspace(1e-4, 100, 200)
    np.savetxt(table, np.column_stack([k, 1 / (1 + (k / 0.05) ** 2)]))
    cosmo = dataclasses.replace(COSMO, transfer="table", transfer_table=str(table))
    written = generate_initial_conditions(path, cosmo, 16, 64.0, Z_INIT, seed=3, sim_id=3,
                                          **(IC_SETTINGS | {"fixed_amplitude": True}))
    with h5py.File(path, "r") as handle:
        assert set(IC_ATTRIBUTES) <= set(handle.attrs)
        for name in ("psi1", "psi2", "velocity"):
            assert handle[name].dtype == np.float32
            assert handle[name].shape == (3, 16, 16, 16)
        assert handle.attrs["units_displacement"] == "Mpc/h"
        assert handle.attrs["units_velocity"] == "km/s"
        assert handle.attrs["backend"] == "native"
        assert handle.attrs["a_init"] == pytest.approx(1 / 50)
    read = read_initial_conditions(path)
    assert read.cosmology == cosmo
    for name in ("psi1", "psi2", "velocity"):
        np.testing.assert_array_equal(getattr(read, name), getattr(written, name))
    assert (read.seed, read.sim_id, read.fixed_amplitude, read.D1_init) == \
        (3, 3, True, written.D1_init)


def test_lattice_is_cell_centred_and_positions_wrap():
    q = lagrangian_positions(4, 8.0)
    np.testing.assert_allclose(q[:, 0, 0, 0], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(q[:, 3, 2, 1], [7.0, 5.0, 3.0])
    ic = compute_initial_conditions(COSMO, 16, 16.0, 2.0, seed=1, sim_id=0,  # large shifts
                                    **IC_SETTINGS)
    positions = ic.positions()
    assert positions.shape == (16**3, 3)
    assert positions.min() >= 0 and positions.max() < 16.0


@pytest.fixture()
def ic_file(tmp_path):
    path = tmp_path / "ic.h5"
    generate_initial_conditions(path, COSMO, 16, 64.0, Z_INIT, seed=3, sim_id=0, **IC_SETTINGS)
    return path


def test_truncated_file_raises(ic_file):
    data = ic_file.read_bytes()
    ic_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(PipelineError, match=str(ic_file)):
        read_initial_conditions(ic_file)


@pytest.mark.parametrize("remove", ["psi2", "D1_init"])
def test_incomplete_file_raises(ic_file, remove):
    with h5py.File(ic_file, "a") as handle:
        if remove in handle:
            del handle[remove]
        else:
            del handle.attrs[remove]
    with pytest.raises(PipelineError, match=f"incomplete.*{remove}"):
        read_initial_conditions(ic_file)


def test_missing_file_raises(tmp_path):
    with pytest.raises(PipelineError, match="does not exist"):
        read_initial_conditions(tmp_path / "nothing.h5")


@pytest.mark.parametrize("changes, name", [
    ({"z_init": 0.0}, "z_init"),
    ({"z_init": -3.0}, "z_init"),
    ({"n_particles": 15}, "n_particles"),
    ({"n_particles": 2}, "n_particles"),
    ({"n_particles": 16.0}, "n_particles"),
    ({"box_size": 0.0}, "box_size"),
    ({"box_size": float("inf")}, "box_size"),
    ({"z_init": float("nan")}, "z_init"),
    ({"seed": -1}, "seed"),
    ({"sim_id": -2}, "sim_id"),
    ({"lpt_order": 3}, "lpt_order"),
    ({"threads": 0}, "threads"),
])
def test_bad_inputs_raise(tmp_path, changes, name):
    arguments = {"n_particles": 16, "box_size": 64.0, "z_init": Z_INIT, "seed": 1,
                 "sim_id": 0, "threads": 1, **IC_SETTINGS, **changes}
    with pytest.raises(PipelineError, match=name):
        generate_initial_conditions(tmp_path / "ic.h5", COSMO, **arguments)
    assert not (tmp_path / "ic.h5").exists()
