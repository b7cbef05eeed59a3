"""The science preset (config/science.yaml) and its Fisher companion: they plan, agree on the
resolution, and a scaled-down copy runs through the analysis with its learning curve and its
Fisher bound, so the preset cannot rot."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import yaml

from conftest import REPO, run_snakemake, write_config
from workflow.config import ConfigError, load_config, validate_config

SCIENCE = REPO / "config" / "science.yaml"
COMPANION = REPO / "config" / "science_fisher.yaml"

# The preset at 1/64 of its particles and 1/8 of its voxels per sample (the same 1 Mpc/h
# spacing and 2 Mpc/h voxels), 24 + 21 simulations in one batch each (every batch job starts
# Python, numpy and numba), 2 epochs: every rule of the preset in about two minutes on 2 cores.
# Shards of 4 simulations keep the 1/4 and 1/2 learning-curve subsets of the 16 training
# simulations whole shards.
SCALED = {
    "simulation": {"box_size": 32.0, "n_particles": 32, "sims_per_job": 24, "n_steps": 4},
    "initial_conditions": {"z_init": 15.0},
    "preprocessing": {"grid": 16, "subvolume": 8, "samples_per_file": 16, "sims_per_shard": 4},
    "training": {"epochs": 2, "batch_size": 8},
    "analysis": {"bootstrap": 100, "summary_bins": 4, "slices": 1},
}
SCALED_SCIENCE = {"sampling": {"n_simulations": 24, "splits": {"train": 2 / 3, "val": 1 / 6, "test": 1 / 6}}}
SCALED_COMPANION = {"sampling": {"n_simulations": 21},  # 3 repetitions of 1 + 2 x 3 points
                    "preprocessing": {"sims_per_shard": 24}}  # one write_tfrecords job


def merged(base: dict, *overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for override in overrides:
        for key, value in override.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def preset(path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_companion_has_the_science_resolution():
    science, companion = preset(SCIENCE), preset(COMPANION)
    for section in ("cosmology", "simulation", "initial_conditions", "preprocessing"):
        assert companion[section] == science[section], section
    assert companion["sampling"]["design"] == "fiducial_derivatives"
    assert science["analysis"]["fisher_companion"] == "config/science_fisher.yaml"
    voxel = science["simulation"]["box_size"] / science["preprocessing"]["grid"]
    spacing = science["simulation"]["box_size"] / science["simulation"]["n_particles"]
    assert voxel == 2.0 and spacing <= 2.0  # the paper's voxels, its particle spacing or finer


def test_the_science_preset_plans(tmp_path):
    (tmp_path / "config").mkdir()
    # analysis.fisher_companion, relative to the working directory
    shutil.copy(COMPANION, tmp_path / "config")
    result = run_snakemake(tmp_path, "-n", "--configfile", str(SCIENCE))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = result.stdout + result.stderr
    for rule, count in (("simulate", 60), ("train_fraction", 2), ("fisher_companion", 1), ("analyze", 1)):
        assert any(line.split() == [rule, str(count)] for line in plan.splitlines()), (rule, plan[-2500:])


def test_learning_curve_fractions_must_be_whole_shards(monkeypatch):
    monkeypatch.chdir(REPO)
    config = preset(SCIENCE)
    config["analysis"]["learning_curve"] = [0.3]
    with pytest.raises(ConfigError, match=r"'analysis.learning_curve' = 0.3 selects 192 of the 640 "
                                          r"training simulations, not a positive multiple of the 80"):
        validate_config(config)
    config["analysis"]["learning_curve"] = []
    config["analysis"]["fisher_companion"] = "config/no_such.yaml"
    with pytest.raises(ConfigError, match="'analysis.fisher_companion' = 'config/no_such.yaml': no such"):
        validate_config(config)


@pytest.mark.slow  # 95-250 s on 2 cores shared with other work (load average 2-4.5)
def test_a_scaled_down_science_preset_runs_through_the_analysis(tmp_path, monkeypatch):
    (tmp_path / "config").mkdir()
    companion = merged(preset(COMPANION), SCALED, SCALED_COMPANION)
    write_config(tmp_path / "config", companion, "science_fisher.yaml")
    science = write_config(tmp_path, merged(preset(SCIENCE), SCALED, SCALED_SCIENCE), "science.yaml")
    monkeypatch.chdir(tmp_path)  # where the run resolves config/science_fisher.yaml: the scaled one
    load_config(science)  # valid as scaled, the companion's resolution checked against this run's

    result = run_snakemake(tmp_path, "--configfile", str(science))
    assert result.returncode == 0, result.stderr[-4000:]

    run = tmp_path / "results" / "science"
    metrics = json.loads((run / "analysis" / "metrics.json").read_text())
    curve = metrics["learning_curve"]
    assert curve["fractions"] == [0.25, 0.5, 1.0] and curve["train_simulations"] == [4, 8, 16]
    for fraction in ("0.25", "0.5"):
        record = json.loads((run / "learning_curve" / f"train_{fraction}" / "run.json").read_text())
        assert record["train_simulations"] == float(fraction) * 16
        assert record["settings"]["train_fraction"] == float(fraction)
    for model in ("network", "ridge"):
        for values in curve["models"][model].values():
            assert len(values["ratio"]) == 3
            assert all(low <= ratio <= high for low, ratio, high in
                       zip(values["ratio_low"], values["ratio"], values["ratio_high"]))
    assert set(curve["trend"]) == {"Omega_m", "sigma_8", "n_s"}
    uncertainty = metrics["uncertainty"]
    assert uncertainty["n_simulations"] == 4 and set(uncertainty["versus"]) == {"ridge", "gradient_boosting"}
    fisher = metrics["fisher"]
    assert fisher["source"] == "config/science_fisher.yaml"
    assert fisher["forecast"]["n_repetitions"] == 3
    assert set(fisher["against_errors"]) == {"Omega_m", "sigma_8", "n_s"}
    assert metrics["choices"]["ridge"]["chosen_on"] == "validation split"
    assert (tmp_path / "results" / "science_fisher" / "tfrecords" / "manifest.json").is_file()
    assert not (tmp_path / "results" / "science_fisher" / "training").exists()  # up to its manifest only
    report = (run / "analysis" / "report.html").read_text()
    assert metrics["combination"]["baseline"] == metrics["best_baseline"]
    for heading in ("Uncertainty of the errors", "Network and baseline combined",
                    "Learning curves in data", "Fisher forecast", "Hyperparameter choices"):
        assert f"<summary>{heading}</summary>" in report  # the full tables, collapsed
    assert report.index("<table id='headline'>") < report.index("<h2>Figures</h2>")  # the answer first
    assert "Where the curves are heading" in report
    curve = metrics["learning_curve"]  # three training-set sizes: the saturating fits exist
    assert all(fit is not None and fit["L_min"] >= 0 and 0 < fit["alpha"] <= 3
               for fits in curve["saturating"].values() for fit in fits.values())
    assert set(curve["fisher_crossing_simulations"]) == {"Omega_m", "sigma_8", "n_s"}
    assert (run / "analysis" / "figures" / "data_learning_curves.png").is_file()
