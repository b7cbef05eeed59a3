"""The TFRecord manifest: what every file holds, and how the input pipeline normalises it.

Each ``write_tfrecords`` job (one shard of one split, see :mod:`preprocessing.tfrecords`) leaves
a shard summary next to its files; :func:`build_manifest` merges the summaries without rereading
any sample. The normalisation statistics are the exact mean and standard deviation of
log1p(counts) over every voxel of the training split, per channel, from the shards' streaming
sums (sum and sum of squares of log1p, in float64). The targets stay in physical units in the
records; the manifest records the ranges the input pipeline scales them over (docs/formats.md,
"Normalisation").

Outputs (run directory, docs/formats.md; named by :class:`workflow.paths.DatasetFiles`):

* ``tfrecords/<split>/<split>_shard_<NNNN>.json``: one shard's files (written by the shard job
  through :func:`write_shard_summary`);
* ``tfrecords/manifest.json``: ``format_version``, ``code_version``, ``shape`` [n, n, n, C],
  ``dtype``, ``byte_order``, ``redshifts`` (channel order), ``compression`` (null | "GZIP"),
  ``samples_per_file``, ``parameters`` (order of ``y``), ``target_ranges``, ``normalisation``
  (transform, split, per-channel mean and std, voxel count), ``splits`` (files, samples and
  sim_ids per split) and ``files`` (path relative to ``tfrecords/``, split, n_samples, sim_ids,
  sha256).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from workflow.errors import PipelineError
from workflow.io import atomic_write_text, sha256_file
from workflow.paths import DatasetFiles
from workflow.version import CODE_VERSION

FORMAT_VERSION = 1
VOXEL_DTYPES = {"int16": np.dtype(np.int16), "int32": np.dtype(np.int32),
                "float32": np.dtype(np.float32)}
"""The stored voxel types of histograms and samples, by name (integer counts or CIC's float)."""
COMPRESSIONS = (None, "GZIP")  # TensorFlow's names of the config's preprocessing.compression
#: Keys that every shard of the data set must agree on.
SHARED_KEYS = ("shape", "dtype", "compression", "redshifts", "parameters", "samples_per_file")


def log1p_moments(samples: np.ndarray) -> dict[str, list]:
    """Streaming sums of log1p over ``samples`` (..., C), per channel C (last axis).

    Returns ``{"n": [...], "sum": [...], "sum_sq": [...]}`` (voxel counts, sum of log1p(x) and
    of log1p(x)^2). Integer counts go through a table of value frequencies, so the sums are
    exact up to float64 rounding of the table and cheap; float counts are summed directly.
    """
    flat = np.asarray(samples).reshape(-1, samples.shape[-1])
    n, total, total_sq = [], [], []
    for channel in flat.T:
        if channel.dtype.kind in "iu":
            if channel.size and channel.min() < 0:
                raise ValueError("particle counts cannot be negative")
            frequency = np.bincount(channel).astype(np.float64)
            log_value = np.log1p(np.arange(len(frequency), dtype=np.float64))
            total.append(float(frequency @ log_value))
            total_sq.append(float(frequency @ log_value**2))
        else:
            log_value = np.log1p(channel.astype(np.float64))
            total.append(float(log_value.sum()))
            total_sq.append(float(log_value @ log_value))
        n.append(int(channel.size))
    return {"n": n, "sum": total, "sum_sq": total_sq}


def add_moments(a: dict[str, list] | None, b: dict[str, list]) -> dict[str, list]:
    """Channel-wise sum of two :func:`log1p_moments` results (``a`` may be None)."""
    if a is None:
        return {key: list(values) for key, values in b.items()}
    return {key: [x + y for x, y in zip(a[key], b[key])] for key in a}


def write_shard_summary(
    path: str | os.PathLike,
    *,
    split: str,
    shard: int,
    shape: Sequence[int],
    dtype: str,
    compression: str | None,
    redshifts: Sequence[float],
    parameters: Sequence[str],
    samples_per_file: int,
    files: Sequence[Mapping],
    moments: Mapping[str, list],
) -> Path:
    """Write one shard's summary (JSON, atomically); ``files`` entries as in the manifest."""
    summary = {
        "format_version": FORMAT_VERSION, "split": split, "shard": int(shard),
        "shape": [int(s) for s in shape], "dtype": dtype, "compression": compression,
        "redshifts": [float(z) for z in redshifts], "parameters": list(parameters),
        "samples_per_file": int(samples_per_file), "files": [dict(f) for f in files],
        "log1p_moments": dict(moments),
    }
    atomic_write_text(path, json.dumps(summary, indent=1) + "\n")
    return Path(path)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{what} {path} does not exist.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PipelineError(f"{what} {path} is not readable JSON: {error}.") from error


def _read_shard_summary(path: Path) -> dict:
    summary = _read_json(path, "Shard summary")
    if not isinstance(summary, dict) or summary.get("format_version") != FORMAT_VERSION:
        raise PipelineError(
            f"Shard summary {path} is not a format-version {FORMAT_VERSION} summary; rerun the "
            f"write_tfrecords stage."
        )
    return summary | {"_path": str(path)}


def build_manifest(
    tfrecord_dir: str | os.PathLike,
    target_ranges: Mapping[str, Sequence[float]],
    summaries: Sequence[str | os.PathLike] | None = None,
    normalisation_split: str = "train",
) -> Path:
    """Merge the shard summaries under ``tfrecord_dir`` into ``tfrecord_dir/manifest.json``.

    Parameters
    ----------
    tfrecord_dir : the run's ``tfrecords/`` directory.
    target_ranges : (low, high) of each target parameter, used to scale ``y`` to [-1, 1]; its
        keys must be the parameters recorded in the records, in any order.
    summaries : the shard summaries to merge; default all ``*/*_shard_*.json`` found.
    normalisation_split : the split whose voxels give the log1p mean and std.

    Raises PipelineError if the shards disagree on shape, dtype, compression, redshifts or
    parameters, if a simulation appears in two shards, or if the normalisation split is empty.
    """
    tfrecord_dir = Path(tfrecord_dir)
    if summaries is None:
        summaries = DatasetFiles(tfrecord_dir).shard_summaries()
    if not summaries:
        raise PipelineError(f"No shard summaries to build a manifest from in {tfrecord_dir}.")
    shards = sorted(
        (_read_shard_summary(Path(p)) for p in summaries), key=lambda s: (s["split"], s["shard"])
    )
    first = shards[0]
    for shard in shards[1:]:
        for key in SHARED_KEYS:
            if shard.get(key) != first.get(key):
                raise PipelineError(
                    f"Shard summary {shard['_path']} has {key} = {shard.get(key)!r}, but "
                    f"{first['_path']} has {first.get(key)!r}; rewrite the TFRecords with one "
                    f"configuration."
                )
    parameters = first["parameters"]
    if sorted(target_ranges) != sorted(parameters):
        raise PipelineError(
            f"Target ranges are given for {sorted(target_ranges)}, but the records hold "
            f"parameters {parameters}."
        )
    files, sim_split, moments = [], {}, None
    for shard in shards:
        for entry in shard["files"]:
            for sim_id in entry["sim_ids"]:
                if sim_split.setdefault(sim_id, shard["_path"]) != shard["_path"]:
                    raise PipelineError(
                        f"Simulation {sim_id} appears in both {sim_split[sim_id]} and "
                        f"{shard['_path']}; a simulation must belong to one shard of one split."
                    )
            files.append({"split": shard["split"], **entry})
        if shard["split"] == normalisation_split:
            moments = add_moments(moments, shard["log1p_moments"])
    if moments is None:
        raise PipelineError(
            f"No shard of the normalisation split '{normalisation_split}' in {tfrecord_dir}."
        )
    mean = [s / n for s, n in zip(moments["sum"], moments["n"])]
    std = [math.sqrt(max(sq / n - m * m, 0.0)) for sq, n, m in zip(moments["sum_sq"], moments["n"], mean)]
    splits = {}
    for entry in files:
        split = splits.setdefault(entry["split"], {"n_files": 0, "n_samples": 0, "sim_ids": set()})
        split["n_files"] += 1
        split["n_samples"] += entry["n_samples"]
        split["sim_ids"].update(entry["sim_ids"])
    manifest = {
        "format_version": FORMAT_VERSION,
        "code_version": CODE_VERSION,
        **{key: first[key] for key in SHARED_KEYS},
        "byte_order": "little",
        "target_ranges": {name: [float(v) for v in target_ranges[name]] for name in parameters},
        "normalisation": {
            "transform": "log1p", "split": normalisation_split, "mean": mean, "std": std,
            "n_voxels": moments["n"][0],
        },
        "splits": {
            name: {**split, "sim_ids": sorted(split["sim_ids"])} for name, split in splits.items()
        },
        "files": files,
    }
    path = DatasetFiles(tfrecord_dir).manifest
    _validated(manifest, path)
    atomic_write_text(path, json.dumps(manifest, indent=1) + "\n")
    return path


@dataclass(frozen=True)
class ManifestFile:
    """One TFRecord file: ``path`` relative to the manifest's directory."""

    path: str
    split: str
    n_samples: int
    sim_ids: tuple[int, ...]
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A validated ``manifest.json``; ``root`` is its directory (``tfrecords/``)."""

    root: Path
    shape: tuple[int, int, int, int]
    dtype: str
    compression: str | None
    redshifts: tuple[float, ...]
    parameters: tuple[str, ...]
    target_ranges: dict[str, tuple[float, float]]
    log1p_mean: tuple[float, ...]
    log1p_std: tuple[float, ...]
    normalisation_split: str
    samples_per_file: int
    files: tuple[ManifestFile, ...]

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.split for f in self.files))

    def files_of(self, split: str) -> list[Path]:
        """Absolute paths of the files of ``split``, in manifest order."""
        return [self.root / f.path for f in self.files if f.split == split]

    def n_samples(self, split: str) -> int:
        return sum(f.n_samples for f in self.files if f.split == split)

    def simulations(self, split: str) -> list[int]:
        """The simulations of ``split`` in the order of their first file (the files are in
        shard order, and each shard holds shuffled simulations)."""
        return list(dict.fromkeys(s for f in self.files if f.split == split for s in f.sim_ids))

    def subset(self, split: str, fraction: float, where: str | os.PathLike = "manifest") -> "Manifest":
        """This manifest with ``split`` cut to its first round(fraction x simulations)
        simulations (:meth:`simulations`), as whole files (training.train_fraction; the
        learning curve). PipelineError, naming ``where``, if a file holds simulations on both
        sides of the cut."""
        if fraction >= 1:
            return self
        order = self.simulations(split)
        chosen = set(order[:round(fraction * len(order))])
        straddling = [f.path for f in self.files if f.split == split
                      and chosen & set(f.sim_ids) and not chosen >= set(f.sim_ids)]
        if not chosen or straddling:
            raise PipelineError(
                f"training.train_fraction = {fraction:g} selects {len(chosen)} of the "
                f"{len(order)} simulations of split '{split}' of {where}, which "
                + (f"file {straddling[0]} holds together with others" if straddling else "is none")
                + "; choose a fraction whose simulations fill whole shards "
                "(preprocessing.sims_per_shard).")
        files = tuple(f for f in self.files if f.split != split or chosen >= set(f.sim_ids))
        return dataclasses.replace(self, files=files)

    # The input pipeline's transforms (docs/formats.md, "Normalisation"), shared by training and
    # analysis. Each works on NumPy arrays and on TensorFlow tensors (also inside tf.data maps).

    def target_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) of the targets in parameter order, float32: the sampled ranges."""
        return tuple(np.array([self.target_ranges[p][i] for p in self.parameters], np.float32)
                     for i in (0, 1))

    def scale_targets(self, y):
        """Targets y (physical units, parameter order, last axis) -> scaled to [-1, 1]."""
        low, high = self.target_bounds()
        return 2.0 * (y - low) / (high - low) - 1.0

    def unscale_targets(self, scaled):
        """The inverse of :meth:`scale_targets`: scaled targets -> physical units."""
        low, high = self.target_bounds()
        return low + (scaled + 1.0) * (high - low) / 2.0

    def normalise_counts(self, x):
        """Counts x (..., channels) -> (log1p(x) - mean) / std per channel, float32."""
        mean, std = (np.array(v, np.float32) for v in (self.log1p_mean, self.log1p_std))
        if isinstance(x, np.ndarray):
            return (np.log1p(x.astype(np.float32)) - mean) / std
        import tensorflow as tf

        return (tf.math.log1p(tf.cast(x, tf.float32)) - mean) / std

    def normalise(self, x, y):
        """A sample as the network sees it: (:meth:`normalise_counts` (x), :meth:`scale_targets` (y))."""
        return self.normalise_counts(x), self.scale_targets(y)

    def counts_from_normalised(self, normalised):
        """The inverse of :meth:`normalise_counts` (NumPy): expm1(normalised x std + mean)."""
        return np.expm1(np.asarray(normalised, np.float64) * self.log1p_std + self.log1p_mean)


def _field(data: Mapping, key: str, kind, path: Path, where: str = ""):
    """``data[key]`` if present and of type ``kind``; else a PipelineError naming both."""
    if key not in data:
        raise PipelineError(f"Manifest {path} has no key '{where}{key}'.")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise PipelineError(
            f"Manifest {path} has {where}{key} = {value!r}; expected {_kind_name(kind)}."
        )
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", str: "a string", list: "a list", dict: "a mapping",
                        type(None): "null"}[k] for k in kinds)


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Read and validate ``manifest.json``; raises PipelineError naming the key at fault."""
    path = Path(path)
    return _validated(_read_json(path, "Manifest"), path)


def _validated(data, path: Path) -> Manifest:
    """The :class:`Manifest` of the parsed JSON ``data`` of ``path``, checked key by key."""
    if not isinstance(data, dict):
        raise PipelineError(f"Manifest {path} is not a JSON object.")
    version = _field(data, "format_version", int, path)
    if version != FORMAT_VERSION:
        raise PipelineError(
            f"Manifest {path} has format_version {version}; this code reads version "
            f"{FORMAT_VERSION}; rebuild it with the manifest stage."
        )
    shape = _field(data, "shape", list, path)
    if len(shape) != 4 or not all(isinstance(s, int) and s > 0 for s in shape) or len(set(shape[:3])) != 1:
        raise PipelineError(f"Manifest {path} has shape = {shape}; expected [n, n, n, channels].")
    dtype = _field(data, "dtype", str, path)
    if dtype not in VOXEL_DTYPES:
        raise PipelineError(f"Manifest {path} has dtype = {dtype!r}; expected one of "
                            f"{tuple(VOXEL_DTYPES)}.")
    compression = _field(data, "compression", (str, type(None)), path)
    if compression not in COMPRESSIONS:
        raise PipelineError(
            f"Manifest {path} has compression = {compression!r}; expected one of {COMPRESSIONS}."
        )
    redshifts = _field(data, "redshifts", list, path)
    if len(redshifts) != shape[3]:
        raise PipelineError(
            f"Manifest {path} lists {len(redshifts)} redshifts for {shape[3]} channels."
        )
    parameters = _field(data, "parameters", list, path)
    ranges = _field(data, "target_ranges", dict, path)
    if sorted(ranges) != sorted(parameters) or not all(
        len(ranges[p]) == 2 and ranges[p][0] < ranges[p][1] for p in parameters
    ):
        raise PipelineError(
            f"Manifest {path} has target_ranges = {ranges}; expected (low, high) with "
            f"low < high for each of {parameters}."
        )
    normalisation = _field(data, "normalisation", dict, path)
    mean = _field(normalisation, "mean", list, path, "normalisation.")
    std = _field(normalisation, "std", list, path, "normalisation.")
    if len(mean) != shape[3] or len(std) != shape[3] or not all(s > 0 for s in std):
        raise PipelineError(
            f"Manifest {path} has normalisation mean {mean} and std {std}; expected "
            f"{shape[3]} values each, std positive."
        )
    files = []
    for index, entry in enumerate(_field(data, "files", list, path)):
        where = f"files[{index}]."
        files.append(ManifestFile(
            path=_field(entry, "path", str, path, where),
            split=_field(entry, "split", str, path, where),
            n_samples=_field(entry, "n_samples", int, path, where),
            sim_ids=tuple(_field(entry, "sim_ids", list, path, where)),
            sha256=_field(entry, "sha256", str, path, where),
        ))
    _check_split_membership(files, path)
    return Manifest(
        root=path.parent, shape=tuple(shape), dtype=dtype, compression=compression,
        redshifts=tuple(redshifts), parameters=tuple(parameters),
        target_ranges={p: tuple(ranges[p]) for p in parameters},
        log1p_mean=tuple(mean), log1p_std=tuple(std),
        normalisation_split=_field(normalisation, "split", str, path, "normalisation."),
        samples_per_file=_field(data, "samples_per_file", int, path),
        files=tuple(files),
    )


def verify_files(manifest: Manifest, manifest_path: Path, split: str | None = None,
                 workers: int = 1) -> int:
    """Check that every file of ``split`` (all splits: None) exists and matches its sha256 in
    the manifest, ``workers`` files at a time; return their bytes. PipelineError names a
    missing or corrupt file."""

    def verified_size(entry: ManifestFile) -> int:
        path = manifest.root / entry.path
        if not path.is_file():
            raise PipelineError(f"{path} is listed in {manifest_path} but does not exist; rerun the "
                                "write_tfrecords and manifest jobs")
        if sha256_file(path) != entry.sha256:
            raise PipelineError(f"{path} does not match its sha256 in {manifest_path} (corrupt file); "
                                "rerun the write_tfrecords job that wrote it")
        return path.stat().st_size

    entries = [entry for entry in manifest.files if split is None or entry.split == split]
    with ThreadPoolExecutor(workers) as pool:  # hashlib releases the GIL: files hash in parallel
        return sum(pool.map(verified_size, entries))


def _check_split_membership(files: Sequence[ManifestFile], path: Path) -> None:
    """No file listed twice and no simulation in two splits."""
    seen_paths, sim_split = set(), {}
    for entry in files:
        if entry.path in seen_paths:
            raise PipelineError(f"Manifest {path} lists file {entry.path} twice.")
        seen_paths.add(entry.path)
        for sim_id in entry.sim_ids:
            if sim_split.setdefault(sim_id, entry.split) != entry.split:
                raise PipelineError(
                    f"Manifest {path} puts simulation {sim_id} in splits "
                    f"'{sim_split[sim_id]}' and '{entry.split}'; a simulation belongs to one split."
                )
