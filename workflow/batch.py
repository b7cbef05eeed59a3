"""Batches of simulations, the unit of scheduling (docs/provenance.md, "Batches and provenance").

A batch job runs one task per simulation, each writing one HDF5 file. Every file carries, as
its attribute ``provenance``, what it was made from: the stage, the simulation (sim_id, seed,
parameters), the stage's configuration keys (its ``reads`` in workflow/stages.py) and the code
version. A task is skipped when its file already holds the provenance it would be written with
and is newer than the task's input files: the run is deterministic, so redoing it would give
the same bytes. A killed job therefore redoes only the simulations it had not finished; a
changed setting, or a regenerated input, redoes them. When every task is done the job writes a
small JSON summary, the Snakemake output of the batch rule.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import h5py

from workflow.io import atomic_write_text
from workflow.logs import PROGRESS
from workflow.params_table import SimulationRecord, select_simulations
from workflow.paths import RunLayout
from workflow.task import Task
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)


def provenance(stage, record: SimulationRecord, config) -> str:
    """What a batch task's file is made from, as canonical JSON (see the module docstring)."""
    return json.dumps({
        "stage": stage.name, "sim_id": record.sim_id, "seed": record.seed,
        "parameters": record.parameters, "config": stage.params(config.as_declared()),
        "code_version": CODE_VERSION,
    }, sort_keys=True)


def output_is_current(path: Path, expected: str, inputs: tuple[Path, ...] = ()) -> bool:
    """True when ``path`` is a readable HDF5 file whose ``provenance`` attribute is ``expected``
    and which is at least as new as every existing file in ``inputs``."""
    try:
        # An input deleted after use (e.g. ic.h5 at paper scale) does not invalidate the output.
        existing = [Path(i) for i in inputs if Path(i).exists()]
        if any(i.stat().st_mtime_ns > path.stat().st_mtime_ns for i in existing):
            return False
        with h5py.File(path, "r") as handle:
            stored = handle.attrs.get("provenance")
    except OSError:  # missing or truncated: redo it
        return False
    return (stored.decode() if isinstance(stored, bytes) else stored) == expected


def batch_tasks(stage, job: Callable, run: RunLayout, config, batch: int | None = None,
                sim_ids: list[int] | None = None,
                force: bool = False) -> Iterator[tuple[SimulationRecord, Task, str, bool]]:
    """Each simulation of ``batch`` (or of ``sim_ids``) as its record, ``job``'s task for it, the
    provenance its file is written with and whether that file is current (never when ``force``)."""
    for record in select_simulations(run, batch, sim_ids):
        task = job(run, config, record)
        expected = provenance(stage, record, config)
        yield record, task, expected, not force and output_is_current(task.output, expected, task.inputs)


def run_batch(stage, job: Callable, run: RunLayout, config, batch: int | None = None,
              sim_ids: list[int] | None = None, force: bool = False,
              regenerate: Callable[[Path, SimulationRecord], None] | None = None,
              discard: Callable[[int], list[Path]] = lambda sim_id: []) -> list[dict]:
    """Run ``job``'s task for each simulation of ``batch`` (then write the batch summary) or of
    ``sim_ids``, skipping those already done unless ``force``.

    ``regenerate(path, record)`` makes a missing input file again (an intermediate that was
    not kept; workflow.stages.regenerator) before the task runs; without it a missing input
    fails in the task, naming the file. ``discard(sim_id)``: the inputs to delete once the
    simulation's output is current, intermediates the configuration does not keep
    (workflow.stages.discarded_inputs).
    """
    done, started = [], time.perf_counter()
    tasks = list(batch_tasks(stage, job, run, config, batch, sim_ids, force))
    for number, (record, task, expected, current) in enumerate(tasks, 1):
        if current:
            log.info("%s: sim %d is up to date (%s), skipped [%d/%d]", stage.name, record.sim_id,
                     task.output, number, len(tasks), extra=PROGRESS)
            seconds = None
        else:
            start = time.perf_counter()
            for path in task.inputs:
                if regenerate is not None and not path.exists():
                    regenerate(path, record)
            task.write(expected)
            seconds = round(time.perf_counter() - start, 3)
            left = (time.perf_counter() - started) / number * (len(tasks) - number)
            log.info("%s: sim %d done in %.1f s [%d/%d]%s", stage.name, record.sim_id, seconds,
                     number, len(tasks), f", about {left:.0f} s left" if number < len(tasks) else "",
                     extra=PROGRESS)
        for path in discard(record.sim_id):
            path.unlink(missing_ok=True)
        done.append({"sim_id": record.sim_id, "output": str(task.output), "seconds": seconds,
                     "provenance": expected})
    if batch is not None:
        atomic_write_text(run.batch_summary(stage.name, batch),
                          json.dumps({"stage": stage.name, "simulations": done}, indent=1) + "\n")
    return done
