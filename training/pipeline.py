"""Input pipeline: shuffle-then-shard over files, normalisation, augmentation, batching.

Each epoch the training files are put in a random order that depends only on the seed and the
epoch, so every rank computes the same order; rank r of P then reads files r, r + P, r + 2P, ...
of it. Together the ranks read every training sample exactly once per epoch, and no two ranks
open the same file. A rank's samples pass through a seeded shuffle buffer, the log1p
normalisation and target scaling recorded in the manifest, and (optionally) a random one of the
48 symmetries of the cube, which map a sub-volume onto itself and leave the cosmological
parameters unchanged.

Every rank must take the same number of steps per epoch (each step ends in an allreduce), but
file shards differ by up to one file. Each rank's epoch is therefore padded to
``steps_per_epoch * batch_size`` samples with zero-weight samples; the gradient average weights
every sample by its weight (training.distributed), so padding changes no update and a
``P``-rank step equals one step on the union of the ranks' batches.

Validation files are sharded the same way (without shuffling) when there are at least as many
as ranks; otherwise every rank reads them all and keeps every P-th record.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from preprocessing.manifest import Manifest
from preprocessing.tfrecords import read_dataset
from workflow.errors import PipelineError

N_SYMMETRIES = 48
AXIS_PERMUTATIONS = tuple(itertools.permutations(range(3)))  # 6 x 8 reflections = 48


def epoch_file_order(n_files: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of the training files in ``epoch``; identical on every rank."""
    return np.random.default_rng([seed, epoch]).permutation(n_files)


def shard_indices(n_files: int, seed: int, epoch: int, rank: int, n_ranks: int,
                  fixed: bool = False) -> np.ndarray:
    """Indices (into the manifest's file list) of the training files that ``rank`` reads in ``epoch``.

    ``fixed``: every epoch the rank reads the shard it was given in epoch 0, in a new order
    (node-local staging: a rank holds only its own files, as in the MLPerf HPC reference).
    """
    if not fixed:
        return epoch_file_order(n_files, seed, epoch)[rank::n_ranks]
    own = epoch_file_order(n_files, seed, 0)[rank::n_ranks]
    return own[np.random.default_rng([seed, epoch, rank]).permutation(len(own))] if epoch else own


def _stream_seed(seed: int, epoch: int, rank: int) -> int:
    """A 63-bit seed for one rank's shuffle buffer and augmentation in one epoch."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1, np.uint64)[0] >> 1)


@dataclass(frozen=True)
class TrainingPlan:
    """Sizes that fix every rank's epoch: ``steps_per_epoch`` batches of ``batch_size``."""

    file_samples: tuple[int, ...]
    n_ranks: int
    batch_size: int
    fixed_shards: bool = False
    """Each rank keeps its epoch-0 files (node-local staging); see :func:`shard_indices`."""

    @property
    def n_samples(self) -> int:
        return sum(self.file_samples)

    @property
    def largest_shard(self) -> int:
        """The most samples any rank can receive in an epoch (its files are the largest)."""
        largest = sorted(self.file_samples, reverse=True)
        return sum(largest[:math.ceil(len(largest) / self.n_ranks)])

    @property
    def smallest_shard(self) -> int:
        """The fewest samples any rank can receive in an epoch."""
        smallest = sorted(self.file_samples)
        return sum(smallest[:len(smallest) // self.n_ranks])

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.largest_shard / self.batch_size)

    def shard_samples(self, seed: int, epoch: int, rank: int) -> int:
        indices = self.files_of_rank(seed, epoch, rank)
        return sum(self.file_samples[i] for i in indices)

    def files_of_rank(self, seed: int, epoch: int, rank: int) -> np.ndarray:
        """Indices of the split's files that ``rank`` reads in ``epoch``."""
        return shard_indices(len(self.file_samples), seed, epoch, rank, self.n_ranks, self.fixed_shards)


def make_plan(manifest: Manifest, split: str, n_ranks: int, batch_size: int,
              fixed_shards: bool = False) -> TrainingPlan:
    """The plan of ``split``; PipelineError if a rank's shard could be smaller than a batch."""
    sizes = tuple(f.n_samples for f in manifest.files if f.split == split)
    plan = TrainingPlan(sizes, n_ranks, batch_size, fixed_shards)
    if plan.smallest_shard < batch_size:
        raise PipelineError(
            f"training.batch_size = {batch_size} is larger than the smallest per-rank shard "
            f"({plan.smallest_shard} samples: {len(sizes)} files of split '{split}', "
            f"{plan.n_samples} samples, over {n_ranks} ranks); lower the batch size or the "
            f"number of ranks, or write more, smaller TFRecord files."
        )
    return plan


def apply_symmetry(x, index):
    """Sample ``x`` (n, n, n, channels) under cube symmetry ``index`` in [0, 48): the spatial
    axes permuted by AXIS_PERMUTATIONS[index // 8], then reversed along each axis a for which
    bit a of index % 8 is set. Index 0 is the identity."""
    import tensorflow as tf

    order = tf.gather(tf.constant(AXIS_PERMUTATIONS, tf.int32), index // 8)
    reflect = tf.bitwise.bitwise_and(tf.bitwise.right_shift(index % 8, tf.range(3)), 1) > 0
    moved = tf.transpose(x, tf.concat([order, [3]], axis=0))
    flipped = tf.reverse(moved, tf.boolean_mask(tf.range(3), reflect))
    return tf.ensure_shape(flipped, x.shape)


def _read(manifest: Manifest, files: Sequence[Path]):
    return read_dataset(files, manifest.shape, manifest.dtype, manifest.compression,
                        n_targets=len(manifest.parameters))


def epoch_dataset(manifest: Manifest, plan: TrainingPlan, split: str, epoch: int, rank: int,
                  seed: int, shuffle_buffer: int, augment: bool, start_step: int = 0,
                  claimed_files=None):
    """One rank's samples (x, y, weight) for ``epoch``, ``plan.steps_per_epoch * batch`` of them.

    ``start_step`` skips the first batches (resuming inside an epoch); the shuffle and the
    augmentation depend only on (seed, epoch, rank, position), so the skipped stream is the
    uninterrupted one. ``claimed_files``: a ``tf.data.Dataset`` of file names to read instead
    of the rank's shard, without padding (asynchronous training hands files out one by one).
    """
    import tensorflow as tf

    files = manifest.files_of(split)
    mine = claimed_files
    if claimed_files is None:
        mine = [files[i] for i in plan.files_of_rank(seed, epoch, rank)]
    stream_seed = _stream_seed(seed, epoch, rank)
    samples = _read(manifest, mine).map(lambda x, y: (x, y, tf.constant(1.0)))
    if shuffle_buffer > 1:
        samples = samples.shuffle(shuffle_buffer, seed=stream_seed, reshuffle_each_iteration=False)
    n_padding = 0 if claimed_files is not None else (
        plan.steps_per_epoch * plan.batch_size - plan.shard_samples(seed, epoch, rank))
    padding = tf.data.Dataset.from_tensors((
        tf.zeros(manifest.shape, manifest.dtype), tf.zeros([len(manifest.parameters)]),
        tf.constant(0.0),
    )).repeat(n_padding)

    def prepare(position, sample):
        x, y, weight = sample
        x, y = manifest.normalise(x, y)
        if augment:
            index = tf.random.stateless_uniform(
                [], seed=tf.stack([tf.constant(stream_seed, tf.int64), position]),
                minval=0, maxval=N_SYMMETRIES, dtype=tf.int32)
            x = apply_symmetry(x, index)
        return x, y, weight

    return (samples.concatenate(padding).enumerate().skip(start_step * plan.batch_size)
            .map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True))


def training_dataset(manifest: Manifest, plan: TrainingPlan, split: str, rank: int, seed: int,
                     shuffle_buffer: int, augment: bool, epochs: range, start_step: int = 0):
    """Batches (x, y, weight) of ``rank`` for ``epochs``, the first one from ``start_step``."""
    import tensorflow as tf

    parts = [epoch_dataset(manifest, plan, split, epoch, rank, seed, shuffle_buffer, augment,
                           start_step if epoch == epochs.start else 0) for epoch in epochs]
    stream = functools.reduce(tf.data.Dataset.concatenate, parts)
    return stream.batch(plan.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def validation_file_indices(n_files: int, rank: int, n_ranks: int) -> range:
    """Indices of the validation files that ``rank`` reads (all of them when fewer than ranks)."""
    return range(rank, n_files, n_ranks) if n_files >= n_ranks else range(n_files)


def validation_part(manifest: Manifest, split: str, rank: int, n_ranks: int, read=None):
    """``read(files)`` (default: (x, y) records) of ``rank``'s part of an unshuffled ``split``.

    Its files :func:`validation_file_indices`, or, with fewer files than ranks, every
    ``n_ranks``-th record of all of them. Returns (dataset, number of samples).
    """
    read = read or functools.partial(_read, manifest)
    files = manifest.files_of(split)
    sizes = [f.n_samples for f in manifest.files if f.split == split]
    if len(files) >= n_ranks:
        mine = validation_file_indices(len(files), rank, n_ranks)
        return read([files[i] for i in mine]), sum(sizes[i] for i in mine)
    return read(files).shard(n_ranks, rank), len(range(rank, sum(sizes), n_ranks))


def validation_dataset(manifest: Manifest, split: str, batch_size: int, rank: int, n_ranks: int):
    """(dataset of normalised (x, y) batches for ``rank``, its number of samples)."""
    import tensorflow as tf

    samples, count = validation_part(manifest, split, rank, n_ranks)
    dataset = samples.map(manifest.normalise, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)
    # Keras drops the validation iterator at every evaluation, and destroying an iterator waits
    # for tf.data's autotuning thread: 2.5-4.8 s in about half the epochs of a 2-rank run on 2
    # cores (py-spy: RootDataset::Iterator::~Iterator joining it), during which the other ranks
    # wait at the epoch's end. Without autotuning, AUTOTUNE means a fixed parallelism (the
    # tf.data thread pool's size) and nothing to join.
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE).with_options(options), count


def check_split(manifest: Manifest, split: str, manifest_path: Path) -> None:
    """The split exists, its files exist, and its first record agrees with the manifest.

    Compares the record's ``shape`` feature, the byte length of ``x`` (shape x dtype size) and
    the number of targets with the manifest; raises PipelineError naming file and values.
    """
    import tensorflow as tf

    files = manifest.files_of(split)
    if not files:
        raise PipelineError(
            f"Manifest {manifest_path} has no files of split '{split}' (it has "
            f"{list(manifest.splits)}); set training.train_split / validation_split."
        )
    for path in files:
        if not path.is_file():
            raise PipelineError(f"TFRecord {path} listed in {manifest_path} does not exist.")
    first = files[0]
    try:
        record = next(iter(tf.data.TFRecordDataset([str(first)],
                                                   compression_type=manifest.compression or "")))
        example = tf.io.parse_single_example(record, {
            "x": tf.io.FixedLenFeature([], tf.string),
            "y": tf.io.VarLenFeature(tf.float32),
            "shape": tf.io.VarLenFeature(tf.int64),
        })
    except (tf.errors.OpError, StopIteration) as error:
        reason = getattr(error, "message", "it holds no records")
        raise PipelineError(f"TFRecord {first} is unreadable or corrupt: {reason}.") from error
    shape = tf.sparse.to_dense(example["shape"]).numpy().tolist()
    n_bytes = len(example["x"].numpy())
    n_targets = int(example["y"].values.shape[0])
    expected_bytes = math.prod(manifest.shape) * np.dtype(manifest.dtype).itemsize
    if shape != list(manifest.shape) or n_bytes != expected_bytes:
        raise PipelineError(
            f"TFRecord {first} holds samples of shape {shape} ({n_bytes} bytes), but manifest "
            f"{manifest_path} says shape {list(manifest.shape)} of {manifest.dtype} "
            f"({expected_bytes} bytes); rebuild the manifest from these records."
        )
    if n_targets != len(manifest.parameters):
        raise PipelineError(
            f"TFRecord {first} holds {n_targets} targets, but manifest {manifest_path} lists "
            f"{list(manifest.parameters)}."
        )
