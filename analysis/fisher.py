"""Fisher forecast from the ``fiducial_derivatives`` design: the information bound of a summary.

The design (:mod:`simulations.sampling`) repeats a fiducial point theta_0 and, for each
parameter i, the points theta_0 -/+ step_i e_i; all points of one repetition share one seed, so
the differences between them are free of cosmic variance. From a summary vector s (e.g.
:func:`analysis.power_spectrum.summary_statistics`) of every row (a simulation or one of its
sub-volumes) the Gaussian-likelihood Fisher matrix (Tegmark, Taylor & Heavens 1997, eq. 15,
with a parameter-independent covariance) is

    F_ij = (d mu / d theta_i)^T  Psi  (d mu / d theta_j),

with
* d mu / d theta_i = mean over repetitions r of [s(theta_0 + step_i e_i; r) - s(theta_0 -
  step_i e_i; r)] / (2 step_i)  (central differences of paired runs);
* Psi = (n - p - 2) / (n - 1) C^-1, the Hartlap, Simon & Schneider (2007, A&A 464, 399, eq. 17)
  unbiased estimate of the precision matrix from the sample covariance C of the n fiducial rows
  of p-dimensional summaries (n > p + 2);

marginal errors sigma_i = sqrt((F^-1)_ii) and conditional errors 1 / sqrt(F_ii), for one row's
summary (N independent rows: divide by sqrt(N)). Sub-volumes of one simulation are not quite
independent; the covariance of their summaries then slightly underestimates that of whole boxes.

Noise in the estimated derivatives adds a positive-definite term to F and so biases the
errors low (e.g. Coulton & Wandelt 2023); :func:`fisher_convergence` recomputes the errors from
nested subsets of the repetitions (derivatives) and of the fiducial rows (covariance), and calls
the forecast converged when the last doubling-like step (from ``fractions[-2]`` to all) changes
no marginal error by more than the tolerance.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from workflow.errors import PipelineError

DEFAULT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
DEFAULT_TOLERANCE = 0.1
_RELATIVE_TOLERANCE = 1e-9  # parameter values equal to the fiducial one up to float rounding


@dataclasses.dataclass(frozen=True)
class DerivativeDesign:
    """Rows of a fiducial_derivatives ensemble, classified.

    names: parameter names; fiducial: (d,) point; steps: (d,) derivative steps (half the
    distance between the - and + points); repetitions: (R,) seeds in order of first
    appearance; fiducial_rows: row indices at the fiducial point; minus_rows / plus_rows: per
    parameter, a list over repetitions of the row indices of that repetition's -/+ point.
    """

    names: tuple[str, ...]
    fiducial: np.ndarray
    steps: np.ndarray
    repetitions: np.ndarray
    fiducial_rows: np.ndarray
    minus_rows: tuple[tuple[np.ndarray, ...], ...]
    plus_rows: tuple[tuple[np.ndarray, ...], ...]


def derivative_design(parameters: np.ndarray, names: Sequence[str],
                      seeds: np.ndarray) -> DerivativeDesign:
    """Classify rows (parameters (n, d), seeds (n,)) of a fiducial_derivatives ensemble.

    The fiducial value of each parameter is its median over the rows (2 of every 1 + 2d points
    differ from it). Every row must be the fiducial point or differ from it in one parameter,
    and every repetition (seed) must hold both -/+ points of every parameter.
    """
    values = np.asarray(parameters, dtype=np.float64)
    seeds = np.asarray(seeds)
    names = tuple(names)
    if values.ndim != 2 or values.shape[1] != len(names) or len(seeds) != len(values) or not len(values):
        raise PipelineError(
            f"Fisher design: parameters of shape {values.shape} and {len(seeds)} seeds do not "
            f"form a table of {len(names)} parameters {list(names)} with one seed per row.")
    fiducial = np.median(values, axis=0)
    offset = values - fiducial
    moved = np.abs(offset) > _RELATIVE_TOLERANCE * np.maximum(np.abs(fiducial), 1.0)
    several = np.flatnonzero(moved.sum(axis=1) > 1)
    if len(several):
        raise PipelineError(
            f"Fisher design: row {several[0]} ({dict(zip(names, values[several[0]].tolist()))}) "
            f"differs from the fiducial point {dict(zip(names, fiducial.tolist()))} in more than "
            f"one parameter; the sampling design is not fiducial_derivatives.")
    repetitions = np.array(list(dict.fromkeys(seeds.tolist())))
    fiducial_rows = np.flatnonzero(~moved.any(axis=1))
    steps = np.zeros(len(names))
    minus_rows, plus_rows = [], []
    for i, name in enumerate(names):
        minus_of, plus_of = [], []
        for sign, target in ((-1, minus_of), (1, plus_of)):
            rows = moved[:, i] & (np.sign(offset[:, i]) == sign)
            for seed in repetitions:
                selected = np.flatnonzero(rows & (seeds == seed))
                if not len(selected):
                    raise PipelineError(
                        f"Fisher design: repetition with seed {seed} has no "
                        f"{'-' if sign < 0 else '+'}{name} point; every repetition needs the "
                        f"fiducial point and both steps of every parameter.")
                target.append(selected)
        all_minus = np.concatenate(minus_of)
        all_plus = np.concatenate(plus_of)
        steps[i] = 0.5 * (np.mean(values[all_plus, i]) - np.mean(values[all_minus, i]))
        minus_rows.append(tuple(minus_of))
        plus_rows.append(tuple(plus_of))
    missing = [seed for seed in repetitions if not np.any(seeds[fiducial_rows] == seed)]
    if len(fiducial_rows) == 0 or missing:
        raise PipelineError(
            f"Fisher design: repetition(s) with seed {missing[:3] or list(repetitions[:1])} have "
            f"no fiducial point {dict(zip(names, fiducial.tolist()))}.")
    return DerivativeDesign(names, fiducial, steps, repetitions, fiducial_rows,
                            tuple(minus_rows), tuple(plus_rows))


@dataclasses.dataclass(frozen=True)
class FisherForecast:
    """Fisher matrix and errors for one row's summary.

    derivatives (d, p): d mu / d theta; covariance (p, p): sample covariance at the fiducial
    point; precision (p, p): Hartlap-corrected inverse; hartlap_factor; fisher (d, d);
    marginal_errors, conditional_errors (d,) in the parameters' units; n_covariance rows and
    n_repetitions used for the derivatives.
    """

    names: tuple[str, ...]
    derivatives: np.ndarray
    covariance: np.ndarray
    precision: np.ndarray
    hartlap_factor: float
    fisher: np.ndarray
    marginal_errors: np.ndarray
    conditional_errors: np.ndarray
    n_covariance: int
    n_repetitions: int

    def summary(self) -> dict:
        """JSON-ready: errors per parameter, sample counts, the Fisher matrix."""
        return {
            "marginal_errors": dict(zip(self.names, self.marginal_errors.tolist())),
            "conditional_errors": dict(zip(self.names, self.conditional_errors.tolist())),
            "n_covariance": self.n_covariance, "n_repetitions": self.n_repetitions,
            "hartlap_factor": self.hartlap_factor, "fisher": self.fisher.tolist(),
        }


def hartlap_precision(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Sample covariance of ``samples`` (n, p), its Hartlap-corrected inverse and the factor.

    Needs n > p + 2 (below that the inverse Wishart mean does not exist).
    """
    samples = np.asarray(samples, dtype=np.float64)
    n, p = samples.shape
    if n <= p + 2:
        raise PipelineError(
            f"Fisher covariance: {n} fiducial rows for a summary of {p} numbers; the Hartlap "
            f"correction needs more than p + 2 = {p + 2} rows (more fiducial simulations, or a "
            f"shorter summary).")
    covariance = np.atleast_2d(np.cov(samples, rowvar=False, ddof=1))
    try:
        inverse = np.linalg.inv(covariance)
    except np.linalg.LinAlgError:
        raise PipelineError(
            "Fisher covariance of the fiducial summaries is singular (a summary entry is "
            "constant or a copy of others).") from None
    factor = (n - p - 2) / (n - 1)
    return covariance, factor * inverse, factor


def fisher_forecast(summaries: np.ndarray, design: DerivativeDesign,
                    repetitions: Sequence | None = None,
                    covariance_rows: np.ndarray | None = None) -> FisherForecast:
    """Fisher forecast from summaries (n_rows, p) of the rows classified in ``design``.

    repetitions: the seeds whose -/+ pairs give the derivatives (default all); covariance_rows:
    the fiducial rows whose summaries give the covariance (default all fiducial rows).
    """
    summaries = np.asarray(summaries, dtype=np.float64)
    if summaries.ndim != 2 or not np.all(np.isfinite(summaries)):
        raise PipelineError(
            f"Fisher summaries must be a finite (n_rows, p) table; got shape {summaries.shape}"
            f"{'' if summaries.ndim != 2 else ' with values that are not finite'}.")
    chosen = set(np.asarray(design.repetitions if repetitions is None else repetitions).tolist())
    keep = [r for r, seed in enumerate(design.repetitions.tolist()) if seed in chosen]
    if not keep:
        raise PipelineError("Fisher forecast: no repetition selected for the derivatives.")
    derivatives = np.empty((len(design.names), summaries.shape[1]))
    for i in range(len(design.names)):
        differences = [summaries[design.plus_rows[i][r]].mean(axis=0)
                       - summaries[design.minus_rows[i][r]].mean(axis=0) for r in keep]
        derivatives[i] = np.mean(differences, axis=0) / (2.0 * design.steps[i])
    rows = design.fiducial_rows if covariance_rows is None else np.asarray(covariance_rows)
    covariance, precision, factor = hartlap_precision(summaries[rows])
    fisher = derivatives @ precision @ derivatives.T
    try:
        inverse = np.linalg.inv(fisher)
    except np.linalg.LinAlgError:
        raise PipelineError(
            f"Fisher matrix is singular: the summary does not constrain every one of "
            f"{list(design.names)} (a derivative is zero or two are degenerate).") from None
    marginal = np.sqrt(np.where(np.diag(inverse) > 0, np.diag(inverse), np.nan))
    conditional = 1.0 / np.sqrt(np.diag(fisher))
    return FisherForecast(design.names, derivatives, covariance, precision, factor, fisher,
                          marginal, conditional, len(rows), len(keep))


def fisher_convergence(summaries: np.ndarray, design: DerivativeDesign,
                       fractions: Sequence[float] = DEFAULT_FRACTIONS,
                       tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Marginal errors against the number of simulations used, for derivatives and covariance.

    For each fraction f: the first ceil(f R) repetitions (all fiducial rows for the
    covariance), and the first max(ceil(f n), p + 3) fiducial rows (all repetitions for the
    derivatives). Returns {"derivatives": {"n": [...], "marginal_errors": {name: [...]}},
    "covariance": {...}, "change": {"derivatives": {name: x}, "covariance": {...}} (relative
    change of each error from the last-but-one point to the last), "tolerance", "converged"}.
    """
    fractions = sorted(set(float(f) for f in fractions))
    if not fractions or fractions[0] <= 0 or fractions[-1] != 1.0 or len(fractions) < 2:
        raise PipelineError(
            f"Fisher convergence fractions {fractions} must be at least two values in (0, 1] "
            f"ending with 1.")
    n_features = np.asarray(summaries).shape[1]
    result: dict = {"tolerance": tolerance}
    n_reps = len(design.repetitions)
    n_fid = len(design.fiducial_rows)
    curves = {
        "derivatives": sorted({max(1, math.ceil(f * n_reps)) for f in fractions}),
        "covariance": sorted({min(n_fid, max(math.ceil(f * n_fid), n_features + 3))
                              for f in fractions}),
    }
    converged = True
    result["change"] = {}
    for what, counts in curves.items():
        errors = []
        for count in counts:
            if what == "derivatives":
                forecast = fisher_forecast(summaries, design,
                                           repetitions=list(design.repetitions[:count]))
            else:
                forecast = fisher_forecast(summaries, design,
                                           covariance_rows=design.fiducial_rows[:count])
            errors.append(forecast.marginal_errors)
        errors = np.array(errors)
        result[what] = {"n": counts,
                        "marginal_errors": {name: errors[:, i].tolist()
                                            for i, name in enumerate(design.names)}}
        if len(counts) >= 2:
            change = np.abs(errors[-1] / errors[-2] - 1.0)
        else:  # a single repetition or too few rows to vary: nothing shows convergence
            change = np.full(len(design.names), np.inf)
        result["change"][what] = dict(zip(design.names, change.tolist()))
        converged &= bool(np.all(change <= tolerance))
    result["converged"] = converged
    return result
