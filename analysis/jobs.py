"""The ``analyze`` stage's job: how well the trained network estimates the parameters, against
what, and whether the simulations behind it are sound. :func:`analyze` runs these steps in order,
each a function of the :class:`Analysis` they share:

1. :func:`evaluate_splits`: the network (``training/model.keras``) predicts every sample of the
   evaluation split (``analysis.split``, the test split by default), read from the TFRecords
   after their sha256 is checked against the manifest; predictions are turned back into
   physical units with the manifest's target scaling.
2. :func:`fit_baselines`: the baselines, fitted on the training split, chosen on the validation
   split (``training.train_split`` and ``training.validation_split``), evaluated on the same
   evaluation split: the training mean; ridge and gradient boosting on each sample's summary
   statistics (binned P(k), one-point statistics of log(1 + counts); analysis.baselines).
3. :func:`combine_with_best_baseline`: the network combined with the best baseline (weights
   chosen on the validation split, ``analysis.baselines.fit_combination``) against that
   baseline: whether the network reads information that the summary statistics miss.
4. :func:`score_models`: every model's errors (analysis.metrics), with bootstrap intervals over
   the evaluated simulations.
5. :func:`fit_posterior_baselines` (a network with ``training.head: gaussian``): Gaussian
   posteriors of the same family from the summary statistics, P(k) alone and P(k) with the
   one-point statistics (analysis.baselines.fit_posterior_baselines).
6. :func:`calibrate_posteriors` (the same networks): the Gaussian posteriors of the network and
   of those baselines, per sample and per simulation (the product of its sub-volumes'), tested
   for calibration on the evaluation split, the simulations' also after the covariance
   inflation fitted on the validation split; and how much narrower the network's calibrated
   posteriors are than each baseline's (analysis.posteriors).
7. :func:`learning_curve` (``analysis.learning_curve``): the network trained on fractions of the
   training simulations and the ridge baseline refitted on them.
8. :func:`fisher_forecast` (design ``fiducial_derivatives``, or ``analysis.fisher_companion``):
   from the samples' log P(k) bins, the two-point information bound for one sample
   (analysis.fisher).
9. :func:`check_simulations`: every simulation's histogram, at every redshift, against linear
   theory (analysis.simulation_validation); flagged simulations are listed.
10. :func:`draw_figures`: ``figures/*.png`` (analysis.figures).
11. :func:`write_outputs` (``analysis/``, named by :class:`workflow.paths.AnalysisFiles`):
   ``predictions.csv`` (per sample and per simulation, every model), ``metrics.json`` (per
   parameter and model: MAE, RMSE, bias, R^2, Pearson r, relative error, MLPerf's scaled MAE;
   the baselines' choices; the flagged simulations; the Fisher errors) and ``report.html`` (one
   self-contained page).
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
from workflow.params_table import SimulationRecord, read_params_csv
from workflow.paths import AnalysisFiles, RunLayout
from workflow.task import Task

log = logging.getLogger(__name__)


def analyze(run: RunLayout, config) -> dict:
    """The ``analyze`` job (see the module docstring); returns metrics.json's content."""
    started = time.perf_counter()
    analysis = evaluate_splits(run, config)
    fit_baselines(analysis)
    combine_with_best_baseline(analysis)
    score_models(analysis)
    fit_posterior_baselines(analysis)
    calibrate_posteriors(analysis)
    learning_curve(analysis)
    fisher_forecast(analysis)
    check_simulations(analysis)
    figures = draw_figures(analysis)
    return write_outputs(analysis, figures, seconds=time.perf_counter() - started)


@dataclasses.dataclass
class Analysis:
    """What the steps of :func:`analyze` share: the run, its settings and data set, the scans of
    its splits; every model's predictions on the evaluation split (``models``, in metrics.json's
    order: a step that makes a model adds it there and, but for the network, its fit with its
    choices to ``fits``); and each step's part of metrics.json."""

    run: RunLayout
    section: object  # the configuration's analysis section
    manifest: Manifest
    split: str  # analysis.split, the evaluation split
    train_split: str | None  # training.train_split
    validation_split: str | None  # training.validation_split
    voxel: float  # Mpc/h
    fisher_of_this_run: bool  # design fiducial_derivatives and no analysis.fisher_companion
    scans: dict = dataclasses.field(default_factory=dict)  # split -> SplitScan
    models: dict = dataclasses.field(default_factory=dict)  # name -> analysis.metrics.Predictions
    fits: dict = dataclasses.field(default_factory=dict)  # name -> analysis.baselines.BaselineFit
    best_baseline: str | None = None  # the best but the mean on the validation split
    metrics: dict | None = None  # name -> analysis.metrics.evaluate
    uncertainty: dict | None = None  # analysis.metrics.bootstrap_mse
    combination: dict | None = None  # the combination's choices and test against its baseline
    posterior_fits: dict = dataclasses.field(default_factory=dict)  # name -> baselines.PosteriorFit
    posteriors: dict | None = None  # per posterior model analysis.posteriors' diagnostics; the gain
    simulation_posteriors: dict | None = None  # per posterior model, the evaluated simulations'
    learning_curve: dict | None = None
    fisher: dict | None = None
    checks: list = dataclasses.field(default_factory=list)  # per simulation, against linear theory

    @property
    def combines(self) -> bool:
        """Whether the network is combined with the best baseline: there is one besides the mean,
        and a validation split apart from the evaluation split to weigh them on."""
        return bool(set(self.section["baselines"]) - {"mean"}) and self.validation_split != self.split

    @property
    def sample_box(self) -> float:
        """Mpc/h across one sample."""
        return self.manifest.shape[0] * self.voxel

    @property
    def options(self) -> dict:
        """Of the summary statistics (analysis.power_spectrum.summary_statistics)."""
        return {"n_bins": self.section["summary_bins"]}

    @property
    def feature_names(self) -> list[str]:
        """Of the summary statistics' columns (analysis.power_spectrum.summary_names)."""
        from analysis.power_spectrum import summary_names

        manifest = self.manifest
        return summary_names(manifest.shape[0], self.sample_box, manifest.shape[3], **self.options)

    @property
    def evaluated(self) -> SplitScan:
        return self.scans[self.split]

    def on_evaluation_split(self, predicted: np.ndarray):
        """Predictions (N, P; physical units) of the evaluation split's samples, as analysis.metrics'."""
        from analysis.metrics import Predictions

        evaluated = self.evaluated
        return Predictions(self.manifest.parameters, evaluated.sim_ids, evaluated.targets, predicted)


def evaluate_splits(run: RunLayout, config) -> Analysis:
    """Reads the manifest, the network and the TFRecords; gives the Analysis with the splits'
    scans (summary statistics where a baseline, a posterior baseline or the Fisher forecast needs
    them) and the network's predictions."""
    section, training = config["analysis"], config["training"]
    analysis = Analysis(
        run, section, load_manifest(run.manifest), split=section["split"],
        train_split=training["train_split"], validation_split=training["validation_split"],
        voxel=config["simulation"]["box_size"] / config["preprocessing"]["grid"],
        fisher_of_this_run=(config["sampling"]["design"] == "fiducial_derivatives"
                            and section["fisher_companion"] is None))
    manifest, split, baselines = analysis.manifest, analysis.split, section["baselines"]
    for role, name in (("evaluation", split), ("training", analysis.train_split),
                       ("validation", analysis.validation_split)):
        if name is not None and not manifest.files_of(name):
            raise PipelineError(f"The {role} split '{name}' of {run.manifest} holds no files "
                                f"(splits: {list(manifest.splits)}); set sampling.splits so it "
                                f"gets simulations.")
    network = _load_network(run.training_files.model, manifest, run.manifest, section["threads"])
    # the network also predicts the validation split, to weigh its combination with the best
    # baseline there, and to calibrate its posteriors (never on the evaluation split)
    posterior = network.output_shape[-1] > len(manifest.parameters)
    validated = analysis.validation_split not in (None, split) and (analysis.combines or posterior)
    predicted = {split} | ({analysis.validation_split} if validated else set())
    wanted = [split] + ([analysis.train_split, analysis.validation_split] if baselines or posterior else [])
    wanted += [s for s in manifest.splits if analysis.fisher_of_this_run and s not in wanted]
    for name in dict.fromkeys(wanted):
        analysis.scans[name] = _scan(manifest, run.manifest, name, analysis.sample_box, analysis.options,
                                     network if name in predicted else None, section["batch_size"],
                                     keep=section["slices"] if name == split else 0,
                                     features=bool(baselines) or posterior or analysis.fisher_of_this_run)
    analysis.models["network"] = analysis.on_evaluation_split(analysis.evaluated.predictions)
    return analysis


def fit_baselines(analysis: Analysis) -> None:
    """Reads the training and validation splits' summary statistics; gives the baselines' fits
    and predictions, and the best baseline but the mean."""
    from analysis import baselines as fits

    if not analysis.section["baselines"]:
        return
    # validate_config requires a validation split for them, and mean and ridge for a learning curve
    train, validation = analysis.scans[analysis.train_split], analysis.scans[analysis.validation_split]
    fitted = fits.fit_baselines(train.features, train.targets, validation.features, validation.targets,
                                analysis.manifest.parameters, seed=analysis.section["seed"], threads=1,
                                which=list(analysis.section["baselines"]))
    for name, fit in fitted.items():
        analysis.fits[name] = fit
        analysis.models[name] = analysis.on_evaluation_split(fit.predict(analysis.evaluated.features))
    if set(fitted) - {"mean"}:
        analysis.best_baseline = fits.best_baseline(fitted)


def combine_with_best_baseline(analysis: Analysis) -> None:
    """Reads the network's and the best baseline's predictions on the validation split; gives
    the combination's fit and predictions (``network+<baseline>``) and its paired bootstrap test
    against the baseline on the evaluation split."""
    from analysis import baselines as fits
    from analysis.metrics import bootstrap_mse

    if not analysis.combines:
        return
    best, models, section = analysis.best_baseline, analysis.models, analysis.section
    train, validation = analysis.scans[analysis.train_split], analysis.scans[analysis.validation_split]
    on_validation = analysis.fits[best].predict(validation.features)
    combination = fits.fit_combination(validation.predictions, on_validation, validation.targets,
                                       train.targets, analysis.manifest.parameters, best)
    analysis.fits[combination.name] = combination
    models[combination.name] = analysis.on_evaluation_split(combination.predict(
        np.hstack([analysis.evaluated.predictions, models[best].pred])))
    paired = bootstrap_mse({best: models[best], combination.name: models[combination.name]},
                           section["bootstrap"], section["seed"], normaliser=None, reference=combination.name)
    analysis.combination = {**combination.summary(), "baseline": best,
                            "versus_baseline": paired["versus"][best]}


def score_models(analysis: Analysis) -> None:
    """Reads every model's predictions on the evaluation split; gives their metrics and their
    bootstrap intervals, the network against each baseline."""
    from analysis.metrics import bootstrap_mse, evaluate

    section = analysis.section
    analysis.metrics = {name: evaluate(predictions, analysis.manifest.target_ranges)
                        for name, predictions in analysis.models.items()}
    analysis.uncertainty = bootstrap_mse(analysis.models, section["bootstrap"], section["seed"],
                                         versus=list(analysis.section["baselines"]))


def fit_posterior_baselines(analysis: Analysis) -> None:
    """Reads the training and validation splits' summary statistics (a network with the gaussian
    head only: its posteriors on the evaluation split); gives the posterior baselines' fits,
    P(k) alone and P(k) with the one-point statistics (analysis.baselines.fit_posterior)."""
    from analysis import baselines as fits

    if analysis.evaluated.covariances is None:
        return
    if analysis.validation_split in (None, analysis.split) or analysis.train_split is None:
        raise PipelineError(f"Posteriors are fitted on the training split and calibrated on the "
                            f"validation split, training.train_split = {analysis.train_split!r} and "
                            f"training.validation_split = {analysis.validation_split!r}, apart from "
                            f"analysis.split = {analysis.split!r}; set them.")
    train, validation = analysis.scans[analysis.train_split], analysis.scans[analysis.validation_split]
    analysis.posterior_fits = fits.fit_posterior_baselines(
        train.features, train.targets, validation.features, validation.targets, analysis.manifest.parameters,
        analysis.feature_names, *analysis.manifest.target_bounds(), seed=analysis.section["seed"])


def calibrate_posteriors(analysis: Analysis) -> None:
    """Reads the Gaussian posteriors of the network (none with the point head) and of the
    posterior baselines on the evaluation and validation splits; gives, per model, their
    calibration diagnostics in the prior box, the sampling ranges
    (analysis.posteriors.diagnostics): per sample, and per simulation, the product of its
    sub-volumes' posteriors, before and after the inflation of its covariance that calibrates
    the validation split's simulations (analysis.posteriors.temperature_scaling); and the
    network's information gain over each baseline from the inflated per-simulation posteriors
    (analysis.posteriors.information_gain)."""
    from analysis.posteriors import (combine_subvolumes, diagnostics, failed_tests, information_gain,
                                     temperature_scaling)

    evaluated, validation = analysis.evaluated, analysis.scans.get(analysis.validation_split)
    if evaluated.covariances is None:
        return
    names, section = analysis.manifest.parameters, analysis.section
    lower, upper = (np.asarray(bound, np.float64) for bound in analysis.manifest.target_bounds())
    rng = np.random.default_rng(section["seed"])
    moments = {"network": lambda scan: (scan.predictions, scan.covariances),
               **{name: lambda scan, fit=fit: fit.predict(scan.features)
                  for name, fit in analysis.posterior_fits.items()}}

    def per_simulation(scan: SplitScan, means, covariances):
        ids, means, covariances = combine_subvolumes(means, covariances, scan.sim_ids)
        return means, covariances, scan.targets[np.unique(scan.sim_ids, return_index=True)[1]]

    analysis.posteriors, analysis.simulation_posteriors = {}, {}
    for name, posterior in moments.items():
        means, covariances = posterior(evaluated)
        simulations = per_simulation(evaluated, means, covariances)
        analysis.posteriors[name] = {
            "per_sample": diagnostics(means, covariances, evaluated.targets, lower, upper, names, rng),
            "per_simulation": temperature_scaling(per_simulation(validation, *posterior(validation)),
                                                  simulations, lower, upper, names, rng)}
        inflation = analysis.posteriors[name]["per_simulation"]["inflation"]
        analysis.simulation_posteriors[name] = (simulations[0], simulations[1] * inflation, simulations[2])
    analysis.posteriors["gain"] = information_gain(
        {name: covariances for name, (_, covariances, _) in analysis.simulation_posteriors.items()}, names,
        {name: failed_tests(analysis.posteriors[name]["per_simulation"]["after"]) for name in moments},
        n_resamples=section["bootstrap"], seed=section["seed"])


def learning_curve(analysis: Analysis) -> None:
    """Reads the networks trained on fractions of the training simulations; gives the learning
    curve of the network and the ridge baseline.

    The network (trained by rule train_fraction on each fraction) and the ridge baseline
    (refitted on the same simulations, chosen on the whole validation split) on the evaluation
    split, with the full training split as the last point; errors over the training mean's,
    with bootstrap intervals over the evaluation split, and per parameter the power-law trend of
    both (:func:`analysis.metrics.learning_curve_trend`)."""
    from analysis import baselines as fits
    from analysis.metrics import bootstrap_mse, learning_curve_trend, saturating_fit

    run, manifest, section = analysis.run, analysis.manifest, analysis.section
    fractions = sorted(section["learning_curve"])
    if not fractions:
        return
    train_split, names = analysis.train_split, manifest.parameters
    train, validation, evaluated = (analysis.scans[train_split], analysis.scans[analysis.validation_split],
                                    analysis.evaluated)
    points = {"mean": analysis.models["mean"]}
    sizes, alphas = [], {}
    for fraction in fractions:
        subset = set(manifest.subset(train_split, fraction, run.manifest).simulations(train_split))
        sizes.append(len(subset))
        network = _load_network(run.learning_curve_files(fraction).model, manifest,
                                run.manifest, section["threads"])
        predicted = _scan(manifest, run.manifest, analysis.split, 0.0, {}, network, section["batch_size"],
                          keep=0, features=False).predictions
        points[f"network@{fraction:g}"] = analysis.on_evaluation_split(predicted)
        rows = np.isin(train.sim_ids, list(subset))
        ridge = fits.fit_ridge(train.features[rows], train.targets[rows], validation.features,
                               validation.targets, names)
        alphas[f"{fraction:g}"] = ridge.hyperparameters["alpha"]
        points[f"ridge@{fraction:g}"] = analysis.on_evaluation_split(ridge.predict(evaluated.features))
    points["network@1"], points["ridge@1"] = analysis.models["network"], analysis.models["ridge"]
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
    curve["saturating"] = {name: {model: saturating_fit(sizes, curve["models"][model][name]["mse"])
                                  for model in ("network", "ridge")} for name in names}
    analysis.learning_curve = curve


def fisher_forecast(analysis: Analysis) -> None:
    """Reads the log P(k) bins of the Fisher companion's samples, or else of this run's; gives
    the Fisher forecast beside the models' errors and, with a learning curve, the number of
    training simulations at which the network's saturating fit would reach the two-point bound
    (analysis.metrics.bound_crossing; None where it levels off above it)."""
    from analysis.metrics import bound_crossing

    companion = analysis.section["fisher_companion"]
    if companion is not None:
        fisher = _companion_fisher(Path(companion), analysis.manifest, analysis.voxel, analysis.options)
    elif analysis.fisher_of_this_run:
        fisher = _fisher(analysis.manifest, analysis.run.params_csv, analysis.scans, analysis.sample_box,
                         analysis.options)
    else:
        return
    analysis.fisher = {**fisher, "against_errors": _fisher_against_errors(
        fisher, analysis.uncertainty, analysis.manifest.parameters)}
    curve = analysis.learning_curve
    if curve is not None:
        sigmas = fisher["forecast"]["marginal_errors"]
        curve["fisher_crossing_simulations"] = {
            name: bound_crossing(curve["saturating"][name]["network"],
                                 None if sigmas.get(name) is None else sigmas[name] ** 2)
            for name in analysis.manifest.parameters}


def check_simulations(analysis: Analysis) -> None:
    """Reads every simulation's check, as validate_simulations wrote it (validation/*.h5)."""
    from analysis.simulation_validation import read_simulation_check

    run = analysis.run
    analysis.checks = [read_simulation_check(run.simulation_check(r.sim_id))
                       for r in read_params_csv(run.params_csv)]


def draw_figures(analysis: Analysis) -> list:
    """Reads every step's results and the training history; gives the figures drawn
    (analysis.figures), in the report's order."""
    from analysis import figures

    out, manifest, models = analysis.run.analysis_files, analysis.manifest, analysis.models
    best, split, evaluated = analysis.best_baseline, analysis.split, analysis.evaluated
    drawn = [figures.predicted_vs_true(out.figure("predicted_vs_true"), models["network"],
                                       (best, models[best]) if best else None, manifest.target_ranges,
                                       split),
             figures.residual_histograms(out.figure("residuals"), models, split),
             figures.model_comparison(out.figure("model_comparison"), {
                 name: {p: m["per_simulation"]["parameters"][p]["relative_error"]
                        for p in manifest.parameters}
                 for name, m in analysis.metrics.items()})]
    history = analysis.run.training_files.history
    if history.is_file():
        drawn.append(figures.learning_curves(out.figure("learning_curves"), history))
    if evaluated.kept:
        drawn.append(figures.subvolume_slices(
            out.figure("slices"), evaluated.kept,
            [", ".join(f"{p} {v:.3g}" for p, v in zip(manifest.parameters, y))
             for y in evaluated.targets[:len(evaluated.kept)]],
            analysis.voxel, [f"z = {z:g}" for z in manifest.redshifts]))
    if analysis.checks:
        drawn.append(figures.power_spectrum_validation(
            out.figure("power_spectrum_validation"), analysis.checks,
            analysis.section["validation"]["tolerance"]))
    if analysis.posteriors is not None:
        drawn.append(figures.posterior_calibration(out.figure("posterior_calibration"),
                                                   analysis.posteriors["network"]))
        drawn.append(figures.posterior_examples(out.figure("posterior_examples"), {
            name: analysis.simulation_posteriors[name] for name in ("network", "power_spectrum")},
            manifest.parameters))
    fisher = analysis.fisher
    if fisher is not None:
        drawn.append(figures.fisher_convergence(out.figure("fisher_convergence"), fisher["convergence"]))
    if analysis.learning_curve is not None:
        drawn.append(figures.data_learning_curves(
            out.figure("data_learning_curves"), analysis.learning_curve,
            {name: row["variance_over_mean_mse"] for name, row in fisher["against_errors"].items()}
            if fisher else None))
    return drawn


def write_outputs(analysis: Analysis, figures: list, seconds: float) -> dict:
    """Reads every step's results, the figures drawn and the seconds taken; writes
    predictions.csv, metrics.json and report.html and gives metrics.json's content."""
    from analysis import report
    from analysis.metrics import write_metrics_json, write_predictions_csv
    from analysis.simulation_validation import flagged_simulations

    run, manifest, out = analysis.run, analysis.manifest, analysis.run.analysis_files
    checks, names = analysis.checks, manifest.parameters
    flagged, n_validated = flagged_simulations(checks), sum(c.checked for c in checks)
    record = {
        "split": analysis.split, "parameters": list(names), "target_ranges": manifest.target_ranges,
        "models": analysis.metrics,
        "baselines": {name: analysis.fits[name].summary() for name in analysis.section["baselines"]},
        "best_baseline": analysis.best_baseline,
        "summary_statistics": analysis.feature_names,
        "simulation_validation": {"simulations": len(checks), "checked": n_validated, "flagged": flagged},
        "uncertainty": analysis.uncertainty,
        "combination": analysis.combination,
        "posteriors": analysis.posteriors,
        "learning_curve": analysis.learning_curve,
        "fisher": analysis.fisher,
        "choices": _choices(run, {**analysis.fits, **analysis.posterior_fits}, analysis.learning_curve),
        "seconds": round(seconds, 1),
    }
    notes = _notes(analysis.metrics, analysis.best_baseline, names, analysis.uncertainty,
                   analysis.combination)
    write_predictions_csv(out.predictions, analysis.models)
    write_metrics_json(out.metrics, record)
    report.write_report(
        out.report, title=f"CosmoFlow analysis: run {run.root.name}",
        configuration=_recorded_configuration(run), dataset=_dataset(manifest, analysis.sample_box),
        metrics=analysis.metrics, figures=figures, flagged=flagged, n_validated=n_validated,
        fisher=analysis.fisher, uncertainty=analysis.uncertainty, combination=analysis.combination,
        posteriors=analysis.posteriors, best=analysis.best_baseline,
        learning_curve=analysis.learning_curve, choices=record["choices"], notes=notes)
    _log_summary(notes, flagged, n_validated, out)
    return record


# --- evaluation ---------------------------------------------------------------------------------

def _load_network(path: Path, manifest: Manifest, manifest_path: Path, threads: int):
    """The trained network (with the gaussian head, its packed posterior moments: more outputs
    than parameters); PipelineError if it is missing or its input is not the samples'."""
    if not path.is_file():
        raise PipelineError(f"No trained model {path}; run the train stage first (snakemake --until train).")
    import keras

    from training.models import POSTERIOR_LAYER, posterior_network
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
    if any(layer.name == POSTERIOR_LAYER for layer in network.layers):  # training.head: gaussian
        return posterior_network(network)  # the packed posterior moments, not only the means
    return network


@dataclasses.dataclass
class SplitScan:
    """One pass over a split: per sample its targets (physical units), sim_id, the network's
    prediction (physical units; with the gaussian head its posterior mean, and the posterior's
    covariance) and summary statistics when asked, and the first samples' counts."""

    targets: np.ndarray
    sim_ids: np.ndarray
    predictions: np.ndarray | None
    covariances: np.ndarray | None  # (N, P, P), physical units
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
    targets, sim_ids, predictions, covariances, rows, kept, batch = [], [], [], [], [], [], []
    def predict():
        if network is not None and batch:
            outputs = np.asarray(network.predict_on_batch(manifest.normalise_counts(np.stack(batch))),
                                 np.float64)
            if outputs.shape[1] == len(manifest.parameters):
                predictions.append(manifest.unscale_targets(outputs))
            else:
                from training.models import physical_moments, posterior_moments

                means, covariance = physical_moments(*posterior_moments(outputs), *manifest.target_bounds())
                predictions.append(means), covariances.append(covariance)
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
                     np.concatenate(covariances) if covariances else None,
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


def _log_summary(notes: list[str], flagged, n_validated: int, out: AnalysisFiles) -> None:
    for line in notes:
        log.info("analyze: %s", line, extra=PROGRESS)
    log.info("analyze: %d of %d simulations checked against linear theory flagged", len(flagged),
             n_validated, extra=PROGRESS)
    log.info("analyze: wrote %s (open it in a browser), %s, %s", out.report, out.metrics.name,
             out.predictions.name, extra=PROGRESS)
