"""How long Snakemake takes to plan the paper preset, and how many jobs it plans.

Runs `snakemake -n` on config/paper.yaml and, as the peer measured in the same run, on the
tiny default (Snakemake's fixed start-up cost). Goal: the paper plan in under 30 s with
hundreds of jobs, not tens of thousands. Last line: one JSON object.

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


def dry_run(config: Path, workdir: Path) -> tuple[float, int]:
    """Seconds for `snakemake -n` and the total number of jobs it plans."""
    start = time.perf_counter()
    result = subprocess.run(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "-n", "--quiet", "rules",
         "--configfile", str(config)],
        capture_output=True, text=True,
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"snakemake -n failed for {config}:\n{result.stderr}")
    total = re.search(r"^total\s+(\d+)$", result.stdout + result.stderr, re.M)
    return seconds, int(total.group(1))


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        tiny_s, tiny_jobs = dry_run(REPO / "config" / "config.yaml", Path(workdir))
        paper_s, paper_jobs = dry_run(REPO / "config" / "paper.yaml", Path(workdir))
    print(f"tiny  preset: {tiny_jobs:6d} jobs planned in {tiny_s:6.2f} s (Snakemake start-up floor)")
    print(f"paper preset: {paper_jobs:6d} jobs planned in {paper_s:6.2f} s ({paper_s / tiny_s:.2f} x the floor)")
    print(json.dumps({"paper_dry_run_s": round(paper_s, 2), "paper_jobs": paper_jobs,
                      "paper_over_tiny": round(paper_s / tiny_s, 2)}))


if __name__ == "__main__":
    main()
