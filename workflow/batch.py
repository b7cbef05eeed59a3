"""Batches of simulations, the unit of scheduling (DESIGN.md, "Run directory").

A batch job runs one task per simulation. A task is skipped when its HDF5 output already
carries the provenance attributes it would be written with (seed, cosmology, settings, code
version) and is newer than the task's input files: the run is deterministic, so redoing it
would give the same bytes. A killed job therefore redoes only the simulations it had not
finished; a changed setting, or a regenerated input, redoes them. When every task is done the job writes a small JSON summary, the Snakemake output of the
batch rule.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from workflow.io import atomic_write_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """One simulation's work in a batch: ``run()`` writes ``output`` (atomically)."""

    sim_id: int
    output: Path
    provenance: dict  # HDF5 attributes (or scalar datasets) the finished output must carry
    run: Callable[[], object]
    inputs: tuple[Path, ...] = ()  # files the output is made from: a newer one redoes it


def _same(stored, expected) -> bool:
    if isinstance(stored, bytes):
        stored = stored.decode()
    if isinstance(expected, (list, tuple, np.ndarray)):
        return np.array_equal(np.asarray(stored), np.asarray(expected))
    return bool(stored == expected)


def output_is_current(path: Path, provenance: dict, inputs: tuple[Path, ...] = ()) -> bool:
    """True when ``path`` is a readable HDF5 file whose attributes match ``provenance`` and
    which is at least as new as every file in ``inputs``."""
    try:
        # An input deleted after use (e.g. ic.h5 at paper scale) does not invalidate the output.
        existing = [Path(i) for i in inputs if Path(i).exists()]
        if any(i.stat().st_mtime_ns > path.stat().st_mtime_ns for i in existing):
            return False
        with h5py.File(path, "r") as handle:
            for key, expected in provenance.items():
                stored = handle.attrs[key] if key in handle.attrs else handle[key][()]
                if not _same(stored, expected):
                    return False
    except (OSError, KeyError):  # missing, truncated or from an older layout: redo it
        return False
    return True


def run_tasks(stage: str, tasks: list[Task], force: bool = False, summary_path: Path | None = None) -> list[dict]:
    """Run ``tasks`` in order, skipping those already done, then write the batch summary."""
    records = []
    for number, task in enumerate(tasks, 1):
        if not force and output_is_current(task.output, task.provenance, task.inputs):
            log.info("%s: sim %d is up to date (%s), skipped [%d/%d]", stage, task.sim_id, task.output, number, len(tasks))
            records.append({"sim_id": task.sim_id, "output": str(task.output), "seconds": None})
            continue
        start = time.perf_counter()
        task.run()
        seconds = time.perf_counter() - start
        log.info("%s: sim %d done in %.1f s [%d/%d]", stage, task.sim_id, seconds, number, len(tasks))
        records.append({"sim_id": task.sim_id, "output": str(task.output), "seconds": round(seconds, 3)})
    if summary_path is not None:
        atomic_write_text(summary_path, json.dumps({"stage": stage, "simulations": records}, indent=1) + "\n")
    return records
