"""``cosmoflow ensemble``: the data set's stages, sampling to the TFRecord manifest, as Parsl apps.

Every job is one unit of a stage of the stage table (workflow/stages.py), run on a worker by
:func:`workflow.parsl.apps.run_unit` through :func:`~workflow.stages.run_stage` with the stage's
own slice of the configuration, exactly as the ``cosmoflow <stage>`` command that the Snakemake
rule of the same job runs. The jobs are the units of the stages of ``workflow.stages.ENSEMBLE``
(the simulations to the data set's manifest) with the edges of the table, as the rules have
them: a shard waits only for the histogram batches holding its simulations. Dependencies are
Parsl futures; each job receives the results of those it depends on.

A Parsl run and a Snakemake run of the same configuration write the same files in the same run
directory (the TFRecords byte for byte), and each skips what the other finished: a job here is
skipped when its outputs are current (workflow.parsl.apps), and Snakemake takes outputs it did
not make as current when they are newer than their inputs (it has no metadata for them, which
is no reason to rerun; Parsl writes every output after its inputs). Failed jobs are retried
(``parsl.retries``), then reported by name, with the jobs that could not run because of them;
all the others complete. Progress goes to the console (workflow.parsl.progress).

Outputs: the stages' own, ``logs/<rule>/<unit>.log`` as the rules name them, and ``parsl/``
(Parsl's run directories under ``parsl/ensemble/``, job records under ``parsl/jobs/``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

from workflow.config import dump_config, run_directory
from workflow.errors import PipelineError
from workflow.io import atomic_write_text
from workflow.paths import RunLayout
from workflow.stages import ENSEMBLE, Stage, upstream_of, upstream_units

log = logging.getLogger(__name__)

def ensemble_stages(until: str | None = None) -> tuple[Stage, ...]:
    """The stages of the ensemble (workflow.stages.ENSEMBLE), in order; with ``until`` (a rule
    name), that stage and those upstream of it, as ``snakemake --until``."""
    if until is None:
        return ENSEMBLE
    allowed = [stage.name for stage in ENSEMBLE]
    if until not in allowed:
        raise PipelineError(f"--until {until!r} is not a stage of the ensemble; choose one of: "
                            f"{', '.join(allowed)}")
    return tuple(stage for stage in ENSEMBLE if stage.name in upstream_of(until) | {until})


@dataclass(eq=False)
class Unit:
    """One job: a unit of ``stage`` (``selection`` as run_stage takes it) and the jobs it needs."""

    stage: Stage
    selection: dict
    upstream: list[Unit] = field(default_factory=list)

    @property
    def log_name(self) -> str | None:
        """Its name in logs/<rule>/, as the rule names it."""
        return self.stage.unit.log_name(self.selection)

    @property
    def label(self) -> str:
        """How messages name it: 'simulate batch 3', 'write_tfrecords train shard 0', 'manifest'."""
        return self.stage.unit.label(self.stage, self.selection)


def plan(config: dict, until: str | None = None) -> list[Unit]:
    """Every job of the ensemble (to ``until``), each after the jobs it depends on: the units
    and edges of the stage table (workflow.stages.upstream_units), as the rules have them."""
    units: dict[tuple[str, tuple], Unit] = {}
    for stage in ensemble_stages(until):
        upstream = upstream_units(stage, config)
        for selection in stage.unit.selections(stage, config):
            needs = [units[before.name, tuple(chosen.items())] for before, chosen in upstream(selection)]
            units[stage.name, tuple(selection.items())] = Unit(stage, selection, needs)
    return list(units.values())


@dataclass
class Report:
    """What a run did: jobs run, found up to date, failed (label, attempts, message) and not run."""

    ran: list[str] = field(default_factory=list)
    current: list[str] = field(default_factory=list)
    failed: list[tuple[str, int, str]] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        text = (f"{len(self.ran)} job(s) ran, {len(self.current)} up to date, in "
                f"{self.seconds:.1f} s")
        if self.failed:
            text += f"; {len(self.failed)} failed: " + "; ".join(
                f"{label} (after {attempts} attempt{'s' * (attempts != 1)}): {message}"
                for label, attempts, message in self.failed)
        if self.not_run:
            text += f"; not run because of a failure: {', '.join(self.not_run)}"
        return text


def run_ensemble(config: dict, until: str | None = None, forcerun: tuple[str, ...] = (),
                 stream: TextIO = sys.stderr) -> Report:
    """Run the ensemble of ``config`` (validated) with Parsl; return the :class:`Report`.

    ``until``: the last stage to run; ``forcerun``: stages whose jobs run even when current
    (and, through them, everything downstream), as ``snakemake --forcerun``. Raises
    PipelineError when a job failed, after every job that could run has run.
    """
    from workflow.parsl.configs import ensemble_config
    from workflow.parsl.progress import parsl_run

    known = [stage.name for stage in ensemble_stages()]
    for name in forcerun:
        if name not in known:
            raise PipelineError(f"--forcerun {name!r} is not a stage of the ensemble; choose from: "
                                f"{', '.join(known)}")
    run = RunLayout(run_directory(config).absolute())
    atomic_write_text(run.config_record, dump_config(config))  # as the Snakefile's onstart
    units = plan(config, until)
    started = time.monotonic()
    report = Report()
    try:
        with parsl_run(ensemble_config(config, run.parsl_ensemble), run.parsl_files, "cosmoflow ensemble",
                       Counter(unit.stage.name for unit in units), stream,
                       config["parsl"]["progress_seconds"],
                       lambda: "interrupted; rerun `cosmoflow ensemble` to finish (what is done is kept)"
                       ) as (dfk, progress):
            _execute(dfk, units, config, run, set(forcerun), progress, report)
    finally:
        report.seconds = time.monotonic() - started
    if report.failed:
        raise PipelineError(f"{report.summary()}. Fix the cause and rerun: finished jobs are skipped")
    return report


def _execute(dfk, units, config, run, forced, progress, report) -> None:
    from parsl.app.python import PythonApp
    from parsl.dataflow.errors import DependencyError

    from workflow.parsl.apps import run_unit
    from workflow.parsl.configs import ENSEMBLE_LABEL
    from workflow.parsl.progress import as_completed

    app = PythonApp(run_unit, data_flow_kernel=dfk, executors=[ENSEMBLE_LABEL])
    futures = {}
    for unit in units:
        name = unit.stage.name
        marker = progress.running_dir / f"{name}.{unit.log_name or name}"
        futures[unit] = app(name, str(run.root), config, unit.selection, unit.log_name,
                            str(marker), name in forced, inputs=[futures[u] for u in unit.upstream])
    by_future = {future: unit for unit, future in futures.items()}
    for future in as_completed(by_future, progress):
        result = future.result() if future.exception() is None else {"ran": None, "seconds": 0.0}
        progress.finished(by_future[future].stage.name, result["ran"], result["seconds"])
    # Futures complete in whatever order the workers finish; the report is in plan order, so the
    # same failure gives the same message on every run.
    for unit, future in futures.items():
        error = future.exception()
        if error is None:
            (report.ran if future.result()["ran"] else report.current).append(unit.label)
        elif isinstance(error, DependencyError):
            report.not_run.append(unit.label)
        else:
            attempts = future.task_record["fail_count"]
            where = run.log(unit.stage.name, unit.log_name)
            report.failed.append((unit.label, attempts, f"{error} (log: {where})"))
