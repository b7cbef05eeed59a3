"""How long Snakemake takes to plan the paper preset, and how many jobs it plans.

Runs `snakemake -n` on config/paper.yaml and, as the peer measured in the same run, on the
tiny default (Snakemake's fixed start-up cost). Goal: the paper plan in under 30 s with
hundreds of jobs, not tens of thousands. Then counts the sbatch submissions the paper preset
makes through profiles/slurm, whose job groups bundle each simulation batch's stages (goal:
hundreds). Last line: one JSON object.

    python bench/plan.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def snakemake_dry_run(config: Path, workdir: Path, *options: str) -> tuple[float, str]:
    """Seconds for `snakemake -n` and its output."""
    start = time.perf_counter()
    result = subprocess.run(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "-n",
         "--configfile", str(config), *options],
        capture_output=True, text=True, cwd=REPO,
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"snakemake -n {' '.join(options)} failed for {config}:\n{result.stderr}")
    return seconds, result.stdout + result.stderr


def dry_run(config: Path, workdir: Path) -> tuple[float, int]:
    """Seconds for `snakemake -n` and the total number of jobs it plans."""
    seconds, output = snakemake_dry_run(config, workdir, "--quiet", "rules")
    return seconds, int(re.search(r"^total\s+(\d+)$", output, re.M).group(1))


def slurm_submissions(config: Path, workdir: Path) -> int:
    """sbatch jobs of a dry run through profiles/slurm: each group job, and each job outside a
    group (the dry run prints those unindented), but the target rule `all`, which has no
    command and never leaves the head node."""
    _, output = snakemake_dry_run(config, workdir, "--workflow-profile", str(REPO / "profiles" / "slurm"))
    return len(re.findall(r"\] Group job |^rule (?!all:)\w+:$", output, re.M))


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        tiny_s, tiny_jobs = dry_run(REPO / "config" / "config.yaml", Path(workdir))
        paper_s, paper_jobs = dry_run(REPO / "config" / "paper.yaml", Path(workdir))
        submissions = slurm_submissions(REPO / "config" / "paper.yaml", Path(workdir))
    print(f"tiny  preset: {tiny_jobs:6d} jobs planned in {tiny_s:6.2f} s (Snakemake start-up floor)")
    print(f"paper preset: {paper_jobs:6d} jobs planned in {paper_s:6.2f} s ({paper_s / tiny_s:.2f} x the floor)")
    print(f"paper preset on profiles/slurm: {submissions} sbatch jobs (goal: hundreds)")
    print(json.dumps({"paper_dry_run_s": round(paper_s, 2), "paper_jobs": paper_jobs,
                      "paper_over_tiny": round(paper_s / tiny_s, 2), "paper_slurm_jobs": submissions}))


if __name__ == "__main__":
    main()
