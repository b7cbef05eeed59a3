"""The analyze stage on the small pipeline run: its outputs, the report in a real headless
browser, and bad input (no model, a model of other samples, an empty or shared test split, a
corrupt TFRecord), each a clear error naming the file."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO, run_cli, skip_unless_ci
from workflow.errors import PipelineError
from workflow.paths import RunLayout
from workflow.stages import STAGE, run_stage

ARTIFACTS = REPO / "test-artifacts"  # kept after the run (git ignores it)


def test_analysis_outputs_hold_the_network_and_every_baseline(small_run):
    _, _, run = small_run
    metrics = json.loads((run / "analysis" / "metrics.json").read_text())
    best = metrics["best_baseline"]
    assert best in ("ridge", "gradient_boosting")
    assert list(metrics["models"]) == ["network", "mean", "ridge", "gradient_boosting", f"network+{best}"]
    combination = metrics["combination"]  # weighed on the validation split, scored on the test split
    names = ("Omega_m", "sigma_8", "n_s")
    assert combination["baseline"] == best and set(combination["versus_baseline"]) == set(names)
    for name in names:
        assert 0.0 <= combination["hyperparameters"]["network_weight"][name] <= 1.0
        best_mse = metrics["baselines"][best]["validation_mse"][name]
        assert combination["validation_mse"][name] <= best_mse * (1 + 1e-12)
    assert metrics["choices"][f"network+{best}"]["chosen_on"] == "validation split"
    for model in metrics["models"].values():
        for level in ("per_sample", "per_simulation"):
            for name in names:
                figures = model[level]["parameters"][name]
                assert figures["rmse"] > 0 and figures["mae"] > 0 and figures["mlperf_mae"] > 0
    mean = metrics["models"]["mean"]["per_sample"]["parameters"]
    assert all(abs(mean[name]["pearson_r"] or 0.0) < 1e-9 for name in mean)  # a constant
    assert metrics["simulation_validation"]["simulations"] == 8
    with open(run / "analysis" / "predictions.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    network = [r for r in rows if r["model"] == "network"]
    assert sum(r["level"] == "sample" for r in network) == 16  # 2 test sims x 8 sub-volumes
    assert sum(r["level"] == "simulation" for r in network) == 2
    for row in network:  # physical units, inside the sampling range give or take the network
        assert 0.1 < float(row["pred_Omega_m"]) < 0.6 and 0.5 < float(row["pred_sigma_8"]) < 1.3
    assert sorted(p.name for p in (run / "analysis" / "figures").glob("*.png")) == [
        "learning_curves.png", "model_comparison.png", "power_spectrum_validation.png",
        "predicted_vs_true.png", "residuals.png", "slices.png"]


def test_snakemake_report_packs_the_analysis(small_run, tmp_path):
    workdir, config, _ = small_run
    zipped = tmp_path / "report.zip"
    result = subprocess.run(["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
                             "--configfile", str(config), "--report", str(zipped)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import zipfile

    names = zipfile.ZipFile(zipped).namelist()
    assert any(name.endswith("report.html") for name in names)
    assert any(name.endswith("predicted_vs_true.png") for name in names)


INSTRUMENT = """<script>
window.addEventListener('load', () => {
  const widths = Array.from(document.images).map(image => image.naturalWidth);
  document.body.setAttribute('data-image-widths', JSON.stringify(widths));
  document.body.setAttribute('data-text-length', String(document.body.innerText.length));
  const headline = document.getElementById('headline');
  document.body.setAttribute('data-headline-bottom',
                             String(headline ? headline.getBoundingClientRect().bottom : -1));
});
</script></body>"""


def test_report_renders_in_a_headless_browser(small_run, tmp_path):
    """Chromium loads the page from disk with no network: every image decodes, text shows, the
    headline (the answer per parameter) lies in the first screen of a 1280 x 800 window; the
    screenshot is kept in test-artifacts/."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        skip_unless_ci("no chromium on PATH: bash tests/setup.sh installs it (as root, Debian)")
    _, _, run = small_run
    report, page = run / "analysis" / "report.html", tmp_path / "report.html"
    page.write_text(report.read_text().replace("</body>", INSTRUMENT))
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
              "--virtual-time-budget=10000", "--window-size=1280,4000"]
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    widths = json.loads(dom.stdout.split('data-image-widths="')[1].split('"')[0].replace("&quot;", '"'))
    text_length = int(dom.stdout.split('data-text-length="')[1].split('"')[0])
    headline_bottom = float(dom.stdout.split('data-headline-bottom="')[1].split('"')[0])
    assert 0 < headline_bottom <= 800, headline_bottom
    assert len(widths) == 6 and all(width > 0 for width in widths), widths
    assert text_length > 1000
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "analysis-report.png"
    shot = subprocess.run(common + [f"--screenshot={screenshot}", report.as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(screenshot)
    assert pixels.shape[0] > 1000 and pixels[..., :3].std() > 0.05  # not a blank page


def analyze(run: RunLayout, config: dict):
    stage = STAGE["analyze"]
    return run_stage(stage, run, stage.config_slice(config))


def edit_manifest(run: RunLayout, change) -> None:
    manifest = json.loads(run.manifest.read_text())
    change(manifest)
    run.manifest.write_text(json.dumps(manifest))


def test_no_model_is_named(copied_run):
    run, config = copied_run
    (run.training / "model.keras").unlink()
    with pytest.raises(PipelineError, match=f"No trained model {run.training / 'model.keras'}"):
        analyze(run, config)


def test_a_model_for_other_samples_is_named(copied_run):
    from training.models import build_model

    run, config = copied_run
    build_model("mlperf", (16, 16, 16, 1), 3).save(run.training / "model.keras")
    with pytest.raises(PipelineError, match=r"model.keras takes samples of shape \[16, 16, 16, 1\].*"
                                            r"manifest.json holds samples of shape \[8, 8, 8, 1\]"):
        analyze(run, config)


def test_an_empty_test_split_is_named(copied_run):
    run, config = copied_run
    edit_manifest(run, lambda m: m.update(files=[f for f in m["files"] if f["split"] != "test"]))
    with pytest.raises(PipelineError, match=f"evaluation split 'test' of {run.manifest} holds no files"):
        analyze(run, config)


def test_a_test_split_sharing_a_simulation_with_training_is_named(copied_run):
    run, config = copied_run
    files = json.loads(run.manifest.read_text())["files"]
    train_sim = next(f for f in files if f["split"] == "train")["sim_ids"][0]

    def share(manifest):
        next(f for f in manifest["files"] if f["split"] == "test")["sim_ids"].append(train_sim)

    edit_manifest(run, share)
    with pytest.raises(PipelineError, match=f"{run.manifest} puts simulation {train_sim} in splits"):
        analyze(run, config)


def test_a_corrupt_tfrecord_is_named_by_the_cli(copied_run):
    run, config = copied_run
    victim = sorted((run.tfrecords / "test").glob("*.tfrecord"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (run.root / "config.yaml").write_text(json.dumps(config))
    result = run_cli("analyze", "--config", run.root / "config.yaml")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{victim} does not match its sha256" in result.stderr


def test_analysis_writes_elsewhere_with_output_dir(copied_run, tmp_path):
    run, config = copied_run
    (run.root / "config.yaml").write_text(json.dumps(config))
    out = tmp_path / "other"
    result = run_cli("analyze", "--config", run.root / "config.yaml", "--set", "analysis.baselines=[mean]",
                     "--output-dir", out)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["models"]) == ["network", "mean"] and metrics["best_baseline"] is None
    assert np.isclose(metrics["models"]["network"]["per_sample"]["n"], 16)


def test_gaussian_head_posteriors_are_calibrated_and_reported(copied_run):
    """A network trained with training.head: gaussian gives posteriors; the analysis fits the
    posterior baselines (P(k) alone, P(k) and the one-point statistics), tests every model's
    calibration per sample and per simulation (before and after the fitted inflation), measures
    the network's gain over each, draws the calibration and example figures and reports the
    coverage and the gain; the closing summary prints the gain."""
    from workflow.summary import closing_summary

    run, config = copied_run
    trained = run_cli("train", "--config", run.config_record, "--set", f"results_dir={run.root.parent}",
                      "--set", "training.head=gaussian", "--set", "training.epochs=3")
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = analyze(run, config)
    posteriors = metrics["posteriors"]
    names = ["Omega_m", "sigma_8", "n_s"]
    baselines = ["power_spectrum", "power_spectrum_one_point"]
    assert list(posteriors) == ["network", *baselines, "gain"]
    for model in ["network", *baselines]:
        per_sample, simulations = posteriors[model]["per_sample"], posteriors[model]["per_simulation"]
        assert per_sample["n_posteriors"] == 16 and simulations["before"]["n_posteriors"] == 2
        assert simulations["inflation"] > 0
        for diagnosed in (per_sample, simulations["before"], simulations["after"]):
            assert list(diagnosed["coverage"]["coverage"]) == names + ["joint"]
            assert all(0.0 <= v <= 1.0 for hits in diagnosed["coverage"]["coverage"].values() for v in hits)
            assert list(diagnosed["sbc"]["histograms"]) == names
            assert sum(diagnosed["sbc"]["histograms"]["sigma_8"]) == diagnosed["n_posteriors"]
            assert len(diagnosed["tarp"]["ecp"]) == len(diagnosed["tarp"]["alpha"])
    # P(k) alone reads fewer summary statistics than P(k) with the one-point statistics
    choices = metrics["choices"]
    assert 0 < choices["power_spectrum"]["n_features"] < choices["power_spectrum_one_point"]["n_features"]
    assert choices["power_spectrum_one_point"]["n_features"] == len(metrics["summary_statistics"])
    gain = posteriors["gain"]
    assert gain["reference"] == "network" and gain["n_simulations"] == 2 and list(gain["models"]) == baselines
    for entry in gain["models"].values():
        assert list(entry["sigma_ratio"]) == names
        estimates = [*entry["sigma_ratio"].values(), entry["fom_ratio"]]
        if entry["excluded"]:  # null ratios, and who failed which test
            assert set(entry["excluded"]) <= {"network", *baselines} and all(entry["excluded"].values())
            assert all(e["ratio"] is None for e in estimates)
        else:
            assert all(e["ratio_low"] <= e["ratio"] <= e["ratio_high"] and e["ratio"] > 0 for e in estimates)
    # the means are the network's predictions: its metrics are of the posterior means
    assert metrics["models"]["network"]["per_sample"]["parameters"]["sigma_8"]["rmse"] > 0
    assert list(metrics["models"]) == ["network", "mean", "ridge", "gradient_boosting",
                                       f"network+{metrics['best_baseline']}"]
    figures = run.analysis_files.figures
    assert run.analysis_files.figure("posterior_calibration").is_file()
    assert run.analysis_files.figure("posterior_examples").is_file()
    assert len(list(figures.glob("*.png"))) == 8
    report = run.analysis_files.report.read_text()
    assert "<summary>Posterior calibration</summary>" in report and "inflated x" in report
    assert "σ of P(k) alone / network's" in report  # the headline shows the posterior widths
    assert all(f"{model}, per simulation" in report for model in ["network", *baselines])
    assert "Information gain of the network" in report and "FoM network / baseline" in report
    assert json.loads(run.analysis_files.metrics.read_text())["posteriors"] == posteriors
    assert "posterior gain over P(k) alone" in closing_summary(run) or \
        "posterior sigma of P(k) alone over the network's" in closing_summary(run)
