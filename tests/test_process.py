"""Process-wide settings (workflow/process.py): set once at each entry point, before TensorFlow
or numba loads, whatever the CPU; no library module changes them when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, write_config
from mpi_training import write_dataset
from workflow.process import PROCESS_ENVIRONMENT


def environment_without_settings() -> dict:
    """This process's environment less every process setting, as on a user's fresh shell."""
    return {key: value for key, value in os.environ.items() if key not in PROCESS_ENVIRONMENT}


def test_importing_the_pipeline_changes_no_process_setting():
    script = ("import json, os; "
              "import simulations.mesh, simulations.cola, training.run, training.jobs, "
              "analysis.jobs, preprocessing.jobs, workflow.cli, workflow.stages; "
              "print(json.dumps(sorted(set(os.environ) & %r)))" % set(PROCESS_ENVIRONMENT))
    result = subprocess.run([sys.executable, "-c", script], env=environment_without_settings(),
                            capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(result.stdout) == []


def test_configure_process_keeps_what_the_user_exported():
    script = ("import json, os; from workflow.process import configure_process; "
              "configure_process(); print(json.dumps({k: os.environ[k] for k in %r}))"
              % sorted(PROCESS_ENVIRONMENT))
    exported = {"GOMP_SPINCOUNT": "1000000", "TF_ENABLE_ONEDNN_OPTS": "0"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=environment_without_settings() | exported, check=True)
    assert json.loads(result.stdout) == PROCESS_ENVIRONMENT | exported


def test_cosmoflow_train_runs_onednn_whatever_the_cpu(tmp_path):
    """TensorFlow turns oneDNN on by itself only on CPUs with AVX512_VNNI, AVX512_BF16 or AMX;
    the command turns it on everywhere, even though it imports TensorFlow early to keep its
    start-up messages out of the console."""
    write_dataset(tmp_path / "results" / "onednn", {"train": 2, "val": 1})
    config = write_config(tmp_path, {
        "run_name": "onednn", "results_dir": str(tmp_path / "results"),
        "training": {"epochs": 1, "batch_size": 4, "threads": 1, "ranks": 1}})
    for command in (["stage"], ["train"]):
        result = subprocess.run(["cosmoflow", *command, "--config", str(config)],
                                env=environment_without_settings(), capture_output=True,
                                text=True, timeout=600)  # a hang guard only
        assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "onednn" / "training" / "run.json").read_text())
    assert record["threads"]["onednn"] is True
    assert "oneDNN kernels are off" not in result.stderr
