"""Asynchronous training (training.mode: async) under real ``mpiexec -n 2`` and ``-n 3``.

Without staleness it must reproduce the synchronous run of the same seed (so the one-sided
machinery is exact before it is made asynchronous); with staleness it must still learn, use every
sample of an epoch once, keep its staleness bound, share the files out exactly when one rank is a
straggler (how much less it holds the others back than sync: bench/async.py), resume after
kill -9 and end every rank when one fails. The data are synthetic
but learnable (tests/mpi_training.py), written through the real preprocessing stage.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import keras
import pytest
import yaml

from mpi_training import write_dataset
from preprocessing.manifest import load_manifest
from training.checkpoints import list_checkpoints
from training.optimizers import WarmupPolynomialDecay
from training.settings import STRAGGLER_DELAY_VARIABLE, straggler_delay_s
from workflow.config import validate_config
from workflow.errors import ConfigError, PipelineError

SCRIPT = Path(__file__).with_name("mpi_training.py")
REPO = Path(__file__).resolve().parents[1]
EXACT = {"shuffle_buffer": 0, "augment": False, "deterministic": True, "threads": 1,
         "validation_split": None}


def command(manifest, output_dir, settings: dict, ranks: int) -> list[str]:
    return ["mpiexec", "-n", str(ranks), sys.executable, str(SCRIPT), str(manifest),
            str(output_dir), json.dumps(settings)]


def run_script(manifest, output_dir, settings: dict, ranks: int, env: dict | None = None):
    return subprocess.run(command(manifest, output_dir, settings, ranks), capture_output=True,
                          text=True, timeout=420, env=env)


def record(output_dir: Path) -> dict:
    return json.loads((output_dir / "run.json").read_text())


def weights(output_dir: Path) -> list[np.ndarray]:
    return [w.numpy() for w in keras.saving.load_model(output_dir / "model.keras").weights]


def history(output_dir: Path) -> list[dict]:
    with open(output_dir / "history.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """6 training simulations (48 samples of 16^3 in 6 files of 8) and 2 validation ones."""
    return write_dataset(tmp_path_factory.mktemp("small"), {"train": 6, "val": 2})


@pytest.mark.parametrize("ranks", [2, 3])
def test_async_without_staleness_reproduces_sync(small, tmp_path, ranks):
    settings = EXACT | {"batch_size": 8, "epochs": 2}
    sync = run_script(small, tmp_path / "sync", settings, ranks)
    assert sync.returncode == 0, sync.stderr[-3000:]
    run = run_script(small, tmp_path / "async", settings | {"mode": "async", "max_staleness": 0},
                     ranks)
    assert run.returncode == 0, run.stderr[-3000:]
    reference, result = record(tmp_path / "sync"), record(tmp_path / "async")
    assert (reference["mode"], result["mode"]) == ("sync", "async")
    steps = reference["steps_per_epoch"]
    shared = result["async"]
    # every update summed one gradient of every rank, computed on the same weights
    assert shared["files"] == "synchronous shards"
    assert shared["updates"] == 2 * steps and shared["gradients"] == 2 * steps * ranks
    assert shared["staleness_max"] == 0 and shared["staleness_mean"] == 0
    assert len(set(result["weights_sha256_per_rank"])) == 1
    # fused allreduce and one-sided accumulation add the ranks' gradients in different orders
    for a, b in zip(weights(tmp_path / "sync"), weights(tmp_path / "async")):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for mine, theirs in zip(result["history"], reference["history"]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], rel=1e-6)


def test_async_with_staleness_beats_the_training_mean_and_uses_every_sample_once(tmp_path):
    manifest_path = write_dataset(tmp_path / "data", {"train": 48, "val": 8}, seed=1)
    n_files = len(load_manifest(manifest_path).files_of("train"))
    # global batch 2 x 4 = the batch of the synchronous test of the same bound
    settings = {"epochs": 4, "batch_size": 4, "threads": 1, "mode": "async", "max_staleness": 2}
    out = tmp_path / "training"
    result = run_script(manifest_path, out, settings, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    run = record(out)
    print("validation:", {k: round(v["ratio"], 3) for k, v in run["validation"]["parameters"].items()},
          "mean", round(run["validation"]["mean_ratio"], 3), "async:",
          {k: v for k, v in run["async"].items() if k != "epochs"})
    # Which gradients meet which weights depends on timing, so the score varies from run to
    # run (0.58-0.67 on 2 idle AMD EPYC cores); the test asks for what must hold whatever the
    # timing: better than predicting the training mean, which scores 1. How close async comes
    # to sync is bench/async.py's to measure.
    assert run["validation"]["mean_ratio"] < 1
    shared = run["async"]
    assert shared["files"] == "claimed" and len(shared["epochs"]) == 4
    for epoch in shared["epochs"]:  # the run checked the files claimed were a partition
        assert sum(epoch["samples"]) == run["train_samples"] == 384
        assert sum(epoch["files"]) == n_files and min(epoch["files"]) >= 1
    assert shared["staleness_max"] <= 2
    # each update takes a global batch (the last of an epoch may be short)
    assert 4 * 384 / 8 <= shared["updates"] <= 4 * (384 / 8 + 1)
    assert shared["gradients"] == sum(sum(e["steps"]) for e in shared["epochs"])
    assert [row["epoch"] for row in history(out)] == ["0", "1", "2", "3"]
    assert (out / "model.keras").is_file() and len(set(run["weights_sha256_per_rank"])) == 1


def test_with_a_straggler_every_file_is_claimed_once_and_trained_on_by_its_claimer(tmp_path):
    """Ranks of very different speeds race for the files: the claims still partition each
    epoch's files, and each rank trains exactly the samples of the files it claimed. (How much
    less a straggler holds async back than sync is timing: bench/async.py measures it.)"""
    manifest_path = write_dataset(tmp_path / "data", {"train": 16}, seed=2)
    n_files = len(load_manifest(manifest_path).files_of("train"))
    # rank 1 sleeps this long after each step, a few times its computing time
    settings = {"epochs": 2, "batch_size": 8, "threads": 1, "shuffle_buffer": 0,
                "validation_split": None, "mode": "async"}
    run = run_script(manifest_path, tmp_path / "async", settings, 2,
                     env=os.environ | {STRAGGLER_DELAY_VARIABLE: "0.5"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = record(tmp_path / "async")
    for epoch in result["async"]["epochs"]:
        # rank r starts with file r, then claims the next unclaimed one (a step is a file here:
        # 8 samples per file, batch 8); the run itself checked the claims were a partition
        assert sum(epoch["files"]) == n_files and min(epoch["files"]) >= 1
        assert epoch["steps"] == epoch["files"]
        assert epoch["samples"] == [8 * files for files in epoch["files"]]
    assert result["async"]["staleness_max"] <= 4  # the default bound
    assert result["async"]["gradients"] == 2 * n_files


def test_the_straggler_delay_is_a_test_hook_not_a_setting(monkeypatch):
    """The straggler of the test above and of bench/async.py comes from the environment; a
    configuration that still sets the old key is told so."""
    monkeypatch.delenv(STRAGGLER_DELAY_VARIABLE, raising=False)
    assert straggler_delay_s() == 0
    monkeypatch.setenv(STRAGGLER_DELAY_VARIABLE, "0.25")
    assert straggler_delay_s() == 0.25
    for text in ("soon", "-1", "nan"):
        monkeypatch.setenv(STRAGGLER_DELAY_VARIABLE, text)
        with pytest.raises(PipelineError, match=f"{STRAGGLER_DELAY_VARIABLE} = '{text}'"):
            straggler_delay_s()
    with pytest.raises(ConfigError, match=f"'training.test_only_straggler_delay_s' was removed: .*"
                                          f"{STRAGGLER_DELAY_VARIABLE}"):
        validate_config({"training": {"test_only_straggler_delay_s": 0.5}})


def test_kill_9_then_rerun_resumes_from_the_last_checkpoint(small, tmp_path):
    settings = {"epochs": 3, "batch_size": 4, "threads": 1, "mode": "async", "max_staleness": 2,
                "shuffle_buffer": 8, "validation_split": "val"}
    out = tmp_path / "killed"
    process = subprocess.Popen(command(small, out, settings, 2), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(epoch >= 1 for epoch, _, _ in list_checkpoints(out / "checkpoints")):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)  # every rank and the launcher, like a lost node
    process.wait()
    killed_at = max((e, s) for e, s, _ in list_checkpoints(out / "checkpoints"))
    assert killed_at[0] < 3 and not (out / "model.keras").exists()

    resumed = run_script(small, out, settings, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(epoch {killed_at[0]}, step 0)" in resumed.stderr
    run = record(out)
    assert (run["resumed_from"]["epoch"], run["resumed_from"]["step"]) == killed_at
    rows = history(out)
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]  # continuous, no epoch twice
    # the learning-rate schedule went on from the shared position of the checkpoint
    steps = run["steps_per_epoch"]
    schedule = WarmupPolynomialDecay(1e-3, 0, 3 * steps, 0.01)
    for epoch, row in enumerate(rows):
        assert float(row["learning_rate"]) == pytest.approx(float(schedule((epoch + 1) * steps)),
                                                            rel=1e-5)
    assert len(run["async"]["epochs"]) == 3 - killed_at[0]
    assert len(set(run["weights_sha256_per_rank"])) == 1


def test_a_failing_rank_ends_every_rank_promptly(small, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(small.parent, root)
    files = load_manifest(root / "manifest.json").files_of("train")
    victim = files[3]  # not the first (checked before training); either rank may claim it
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    # run_script's timeout guards against a hang: the healthy rank must be aborted, not wait
    result = run_script(root / "manifest.json", tmp_path / "out",
                        {"epochs": 3, "batch_size": 4, "threads": 1, "mode": "async"}, 2)
    assert result.returncode != 0
    assert re.search(r"rank (\d) of 2 failed, aborting all ranks: Rank \1 read a corrupt TFRecord",
                     result.stderr), result.stderr[-3000:]
    assert victim.name in result.stderr
    assert not (tmp_path / "out" / "model.keras").exists()


def test_async_refuses_step_checkpoints():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["training"] |= {"mode": "async", "checkpoint_every_steps": 5}
    with pytest.raises(ConfigError, match=r"'training.checkpoint_every_steps' = 5 is not supported "
                                          r"with 'training.mode' = 'async'"):
        validate_config(config)
    config["training"] |= {"checkpoint_every_steps": 0, "max_staleness": -1}
    with pytest.raises(ConfigError, match=r"'training.max_staleness' = -1 is out of range"):
        validate_config(config)
