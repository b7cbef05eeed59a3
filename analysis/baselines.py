"""Baselines for the network: fitted on the training split, chosen on the validation split.

* ``mean``: predict the training split's mean of every parameter (the floor any estimator must
  beat; its mean squared error is each parameter's variance about that mean);
* ``ridge``: ridge regression of the parameters on standardised summary statistics
  (:func:`analysis.power_spectrum.summary_statistics`), one penalty alpha per parameter chosen
  on the validation split from ``RIDGE_ALPHAS``;
* ``gradient_boosting``: scikit-learn's histogram gradient-boosted trees (Ke et al. 2017,
  LightGBM's algorithm), one model per parameter, its learning rate, number of trees and
  leaves per tree chosen on the validation split from ``BOOSTING_GRID``: a non-linear map
  from the same features.

``fit_combination`` is not a baseline but a test of the network against one: the network's and
the best baseline's predictions averaged with a weight per parameter chosen on the validation
split. Two estimators that read the same information make the same errors, which averaging does
not cancel; so a combination that beats the baseline on the test split, beyond the test set's
uncertainty, shows that the network reads information the summary statistics miss, even where
the network alone does not beat the baseline.

Selection criterion: the validation mean squared error of each parameter, divided by the
parameter's training variance (so parameters of different ranges weigh alike in
``validation_score``, their mean). The chosen model is the one fitted on the training split
(it is not refitted on train + validation), so validation and test errors stay honest.
Everything is deterministic given ``seed`` (no early stopping, no random sub-sampling).
scikit-learn is used rather than our own solvers: its ridge and boosting are well tested and
fast on the few hundred to 10^5 samples of a CosmoFlow data set.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Mapping, Sequence

import numpy as np
import threadpoolctl
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from training.validation import mean_predictor_mse
from workflow.errors import PipelineError

log = logging.getLogger(__name__)

BASELINES = ("mean", "ridge", "gradient_boosting")  # every baseline, in the order fitted and reported
RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-6, 6, 25))
BOOSTING_GRID = {
    "learning_rate": (0.03, 0.1),
    "max_iter": (100, 300),
    "max_leaf_nodes": (7, 15, 31),
}


@dataclasses.dataclass(frozen=True)
class BaselineFit:
    """A fitted baseline.

    name: one of the config's ``analysis.baselines``; description: one line for the report;
    hyperparameters: the chosen values per parameter; validation_mse: per parameter (physical
    units squared);
    validation_score: mean over parameters of validation MSE / training variance;
    predict(features (N, F)) -> (N, P) predictions in physical units.
    """

    name: str
    description: str
    names: tuple[str, ...]
    hyperparameters: dict
    validation_mse: dict
    validation_score: float
    predict: Callable[[np.ndarray], np.ndarray]

    def summary(self) -> dict:
        """JSON-ready description: name, description, hyperparameters, validation errors."""
        return {"name": self.name, "description": self.description,
                "hyperparameters": self.hyperparameters,
                "validation_mse": self.validation_mse, "validation_score": self.validation_score}


def _check_split(label: str, features: np.ndarray | None, targets: np.ndarray,
                 n_targets: int | None = None) -> tuple[np.ndarray | None, np.ndarray]:
    targets = np.asarray(targets, dtype=np.float64)
    if targets.ndim != 2 or len(targets) == 0:
        raise PipelineError(
            f"Baselines: the {label} targets have shape {targets.shape}; expected a non-empty "
            f"(n_samples, n_parameters) table.")
    if n_targets is not None and targets.shape[1] != n_targets:
        raise PipelineError(
            f"Baselines: the {label} targets have {targets.shape[1]} parameters; the training "
            f"split has {n_targets}.")
    if not np.all(np.isfinite(targets)):
        raise PipelineError(f"Baselines: the {label} targets hold values that are not finite.")
    if features is None:
        return None, targets
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) != len(targets):
        raise PipelineError(
            f"Baselines: the {label} features have shape {features.shape}; expected "
            f"({len(targets)}, n_features), one row per target row.")
    bad = ~np.all(np.isfinite(features), axis=0)
    if bad.any():
        raise PipelineError(
            f"Baselines: the {label} features hold values that are not finite in column(s) "
            f"{np.flatnonzero(bad).tolist()}.")
    return features, targets


def _mse(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    return np.mean((pred - true) ** 2, axis=0)


def _score(mse: np.ndarray, y_train: np.ndarray) -> float:
    variance = np.var(y_train, axis=0)
    return float(np.mean(mse / np.where(variance > 0, variance, 1.0)))


def fit_mean(y_train: np.ndarray, y_val: np.ndarray, names: Sequence[str]) -> BaselineFit:
    """Predict-the-training-mean: every prediction is the training split's mean target."""
    _, y_train = _check_split("training", None, y_train)
    _, y_val = _check_split("validation", None, y_val, y_train.shape[1])
    mean = y_train.mean(axis=0)

    def predict(features: np.ndarray) -> np.ndarray:
        return np.tile(mean, (len(features), 1))

    mse = mean_predictor_mse(len(y_val), y_val.sum(axis=0), (y_val**2).sum(axis=0), mean)
    return BaselineFit(
        "mean", "the training split's mean of each parameter", tuple(names),
        {"training_mean": dict(zip(names, mean.tolist()))},
        dict(zip(names, mse.tolist())), _score(mse, y_train), predict)


def fit_ridge(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
              names: Sequence[str], alphas: Sequence[float] = RIDGE_ALPHAS) -> BaselineFit:
    """Ridge regression on standardised features, one alpha per parameter chosen on validation."""
    x_train, y_train = _check_split("training", x_train, y_train)
    x_val, y_val = _check_split("validation", x_val, y_val, y_train.shape[1])
    scaler = StandardScaler().fit(x_train)
    z_train, z_val = scaler.transform(x_train), scaler.transform(x_val)
    errors = np.array([
        _mse(Ridge(alpha=a).fit(z_train, y_train).predict(z_val).reshape(y_val.shape), y_val)
        for a in alphas])  # (n_alphas, P)
    best = np.argmin(errors, axis=0)
    chosen = np.array([alphas[b] for b in best])
    model = make_pipeline(StandardScaler(), Ridge(alpha=chosen)).fit(x_train, y_train)
    mse = errors[best, np.arange(len(best))]
    for name, alpha in zip(names, chosen):
        # on standardised features the penalty competes with X^T X ~ n_samples: the grid's top
        # may be too weak a limit, its bottom is least squares already
        if alpha == max(alphas):
            log.warning("ridge baseline: alpha for %s is the largest of the grid (%g): a larger "
                        "one might validate better, the fit is close to the training mean", name, alpha)
        elif alpha == min(alphas):
            log.info("ridge baseline: alpha for %s is the smallest of the grid (%g): practically "
                     "unpenalised least squares", name, alpha)

    def predict(features: np.ndarray) -> np.ndarray:
        features = np.asarray(features, dtype=np.float64)
        return model.predict(features).reshape(len(features), len(names))

    return BaselineFit(
        "ridge", "ridge regression on standardised summary statistics", tuple(names),
        {"alpha": dict(zip(names, chosen.tolist()))},
        dict(zip(names, mse.tolist())), _score(mse, y_train), predict)


def fit_gradient_boosting(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray,
                          y_val: np.ndarray, names: Sequence[str], seed: int = 0,
                          grid: Mapping[str, Sequence] = BOOSTING_GRID,
                          threads: int = 1) -> BaselineFit:
    """Histogram gradient boosting per parameter, hyperparameters chosen on validation.

    threads: OpenMP threads of scikit-learn's boosting. One by default: its threads spin while
    they wait, and on a shared or oversubscribed node two threads ran a 600-sample fit 10-40x
    slower than one (0.35 s against 3-15 s on 2 busy cores).
    """
    x_train, y_train = _check_split("training", x_train, y_train)
    x_val, y_val = _check_split("validation", x_val, y_val, y_train.shape[1])
    keys = sorted(grid)
    candidates = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
    with threadpoolctl.threadpool_limits(limits=threads, user_api="openmp"):
        models, chosen, mse = _boosting_search(x_train, y_train, x_val, y_val, names, seed,
                                               candidates)

    def predict(features: np.ndarray) -> np.ndarray:
        features = np.asarray(features, dtype=np.float64)
        with threadpoolctl.threadpool_limits(limits=threads, user_api="openmp"):
            return np.stack([model.predict(features) for model in models], axis=1)

    mse = np.array(mse)
    return BaselineFit(
        "gradient_boosting", "gradient-boosted trees on summary statistics", tuple(names),
        chosen, dict(zip(names, mse.tolist())), _score(mse, y_train), predict)


def _boosting_search(x_train, y_train, x_val, y_val, names, seed, candidates):
    """Per parameter, the candidate settings with the lowest validation MSE and its model."""
    models, chosen, mse = [], {}, []
    for p, name in enumerate(names):
        best = None
        for settings in candidates:
            model = HistGradientBoostingRegressor(
                early_stopping=False, random_state=seed, **settings).fit(x_train, y_train[:, p])
            error = float(np.mean((model.predict(x_val) - y_val[:, p]) ** 2))
            if best is None or error < best[0]:
                best = (error, settings, model)
        mse.append(best[0])
        chosen[name] = best[1]
        models.append(best[2])
    return models, chosen, mse


def fit_combination(network_val: np.ndarray, baseline_val: np.ndarray, y_val: np.ndarray,
                    y_train: np.ndarray, names: Sequence[str], baseline: str) -> BaselineFit:
    """w * network + (1 - w) * baseline, one weight w in [0, 1] per parameter chosen on the
    validation split: the least-squares weight w = sum (n - b)(y - b) / sum (n - b)^2, clipped
    (a convex average of two estimators rather than a free linear stack: one number per
    parameter, which the few hundred validation samples pin down, and no extrapolation).

    *_val: (N, P) validation predictions of the network and of ``baseline`` and the targets, in
    physical units. ``predict`` takes ``np.hstack([network, baseline])`` (N, 2P). Since w = 0
    and w = 1 are allowed, the validation MSE is at most either model's.
    """
    network_val, y_val = _check_split("validation (network)", network_val, y_val)
    baseline_val, _ = _check_split("validation (baseline)", baseline_val, y_val, y_val.shape[1])
    if network_val.shape != y_val.shape or baseline_val.shape != y_val.shape:
        raise PipelineError(f"Combination: predictions of shape {network_val.shape} and "
                            f"{baseline_val.shape} for targets of shape {y_val.shape}.")
    step, residual = network_val - baseline_val, y_val - baseline_val
    spread = np.sum(step**2, axis=0)
    weights = np.clip(np.sum(step * residual, axis=0) / np.where(spread > 0, spread, 1.0), 0.0, 1.0)
    count = len(names)

    def predict(features: np.ndarray) -> np.ndarray:
        features = np.asarray(features, dtype=np.float64)
        return weights * features[:, :count] + (1.0 - weights) * features[:, count:]

    mse = _mse(predict(np.hstack([network_val, baseline_val])), y_val)
    return BaselineFit(
        f"network+{baseline}", f"the network and {baseline} averaged, the network's weight per "
        f"parameter chosen on the validation split", tuple(names),
        {"network_weight": dict(zip(names, weights.tolist()))},
        dict(zip(names, mse.tolist())), _score(mse, y_train), predict)


def fit_baselines(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray,
                  y_val: np.ndarray, names: Sequence[str], seed: int = 0, threads: int = 1,
                  which: Sequence[str] = BASELINES,
                  ) -> dict[str, BaselineFit]:
    """The baselines ``which`` (in that order), fitted on the training and chosen on the
    validation split.

    x_*: (N, F) summary statistics; y_*: (N, P) targets in physical units, columns ``names``;
    threads: OpenMP threads of the boosting (:func:`fit_gradient_boosting`).
    """
    names = tuple(names)
    if np.asarray(y_train).ndim == 2 and np.asarray(y_train).shape[1] != len(names):
        raise PipelineError(
            f"Baselines: {np.asarray(y_train).shape[1]} target columns for parameters {list(names)}.")
    fitters = {
        "mean": lambda: fit_mean(y_train, y_val, names),
        "ridge": lambda: fit_ridge(x_train, y_train, x_val, y_val, names),
        "gradient_boosting": lambda: fit_gradient_boosting(x_train, y_train, x_val, y_val, names,
                                                           seed, threads=threads),
    }
    unknown = [name for name in which if name not in fitters]
    if unknown:
        raise PipelineError(f"Unknown baseline(s) {unknown}; known: {list(fitters)}.")
    fits = {name: fitters[name]() for name in which}
    for fit in fits.values():
        log.info("baseline %s: validation score %.4g (MSE / training variance)", fit.name,
                 fit.validation_score)
    return fits


def best_baseline(fits: Mapping[str, BaselineFit], exclude: Sequence[str] = ("mean",)) -> str:
    """Name of the fit with the lowest validation score, ignoring ``exclude``."""
    eligible = {name: fit for name, fit in fits.items() if name not in exclude}
    if not eligible:
        raise PipelineError(f"No baseline to choose from among {list(fits)} excluding {list(exclude)}.")
    return min(eligible, key=lambda name: eligible[name].validation_score)
