"""Sub-volumes and TFRecords: exact round trips, split planning, determinism, corruption, full disk."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import skip_unless_ci
from preprocessing.histogram import write_histogram
from preprocessing.manifest import build_manifest, load_manifest
from preprocessing.subvolumes import (
    assemble_subvolumes, split_subvolumes, subvolume_slices,
)
from preprocessing.tfrecords import (
    plan_shards, plan_split, read_dataset, serialize_example, verify_data, write_split_shard,
    write_tfrecord_file,
)
from workflow.errors import PipelineError

PARAMETERS = ("Omega_m", "sigma_8", "n_s")
RANGES = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.9, 1.0)}
GRID, SUBVOLUME, REDSHIFTS = 8, 4, (1.0, 0.0)
SPLITS = {"train": [0, 2, 3, 5, 7, 8], "val": [1, 4], "test": [6]}


def targets_of(sim_id: int) -> tuple[float, float, float]:
    return (0.25 + 0.01 * sim_id, 0.78 + 0.015 * sim_id, 0.9 + 0.009 * sim_id)


@pytest.fixture(scope="module")
def histograms(tmp_path_factory) -> dict[int, Path]:
    """Nine histograms (2 redshifts, 8^3 voxels) of Poisson counts, distinct per simulation."""
    directory = tmp_path_factory.mktemp("histograms")
    rng = np.random.default_rng(0)
    paths = {}
    for sim_id in sorted(sum(SPLITS.values(), [])):
        counts = rng.poisson(3.0 + sim_id, (len(REDSHIFTS),) + (GRID,) * 3).astype(np.int16)
        paths[sim_id] = write_histogram(directory / f"{sim_id:05d}.h5", counts, 16.0, REDSHIFTS,
                                        "ngp", sim_id)
    return paths


def expected_samples(histograms, sim_ids) -> dict[bytes, tuple[int, int]]:
    """x bytes of every (sim, sub-volume) sample -> (sim_id, index), read independently with h5py."""
    import h5py

    samples = {}
    for sim_id in sim_ids:
        with h5py.File(histograms[sim_id], "r") as f:
            for index, sample in enumerate(split_subvolumes(f["counts"][()], SUBVOLUME)):
                samples[sample.astype("<i2").tobytes()] = (sim_id, index)
    return samples


def write_run(run_dir: Path, histograms, compression=None, seed=42, samples_per_file=3) -> Path:
    """Plan and write every shard of every split, then build the manifest."""
    for split, sim_ids in SPLITS.items():
        plan = plan_split(sim_ids, 8, samples_per_file, seed, split, sims_per_shard=2,
                          compression=compression)
        for shard in range(plan.n_shards):
            write_split_shard(plan, shard, histograms, {s: targets_of(s) for s in sim_ids},
                              PARAMETERS, run_dir / "tfrecords", SUBVOLUME)
    return build_manifest(run_dir / "tfrecords", RANGES)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, histograms) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    write_run(run_dir, histograms)
    return run_dir


def test_subvolumes_tile_the_grid_exactly():
    grids = np.arange(2 * 12**3).reshape(2, 12, 12, 12)
    parts = split_subvolumes(grids, 4)
    assert parts.shape == (27, 4, 4, 4, 2)
    # Every voxel of every channel appears exactly once, and reassembly restores the grid.
    np.testing.assert_array_equal(np.sort(parts.ravel()), grids.ravel())
    np.testing.assert_array_equal(assemble_subvolumes(parts), grids)
    # Sub-volume s = (a k + b) k + c starts at voxel (a, b, c) * n; channels last.
    a, b, c = 1, 2, 0
    np.testing.assert_array_equal(parts[(a * 3 + b) * 3 + c][..., 1], grids[1, 4:8, 8:12, 0:4])
    assert subvolume_slices(12, 4, 5) == (slice(0, 4), slice(4, 8), slice(8, 12))
    with pytest.raises(ValueError, match="sub-volume size 5 does not divide the histogram grid 12"):
        split_subvolumes(grids, 5)


def test_record_reads_back_with_only_the_mlperf_parse_ops():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 3000, (4, 4, 4, 2)).astype(">i2")  # big-endian input is stored little-endian
    y = (0.3123, 0.8456, 0.9678)
    record = serialize_example(x, y, sim_id=12)
    parsed = tf.io.parse_single_example(record, {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([3], tf.float32),
        "shape": tf.io.FixedLenFeature([4], tf.int64),
        "sim_id": tf.io.FixedLenFeature([], tf.int64),
    })
    decoded = tf.reshape(tf.io.decode_raw(parsed["x"], tf.int16), parsed["shape"]).numpy()
    np.testing.assert_array_equal(decoded, x)
    np.testing.assert_array_equal(parsed["y"].numpy(), np.float32(y))
    assert parsed["sim_id"].numpy() == 12
    assert serialize_example(x, y, 12) == record  # deterministic serialisation


def test_plan_assigns_every_sample_once_and_interleaves_simulations():
    sim_ids = list(range(100, 140))
    plan = plan_split(sim_ids, 8, 16, seed=3, split="train", sims_per_shard=5)
    samples = [sample for f in plan.files for sample in f.samples]
    assert sorted(samples) == [(s, i) for s in sim_ids for i in range(8)]
    # Shards hold whole files (sims_per_shard 5 -> 6, a multiple of the 2 sims that fill a file)
    # and whole simulations; only the last file of the split may be short.
    assert [len(f.samples) for f in plan.files] == [16] * 20
    assert plan.n_shards == 7
    shard_of = {}
    for f in plan.files:
        for sim_id in f.sim_ids:
            assert shard_of.setdefault(sim_id, f.shard) == f.shard
    assert sorted(shard_of) == sim_ids
    assert min(len(f.sim_ids) for f in plan.files) >= 4  # samples are mixed, not sim by sim
    assert [f.name for f in plan.files[:2]] == ["train_0000.tfrecord", "train_0001.tfrecord"]
    # the cheap shard plan that the workflow's DAG uses agrees with the full plan
    assert plan_shards(sim_ids, 8, 16, 3, "train", 5) == [plan.shard_sim_ids(k) for k in range(7)]
    assert plan_split(sim_ids[::-1], 8, 16, 3, "train", 5) == plan  # input order is irrelevant
    assert plan_split(sim_ids, 8, 16, 4, "train", 5) != plan
    short = plan_split(range(5), 8, 16, 3, "val", 64, compression="GZIP")
    assert [len(f.samples) for f in short.files] == [16, 16, 8]
    assert short.files[0].name == "val_0000.tfrecord.gz"


def test_end_to_end_every_sample_once_and_counts_match_manifest(run_dir, histograms):
    manifest = load_manifest(run_dir / "tfrecords/manifest.json")
    assert manifest.shape == (SUBVOLUME, SUBVOLUME, SUBVOLUME, 2) and manifest.dtype == "int16"
    assert manifest.redshifts == REDSHIFTS and manifest.parameters == PARAMETERS
    split_of = {}
    for split, sim_ids in SPLITS.items():
        assert {s for f in manifest.files if f.split == split for s in f.sim_ids} == set(sim_ids)
        for sim_id in sim_ids:
            assert split_of.setdefault(sim_id, split) == split  # no simulation in two splits
        expected = expected_samples(histograms, sim_ids)
        assert manifest.n_samples(split) == len(expected) == 8 * len(sim_ids)
        dataset = read_dataset(manifest.files_of(split), manifest.shape, manifest.dtype,
                               manifest.compression, n_targets=3)
        found = []
        for x, y in dataset.as_numpy_iterator():
            sim_id, index = expected[x.astype("<i2").tobytes()]
            np.testing.assert_array_equal(y, np.float32(targets_of(sim_id)))
            found.append((sim_id, index))
        assert sorted(found) == sorted(expected.values())  # each sample written exactly once
    assert verify_data(run_dir) == []


def test_normalisation_is_exact_log1p_statistics_of_training_split(run_dir, histograms):
    import h5py

    manifest = load_manifest(run_dir / "tfrecords/manifest.json")
    counts = []
    for sim_id in SPLITS["train"]:
        with h5py.File(histograms[sim_id], "r") as f:
            counts.append(f["counts"][()])
    log_counts = np.log1p(np.stack(counts).astype(np.float64))  # (sims, channel, G, G, G)
    np.testing.assert_allclose(manifest.log1p_mean, log_counts.mean(axis=(0, 2, 3, 4)), rtol=1e-12)
    np.testing.assert_allclose(manifest.log1p_std, log_counts.std(axis=(0, 2, 3, 4)), rtol=1e-9)


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_same_inputs_and_seed_give_byte_identical_files(tmp_path, histograms, compression):
    first = write_run(tmp_path / "a", histograms, compression)
    second = write_run(tmp_path / "b", histograms, compression)
    files = sorted(p.relative_to(first.parent) for p in first.parent.glob("*/*.tfrecord*"))
    assert len(files) == 16 + 6 + 3  # ceil(8 samples x sims / 3) per split
    for name in files:
        assert (first.parent / name).read_bytes() == (second.parent / name).read_bytes(), name
    assert json.loads(first.read_text())["files"] == json.loads(second.read_text())["files"]
    if compression == "GZIP":
        # TF's GZIP records are a plain gzip stream of the uncompressed TFRecord file.
        plain = write_run(tmp_path / "plain", histograms, None)
        for name in files:
            uncompressed = plain.parent / str(name).removesuffix(".gz")
            assert gzip.decompress((first.parent / name).read_bytes()) == uncompressed.read_bytes()


def test_corrupted_byte_is_found_by_verify_and_raises_in_reader(tmp_path, histograms):
    write_run(tmp_path, histograms)
    manifest = load_manifest(tmp_path / "tfrecords/manifest.json")
    victim = manifest.files_of("train")[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = verify_data(tmp_path)
    assert problems and all(str(victim) in p for p in problems)
    assert any("corrupt" in p for p in problems) and any("sha256" in p for p in problems)
    dataset = read_dataset([victim], manifest.shape, manifest.dtype)
    with pytest.raises(tf.errors.DataLossError):
        for _ in dataset:
            pass


def test_verify_reports_missing_and_unlisted_files(tmp_path, histograms):
    write_run(tmp_path, histograms)
    manifest = load_manifest(tmp_path / "tfrecords/manifest.json")
    missing = manifest.files_of("val")[0]
    missing.unlink()
    stray = tmp_path / "tfrecords/train/train_9999.tfrecord"
    stray.write_bytes(b"")
    problems = verify_data(tmp_path)
    assert problems == [f"{missing}: listed in the manifest but missing.",
                        f"{stray}: TFRecord file not listed in the manifest."]
    assert "does not exist" in verify_data(tmp_path / "nowhere")[0]


def test_missing_histogram_is_named(tmp_path, histograms):
    plan = plan_split([0, 99], 8, 4, 1, "train")
    paths = dict(histograms) | {99: tmp_path / "00099.h5"}
    with pytest.raises(PipelineError, match=r"00099\.h5 does not exist"):
        write_split_shard(plan, 0, paths, {0: targets_of(0), 99: targets_of(99)}, PARAMETERS,
                          tmp_path / "tfrecords", SUBVOLUME)
    with pytest.raises(PipelineError, match="sub-volumes per simulation"):
        write_split_shard(plan_split([0], 27, 4, 1, "train"), 0, histograms, {0: targets_of(0)},
                          PARAMETERS, tmp_path / "tfrecords", SUBVOLUME)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (needs root); skipped where mounting is not allowed."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        skip_unless_ci(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_full_disk_leaves_no_file_and_says_why(small_disk, compression):
    rng = np.random.default_rng(2)
    records = (serialize_example(rng.integers(0, 30000, (16, 16, 16, 1)).astype(np.int16),
                                 (0.3, 0.8, 0.96), i) for i in range(20))  # 20 x 8 KiB > 64 KiB
    target = small_disk / "train" / "train_0000.tfrecord"
    with pytest.raises(PipelineError, match=r"train_0000\.tfrecord: No space left on device"):
        write_tfrecord_file(target, records, compression)
    assert list(small_disk.rglob("*")) == [small_disk / "train"]  # no final and no temporary file


def test_shard_files_have_manifest_checksums(run_dir):
    manifest = load_manifest(run_dir / "tfrecords/manifest.json")
    for entry in manifest.files:
        digest = hashlib.sha256((manifest.root / entry.path).read_bytes()).hexdigest()
        assert digest == entry.sha256
