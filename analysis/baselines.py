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

Posterior baselines (:func:`fit_posterior`, for a network with the gaussian head): Gaussian
posteriors of the same family as the network's, from a small dense network on the summary
statistics trained on the same Gaussian negative log-likelihood, so that the posteriors are
compared through the same calibration (analysis.posteriors):

* ``power_spectrum``: the log10 P(k) bins alone, the plain two-point analysis;
* ``power_spectrum_one_point``: P(k) and the one-point statistics of log(1 + counts), the
  features of ``ridge``.

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
Everything is deterministic given ``seed`` (the point baselines use no early stopping and no
random sub-sampling; the posterior baselines stop early on the validation split, with seeded
initialisation and shuffling and TensorFlow's deterministic ops).
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

POSTERIOR_BASELINES = {  # name -> (description, the summary statistics it reads: name markers)
    "power_spectrum": ("Gaussian posterior from P(k) alone (the two-point analysis)", ("_log10P_",)),
    "power_spectrum_one_point": ("Gaussian posterior from P(k) and the one-point statistics",
                                 ("_log10P_", "_log1p_")),
}
POSTERIOR_HIDDEN = (64, 64)  # units of the dense layers of a posterior baseline
POSTERIOR_TRAINING = {"learning_rate": 3e-3, "batch_size": 128, "max_epochs": 2000, "patience": 100,
                      "leak": 0.01}


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


@dataclasses.dataclass(frozen=True)
class PosteriorFit:
    """A fitted posterior baseline.

    name: a key of ``POSTERIOR_BASELINES``; columns: the summary statistics it reads (indices
    into :func:`analysis.power_spectrum.summary_statistics`' features); hyperparameters: its
    network and training, with the epochs run and the best one; validation_nll: the mean
    Gaussian negative log-likelihood of the validation split at the best epoch (nats, targets
    scaled to [-1, 1]); predict(features (N, F), all the summary statistics) -> posterior means
    (N, P) and covariances (N, P, P), physical units.
    """

    name: str
    description: str
    names: tuple[str, ...]
    columns: tuple[int, ...]
    hyperparameters: dict
    validation_nll: float
    predict: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]

    def summary(self) -> dict:
        """JSON-ready description: name, description, features read, settings, validation NLL."""
        return {"name": self.name, "description": self.description, "n_features": len(self.columns),
                "hyperparameters": self.hyperparameters, "validation_nll": self.validation_nll}


def posterior_columns(name: str, feature_names: Sequence[str]) -> list[int]:
    """The columns of the summary statistics (named by
    :func:`analysis.power_spectrum.summary_names`) that posterior baseline ``name`` reads."""
    if name not in POSTERIOR_BASELINES:
        raise PipelineError(f"Unknown posterior baseline {name!r}; known: {list(POSTERIOR_BASELINES)}.")
    markers = POSTERIOR_BASELINES[name][1]
    columns = [i for i, feature in enumerate(feature_names) if any(m in feature for m in markers)]
    if not columns:
        raise PipelineError(f"Posterior baseline {name!r}: no summary statistic named with "
                            f"{list(markers)} among {list(feature_names)}.")
    return columns


def fit_posterior(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
                  names: Sequence[str], low, high, columns: Sequence[int] | None = None,
                  seed: int = 0, name: str = "posterior", description: str = "",
                  settings: Mapping = POSTERIOR_TRAINING) -> PosteriorFit:
    """A Gaussian posterior of the parameters given summary statistics: a dense network
    (``POSTERIOR_HIDDEN`` units, leaky ReLU) ending in the gaussian head of the CosmoFlow
    network (:class:`training.layers.GaussianPosterior`, linear means), trained on its negative
    log-likelihood (:class:`training.layers.GaussianNLL`) with Adam.

    The features ``columns`` of x_* (N, F) are standardised on the training split; the targets
    y_* (N, P, physical units) are scaled to [-1, 1] over the sampling ranges [low, high] as the
    network's are (``Manifest.scale_targets``), and the moments are returned in physical units
    (:func:`training.models.physical_moments`). Training stops when the validation NLL has not
    improved for ``patience`` epochs and keeps the best epoch's weights; initialisation and
    shuffling are seeded and TensorFlow's ops deterministic, so a fit is repeatable.
    """
    import keras
    import tensorflow as tf

    from training.layers import GaussianNLL, GaussianPosterior, LeakyReLU
    from training.models import physical_moments, posterior_moments

    x_train, y_train = _check_split("training", x_train, y_train)
    x_val, y_val = _check_split("validation", x_val, y_val, y_train.shape[1])
    columns = list(range(x_train.shape[1])) if columns is None else list(columns)
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    scaler = StandardScaler().fit(x_train[:, columns])

    def inputs(features: np.ndarray) -> np.ndarray:
        return scaler.transform(np.asarray(features, np.float64)[:, columns]).astype(np.float32)

    def scaled(y: np.ndarray) -> np.ndarray:
        return (2.0 * (y - low) / (high - low) - 1.0).astype(np.float32)

    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(seed)
    count = len(names)
    x = features = keras.Input(shape=(len(columns),), name="summary_statistics")
    for index, units in enumerate(POSTERIOR_HIDDEN, 1):
        x = keras.layers.Dense(units, name=f"dense{index}")(x)
        x = LeakyReLU(settings["leak"], name=f"dense{index}_act")(x)
    x = keras.layers.Dense(count + count * (count + 1) // 2, name="posterior_dense")(x)
    model = keras.Model(features, GaussianPosterior(count, name="posterior")(x), name=name)
    model.compile(optimizer=keras.optimizers.Adam(settings["learning_rate"]), loss=GaussianNLL())
    history = _train_early_stopping(model, (inputs(x_train), scaled(y_train)),
                                    (inputs(x_val), scaled(y_val)), settings, np.random.default_rng(seed))
    best = int(np.argmin(history))
    log.info("posterior baseline %s: %d epochs, best %d, validation NLL %.4g", name, len(history),
             best + 1, history[best])

    def predict(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        packed = np.asarray(model.predict_on_batch(inputs(features)), np.float64)
        return physical_moments(*posterior_moments(packed), low, high)

    return PosteriorFit(
        name, description, tuple(names), tuple(columns),
        {"hidden_units": list(POSTERIOR_HIDDEN), **dict(settings), "epochs_run": len(history),
         "best_epoch": best + 1},
        float(history[best]), predict)


def _train_early_stopping(model, train, validation, settings: Mapping, rng: np.random.Generator) -> list:
    """Mini-batch epochs over ``train`` (x, y), shuffled by ``rng``, until the loss on
    ``validation`` has not improved for ``patience`` epochs; leaves ``model`` with the weights
    of its best epoch and returns the validation loss per epoch. One compiled step per batch
    (Keras's train_on_batch): on a few hundred samples ``Model.fit``'s per-epoch set-up would
    cost more than the epoch."""
    (x, y), batch = train, settings["batch_size"]
    history, best = [], None
    for _ in range(settings["max_epochs"]):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch):
            model.train_on_batch(x[order[start:start + batch]], y[order[start:start + batch]])
        history.append(float(model.test_on_batch(*validation)))
        if best is None or history[-1] < history[best]:
            best, weights = len(history) - 1, model.get_weights()
        elif len(history) - 1 - best >= settings["patience"]:
            break
    model.set_weights(weights)
    return history


def fit_posterior_baselines(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray,
                            y_val: np.ndarray, names: Sequence[str], feature_names: Sequence[str],
                            low, high, seed: int = 0) -> dict[str, PosteriorFit]:
    """Every posterior baseline (``POSTERIOR_BASELINES``, in that order), fitted on the training
    split with early stopping on the validation split (:func:`fit_posterior`); x_*: (N, F) all
    the summary statistics, named ``feature_names``."""
    return {name: fit_posterior(x_train, y_train, x_val, y_val, names, low, high,
                                posterior_columns(name, feature_names), seed, name, description)
            for name, (description, _) in POSTERIOR_BASELINES.items()}


def best_baseline(fits: Mapping[str, BaselineFit], exclude: Sequence[str] = ("mean",)) -> str:
    """Name of the fit with the lowest validation score, ignoring ``exclude``."""
    eligible = {name: fit for name, fit in fits.items() if name not in exclude}
    if not eligible:
        raise PipelineError(f"No baseline to choose from among {list(fits)} excluding {list(exclude)}.")
    return min(eligible, key=lambda name: eligible[name].validation_score)
