"""The whole pipeline, every rule through `train`, as real Snakemake runs on a very small ensemble."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time


from conftest import REPO, SMALL, run_cli, run_snakemake, write_config
from preprocessing.manifest import load_manifest
from workflow.params_table import read_params_csv


def digests(run_dir):
    """sha256 of every HDF5 and TFRecord file of a run, by relative path."""
    return {
        str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(run_dir.rglob("*"))
        if path.suffix in (".h5", ".tfrecord") and "training" not in path.relative_to(run_dir).parts
    }


def test_pipeline_writes_a_verified_data_set(small_run):
    _, _, run = small_run
    manifest = load_manifest(run / "tfrecords" / "manifest.json")
    assert manifest.shape == (8, 8, 8, 1)
    assert manifest.parameters == ("Omega_m", "sigma_8", "n_s")
    records = read_params_csv(run / "params.csv")
    for split in ("train", "val", "test"):
        members = {r.sim_id for r in records if r.split == split}
        in_files = {s for f in manifest.files if f.split == split for s in f.sim_ids}
        assert in_files == members, split
        assert manifest.n_samples(split) == 8 * len(members)  # (16/8)^3 sub-volumes each
    result = run_cli("verify-data", run)
    assert result.returncode == 0, result.stderr


def test_same_config_gives_identical_bytes(small_run, tmp_path):
    _, _, run = small_run
    config_path = write_config(tmp_path, SMALL)
    manifest = "results/small/tfrecords/manifest.json"  # the data set; training is not compared
    checks = [f"results/small/batches/validate_simulations/{batch}.json" for batch in (0, 1)]
    assert run_snakemake(tmp_path, manifest, *checks, "--configfile", str(config_path)).returncode == 0
    first, second = digests(run), digests(tmp_path / "results" / "small")
    # per simulation ic.h5, snapshot.h5, its histogram and its check (validate_simulations)
    assert len(first) == 8 * 4 + len(list((run / "tfrecords").rglob("*.tfrecord")))
    assert first == second


def test_one_simulation_regenerates_alone_bit_for_bit(small_run):
    workdir, _, run = small_run
    snapshot = run / "sims" / "00005" / "snapshot.h5"
    before = snapshot.read_bytes()
    snapshot.unlink()
    result = run_cli("simulate", "--config", run / "config.yaml", "--sim-id", "5", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert snapshot.read_bytes() == before


def test_killed_run_resumes_and_redoes_only_what_is_missing(tmp_path):
    """SIGKILL the whole Snakemake process group in the middle of a simulate job, rerun."""
    config = {**SMALL, "sampling": {**SMALL["sampling"], "n_simulations": 8},
              "simulation": {**SMALL["simulation"], "sims_per_job": 8, "n_particles": 32, "n_steps": 10}}
    config_path = write_config(tmp_path, config)
    until = ("--until", "initial_conditions")
    assert run_snakemake(tmp_path, "--configfile", str(config_path), *until).returncode == 0
    run = tmp_path / "results" / "small"
    log = run / "logs" / "simulate" / "0.log"
    job = subprocess.Popen(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--cores", "2",
         "--configfile", str(config_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (log.exists() and "sim 1 done" in log.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert not (run / "batches" / "simulate" / "0.json").exists()
    done = {i: run / "sims" / f"{i:05d}" / "snapshot.h5" for i in (0, 1)}
    mtimes = {i: path.stat().st_mtime_ns for i, path in done.items()}
    # atomic writes: a killed simulation leaves at most a hidden temporary file, never a snapshot
    assert all(p.name == "snapshot.h5" for p in run.glob("sims/*/snapshot*"))

    # snakemake again, no `snakemake --unlock` first (workflow/locks.py), to the data set that
    # verify-data checks (training and analysis have nothing to do with the kill)
    manifest = "results/small/tfrecords/manifest.json"
    result = run_snakemake(tmp_path, manifest, "--configfile", str(config_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(run.glob("sims/*/.*.tmp"))  # the killed writer's temporary file is gone
    text = log.read_text()
    assert "sim 0 is up to date" in text and "sim 1 is up to date" in text and "sim 7 done" in text
    assert {i: path.stat().st_mtime_ns for i, path in done.items()} == mtimes
    assert run_cli("verify-data", run).returncode == 0


def test_changed_preprocessing_leaves_exactly_the_new_data_set(small_run, tmp_path):
    workdir = tmp_path / "pipeline"  # a copy (mtimes and Snakemake's records kept): the module's
    shutil.copytree(small_run[0], workdir, symlinks=True)  # other tests keep the original run
    run = workdir / "results" / "small"
    changed = {**SMALL, "preprocessing": {**SMALL["preprocessing"], "samples_per_file": 4,
                                          "compression": "gzip"}}
    trained = "results/small/training/run.json"  # through training, not the analysis
    changed_path = write_config(workdir, changed, "changed.yaml")
    result = run_snakemake(workdir, trained, "--configfile", str(changed_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rule simulate" not in result.stdout + result.stderr  # the simulations are reused
    assert not list(run.glob("tfrecords/*/*.tfrecord"))  # the old uncompressed files are gone
    manifest = load_manifest(run / "tfrecords" / "manifest.json")
    assert manifest.compression == "GZIP" and {f.n_samples for f in manifest.files} == {4}
    superseded = run / "training" / "checkpoints.superseded"  # trained afresh on the new data,
    assert (superseded / "history.csv").is_file()  # the other run's history moved aside with its state
    history = (run / "training" / "history.csv").read_text().splitlines()
    assert len(history) == 1 + changed["training"]["epochs"]
    assert run_cli("verify-data", run).returncode == 0


def test_a_missing_input_is_made_again_and_a_broken_one_is_named(small_run):
    """A batch job makes a missing input file again through the stage that writes it (here the
    snapshot, from ic.h5); an input it cannot use is named."""
    workdir, _, run = small_run
    snapshot, ic = run / "sims" / "00001" / "snapshot.h5", run / "sims" / "00001" / "ic.h5"
    histogram = run / "histograms" / "00001.h5"
    saved = {path: path.read_bytes() for path in (snapshot, ic, histogram)}
    moved = snapshot.with_name("moved.h5")
    os.replace(snapshot, moved)
    try:
        ic.write_bytes(saved[ic][: len(saved[ic]) // 2])  # truncated
        broken = run_cli("histogram", "--config", run / "config.yaml", "--sim-id", "1", "--force",
                         cwd=workdir)
        ic.write_bytes(saved[ic])
        remade = run_cli("histogram", "--config", run / "config.yaml", "--sim-id", "1", "--force",
                         cwd=workdir)
    finally:
        os.replace(moved, snapshot)
        for path, data in saved.items():
            path.write_bytes(data)
    assert broken.returncode == 1 and str(ic.relative_to(workdir)) in broken.stderr, broken.stderr
    assert remade.returncode == 0, remade.stderr
    assert "simulate: making results/small/sims/00001/snapshot.h5 again for sim 1" in remade.stderr
    assert histogram.read_bytes() == saved[histogram]


def test_verify_data_names_a_corrupted_file(small_run, tmp_path):
    _, _, run = small_run
    victim = sorted((run / "tfrecords" / "train").glob("*.tfrecord"))[0]
    original = victim.read_bytes()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0xFF
    victim.write_bytes(bytes(corrupted))
    try:
        result = run_cli("verify-data", run)
    finally:
        victim.write_bytes(original)
    assert result.returncode == 1
    assert str(victim) in result.stderr


def jobs_run(result) -> list[str]:
    """The rules of the jobs a Snakemake run executed (or planned, with -n)."""
    return sorted(re.findall(r"^(?:local)?rule (\w+):$", result.stdout + result.stderr, re.M))


def test_deleted_files_are_regenerated_alone_by_a_plain_snakemake(small_run, tmp_path):
    workdir = tmp_path / "pipeline"  # a copy, as in the test above
    shutil.copytree(small_run[0], workdir, symlinks=True)
    run = workdir / "results" / "small"
    deleted = [run / "sims/00003/ic.h5", run / "sims/00005/snapshot.h5", run / "histograms/00002.h5"]
    before = {path: path.read_bytes() for path in deleted}
    rewritten = deleted + [run / "sims/00003/music.conf"]  # the IC job writes it beside ic.h5
    kept = {path: path.stat().st_mtime_ns for path in run.rglob("*")
            if path.is_file() and path not in rewritten and ".snakemake" not in path.parts
            and "logs" not in path.parts and "config.yaml" != path.name}
    for path in deleted:
        path.unlink()
    config = str(workdir / "config.yaml")
    alone = ["all", "histogram_one", "initial_conditions_one", "simulate_one"]
    planned = run_snakemake(workdir, "-n", "--configfile", config)
    assert jobs_run(planned) == alone, planned.stdout
    result = run_snakemake(workdir, "--configfile", config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert jobs_run(result) == alone
    assert {path: path.read_bytes() for path in deleted} == before  # bit for bit
    assert {path: path.stat().st_mtime_ns for path in kept} == kept  # nothing else rewritten
    again = run_snakemake(workdir, "-n", "--configfile", config)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_a_changed_key_reruns_exactly_the_stages_that_read_it(small_run, tmp_path):
    workdir, config, _ = small_run
    for change, expected in [
        ({"simulation": {"threads": 2}}, []),  # how a job runs, not what it writes
        ({"training": {"threads": 1}}, []),
        ({"analysis": {"threads": 1}}, []),
        ({"staging": {"workers": 1}}, []),
        ({"analysis": {"summary_bins": 6}}, ["all", "analyze"]),  # analysis only
        ({"training": {"learning_rate": 0.002}}, ["all", "analyze", "train"]),
        ({"preprocessing": {"samples_per_file": 4}},
         ["all", "analyze", "manifest", "stage", "train"] + ["write_tfrecords"] * 3),
    ]:
        changed = write_config(tmp_path, change, "changed.yaml")  # layered over the run's config
        result = run_snakemake(workdir, "-n", "--configfile", str(config), str(changed))
        assert result.returncode == 0, result.stderr
        assert jobs_run(result) == expected, (change, result.stdout)


def test_train_with_overrides_writes_to_another_directory(small_run, tmp_path):
    workdir, _, run = small_run
    before = {p: p.stat().st_mtime_ns for p in (run / "training").rglob("*") if p.is_file()}
    trial = tmp_path / "sweeps" / "lr" / "0"
    result = run_cli("train", "--config", run / "config.yaml", "--set", "training.epochs=1",
                     "--set", "training.learning_rate=1e-3", "--output-dir", trial, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((trial / "run.json").read_text())
    assert record["settings"]["learning_rate"] == 0.001 and record["settings"]["epochs"] == 1
    assert (trial / "model.keras").is_file()
    assert {p: p.stat().st_mtime_ns for p in (run / "training").rglob("*") if p.is_file()} == before


def test_intermediates_not_kept_are_deleted_and_made_again_when_a_rerun_needs_them(tmp_path):
    lean = {**SMALL, "run_name": "lean", "simulation": {
        **SMALL["simulation"], "keep_initial_conditions": False, "keep_snapshots": False}}
    config = write_config(tmp_path, lean)
    until = ("--until", "histogram")
    assert run_snakemake(tmp_path, "--configfile", str(config), *until).returncode == 0
    run = tmp_path / "results" / "lean"
    assert not list(run.glob("sims/*/*.h5"))  # only music.conf stays beside the histograms
    histograms = {path: path.read_bytes() for path in run.glob("histograms/*.h5")}
    assert len(histograms) == 8
    again = run_snakemake(tmp_path, "-n", "--configfile", str(config), *until)
    assert again.returncode == 0 and jobs_run(again) == []  # not kept is not missing

    changed = write_config(tmp_path, {"simulation": {"n_steps": 5}}, "changed.yaml")
    result = run_snakemake(tmp_path, "--configfile", str(config), str(changed), *until)
    assert result.returncode == 0, result.stderr[-3000:]
    assert jobs_run(result) == ["histogram"] * 2 + ["simulate"] * 2
    log = (run / "logs" / "simulate" / "0.log").read_text()
    assert "initial_conditions: making" in log and "sim 3 done" in log  # ic.h5 made again
    assert not list(run.glob("sims/*/*.h5"))
    assert all(path.read_bytes() != data for path, data in histograms.items())  # other steps


def test_the_console_shows_progress_and_a_closing_summary_but_no_tensorflow_noise(small_run):
    workdir, _, run = small_run
    console = (workdir / "console.txt").read_text()
    assert re.search(r"^\d\d:\d\d:\d\d simulate: sim 3 done in [\d.]+ s \[4/4\]$", console, re.M)
    epochs = re.findall(r"^\d\d:\d\d:\d\d epoch (\d+)/8: .*val_loss.*samples/s.*left$", console, re.M)
    assert epochs == [str(e) for e in range(1, 9)]
    assert "CosmoFlow run results/small:" in console
    assert "report: results/small/analysis/report.html" in console
    assert "cuInit" not in console and "E0000" not in console and "I0000" not in console
    train_log = (run / "logs" / "train" / "train.log").read_text()
    assert "epoch 8/8" in train_log and "E0000" not in train_log  # the full record, quiet too
