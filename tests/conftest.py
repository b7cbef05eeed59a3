"""Shared test helpers: tiny configurations and real Snakemake / CLI runs in temporary dirs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mpi_training import TEST_TRAINING
from workflow.config import load_config, validate_config
from workflow.paths import RunLayout
from workflow.process import configure_process

# the tests import the pipeline's modules in this process: the same process settings as the
# cosmoflow command (oneDNN, OpenMP spin, TensorFlow's log level) before any of them loads
configure_process()

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # the project's read-only design and reference data


# 8 simulations of 16^3 particles in 2 batches: the whole pipeline in about a minute.
SMALL = {
    "run_name": "small",
    "seed": 11,
    "sampling": {"n_simulations": 8, "splits": {"train": 0.5, "val": 0.25, "test": 0.25}},
    "simulation": {"sims_per_job": 4, "box_size": 64.0, "n_particles": 16, "n_steps": 4, "threads": 1,
                   "redshifts": [0.0], "keep_initial_conditions": True, "keep_snapshots": True},
    "initial_conditions": {"z_init": 15.0},
    "preprocessing": {"grid": 16, "subvolume": 8, "samples_per_file": 8},
    "training": TEST_TRAINING,  # the network, optimiser and 8 epochs the pipeline tests expect
    # CAMB's halofit: tests/test_analysis_simulation_validation.py
    "analysis": {"validation": {"halofit": False}},
}


SOLVER = {key: validate_config({})["simulation"][key]
          for key in ("stepping", "cola", "n_cola", "mesh_factor", "backend")}
"""The COLA solver's settings by default, as the simulate job passes them from the configuration."""
FIXED_COSMOLOGY = validate_config({})["cosmology"]
"""The cosmology's fixed parameters by default (h, Omega_b, T_cmb, transfer, transfer_table), as
the jobs pass them to :class:`simulations.cosmology.Cosmology` from the configuration."""
IC_SETTINGS = {key: validate_config({})["initial_conditions"][key]
               for key in ("lpt_order", "fixed_amplitude", "phase_flip")}
"""The initial conditions' settings by default, as the initial_conditions job passes them."""

KERNEL_CHOICES = [
    ("cosmology.transfer", "simulations.cosmology", "TRANSFERS"),
    ("initial_conditions.lpt_order", "simulations.initial_conditions", "LPT_ORDERS"),
    ("preprocessing.assignment", "preprocessing.histogram", "ASSIGNMENTS"),
    ("preprocessing.dtype", "preprocessing.manifest", "VOXEL_DTYPES"),
    ("staging.mode", "preprocessing.staging", "MODES"),
    ("training.head", "training.models", "HEADS"),
    ("analysis.baselines", "analysis.baselines", "BASELINES"),
]
"""(schema key, module, name): a kernel's own set of what it implements for a configuration
choice, which it checks its argument against; tests/test_config.py keeps each equal to the
schema's enum, and no other module restates an enum (tests/test_stages.py)."""


def simulate(ic_path: Path, out: Path, redshifts, n_steps: int, **changes) -> Path:
    """:func:`simulations.cola.run_simulation` with :data:`SOLVER`, but ``changes``."""
    from simulations.cola import run_simulation

    return run_simulation(ic_path, out, redshifts, n_steps, **(SOLVER | changes))


def skip_unless_ci(reason: str) -> None:
    """Skip a test whose requirement the README's test set-up provides (tests/setup.sh: Slurm,
    chromium, tmpfs mounts as root; the test extra: camb) where it is missing; in CI
    (``CI=true``, where that set-up ran as root) the same absence fails the test, so that a
    broken set-up cannot turn into a green run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, but the test set-up did not provide this: {reason}")
    pytest.skip(reason)


def write_config(directory: Path, config: dict, name: str = "config.yaml") -> Path:
    path = Path(directory) / name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed `cosmoflow` command as a user would."""
    return subprocess.run(
        ["cosmoflow", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )


def run_snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the repository's Snakefile with `workdir` as working directory."""
    return subprocess.run(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2", *args],
        capture_output=True, text=True, timeout=1800,
    )


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """The whole pipeline on SMALL through Snakemake, once per test session: (working
    directory, config path, run directory). Tests that change it work on a copy."""
    workdir = tmp_path_factory.mktemp("pipeline")
    config_path = write_config(workdir, SMALL)
    result = run_snakemake(workdir, "--configfile", str(config_path))
    assert result.returncode == 0, result.stderr[-3000:]
    (workdir / "console.txt").write_text(result.stdout + result.stderr)  # what a user saw
    return workdir, config_path, workdir / "results" / "small"


@pytest.fixture
def tiny_config() -> dict:
    """A small ensemble: 16 simulations in batches of 4."""
    return {
        "run_name": "test",
        "seed": 7,
        "sampling": {"n_simulations": 16, "splits": {"train": 0.5, "val": 0.25, "test": 0.25}},
        "simulation": {"sims_per_job": 4},
    }


@pytest.fixture
def copied_run(small_run, tmp_path):
    """A copy of the small run (its layout and validated config) to break in one place."""
    _, config_path, run = small_run
    copy = tmp_path / "results" / "small"
    shutil.copytree(run, copy, symlinks=True)
    config = load_config(copy / "config.yaml") | {"results_dir": str(tmp_path / "results")}
    return RunLayout(copy), config


@pytest.fixture(scope="session")
def pycola_env() -> dict:
    """pyCOLA's environment (made here if the set-up command has not been run)."""
    from simulations import pycola_backend
    from workflow.errors import PipelineError

    try:
        return pycola_backend.check_environment()
    except PipelineError:
        pycola_backend.setup_environment()
        return pycola_backend.check_environment()
