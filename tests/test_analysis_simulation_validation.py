"""Simulation validation on real small simulations made with the project's own 2LPT + COLA:
a correct one passes, wrong ones (amplitude, redshift labels) are flagged."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from analysis import simulation_validation as sv
from conftest import FIXED_COSMOLOGY, IC_SETTINGS, SOLVER, skip_unless_ci
from preprocessing.histogram import histogram_snapshot
from simulations.cola import run_simulation
from simulations.cosmology import Cosmology
from simulations.initial_conditions import generate_initial_conditions
from workflow.config import validate_config
from workflow.errors import PipelineError

COSMOLOGY = Cosmology(Omega_m=0.3, sigma_8=0.8, n_s=0.96, **FIXED_COSMOLOGY)


def settings(validation=None):
    """The checks' settings of a configuration with section analysis.validation ``validation``."""
    config = validate_config({"analysis": {"validation": validation or {}}})
    return sv.ValidationSettings.from_mapping(config["analysis"]["validation"], config["cosmology"])


NO_HALOFIT = settings({"halofit": False})
N_PARTICLES, BOX = 32, 256.0  # the tiny default box with half its particles per side


def simulate(directory, cosmo, seed, redshifts=(0.0, 1.0)):
    ic = directory / f"ic_{seed}.h5"
    snapshot = directory / f"snapshot_{seed}.h5"
    generate_initial_conditions(ic, cosmo, N_PARTICLES, BOX, 20.0, seed=seed, sim_id=seed,
                                **IC_SETTINGS)
    run_simulation(ic, snapshot, list(redshifts), n_steps=10, threads=2, **SOLVER)
    return snapshot


@pytest.fixture(scope="module")
def correct(tmp_path_factory):
    return simulate(tmp_path_factory.mktemp("correct"), COSMOLOGY, seed=5)


@pytest.fixture(scope="module")
def too_much_power(tmp_path_factory):
    """Run with sigma_8 = 1.12 but recorded as 0.8: P(k) twice what its attributes claim."""
    path = simulate(tmp_path_factory.mktemp("wrong"), dataclasses.replace(COSMOLOGY, sigma_8=1.12),
                    seed=6)
    with h5py.File(path, "r+") as handle:
        handle.attrs["sigma_8"] = 0.8
    return path


def test_a_correct_small_simulation_passes(correct):
    check = sv.validate_snapshot(correct, NO_HALOFIT)
    assert not check.flagged, check.reasons
    assert [c.redshift for c in check.redshifts] == [0.0, 1.0]
    for redshift in check.redshifts:
        # Within its cosmic variance of linear theory, on a few hundred large-scale modes.
        assert redshift.large_scale.sum() >= 3
        assert abs(redshift.amplitude - 1) < 3 * redshift.amplitude_error + 0.1
        assert 0.02 < redshift.amplitude_error < 0.2
    z0 = check.redshifts[0]
    assert z0.growth is not None and abs(z0.growth - 1) < 0.05
    assert check.redshifts[1].growth is None  # the reference redshift
    # The linear check stops where Delta^2 reaches 0.3: lower k at z = 0 than at z = 1.
    assert z0.summary()["k_max_linear"] < check.redshifts[1].summary()["k_max_linear"]
    assert check.summary()["flagged"] is False


def test_a_simulation_with_the_wrong_amplitude_is_flagged(too_much_power):
    check = sv.validate_snapshot(too_much_power, NO_HALOFIT)
    assert check.flagged
    assert all(abs(c.amplitude - 1.96) < 0.5 for c in check.redshifts)  # (1.12 / 0.8)^2
    assert any("linear theory" in reason for reason in check.reasons)
    flagged = sv.flagged_simulations([check])
    assert flagged[0]["sim_id"] == 6 and flagged[0]["reasons"]


def test_swapped_redshift_labels_are_flagged(correct, tmp_path):
    path = tmp_path / "swapped.h5"
    path.write_bytes(correct.read_bytes())
    with h5py.File(path, "r+") as handle:
        handle["redshifts"][...] = [1.0, 0.0]
    check = sv.validate_snapshot(path, NO_HALOFIT)
    assert check.flagged
    assert any("growth" in reason for reason in check.reasons)
    assert any("linear theory" in reason for reason in check.reasons)


def test_a_tighter_tolerance_without_cosmic_variance_flags_the_correct_box(correct):
    """The allowance for cosmic variance is what lets a correct 256 Mpc/h box pass."""
    strict = settings({"halofit": False, "tolerance": 0.0, "n_sigma": 0.0, "growth_tolerance": 1.0})
    check = sv.validate_snapshot(correct, strict)
    assert check.flagged


def test_halofit_reference_with_camb(correct):
    if not sv.camb_available():
        skip_unless_ci("camb (the test extra) is not installed")
    check = sv.validate_snapshot(correct, settings({"halofit": True}))
    assert not check.flagged
    for redshift in check.redshifts:
        assert 0.7 < redshift.halofit_ratio < 1.3
        used = np.isfinite(redshift.halofit)
        # Halofit's boost over linear theory grows with k and with time.
        boost = redshift.halofit[used] / redshift.linear[used]
        assert boost[-1] > boost[0]
    z0, z1 = check.redshifts
    assert (z0.halofit / z0.linear)[np.isfinite(z0.halofit)][-1] > \
        (z1.halofit / z1.linear)[np.isfinite(z1.halofit)][-1]


def test_without_camb_halofit_is_skipped(correct, monkeypatch):
    monkeypatch.setattr(sv, "camb_available", lambda: False)
    check = sv.validate_snapshot(correct, settings({"halofit": "auto"}))
    assert all(c.halofit is None and c.halofit_ratio is None for c in check.redshifts)
    with pytest.raises(PipelineError, match="camb"):
        sv.validate_snapshot(correct, settings({"halofit": True}))


def test_bad_files_and_settings(tmp_path):
    with pytest.raises(PipelineError, match="does not exist"):
        sv.validate_snapshot(tmp_path / "missing.h5", NO_HALOFIT)
    broken = tmp_path / "broken.h5"
    broken.write_bytes(b"not hdf5")
    with pytest.raises(PipelineError, match="broken.h5"):
        sv.validate_snapshot(broken, NO_HALOFIT)
    incomplete = tmp_path / "incomplete.h5"
    with h5py.File(incomplete, "w") as handle:
        handle["positions"] = np.zeros((1, 8, 3), np.float32)
        handle["redshifts"] = [0.0]
        handle.attrs["box_size"] = 10.0
        handle.attrs["n_particles"] = 2
    with pytest.raises(PipelineError, match="lacks attribute"):
        sv.validate_snapshot(incomplete, NO_HALOFIT)
    with pytest.raises(PipelineError, match=r"analysis.validation.tolerance' = -0.1 is out of range"):
        settings({"tolerance": -0.1})
    with pytest.raises(PipelineError, match="Histogram .*missing.h5 does not exist"):
        sv.validate_histogram(tmp_path / "missing.h5", NO_HALOFIT)


def histogram_of(snapshot, directory, grid=32):
    """The simulation's histogram as the pipeline makes it (NGP counts, int16)."""
    return histogram_snapshot(snapshot, directory / f"{snapshot.stem}_histogram.h5", grid, "ngp", "int16")


def test_the_histogram_of_a_correct_simulation_passes_and_a_wrong_one_is_flagged(
        correct, too_much_power, tmp_path):
    """The analysis checks each simulation on its histogram (the field its samples come from):
    8 Mpc/h NGP voxels, window deconvolved, k up to half the grid's Nyquist frequency."""
    check = sv.validate_histogram(histogram_of(correct, tmp_path), NO_HALOFIT)
    assert not check.flagged, check.reasons
    for redshift in check.redshifts:
        assert redshift.large_scale.sum() >= 3
        assert abs(redshift.amplitude - 1) < 3 * redshift.amplitude_error + 0.1
        assert redshift.spectrum.k[redshift.large_scale].max() <= 0.5 * np.pi * 32 / BOX
    wrong = sv.validate_histogram(histogram_of(too_much_power, tmp_path), NO_HALOFIT)
    assert wrong.flagged and all(abs(c.amplitude - 1.96) < 0.5 for c in wrong.redshifts)
    # the histogram and the particles agree on the large-scale amplitude
    particles = sv.validate_snapshot(correct, NO_HALOFIT)
    for a, b in zip(check.redshifts, particles.redshifts):
        assert abs(a.amplitude - b.amplitude) < 0.05


def test_a_check_written_to_hdf5_reads_back_equal(too_much_power, correct, tmp_path):
    """validate_simulations stores each check for the report (validation/<sim_id>.h5): a flagged
    check with reasons and one with halofit columns come back with every figure and array."""
    flagged = sv.validate_snapshot(too_much_power, NO_HALOFIT)
    with_halofit = sv.validate_snapshot(correct, settings({"halofit": sv.camb_available()}))
    assert flagged.flagged and not with_halofit.flagged
    for index, check in enumerate((flagged, with_halofit)):
        path = tmp_path / f"{index}.h5"
        sv.write_simulation_check(path, check, provenance="made here")
        back = sv.read_simulation_check(path)
        assert back.summary() == check.summary()
        for ours, theirs in zip(check.redshifts, back.redshifts, strict=True):
            for name in ("k_edges", "k", "power", "n_modes"):
                np.testing.assert_array_equal(getattr(ours.spectrum, name), getattr(theirs.spectrum, name))
            np.testing.assert_array_equal(ours.linear, theirs.linear)
            np.testing.assert_array_equal(ours.large_scale, theirs.large_scale)
            assert (ours.halofit is None) == (theirs.halofit is None)
            assert ours.spectrum.assignment == theirs.spectrum.assignment
        with h5py.File(path, "r") as handle:
            assert handle.attrs["provenance"] == "made here"
    (tmp_path / "cut.h5").write_bytes((tmp_path / "0.h5").read_bytes()[:500])
    with pytest.raises(PipelineError, match="cut.h5 is unreadable"):
        sv.read_simulation_check(tmp_path / "cut.h5")
