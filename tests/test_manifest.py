"""The manifest: merging shard summaries, exact normalisation sums, validation on load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from preprocessing.manifest import (
    add_moments, build_manifest, load_manifest, log1p_moments,
    write_shard_summary,
)
from workflow.errors import PipelineError
from workflow.paths import DatasetFiles

RANGES = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.9, 1.0)}


def shard(tfrecord_dir, split, index, sim_ids, counts=None, **changes):
    """Write a shard summary of one file holding 8 samples of each of ``sim_ids``."""
    if counts is None:
        counts = np.random.default_rng(index).poisson(2.0, (8, 4, 4, 4, 2)).astype(np.int16)
    fields = dict(
        split=split, shard=index, shape=[4, 4, 4, 2], dtype="int16", compression=None,
        redshifts=[1.0, 0.0], parameters=list(RANGES), samples_per_file=64,
        files=[{"path": f"{split}/{split}_{index:04d}.tfrecord", "n_samples": 8 * len(sim_ids),
                "sim_ids": sim_ids, "sha256": "0" * 64}],
        moments=log1p_moments(counts),
    ) | changes
    return write_shard_summary(DatasetFiles(tfrecord_dir).shard_summary(split, index), **fields)


def test_log1p_moments_of_integer_counts_match_direct_sums():
    rng = np.random.default_rng(0)
    counts = rng.poisson(5.0, (3, 6, 6, 6, 2)).astype(np.int16)
    moments = log1p_moments(counts)
    direct = np.log1p(counts.reshape(-1, 2).astype(np.float64))
    assert moments["n"] == [648, 648]
    np.testing.assert_allclose(moments["sum"], direct.sum(axis=0), rtol=1e-13)
    np.testing.assert_allclose(moments["sum_sq"], (direct**2).sum(axis=0), rtol=1e-13)
    as_float = log1p_moments(counts.astype(np.float32))
    np.testing.assert_allclose(as_float["sum"], moments["sum"], rtol=1e-12)
    halves = add_moments(log1p_moments(counts[:1]), log1p_moments(counts[1:]))
    np.testing.assert_allclose(halves["sum_sq"], moments["sum_sq"], rtol=1e-13)
    with pytest.raises(ValueError, match="negative"):
        log1p_moments(-counts[..., :1] - 1)


def test_manifest_merges_shards_and_normalises_over_training_only(tmp_path):
    rng = np.random.default_rng(1)
    train_a = rng.poisson(3.0, (8, 4, 4, 4, 2)).astype(np.int16)
    train_b = rng.poisson(9.0, (16, 4, 4, 4, 2)).astype(np.int16)
    shard(tmp_path, "train", 0, [4], train_a)
    shard(tmp_path, "train", 1, [1, 7], train_b)
    shard(tmp_path, "val", 0, [2], np.full((8, 4, 4, 4, 2), 1000, np.int16))
    manifest = load_manifest(build_manifest(tmp_path, RANGES))
    log_counts = np.log1p(np.concatenate([train_a, train_b]).reshape(-1, 2).astype(np.float64))
    np.testing.assert_allclose(manifest.log1p_mean, log_counts.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(manifest.log1p_std, log_counts.std(axis=0), rtol=1e-10)
    assert manifest.normalisation_split == "train"
    assert manifest.n_samples("train") == 24 and manifest.n_samples("val") == 8
    assert manifest.files_of("train") == [tmp_path / "train/train_0000.tfrecord",
                                          tmp_path / "train/train_0001.tfrecord"]
    assert manifest.target_ranges == RANGES and manifest.parameters == tuple(RANGES)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["splits"]["train"] == {"n_files": 2, "n_samples": 24, "sim_ids": [1, 4, 7]}
    assert data["byte_order"] == "little" and data["format_version"] == 1


def test_shards_that_disagree_are_refused(tmp_path):
    shard(tmp_path, "train", 0, [1])
    shard(tmp_path, "train", 1, [2], dtype="int32")
    with pytest.raises(PipelineError, match=r"train_shard_0001\.json has dtype = 'int32'"):
        build_manifest(tmp_path, RANGES)


def test_a_simulation_in_two_splits_is_refused(tmp_path):
    shard(tmp_path, "train", 0, [1, 2])
    shard(tmp_path, "val", 0, [2])
    with pytest.raises(PipelineError, match="Simulation 2 appears in both"):
        build_manifest(tmp_path, RANGES)


def test_targets_and_training_split_must_be_present(tmp_path):
    with pytest.raises(PipelineError, match="No shard summaries"):
        build_manifest(tmp_path, RANGES)
    shard(tmp_path, "val", 0, [1])
    with pytest.raises(PipelineError, match="Target ranges are given for"):
        build_manifest(tmp_path, {"Omega_m": (0.25, 0.35)})
    with pytest.raises(PipelineError, match="normalisation split 'train'"):
        build_manifest(tmp_path, RANGES)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("dtype"), "has no key 'dtype'"),
    (lambda m: m.update(dtype="int8"), "dtype = 'int8'; expected one of"),
    (lambda m: m.update(format_version=99), "format_version 99"),
    (lambda m: m.update(shape=[4, 4, 2]), r"shape = \[4, 4, 2\]"),
    (lambda m: m.update(compression="LZ4"), "compression = 'LZ4'"),
    (lambda m: m["normalisation"].update(std=[0.0, 1.0]), "std positive"),
    (lambda m: m["files"][0].update(n_samples="8"), r"files\[0\]\.n_samples = '8'; expected an integer"),
    (lambda m: m["files"][1].update(split="val", sim_ids=[1]), "simulation 1 in splits 'train' and 'val'"),
    (lambda m: m["target_ranges"].update(n_s=[1.0, 0.9]), "low < high"),
])
def test_load_manifest_names_the_faulty_key(tmp_path, edit, message):
    shard(tmp_path, "train", 0, [1])
    shard(tmp_path, "train", 1, [2])
    path = build_manifest(tmp_path, RANGES)
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match=message):
        load_manifest(path)


def test_unreadable_manifest_is_named(tmp_path):
    with pytest.raises(PipelineError, match="manifest.json does not exist"):
        load_manifest(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(PipelineError, match="manifest.json is not readable JSON"):
        load_manifest(tmp_path / "manifest.json")


def test_constant_training_counts_are_refused_before_writing(tmp_path):
    shard(tmp_path, "train", 0, [1], np.full((8, 4, 4, 4, 2), 3, np.int16))
    with pytest.raises(PipelineError, match="std positive"):
        build_manifest(tmp_path, RANGES)
    assert not (tmp_path / "manifest.json").exists()


def test_a_training_subset_is_the_first_simulations_as_whole_files(tmp_path):
    """training.train_fraction: the first simulations in file (shard) order, whole files only."""
    shard(tmp_path, "train", 0, [5, 2])
    shard(tmp_path, "train", 1, [1, 7])
    shard(tmp_path, "val", 0, [3])
    manifest = load_manifest(build_manifest(tmp_path, RANGES))
    assert manifest.simulations("train") == [5, 2, 1, 7]
    half = manifest.subset("train", 0.5)
    assert half.simulations("train") == [5, 2] and half.n_samples("train") == 16
    assert half.files_of("val") == manifest.files_of("val")
    assert manifest.subset("train", 1.0) is manifest
    with pytest.raises(PipelineError, match=r"selects 1 of the 4 simulations of split 'train' of "
                                            r"manifest, which file train/train_0000.tfrecord holds"):
        manifest.subset("train", 0.25)
