"""The ``analyze`` stage's job: how well the trained network estimates the parameters, against
what, and whether the simulations behind it are sound.

1. **Evaluation**: the network (``training/model.keras``) predicts every sample of the
   evaluation split (``analysis.split``, the test split by default), read from the TFRecords
   after their sha256 is checked against the manifest; predictions are turned back into
   physical units with the manifest's target scaling.
2. **Baselines**, fitted on the training split, chosen on the validation split
   (``training.train_split`` and ``training.validation_split``), evaluated on the same
   evaluation split: the training mean; ridge and gradient boosting on each sample's summary
   statistics (binned P(k), one-point statistics of log(1 + counts); analysis.baselines).
3. **Fisher forecast** (design ``fiducial_derivatives`` only): from the samples' log P(k)
   bins, the two-point information bound for one sample (analysis.fisher).
4. **Simulation validation**: every simulation's histogram, at every redshift, against linear
   theory (analysis.simulation_validation); flagged simulations are listed.
5. **Outputs** (``analysis/``): ``predictions.csv`` (per sample and per simulation, every
   model), ``metrics.json`` (per parameter and model: MAE, RMSE, bias, R^2, Pearson r, relative
   error, MLPerf's scaled MAE; the baselines' choices; the flagged simulations; the Fisher
   errors), ``figures/*.png`` and ``report.html`` (one self-contained page).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from preprocessing.manifest import Manifest, load_manifest, verify_files
from workflow.errors import PipelineError
from workflow.logs import PROGRESS
from workflow.paths import RunLayout, read_params_csv

log = logging.getLogger(__name__)

FIGURES = "figures"


def analyze(run: RunLayout, config) -> dict:
    """The ``analyze`` job (see the module docstring); returns metrics.json's content."""
    from analysis import baselines as fits, figures, report
    from analysis.metrics import Predictions, evaluate, write_metrics_json, write_predictions_csv
    from analysis.power_spectrum import summary_names
    from analysis.simulation_validation import flagged_simulations

    section = config["analysis"]
    started = time.perf_counter()
    manifest = load_manifest(run.manifest)
    split = section["split"]
    train_split, validation_split = (config["training"][key] for key in ("train_split", "validation_split"))
    voxel = config["simulation"]["box_size"] / config["preprocessing"]["grid"]
    sample_box = manifest.shape[0] * voxel  # Mpc/h across one sample
    for role, name in (("evaluation", split), ("training", train_split), ("validation", validation_split)):
        if name is not None and not manifest.files_of(name):
            raise PipelineError(f"The {role} split '{name}' of {run.manifest} holds no files "
                                f"(splits: {list(manifest.splits)}); set sampling.splits so it "
                                f"gets simulations.")
    network = _load_network(run.training / "model.keras", manifest, run.manifest, section["threads"])

    which = list(section["baselines"])
    if which and validation_split is None:
        raise PipelineError("analysis.baselines are chosen on training.validation_split, which is "
                            "null; set it (e.g. val) or set analysis.baselines to []")
    options = {"n_bins": section["summary_bins"]}
    fisher_design = config["sampling"]["design"] == "fiducial_derivatives"
    wanted = [split] + ([train_split, validation_split] if which else [])
    wanted += [s for s in manifest.splits if fisher_design and s not in wanted]
    scans = {}
    for name in dict.fromkeys(wanted):
        scans[name] = _scan(manifest, run.manifest, name, sample_box, options,
                            network if name == split else None, section["batch_size"],
                            keep=section["slices"] if name == split else 0,
                            features=bool(which) or fisher_design)
    evaluated = scans[split]
    models = {"network": Predictions(manifest.parameters, evaluated.sim_ids, evaluated.targets,
                                     evaluated.predictions)}
    fitted = {}
    if which:
        train, validation = scans[train_split], scans[validation_split]
        fitted = fits.fit_baselines(train.features, train.targets, validation.features,
                                    validation.targets, manifest.parameters, seed=section["seed"],
                                    threads=1, which=which)
        for name, fit in fitted.items():
            models[name] = Predictions(manifest.parameters, evaluated.sim_ids, evaluated.targets,
                                       fit.predict(evaluated.features))

    ranges = manifest.target_ranges
    metrics = {name: evaluate(predictions, ranges) for name, predictions in models.items()}
    best = fits.best_baseline(fitted) if set(fitted) - {"mean"} else None

    fisher = _fisher(manifest, run, scans, sample_box, options) if fisher_design else None

    checks = _validate_simulations(run, config, section["threads"])

    out = run.analysis
    figure_dir = out / FIGURES
    drawn = [figures.predicted_vs_true(figure_dir / "predicted_vs_true.png", models["network"],
                                       (best, models[best]) if best else None, ranges, split),
             figures.residual_histograms(figure_dir / "residuals.png", models, split),
             figures.model_comparison(figure_dir / "model_comparison.png", {
                 name: {p: m["per_simulation"]["parameters"][p]["relative_error"] for p in manifest.parameters}
                 for name, m in metrics.items()})]
    history = run.training / "history.csv"
    if history.is_file():
        drawn.append(figures.learning_curves(figure_dir / "learning_curves.png", history))
    if evaluated.kept:
        drawn.append(figures.subvolume_slices(
            figure_dir / "slices.png", evaluated.kept,
            [", ".join(f"{p} {v:.3g}" for p, v in zip(manifest.parameters, y))
             for y in evaluated.targets[:len(evaluated.kept)]],
            voxel, [f"z = {z:g}" for z in manifest.redshifts]))
    if checks:
        drawn.append(figures.power_spectrum_validation(
            figure_dir / "power_spectrum_validation.png", checks, config["analysis"]["validation"]["tolerance"]))
    if fisher is not None:
        drawn.append(figures.fisher_convergence(figure_dir / "fisher_convergence.png", fisher["convergence"]))

    flagged = flagged_simulations(checks)
    record = {
        "split": split, "parameters": list(manifest.parameters), "target_ranges": ranges,
        "models": metrics,
        "baselines": {name: fit.summary() for name, fit in fitted.items()},
        "best_baseline": best,
        "summary_statistics": summary_names(manifest.shape[0], sample_box, manifest.shape[3], **options),
        "simulation_validation": {"simulations": len(checks), "checked": sum(c.checked for c in checks),
                                  "flagged": flagged},
        "fisher": fisher and {"forecast": fisher["forecast"], "convergence": fisher["convergence"]},
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_predictions_csv(out / "predictions.csv", models)
    write_metrics_json(out / "metrics.json", record)
    report.write_report(
        out / "report.html", title=f"CosmoFlow analysis: run {run.root.name}",
        configuration=_recorded_configuration(run), dataset=_dataset(manifest, sample_box),
        metrics=metrics, figures=drawn, flagged=flagged, n_validated=sum(c.checked for c in checks),
        fisher=fisher,
        notes=_notes(metrics, best, manifest.parameters))
    _log_summary(metrics, best, manifest.parameters, flagged, sum(c.checked for c in checks), out)
    return record


# --- evaluation ---------------------------------------------------------------------------------

def _load_network(path: Path, manifest: Manifest, manifest_path: Path, threads: int):
    """The trained network; PipelineError if it is missing or its input is not the samples'."""
    if not path.is_file():
        raise PipelineError(f"No trained model {path}; run the train stage first (snakemake --until train).")
    import keras

    from training.run import set_tensorflow_threads

    set_tensorflow_threads(threads, keys=("analysis.threads", ""))
    try:
        network = keras.models.load_model(path, compile=False)
    except (OSError, ValueError) as error:
        raise PipelineError(f"Model {path} cannot be loaded: {error}") from error
    expected = tuple(network.input_shape[1:])
    if expected != tuple(manifest.shape) or network.output_shape[-1] != len(manifest.parameters):
        raise PipelineError(
            f"Model {path} takes samples of shape {list(expected)} and predicts "
            f"{network.output_shape[-1]} parameters, but {manifest_path} holds samples of shape "
            f"{list(manifest.shape)} with {len(manifest.parameters)} parameters; retrain on this "
            f"data set.")
    return network


@dataclasses.dataclass
class SplitScan:
    """One pass over a split: per sample its targets (physical units), sim_id, the network's
    prediction (physical units) and summary statistics when asked, and the first samples' counts."""

    targets: np.ndarray
    sim_ids: np.ndarray
    predictions: np.ndarray | None
    features: np.ndarray | None
    kept: list


def _scan(manifest: Manifest, manifest_path: Path, split: str, sample_box: float, options: dict,
          network, batch_size: int, keep: int, features: bool) -> SplitScan:
    """Read a split once, in manifest order, after checking its files against the manifest's
    sha256 (a corrupt file is named); memory holds one batch of samples, not the split."""
    from analysis.power_spectrum import summary_statistics
    from preprocessing.tfrecords import read_dataset

    verify_files(manifest, manifest_path, split)
    data = read_dataset(manifest.files_of(split), manifest.shape, manifest.dtype,
                        manifest.compression, len(manifest.parameters), with_sim_id=True)
    targets, sim_ids, predictions, rows, kept, batch = [], [], [], [], [], []

    def predict():
        if network is not None and batch:
            scaled = network.predict_on_batch(manifest.normalise_counts(np.stack(batch)))
            predictions.append(manifest.unscale_targets(np.asarray(scaled, np.float64)))
        batch.clear()

    what = " + ".join(["inference"] * (network is not None) + ["summary statistics"] * features)
    for x, y, sim_id in tqdm(data.as_numpy_iterator(), total=manifest.n_samples(split),
                             desc=f"analyze: {split} split ({what or 'targets'})", unit="sample",
                             mininterval=2.0, disable=None):
        targets.append(y), sim_ids.append(sim_id)
        if features:
            rows.append(summary_statistics(x, sample_box, **options))
        if len(kept) < keep:
            kept.append(x)
        batch.append(x)
        if len(batch) == batch_size:
            predict()
    predict()
    return SplitScan(np.array(targets, np.float64), np.array(sim_ids),
                     np.concatenate(predictions) if predictions else None,
                     np.stack(rows) if rows else None, kept)


def _fisher(manifest: Manifest, run: RunLayout, scans: dict, sample_box: float, options: dict) -> dict:
    """Fisher forecast from the log P(k) bins of every sample of every split (one row each)."""
    from analysis.fisher import derivative_design, fisher_convergence, fisher_forecast
    from analysis.power_spectrum import summary_names

    names = summary_names(manifest.shape[0], sample_box, manifest.shape[3], **options)
    spectrum = [i for i, name in enumerate(names) if "log10P" in name]
    seeds = {r.sim_id: r.seed for r in read_params_csv(run.params_csv)}
    parts = [scans[split] for split in manifest.splits]
    design = derivative_design(np.concatenate([p.targets for p in parts]), manifest.parameters,
                               np.array([seeds[int(s)] for p in parts for s in p.sim_ids]))
    summaries = np.concatenate([p.features[:, spectrum] for p in parts])
    return {"forecast": fisher_forecast(summaries, design).summary(),
            "convergence": fisher_convergence(summaries, design)}


# --- simulation validation ---------------------------------------------------------------------

def _validate_simulations(run: RunLayout, config, threads: int) -> list:
    """Every simulation's histogram against linear theory (analysis.simulation_validation)."""
    from analysis.simulation_validation import ValidationSettings, validate_histogram

    settings = ValidationSettings.from_mapping(
        config["analysis"]["validation"].plain(),
        {key: config["cosmology"][key] for key in ("transfer", "transfer_table", "T_cmb")})
    records = read_params_csv(run.params_csv)
    return [validate_histogram(run.histogram(r.sim_id), settings, workers=threads)
            for r in tqdm(records, desc="analyze: simulation validation", unit="sim",
                          mininterval=2.0, disable=None)]


# --- report text ---------------------------------------------------------------------------------

def _recorded_configuration(run: RunLayout) -> dict:
    """The run's configuration as recorded in its config.yaml (every default filled in)."""
    from workflow.config import read_yaml

    try:
        return read_yaml(run.config_record.read_text(encoding="utf-8")) or {}
    except OSError:
        return {"note": f"{run.config_record} not found"}


def _dataset(manifest: Manifest, sample_box: float) -> dict:
    return {"sample shape": list(manifest.shape), "sample side (Mpc/h)": sample_box,
            "redshift channels": list(manifest.redshifts), "parameters": list(manifest.parameters),
            **{f"{split} samples": manifest.n_samples(split) for split in manifest.splits},
            **{f"{split} simulations": len({s for f in manifest.files if f.split == split for s in f.sim_ids})
               for split in manifest.splits}}


def _comparison(metrics: dict, best: str | None, names) -> list[tuple[str, float, float]]:
    """(parameter, network MSE / mean baseline's, network MSE / best baseline's) per parameter."""
    def mse(model, name):
        return metrics[model]["per_sample"]["parameters"][name]["rmse"] ** 2

    return [(name, mse("network", name) / mse("mean", name) if "mean" in metrics else float("nan"),
             mse("network", name) / mse(best, name) if best else float("nan")) for name in names]


def _notes(metrics: dict, best: str | None, names) -> list[str]:
    lines = []
    for name, over_mean, over_best in _comparison(metrics, best, names):
        verdict = ("beats" if over_best < 1 else "does not beat") if best else ""
        lines.append(f"{name}: the network's test MSE is {over_mean:.3f} x the training mean's"
                     + (f" and {over_best:.3f} x the best baseline's ({best}): it {verdict} it."
                        if best else "."))
    return lines


def _log_summary(metrics, best, names, flagged, n_validated, out: Path) -> None:
    for line in _notes(metrics, best, names):
        log.info("analyze: %s", line, extra=PROGRESS)
    log.info("analyze: %d of %d simulations checked against linear theory flagged", len(flagged),
             n_validated, extra=PROGRESS)
    log.info("analyze: wrote %s (open it in a browser), metrics.json, predictions.csv",
             out / "report.html", extra=PROGRESS)
