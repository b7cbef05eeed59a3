"""The ``analyze`` stage's job: how well the trained network estimates the parameters, against
what, and whether the simulations behind it are sound.

1. **Evaluation**: the network (``training/model.keras``) predicts every sample of the
   evaluation split (``analysis.split``, the test split by default), read from the TFRecords
   after their sha256 is checked against the manifest; predictions are turned back into
   physical units with the manifest's target scaling.
2. **Baselines**, fitted on the training split, chosen on the validation split
   (``training.train_split`` and ``training.validation_split``), evaluated on the same
   evaluation split: the training mean; ridge and gradient boosting on each sample's summary
   statistics (binned P(k), one-point statistics of log(1 + counts); analysis.baselines);
   and the network combined with the best of them (weights chosen on the validation split,
   ``analysis.baselines.fit_combination``): whether the network reads information that the
   summary statistics miss.
3. **Fisher forecast** (design ``fiducial_derivatives`` only): from the samples' log P(k)
   bins, the two-point information bound for one sample (analysis.fisher).
4. **Simulation validation**: every simulation's histogram, at every redshift, against linear
   theory (analysis.simulation_validation); flagged simulations are listed.
5. **Outputs** (``analysis/``, named by :class:`workflow.paths.AnalysisFiles`):
   ``predictions.csv`` (per sample and per simulation, every model), ``metrics.json`` (per
   parameter and model: MAE, RMSE, bias, R^2, Pearson r, relative error, MLPerf's scaled MAE;
   the baselines' choices; the flagged simulations; the Fisher errors), ``figures/*.png`` and
   ``report.html`` (one self-contained page).
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
from workflow.paths import AnalysisFiles, RunLayout, SimulationRecord, read_params_csv
from workflow.task import Task

log = logging.getLogger(__name__)


def analyze(run: RunLayout, config) -> dict:
    """The ``analyze`` job (see the module docstring); returns metrics.json's content."""
    from analysis import baselines as fits, figures, report
    from analysis.metrics import (Predictions, bootstrap_mse, evaluate, write_metrics_json,
                                  write_predictions_csv)
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
    network = _load_network(run.training_files.model, manifest, run.manifest, section["threads"])

    # chosen on validation_split, which validate_config requires for them, as it requires the
    # mean and ridge baselines for a learning curve
    which = list(section["baselines"])
    options = {"n_bins": section["summary_bins"]}
    fisher_design = config["sampling"]["design"] == "fiducial_derivatives"
    fractions = sorted(section["learning_curve"])
    # the network also predicts the validation split, to weigh its combination with the best
    # baseline there (never on the evaluation split)
    combine = bool(set(which) - {"mean"}) and validation_split != split
    wanted = [split] + ([train_split, validation_split] if which else [])
    wanted += [s for s in manifest.splits if fisher_design and s not in wanted]
    scans = {}
    for name in dict.fromkeys(wanted):
        scans[name] = _scan(manifest, run.manifest, name, sample_box, options,
                            network if name == split or (combine and name == validation_split)
                            else None, section["batch_size"],
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

    best = fits.best_baseline(fitted) if set(fitted) - {"mean"} else None
    combination = None
    if combine:
        combination = fits.fit_combination(
            validation.predictions, fitted[best].predict(validation.features), validation.targets,
            train.targets, manifest.parameters, best)
        models[combination.name] = Predictions(
            manifest.parameters, evaluated.sim_ids, evaluated.targets,
            combination.predict(np.hstack([evaluated.predictions, models[best].pred])))

    ranges = manifest.target_ranges
    metrics = {name: evaluate(predictions, ranges) for name, predictions in models.items()}
    uncertainty = bootstrap_mse(models, section["bootstrap"], section["seed"], versus=list(fitted))
    combined = None
    if combination is not None:
        paired = bootstrap_mse({best: models[best], combination.name: models[combination.name]},
                               section["bootstrap"], section["seed"], normaliser=None,
                               reference=combination.name)
        combined = {**combination.summary(), "baseline": best, "versus_baseline": paired["versus"][best]}

    curve = None
    if fractions:
        curve = _learning_curve(run, manifest, scans, split, train_split, validation_split,
                                fractions, models, section)

    fisher = _fisher(manifest, run.params_csv, scans, sample_box, options) if fisher_design else None
    companion = section["fisher_companion"]
    if companion is not None:
        fisher = _companion_fisher(Path(companion), manifest, voxel, options)

    checks = _simulation_checks(run)

    out = run.analysis_files
    drawn = [figures.predicted_vs_true(out.figure("predicted_vs_true"), models["network"],
                                       (best, models[best]) if best else None, ranges, split),
             figures.residual_histograms(out.figure("residuals"), models, split),
             figures.model_comparison(out.figure("model_comparison"), {
                 name: {p: m["per_simulation"]["parameters"][p]["relative_error"]
                        for p in manifest.parameters}
                 for name, m in metrics.items()})]
    history = run.training_files.history
    if history.is_file():
        drawn.append(figures.learning_curves(out.figure("learning_curves"), history))
    if evaluated.kept:
        drawn.append(figures.subvolume_slices(
            out.figure("slices"), evaluated.kept,
            [", ".join(f"{p} {v:.3g}" for p, v in zip(manifest.parameters, y))
             for y in evaluated.targets[:len(evaluated.kept)]],
            voxel, [f"z = {z:g}" for z in manifest.redshifts]))
    if checks:
        drawn.append(figures.power_spectrum_validation(
            out.figure("power_spectrum_validation"), checks, config["analysis"]["validation"]["tolerance"]))
    if fisher is not None:
        drawn.append(figures.fisher_convergence(out.figure("fisher_convergence"), fisher["convergence"]))
    bound = _fisher_against_errors(fisher, uncertainty, manifest.parameters) if fisher else None
    if curve is not None:
        drawn.append(figures.data_learning_curves(
            out.figure("data_learning_curves"), curve,
            {name: row["variance_over_mean_mse"] for name, row in bound.items()} if bound else None))

    flagged = flagged_simulations(checks)
    record = {
        "split": split, "parameters": list(manifest.parameters), "target_ranges": ranges,
        "models": metrics,
        "baselines": {name: fit.summary() for name, fit in fitted.items()},
        "best_baseline": best,
        "summary_statistics": summary_names(manifest.shape[0], sample_box, manifest.shape[3], **options),
        "simulation_validation": {"simulations": len(checks), "checked": sum(c.checked for c in checks),
                                  "flagged": flagged},
        "uncertainty": uncertainty,
        "combination": combined,
        "learning_curve": curve,
        "fisher": fisher and {"source": fisher["source"], "forecast": fisher["forecast"],
                              "convergence": fisher["convergence"], "against_errors": bound},
        "choices": _choices(run, {**fitted, **({combination.name: combination} if combination else {})},
                            curve),
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_predictions_csv(out.predictions, models)
    write_metrics_json(out.metrics, record)
    report.write_report(
        out.report, title=f"CosmoFlow analysis: run {run.root.name}",
        configuration=_recorded_configuration(run), dataset=_dataset(manifest, sample_box),
        metrics=metrics, figures=drawn, flagged=flagged, n_validated=sum(c.checked for c in checks),
        fisher=fisher and {**fisher, "against_errors": bound},
        uncertainty=uncertainty, combination=combined, learning_curve=curve,
        choices=record["choices"], notes=_notes(metrics, best, manifest.parameters, uncertainty, combined))
    _log_summary(metrics, best, manifest.parameters, flagged, sum(c.checked for c in checks), out,
                 uncertainty, combined)
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


def _fisher(manifest: Manifest, params_csv: Path, scans: dict, sample_box: float, options: dict,
            source: str = "this run") -> dict:
    """Fisher forecast from the log P(k) bins of every sample of every split (one row each)."""
    from analysis.fisher import derivative_design, fisher_convergence, fisher_forecast
    from analysis.power_spectrum import summary_names

    names = summary_names(manifest.shape[0], sample_box, manifest.shape[3], **options)
    spectrum = [i for i, name in enumerate(names) if "log10P" in name]
    seeds = {r.sim_id: r.seed for r in read_params_csv(params_csv)}
    parts = [scans[split] for split in manifest.splits]
    design = derivative_design(np.concatenate([p.targets for p in parts]), manifest.parameters,
                               np.array([seeds[int(s)] for p in parts for s in p.sim_ids]))
    summaries = np.concatenate([p.features[:, spectrum] for p in parts])
    return {"source": source, "forecast": fisher_forecast(summaries, design).summary(),
            "convergence": fisher_convergence(summaries, design)}


def _companion_fisher(companion: Path, manifest: Manifest, voxel: float, options: dict) -> dict:
    """The Fisher forecast from the data set of a fiducial_derivatives run at this run's
    resolution (analysis.fisher_companion, its configuration file, which
    workflow.config.validate_config checks): same sample shape, same voxel size."""
    from workflow.config import load_config, run_directory

    recorded = load_config(companion)
    other = RunLayout(run_directory(recorded))
    for path in (other.manifest, other.params_csv):
        if not path.is_file():
            raise PipelineError(
                f"analysis.fisher_companion = {str(companion)!r}: {path} does not exist; make the "
                f"companion's data set first (snakemake --configfile {companion} --until manifest).")
    theirs = load_manifest(other.manifest)
    their_voxel = recorded["simulation"]["box_size"] / recorded["preprocessing"]["grid"]
    if tuple(theirs.shape) != tuple(manifest.shape) or not np.isclose(their_voxel, voxel) \
            or tuple(theirs.parameters) != tuple(manifest.parameters):
        raise PipelineError(
            f"analysis.fisher_companion = {str(companion)!r} holds samples of shape "
            f"{list(theirs.shape)} with {their_voxel:g} Mpc/h voxels and parameters "
            f"{list(theirs.parameters)}; this run's are {list(manifest.shape)}, {voxel:g} Mpc/h, "
            f"{list(manifest.parameters)}. The companion must have the same resolution.")
    box = theirs.shape[0] * their_voxel
    scans = {name: _scan(theirs, other.manifest, name, box, options, None, 1, keep=0, features=True)
             for name in theirs.splits}
    return _fisher(theirs, other.params_csv, scans, box, options, source=str(companion))


def _fisher_against_errors(fisher: dict, uncertainty: dict, names) -> dict:
    """Per parameter: the Fisher marginal error for one sample beside the per-sample RMSE of
    the network and every baseline, and its variance over the training mean's MSE."""
    errors = fisher["forecast"]["marginal_errors"]
    models = uncertainty["models"]
    rows = {}
    for name in names:
        sigma = errors.get(name)
        row = {"fisher_sigma": sigma, "rmse": {m: float(np.sqrt(v[name]["mse"])) for m, v in models.items()}}
        mean_mse = models["mean"][name]["mse"] if "mean" in models else None
        row["variance_over_mean_mse"] = (sigma**2 / mean_mse if sigma is not None and mean_mse
                                         else None)
        rows[name] = row
    return rows


# --- learning curve ------------------------------------------------------------------------------

def _learning_curve(run: RunLayout, manifest: Manifest, scans: dict, split: str, train_split: str,
                    validation_split: str, fractions, models: dict, section) -> dict:
    """The network (trained by rule train_fraction on each fraction of the training
    simulations) and the ridge baseline (refitted on the same simulations, chosen on the whole
    validation split) on the evaluation split, with the full training split as the last point;
    errors over the training mean's, with bootstrap intervals over the evaluation split, and
    per parameter the power-law trend of both (:func:`analysis.metrics.learning_curve_trend`)."""
    from analysis import baselines as fits
    from analysis.metrics import Predictions, bootstrap_mse, learning_curve_trend

    evaluated, train, validation = scans[split], scans[train_split], scans[validation_split]
    names = manifest.parameters
    points = {"mean": models["mean"]}
    sizes, alphas = [], {}
    for fraction in fractions:
        subset = set(manifest.subset(train_split, fraction, run.manifest).simulations(train_split))
        sizes.append(len(subset))
        network = _load_network(run.learning_curve_files(fraction).model, manifest,
                                run.manifest, section["threads"])
        predicted = _scan(manifest, run.manifest, split, 0.0, {}, network, section["batch_size"],
                          keep=0, features=False).predictions
        points[f"network@{fraction:g}"] = Predictions(names, evaluated.sim_ids, evaluated.targets, predicted)
        rows = np.isin(train.sim_ids, list(subset))
        ridge = fits.fit_ridge(train.features[rows], train.targets[rows], validation.features,
                               validation.targets, names)
        alphas[f"{fraction:g}"] = ridge.hyperparameters["alpha"]
        points[f"ridge@{fraction:g}"] = Predictions(names, evaluated.sim_ids, evaluated.targets,
                                                    ridge.predict(evaluated.features))
    points["network@1"], points["ridge@1"] = models["network"], models["ridge"]
    sizes.append(len(manifest.simulations(train_split)))
    scores = bootstrap_mse(points, section["bootstrap"], section["seed"], reference=None)
    curve = {"fractions": [*fractions, 1.0], "train_simulations": sizes,
             "ridge_alpha": alphas, "models": {}}
    for model in ("network", "ridge"):
        curve["models"][model] = {name: {key: [scores["models"][f"{model}@{f:g}"][name][key]
                                               for f in curve["fractions"]]
                                         for key in ("ratio", "ratio_low", "ratio_high", "mse")}
                                  for name in names}
    curve["trend"] = {name: learning_curve_trend(sizes, curve["models"]["network"][name]["mse"],
                                                 curve["models"]["ridge"][name]["mse"])
                      for name in names}
    return curve


def _choices(run: RunLayout, fitted: dict, curve: dict | None) -> dict:
    """How every hyperparameter of the compared models was chosen: the baselines' on the
    validation split (their grids and choices), the network's from the training record."""
    import json

    choices = {name: {"chosen_on": "validation split", **fit.summary()} for name, fit in fitted.items()}
    record = run.training_files.run_record
    network = {"chosen_on": "validation split, by hand: the settings of the configuration "
                            "(its comments say how they were chosen); never the test split"}
    if record.is_file():
        recorded = json.loads(record.read_text(encoding="utf-8"))
        network["settings"] = recorded.get("settings")
        network["validation"] = recorded.get("validation")
    choices["network"] = network
    if curve is not None:
        choices["learning_curve_ridge_alpha"] = curve["ridge_alpha"]
    return choices


# --- simulation validation ---------------------------------------------------------------------

def validate_simulation(run: RunLayout, config, record: SimulationRecord) -> Task:
    """The ``validate_simulations`` job for one simulation: its histogram against linear theory
    (analysis.simulation_validation) -> validation/<sim_id>.h5. It runs right after the
    histogram, so a flagged simulation is reported (a warning) while the data set is made."""
    from analysis.simulation_validation import ValidationSettings, validate_histogram, write_simulation_check

    settings = ValidationSettings.from_mapping(config["analysis"]["validation"].plain(), config["cosmology"])
    source, out = run.histogram(record.sim_id), run.simulation_check(record.sim_id)

    def write(provenance: str):
        check = validate_histogram(source, settings, config["analysis"]["threads"])
        # named relative to the run directory: the same bytes whichever driver runs the job
        write_simulation_check(out, dataclasses.replace(check, path=str(source.relative_to(run.root))),
                               provenance)

    return Task(out, write, inputs=(source,))


def _simulation_checks(run: RunLayout) -> list:
    """Every simulation's check, as validate_simulations wrote it."""
    from analysis.simulation_validation import read_simulation_check

    return [read_simulation_check(run.simulation_check(r.sim_id)) for r in read_params_csv(run.params_csv)]


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


def _notes(metrics: dict, best: str | None, names, uncertainty: dict | None = None,
           combination: dict | None = None) -> list[str]:
    lines = []
    for name, over_mean, over_best in _comparison(metrics, best, names):
        verdict = ("it beats it" if over_best < 1 else "it does not beat it") if best else ""
        interval = ""
        if best and uncertainty and best in uncertainty.get("versus", {}):
            paired = uncertainty["versus"][best][name]
            clear = paired["ratio_high"] < 1 or paired["ratio_low"] > 1
            interval = (f" (bootstrap interval {paired['ratio_low']:.3f}-{paired['ratio_high']:.3f}"
                        f", {'beyond' if clear else 'within'} the test set's uncertainty)")
            if not clear:
                verdict = "the test set cannot tell them apart"
        lines.append(f"{name}: the network's test MSE is {over_mean:.3f} x the training mean's"
                     + (f" and {over_best:.3f} x the best baseline's ({best}){interval}: "
                        f"{verdict}." if best else "."))
    for name in names if combination else ():
        paired = combination["versus_baseline"][name]
        weight = combination["hyperparameters"]["network_weight"][name]
        verdict = ("the network reads information that the summary statistics miss"
                   if paired["ratio_high"] < 1 else
                   "no information beyond the summary statistics within the test set's uncertainty")
        lines.append(f"{name}: the network and {best} combined ({weight:.2f} x the network, chosen "
                     f"on the validation split) reach {paired['ratio']:.3f} x {best}'s test MSE "
                     f"(bootstrap interval {paired['ratio_low']:.3f}-{paired['ratio_high']:.3f}): "
                     f"{verdict}.")
    return lines


def _log_summary(metrics, best, names, flagged, n_validated, out: AnalysisFiles, uncertainty=None,
                 combination=None) -> None:
    for line in _notes(metrics, best, names, uncertainty, combination):
        log.info("analyze: %s", line, extra=PROGRESS)
    log.info("analyze: %d of %d simulations checked against linear theory flagged", len(flagged),
             n_validated, extra=PROGRESS)
    log.info("analyze: wrote %s (open it in a browser), %s, %s", out.report, out.metrics.name,
             out.predictions.name, extra=PROGRESS)
