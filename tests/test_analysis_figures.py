"""Every figure writes a PNG that decodes, has the documented size, is not blank, and comes
with a caption."""

from __future__ import annotations

import h5py
import matplotlib.image
import numpy as np
import pytest

from analysis import figures
from analysis.metrics import Predictions
from analysis.simulation_validation import ValidationSettings, validate_snapshot
from workflow.config import validate_config
from workflow.errors import PipelineError

NAMES = ("Omega_m", "sigma_8", "n_s")
RANGES = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.9, 1.0)}


def check_png(figure: figures.Figure, width_in: float, height_in: float) -> np.ndarray:
    assert figure.path.is_file() and figure.caption and figure.alt
    assert figure.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(figure.path)
    assert image.shape[:2] == (round(height_in * figures.DPI), round(width_in * figures.DPI))
    rgb = image[..., :3]
    not_white = np.any(rgb < 0.95, axis=-1).mean()
    assert not_white > 0.03, f"{figure.path.name} is nearly blank ({not_white:.3f} drawn)"
    assert rgb.std() > 0.05
    return image


@pytest.fixture(scope="module")
def predictions():
    rng = np.random.default_rng(0)
    sims = np.repeat(np.arange(12), 8)
    low = np.array([RANGES[n][0] for n in NAMES])
    high = np.array([RANGES[n][1] for n in NAMES])
    truth = np.repeat(low + rng.random((12, 3)) * (high - low), 8, axis=0)
    network = Predictions(NAMES, sims, truth, truth + 0.02 * (high - low) * rng.normal(size=truth.shape))
    ridge = Predictions(NAMES, sims, truth, truth + 0.1 * (high - low) * rng.normal(size=truth.shape))
    return network, ridge


def test_predicted_vs_true(tmp_path, predictions):
    network, ridge = predictions
    figure = figures.predicted_vs_true(tmp_path / "pvt.png", network, ("ridge", ridge), RANGES)
    width, height = figures.SIZES["predicted_vs_true"]
    check_png(figure, width * 3, height)
    assert "12 simulations, 96 sub-volumes" in figure.caption and "ridge" in figure.caption


def test_residual_histograms(tmp_path, predictions):
    network, ridge = predictions
    figure = figures.residual_histograms(tmp_path / "res.png", {"network": network, "ridge": ridge})
    width, height = figures.SIZES["residual_histograms"]
    check_png(figure, width * 3, height)


def test_learning_curves(tmp_path):
    history = tmp_path / "history.csv"
    rows = ["epoch,learning_rate,loss,samples_per_second,val_loss"]
    rows += [f"{e},{5e-4 * (1 - e / 10)},{0.5 * 0.8**e},{100.0},{0.55 * 0.85**e + 0.01 * e}"
             for e in range(10)]
    history.write_text("\n".join(rows) + "\n")
    figure = figures.learning_curves(tmp_path / "lc.png", history)
    check_png(figure, *figures.SIZES["learning_curves"])
    assert "10 epochs" in figure.caption
    (tmp_path / "bad.csv").write_text("step,value\n1,2\n")
    with pytest.raises(PipelineError, match="bad.csv"):
        figures.learning_curves(tmp_path / "x.png", tmp_path / "bad.csv")
    with pytest.raises(PipelineError, match="does not exist"):
        figures.learning_curves(tmp_path / "x.png", tmp_path / "missing.csv")


def test_subvolume_slices(tmp_path):
    rng = np.random.default_rng(1)
    samples = [rng.poisson(4.0, (16, 16, 16, 2)).astype(np.int16) for _ in range(3)]
    titles = [f"Omega_m = {0.3 + 0.01 * i:.2f}" for i in range(3)]
    figure = figures.subvolume_slices(tmp_path / "slices.png", samples, titles, 8.0,
                                      ["z = 0", "z = 1"])
    width, height = figures.SIZES["subvolume_slices"]
    check_png(figure, width * 3, height * 2)
    assert "128 Mpc/h across" in figure.caption


def test_power_spectrum_validation(tmp_path):
    """A Poisson 'snapshot': it has nothing like the linear power, so it is flagged (red)."""
    path = tmp_path / "snapshot.h5"
    n = 16
    positions = np.random.default_rng(2).uniform(0, 256.0, (2, n**3, 3)).astype(np.float32)
    with h5py.File(path, "w") as handle:
        handle["positions"] = positions
        handle["redshifts"] = [0.0, 1.0]
        handle.attrs.update({"box_size": 256.0, "n_particles": n, "sim_id": 3, "Omega_m": 0.3,
                             "Omega_b": 0.049, "h": 0.7, "sigma_8": 0.8, "n_s": 0.96})
    defaults = validate_config({})
    check = validate_snapshot(path, ValidationSettings.from_mapping(defaults["analysis"]["validation"],
                                                                    defaults["cosmology"]))
    assert check.flagged
    figure = figures.power_spectrum_validation(tmp_path / "pk.png", [check], tolerance=0.1)
    width, height = figures.SIZES["power_spectrum_validation"]
    check_png(figure, width * 2, height)
    assert "1 simulation(s) flagged" in figure.caption


def test_model_comparison(tmp_path):
    errors = {"network": {"Omega_m": 0.04, "sigma_8": 0.02, "n_s": 0.03},
              "ridge": {"Omega_m": 0.05, "sigma_8": 0.03, "n_s": 0.02},
              "mean": {"Omega_m": 0.09, "sigma_8": 0.05, "n_s": 0.03}}
    figure = figures.model_comparison(tmp_path / "bars.png", errors)
    check_png(figure, *figures.SIZES["model_comparison"])
    assert "0.0022" in figure.caption
    with pytest.raises(PipelineError):
        figures.model_comparison(tmp_path / "none.png", {})


def test_fisher_convergence(tmp_path):
    convergence = {"derivatives": {"n": [2, 4, 8], "marginal_errors": {
                       "Omega_m": [0.01, 0.015, 0.018], "sigma_8": [0.02, 0.02, 0.021]}},
                   "covariance": {"n": [40, 80, 160], "marginal_errors": {
                       "Omega_m": [0.017, 0.018, 0.018], "sigma_8": [0.02, 0.021, 0.021]}},
                   "tolerance": 0.1, "converged": False}
    figure = figures.fisher_convergence(tmp_path / "fisher.png", convergence)
    check_png(figure, *figures.SIZES["fisher_convergence"])
    assert "not converged" in figure.caption
