"""The README's main command, ``snakemake --cores all``, against its simulations alone.

Runs the whole pipeline on ``--config`` (default config/config.yaml, the tiny default; ``--set
KEY=VALUE`` changes keys as ``cosmoflow --set`` does) in a fresh temporary directory, every stage
from the parameter design to the analysis report, and reads the wall seconds of its jobs from
Snakemake's benchmark files (results/<run>/benchmarks/, ``s``). Figures:

* ``main_s``: wall seconds of the main command, Snakemake's start-up included; ``main_cpu_s``
  the CPU seconds (user + system) of it and every process it started. On a busy machine
  ``main_cpu_s`` / cores estimates the idle wall time. Goal for the tiny default: at most
  300 s on an idle 2-core machine.
* ``simulations_s``: the floor measured in the same run, the wall seconds of the
  initial_conditions and simulate jobs, each weighted by the share of the cores it holds
  (its threads / the cores): what the simulations alone take with the cores kept full.
* ``main_over_simulations``: the ratio, the cost of everything after the N-body runs
  (histograms, TFRecords, training, analysis) in units of the simulations.
* the seconds of each stage's jobs, so weighted, are printed with the details.

Last line: one JSON object.

    python bench/main_command.py [--config config/config.yaml] [--set KEY=VALUE ...] [--quick]

As long as the main command itself (the tiny default: about 13 minutes on an idle 2-core AMD EPYC
of family 25); ``--quick`` (8 simulations of 16^3 particles, one epoch, one batch; about 100 CPU seconds,
a minute on 2 idle cores) checks that it runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first, as every entry point of the pipeline (Snakemake inherits it)

import yaml

from machine import cpu_description, cpu_line
from quick_mode import parse_arguments
from workflow.config import load_config
from workflow.stages import STAGES

REPO = Path(__file__).resolve().parents[1]
SIMULATIONS = ("initial_conditions", "simulate")
"""The stages whose jobs make the floor."""
QUICK = {"set": ["sampling.n_simulations=8", "sampling.splits={train: 0.5, val: 0.25, test: 0.25}",
                 "simulation.sims_per_job=8", "simulation.box_size=64.0", "simulation.n_particles=16",
                 "simulation.n_steps=4", "simulation.threads=1", "preprocessing.grid=16",
                 "preprocessing.subvolume=8", "preprocessing.samples_per_file=8", "training.epochs=1"]}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stage_seconds(run: Path, config: dict, cores: int) -> dict[str, float]:
    """Each stage's job wall seconds from Snakemake's benchmark files, each job weighted by its
    threads / ``cores`` (the share of the machine it holds)."""
    seconds = {}
    for stage in STAGES:
        share = min(stage.resources(config).get("threads", 1), cores) / cores
        files = sorted((run / "benchmarks" / stage.name).glob("*.tsv"))
        if files:
            seconds[stage.name] = share * sum(float(row["s"]) for path in files
                                              for row in csv.DictReader(path.open(), delimiter="\t"))
    return seconds


def main(config_path: Path, assignments: list[str]) -> None:
    config = load_config(config_path, [*assignments, "results_dir=results"])
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as workdir:
        run_config = Path(workdir) / "config.yaml"
        run_config.write_text(yaml.safe_dump(config), encoding="utf-8")
        start, cpu = time.perf_counter(), children_cpu_s()
        result = subprocess.run(["snakemake", "-s", str(REPO / "Snakefile"), "--directory", workdir,
                                 "--cores", "all", "--configfile", str(run_config)],
                                capture_output=True, text=True, cwd=REPO)
        main_s, main_cpu_s = time.perf_counter() - start, children_cpu_s() - cpu
        if result.returncode != 0:
            sys.exit(f"snakemake --cores all failed for {config_path}:\n{result.stderr[-3000:]}")
        stages = stage_seconds(Path(workdir) / "results" / config["run_name"], config, cores)
    simulations_s = sum(stages[name] for name in SIMULATIONS)
    print(cpu_line())
    print(f"main command: {main_s:7.1f} s wall, {main_cpu_s:7.1f} CPU s ({main_cpu_s / cores:.1f} s "
          f"on {cores} idle cores)")
    print(f"simulations : {simulations_s:7.1f} s (initial conditions + simulate jobs, the floor)")
    print(f"main / simulations: {main_s / simulations_s:.2f}")
    print(json.dumps({"config": str(config_path), "set": assignments, "cores": cores,
                      "cpu": cpu_description(),
                      "stage_seconds": {name: round(s, 1) for name, s in stages.items()}}))
    print(json.dumps({"main_s": round(main_s, 1), "main_cpu_s": round(main_cpu_s, 1),
                      "simulations_s": round(simulations_s, 1),
                      "main_over_simulations": round(main_s / simulations_s, 2),
                      "cpu_model": cpu_description()["model"]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml",
                        help="configuration to run (default config/config.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change a key of the configuration (as cosmoflow --set); repeatable")
    arguments = parse_arguments(parser, QUICK)
    main(arguments.config, arguments.set)
