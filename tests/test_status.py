"""``cosmoflow status`` (workflow/status.py): a run's stages, missing simulations, Snakemake's
state, disk and failed log, read from the run directory alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, write_config
from workflow.cli import main
from workflow.paths import RunLayout

# the installed console script may run another checkout's code: the commands run in-process


def status_of(capsys, *args) -> dict:
    assert main(["status", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def by_stage(status: dict) -> dict:
    return {row["stage"]: row for row in status["stages"]}


def test_every_stage_of_the_small_run_is_done_and_no_snakemake_run_is_alive(small_run, capsys):
    workdir, _, run = small_run
    status = status_of(capsys, run)
    for row in status["stages"]:
        assert row["state"] == ("no units" if row["stage"] == "train_fraction" else "done"), row
        assert row["done"] == row["total"]
        assert row.get("missing_sims", []) == []
    assert status["snakemake"] == {"workdir": str(workdir.resolve()), "state": "not running",
                                   "locks": [], "incomplete": []}
    disk = status["disk"]
    assert {"sims/", "histograms/", "tfrecords/", "training/", "logs/"} <= set(disk["directories"])
    used = list(disk["directories"].values())
    assert used == sorted(used, reverse=True) and disk["total_bytes"] > sum(used)  # + config.yaml, ...
    assert status["failed_log"] is None

    assert main(["status", str(run)]) == 0
    table = capsys.readouterr().out
    assert "Snakemake: not running" in table
    assert all(f"{name}   " in table for name in ("sample_parameters", "histogram", "analyze"))


def test_a_deleted_batch_summary_and_histogram_show_the_batch_and_the_simulation(copied_run, capsys):
    run, config = copied_run
    run.batch_summary("histogram", 1).unlink()
    run.histogram(5).unlink()
    stages = by_stage(status_of(capsys, run.root))
    assert stages["histogram"]["state"] == "partial"
    assert (stages["histogram"]["done"], stages["histogram"]["total"]) == (1, 2)
    assert stages["histogram"]["missing_sims"] == [5]
    assert stages["simulate"]["state"] == "done" and stages["simulate"]["missing_sims"] == []
    assert stages["manifest"]["state"] == "done"  # its outputs exist; whether current is Snakemake's call

    assert main(["status", str(run.root)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["histogram"]]
    assert line.split()[1:] == ["partial", "1/2", "5", "(1)"]


def test_a_failed_job_shows_the_end_of_its_log(copied_run, tmp_path, monkeypatch, capsys):
    run, config = copied_run
    monkeypatch.chdir(tmp_path)
    config_path = write_config(tmp_path, config)
    run.histogram(5).unlink()
    run.snapshot(5).write_bytes(b"not an HDF5 file")
    log = run.log("histogram", "1")
    assert main(["histogram", "--config", str(config_path), "--batch", "1", "--log-file", str(log)]) == 1
    capsys.readouterr()

    failed = status_of(capsys, run.root)["failed_log"]
    assert failed["path"] == str(log)
    assert "error" in "\n".join(failed["last_lines"]).lower()
    assert main(["status", str(run.root)]) == 0
    assert f"Failed: {log} ends with an error:" in capsys.readouterr().out


def test_a_live_run_and_a_killed_one(copied_run, tmp_path, capsys):
    """A job of a run holds the workflow's lock (workflow/locks.py) while it lives; once none
    does, Snakemake's locks and incomplete markers left in .snakemake/ mean a killed run."""
    run, _ = copied_run
    metadata = tmp_path / ".snakemake"
    holder = subprocess.Popen(
        [sys.executable, "-c", "from workflow.locks import release_stale_locks; release_stale_locks(); "
         "print('held', flush=True); input()"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert status_of(capsys, run.root)["snakemake"]["state"] == "running"
    finally:
        holder.communicate("\n", timeout=60)
    assert status_of(capsys, run.root)["snakemake"]["state"] == "not running"

    (metadata / "locks").mkdir()
    (metadata / "locks" / "0.output.lock").write_text("results/small/batches/histogram/1.json\n")
    marker = metadata / "incomplete" / "cmVzdWx0cy9zbWFsbC9iYXRjaGVzL2hpc3RvZ3JhbS8xLmpzb24="
    marker.parent.mkdir()
    marker.write_text('{"external_jobid": null}')  # as Snakemake marks results/small/batches/histogram/1.json
    snakemake = status_of(capsys, run.root)["snakemake"]
    assert snakemake["state"] == "killed"
    assert snakemake["incomplete"] == ["results/small/batches/histogram/1.json"]
    assert snakemake["locks"] == [str(metadata / "locks" / "0.output.lock")]


def test_a_run_with_only_its_parameters(tmp_path, tiny_config, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config_path = write_config(tmp_path, tiny_config)
    assert main(["sample-parameters", "--config", str(config_path)]) == 0
    capsys.readouterr()

    status = status_of(capsys, "--config", config_path)
    assert status["run_dir"] == "results/test"
    states = {name: row["state"] for name, row in by_stage(status).items()}
    assert states.pop("sample_parameters") == "done"
    assert states.pop("train_fraction") == "no units"  # analysis.learning_curve is empty
    assert set(states.values()) == {"not started"}
    assert by_stage(status)["histogram"]["missing_sims"] == list(range(16))
    assert "missing_sims" not in by_stage(status)["initial_conditions"]  # not kept by default
    assert status["disk"]["directories"] == {} and status["disk"]["total_bytes"] > 0  # params.csv

    # no config.yaml: only a snakemake run records it
    assert main(["status", "results/test"]) == 1
    assert str(RunLayout(tmp_path / "results" / "test").config_record.relative_to(tmp_path)) in \
        capsys.readouterr().err


def test_a_missing_run_directory_is_an_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "results" / "nowhere"
    assert main(["status", str(missing)]) == 1
    assert f"cosmoflow status: error: run directory {missing} not found" in capsys.readouterr().err
