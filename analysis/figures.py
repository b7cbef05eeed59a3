"""The analysis figures: PNG files, each returned with its one-paragraph caption.

Every function draws on its own :class:`matplotlib.figure.Figure` (no pyplot, no global
state, no GUI backend: PNGs are rendered by Agg), writes the PNG atomically and returns a
:class:`Figure` (path, caption, alt text) for the report. Sizes are fixed (``SIZES``, inches
at ``DPI``), so a figure's pixel size is known in advance.

* :func:`predicted_vs_true`: network and best baseline per parameter, per-simulation means
  with the sub-volumes' standard deviation as error bars;
* :func:`residual_histograms`: prediction minus truth per parameter, one outline per model;
* :func:`learning_curves`: loss and validation loss per epoch from ``history.csv``, and the
  learning rate;
* :func:`subvolume_slices`: middle slices of sample sub-volumes, log(1 + counts);
* :func:`power_spectrum_validation`: snapshot P(k) against linear theory (and halofit);
* :func:`model_comparison`: relative errors of the network and baselines against the paper's;
* :func:`posterior_calibration`: TARP expected coverage of the network's posteriors and their
  SBC rank histograms;
* :func:`posterior_examples`: the posteriors of a few test simulations, the network's and the
  power-spectrum baseline's, as 1- and 2-sigma ellipses of each parameter pair;
* :func:`fisher_convergence`: Fisher marginal errors against the simulations used;
* :func:`data_learning_curves`: test errors of the network and the power-spectrum baseline
  against the number of training simulations, with the Fisher bound.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from scipy import stats
from matplotlib.figure import Figure as MatplotlibFigure
from matplotlib.patches import Ellipse
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from analysis.metrics import PAPER_RELATIVE_ERRORS, Predictions
from workflow.errors import PipelineError
from workflow.io import atomic_path, read_csv

DPI = 100
SIZES = {
    "predicted_vs_true": (4.2, 4.2),  # per parameter panel
    "residual_histograms": (4.2, 3.4),  # per parameter panel
    "learning_curves": (10.0, 4.0),
    "subvolume_slices": (2.8, 2.9),  # per sample (column) and channel (row)
    "power_spectrum_validation": (5.0, 7.0),  # per redshift (column)
    "model_comparison": (8.0, 4.5),
    "fisher_convergence": (10.0, 4.0),
    "posterior_calibration": (3.6, 3.4),  # per panel: TARP, then one SBC panel per parameter
    "posterior_examples": (2.4, 2.4),  # per panel: parameter pairs of one simulation's corner plot
    "data_learning_curves": (4.2, 3.8),  # per parameter panel
}
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
LABELS = {"Omega_m": r"$\Omega_m$", "sigma_8": r"$\sigma_8$", "n_s": r"$n_s$", "h": r"$h$"}


@dataclasses.dataclass(frozen=True)
class Figure:
    """A written figure: the PNG's path, its caption (one paragraph) and a short alt text."""

    path: Path
    caption: str
    alt: str


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _save(figure: MatplotlibFigure, path: str | os.PathLike) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=DPI)
    return path


def _new(size: tuple[float, float]) -> MatplotlibFigure:
    return MatplotlibFigure(figsize=size, dpi=DPI, layout="constrained")


def _plain_log_ticks(axis) -> None:
    """Ticks at 1, 2, 5 x 10^n labelled as plain numbers (0.02, 0.05, 0.1), no minor labels:
    readable when a log axis spans less than a decade."""
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


# --------------------------------------------------------------------------------------------
# Predictions


def predicted_vs_true(
    path: str | os.PathLike,
    network: Predictions,
    baseline: tuple[str, Predictions] | None = None,
    ranges: Mapping[str, Sequence[float]] | None = None,
    split: str = "test",
) -> Figure:
    """Per parameter: per-simulation mean prediction against truth, with error bars.

    network, baseline: per-sample predictions (baseline given as (name, predictions));
    ranges: the sampling ranges, used as axis limits.
    """
    names = network.names
    width, height = SIZES["predicted_vs_true"]
    figure = _new((width * len(names), height))
    axes = figure.subplots(1, len(names), squeeze=False)[0]
    models = [("network", network)] + ([baseline] if baseline is not None else [])
    sims = {label: predictions.per_simulation() for label, predictions in models}
    for p, (name, ax) in enumerate(zip(names, axes)):
        for colour, (label, _) in zip(COLOURS, models):
            table = sims[label]
            ax.errorbar(table.true[:, p], table.pred[:, p], yerr=table.pred_std[:, p], fmt="o",
                        ms=4, lw=1, capsize=2, color=colour, alpha=0.8, label=label)
        low, high = (ranges[name] if ranges and name in ranges else
                     (float(network.true[:, p].min()), float(network.true[:, p].max())))
        pad = 0.08 * (high - low or 1.0)
        ax.plot([low - pad, high + pad], [low - pad, high + pad], "k--", lw=1, label="perfect")
        ax.set_xlim(low - pad, high + pad)
        ax.set_ylim(low - pad, high + pad)
        ax.set_aspect("equal")
        ax.set_xlabel(f"true {_label(name)}")
        ax.set_ylabel(f"predicted {_label(name)}")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    path = _save(figure, path)
    n_sims = len(sims["network"].sim_ids)
    compared = f" and the best baseline ({baseline[0]}, orange)" if baseline else ""
    caption = (
        f"Predicted against true parameters on the {split} split ({n_sims} simulations, "
        f"{len(network.sim_ids)} sub-volumes): each point is a simulation's mean prediction "
        f"over its sub-volumes, the bar their standard deviation; the network (blue){compared}. "
        f"The dashed line is perfect prediction; axes span the sampling ranges.")
    return Figure(path, caption, "predicted against true parameters")


def residual_histograms(path: str | os.PathLike, models: Mapping[str, Predictions],
                        split: str = "test", bins: int = 30) -> Figure:
    """Per parameter, the distribution of prediction - truth (per sample) of each model."""
    if not models:
        raise PipelineError("Residual histograms need the predictions of at least one model.")
    names = next(iter(models.values())).names
    width, height = SIZES["residual_histograms"]
    figure = _new((width * len(names), height))
    axes = figure.subplots(1, len(names), squeeze=False)[0]
    for p, (name, ax) in enumerate(zip(names, axes)):
        residuals = {label: pred.pred[:, p] - pred.true[:, p] for label, pred in models.items()}
        extent = max(float(np.max(np.abs(r))) for r in residuals.values()) or 1.0
        edges = np.linspace(-extent, extent, bins + 1)
        for colour, (label, values) in zip(COLOURS, residuals.items()):
            ax.hist(values, bins=edges, histtype="step", lw=1.5, color=colour,
                    label=f"{label} (rms {np.sqrt(np.mean(values**2)):.3g})")
        ax.axvline(0.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel(f"predicted - true {_label(name)}")
        ax.set_ylabel("sub-volumes")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    path = _save(figure, path)
    n = len(next(iter(models.values())).sim_ids)
    caption = (
        f"Residuals (prediction minus truth, physical units) of the {n} {split} sub-volumes, "
        f"per parameter, for {', '.join(models)}; the legend gives each model's rms residual. "
        f"A narrow histogram centred on zero is an unbiased, precise estimator.")
    return Figure(path, caption, "residual histograms")


# --------------------------------------------------------------------------------------------
# Training


def read_history(history_path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Columns of a Keras CSVLogger ``history.csv`` as float arrays (NaN for empty cells).

    Requires ``epoch`` and ``loss``; raises PipelineError naming the file otherwise.
    """
    path = Path(history_path)
    columns, rows = read_csv(path, f"Training history {path} does not exist; run the train stage first.")
    missing = [c for c in ("epoch", "loss") if c not in columns]
    if missing or not rows:
        raise PipelineError(
            f"Training history {path} has columns {columns} and {len(rows)} rows; it needs "
            f"'epoch' and 'loss' and at least one epoch.")
    history = {}
    for column in columns:
        try:
            history[column] = np.array([float(row[column]) if row[column] not in ("", "NA", None)
                                        else np.nan for row in rows])
        except ValueError as error:
            raise PipelineError(f"Training history {path}, column {column!r}: {error}.") from None
    return history


def learning_curves(path: str | os.PathLike, history_path: str | os.PathLike) -> Figure:
    """Training and validation loss per epoch (log scale), and the learning rate."""
    history = read_history(history_path)
    epochs = history["epoch"] + 1  # CSVLogger counts from 0
    figure = _new(SIZES["learning_curves"])
    loss_ax, rate_ax = figure.subplots(1, 2, width_ratios=(2, 1))
    loss_ax.plot(epochs, history["loss"], "o-", ms=3, color=COLOURS[0], label="training loss")
    if "val_loss" in history:
        loss_ax.plot(epochs, history["val_loss"], "s-", ms=3, color=COLOURS[1],
                     label="validation loss")
        best = int(np.nanargmin(history["val_loss"]))
        loss_ax.axvline(epochs[best], color="grey", ls=":", lw=1,
                        label=f"best validation (epoch {epochs[best]:g})")
    if np.all(np.concatenate([history["loss"], history.get("val_loss", [])]) > 0):
        loss_ax.set_yscale("log")
        _plain_log_ticks(loss_ax.yaxis)
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("loss (MSE of scaled targets)")
    loss_ax.legend(fontsize=8)
    loss_ax.grid(alpha=0.3, which="both")
    if "learning_rate" in history:
        rate_ax.plot(epochs, history["learning_rate"], "-", color=COLOURS[2])
        rate_ax.set_ylabel("learning rate")
    else:
        rate_ax.text(0.5, 0.5, "no learning_rate column", ha="center", va="center",
                     transform=rate_ax.transAxes)
    rate_ax.set_xlabel("epoch")
    rate_ax.grid(alpha=0.3)
    path = _save(figure, path)
    final = (f"; final training loss {history['loss'][-1]:.3g}"
             + (f", validation loss {history['val_loss'][-1]:.3g}" if "val_loss" in history else ""))
    caption = (
        f"Learning curves over {len(epochs)} epochs: the loss on the training split (blue) and "
        f"on the validation split (orange), log scale, and the learning rate schedule (right)"
        f"{final}. A validation loss rising while the training loss falls is over-fitting.")
    return Figure(path, caption, "learning curves")


# --------------------------------------------------------------------------------------------
# Data


def subvolume_slices(path: str | os.PathLike, samples: Sequence[np.ndarray],
                     titles: Sequence[str], voxel_size: float,
                     channel_labels: Sequence[str] | None = None) -> Figure:
    """The middle slice (first axis) of each sample, log(1 + counts), one row per channel.

    samples: (n, n, n) or (n, n, n, C) particle counts; titles: one per sample (e.g. its true
    parameters); voxel_size in Mpc/h; channel_labels: e.g. ['z = 0', 'z = 1'].
    """
    if not samples or len(samples) != len(titles):
        raise PipelineError(
            f"Sub-volume slices need samples and one title each; got {len(samples)} samples and "
            f"{len(titles)} titles.")
    arrays = [np.asarray(s)[..., None] if np.asarray(s).ndim == 3 else np.asarray(s) for s in samples]
    n_channels = arrays[0].shape[-1]
    labels = list(channel_labels) if channel_labels else [f"channel {c}" for c in range(n_channels)]
    width, height = SIZES["subvolume_slices"]
    figure = _new((width * len(arrays), height * n_channels))
    axes = figure.subplots(n_channels, len(arrays), squeeze=False)
    n = arrays[0].shape[0]
    extent = (0.0, n * voxel_size, 0.0, n * voxel_size)
    top = max(float(np.log1p(a.max())) for a in arrays)
    for column, (array, title) in enumerate(zip(arrays, titles)):
        for channel in range(n_channels):
            ax = axes[channel, column]
            image = ax.imshow(np.log1p(array[n // 2, :, :, channel].astype(float)).T,
                              origin="lower", extent=extent, cmap="magma", vmin=0.0, vmax=top)
            ax.set_title(f"{title}\n{labels[channel]}" if channel == 0 else labels[channel],
                         fontsize=8)
            ax.set_xlabel("y [Mpc/h]", fontsize=8)
            ax.set_ylabel("z [Mpc/h]", fontsize=8)
            ax.tick_params(labelsize=7)
    figure.colorbar(image, ax=axes, shrink=0.8, label="log(1 + counts)")
    path = _save(figure, path)
    caption = (
        f"Slices through the middle of {len(arrays)} sample sub-volumes ({n}^3 voxels of "
        f"{voxel_size:g} Mpc/h, {n * voxel_size:g} Mpc/h across): log(1 + particle counts), one "
        f"row per redshift channel, on one colour scale; titles give the true parameters.")
    return Figure(path, caption, "slices through sample sub-volumes")


def power_spectrum_validation(path: str | os.PathLike, checks: Sequence,
                              tolerance: float | None = None) -> Figure:
    """P(k) of every validated snapshot against linear theory (and halofit), per redshift.

    checks: :class:`analysis.simulation_validation.SimulationCheck` objects (all with the
    same redshifts); flagged simulations are drawn in red. Top row: P(k) and the theory of the
    first simulation; bottom row: P / P_lin of every simulation, the large-scale bins of the
    linear check shaded, and halofit / linear (the expected non-linear boost) where available.
    """
    if not checks:
        raise PipelineError("The P(k) validation plot needs at least one validated simulation.")
    redshifts = [c.redshift for c in checks[0].redshifts]
    width, height = SIZES["power_spectrum_validation"]
    figure = _new((width * len(redshifts), height))
    axes = figure.subplots(2, len(redshifts), squeeze=False, sharex="col")
    for column, z in enumerate(redshifts):
        top, bottom = axes[0, column], axes[1, column]
        for check in checks:
            matching = [c for c in check.redshifts if c.redshift == z]
            if not matching:
                continue
            entry = matching[0]
            spectrum = entry.spectrum
            filled = spectrum.n_modes > 0
            colour, alpha, width_ = ("red", 0.9, 1.2) if check.flagged else (COLOURS[0], 0.35, 0.8)
            top.loglog(spectrum.k[filled], spectrum.power[filled], color=colour, alpha=alpha,
                       lw=width_)
            bottom.semilogx(spectrum.k[filled], (spectrum.power / entry.linear)[filled],
                            color=colour, alpha=alpha, lw=width_)
        first = next(c for c in checks[0].redshifts if c.redshift == z)
        filled = first.spectrum.n_modes > 0
        top.loglog(first.spectrum.k[filled], first.linear[filled], "k--", lw=1.5,
                   label=r"linear $\times D_1^2$")
        if first.halofit is not None:
            top.loglog(first.spectrum.k, first.halofit, "k:", lw=1.5, label="halofit (CAMB)")
            bottom.semilogx(first.spectrum.k, first.halofit / first.linear, "k:", lw=1.5,
                            label="halofit / linear")
        k_plotted = first.spectrum.k[filled]
        if first.large_scale.any():
            k_max = float(first.spectrum.k[first.large_scale].max())
            bottom.axvspan(k_plotted.min(), k_max, color="green", alpha=0.08,
                           label="linear check")
        bottom.set_xlim(0.9 * k_plotted.min(), 1.1 * k_plotted.max())
        bottom.axhline(1.0, color="k", lw=0.8)
        if tolerance is not None:
            bottom.axhspan(1 - tolerance, 1 + tolerance, color="grey", alpha=0.12,
                           label=f"1 $\\pm$ {tolerance:g}")
        top.set_title(f"z = {z:g}")
        top.set_ylabel(r"P(k) [(Mpc/h)$^3$]")
        bottom.set_ylabel(r"P(k) / P$_\mathrm{lin}$(k)")
        bottom.set_xlabel("k [h/Mpc]")
        bottom.set_ylim(0.0, 2.5)
        top.legend(fontsize=8)
        bottom.legend(fontsize=7, loc="upper left")
        for ax in (top, bottom):
            ax.grid(alpha=0.3, which="both")
        _plain_log_ticks(bottom.xaxis)
        _plain_log_ticks(top.yaxis)
    path = _save(figure, path)
    n_flagged = sum(c.flagged for c in checks)
    caption = (
        f"Matter power spectra of {len(checks)} simulations at z = "
        f"{', '.join(f'{z:g}' for z in redshifts)} (CIC, window deconvolved) against linear "
        f"theory scaled by the growth factor (dashed, for the first simulation's cosmology)"
        f"{' and halofit (dotted)' if first.halofit is not None else ''}; bottom: the ratio to "
        f"each simulation's own linear theory, with the large-scale bins of the linear check "
        f"shaded. {n_flagged} simulation(s) flagged, drawn in red.")
    return Figure(path, caption, "power spectrum validation")


# --------------------------------------------------------------------------------------------
# Comparison


def model_comparison(path: str | os.PathLike, relative_errors: Mapping[str, Mapping[str, float]],
                     paper: Mapping[str, float] = PAPER_RELATIVE_ERRORS,
                     metric_label: str = "relative error, mean |pred - true| / true") -> Figure:
    """Bar chart: each model's per-parameter error (log scale), with the paper's where given.

    relative_errors: {model: {parameter: value}}, e.g. per-simulation relative errors of the
    network and every baseline on the test split.
    """
    if not relative_errors:
        raise PipelineError("The model comparison needs the errors of at least one model.")
    names = list(next(iter(relative_errors.values())))
    groups = list(relative_errors) + (["paper (SC18)"] if any(n in paper for n in names) else [])
    figure = _new(SIZES["model_comparison"])
    ax = figure.subplots()
    width = 0.8 / len(groups)
    positions = np.arange(len(names))
    for index, group in enumerate(groups):
        if group == "paper (SC18)":
            values = [paper.get(name, math.nan) for name in names]
            style = {"color": "white", "edgecolor": "k", "hatch": "//"}
        else:
            values = [relative_errors[group].get(name, math.nan) for name in names]
            style = {"color": COLOURS[index % len(COLOURS)]}
        x = positions + (index - (len(groups) - 1) / 2) * width
        bars = ax.bar(x, values, width, label=group, **style)
        for bar, value in zip(bars, values):
            if math.isfinite(value):
                ax.annotate(f"{value:.2g}", (bar.get_x() + bar.get_width() / 2, value),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(positions, [_label(n) for n in names])
    ax.set_yscale("log")
    ax.set_ylabel(metric_label)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y", which="both")
    path = _save(figure, path)
    caption = (
        f"Errors per parameter ({metric_label}, log scale) of {', '.join(relative_errors)}"
        + (". Hatched: the CosmoFlow paper's relative errors at 2048 nodes (0.0022, 0.0094, "
           "0.0096 for Omega_m, sigma_8, n_s), from 12,632 simulations of 512^3 particles in "
           "512 Mpc/h boxes: a far larger and finer data set, so a reference, not a like-for-"
           "like comparison" if "paper (SC18)" in groups else "") + ".")
    return Figure(path, caption, "model comparison")


def posterior_calibration(path: str | os.PathLike, posteriors: Mapping) -> Figure:
    """The calibration of the network's posteriors (``calibrate_posteriors`` of analysis.jobs):
    TARP expected coverage against credibility per sample and per simulation (after the fitted
    inflation), with the bootstrap band, and per parameter the per-sample SBC rank histogram with
    the counts a calibrated posterior gives (Lemos et al. 2023; Talts et al. 2018)."""
    per_sample, per_simulation = posteriors["per_sample"], posteriors["per_simulation"]["after"]
    names = list(per_sample["sbc"]["histograms"])
    width, height = SIZES["posterior_calibration"]
    figure = _new((width * (1 + len(names)), height))
    axes = figure.subplots(1, 1 + len(names))
    for colour, (label, diagnosed) in zip(COLOURS, (("per sample", per_sample),
                                                    ("per simulation, inflated", per_simulation))):
        tarp = diagnosed["tarp"]
        axes[0].fill_between(tarp["alpha"], *tarp["ecp_band_95"], color=colour, alpha=0.2)
        axes[0].plot(tarp["alpha"], tarp["ecp"], color=colour,
                     label=f"{label} (D = {tarp['distance']:.2f}, band {tarp['distance_band']:.2f})")
    axes[0].plot([0, 1], [0, 1], "k--", lw=0.8)
    axes[0].set_xlabel("credibility level")
    axes[0].set_ylabel("expected coverage (TARP)")
    axes[0].legend(fontsize=7)
    sbc = per_sample["sbc"]
    for ax, name in zip(axes[1:], names):
        counts = np.asarray(sbc["histograms"][name])
        ax.bar(np.arange(len(counts)), counts, width=1.0, color=COLOURS[0], alpha=0.7)
        ax.axhline(counts.sum() / len(counts), color="k", lw=0.8)
        ax.set_xlabel(f"rank of the true {_label(name)} (bin)")
        ax.set_title(f"SBC, p = {sbc['p_values'][name]:.2g}", fontsize=9)
    axes[1].set_ylabel("samples")
    path = _save(figure, path)
    caption = (
        "Calibration of the network's Gaussian posteriors on the evaluation split. Left: TARP "
        "expected coverage against the credibility level, per sample and per simulation (its "
        "sub-volumes' posteriors multiplied, the covariance inflated by the factor fitted on the "
        "validation split), with 95% bootstrap bands; a calibrated posterior follows the diagonal, "
        "an over-confident one falls below it. Right: per parameter, the rank of the true value "
        "among the posterior draws of each sample (simulation-based calibration); calibrated "
        "ranks are uniform (the line), a U shape means over-confident, a hump under-confident.")
    return Figure(path, caption, "posterior calibration")


ELLIPSE_LEVELS = (0.6827, 0.9545)  # the 1- and 2-sigma credibility of a 2-D Gaussian's ellipses


def _ellipses(ax, mean, covariance, colour: str, label: str | None) -> None:
    """The 1- and 2-sigma credible ellipses of a 2-D Gaussian: (x - mu)^T Sigma^-1 (x - mu) =
    chi^2_2 quantile of the level, axes along Sigma's eigenvectors."""
    values, vectors = np.linalg.eigh(covariance)
    angle = math.degrees(math.atan2(vectors[1, 1], vectors[0, 1]))
    for level, style in zip(ELLIPSE_LEVELS, ("-", "--")):
        radius = math.sqrt(stats.chi2.ppf(level, 2))
        ax.add_patch(Ellipse(mean, 2 * radius * math.sqrt(values[1]), 2 * radius * math.sqrt(values[0]),
                             angle=angle, fill=False, color=colour, ls=style,
                             label=label if level == ELLIPSE_LEVELS[0] else None))


def posterior_examples(path: str | os.PathLike, posteriors: Mapping[str, Sequence[np.ndarray]],
                       names: Sequence[str], n_examples: int = 3) -> Figure:
    """For the first ``n_examples`` evaluated simulations, a small corner plot of each model's
    per-simulation posterior: its 1- and 2-sigma ellipses in every parameter pair, the true
    values marked.

    posteriors: {model: (means (G, P), covariances (G, P, P), truths (G, P))}, physical units,
    the same G simulations in the same order for every model (``calibrate_posteriors`` of
    analysis.jobs: the inflated per-simulation posteriors).
    """
    truths = next(iter(posteriors.values()))[2]
    count, size = min(n_examples, len(truths)), len(names) - 1
    width, height = SIZES["posterior_examples"]
    figure = _new((width * size * count, height * size))
    for g, panel in enumerate(figure.subfigures(1, count, squeeze=False)[0]):
        axes = panel.subplots(size, size, squeeze=False)
        for row, column in itertools.product(range(size), range(size)):
            ax, (i, j) = axes[row, column], (column, row + 1)  # parameter j against parameter i
            if column > row:
                ax.set_visible(False)
                continue
            pair = [i, j]
            for colour, (model, (means, covariances, _)) in zip(COLOURS, posteriors.items()):
                _ellipses(ax, means[g, pair], covariances[g][np.ix_(pair, pair)], colour,
                          model if (row, column) == (0, 0) else None)
            ax.plot(*truths[g, pair], "k*", ms=9, label="true" if (row, column) == (0, 0) else None)
            ax.autoscale_view()
            ax.set_xlabel(_label(names[i]) if row == size - 1 else "")
            ax.set_ylabel(_label(names[j]) if column == 0 else "")
        axes[0, 0].legend(fontsize=7)
        panel.suptitle(f"simulation {g + 1}", fontsize=9)
    path = _save(figure, path)
    caption = (
        f"Posteriors of {count} test simulations (one corner plot each, parameter pairs): "
        f"{' and '.join(posteriors)}, each the product of the simulation's sub-volume posteriors "
        "with its covariance inflated by the factor fitted on the validation split; solid: the "
        "1-sigma (68.3%) ellipse, dashed: 2-sigma (95.4%), the prior box not drawn. Star: the "
        "true parameters. A smaller ellipse that still holds the star: more information, "
        "calibrated.")
    return Figure(path, caption, "posterior examples")


def fisher_convergence(path: str | os.PathLike, convergence: Mapping) -> Figure:
    """Fisher marginal errors against the number of repetitions used for the derivatives and
    of fiducial rows used for the covariance (:func:`analysis.fisher.fisher_convergence`),
    each relative to its value with everything used."""
    figure = _new(SIZES["fisher_convergence"])
    axes = figure.subplots(1, 2, sharey=True)
    titles = {"derivatives": "repetitions used for the derivatives",
              "covariance": "fiducial samples used for the covariance"}
    for ax, what in zip(axes, ("derivatives", "covariance")):
        counts = convergence[what]["n"]
        for colour, (name, errors) in zip(COLOURS, convergence[what]["marginal_errors"].items()):
            errors = np.asarray(errors, dtype=float)
            ax.plot(counts, errors / errors[-1], "o-", color=colour, label=_label(name))
        tolerance = convergence.get("tolerance")
        if tolerance is not None:
            ax.axhspan(1 - tolerance, 1 + tolerance, color="grey", alpha=0.15,
                       label=f"1 $\\pm$ {tolerance:g}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel(titles[what])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("marginal error / its value with all")
    axes[0].legend(fontsize=8)
    path = _save(figure, path)
    state = "converged" if convergence.get("converged") else "not converged"
    caption = (
        f"Convergence of the Fisher forecast: each parameter's marginal error against the "
        f"number of simulations used for the derivatives (left) and for the covariance (right), "
        f"relative to its value with all of them; {state} at tolerance "
        f"{convergence.get('tolerance')}. Noisy derivatives bias Fisher errors low, so errors "
        f"still rising at the right end of the left panel are lower bounds.")
    return Figure(path, caption, "Fisher forecast convergence")


def data_learning_curves(path: str | os.PathLike, curve: Mapping,
                         fisher_ratio: Mapping[str, float] | None = None) -> Figure:
    """Test MSE over the training mean's against the number of training simulations, one
    panel per parameter, one line per model, bootstrap intervals as error bars.

    curve: the ``learning_curve`` record of analysis.jobs (``train_simulations``, and per model
    and parameter lists ``ratio``, ``ratio_low``, ``ratio_high``); fisher_ratio: per parameter,
    the Fisher bound's variance over the training mean's MSE (a dashed line), or None.
    """
    names = list(next(iter(curve["models"].values())))
    figure = _new((SIZES["data_learning_curves"][0] * len(names), SIZES["data_learning_curves"][1]))
    axes = np.atleast_1d(figure.subplots(1, len(names)))
    n = np.asarray(curve["train_simulations"], dtype=float)
    for ax, name in zip(axes, names):
        for index, (model, values) in enumerate(curve["models"].items()):
            ratio = np.asarray(values[name]["ratio"], dtype=float)
            errors = [ratio - np.asarray(values[name]["ratio_low"], float),
                      np.asarray(values[name]["ratio_high"], float) - ratio]
            shift = 1.0 + 0.02 * (index - (len(curve["models"]) - 1) / 2)  # keep bars apart
            ax.errorbar(n * shift, ratio, yerr=errors, fmt="o-", capsize=3,
                        color=COLOURS[index % len(COLOURS)], label=model)
        if fisher_ratio and fisher_ratio.get(name) is not None:
            ax.axhline(fisher_ratio[name], color="k", ls="--", lw=1, label="Fisher bound, P(k)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
        ax.set_xticks(n, [f"{int(v)}" for v in n])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("training simulations")
        ax.set_title(_label(name))
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("test MSE / training mean's MSE (log)")
    axes[0].legend(fontsize=8)
    path = _save(figure, path)
    caption = (
        "Learning curves in data: each model's test mean squared error (per sample) over that "
        "of predicting the training mean, against the number of training simulations it was "
        "fitted on (random subsets of whole TFRecord shards, the same for every model). Error "
        "bars: 16th-84th percentiles of a bootstrap over the test simulations. Below 1: the "
        "model has learned something; a model whose curve still falls at the right end would "
        "gain from more simulations"
        + (". Dashed: the Fisher forecast's variance for one sample from the power spectrum "
           "(fiducial_derivatives companion run, at the fiducial point), over the same mean's "
           "MSE: roughly the floor of an estimator of P(k) alone near the fiducial cosmology"
           if fisher_ratio else "") + ".")
    return Figure(path, caption, "learning curves in data")
