"""The whole pipeline, every rule through `train`, as real Snakemake runs on a very small ensemble."""

import hashlib
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import REPO, SMALL, run_cli, run_snakemake, write_config
from preprocessing.manifest import load_manifest
from simulations.sampling import read_params_csv


def digests(run_dir):
    """sha256 of every HDF5 and TFRecord file of a run, by relative path."""
    return {
        str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(run_dir.rglob("*"))
        if path.suffix in (".h5", ".tfrecord") and "training" not in path.relative_to(run_dir).parts
    }


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pipeline")
    config_path = write_config(workdir, SMALL)
    result = run_snakemake(workdir, "--configfile", str(config_path))
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, config_path, workdir / "results" / "small"


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
    assert run_snakemake(tmp_path, "--configfile", str(config_path)).returncode == 0
    first, second = digests(run), digests(tmp_path / "results" / "small")
    assert len(first) == 8 * 3 + len(list((run / "tfrecords").rglob("*.tfrecord")))
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
              "simulation": {**SMALL["simulation"], "batch_size": 8, "n_particles": 32, "n_steps": 10}}
    config_path = write_config(tmp_path, config)
    assert run_snakemake(tmp_path, "--configfile", str(config_path), "--until", "initial_conditions").returncode == 0
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

    # as after any kill -9: release Snakemake's lock, then rerun
    assert run_snakemake(tmp_path, "--configfile", str(config_path), "--unlock").returncode == 0
    result = run_snakemake(tmp_path, "--configfile", str(config_path))
    assert result.returncode == 0, result.stderr[-3000:]
    text = log.read_text()
    assert "sim 0 is up to date" in text and "sim 1 is up to date" in text and "sim 7 done" in text
    assert {i: path.stat().st_mtime_ns for i, path in done.items()} == mtimes
    assert run_cli("verify-data", run).returncode == 0


def test_changed_preprocessing_leaves_exactly_the_new_data_set(small_run, tmp_path):
    workdir = tmp_path / "pipeline"  # a copy (mtimes and Snakemake's records kept): the module's
    shutil.copytree(small_run[0], workdir, symlinks=True)  # other tests keep the original run
    run = workdir / "results" / "small"
    changed = {**SMALL, "preprocessing": {**SMALL["preprocessing"], "samples_per_file": 4, "compression": "gzip"}}
    result = run_snakemake(workdir, "--configfile", str(write_config(workdir, changed, "changed.yaml")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rule simulate" not in result.stdout + result.stderr  # the simulations are reused
    assert not list(run.glob("tfrecords/*/*.tfrecord"))  # the old uncompressed files are gone
    manifest = load_manifest(run / "tfrecords" / "manifest.json")
    assert manifest.compression == "GZIP" and {f.n_samples for f in manifest.files} == {4}
    assert (run / "training" / "checkpoints.superseded").is_dir()  # trained afresh on the new data
    assert run_cli("verify-data", run).returncode == 0


def test_missing_snapshot_is_named(small_run):
    workdir, _, run = small_run
    snapshot = run / "sims" / "00001" / "snapshot.h5"
    moved = snapshot.with_name("moved.h5")
    os.replace(snapshot, moved)
    try:
        result = run_cli("histogram", "--config", run / "config.yaml", "--sim-id", "1", "--force", cwd=workdir)
    finally:
        os.replace(moved, snapshot)
    assert result.returncode == 1
    assert str(snapshot.relative_to(workdir)) in result.stderr


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
