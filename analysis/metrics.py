"""Errors of parameter predictions, per sample and per simulation, and the predictions table.

For each parameter p, over N predictions (physical units) pred_i of truths true_i:

* ``mae``  = mean |pred - true|;  ``rmse`` = sqrt(mean (pred - true)^2);  ``bias`` = mean (pred - true);
* ``r2``   = 1 - sum (pred - true)^2 / sum (true - mean(true))^2  (coefficient of determination;
  NaN when every truth is equal);
* ``pearson_r``: linear correlation of pred and true (NaN when either is constant);
* ``relative_error`` = mean |pred - true| / |true|: the mean absolute relative error. The
  CosmoFlow paper (Mathuriya et al. 2018, Sec. VII-A) reports "relative errors" of (0.0022,
  0.0094, 0.0096) for (Omega_m, sigma_8, n_s) without stating a formula; this is the reading
  used here and in the report;
* ``mlperf_mae``: mean |scale(pred) - scale(true)| with scale(x) = 2 (x - low) / (high - low) - 1
  over the sampling range (the manifest's target ranges), the MLPerf HPC CosmoFlow quality
  metric; the overall ``mlperf_mae`` is its mean over parameters, i.e. over all targets of all
  samples, to be compared with MLPerf's convergence target ``MLPERF_TARGET_MAE`` = 0.124.

Per simulation (:meth:`Predictions.per_simulation`): the predictions of a simulation's
sub-volumes are averaged, their sample standard deviation (ddof = 1; 0 for a single
sub-volume) is the error bar, and the metrics above are taken over simulations.

``predictions.csv`` (:func:`write_predictions_csv`) holds one row per sample and one per
simulation (column ``level``), for every model (column ``model``: the network and each baseline).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from workflow.errors import PipelineError
from workflow.io import atomic_write_text, read_csv

PAPER_RELATIVE_ERRORS = {"Omega_m": 0.0022, "sigma_8": 0.0094, "n_s": 0.0096}
"""CosmoFlow SC18 relative errors at 2048 nodes (Mathuriya et al. 2018, Sec. VII-A)."""
MLPERF_TARGET_MAE = 0.124
"""MLPerf HPC CosmoFlow convergence target: MAE of the targets scaled to [-1, 1]."""
METRICS = ("mae", "rmse", "bias", "r2", "pearson_r", "relative_error", "mlperf_mae")
DEFINITIONS = {
    "mae": "mean |pred - true|",
    "rmse": "sqrt(mean (pred - true)^2)",
    "bias": "mean (pred - true)",
    "r2": "1 - sum (pred - true)^2 / sum (true - mean true)^2",
    "pearson_r": "Pearson correlation of pred and true",
    "relative_error": "mean |pred - true| / |true| (the paper's relative error as read here)",
    "mlperf_mae": "mean |pred - true| of targets scaled to [-1, 1] over the sampling ranges",
    "subvolume_std": "mean over simulations of the standard deviation of their sub-volumes' "
                     "predictions (ddof = 1)",
}


@dataclasses.dataclass(frozen=True)
class Predictions:
    """One model's predictions on one split: rows are samples (sub-volumes).

    names: parameter names (column order); sim_ids: (N,) simulation of each sample;
    true, pred: (N, P) float64, physical units.
    """

    names: tuple[str, ...]
    sim_ids: np.ndarray
    true: np.ndarray
    pred: np.ndarray

    def __post_init__(self) -> None:
        true = np.asarray(self.true, dtype=np.float64)
        pred = np.asarray(self.pred, dtype=np.float64)
        sim_ids = np.asarray(self.sim_ids).astype(np.int64)
        names = tuple(self.names)
        n = len(sim_ids)
        if n == 0:
            raise PipelineError("Predictions hold no samples; the evaluated split is empty.")
        for label, array in (("true", true), ("pred", pred)):
            if array.shape != (n, len(names)):
                raise PipelineError(
                    f"Predictions {label} has shape {array.shape}; expected ({n}, {len(names)}) "
                    f"for {n} samples of parameters {list(names)}.")
            if not np.all(np.isfinite(array)):
                raise PipelineError(f"Predictions {label} holds values that are not finite.")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sim_ids", sim_ids)
        object.__setattr__(self, "true", true)
        object.__setattr__(self, "pred", pred)

    def per_simulation(self) -> "SimulationPredictions":
        """Mean prediction of each simulation's sub-volumes, with their standard deviation."""
        sims, inverse, counts = np.unique(self.sim_ids, return_inverse=True, return_counts=True)
        n_params = len(self.names)
        true = np.zeros((len(sims), n_params))
        mean = np.zeros((len(sims), n_params))
        np.add.at(true, inverse, self.true)
        np.add.at(mean, inverse, self.pred)
        true /= counts[:, None]
        mean /= counts[:, None]
        spread = np.abs(self.true - true[inverse]).max(axis=0)
        scale = np.maximum(np.abs(true).max(axis=0), 1e-300)
        if np.any(spread > 1e-9 * scale):
            bad = self.names[int(np.argmax(spread / scale))]
            raise PipelineError(
                f"Predictions: the sub-volumes of one simulation have different true {bad} "
                f"(up to {spread.max():.3g} apart); sim_ids and targets do not belong together.")
        squares = np.zeros((len(sims), n_params))
        np.add.at(squares, inverse, (self.pred - mean[inverse]) ** 2)
        std = np.where(counts[:, None] > 1, np.sqrt(squares / np.maximum(counts - 1, 1)[:, None]), 0.0)
        return SimulationPredictions(self.names, sims, true, mean, std, counts)


@dataclasses.dataclass(frozen=True)
class SimulationPredictions:
    """Per-simulation predictions: sim_ids (S,), true and pred (mean over sub-volumes) (S, P),
    pred_std (S, P) standard deviation over the sub-volumes, n_subvolumes (S,)."""

    names: tuple[str, ...]
    sim_ids: np.ndarray
    true: np.ndarray
    pred: np.ndarray
    pred_std: np.ndarray
    n_subvolumes: np.ndarray


def scale_targets(values: np.ndarray, names: Sequence[str],
                  ranges: Mapping[str, Sequence[float]]) -> np.ndarray:
    """Targets (N, P) in physical units scaled to [-1, 1] over each parameter's (low, high)."""
    low, high = _range_arrays(names, ranges)
    return 2.0 * (np.asarray(values, dtype=np.float64) - low) / (high - low) - 1.0


def _range_arrays(names: Sequence[str], ranges: Mapping[str, Sequence[float]]):
    missing = [name for name in names if name not in ranges]
    if missing:
        raise PipelineError(
            f"Target ranges {dict(ranges)} lack parameter(s) {missing}; the manifest's "
            f"target_ranges must cover every predicted parameter.")
    low = np.array([float(ranges[name][0]) for name in names])
    high = np.array([float(ranges[name][1]) for name in names])
    if np.any(high <= low):
        raise PipelineError(f"Target ranges {dict(ranges)} must have low < high for each parameter.")
    return low, high


def parameter_metrics(true: np.ndarray, pred: np.ndarray, low: float | None = None,
                      high: float | None = None) -> dict[str, float]:
    """The metrics of the module docstring for one parameter: true, pred (N,) physical units.

    ``mlperf_mae`` needs the sampling range (low, high); without it, it is NaN.
    """
    true = np.asarray(true, dtype=np.float64)
    pred = np.asarray(pred, dtype=np.float64)
    error = pred - true
    ss_tot = float(np.sum((true - true.mean()) ** 2))
    ss_res = float(np.sum(error**2))
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = float(np.mean(np.abs(error) / np.abs(true)))
    dp, dt = pred - pred.mean(), true - true.mean()
    norm = math.sqrt(float(np.sum(dp**2)) * float(np.sum(dt**2)))
    mlperf = (float(np.mean(np.abs(error))) * 2.0 / (high - low)
              if low is not None and high is not None else math.nan)
    return {
        "mae": float(np.mean(np.abs(error))),
        "rmse": math.sqrt(ss_res / len(true)),
        "bias": float(np.mean(error)),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan,
        "pearson_r": float(np.sum(dp * dt)) / norm if norm > 0 else math.nan,
        "relative_error": relative,
        "mlperf_mae": mlperf,
    }


def _table_metrics(names, true, pred, ranges) -> dict:
    low, high = _range_arrays(names, ranges) if ranges is not None else (None, None)
    parameters = {}
    for p, name in enumerate(names):
        parameters[name] = parameter_metrics(
            true[:, p], pred[:, p],
            None if low is None else low[p], None if high is None else high[p])
    mlperf = (float(np.mean([m["mlperf_mae"] for m in parameters.values()]))
              if ranges is not None else math.nan)
    return {"n": int(len(true)), "parameters": parameters, "mlperf_mae": mlperf}


def evaluate(predictions: Predictions, ranges: Mapping[str, Sequence[float]] | None = None) -> dict:
    """Metrics per sample and per simulation.

    Returns ``{"parameters": [...], "per_sample": {"n", "parameters": {name: {metric: value}},
    "mlperf_mae"}, "per_simulation": {... same, plus "subvolume_std" per parameter},
    "mlperf_target_mae": 0.124}``; ``ranges`` (name -> (low, high)) enables ``mlperf_mae``.
    """
    sims = predictions.per_simulation()
    per_simulation = _table_metrics(predictions.names, sims.true, sims.pred, ranges)
    for p, name in enumerate(predictions.names):
        per_simulation["parameters"][name]["subvolume_std"] = float(np.mean(sims.pred_std[:, p]))
    return {
        "parameters": list(predictions.names),
        "per_sample": _table_metrics(predictions.names, predictions.true, predictions.pred, ranges),
        "per_simulation": per_simulation,
        "mlperf_target_mae": MLPERF_TARGET_MAE,
    }


BOOTSTRAP_INTERVAL = (15.865, 84.135)
"""Percentiles of the bootstrap distributions reported as each error's interval (one standard
deviation either side for a normal distribution)."""


def bootstrap_mse(models: Mapping[str, Predictions], n_resamples: int = 1000, seed: int = 0,
                  normaliser: str | None = "mean", reference: str | None = "network",
                  versus: Sequence[str] | None = None) -> dict:
    """Uncertainty of every model's per-sample mean squared error from the finite test set.

    The evaluated simulations are resampled with replacement ``n_resamples`` times, each with
    all its sub-volumes (sub-volumes of one simulation share its parameters and are not
    independent); every model is scored on the same resamples, so the ratios of two models'
    errors are paired and much tighter than either error alone. Returns::

        {"method", "n_resamples", "n_simulations", "interval": [16th, 84th percentile],
         "models": {model: {parameter: {"mse", "mse_std", "ratio", "ratio_low", "ratio_high"}}},
         "versus": {other: {parameter: {"ratio", "ratio_low", "ratio_high", "p_better"}}}}

    ``ratio``: MSE over the ``normaliser`` model's (the training mean: 1 is no information),
    its interval from the same resamples; ``versus``: the ``reference`` model's MSE over each
    other model's (those in ``versus``, by default all but the reference and the normaliser),
    and ``p_better``, the fraction of resamples in which the reference's MSE is the lower. The
    resamples depend only on ``seed`` and the evaluated simulations, so two calls with the same
    seed on the same samples are paired too. All models must hold the same samples in the same
    order.
    """
    if not models:
        raise PipelineError("Bootstrap: no predictions given.")
    first = next(iter(models.values()))
    for name, predictions in models.items():
        if not (np.array_equal(predictions.sim_ids, first.sim_ids)
                and np.allclose(predictions.true, first.true)):
            raise PipelineError(f"Bootstrap: the predictions of {name!r} are not of the same samples "
                                f"as those of {next(iter(models))!r}.")
    sims, inverse, counts = np.unique(first.sim_ids, return_inverse=True, return_counts=True)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(sims), size=(n_resamples, len(sims)))
    weights = np.stack([np.bincount(row, minlength=len(sims)) for row in draws]).astype(np.float64)
    samples = weights @ counts  # (B,) samples in each resample
    mse, resampled = {}, {}
    for name, predictions in models.items():
        squares = np.zeros((len(sims), len(first.names)))
        np.add.at(squares, inverse, (predictions.pred - predictions.true) ** 2)
        mse[name] = squares.sum(axis=0) / counts.sum()
        resampled[name] = (weights @ squares) / samples[:, None]  # (B, P)
    low, high = BOOTSTRAP_INTERVAL

    def interval(values):
        return np.percentile(values, low, axis=0), np.percentile(values, high, axis=0)

    record = {"method": "bootstrap over the evaluated simulations, each with all its sub-volumes",
              "n_resamples": int(n_resamples), "n_simulations": int(len(sims)),
              "interval": [low, high], "models": {}, "versus": {}}
    norm = normaliser if normaliser in models else None
    for name in models:
        entry = {}
        ratio = resampled[name] / resampled[norm] if norm else None
        lo, hi = interval(ratio) if norm else (None, None)
        for p, parameter in enumerate(first.names):
            entry[parameter] = {"mse": float(mse[name][p]),
                                "mse_std": float(np.std(resampled[name][:, p], ddof=1))}
            if norm:
                entry[parameter].update(ratio=float(mse[name][p] / mse[norm][p]),
                                        ratio_low=float(lo[p]), ratio_high=float(hi[p]))
        record["models"][name] = entry
    if reference in models:
        for name in (versus if versus is not None else models):
            if name in (reference, normaliser):
                continue
            ratio = resampled[reference] / resampled[name]
            lo, hi = interval(ratio)
            record["versus"][name] = {parameter: {
                "ratio": float(mse[reference][p] / mse[name][p]), "ratio_low": float(lo[p]),
                "ratio_high": float(hi[p]), "p_better": float(np.mean(ratio[:, p] < 1.0))}
                for p, parameter in enumerate(first.names)}
    return record


def learning_curve_trend(train_simulations: Sequence[int], network_mse: Sequence[float],
                         baseline_mse: Sequence[float]) -> dict:
    """Where two learning curves are heading: a power law MSE = A N^b fitted to each (least
    squares in log MSE against log N over the points given) and, if the network is behind at
    the largest N but its MSE falls faster, the N at which the two fits cross.

    A few-point extrapolation, no more: it assumes both curves keep their measured slopes (they
    flatten eventually, towards the information the input holds). Returns ``{"network_slope",
    "baseline_slope", "network_ahead": bool (at the largest N), "crossover_simulations": float
    or None}``.
    """
    n = np.log(np.asarray(train_simulations, dtype=np.float64))
    if len(n) < 2 or len(np.unique(n)) < 2:
        raise PipelineError(f"Learning-curve trend: needs two or more training-set sizes, got "
                            f"{list(train_simulations)}.")
    (slope_net, log_net), (slope_base, log_base) = (
        np.polyfit(n, np.log(np.asarray(mse, dtype=np.float64)), 1) for mse in (network_mse, baseline_mse))
    largest = int(np.argmax(n))
    ahead = bool(network_mse[largest] < baseline_mse[largest])
    crossover = None
    if not ahead and slope_net < slope_base:
        crossover = float(np.exp((log_base - log_net) / (slope_net - slope_base)))
    return {"network_slope": float(slope_net), "baseline_slope": float(slope_base),
            "network_ahead": ahead, "crossover_simulations": crossover}


def saturating_fit(train_simulations: Sequence[int], mse: Sequence[float]) -> dict | None:
    """MSE = L_min + c N^-alpha fitted to a learning curve (Bairagi, Wandelt & Villaescusa-Navarro
    2025 find alpha ~ 0.39 for CNNs on dark-matter fields): L_min the error that more simulations
    cannot remove, alpha how fast the rest falls. Least squares in log MSE (scipy's curve_fit)
    with L_min >= 0, c > 0 and 0 < alpha <= 3; three parameters need three or more sizes (None
    with fewer, or when the fit does not converge). Returns ``{"L_min", "c", "alpha"}``."""
    import warnings

    from scipy.optimize import OptimizeWarning, curve_fit

    n, y = np.asarray(train_simulations, np.float64), np.asarray(mse, np.float64)
    if len(np.unique(n)) < 3 or not np.all(y > 0):
        return None

    def log_model(size, floor, log_c, alpha):
        return np.log(floor + np.exp(log_c) * size ** -alpha)

    start = (0.5 * y.min(), np.log(max(y.max() - 0.5 * y.min(), 1e-300)) + 0.4 * np.log(n.min()), 0.4)
    with warnings.catch_warnings():  # three sizes fit exactly: no covariance, a warning
        warnings.simplefilter("ignore", OptimizeWarning)
        try:
            (floor, log_c, alpha), _ = curve_fit(log_model, n, np.log(y), p0=start, maxfev=20000,
                                                 bounds=([0.0, -np.inf, 1e-3], [y.max(), np.inf, 3.0]))
        except (RuntimeError, ValueError):
            return None
    return {"L_min": float(floor), "c": float(np.exp(log_c)), "alpha": float(alpha)}


def bound_crossing(fit: Mapping | None, variance: float | None) -> float | None:
    """The number of training simulations at which a :func:`saturating_fit` reaches an error
    bound (e.g. the Fisher variance of the two-point function for one sample): N with
    L_min + c N^-alpha = variance, or None when the fit levels off above the bound (or there is
    no fit or no bound)."""
    if fit is None or variance is None or variance <= fit["L_min"]:
        return None
    return float((fit["c"] / (variance - fit["L_min"])) ** (1.0 / fit["alpha"]))


# --------------------------------------------------------------------------------------------
# Files


def _jsonable(value):
    """NaN and infinities become null (strict JSON); numpy scalars become Python numbers."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def write_metrics_json(path: str | os.PathLike, metrics: Mapping) -> Path:
    """Write ``metrics`` (e.g. {model: evaluate(...)} plus context) as strict JSON, atomically."""
    atomic_write_text(path, json.dumps(_jsonable(metrics), indent=1, allow_nan=False) + "\n")
    return Path(path)


PREDICTION_COLUMNS = ("model", "level", "sim_id", "sample", "n_subvolumes")


def write_predictions_csv(path: str | os.PathLike, models: Mapping[str, Predictions]) -> Path:
    """Write ``predictions.csv`` atomically: per model, one row per sample then one per simulation.

    Columns: model, level ('sample' | 'simulation'), sim_id, sample (row index in the
    evaluated split; empty for simulations), n_subvolumes, then true_<p>, pred_<p>, std_<p>
    (std: the standard deviation over the simulation's sub-volumes; empty for samples), for
    each parameter p, physical units. Floats are written with repr() so they read back exactly.
    """
    if not models:
        raise PipelineError(f"No predictions to write to {path}.")
    names = next(iter(models.values())).names
    for model, predictions in models.items():
        if predictions.names != names:
            raise PipelineError(
                f"Predictions of model {model!r} are for {list(predictions.names)}; the others "
                f"are for {list(names)}.")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*PREDICTION_COLUMNS,
                     *(f"{kind}_{name}" for name in names for kind in ("true", "pred", "std"))])
    for model, predictions in models.items():
        for index in range(len(predictions.sim_ids)):
            values = []
            for p in range(len(names)):
                values += [repr(float(predictions.true[index, p])),
                           repr(float(predictions.pred[index, p])), ""]
            writer.writerow([model, "sample", int(predictions.sim_ids[index]), index, 1, *values])
        sims = predictions.per_simulation()
        for index, sim_id in enumerate(sims.sim_ids):
            values = []
            for p in range(len(names)):
                values += [repr(float(sims.true[index, p])), repr(float(sims.pred[index, p])),
                           repr(float(sims.pred_std[index, p]))]
            writer.writerow([model, "simulation", int(sim_id), "", int(sims.n_subvolumes[index]),
                             *values])
    atomic_write_text(path, buffer.getvalue())
    return Path(path)


def read_predictions_csv(path: str | os.PathLike) -> dict[str, Predictions]:
    """The per-sample predictions of each model in a :func:`write_predictions_csv` file."""
    path = Path(path)
    header, rows = read_csv(path, f"Predictions table {path} does not exist.")
    if tuple(header[:len(PREDICTION_COLUMNS)]) != PREDICTION_COLUMNS:
        raise PipelineError(
            f"Predictions table {path} has columns {header[:5]}; expected {list(PREDICTION_COLUMNS)} "
            f"first.")
    names = tuple(column[len("true_"):] for column in header if column.startswith("true_"))
    grouped: dict[str, list] = {}
    for line, row in enumerate(rows, start=2):
        if row["level"] != "sample":
            continue
        try:
            grouped.setdefault(row["model"], []).append(
                (int(row["sim_id"]), [float(row[f"true_{n}"]) for n in names],
                 [float(row[f"pred_{n}"]) for n in names]))
        except (KeyError, TypeError, ValueError) as error:
            raise PipelineError(f"Predictions table {path}, line {line}, is malformed: {error}.") from None
    if not grouped:
        raise PipelineError(f"Predictions table {path} holds no sample rows.")
    return {model: Predictions(names, np.array([r[0] for r in entries]),
                               np.array([r[1] for r in entries]), np.array([r[2] for r in entries]))
            for model, entries in grouped.items()}
