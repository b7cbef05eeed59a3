"""How long Snakemake takes to plan the paper preset, and how many jobs it plans.

Runs `snakemake -n` on config/paper.yaml and, as the peer measured in the same run, on the
tiny default (Snakemake's fixed start-up cost), each the best of three (``--repeats``), with
the CPU seconds the run used. Goal: the paper plan in at most 5 s on an idle 2-core machine,
with hundreds of jobs, not tens of thousands. Then counts the sbatch submissions the paper
preset makes through profiles/slurm, whose job groups bundle each simulation batch's stages
(goal: hundreds). Last line: one JSON object.

    python bench/plan.py [--repeats 3] [--quick]

``--quick`` (one plan of each, about 30 s on 2 cores) checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first, as every entry point of the pipeline (Snakemake inherits it)

from quick_mode import parse_arguments

REPO = Path(__file__).resolve().parents[1]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def snakemake_dry_run(config: Path, workdir: Path, *options: str) -> tuple[float, float, str]:
    """Wall seconds and CPU seconds for `snakemake -n`, and its output."""
    start, cpu = time.perf_counter(), children_cpu_s()
    result = subprocess.run(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "-n",
         "--configfile", str(config), *options],
        capture_output=True, text=True, cwd=REPO,
    )
    seconds, cpu = time.perf_counter() - start, children_cpu_s() - cpu
    if result.returncode != 0:
        sys.exit(f"snakemake -n {' '.join(options)} failed for {config}:\n{result.stderr}")
    return seconds, cpu, result.stdout + result.stderr


def dry_run(config: Path, workdir: Path, repeats: int) -> tuple[float, float, int]:
    """Best wall and CPU seconds of `snakemake -n` over ``repeats`` runs, and the jobs planned."""
    runs = [snakemake_dry_run(config, workdir, "--quiet", "rules") for _ in range(repeats)]
    jobs = int(re.search(r"^total\s+(\d+)$", runs[0][2], re.M).group(1))
    return min(r[0] for r in runs), min(r[1] for r in runs), jobs


def slurm_submissions(config: Path, workdir: Path) -> int:
    """sbatch jobs of a dry run through profiles/slurm: each group job, and each job outside a
    group (the dry run prints those unindented), but the target rule `all`, which has no
    command and never leaves the head node."""
    _, _, output = snakemake_dry_run(config, workdir,
                                     "--workflow-profile", str(REPO / "profiles" / "slurm"))
    return len(re.findall(r"\] Group job |^rule (?!all:)\w+:$", output, re.M))


def main(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        tiny_s, tiny_cpu, tiny_jobs = dry_run(REPO / "config" / "config.yaml", Path(workdir),
                                              repeats)
        paper_s, paper_cpu, paper_jobs = dry_run(REPO / "config" / "paper.yaml", Path(workdir),
                                                 repeats)
        submissions = slurm_submissions(REPO / "config" / "paper.yaml", Path(workdir))
    print(f"tiny  preset: {tiny_jobs:6d} jobs planned in {tiny_s:6.2f} s, {tiny_cpu:5.2f} CPU s "
          f"(Snakemake start-up floor)")
    print(f"paper preset: {paper_jobs:6d} jobs planned in {paper_s:6.2f} s, {paper_cpu:5.2f} "
          f"CPU s ({paper_s / tiny_s:.2f} x the floor; goal <= 5 s)")
    print(f"paper preset on profiles/slurm: {submissions} sbatch jobs (goal: hundreds)")
    print(json.dumps({"paper_dry_run_s": round(paper_s, 2),
                      "paper_dry_run_cpu_s": round(paper_cpu, 2), "paper_jobs": paper_jobs,
                      "paper_over_tiny": round(paper_s / tiny_s, 2),
                      "paper_slurm_jobs": submissions}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="plans of each preset, best kept (default 3)")
    main(parse_arguments(parser, {"repeats": 1}).repeats)
