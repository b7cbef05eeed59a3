"""Parsl's overhead: ``cosmoflow ensemble`` against direct calls of the same stage functions.

The peer runs, in one fresh Python process, :func:`workflow.stages.run_stage` for every job of
the ensemble (sampling, each batch's initial conditions, simulation and histogram, each
TFRecord shard, the manifest), one after another, in the order of
:func:`workflow.parsl.ensemble.plan`. The measured run is ``cosmoflow ensemble`` with
``--workers`` local HighThroughputExecutor workers (default 1, so both do the jobs one at a
time with the same threads each). Both start from an empty run directory (the same path: the
same batches, the same files) and are timed from outside, interpreter start-up and imports
included; they alternate over ``--repeats`` rounds and the best of each is kept.

Figures: ``overhead_fraction`` = Parsl wall time / direct wall time - 1 (goal <= 0.05 on the
tiny config); ``empty_task_ms`` = mean round trip of an app that does nothing, submitted and
awaited one at a time on a warm local HighThroughputExecutor (goal <= 50 ms). Last line: one
JSON object.

    python bench/parsl_overhead.py [--config config/config.yaml] [--workers 1] [--repeats 2]
                                   [--tasks 200] [--quick]

``--quick`` (one round on the config shrunk to 4 simulations of 16^3 particles, QUICK_CONFIG,
and 20 empty apps; about a minute on 2 cores) checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first, as every entry point of the pipeline (the workers inherit it)

import yaml

from machine import cpu_description
from quick_mode import parse_arguments
from workflow.config import dump_config, load_config, run_directory
from workflow.paths import RunLayout

REPO = Path(__file__).resolve().parents[1]
QUICK_CONFIG = {  # --quick: changes to the config, one batch of 4 tiny simulations
    "sampling": {"n_simulations": 4, "splits": {"train": 0.5, "val": 0.25, "test": 0.25}},
    "simulation": {"sims_per_job": 4, "box_size": 64.0, "n_particles": 16, "n_steps": 4},
    "initial_conditions": {"z_init": 15.0},
    "preprocessing": {"grid": 16, "subvolume": 8, "samples_per_file": 8},
}


def direct(config_path: str) -> None:
    """The peer: every job of the ensemble, in this process, one after another."""
    from workflow.logs import configure_logging
    from workflow.parsl.ensemble import plan
    from workflow.stages import run_stage

    configure_logging("WARNING")
    config = load_config(config_path)
    run = RunLayout(run_directory(config).absolute())
    run.root.mkdir(parents=True, exist_ok=True)
    run.config_record.write_text(dump_config(config))
    for unit in plan(config):
        run_stage(unit.stage, run, unit.stage.config_slice(config), **unit.selection)


def timed_command(command: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return seconds


def empty_task_ms(work: Path, n: int) -> float:
    """Mean round trip of an empty app on a warm local HighThroughputExecutor (1 worker)."""
    from parsl.app.python import PythonApp
    from parsl.dataflow.dflow import DataFlowKernel

    from workflow.config import validate_config
    from workflow.parsl.configs import ENSEMBLE_LABEL, ensemble_config

    config = validate_config({"parsl": {"workers_per_node": 1}})
    dfk = DataFlowKernel(ensemble_config(config, work / "runinfo"))
    try:
        app = PythonApp(_empty, data_flow_kernel=dfk, executors=[ENSEMBLE_LABEL])
        for _ in range(20):  # the worker up and warm
            app().result()
        start = time.perf_counter()
        for _ in range(n):
            app().result()
        return (time.perf_counter() - start) / n * 1e3
    finally:
        dfk.cleanup()


def _empty():
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "config" / "config.yaml"),
                        help="the ensemble's config")
    parser.add_argument("--workers", type=int, default=1,
                        help="Parsl workers (default 1, as the direct peer)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternated rounds, best kept (default 2)")
    parser.add_argument("--tasks", type=int, default=200, help="empty apps timed (default 200)")
    parser.add_argument("--direct", metavar="CONFIG", help=argparse.SUPPRESS)  # the peer's process
    args = parse_arguments(parser, {"repeats": 1, "tasks": 20})
    if args.direct:
        direct(args.direct)
        return

    with tempfile.TemporaryDirectory(prefix="bench-parsl-") as tmp:
        work = Path(tmp)
        config = yaml.safe_load(Path(args.config).read_text())
        for section, changes in (QUICK_CONFIG.items() if args.quick else ()):
            config[section] = {**config.get(section, {}), **changes}
        config.update(results_dir=str(work / "results"), run_name="bench")
        config.setdefault("parsl", {})["workers_per_node"] = args.workers
        config_path = work / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        validated = load_config(config_path)
        run_dir = run_directory(validated)
        from workflow.parsl.ensemble import plan

        jobs = len(plan(validated))
        runs = {"direct": [sys.executable, __file__, "--direct", str(config_path)],
                "parsl": [sys.executable, "-m", "workflow.cli", "ensemble", "--config",
                          str(config_path)]}
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.repeats):
            for name in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
                shutil.rmtree(run_dir, ignore_errors=True)
                seconds[name].append(timed_command(runs[name], work))
                print(f"round {round_ + 1}: {name} {seconds[name][-1]:.1f} s", flush=True)
        empty = empty_task_ms(work, args.tasks)
    best = {name: min(values) for name, values in seconds.items()}
    figures = {
        "overhead_fraction": round(best["parsl"] / best["direct"] - 1, 4),
        "empty_task_ms": round(empty, 2),
        "parsl_seconds": round(best["parsl"], 2), "direct_seconds": round(best["direct"], 2),
        "all_seconds": {name: [round(s, 2) for s in values] for name, values in seconds.items()},
        "jobs": jobs, "workers": args.workers, "cpu": cpu_description(), "cores": os.cpu_count(),
    }
    print(f"Parsl ensemble {best['parsl']:.1f} s vs direct calls {best['direct']:.1f} s over "
          f"{jobs} jobs ({args.workers} worker(s)): overhead "
          f"{figures['overhead_fraction']:+.1%} (goal <= 5%); empty app round trip "
          f"{empty:.1f} ms (goal <= 50 ms)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
