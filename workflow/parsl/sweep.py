"""``cosmoflow sweep``: a hyperparameter search, training trials run concurrently through Parsl.

The trials come from the ``sweep`` config section: every combination of the values of
``sweep.space`` (grid search) or ``sweep.trials`` distinct combinations drawn with
``sweep.seed`` (random search), over learning rate, batch size, model width and optimiser. A
trial is the ``train`` stage of the stage table (workflow/stages.py) with those keys set, a
short ``sweep.epochs`` and its outputs moved to ``sweeps/<name>/<trial>/``: the command
``cosmoflow train --set ... --output-dir ...``, launched on ``sweep.ranks`` MPI ranks by
Parsl's MPIExecutor (``$PARSL_MPI_PREFIX``: mpiexec here, srun on Slurm). Trials are named
after their values (``lr0.0005_bs16_w1_adam``), so a changed space reuses the directories of
the combinations it keeps.

``sweeps/<name>/sweep.csv`` lists each trial's values, validation loss (the last epoch's
``val_loss``), validation MSE over the predict-the-training-mean baseline's (run.json
``validation``, the mean over the parameters and each parameter's), seconds and status, and
marks the best (lowest MSE ratio). Parsl's memoizer checkpoints every finished trial
(``checkpoint_mode='task_exit'``, in ``sweeps/<name>/parsl/``); a rerun loads those
checkpoints and runs only the trials that are not done, including those a kill interrupted,
which resume from their own last training checkpoint. A trial reruns when its values, the
training settings, the data set (the manifest's sha256) or the code version change.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import logging
import math
import sys
from pathlib import Path
from typing import TextIO

from workflow.config import dump_config, run_directory, schema_keys
from workflow.errors import PipelineError
from workflow.io import atomic_write_text
from workflow.paths import RunLayout
from workflow.stages import TRAIN
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

TUNING = ("enabled", "concurrent", "threads", "nodes")
"""Keys of the sweep section that change how trials run, not what they give."""


def trial_settings(config: dict) -> dict:
    """The train stage's params that trials keep: all but those a trial sets itself (the
    space's keys, epochs, ranks, nodes)."""
    overridden = set(schema_keys("sweep.space")) | {"epochs", "ranks", "nodes"}
    params = TRAIN.params(config)
    return {**params, "training": {k: v for k, v in params["training"].items() if k not in overridden}}


def sweep_params(config: dict) -> dict:
    """What a sweep's results depend on (rule sweep's params): its section but the tuning keys,
    and the training settings the trials keep."""
    section = {key: value for key, value in config["sweep"].items() if key not in TUNING}
    return {"sweep": section, **trial_settings(config)}


def trial_name(values: dict) -> str:
    """``lr<learning_rate>_bs<batch_size>_w<width>_<optimizer>``."""
    return (f"lr{values['learning_rate']:g}_bs{values['batch_size']}_w{values['width']:g}_"
            f"{values['optimizer']}")


def trials(config: dict) -> dict[str, dict]:
    """The trials of the sweep, by name: each a dict of ``sweep.space`` keys to values."""
    import numpy as np

    sweep = config["sweep"]
    keys = schema_keys("sweep.space")
    combinations = [dict(zip(keys, values))
                    for values in itertools.product(*(sweep["space"][k] for k in keys))]
    if sweep["search"] == "random":
        drawn = np.random.default_rng(sweep["seed"]).choice(len(combinations), sweep["trials"],
                                                            replace=False)
        combinations = [combinations[int(i)] for i in drawn]
    return {trial_name(values): values for values in combinations}


def _fingerprint(config: dict, run: RunLayout) -> str:
    """The data set and the training settings a trial starts from (not its own values)."""
    from preprocessing.jobs import load_staged_record

    staged = load_staged_record(run.staged_record)
    text = json.dumps({"train": trial_settings(config), "data": staged["source_manifest_sha256"],
                       "epochs": config["sweep"]["epochs"], "code_version": CODE_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def trial_command(config_path: Path, trial_dir: Path, values: dict, sweep: dict) -> list[str]:
    """The trial's ``cosmoflow train`` command (without the MPI launcher or threads)."""
    settings = {**{f"training.{key}": value for key, value in values.items()},
                "training.epochs": sweep["epochs"], "training.ranks": sweep["ranks"],
                "training.nodes": sweep["nodes"]}
    command = [sys.executable, "-m", "workflow.cli", TRAIN.command, "--config", str(config_path),
               "--output-dir", str(trial_dir)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"]
    return command


def run_sweep(config: dict, stream: TextIO = sys.stderr) -> list[dict]:
    """Run the sweep of ``config`` (validated); write sweep.csv; return its rows.

    Raises PipelineError when the data set is not staged, when interrupted (finished trials are
    kept for the rerun) or when a trial failed (after writing sweep.csv with its row).
    """
    from parsl.app.python import PythonApp

    from workflow.parsl.apps import run_trial
    from workflow.parsl.configs import SWEEP_LABEL, sweep_config, trial_resources
    from workflow.parsl.progress import as_completed, parsl_run

    sweep = config["sweep"]
    if config["training"]["validation_split"] is None:
        raise PipelineError("key 'training.validation_split' = None leaves the sweep nothing to rank "
                            "its trials by; name a split")
    run = RunLayout(run_directory(config).absolute())
    files = run.sweep(sweep["name"])
    fingerprint = _fingerprint(config, run)  # fails first, naming staged.json, if there is no data set
    # the run's configuration, its results directory made absolute so that trials find the data
    atomic_write_text(files.config, dump_config({**config, "results_dir": str(run.root.parent)}))
    atomic_write_text(files.node_file, "localhost\n" * sweep["concurrent"])  # a local block's node list
    chosen = trials(config)
    resources = trial_resources(config)
    results: dict[str, dict] = {}
    cached: list[str] = []
    with parsl_run(sweep_config(config, files.parsl_files.directory, files.node_file), files.parsl_files,
                   f"cosmoflow sweep {sweep['name']}", {"trial": len(chosen)}, stream,
                   config["parsl"]["progress_seconds"],
                   lambda: f"interrupted; {len(results)} of {len(chosen)} trials finished and are kept; "
                   f"rerun `cosmoflow sweep` to run the others") as (dfk, progress):
        app = PythonApp(run_trial, data_flow_kernel=dfk, executors=[SWEEP_LABEL], cache=True,
                        ignore_for_cache=["launch", "marker", "parsl_resource_specification"])
        futures = {}
        for name, values in chosen.items():
            trial = files.trial(name).directory
            futures[app(name, trial_command(files.config, trial, values, sweep), str(trial),
                        fingerprint, launch=["--set", f"training.threads={sweep['threads']}"],
                        marker=str(progress.running_dir / f"trial.{name}"),
                        parsl_resource_specification=dict(resources))] = name
        for future in as_completed(futures, progress):
            name = futures[future]
            error = future.exception()
            if error is None:
                results[name] = {**future.result(), "status": "done"}
                if future.task_record["status"].name == "memo_done":
                    cached.append(name)
                progress.finished("trial", name not in cached, results[name]["seconds"])
            else:
                attempts = future.task_record["fail_count"]
                results[name] = {"status": "failed", "error": f"{error} (after {attempts} attempts)"}
                progress.finished("trial", None)
    if cached:
        log.info("%d trial(s) taken from Parsl's checkpoints: %s", len(cached), ", ".join(cached))
    rows = write_table(files.table, chosen, results, sweep)
    failed = [row for row in rows if row["status"] != "done"]
    best = next((row for row in rows if row["best"]), None)
    if best:
        print(f"best trial of sweep {sweep['name']}: {best['trial']} (validation MSE / baseline "
              f"{best['val_mse_over_baseline']}, val_loss {best['val_loss']}); table: "
              f"{files.table}", file=stream)
    if failed:
        raise PipelineError(f"{len(failed)} of {len(rows)} trials failed: " + "; ".join(
            f"{row['trial']}: {results[row['trial']]['error']}" for row in failed))
    return rows


def _rank(row: dict) -> tuple:
    """Lower is better: the validation MSE ratio, then the validation loss (missing or NaN: last)."""
    return tuple(math.inf if row[key] is None or math.isnan(row[key]) else row[key]
                 for key in ("val_mse_over_baseline", "val_loss"))


def write_table(path: Path, chosen: dict[str, dict], results: dict[str, dict], sweep: dict) -> list[dict]:
    """Write sweep.csv (one row per trial, in trial order) atomically; return the rows."""
    parameters = list(dict.fromkeys(name for result in results.values() for name in result.get("ratios", {})))
    rows = []
    for name, values in chosen.items():
        result = results.get(name, {"status": "not run"})
        rows.append({"trial": name, **values, "epochs": sweep["epochs"], "ranks": sweep["ranks"],
                     "val_loss": result.get("val_loss"),
                     "val_mse_over_baseline": result.get("val_mse_over_baseline"),
                     **{f"{p}_mse_over_baseline": result.get("ratios", {}).get(p) for p in parameters},
                     "seconds": result.get("seconds"), "status": result["status"], "best": False})
    finished = [row for row in rows if row["status"] == "done"]
    if finished:
        min(finished, key=_rank)["best"] = True
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: "" if value is None else value for key, value in row.items()} for row in rows)
    atomic_write_text(path, text.getvalue())
    return rows
