"""Training settings: one frozen dataclass whose fields are the config keys ``training.<field>``.

The JSON Schema ``workflow/schemas/config.schema.yaml`` (section ``training``) holds every
field's meaning, default and allowed range; :meth:`TrainingSettings.from_mapping` validates a
section against it, fills the defaults and applies the cross-key rules of
:func:`workflow.config.validate_config`, so a direct Python caller gets the same one-sentence
errors as a config file. Learning rates apply to the global batch (``batch_size`` x ranks):
scale them yourself when changing the number of ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from workflow.config import validate_config

LAUNCH_KEYS = ("ranks", "nodes")  # keys of the config section that the job launcher uses


@dataclass(frozen=True)
class TrainingSettings:
    """The ``training`` config section but the launch keys (see the schema for each field)."""

    model: str
    width: float
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
    test_only_straggler_delay_s: float

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> "TrainingSettings":
        """Settings from (part of) a ``training`` section: validated, defaults filled in."""
        training = validate_config({"training": dict(section)}, source="training settings")["training"]
        return cls(**{key: value for key, value in training.items() if key not in LAUNCH_KEYS})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
