"""Staging: verified copies that training reads, reuse on rerun, per-rank node-local copies,
burst buffer, Lustre striping, and clean failures (corrupt source, full target, no Lustre)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, skip_unless_ci, write_config
from mpi_training import write_dataset
from preprocessing import staging
from preprocessing.manifest import load_manifest
from preprocessing.tfrecords import read_dataset
from training.pipeline import make_plan, training_dataset
from workflow.config import load_config, run_directory
from workflow.errors import PipelineError
from workflow.paths import RunLayout
from workflow.stages import STAGE, run_stage

SIMS = {"train": 4, "val": 2, "test": 2}  # 8 samples of 16^3 int16 each, 4 samples per file
LUSTRE = {"stripe_count": 4, "stripe_size": "4M", "optional": False}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A real data set: 16 TFRecord files of 4 samples (~33 KB each) and their manifest."""
    return write_dataset(tmp_path_factory.mktemp("data"), SIMS, grid=32, subvolume=16,
                         samples_per_file=4).parent


def make_run(tmp_path: Path, source: Path, **staging_section) -> dict:
    """A validated config whose run directory holds a copy of ``source`` as tfrecords/."""
    config = {"run_name": "t", "results_dir": str(tmp_path / "results"),
              "sampling": {"n_simulations": 8, "splits": {"train": 0.5, "val": 0.25, "test": 0.25}},
              "simulation": {"redshifts": [0.0]},  # one channel, as write_dataset writes
              "preprocessing": {"grid": 32, "subvolume": 16, "samples_per_file": 4},
              "staging": {"workers": 2, **staging_section}}
    shutil.copytree(source, tmp_path / "results" / "t" / "tfrecords")
    return load_config(write_config(tmp_path, config))


def stage_job(config: dict) -> dict:
    """The ``stage`` rule's job on ``config``, as `cosmoflow stage` runs it."""
    stage = STAGE["stage"]
    return run_stage(stage, RunLayout(run_directory(config)), stage.config_slice(config))


def resolve(config: dict, **options) -> Path:
    return staging.resolve_target(config["staging"], RunLayout(run_directory(config)), **options)


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """(inode, mtime_ns, sha256) of every file under ``directory``, by relative path."""
    return {str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns,
                                            hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def samples(manifest_path: Path, split: str = "train") -> list[bytes]:
    manifest = load_manifest(manifest_path)
    data = read_dataset(manifest.files_of(split), manifest.shape, manifest.dtype)
    return [x.tobytes() + y.tobytes() for x, y in data.as_numpy_iterator()]


def test_copy_mode_writes_a_verified_copy_that_training_reads(tmp_path, source):
    config = make_run(tmp_path, source, mode="copy")
    run = tmp_path / "results" / "t"
    record = stage_job(config)
    target = run / "staged" / "data"
    assert json.loads((run / "staged" / "staged.json").read_text()) == record
    assert record == staging.load_staged_record(run / "staged" / "staged.json")
    files = sorted(p for p in (run / "tfrecords").rglob("*.tfrecord"))
    assert {k: record[k] for k in ("mode", "target", "manifest", "files", "bytes", "verified",
                                   "in_job", "reused")} == {
        "mode": "copy", "target": str(target.absolute()),
        "manifest": str((target / "manifest.json").absolute()), "files": 16,
        "bytes": sum(p.stat().st_size for p in files), "verified": True, "in_job": False,
        "reused": False}
    assert record["source_manifest"] == str((run / "tfrecords" / "manifest.json").absolute())
    assert record["source_manifest_sha256"] == hashlib.sha256(
        (run / "tfrecords" / "manifest.json").read_bytes()).hexdigest()
    assert record["mb_per_s"] > 0 and record["seconds"] > 0
    for path in files:
        assert (target / path.relative_to(run / "tfrecords")).read_bytes() == path.read_bytes()
    assert not list(target.parent.glob("data.partial-*"))

    staged_manifest = Path(record["manifest"])
    assert samples(staged_manifest) == samples(run / "tfrecords" / "manifest.json")
    batches = []
    for path in (staged_manifest, run / "tfrecords" / "manifest.json"):  # the training input pipeline
        manifest = load_manifest(path)
        plan = make_plan(manifest, "train", n_ranks=1, batch_size=4)
        stream = training_dataset(manifest, plan, "train", rank=0, seed=3, shuffle_buffer=8,
                                  augment=True, epochs=range(2))
        batches.append([x.tobytes() for x, _, _ in stream.as_numpy_iterator()])
    assert batches[0] == batches[1] and len(batches[0]) == 2 * 8


def test_none_mode_verifies_in_place_and_names_a_corrupt_file(tmp_path, source):
    config = make_run(tmp_path, source)
    run = tmp_path / "results" / "t"
    record = stage_job(config)
    assert record["mode"] == "none" and record["verified"] and not record["in_job"]
    source_manifest = str((run / "tfrecords/manifest.json").absolute())
    assert record["manifest"] == record["source_manifest"] == source_manifest
    assert record["target"] == str((run / "tfrecords").absolute()) and record["files"] == 16
    assert json.loads((run / "staged/staged.json").read_text()) == record
    victim = run / "tfrecords" / load_manifest(run / "tfrecords/manifest.json").files[5].path
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(data)
    with pytest.raises(PipelineError, match=rf"{victim.name} does not match its sha256"):
        stage_job(config)


def test_rerun_reuses_a_verified_target_and_repairs_a_damaged_one(tmp_path, source):
    manifest = source / "manifest.json"
    first = staging.stage_files(manifest, tmp_path / "staged", workers=2, progress=False)
    before = snapshot(tmp_path / "staged")
    second = staging.stage_files(manifest, tmp_path / "staged", workers=2, progress=False)
    assert not first["reused"] and second["reused"] and second["reused_files"] == 16
    assert snapshot(tmp_path / "staged") == before  # nothing rewritten: same inodes and mtimes

    damaged = load_manifest(manifest).files[3].path
    (tmp_path / "staged" / damaged).write_bytes(b"truncated")
    (tmp_path / "staged" / load_manifest(manifest).files[4].path).unlink()
    third = staging.stage_files(manifest, tmp_path / "staged", workers=2, progress=False)
    assert not third["reused"] and third["reused_files"] == 14
    after = snapshot(tmp_path / "staged")
    assert {k: v[2] for k, v in after.items()} == {k: v[2] for k, v in before.items()}
    unchanged = [k for k in before if k not in (damaged, load_manifest(manifest).files[4].path,
                                                "manifest.json")]
    assert all(after[k][:2] == before[k][:2] for k in unchanged)  # hard-linked, not copied
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staged"]


def test_an_unrelated_existing_directory_is_not_replaced(tmp_path, source):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(PipelineError, match="not a staged copy"):
        staging.stage_files(source / "manifest.json", tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_corrupt_source_fails_naming_the_file_and_leaves_nothing(tmp_path, source):
    shutil.copytree(source, tmp_path / "src")
    manifest = load_manifest(tmp_path / "src" / "manifest.json")
    victim = tmp_path / "src" / manifest.files[7].path
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(data)
    before = snapshot(tmp_path / "src")
    expected = rf"staging {victim} to .*corrupt source file.*partial copy was removed"
    with pytest.raises(PipelineError, match=expected):
        staging.stage_files(tmp_path / "src" / "manifest.json", tmp_path / "out" / "staged",
                            workers=2, progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # no target and no partial directory
    assert snapshot(tmp_path / "src") == before


@pytest.fixture
def small_disk(tmp_path):
    """A 128 KiB tmpfs, a quarter of the data set (needs root); skipped where mounting is refused."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        skip_unless_ci(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_full_target_fails_cleanly_naming_the_file(small_disk, source):
    assert sum(p.stat().st_size for p in source.rglob("*.tfrecord")) > 4 * 128 * 1024
    before = snapshot(source)
    with pytest.raises(PipelineError) as failure:
        staging.stage_files(source / "manifest.json", small_disk / "staged", workers=2, progress=False)
    message = str(failure.value)
    assert "No space left on device" in message and "the target is full" in message
    assert f"staging {source}/" in message and ".tfrecord to " in message
    assert "partial copy was removed" in message
    assert list(small_disk.iterdir()) == []
    assert snapshot(source) == before


def test_node_local_stages_each_ranks_own_files(tmp_path, source, monkeypatch):
    config = make_run(tmp_path, source, mode="node_local", target=str(tmp_path / "$SCRATCH_NAME"))
    monkeypatch.setenv("SCRATCH_NAME", "local")
    record = stage_job(config)
    assert record["in_job"] and record["mode"] == "node_local" and not record["verified"]
    assert record["target"] == f"{tmp_path}/$SCRATCH_NAME/cosmoflow-t/rank{{rank:05d}}"
    assert not (tmp_path / "local").exists()  # the stage job copies nothing
    manifest = tmp_path / "results/t/tfrecords/manifest.json"
    names = [f.path for f in load_manifest(manifest).files]
    for rank in (0, 1):
        target = resolve(config, rank=rank)
        assert target == tmp_path / "local" / "cosmoflow-t" / f"rank{rank:05d}"
        report = staging.stage_files(manifest, target, names=names[rank::2], workers=2, progress=False)
        assert report["files"] == 8 and not report["reused"]
        held = sorted(str(p.relative_to(target)) for p in target.rglob("*.tfrecord"))
        assert held == sorted(names[rank::2])
    monkeypatch.delenv("SCRATCH_NAME")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    config["staging"]["target"] = None
    assert resolve(config, rank=3) == tmp_path / "tmpdir" / "cosmoflow-t" / "rank00003"
    with pytest.raises(PipelineError, match="give the rank"):
        resolve(config)


MPI_SCRIPT = """
import json, sys
from mpi4py import MPI
from preprocessing.manifest import load_manifest
from preprocessing.staging import resolve_target, stage_files
from workflow.config import load_config, run_directory
from workflow.paths import RunLayout

config, manifest = load_config(sys.argv[1]), sys.argv[2]
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
names = [f.path for f in load_manifest(manifest).files][rank::size]
target = resolve_target(config["staging"], RunLayout(run_directory(config)), rank=rank)
report = stage_files(manifest, target, names=names, workers=2, progress=False)
comm.Barrier()
reports = comm.gather(report)
if rank == 0:
    print(json.dumps(reports))
"""


def test_node_local_under_mpiexec_each_rank_stages_its_half(tmp_path, source):
    config = make_run(tmp_path, source, mode="node_local", target=str(tmp_path / "nodes"))
    config_path = tmp_path / "results/t/config.yaml"
    config_path.write_text(json.dumps(config))
    script = tmp_path / "stage_ranks.py"
    script.write_text(MPI_SCRIPT)
    manifest = tmp_path / "results/t/tfrecords/manifest.json"
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script), str(config_path),
                             str(manifest)], capture_output=True, text=True, timeout=120,
                            env=os.environ | {"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    names = [f.path for f in load_manifest(manifest).files]
    for rank, report in enumerate(reports):
        target = tmp_path / "nodes" / "cosmoflow-t" / f"rank{rank:05d}"
        assert report["target"] == str(target) and report["verified"]
        held = sorted(str(p.relative_to(target)) for p in target.rglob("*.tfrecord"))
        assert held == sorted(names[rank::2])
        for name in held:
            assert (target / name).read_bytes() == (manifest.parent / name).read_bytes()


def test_burst_buffer_verifies_what_stage_in_put_there(tmp_path, source, monkeypatch):
    config = make_run(tmp_path, source, mode="burst_buffer",
                      burst_buffer={"pool": "wlm_pool", "capacity_margin": 1.5})
    run = tmp_path / "results" / "t"
    monkeypatch.delenv("DW_JOB_STRIPED", raising=False)
    with pytest.raises(PipelineError, match=r"\$DW_JOB_STRIPED.*or staging\.target"):
        resolve(config)
    record = stage_job(config)
    assert record["in_job"] and record["target"] == "$DW_JOB_STRIPED/t"
    assert record["manifest"] == str((run / "tfrecords/manifest.json").absolute())
    assert (run / "staged/datawarp.bb").read_text() == staging.burst_buffer_directives(
        config["staging"], RunLayout(run), record["bytes"]) + "\n"
    assert staging.burst_buffer_sbatch_options(config) == f"--bbf={(run / 'staged/datawarp.bb').absolute()}"

    monkeypatch.setenv("DW_JOB_STRIPED", str(tmp_path / "dw"))
    target = resolve(config)
    assert target == tmp_path / "dw" / "t"
    shutil.copytree(run / "tfrecords", target)  # what `#DW stage_in type=directory` leaves
    before = snapshot(target)
    report = staging.stage_files(run / "tfrecords/manifest.json", target, workers=2, progress=False)
    assert report["reused"] and report["verified"] and snapshot(target) == before
    assert samples(Path(report["manifest"]), "val") == samples(run / "tfrecords/manifest.json", "val")

    config["staging"]["target"] = str(tmp_path / "nvme")
    assert resolve(config) == tmp_path / "dw" / "t"  # DataWarp first
    monkeypatch.delenv("DW_JOB_STRIPED")
    assert resolve(config) == tmp_path / "nvme"


def write_fake_lfs(directory: Path, exit_status: int = 0) -> Path:
    """An ``lfs`` that logs its arguments and the listing of its last argument (the directory)."""
    directory.mkdir()
    log = directory / "lfs.log"
    lfs = directory / "lfs"
    lfs.write_text(f"""#!/bin/sh
for last; do :; done
echo "argv: $*" >> {log}
echo "listing: $(ls -A "$last" | tr '\\n' ' ')" >> {log}
[ {exit_status} -eq 0 ] || echo "lfs setstripe: not a Lustre file system" >&2
exit {exit_status}
""")
    lfs.chmod(0o755)
    return log


def test_lustre_stripes_the_empty_directory_before_any_file(tmp_path, source, monkeypatch):
    log = write_fake_lfs(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    config = make_run(tmp_path, source, mode="lustre", target=str(tmp_path / "lustre" / "data"),
                      lustre={"stripe_count": 4, "stripe_size": "4M"})
    record = stage_job(config)
    argv, listing = log.read_text().splitlines()
    partial = tmp_path / "lustre" / f"data.partial-{os.getpid()}"
    assert argv == f"argv: setstripe -c 4 -S 4M {partial}"
    assert listing.strip() == "listing:"  # empty when striped
    assert record["mode"] == "lustre" and record["lustre"] == {
        "stripe_count": 4, "stripe_size": "4M", "applied": True}
    assert len(list((tmp_path / "lustre" / "data").rglob("*.tfrecord"))) == 16
    assert stage_job(config)["reused"] and len(log.read_text().splitlines()) == 2

    config["staging"]["lustre"]["stripe_count"] = 8  # new settings: a fresh, restriped copy
    assert not stage_job(config)["reused"]
    assert log.read_text().splitlines()[2].startswith("argv: setstripe -c 8 -S 4M ")


def test_lustre_without_lfs_fails_clearly_unless_optional(tmp_path, source, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(PipelineError, match=r"`lfs` is not on PATH.*staging\.lustre\.optional"):
        staging.stage_files(source / "manifest.json", tmp_path / "a", lustre=LUSTRE, progress=False)
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob("a.partial-*"))
    report = staging.stage_files(source / "manifest.json", tmp_path / "b", progress=False,
                                 lustre=LUSTRE | {"optional": True})
    assert report["verified"] and report["lustre"]["applied"] is False
    assert "copying unstriped" in caplog.text

    write_fake_lfs(tmp_path / "bin", exit_status=22)  # lfs present, target not on Lustre
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(PipelineError, match="not a Lustre file system; is the target on Lustre"):
        staging.stage_files(source / "manifest.json", tmp_path / "c", lustre=LUSTRE, progress=False)
    assert not list(tmp_path.glob("c*"))


def test_staged_record_problems_are_named(tmp_path):
    path = tmp_path / "staged.json"
    with pytest.raises(PipelineError, match=rf"{path} does not exist"):
        staging.load_staged_record(path)
    path.write_text("{not json")
    with pytest.raises(PipelineError, match=rf"{path} is not readable JSON"):
        staging.load_staged_record(path)
    path.write_text(json.dumps({"mode": "copy", "target": "/x"}))
    with pytest.raises(PipelineError, match=rf"{path} has no key 'manifest'"):
        staging.load_staged_record(path)


def test_size_estimate_matches_the_files_written(tmp_path, source):
    config = make_run(tmp_path, source, mode="copy")
    actual = {split: sum((source / f).stat().st_size for f in
                         [e.path for e in load_manifest(source / "manifest.json").files if e.split == split])
              for split in SIMS}
    estimate = staging.split_bytes(config)
    for split, n_sims in SIMS.items():
        n_samples = n_sims * 8
        assert actual[split] <= estimate[split] <= actual[split] + 32 * n_samples


def test_paper_plan_and_burst_buffer_request(tmp_path):
    config = load_config(REPO / "config/paper.yaml")
    sample = 128**3 * 2  # one 128^3 int16 channel: 4 MiB
    assert sample == 4 * 2**20
    total, train = 12632 * 8 * sample, (12632 - 2 * 1263) * 8 * sample
    assert 12632 * 8 == 101_056 and (12632 - 2 * 1263) * 8 == 80_848
    assert staging.dataset_bytes(config) == pytest.approx(total, rel=1e-4)

    config["staging"]["mode"] = "node_local"
    plan = staging.staging_plan(config, nodes=64, mb_per_s=50)
    assert plan["train_bytes"] == pytest.approx(train, rel=1e-4)
    assert plan["staged_bytes_per_node"] == pytest.approx(train / 64, rel=1e-4)
    assert plan["epoch_read_bytes_per_node"] == pytest.approx(train / 64, rel=1e-4)
    assert plan["stage_seconds"] == pytest.approx(train / 64 / 50e6, rel=1e-4)
    assert not plan["meets_requirement"] and plan["required_mb_per_s_per_node"] == 62
    assert staging.staging_plan(config, nodes=64)["meets_requirement"]
    text = staging.format_plan(plan)
    assert "50 MB/s per node does NOT meet the 62 MB/s per node" in text

    config["staging"]["mode"] = "copy"
    plan = staging.staging_plan(config, nodes=64, mb_per_s=100)
    assert plan["staged_bytes_per_node"] == pytest.approx(total, rel=1e-4)
    assert staging.staging_runtime_min(config) == math.ceil(1.5 * staging.dataset_bytes(config) / 50e6 / 60)
    config["staging"]["mode"] = "node_local"
    assert staging.staging_runtime_min(config) == 5

    assert staging.burst_buffer_sbatch_options(config) == ""
    config["staging"]["mode"] = "burst_buffer"
    config["staging"]["burst_buffer"]["pool"] = "wlm_pool"
    gib = math.ceil(total * 1.2 / 2**30)
    assert gib == 474
    run = RunLayout(run_directory(config))
    source = run.tfrecords.absolute()
    directives = staging.burst_buffer_directives(config["staging"], run, staging.dataset_bytes(config))
    assert directives.split("\n") == [
        f"#DW jobdw type=scratch access_mode=striped capacity={gib}GiB pool=wlm_pool",
        f"#DW stage_in type=directory source={source} destination=$DW_JOB_STRIPED/paper",
    ]


def test_cli_plan_compares_with_the_required_bandwidth():
    result = subprocess.run(["cosmoflow", "plan-staging", "--config", "config/paper.yaml",
                             "--nodes", "64", "--mb-per-s", "40"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=os.environ | {"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr
    assert "40 MB/s per node does NOT meet the 62 MB/s per node" in result.stdout
    assert "data set: 423.87 GB" in result.stdout and "64 node(s)" in result.stdout
    assert not (REPO / "results" / "paper" / "staged").exists()  # a plan writes nothing
