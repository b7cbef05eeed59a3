"""TFRecord samples: planning, writing, reading and verifying the training data set.

Each sample is one sub-volume of one simulation's histogram (``tf.train.Example`` with ``x``:
raw little-endian bytes of shape [n, n, n, channels], ``y``: the simulation's parameters,
``shape`` and ``sim_id``; docs/formats.md, "TFRecord samples"). This is a superset of the MLPerf HPC
CosmoFlow record, whose reader (``parse_single_example`` + ``decode_raw`` + ``reshape``) works
on these files.

Splitting is by simulation (params.csv); inside a split, :func:`plan_split` shuffles the
simulations with a seed, groups them into *shards* of whole files and shuffles the samples of
each shard across its files, so every file mixes many simulations (the paper's 64 samples per
file then come from up to 64 simulations). The plan is a pure function of its arguments: each
``write_tfrecords`` job recomputes it and writes one shard with :func:`write_split_shard`,
reading only that shard's histograms. At paper scale (~10k training simulations, 8 sub-volumes
each, 64 samples per file) and 64 simulations per shard that is ~160 independent jobs of 8 files.

Outputs (run directory; docs/formats.md, "TFRecord samples", "Shard summaries"):

* ``tfrecords/<split>/<split>_<NNNN>.tfrecord`` (``.tfrecord.gz`` with GZIP compression),
  numbered consecutively within the split;
* ``tfrecords/<split>/<split>_shard_<NNNN>.json``: the shard's files, sha256 and log1p sums,
  merged into ``tfrecords/manifest.json`` by :func:`preprocessing.manifest.build_manifest`.

TensorFlow is imported inside the functions that need it, to keep imports of this module cheap.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import h5py
import numpy as np

from preprocessing.manifest import (
    COMPRESSIONS, add_moments, load_manifest, log1p_moments, write_shard_summary,
)
from preprocessing.subvolumes import blocks_per_side, subvolume_slices
from workflow.config import shard_size
from workflow.errors import PipelineError
from workflow.io import atomic_path, sha256_file
from workflow.logs import PROGRESS
from workflow.paths import DatasetFiles, RunLayout

log = logging.getLogger(__name__)

SUFFIXES = {None: ".tfrecord", "GZIP": ".tfrecord.gz"}


def tfrecord_name(split: str, index: int, compression: str | None = None) -> str:
    """File name of the ``index``-th file of ``split``: ``<split>_<NNNN>.tfrecord[.gz]``."""
    _check_compression(compression)
    return f"{split}_{index:04d}{SUFFIXES[compression]}"


def _check_compression(compression: str | None) -> None:
    if compression not in COMPRESSIONS:
        raise PipelineError(
            f"TFRecord compression {compression!r} is not one of {COMPRESSIONS} (null = none)."
        )


def serialize_example(x: np.ndarray, y: Sequence[float], sim_id: int) -> bytes:
    """One sample as a serialized ``tf.train.Example`` (deterministic bytes).

    ``x``: sub-volume (n, n, n, channels) of particle counts, stored as raw little-endian bytes
    of its dtype; ``y``: target parameters (stored as float32) in the manifest's order.
    """
    import tensorflow as tf

    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"a sample must have shape (n, n, n, channels), got {x.shape}")
    raw = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).tobytes()
    feature = {
        "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[raw])),
        "y": tf.train.Feature(float_list=tf.train.FloatList(value=[float(v) for v in y])),
        "shape": tf.train.Feature(int64_list=tf.train.Int64List(value=list(x.shape))),
        "sim_id": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(sim_id)])),
    }
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=True)


def write_tfrecord_file(
    path: str | os.PathLike, serialized_examples: Iterable[bytes], compression: str | None = None
) -> int:
    """Write records to ``path`` atomically; return how many were written.

    A failure while writing (full disk, I/O error) leaves no file at ``path`` and raises a
    PipelineError naming the file and the operating system's reason.
    """
    import tensorflow as tf

    _check_compression(compression)
    path = Path(path)
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    n_written = 0
    try:
        with atomic_path(path) as tmp:
            with tf.io.TFRecordWriter(str(tmp), options=options) as writer:
                for record in serialized_examples:
                    writer.write(record)
                    n_written += 1
    except tf.errors.OpError as error:
        reason = error.message.rsplit(";", 1)[-1].strip()
        raise PipelineError(f"Could not write TFRecord file {path}: {reason}.") from error
    except OSError as error:
        raise PipelineError(f"Could not write TFRecord file {path}: {error.strerror or error}.") from error
    return n_written


@dataclass(frozen=True)
class PlannedFile:
    """One TFRecord file of a plan: its name, shard, and (sim_id, sub-volume index) samples."""

    name: str
    shard: int
    samples: tuple[tuple[int, int], ...]

    @property
    def sim_ids(self) -> list[int]:
        return sorted({sim_id for sim_id, _ in self.samples})


@dataclass(frozen=True)
class SplitPlan:
    """Assignment of every (simulation, sub-volume) sample of one split to files and shards."""

    split: str
    compression: str | None
    n_subvolumes: int
    samples_per_file: int
    files: tuple[PlannedFile, ...]

    @property
    def n_shards(self) -> int:
        return self.files[-1].shard + 1 if self.files else 0

    def shard_files(self, shard: int) -> list[PlannedFile]:
        if not 0 <= shard < self.n_shards:
            raise PipelineError(
                f"Shard {shard} does not exist in split '{self.split}' ({self.n_shards} shards)."
            )
        return [f for f in self.files if f.shard == shard]

    def shard_sim_ids(self, shard: int) -> list[int]:
        """The simulations whose histograms the job writing ``shard`` reads."""
        return sorted({sim_id for f in self.shard_files(shard) for sim_id in f.sim_ids})


def _shuffled_shards(sim_ids: Sequence[int], n_subvolumes: int, samples_per_file: int, seed: int,
                     split: str, sims_per_shard: int) -> tuple[np.random.Generator, list[list[int]]]:
    """The split's simulations, sorted, shuffled (seed and split name) and cut into shards of
    ``sims_per_shard`` rounded up to fill whole files; and the generator, to shuffle on."""
    if n_subvolumes < 1 or samples_per_file < 1 or sims_per_shard < 1:
        raise PipelineError(
            f"n_subvolumes ({n_subvolumes}), samples_per_file ({samples_per_file}) and "
            f"sims_per_shard ({sims_per_shard}) must be positive."
        )
    ordered = sorted(int(s) for s in sim_ids)
    if len(set(ordered)) != len(ordered):
        raise PipelineError(f"Split '{split}' lists a simulation twice: {ordered}.")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(split.encode())]))
    shuffled = [ordered[i] for i in rng.permutation(len(ordered))]
    size = shard_size(n_subvolumes, samples_per_file, sims_per_shard)
    return rng, [shuffled[start:start + size] for start in range(0, len(shuffled), size)]


def plan_shards(sim_ids: Sequence[int], n_subvolumes: int, samples_per_file: int, seed: int,
                split: str, sims_per_shard: int = 64) -> list[list[int]]:
    """The simulations of each shard of :func:`plan_split` with the same arguments, sorted; cheap
    (no sample is placed), for planning which histograms each write_tfrecords job reads."""
    return [sorted(shard) for shard in _shuffled_shards(
        sim_ids, n_subvolumes, samples_per_file, seed, split, sims_per_shard)[1]]


def plan_split(
    sim_ids: Sequence[int],
    n_subvolumes: int,
    samples_per_file: int,
    seed: int,
    split: str,
    sims_per_shard: int = 64,
    compression: str | None = None,
) -> SplitPlan:
    """Assign every (sim, sub-volume) sample of one split to files, interleaving simulations.

    The simulations (sorted, then shuffled with a generator seeded by ``seed`` and the split
    name) are grouped into shards of ``sims_per_shard`` simulations, rounded up so that a shard
    fills whole files; the samples of each shard are shuffled and cut into files of
    ``samples_per_file``. Only the split's last file can be short. Same arguments, same plan.
    """
    _check_compression(compression)
    rng, shards = _shuffled_shards(sim_ids, n_subvolumes, samples_per_file, seed, split, sims_per_shard)
    files = []
    for shard, members in enumerate(shards):
        samples = [(sim_id, s) for sim_id in members for s in range(n_subvolumes)]
        samples = [samples[i] for i in rng.permutation(len(samples))]
        for offset in range(0, len(samples), samples_per_file):
            name = tfrecord_name(split, len(files), compression)
            files.append(PlannedFile(name, shard, tuple(samples[offset:offset + samples_per_file])))
    return SplitPlan(split, compression, n_subvolumes, samples_per_file, tuple(files))


def _open_histograms(
    sim_ids: Sequence[int], histograms: Mapping[int, str | os.PathLike], stack: contextlib.ExitStack
) -> dict[int, h5py.Dataset]:
    """Open the ``counts`` dataset of each simulation; they must agree on grid, dtype, redshifts."""
    datasets, reference = {}, None
    for sim_id in sim_ids:
        if sim_id not in histograms:
            raise PipelineError(f"No histogram path given for simulation {sim_id}.")
        path = Path(histograms[sim_id])
        try:
            handle = stack.enter_context(h5py.File(path, "r"))
            counts = handle["counts"]
            layout = (counts.shape, str(counts.dtype),
                      tuple(np.asarray(handle.attrs["redshifts"]).tolist()))
        except FileNotFoundError:
            raise PipelineError(f"Histogram {path} does not exist; run the histogram stage.") from None
        except (OSError, KeyError) as error:
            raise PipelineError(f"Histogram {path} is unreadable or incomplete: {error}.") from error
        if reference is None:
            reference = (path, layout)
        elif layout != reference[1]:
            raise PipelineError(
                f"Histogram {path} has (shape, dtype, redshifts) {layout}, but {reference[0]} "
                f"has {reference[1]}; all histograms of a data set must match."
            )
        datasets[sim_id] = counts
    return datasets


def write_split_shard(
    plan: SplitPlan,
    shard: int,
    histograms: Mapping[int, str | os.PathLike],
    targets: Mapping[int, Sequence[float]],
    parameter_names: Sequence[str],
    tfrecord_dir: str | os.PathLike,
    subvolume: int,
) -> Path:
    """Write the files of one shard of ``plan`` and its summary; return the summary's path.

    Parameters
    ----------
    plan : from :func:`plan_split`.
    shard : which shard (0 <= shard < plan.n_shards).
    histograms : sim_id -> ``histograms/<sim_id>.h5`` (at least the shard's simulations).
    targets : sim_id -> parameter values, in the order of ``parameter_names``.
    parameter_names : names of the targets, e.g. ("Omega_m", "sigma_8", "n_s").
    tfrecord_dir : the run's ``tfrecords/`` directory; files go to ``<split>/``.
    subvolume : voxels per side n of a sample; must divide the histogram grid.

    Each sub-volume is read straight from its histogram file, so memory holds one sample.
    """
    tfrecord_dir = Path(tfrecord_dir)
    planned_files = plan.shard_files(shard)
    sim_ids = plan.shard_sim_ids(shard)
    for sim_id in sim_ids:
        if len(targets.get(sim_id, ())) != len(parameter_names):
            raise PipelineError(
                f"Simulation {sim_id} has targets {targets.get(sim_id)}; expected values for "
                f"{list(parameter_names)}."
            )
    moments, written = None, []
    with contextlib.ExitStack() as stack:
        datasets = _open_histograms(sim_ids, histograms, stack)
        any_counts = datasets[sim_ids[0]]
        n_channels, grid = any_counts.shape[0], any_counts.shape[1]
        if blocks_per_side(grid, subvolume) ** 3 != plan.n_subvolumes:
            raise PipelineError(
                f"The plan has {plan.n_subvolumes} sub-volumes per simulation, but a {grid}^3 "
                f"histogram holds {(grid // subvolume) ** 3} of {subvolume}^3."
            )
        redshifts = any_counts.parent.attrs["redshifts"]

        def examples(planned: PlannedFile) -> Iterable[bytes]:
            nonlocal moments
            for sim_id, index in planned.samples:
                counts = datasets[sim_id]
                try:
                    block = counts[(slice(None),) + subvolume_slices(grid, subvolume, index)]
                except OSError as error:
                    raise PipelineError(
                        f"Histogram {counts.file.filename} could not be read (truncated?): {error}."
                    ) from error
                sample = np.moveaxis(block, 0, -1)
                moments = add_moments(moments, log1p_moments(sample))
                yield serialize_example(sample, targets[sim_id], sim_id)

        for planned in planned_files:
            path = tfrecord_dir / plan.split / planned.name
            n_written = write_tfrecord_file(path, examples(planned), plan.compression)
            written.append({
                "path": f"{plan.split}/{planned.name}", "n_samples": n_written,
                "sim_ids": planned.sim_ids, "sha256": sha256_file(path),
            })
            log.info("wrote %s (%d samples of %d simulations)", path, n_written, len(planned.sim_ids),
                     extra=PROGRESS)
    return write_shard_summary(
        DatasetFiles(tfrecord_dir).shard_summary(plan.split, shard),
        split=plan.split, shard=shard, shape=(subvolume,) * 3 + (n_channels,),
        dtype=str(any_counts.dtype), compression=plan.compression, redshifts=redshifts,
        parameters=parameter_names, samples_per_file=plan.samples_per_file, files=written,
        moments=moments,
    )


def read_dataset(
    files: Sequence[str | os.PathLike],
    shape: Sequence[int],
    dtype: str = "int16",
    compression: str | None = None,
    n_targets: int = 3,
    with_sim_id: bool = False,
):
    """A ``tf.data.Dataset`` of (x, y) (or (x, y, sim_id)) from TFRecord files, in file and
    record order.

    ``files`` may also be a ``tf.data.Dataset`` of file names, opened one after the other as
    the records are consumed (asynchronous training hands files out that way).

    ``x`` has ``shape`` [n, n, n, channels] and ``dtype`` (raw counts, not normalised); ``y``
    float32 (n_targets,); ``sim_id`` int64. A corrupt record (CRC mismatch, bad length) raises
    when reached; it is never skipped.
    """
    import tensorflow as tf

    _check_compression(compression)
    features = {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([n_targets], tf.float32),
    }
    if with_sim_id:
        features["sim_id"] = tf.io.FixedLenFeature([], tf.int64)
    shape = [int(s) for s in shape]

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        x = tf.reshape(tf.io.decode_raw(example["x"], tf.as_dtype(dtype), little_endian=True), shape)
        return (x, example["y"], example["sim_id"]) if with_sim_id else (x, example["y"])

    names = files if isinstance(files, tf.data.Dataset) else [str(f) for f in files]
    records = tf.data.TFRecordDataset(names, compression_type=compression or "")
    return records.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def read_targets(files: Sequence[str | os.PathLike], compression: str | None = None,
                 n_targets: int = 3):
    """A ``tf.data.Dataset`` of the targets ``y`` (float32 (n_targets,)) of the records, in order.

    Only ``y`` is parsed (``x`` is not decoded), so this costs one read of the files' bytes.
    """
    import tensorflow as tf

    _check_compression(compression)
    features = {"y": tf.io.FixedLenFeature([n_targets], tf.float32)}
    names = files if isinstance(files, tf.data.Dataset) else [str(f) for f in files]
    records = tf.data.TFRecordDataset(names, compression_type=compression or "")
    return records.map(lambda record: tf.io.parse_single_example(record, features)["y"],
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def verify_data(run_dir: str | os.PathLike) -> list[str]:
    """Check the run's TFRecords against ``tfrecords/manifest.json``; return the problems found.

    Every record's CRC and parse, each file's sample count, sim_ids and sha256 against the
    manifest, and TFRecord files on disk that the manifest does not list. Each problem is one
    sentence naming the file. An empty list means the data set is intact.
    """
    run = RunLayout(Path(run_dir))
    tfrecord_dir = run.tfrecords
    try:
        manifest = load_manifest(run.manifest)
    except PipelineError as error:
        return [str(error)]
    problems = []
    for entry in manifest.files:
        path = manifest.root / entry.path
        if not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing.")
            continue
        if sha256_file(path) != entry.sha256:
            problems.append(f"{path}: sha256 differs from the manifest.")
        problems.extend(_check_records(path, entry, manifest))
    listed = {manifest.root / entry.path for entry in manifest.files}
    on_disk = {p for suffix in SUFFIXES.values() for p in tfrecord_dir.glob(f"*/*{suffix}")}
    problems.extend(f"{path}: TFRecord file not listed in the manifest." for path in sorted(on_disk - listed))
    return problems


def _check_records(path: Path, entry, manifest) -> list[str]:
    """Problems in one file's records: CRC, parse, shape, byte length, sim_ids, count."""
    import tensorflow as tf
    from google.protobuf.message import DecodeError

    expected_bytes = math.prod(manifest.shape) * np.dtype(manifest.dtype).itemsize
    records = tf.data.TFRecordDataset(str(path), compression_type=manifest.compression or "")
    problems, sim_ids, n_records = [], set(), 0
    try:
        for record in records:
            example = tf.train.Example.FromString(record.numpy())
            feature = example.features.feature
            shape = list(feature["shape"].int64_list.value)
            n_bytes = sum(len(v) for v in feature["x"].bytes_list.value)
            n_targets = len(feature["y"].float_list.value)
            if (shape != list(manifest.shape) or n_bytes != expected_bytes
                    or n_targets != len(manifest.parameters)):
                problems.append(
                    f"{path}: record {n_records} has shape {shape}, {n_bytes} bytes of x and "
                    f"{n_targets} targets; the manifest expects {list(manifest.shape)}, "
                    f"{expected_bytes} bytes and {len(manifest.parameters)} targets."
                )
            sim_ids.update(feature["sim_id"].int64_list.value)
            n_records += 1
    except (tf.errors.OpError, DecodeError) as error:
        reason = getattr(error, "message", str(error))
        return problems + [f"{path}: record {n_records} is corrupt or unreadable ({reason})."]
    if n_records != entry.n_samples:
        problems.append(f"{path}: {n_records} records, the manifest says {entry.n_samples}.")
    if sorted(sim_ids) != sorted(entry.sim_ids):
        problems.append(
            f"{path}: records come from simulations {sorted(sim_ids)}, the manifest says "
            f"{sorted(entry.sim_ids)}."
        )
    return problems
