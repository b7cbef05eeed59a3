"""The analysis report: one self-contained HTML page (``analysis/report.html``).

Everything is inline: the style sheet, and every figure as a base64 ``data:image/png`` URI,
so the page opens from disk, offline, and can be mailed as one file. It leads with the answer,
a headline per parameter (:func:`_headline_html`: the network against the training mean and the
best baseline, with bootstrap intervals and a one-word verdict), then the figures with their
captions, then the full tables, each collapsed under its title: the metrics of the network and
every baseline per parameter (per simulation and per sample; the lowest error of each row in
bold; the paper's relative errors beside them), their uncertainty, the combination, the
posteriors' calibration, the learning curves, the Fisher forecast, the flagged simulations, the
choices, the data set and the configuration. Written atomically
(:func:`workflow.io.atomic_write_text`).
"""

from __future__ import annotations

import base64
import html
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

from analysis.figures import Figure
from analysis.metrics import DEFINITIONS, MLPERF_TARGET_MAE, PAPER_RELATIVE_ERRORS
from workflow.errors import PipelineError
from workflow.io import atomic_write_text
from workflow.version import CODE_VERSION

METRIC_ROWS = (  # (key, label, lower is better)
    ("mae", "MAE", True),
    ("rmse", "RMSE", True),
    ("bias", "bias", None),
    ("relative_error", "relative error", True),
    ("mlperf_mae", "MLPerf MAE (scaled)", True),
    ("r2", "R²", False),
    ("pearson_r", "Pearson r", False),
)
LEVELS = (("per_simulation", "per simulation (mean over its sub-volumes)"),
          ("per_sample", "per sample (sub-volume)"))

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1280px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f2f2f2; } td.name, th.name { text-align: left; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.92em; color: #444; max-width: 70em; }
.flagged { color: #b00; } .note { color: #555; font-size: 0.92em; }
details { margin: 0.6em 0; } summary { font-size: 1.2em; font-weight: bold; cursor: pointer; }
.better { color: #070; font-weight: bold; } .worse { color: #b00; font-weight: bold; }
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _number(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _e(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def _flatten(mapping: Mapping, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for key, value in mapping.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            rows += _flatten(value, name)
        else:
            rows.append((name, value))
    return rows


def _key_value_table(mapping: Mapping) -> str:
    rows = "".join(f"<tr><td class='name'>{_e(k)}</td><td class='name'>{_e(_format_value(v))}</td></tr>"
                   for k, v in _flatten(mapping))
    return f"<table><tr><th class='name'>key</th><th class='name'>value</th></tr>{rows}</table>"


def _format_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(_format_value(v) for v in value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _metrics_table(metrics: Mapping[str, Mapping], level: str, names: Sequence[str]) -> str:
    models = list(metrics)
    header = "".join(f"<th>{_e(m)}</th>" for m in models)
    paper_column = any(n in PAPER_RELATIVE_ERRORS for n in names)
    header += "<th>paper (SC18)</th>" if paper_column else ""
    body = []
    for name in names:
        for key, label, lower_better in METRIC_ROWS:
            values = [metrics[m][level]["parameters"].get(name, {}).get(key) for m in models]
            finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            best = None
            if finite and lower_better is not None and len(models) > 1:
                best = min(finite) if lower_better else max(finite)
            cells = "".join(
                f"<td>{'<b>' if v == best and best is not None else ''}{_number(v)}"
                f"{'</b>' if v == best and best is not None else ''}</td>" for v in values)
            if paper_column:
                paper = PAPER_RELATIVE_ERRORS.get(name) if key == "relative_error" else None
                cells += f"<td>{_number(paper)}</td>"
            body.append(f"<tr><td class='name'>{_e(name)}</td><td class='name' "
                        f"title='{_e(DEFINITIONS.get(key, ''))}'>{_e(label)}</td>{cells}</tr>")
    overall = [metrics[m][level].get("mlperf_mae") for m in models]
    cells = "".join(f"<td>{_number(v)}</td>" for v in overall)
    cells += f"<td>target {MLPERF_TARGET_MAE}</td>" if paper_column else ""
    body.append(f"<tr><td class='name'>all</td><td class='name'>MLPerf MAE (scaled)</td>{cells}</tr>")
    counts = [metrics[m][level].get("n") for m in models]
    cells = "".join(f"<td>{_number(v)}</td>" for v in counts) + ("<td></td>" if paper_column else "")
    body.append(f"<tr><td class='name'>all</td><td class='name'>evaluated</td>{cells}</tr>")
    return (f"<table><tr><th class='name'>parameter</th><th class='name'>metric</th>{header}</tr>"
            f"{''.join(body)}</table>")


def _figure_html(figure: Figure) -> str:
    path = Path(figure.path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise PipelineError(f"Report figure {path} cannot be read: {error}.") from None
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise PipelineError(f"Report figure {path} is not a PNG file.")
    encoded = base64.b64encode(data).decode("ascii")
    return (f"<figure><img src='data:image/png;base64,{encoded}' alt='{_e(figure.alt)}'>"
            f"<figcaption>{_e(figure.caption)}</figcaption></figure>")


def _fisher_html(fisher: Mapping) -> str:
    forecast = fisher.get("forecast", {})
    errors = forecast.get("marginal_errors", {})
    conditional = forecast.get("conditional_errors", {})
    rows = "".join(f"<tr><td class='name'>{_e(n)}</td><td>{_number(errors[n])}</td>"
                   f"<td>{_number(conditional.get(n))}</td></tr>" for n in errors)
    convergence = fisher.get("convergence")
    note = ""
    if convergence is not None:
        state = "converged" if convergence.get("converged") else "<b>not converged</b>"
        note = (f"<p class='note'>Convergence of the marginal errors with the number of "
                f"simulations used (tolerance {_number(convergence.get('tolerance'))}): {state}. "
                f"Noisy derivatives bias Fisher errors low.</p>")
    source = fisher.get("source")
    return (f"<p>Information bound of one sample's power spectrum from the "
            f"fiducial-derivatives simulations of {_e(source or 'this run')} "
            f"({_number(forecast.get('n_repetitions'))} "
            f"repetitions, covariance from {_number(forecast.get('n_covariance'))} fiducial "
            f"samples, Hartlap-corrected).</p><table><tr><th class='name'>parameter</th>"
            f"<th>marginal σ</th><th>conditional σ</th></tr>{rows}</table>{note}")


def _verdict(entry: Mapping) -> str:
    """'better' when a ratio's interval lies below 1, 'worse' above 1, else 'tied'."""
    word = "better" if entry["ratio_high"] < 1 else "worse" if entry["ratio_low"] > 1 else "tied"
    return f"<span class='{word}'>{word}</span>" if word != "tied" else word


def _headline_html(uncertainty: Mapping, best: str | None, names: Sequence[str],
                   gain: Mapping | None) -> str:
    """The answer, per parameter: the network's test MSE over the training mean's and over the
    best baseline's (paired), each with its bootstrap interval, and the verdict against the best
    baseline (against the mean when there is none); with posteriors, the posterior width of P(k)
    alone over the network's."""
    network, versus = uncertainty["models"]["network"], uncertainty.get("versus", {})
    against = best if best in versus else None
    power = (gain or {}).get("models", {}).get("power_spectrum")
    head = ("<th class='name'>parameter</th><th>network MSE / training mean's</th>"
            + (f"<th>network MSE / {_e(against)}'s</th>" if against else "") + "<th>verdict</th>"
            + ("<th>σ of P(k) alone / network's</th>" if power else ""))
    rows = []
    for name in names:
        compared = versus[against][name] if against else network[name]
        cells = f"<td>{_interval(network[name])}</td>" + (
            f"<td>{_interval(compared)}</td>" if against else "")
        width = ""
        if power:
            width = "uncalibrated" if power["excluded"] else _interval(power["sigma_ratio"][name])
            width = f"<td>{width}</td>"
        rows.append(f"<tr><td class='name'>{_e(name)}</td>{cells}<td>{_verdict(compared)}</td>{width}</tr>")
    reference = f"the best baseline ({_e(against)})" if against else "the training mean"
    return (f"<table id='headline'><tr>{head}</tr>{''.join(rows)}</table>"
            f"<p class='note'>Test MSE ratios with the 16th-84th percentile interval of a "
            f"bootstrap over the {_number(uncertainty['n_simulations'])} test simulations; the "
            f"verdict is the network against {reference}: better or worse when the whole "
            f"interval lies on one side of 1, else tied.</p>")


def _interval(entry: Mapping, key: str = "ratio") -> str:
    return (f"{_number(entry.get(key))} <span class='note'>[{_number(entry.get(key + '_low'))}, "
            f"{_number(entry.get(key + '_high'))}]</span>")


def _uncertainty_html(uncertainty: Mapping, names: Sequence[str]) -> str:
    """Per model and parameter: MSE over the training mean's with its bootstrap interval; the
    network's MSE over each other model's, with the fraction of resamples it is lower in."""
    models = [m for m in uncertainty["models"] if m != "mean"]
    head = "".join(f"<th>{_e(m)}</th>" for m in models)
    rows = "".join(f"<tr><td class='name'>{_e(n)}</td>" + "".join(
        f"<td>{_interval(uncertainty['models'][m][n])}</td>" for m in models) + "</tr>" for n in names)
    parts = [f"<p>Test MSE (per sample) over the training mean's, with the 16th-84th percentile "
             f"interval of a bootstrap over the {_number(uncertainty['n_simulations'])} test "
             f"simulations ({_number(uncertainty['n_resamples'])} resamples, each simulation "
             f"with all its sub-volumes):</p><table><tr><th class='name'>parameter</th>{head}"
             f"</tr>{rows}</table>"]
    versus = uncertainty.get("versus", {})
    if versus:
        head = "".join(f"<th>network / {_e(m)}</th><th>P(network better)</th>" for m in versus)
        rows = "".join(f"<tr><td class='name'>{_e(n)}</td>" + "".join(
            f"<td>{_interval(versus[m][n])}</td><td>{_number(versus[m][n]['p_better'])}</td>"
            for m in versus) + "</tr>" for n in names)
        parts.append("<p>The network's test MSE over each baseline's on the same resamples "
                     "(paired, so tighter than either error alone); below 1 with the interval "
                     "below 1: the network is better beyond the test set's uncertainty.</p>"
                     f"<table><tr><th class='name'>parameter</th>{head}</tr>{rows}</table>")
    return "".join(parts)


def _combination_html(combination: Mapping, names: Sequence[str]) -> str:
    """Per parameter: the network's weight in its combination with the best baseline and the
    combination's test MSE over the baseline's (paired bootstrap)."""
    base, weights = _e(combination["baseline"]), combination["hyperparameters"]["network_weight"]
    paired = combination["versus_baseline"]
    rows = "".join(f"<tr><td class='name'>{_e(n)}</td><td>{_number(weights[n])}</td>"
                   f"<td>{_interval(paired[n])}</td><td>{_number(paired[n]['p_better'])}</td></tr>"
                   for n in names)
    return (f"<p>The network's and {base}'s predictions averaged, w × network + (1 − w) × {base}, "
            "w chosen per parameter on the validation split. Estimators that read the same "
            "information make the same errors and gain nothing from being averaged; a "
            f"combination better than {base} beyond the test set's uncertainty (interval below "
            "1) shows that the network reads information its summary statistics miss, even "
            f"where the network alone does not beat {base}.</p><table><tr><th class='name'>"
            f"parameter</th><th>w</th><th>combined / {base}</th><th>P(combined better)</th></tr>"
            f"{rows}</table>")


def _learning_curve_html(curve: Mapping, names: Sequence[str]) -> str:
    head = "".join(f"<th>{_e(m)}: {_e(n)}</th>" for m in curve["models"] for n in names)
    rows = []
    for i, (fraction, count) in enumerate(zip(curve["fractions"], curve["train_simulations"])):
        keys = ("ratio", "ratio_low", "ratio_high")
        cells = "".join(f"<td>{_interval({k: curve['models'][m][n][k][i] for k in keys})}</td>"
                        for m in curve["models"] for n in names)
        rows.append(f"<tr><td>{_number(float(fraction))}</td><td>{_number(int(count))}</td>{cells}</tr>")
    return ("<p>Test MSE over the training mean's (bootstrap interval) of the network and the "
            "ridge fit of the summary statistics, each trained on a fraction of the training "
            "simulations (the same simulations for both).</p>"
            f"<table><tr><th>fraction</th><th>training simulations</th>{head}</tr>"
            f"{''.join(rows)}</table>{_trend_html(curve['trend'])}"
            + (_saturating_html(curve) if curve.get("saturating") else ""))


def _trend_html(trend: Mapping) -> str:
    """One line per parameter: the fitted power-law slopes and where the fits cross."""
    lines = []
    for name, t in trend.items():
        if t["network_ahead"]:
            where = "the network is ahead at the largest training set"
        elif t["crossover_simulations"] is not None:
            where = f"the fits cross at ~{_number(t['crossover_simulations'])} training simulations"
        else:
            where = "the network is behind and its MSE does not fall faster: the fits do not cross"
        lines.append(f"<li>{_e(name)}: MSE ∝ N<sup>{t['network_slope']:.2f}</sup> (network), "
                     f"N<sup>{t['baseline_slope']:.2f}</sup> (ridge); {where}</li>")
    return ("<p>Where the curves are heading (power laws fitted to the points above; an "
            f"extrapolation that assumes both keep their slopes):</p><ul>{''.join(lines)}</ul>")


def _saturating_html(curve: Mapping) -> str:
    """Per parameter and model the fit MSE = L_min + c N^-alpha, and for the network the
    training set at which it would reach the Fisher bound of the two-point function."""
    crossing = curve.get("fisher_crossing_simulations") or {}
    rows = []
    for name, fits in curve["saturating"].items():
        cells = "".join(f"<td>{_number(fit['L_min'])}</td><td>{_number(fit['alpha'])}</td>" if fit
                        else "<td colspan='2'>no fit</td>" for fit in fits.values())
        reach = _number(crossing[name]) if crossing.get(name) is not None else (
            "not reached" if crossing else "no bound")
        rows.append(f"<tr><td class='name'>{_e(name)}</td>{cells}<td>{reach}</td></tr>")
    head = "".join(f"<th>{_e(model)} L<sub>min</sub></th><th>{_e(model)} α</th>" for model in
                   next(iter(curve["saturating"].values())))
    return ("<p>Saturating fits MSE = L<sub>min</sub> + c N<sup>−α</sup> (three or more training-set "
            "sizes; Bairagi, Wandelt & Villaescusa-Navarro 2025 find α ≈ 0.39), and the training "
            "simulations at which the network's fit would reach the Fisher bound of the two-point "
            "function for one sample (not reached: the fit levels off above it):</p><table><tr>"
            f"<th class='name'>parameter</th>{head}<th>N at the Fisher bound</th></tr>{''.join(rows)}"
            "</table>")


def _coverage_rows(label: str, diagnosed: Mapping) -> str:
    """One row of the coverage table: coverage of the 68% and 95% credible regions per
    parameter and joint, the TARP distance, the SBC p-values, whether each test passed."""
    coverage = diagnosed["coverage"]
    cells = "".join(f"<td>{_number(value)}</td>" for hits in coverage["coverage"].values() for value in hits)
    verdicts = ", ".join(f"{test} {'pass' if diagnosed[test]['calibrated'] else 'FAIL'}"
                         for test in ("coverage", "tarp", "sbc"))
    sbc = ", ".join(f"{_number(p)}" for p in diagnosed["sbc"]["p_values"].values())
    tarp = diagnosed["tarp"]
    return (f"<tr><th>{_e(label)} ({diagnosed['n_posteriors']})</th>{cells}"
            f"<td>{_number(tarp['distance'])} / {_number(tarp['distance_band'])}</td>"
            f"<td>{sbc}</td><td>{_number(diagnosed['mean_log_density'])}</td><td>{_e(verdicts)}</td></tr>")


def _posteriors_html(posteriors: Mapping) -> str:
    """The posterior calibration of the network and the posterior baselines (metrics.json's
    ``posteriors``): per model, per sample, and per simulation before and after the covariance
    inflation fitted on the validation split; then the network's gain over each baseline."""
    models = {name: entry for name, entry in posteriors.items() if name != "gain"}
    rows = []
    for name, entry in models.items():
        simulations = entry["per_simulation"]
        rows += [(f"{name}, per sample", entry["per_sample"]),
                 (f"{name}, per simulation", simulations["before"]),
                 (f"{name}, per simulation, inflated x{simulations['inflation']:.3g}", simulations["after"])]
    coverage = models["network"]["per_sample"]["coverage"]
    levels = [f"{level:.0%}" for level in coverage["levels"]]
    head = "".join(f"<th>{_e(name)} {level}</th>" for name in coverage["coverage"] for level in levels)
    band = ", ".join(f"{level}: {_number(low)} to {_number(high)}"
                     for level, (low, high) in zip(levels, coverage["band_2sigma"]))
    return ("<p>Coverage of the credible regions of the network and of the posterior baselines "
            "(the same Gaussian head on the summary statistics) on the evaluation split: the fraction "
            "of true parameters inside the 68% and 95% regions (per parameter: equal-tailed "
            "intervals; joint: highest density), the TARP distance from the diagonal against its "
            "99% band, the SBC rank tests' p-values and the mean log posterior density of the "
            f"truths. Binomial 2-sigma band per sample: {_e(band)}.</p>"
            f"<table><tr><th></th>{head}<th>TARP D / band</th><th>SBC p</th><th>mean log density</th>"
            f"<th>tests</th></tr>" + "".join(_coverage_rows(label, d) for label, d in rows) + "</table>"
            + _gain_html(posteriors["gain"]))


def _gain_html(gain: Mapping) -> str:
    """Per baseline: its posterior standard deviation over the network's per parameter and the
    network's figure of merit over its, with bootstrap intervals; or who failed calibration."""
    names = list(next(iter(gain["models"].values()))["sigma_ratio"]) if gain["models"] else []
    head = "".join(f"<th>σ ratio {_e(name)}</th>" for name in names)
    rows, excluded = [], []
    for model, entry in gain["models"].items():
        if entry["excluded"]:
            why = "; ".join(f"{who}: {', '.join(tests)}" for who, tests in entry["excluded"].items())
            excluded.append(f"<li>{_e(model)}: not compared, calibration failed ({_e(why)})</li>")
        cells = "".join(f"<td>{_interval(entry['sigma_ratio'][name])}</td>" for name in names)
        rows.append(f"<tr><td class='name'>{_e(model)}</td>{cells}"
                    f"<td>{_interval(entry['fom_ratio'])}</td></tr>")
    listed = f"<ul>{''.join(excluded)}</ul>" if excluded else ""
    return (f"<h3>Information gain of the network</h3><p>From the calibrated (inflated) per-simulation "
            "posteriors: per parameter the RMS posterior standard deviation of each baseline over "
            "the network's, and the network's figure of merit (det Σ)<sup>−1/2</sup> over the "
            "baseline's (geometric means over the simulations); above 1 the network's posteriors "
            f"are the narrower. Intervals: a bootstrap over the {_number(gain['n_simulations'])} "
            f"simulations ({_number(gain['n_resamples'])} resamples, "
            f"{_number(gain['interval'][0])}th to {_number(gain['interval'][1])}th percentile). "
            "Only posteriors that pass every calibration test are compared.</p>"
            f"<table><tr><th class='name'>baseline</th>{head}<th>FoM network / baseline</th></tr>"
            f"{''.join(rows)}</table>{listed}")


def _fisher_comparison_html(rows: Mapping) -> str:
    models = list(next(iter(rows.values()))["rmse"])
    head = "".join(f"<th>RMSE {_e(m)}</th>" for m in models)
    body = "".join(
        f"<tr><td class='name'>{_e(n)}</td><td>{_number(r['fisher_sigma'])}</td>"
        + "".join(f"<td>{_number(r['rmse'][m])}</td>" for m in models) + "</tr>"
        for n, r in rows.items())
    return ("<p>The Fisher bound of the power spectrum for one sample beside each model's "
            "per-sample test RMSE. The bound holds at the fiducial point; the RMSEs average over "
            "the sampled range, so the comparison is indicative, not exact.</p>"
            f"<table><tr><th class='name'>parameter</th><th>Fisher σ (P(k))</th>{head}</tr>"
            f"{body}</table>")


def render_report(
    *,
    title: str,
    configuration: Mapping,
    dataset: Mapping,
    metrics: Mapping[str, Mapping],
    figures: Sequence[Figure],
    flagged: Sequence[Mapping],
    n_validated: int | None = None,
    fisher: Mapping | None = None,
    notes: Sequence[str] = (),
    uncertainty: Mapping | None = None,
    combination: Mapping | None = None,
    learning_curve: Mapping | None = None,
    choices: Mapping | None = None,
    posteriors: Mapping | None = None,
    best: str | None = None,
) -> str:
    """The report's HTML text.

    configuration: the run's configuration (nested mapping, shown flattened); dataset: sizes
    (e.g. simulations and samples per split, sample shape); metrics: {model: the output of
    :func:`analysis.metrics.evaluate`}, network first; figures: written :class:`Figure`\\ s;
    flagged: :func:`analysis.simulation_validation.flagged_simulations`; n_validated: how many
    simulations were validated; fisher: {"forecast": FisherForecast.summary(), "convergence":
    fisher_convergence(...)} or None; notes: paragraphs of plain text shown under the metrics.
    uncertainty: :func:`analysis.metrics.bootstrap_mse` of the evaluated models; combination: the
    network combined with the best baseline (metrics.json's ``combination``); learning_curve:
    the learning-curve record of analysis.jobs; choices: how each model's hyperparameters were
    chosen (shown flattened); posteriors: the calibration of the network's and the posterior
    baselines' posteriors and the network's gain (metrics.json's ``posteriors``) or None; best:
    the best baseline but the mean (the headline's reference) or None.
    """
    if not metrics:
        raise PipelineError("The report needs the metrics of at least one model.")
    names = next(iter(metrics.values()))["parameters"]
    parts = [f"<h1>{_e(title)}</h1>",
             f"<p class='note'>CosmoFlow pipeline {_e(CODE_VERSION)}: parameter estimation by "
             f"the network against baselines fitted on the same training split, chosen on the "
             f"validation split and evaluated on the test split.</p>"]
    if uncertainty:
        gain = (posteriors or {}).get("gain")
        parts.append(f"<h2>The answer</h2>{_headline_html(uncertainty, best, names, gain)}")
    parts.append("<h2>Figures</h2>")
    parts += [_figure_html(figure) for figure in figures]
    parts.append("<h2>Tables</h2>")

    def collapsed(summary: str, body: str) -> None:
        parts.append(f"<details><summary>{_e(summary)}</summary>{body}</details>")

    collapsed("Metrics", "".join(f"<h3>{_e(label)}</h3>{_metrics_table(metrics, level, names)}"
                                 for level, label in LEVELS)
              + "<p class='note'>" + "; ".join(f"{_e(k)}: {_e(v)}" for k, v in DEFINITIONS.items())
              + ". Bold: the best model in the row. The paper's relative errors come from 12,632 "
              "simulations of 512³ particles in 512 Mpc/h boxes.</p>"
              + "".join(f"<p>{_e(note)}</p>" for note in notes))
    if uncertainty:
        collapsed("Uncertainty of the errors", _uncertainty_html(uncertainty, names))
    if combination:
        collapsed("Network and baseline combined", _combination_html(combination, names))
    if posteriors:
        collapsed("Posterior calibration", _posteriors_html(posteriors))
    if learning_curve:
        collapsed("Learning curves in data", _learning_curve_html(learning_curve, names))
    if fisher:
        collapsed("Fisher forecast", _fisher_html(fisher) + (
            _fisher_comparison_html(fisher["against_errors"]) if fisher.get("against_errors") else ""))
    if flagged:
        items = "".join(
            f"<li class='flagged'>simulation {_e(f.get('sim_id'))} ({_e(f.get('path', ''))}): "
            f"{_e('; '.join(f.get('reasons', [])))}</li>" for f in flagged)
        validation = (f"<p>{len(flagged)} of {_number(n_validated) if n_validated is not None else '?'} "
                      f"simulations flagged:</p><ul>{items}</ul>")
    else:
        validation = (f"<p>No simulation flagged"
                      f"{f' (of {n_validated} validated)' if n_validated is not None else ''}.</p>")
    collapsed("Simulation validation", validation)
    if choices:
        collapsed("Hyperparameter choices", "<p>Every choice was made on the validation split, "
                  f"never on the test split.</p>{_key_value_table(choices)}")
    collapsed("Data set", _key_value_table(dataset))
    collapsed("Configuration", _key_value_table(configuration))
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def write_report(path: str | os.PathLike, **content) -> Path:
    """Render (:func:`render_report`, same keyword arguments) and write ``path`` atomically."""
    atomic_write_text(path, render_report(**content))
    return Path(path)
