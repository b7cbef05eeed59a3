"""profiles/slurm against a real one-node Slurm (tests/slurm/setup.sh), with real Snakemake.

Select with `pytest -m slurm`. Every test skips, with the set-up script's reason, on a machine
where Slurm cannot be started (not root, no apt, daemons that do not come up).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SMALL, skip_unless_ci, write_config
from preprocessing.manifest import load_manifest
from workflow.config import validate_config
from workflow.resources import job_memory_mb, job_runtime_min

pytestmark = pytest.mark.slurm

SETUP = REPO / "tests" / "slurm" / "setup.sh"
PROFILE = REPO / "profiles" / "slurm"

# SMALL's 8 simulations of 16^3 particles in one batch (one group job); 2 threads per simulation
# job, so that its sbatch request (2 cpus) differs from the profile's default of 1. Neither
# changes the bytes: the data set is compared with the session's local run of SMALL.
TINY = {**SMALL, "run_name": "slurm",
        "simulation": {**SMALL["simulation"], "threads": 2, "sims_per_job": 8}}
MANIFEST = Path("results") / "slurm" / "tfrecords" / "manifest.json"


@pytest.fixture(scope="module")
def slurm() -> None:
    """A Slurm that answers, started by tests/slurm/setup.sh if need be; else skip with its reason."""
    if not sys.platform.startswith("linux") or shutil.which("bash") is None:
        skip_unless_ci("the local Slurm needs Linux and bash")
    try:
        result = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        skip_unless_ci("tests/slurm/setup.sh did not finish within 600 s")
    lines = (result.stdout.strip().splitlines()
             or [f"slurm-setup: unavailable: no output; {result.stderr.strip()}"])
    if result.returncode != 0 or not lines[-1].startswith("slurm-setup: ready"):
        skip_unless_ci("no local Slurm: " + lines[-1].removeprefix("slurm-setup: unavailable: "))


def squeue_jobs(workdir: Path) -> list[dict]:
    """Every job Slurm still knows (MinJobAge = 600 s) whose working directory is ``workdir``."""
    fields = {"id": "%i", "comment": "%k", "cpus": "%C", "memory": "%m", "limit": "%l",
              "partition": "%P", "state": "%T", "workdir": "%Z"}
    out = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--format", "\t".join(fields.values())],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    jobs = [dict(zip(fields, line.split("\t"))) for line in out.splitlines() if line.strip()]
    return [job for job in jobs if Path(job["workdir"]).resolve() == workdir.resolve()]


def manifest_digests(manifest: Path) -> dict[str, str]:
    return {entry.path: entry.sha256 for entry in load_manifest(manifest).files}


@pytest.fixture(scope="module")
def slurm_run(slurm, small_run, tmp_path_factory):
    """The tiny pipeline to the manifest through the Slurm profile, and the local run of SMALL."""
    slurm_dir = tmp_path_factory.mktemp("slurm")
    result = subprocess.run(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(write_config(slurm_dir, TINY)),
         "--directory", str(slurm_dir), "--workflow-profile", str(PROFILE),
         # poll soon and often: the profile's 40 s first delay is meant for shared clusters
         "--slurm-init-seconds-before-status-checks", "3", "--latency-wait", "10", str(MANIFEST)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "COSMOFLOW_SLURM_ACCOUNT": ""},
    )
    return {"dir": slurm_dir, "local_run": small_run[2], "result": result}


def test_pipeline_runs_through_slurm(slurm_run):
    result = slurm_run["result"]
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert (slurm_run["dir"] / MANIFEST).exists()
    assert "has been submitted with SLURM jobid" in result.stderr


def slurm_time_limit(minutes: int) -> str:
    """A time limit as squeue's %l prints it: M:SS below an hour, else H:MM:SS."""
    return f"{minutes}:00" if minutes < 60 else f"{minutes // 60}:{minutes % 60:02d}:00"


def test_jobs_request_what_the_rules_declare(slurm_run):
    assert slurm_run["result"].returncode == 0
    jobs = squeue_jobs(slurm_run["dir"])
    by_name: dict[str, list[dict]] = {}
    for job in jobs:  # comments: rule_<rule>[_wildcards_...] or rule_<group>_<its rules>
        name = job["comment"].removeprefix("rule_").split("_wildcards_")[0]
        group = "simulation_batch" if name.startswith("simulation_batch") else name
        by_name.setdefault(group, []).append(job)
    # the profile groups each batch's stages into one job (validation is not needed here)
    assert {name: len(js) for name, js in by_name.items()} == {
        "sample_parameters": 1, "simulation_batch": 1, "write_tfrecords": 3, "manifest": 1,
    }, jobs
    assert {job["state"] for job in jobs} == {"COMPLETED"}
    assert {job["partition"] for job in jobs} == {"local"}  # Slurm's default partition

    # a group job asks for the largest cores and memory of its stages and the sum of their time
    # limits; histogram declares none and takes the profile's default-resources (1 cpu, 4000 MB, 60 min)
    config = validate_config(TINY)
    stages = ("initial_conditions", "simulate")
    for job in by_name["simulation_batch"]:
        assert "histogram" in job["comment"] and all(stage in job["comment"] for stage in stages), job
        assert int(job["cpus"]) == TINY["simulation"]["threads"], job
        assert job["memory"] == f"{max(4000, *(job_memory_mb(s, config) for s in stages))}M", job
        assert job["limit"] == slurm_time_limit(60 + sum(job_runtime_min(s, config) for s in stages)), job
    for job in by_name["manifest"]:  # the profile's default-resources
        assert (job["cpus"], job["memory"], job["limit"]) == ("1", "4000M", "1:00:00"), job


def test_slurm_run_writes_the_same_bytes_as_a_local_run(slurm_run):
    assert slurm_run["result"].returncode == 0
    on_slurm = manifest_digests(slurm_run["dir"] / MANIFEST)
    local = manifest_digests(slurm_run["local_run"] / "tfrecords" / "manifest.json")
    assert len(on_slurm) == 8 and on_slurm == local  # 8 simulations x 8 sub-volumes, 8 per file


def srun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", "--nodes=1", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


WORLD_SIZE = "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())"


def test_two_tasks_form_one_world_with_pmi2(slurm):
    result = srun("-n", "2", "--mpi=pmi2", sys.executable, "-c", WORLD_SIZE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "2"]


def test_two_tasks_without_pmi_are_two_worlds(slurm):
    """MpiDefault=none: without --mpi=pmi2 each task is a world of its own (why the profile sets it)."""
    result = srun("-n", "2", "--mpi=none", sys.executable, "-c", WORLD_SIZE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


# A rule named like the pipeline's MPI rule, so the profile's set-resources apply to it.
MPI_SNAKEFILE = f"""
rule train:
    output: "world_sizes.txt"
    resources: tasks=2, mpi="mpiexec"
    shell: "{{resources.mpi}} -n {{resources.tasks}} {sys.executable} -c {WORLD_SIZE!r} > {{output}}"
"""


def test_profile_launches_an_mpi_rule_as_one_world(slurm, tmp_path):
    (tmp_path / "Snakefile").write_text(MPI_SNAKEFILE)
    result = subprocess.run(
        ["snakemake", "--directory", str(tmp_path), "--workflow-profile", str(PROFILE),
         "--slurm-init-seconds-before-status-checks", "3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "srun --mpi=pmi2 -n 2" in result.stdout + result.stderr  # printshellcmds
    assert (tmp_path / "world_sizes.txt").read_text().split() == ["2", "2"]
    (job,) = squeue_jobs(tmp_path)
    assert (job["comment"], job["cpus"], job["state"]) == ("rule_train", "2", "COMPLETED")


def test_world_communicator_refuses_tasks_that_are_not_one_world(slurm):
    """The guard: Slurm launched 2 tasks, MPI sees 1 rank each, so training must not start."""
    code = "from training.mpi import world_communicator; world_communicator()"
    result = srun("-n", "2", "--mpi=none", sys.executable, "-c", code, timeout=300)
    assert result.returncode != 0, result.stdout + result.stderr
    # each task's error names the 2 tasks Slurm started and the cure, srun --mpi=pmi2
    messages = [line for line in result.stderr.splitlines()
                if line.startswith("workflow.errors.PipelineError:")]
    assert len(messages) == 2, result.stderr[-2000:]
    assert all("2" in line and "pmi2" in line for line in messages), messages
    # and with PMI-2 the same call is fine
    assert srun("-n", "2", "--mpi=pmi2", sys.executable, "-c", code, timeout=300).returncode == 0


def test_async_training_runs_as_one_world_under_srun(slurm, tmp_path):
    """training.mode: async through the profile's launcher: its window spans the srun tasks."""
    import json

    from mpi_training import write_dataset

    manifest = write_dataset(tmp_path / "data", {"train": 4}, seed=3)
    settings = {"epochs": 1, "batch_size": 8, "threads": 1, "validation_split": None,
                "mode": "async", "max_staleness": 2}
    result = srun("-n", "2", "--mpi=pmi2", sys.executable, str(REPO / "tests" / "mpi_training.py"),
                  str(manifest), str(tmp_path / "out"), json.dumps(settings), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["ranks"] == 2 and record["mode"] == "async"
    assert sum(record["async"]["epochs"][0]["samples"]) == 32
