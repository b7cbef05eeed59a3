"""Training checkpoints: weights, optimiser and metric state, and the input position.

``checkpoints/epoch<EEEE>-step<SSSSSS>.h5`` holds the state after ``step`` batches of epoch
``epoch`` (step 0 of epoch e+1 = the end of epoch e). Each file is written atomically by rank 0
and the newest two are kept. The attributes record what the run depends on (settings, number of
ranks, the training data), and :func:`load_latest` refuses a checkpoint whose record differs,
as resuming would then not continue the same run (cf. keras BackupAndRestore).

Datasets: ``model/<i>``, ``optimizer/<i>``, ``metrics/<i>`` (the variables in Keras order).
Attributes: ``epoch``, ``step``, ``identity`` (JSON), ``code_version``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np

from workflow.errors import PipelineError
from workflow.io import atomic_path, atomic_write_text
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

KEEP = 2
_NAME = re.compile(r"^epoch(\d{4})-step(\d{6})\.h5$")
GROUPS = ("model", "optimizer", "metrics")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read back: position and the variable values of each group."""

    path: Path
    epoch: int
    step: int
    values: dict[str, list[np.ndarray]]


def checkpoint_path(directory: Path, epoch: int, step: int) -> Path:
    return Path(directory) / f"epoch{epoch:04d}-step{step:06d}.h5"


def list_checkpoints(directory: Path) -> list[tuple[int, int, Path]]:
    """(epoch, step, path) of every checkpoint in ``directory``, oldest first."""
    found = []
    for path in Path(directory).glob("*.h5"):
        match = _NAME.match(path.name)
        if match:
            found.append((int(match[1]), int(match[2]), path))
    return sorted(found)


def save(directory: Path, epoch: int, step: int, variables: Mapping[str, Sequence],
         identity: Mapping) -> Path:
    """Write the checkpoint of position (epoch, step) atomically; delete all but the newest KEEP."""
    path = checkpoint_path(directory, epoch, step)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as handle:
        for group in GROUPS:
            for index, variable in enumerate(variables[group]):
                handle.create_dataset(f"{group}/{index}", data=np.asarray(variable))
        handle.attrs.update(epoch=epoch, step=step, identity=json.dumps(dict(identity), sort_keys=True),
                            code_version=CODE_VERSION)
    for _, _, old in list_checkpoints(directory)[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


class OtherRunCheckpoint(PipelineError):
    """The newest checkpoint was written by a run with other settings or other data."""


def load_latest(directory: Path, identity: Mapping) -> Checkpoint | None:
    """The newest readable checkpoint in ``directory`` (None if there is none).

    Raises OtherRunCheckpoint if it was written by a run with a different ``identity``.
    """
    for epoch, step, path in reversed(list_checkpoints(directory)):
        try:
            with h5py.File(path, "r") as handle:
                recorded = json.loads(handle.attrs["identity"])
                values = {group: [handle[f"{group}/{i}"][()] for i in range(len(handle.get(group, {})))]
                          for group in GROUPS}
        except (OSError, KeyError, ValueError) as error:
            log.warning("skipping unreadable checkpoint %s: %s", path, error)
            continue
        changed = sorted(k for k in set(recorded) | set(identity) if recorded.get(k) != identity.get(k))
        if changed:
            key = changed[0]
            raise OtherRunCheckpoint(
                f"Checkpoint {path} was written with {key} = {recorded.get(key)!r}, but this run "
                f"has {identity.get(key)!r}; remove {directory} to start training afresh."
            )
        return Checkpoint(path, epoch, step, values)
    return None


HISTORY_COLUMNS_ADDED = ("step_seconds",)
"""history.csv columns that code version 0.1.0 did not always write: a run resumed from an
older history.csv gets them, empty in the earlier rows, before Keras's CSVLogger appends rows
with them (it appends without a header, so the header must already name every column)."""


def truncate_history(path: Path, epochs: int) -> None:
    """Keep only the rows of ``history.csv`` for epochs before ``epochs``, and add any of
    :data:`HISTORY_COLUMNS_ADDED` it lacks (rewritten atomically, only if it changes)."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        rows, header = list(reader), reader.fieldnames or []
    if not header:
        return
    kept = [row for row in rows if int(row["epoch"]) < epochs]
    missing = [column for column in HISTORY_COLUMNS_ADDED if column not in header]
    if len(kept) == len(rows) and not missing:
        return
    columns = header
    if missing:  # the columns as CSVLogger orders them: "epoch", then its keys sorted, and
        # without validation a "val_" copy of every key after them
        plain = [key for key in header[1:] if not key.startswith("val_")]
        padded = all(f"val_{key}" in header for key in plain)
        keys = sorted((plain if padded else header[1:]) + missing)
        columns = ["epoch"] + keys + ([f"val_{key}" for key in keys] if padded else [])
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(kept)
    atomic_write_text(path, text.getvalue())
