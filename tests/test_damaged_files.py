"""A truncated histogram, checkpoint or model.keras in a finished run: the command that reads it
names the file and fails cleanly, or, for a checkpoint, skips it and resumes from the one
before, losing nothing but that one's epochs."""

from __future__ import annotations

import csv
import json

from conftest import run_cli
from training.checkpoints import list_checkpoints


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def written_config(run, config) -> str:
    path = run.root / "config.yaml"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_truncated_histogram_is_named_by_write_tfrecords(copied_run):
    run, config = copied_run
    with open(run.params_csv, newline="") as handle:
        first_test_sim = next(int(row["sim_id"]) for row in csv.DictReader(handle)
                              if row["split"] == "test")
    victim = run.histogram(first_test_sim)
    truncate(victim)
    result = run_cli("write-tfrecords", "--config", written_config(run, config),
                     "--split", "test", "--shard", "0")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"Histogram {victim}" in result.stderr


def test_a_truncated_model_is_named_by_analyze(copied_run):
    run, config = copied_run
    truncate(run.training / "model.keras")
    result = run_cli("analyze", "--config", written_config(run, config))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"Model {run.training / 'model.keras'} cannot be loaded" in result.stderr


def test_a_truncated_checkpoint_is_named_and_training_resumes_from_the_one_before(copied_run):
    run, config = copied_run
    saved = list_checkpoints(run.training / "checkpoints")
    (epoch_before, step_before, _), (_, _, newest) = saved[-2], saved[-1]
    truncate(newest)
    result = run_cli("train", "--config", written_config(run, config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skipping unreadable checkpoint {newest}" in result.stderr
    record = json.loads((run.training / "run.json").read_text())
    assert record["resumed_from"] == {"epoch": epoch_before, "step": step_before}
    assert list_checkpoints(run.training / "checkpoints")[-1][2] == newest  # written again
