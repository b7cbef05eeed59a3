"""Real training runs: 2 MPI ranks = 1 rank with twice the batch, a failing rank ends the job,
kill -9 and resume, and the trained network beats the predict-the-mean baseline.

The data are synthetic but learnable (tests/mpi_training.py), written through the real
preprocessing stage; the multi-rank runs are real ``mpiexec -n 2`` processes.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import keras
import pytest

from mpi_training import training_settings, write_dataset
from preprocessing.manifest import load_manifest
from training.checkpoints import list_checkpoints, truncate_history
from training.models import build_model
from training.pipeline import shard_indices, validation_dataset
from training.run import train_network
from workflow.errors import PipelineError

SCRIPT = Path(__file__).with_name("mpi_training.py")
EXACT = {"shuffle_buffer": 0, "augment": False, "deterministic": True, "threads": 1,
         "validation_split": None, "epochs": 1, "width": 1.0}  # the published network


def run_script(manifest, output_dir, settings: dict, ranks: int | None = None, **kwargs):
    command = [sys.executable, str(SCRIPT), str(manifest), str(output_dir), json.dumps(settings)]
    if ranks:
        command = ["mpiexec", "-n", str(ranks)] + command
    return subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)


def weights(output_dir: Path) -> list[np.ndarray]:
    return [w.numpy() for w in keras.saving.load_model(output_dir / "model.keras").weights]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """6 training simulations (48 samples of 16^3 in 6 files of 8) and 2 validation ones."""
    return write_dataset(tmp_path_factory.mktemp("small"), {"train": 6, "val": 2})


def test_two_ranks_take_the_same_steps_as_one_rank_with_twice_the_batch(small, tmp_path):
    settings = EXACT | {"validation_split": "val"}
    two = run_script(small, tmp_path / "two", settings | {"batch_size": 8}, ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = train_network(small, tmp_path / "one", training_settings(settings | {"batch_size": 16}))
    record = json.loads((tmp_path / "two" / "run.json").read_text())
    assert record["ranks"] == 2 and record["global_batch"] == 16 == one["global_batch"]
    assert record["steps_per_epoch"] == one["steps_per_epoch"] == 3
    digests = record["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]  # identical weights on every rank
    keras.utils.set_random_seed(0)
    initial = [w.numpy() for w in build_model("cosmoflow_paper", (16, 16, 16, 1), 3).weights]
    moved = max(np.abs(a - b).max() for a, b in zip(weights(tmp_path / "one"), initial))
    assert moved > 1e-3  # the runs did train
    for a, b in zip(weights(tmp_path / "one"), weights(tmp_path / "two")):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert record["history"][0]["loss"] == pytest.approx(one["history"][0]["loss"], rel=1e-5)
    assert all(0 < row["step_seconds"] < row["epoch_seconds"] for row in record["history"])
    # the validation scores, summed over the ranks' files, are those of one rank reading all
    assert record["validation"]["samples"] == one["validation"]["samples"] == 16
    for name, score in one["validation"]["parameters"].items():
        assert record["validation"]["parameters"][name] == pytest.approx(score, rel=1e-4)


def test_a_failing_rank_ends_every_rank_promptly(small, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(small.parent, root)
    files = load_manifest(root / "manifest.json").files_of("train")
    # A file that only rank 1 reads in epoch 0 (not the first, which is checked before training)
    victim = files[next(i for i in shard_indices(len(files), 0, 0, 1, 2) if i != 0)]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    # run_script's timeout guards against a hang: the healthy rank must be aborted, not wait
    result = run_script(root / "manifest.json", tmp_path / "out",
                        {"epochs": 3, "batch_size": 4, "threads": 1}, ranks=2)
    assert result.returncode != 0
    assert "rank 1 of 2 failed, aborting all ranks: Rank 1 read a corrupt TFRecord" in result.stderr
    assert victim.name in result.stderr
    assert not (tmp_path / "out" / "model.keras").exists()


def test_bad_input_ends_every_rank_cleanly(small, tmp_path):
    result = run_script(small, tmp_path / "out", {"batch_size": 25}, ranks=2)
    assert result.returncode != 0
    message = "error: training.batch_size = 25 is larger than the smallest per-rank shard (24 samples"
    assert result.stderr.count(message) == 2  # both ranks report it; nothing aborted
    assert "MPI_Abort" not in result.stderr and not (tmp_path / "out").exists()


def read_history(output_dir: Path) -> list[dict]:
    with open(output_dir / "history.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_kill_9_then_rerun_resumes_and_ends_like_an_uninterrupted_run(small, tmp_path):
    settings = {"epochs": 4, "batch_size": 4, "checkpoint_every_steps": 5, "deterministic": True,
                "threads": 1, "shuffle_buffer": 16, "model": "mlperf"}  # with dropout and augmentation
    reference = run_script(small, tmp_path / "reference", settings)
    assert reference.returncode == 0, reference.stderr[-3000:]

    out = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, str(SCRIPT), str(small), str(out), json.dumps(settings)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not any(epoch >= 2 and step > 0 for epoch, step, _ in list_checkpoints(out / "checkpoints")):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = max((e, s) for e, s, _ in list_checkpoints(out / "checkpoints"))
    assert not (out / "model.keras").exists() and len(read_history(out)) >= 2

    resumed = run_script(small, out, settings)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(epoch {killed_at[0]}, step {killed_at[1]})" in resumed.stderr
    record = json.loads((out / "run.json").read_text())
    assert (record["resumed_from"]["epoch"], record["resumed_from"]["step"]) == killed_at
    # the training package switched TensorFlow's oneDNN kernels on before TensorFlow loaded
    assert record["threads"]["onednn"] == (os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0")
    history, expected = read_history(out), read_history(tmp_path / "reference")
    assert [row["epoch"] for row in history] == ["0", "1", "2", "3"]  # continuous, no epoch twice
    for row, reference_row in zip(history, expected):
        assert float(row["loss"]) == pytest.approx(float(reference_row["loss"]), rel=1e-6)
        assert float(row["val_loss"]) == pytest.approx(float(reference_row["val_loss"]), rel=1e-6)
    for a, b in zip(weights(out), weights(tmp_path / "reference")):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("validation", [True, False])
def test_resuming_an_older_history_gives_it_the_new_columns(tmp_path, validation):
    """A history.csv written without step_seconds (before it existed), resumed at epoch 2:
    Keras's CSVLogger then appends rows that name it, without a header; every value must land
    in its own column."""
    keys = ["epoch_seconds", "learning_rate", "loss", "samples_per_second"] + ["val_loss"] * validation

    def log_epochs(path, epochs, row_keys):
        logger = keras.callbacks.CSVLogger(str(path), append=True)
        logger.on_train_begin()
        for epoch in epochs:
            logger.on_epoch_end(epoch, {key: 10 * epoch + i for i, key in enumerate(row_keys)})
        logger.on_train_end()

    path = tmp_path / "history.csv"
    log_epochs(path, range(3), keys)
    truncate_history(path, 2)
    new_keys = keys + ["step_seconds"]
    log_epochs(path, range(2, 4), new_keys)
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["epoch"] for row in rows] == ["0", "1", "2", "3"]
    for row in rows:
        assert None not in row  # no value beyond the header
        epoch = int(row["epoch"])
        for i, key in enumerate(keys if epoch < 2 else new_keys):
            assert float(row[key]) == 10 * epoch + i
        assert row["step_seconds"] == "" if epoch < 2 else float(row["step_seconds"]) > 0


def test_trained_network_beats_the_training_mean_on_validation(tmp_path):
    manifest_path = write_dataset(tmp_path / "data", {"train": 48, "val": 8}, seed=1)
    manifest = load_manifest(manifest_path)
    settings = training_settings({"epochs": 4, "batch_size": 8, "width": 1.0})  # the paper's network
    record = train_network(manifest_path, tmp_path / "training", settings)
    out = tmp_path / "training"
    for name in ("model.keras", "history.csv", "run.json"):
        assert (out / name).is_file()
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert [e for e, s, _ in list_checkpoints(out / "checkpoints")] == [3, 4]  # newest two kept
    assert record["model"]["parameters"] == 7_041_443 and record["samples_per_second"] > 0
    assert record["achieved_gflops"] == pytest.approx(
        record["samples_per_second"] * record["model"]["training_flops_per_sample"] / 1e9)
    assert json.loads((out / "run.json").read_text())["settings"]["epochs"] == 4
    # the time inside the steps is part of the epoch's time, never more
    for row, csv_row in zip(record["history"], read_history(out)):
        assert 0 < row["step_seconds"] * record["steps_per_epoch"] <= row["epoch_seconds"]
        assert float(csv_row["step_seconds"]) == pytest.approx(row["step_seconds"])

    network = keras.saving.load_model(out / "model.keras")
    def targets(split):
        data, _ = validation_dataset(manifest, split, 32, 0, 1)
        pairs = [(y.numpy(), network(x).numpy()) for x, y in data]
        return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    y_train, _ = targets("train")
    y_val, predicted = targets("val")
    network_mse = ((predicted - y_val) ** 2).mean(axis=0)
    baseline_mse = ((y_train.mean(axis=0) - y_val) ** 2).mean(axis=0)
    ratios = network_mse / baseline_mse
    print("validation MSE / predict-the-mean MSE per parameter:",
          dict(zip(manifest.parameters, ratios.round(3))), "mean", ratios.mean().round(3))
    assert ratios.mean() <= 0.7
    # run.json reports the same per-parameter figures, computed from sums inside train_network()
    reported = record["validation"]
    assert reported["split"] == "val" and reported["samples"] == len(y_val)
    assert [reported["parameters"][name]["ratio"] for name in manifest.parameters] == \
        pytest.approx(ratios, rel=1e-4)
    assert reported["mean_ratio"] == pytest.approx(ratios.mean(), rel=1e-4)
    assert [reported["parameters"][name]["baseline_mse"] for name in manifest.parameters] == \
        pytest.approx(baseline_mse, rel=1e-4)


def test_a_checkpoint_of_another_run_is_not_resumed(small, tmp_path):
    settings = {"epochs": 1, "batch_size": 8, "validation_split": None}
    train_network(small, tmp_path, training_settings(settings))
    assert [(e, s) for e, s, _ in list_checkpoints(tmp_path / "checkpoints")] == [(1, 0)]
    # complete: nothing to redo
    again = train_network(small, tmp_path, training_settings(settings))
    assert again["resumed_from"] == {"epoch": 1, "step": 0} and len(again["history"]) == 1
    with pytest.raises(PipelineError, match=r"epoch0001-step000000.h5 was written with "
                                            r"training.learning_rate = 0.001, but this run has 0.002"):
        train_network(small, tmp_path, training_settings(settings | {"learning_rate": 0.002}))
