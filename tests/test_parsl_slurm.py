"""`cosmoflow ensemble` through Parsl's SlurmProvider on the local one-node Slurm (tests/slurm/setup.sh).

Select with `pytest -m slurm`; skips where tests/test_slurm.py's fixture skips (no local Slurm).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from conftest import SMALL, run_cli, write_config
from preprocessing.manifest import load_manifest
from test_slurm import slurm  # noqa: F401  (the fixture: a Slurm that answers, or skip)

pytestmark = pytest.mark.slurm

# two blocks (sbatch jobs) of one worker each, sharing the one node
CONFIG = {**SMALL, "run_name": "parsl_slurm", "seed": 5, "parsl": {
    "provider": "slurm", "blocks": 2, "workers_per_node": 1, "retries": 0, "progress_seconds": 5,
    "slurm": {"exclusive": False, "walltime": "00:20:00"}}}


def block_jobs(workdir: Path) -> list[dict]:
    """Jobs Slurm still knows (MinJobAge 600 s) that Parsl submitted from ``workdir``."""
    fields = {"id": "%i", "name": "%j", "state": "%T", "limit": "%l", "workdir": "%Z"}
    out = subprocess.run(["squeue", "--states=all", "--noheader", "--format", "\t".join(fields.values())],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    jobs = [dict(zip(fields, line.split("\t"))) for line in out.splitlines() if line.strip()]
    return [job for job in jobs if Path(job["workdir"]).resolve() == workdir.resolve()
            and job["name"].startswith("parsl.")]


def test_two_block_ensemble_runs_through_the_slurm_provider(slurm, tmp_path):  # noqa: F811
    result = run_cli("ensemble", "--config", write_config(tmp_path, CONFIG), cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "13 job(s) ran" in result.stdout
    jobs = block_jobs(tmp_path)
    # job names: parsl.<executor>.block-<n>.<submit time>
    assert sorted(job["name"].split(".")[2] for job in jobs) == ["block-0", "block-1"], jobs
    assert {job["limit"] for job in jobs} == {"20:00"}  # parsl.slurm.walltime
    # Parsl cancelled them at the end; Slurm ends them soon after (the deadline guards a hang)
    deadline = time.monotonic() + 300
    while {job["state"] for job in jobs} - {"CANCELLED", "COMPLETED"} and time.monotonic() < deadline:
        time.sleep(1)
        jobs = block_jobs(tmp_path)
    assert {job["state"] for job in jobs} <= {"CANCELLED", "COMPLETED"}, jobs
    run = tmp_path / "results" / "parsl_slurm"
    (parsl_run,) = (run / "parsl" / "ensemble").iterdir()
    scripts = [path for path in (parsl_run / "submit_scripts").glob("parsl.ensemble.block-*")
               if path.suffix not in (".stdout", ".stderr")]
    assert len(scripts) == 2 and all("srun --ntasks 1" in path.read_text() for path in scripts)
    # both blocks' workers took jobs
    for block in ("block-0", "block-1"):
        logs = (parsl_run / "ensemble" / block).glob("*/worker_*.log")
        assert sum(log.read_text().count("Received executor task") for log in logs) >= 1, block
    assert len(load_manifest(run / "tfrecords" / "manifest.json").files) == 8
    assert run_cli("verify-data", run).returncode == 0
