"""The closing summary that ``snakemake`` prints when the pipeline finishes (Snakefile,
``onsuccess``): where the run is, what it produced, its headline results and what to run next.
It reads only the run's files, so it describes whatever part of the pipeline has run."""

from __future__ import annotations

import json
from pathlib import Path

from workflow.params_table import read_params_csv
from workflow.paths import RunLayout


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _gain_line(gain: dict) -> str:
    """One line: per parameter the P(k)-alone posterior's standard deviation over the network's
    (metrics.json ``posteriors.gain``), or why it is not compared."""
    entry = gain["models"]["power_spectrum"]
    if entry["excluded"]:
        failed = "; ".join(f"{who}: {', '.join(tests)}" for who, tests in entry["excluded"].items())
        return f"  posterior gain over P(k) alone: not compared, calibration failed ({failed})"
    ratios = ", ".join(f"{name} {value['ratio']:.2f} [{value['ratio_low']:.2f}, {value['ratio_high']:.2f}]"
                       for name, value in entry["sigma_ratio"].items())
    return (f"  posterior sigma of P(k) alone over the network's: {ratios}; figure of merit "
            f"x{entry['fom_ratio']['ratio']:.2f}")


def closing_summary(run: RunLayout) -> str:
    """A few lines on the run directory ``run`` (see the module docstring)."""
    lines = [f"CosmoFlow run {run.root}:"]
    if run.params_csv.is_file():
        lines.append(f"  {len(read_params_csv(run.params_csv))} simulations ({run.params_csv.name})")
    manifest = _json(run.manifest)
    if manifest:
        counts = ", ".join(f"{split} {entry['n_samples']}" for split, entry in manifest["splits"].items())
        lines.append(f"  data set: {len(manifest['files'])} TFRecord files, samples {counts}, "
                     f"shape {manifest['shape']} ({run.manifest})")
    trained = _json(run.training_files.run_record)
    if trained and trained.get("validation"):
        ratios = ", ".join(f"{name} {figures['ratio']:.2f}"
                           for name, figures in trained["validation"]["parameters"].items())
        lines.append(f"  training: validation MSE over the training-mean baseline's: {ratios} "
                     f"({run.training_files.run_record})")
    analysis = _json(run.analysis_files.metrics)
    if analysis:
        models = analysis["models"]
        best = analysis.get("best_baseline")
        for name in analysis["parameters"]:
            network = models["network"]["per_simulation"]["parameters"][name]["relative_error"]
            text = f"  {name}: relative error {network:.3g} (network)"
            if best:
                error = models[best]["per_simulation"]["parameters"][name]["relative_error"]
                text += f", {error:.3g} ({best})"
            lines.append(text + f" on the {analysis['split']} split")
        gain = (analysis.get("posteriors") or {}).get("gain")
        if gain:
            lines.append(_gain_line(gain))
        flagged = len(analysis["simulation_validation"]["flagged"])
        lines.append(f"  simulation validation: {flagged} of "
                     f"{analysis['simulation_validation']['checked']} simulations flagged")
        lines.append(f"  report: {run.analysis_files.report} (open it in a browser)")
    lines.append(f"Next: cosmoflow verify-data {run.root}   |   snakemake --report report.zip   |   "
                 f"rerun one stage: snakemake --forcerun <rule>")
    return "\n".join(lines)
