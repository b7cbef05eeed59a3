"""Training settings: one frozen dataclass whose fields are the config keys ``training.<field>``.

The JSON Schema (workflow/schemas) validates the configuration first; :class:`TrainingSettings`
checks the same ranges again so that a direct Python caller gets the same one-sentence errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from workflow.errors import ConfigError

MODELS = ("cosmoflow_paper", "mlperf")
OPTIMIZERS = ("adam", "sgd")
PRECISIONS = ("float32", "mixed_bfloat16")


@dataclass(frozen=True)
class TrainingSettings:
    """Hyper-parameters and run options of the training stage (config section ``training``).

    Learning rates apply to the global batch (``batch_size`` x ranks): scale them yourself
    when changing the number of ranks.
    """

    model: str = "cosmoflow_paper"
    """'cosmoflow_paper' (SC18 network) or 'mlperf' (MLPerf HPC reference network)."""
    batch_size: int = 4
    """Samples per rank per step; the global batch is batch_size x ranks."""
    epochs: int = 8
    """Passes over the training split."""
    optimizer: str = "adam"
    """'adam' (the paper, with LARC) or 'sgd' (SGD with momentum, MLPerf)."""
    learning_rate: float = 1e-3
    """Peak learning rate, reached at the end of the warm-up."""
    warmup_epochs: float = 0.0
    """Epochs of linear warm-up from learning_rate / warm-up steps to learning_rate."""
    decay_end_factor: float = 0.01
    """Final learning rate as a fraction of the peak; linear (polynomial power 1) decay."""
    larc: bool = True
    """Layer-wise adaptive rate control (You et al. 2017), clipped at the nominal rate."""
    larc_eta: float = 0.01
    """LARC trust coefficient eta: a tensor's step is at most eta x its norm."""
    momentum: float = 0.9
    """Momentum of SGD (ignored by Adam)."""
    dropout: float | None = None
    """Dropout rate after each hidden dense layer; null = the model's default (0 / 0.5)."""
    augment: bool = True
    """Random one of the 48 rotations and reflections of the cube per training sample."""
    shuffle_buffer: int = 64
    """Samples in each rank's shuffle buffer (0 or 1: file order only)."""
    precision: str = "float32"
    """'float32' or 'mixed_bfloat16' (bfloat16 compute, float32 weights)."""
    checkpoint_every_steps: int = 0
    """Also checkpoint every this many steps (0: at the end of each epoch only)."""
    seed: int = 0
    """Seed of weight initialisation, file order, shuffling, augmentation and dropout."""
    deterministic: bool = False
    """Deterministic TensorFlow ops (bitwise reproducible runs and resumes; may be slower)."""
    threads: int = 0
    """Intra-op threads per rank (0: TensorFlow's default, all cores)."""
    inter_op_threads: int = 0
    """Inter-op threads per rank (0: TensorFlow's default)."""
    train_split: str = "train"
    """Manifest split to train on."""
    validation_split: str | None = "val"
    """Manifest split evaluated after each epoch (null: no validation)."""
    mode: str = "sync"
    """'sync' (gradient allreduce every step) or 'async' (shared weights in an MPI window,
    bounded staleness; training.asynchronous)."""
    max_staleness: int = 4
    """Async: most optimiser updates by which the weights a gradient was computed on may lag
    behind the weights it is applied to (0: every update waits for every rank, as sync)."""
    test_only_straggler_delay_s: float = 0.0
    """Tests and benchmarks only: the last rank sleeps this long after every training step."""

    def __post_init__(self) -> None:
        _choice("model", self.model, MODELS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("precision", self.precision, PRECISIONS)
        _integer("batch_size", self.batch_size, 1)
        _integer("epochs", self.epochs, 1)
        _integer("shuffle_buffer", self.shuffle_buffer, 0)
        _integer("checkpoint_every_steps", self.checkpoint_every_steps, 0)
        _integer("seed", self.seed, 0)
        _integer("threads", self.threads, 0)
        _integer("inter_op_threads", self.inter_op_threads, 0)
        _number("learning_rate", self.learning_rate, 0.0, None, low_open=True)
        _number("warmup_epochs", self.warmup_epochs, 0.0, None)
        _number("decay_end_factor", self.decay_end_factor, 0.0, 1.0)
        _number("larc_eta", self.larc_eta, 0.0, None, low_open=True)
        _number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        if self.dropout is not None:
            _number("dropout", self.dropout, 0.0, 1.0, high_open=True)
        for key in ("larc", "augment", "deterministic"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"training.{key} = {getattr(self, key)!r}; expected true or false.")
        for key, value in (("train_split", self.train_split),
                           ("validation_split", self.validation_split)):
            if value is None and key == "validation_split":
                continue
            if not isinstance(value, str) or not value:
                raise ConfigError(f"training.{key} = {value!r}; expected the name of a manifest split.")
        if self.validation_split == self.train_split:
            raise ConfigError(
                f"training.validation_split = {self.validation_split!r} is also the training "
                f"split; choose another split or null."
            )

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> "TrainingSettings":
        """Settings from the config's ``training`` mapping; unknown keys are refused."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"training.{unknown[0]} is not a training setting; known: {sorted(known)}.")
        return cls(**dict(section))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"training.{key} = {value!r}; expected one of {list(allowed)}.")


def _integer(key: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"training.{key} = {value!r}; expected an integer >= {minimum}.")


def _number(key: str, value, low: float, high: float | None, low_open: bool = False,
            high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high))
    if not ok:
        interval = ("(" if low_open else "[") + f"{low}, " + (
            "inf)" if high is None else f"{high}" + (")" if high_open else "]"))
        raise ConfigError(f"training.{key} = {value!r}; expected a number in {interval}.")
