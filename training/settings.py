"""Training settings: one frozen dataclass whose fields are the config keys ``training.<field>``.

The JSON Schema ``workflow/schemas/config.schema.yaml`` (section ``training``) holds every
field's meaning, default and allowed range; :func:`workflow.config.validate_config` checks a
configuration against it, fills the defaults and applies the cross-key rules, and
:meth:`TrainingSettings.from_mapping` takes the validated section as it is. Learning rates apply
to the global batch (``batch_size`` x ranks): scale them yourself when changing the number of
ranks.

Not a setting: the environment variable :data:`STRAGGLER_DELAY_VARIABLE`, a hook of the tests and
benchmarks that slows one rank down.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from workflow.errors import PipelineError

LAUNCH_KEYS = ("ranks", "nodes")
"""Keys of the section that the job launcher uses (not fields of :class:`TrainingSettings`)."""
TUNING_KEYS = ("threads", "inter_op_threads", "nodes", "deterministic", "checkpoint_every_steps")
"""Keys of the section that change how a training runs, not what it learns (within float
rounding): a changed value neither reruns the train stage (workflow/stages.py) nor stops a
checkpoint from being resumed (training.resume.identity)."""
STRAGGLER_DELAY_VARIABLE = "COSMOFLOW_STRAGGLER_DELAY_S"
"""Tests and benchmarks only, not a configuration key: seconds the last rank sleeps after every
training step, a straggler to see how each training.mode copes with one
(tests/test_training_async.py, bench/async.py). Unset in every real run."""


@dataclass(frozen=True)
class TrainingSettings:
    """The ``training`` config section but the launch keys (see the schema for each field)."""

    model: str
    width: float
    head: str
    batch_size: int
    epochs: int
    optimizer: str
    learning_rate: float
    warmup_epochs: float
    decay_end_factor: float
    larc: bool
    larc_eta: float
    momentum: float
    dropout: float | None
    augment: bool
    shuffle_buffer: int
    precision: str
    checkpoint_every_steps: int
    seed: int
    deterministic: bool
    threads: int
    inter_op_threads: int
    train_split: str
    train_fraction: float
    validation_split: str | None
    mode: str
    max_staleness: int

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> "TrainingSettings":
        """Settings from the ``training`` section of a validated configuration (every key)."""
        return cls(**{key: value for key, value in section.items() if key not in LAUNCH_KEYS})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def straggler_delay_s() -> float:
    """The delay :data:`STRAGGLER_DELAY_VARIABLE` asks for, in seconds (0 when unset)."""
    text = os.environ.get(STRAGGLER_DELAY_VARIABLE, "0")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= 3600:
        raise PipelineError(f"{STRAGGLER_DELAY_VARIABLE} = {text!r} is not a delay in seconds "
                            f"between 0 and 3600; unset it outside tests and benchmarks.")
    return seconds
