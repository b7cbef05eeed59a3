"""The pipeline's stages, in order: the one table that the Snakemake rules, the CLI and Parsl derive from.

Each :class:`Stage` row says everything about a stage: its name (the Snakemake rule, and the
``cosmoflow`` subcommand with ``-`` for ``_``), its :class:`Unit` of work, the job that does one
unit, the files one job writes last, the stages it reads from (and which of their units one of
its units reads), the configuration keys it reads and its resources. From the table:

* ``cosmoflow <command>`` (workflow/cli.py) is one subcommand per stage, with its unit's options
  (:meth:`Unit.add_options`: ``--batch``/``--sim-id``, ``--split``/``--shard``, ``--fraction``);
* workflow/rules/stages.smk writes one rule per stage in one loop: inputs are the upstream
  units' outputs, ``params`` the keys the stage reads (:meth:`Stage.params`, so a changed key
  reruns exactly the stages that read it), threads and resources from :attr:`Stage.resources`;
* ``cosmoflow ensemble`` (workflow/parsl/ensemble.py) plans the units of :data:`ENSEMBLE` with
  the same edges and runs each through :func:`run_stage`, as the CLI does;
* a batch job records the stage's keys in every file it writes and skips a simulation whose
  file already holds them (workflow.batch); a per-simulation file whose producer does not keep
  it (:attr:`Stage.kept_if`) is deleted once the next stage has used it.

A job receives only its declared slice of the configuration (:class:`ConfigSlice`): reading a
key the table does not list for the stage fails at once, naming the stage and the key.

Jobs, one signature per unit (``run`` is the :class:`~workflow.paths.RunLayout`, ``config`` the
stage's :class:`ConfigSlice`): ``run``, ``fraction``: ``job(run, config)``; ``batch``:
``job(run, config, record) -> Task`` for one simulation (a params.csv row), run by
:func:`workflow.batch.run_batch`; ``shard``: ``job(run, config, split, shard)``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from analysis import jobs as analysis_jobs
from preprocessing import jobs as preprocessing_jobs
from simulations import jobs as simulation_jobs
from training import jobs as training_jobs
from workflow import resources
from workflow.batch import run_batch
from workflow.config import SPLITS, load_config, n_batches, run_directory, schema_keys, validate_config
from workflow.config_slice import ConfigSlice, select_keys
from workflow.errors import PipelineError
from workflow.paths import RunLayout, shard_name

log = logging.getLogger(__name__)


# --- units of work --------------------------------------------------------------------------------

class Unit:
    """What one job of a stage covers: the whole run. Subclasses own their wildcards (the rule's,
    in this order), their selections (the keyword arguments of :func:`run_stage` naming one
    unit), their command-line options and how a job of theirs runs."""

    name = "run"
    wildcards: tuple[str, ...] = ()

    def selections(self, stage: Stage, config: Mapping) -> list[dict]:
        """Every unit of ``stage`` that ``config`` makes, in plan order."""
        return [{}]

    def patterns(self) -> dict:
        """The selection of a rule: each wildcard as a Snakemake pattern."""
        return {name: f"{{{name}}}" for name in self.wildcards}

    def wildcard_values(self, selection: Mapping) -> dict:
        """A selection as its wildcards' strings (as Snakemake matches them in paths)."""
        return {name: str(selection[name]) for name in self.wildcards}

    def log_name(self, selection: Mapping) -> str | None:
        """The unit's file name in ``logs/<stage>/`` (None: the stage's own name)."""
        return "_".join(self.wildcard_values(selection).values()) or None

    def label(self, stage: Stage, selection: Mapping) -> str:
        """How messages name a unit: 'simulate batch 3', 'write_tfrecords train shard 0'."""
        return " ".join([stage.name] + [f"{name} {selection[name]}" if name != "split" else selection[name]
                                         for name in self.wildcards])

    def shell_options(self) -> str:
        """The command-line options of a rule's job, from its wildcards."""
        return "".join(f" --{name.replace('_', '-')} {{{name}}}" for name in self.wildcards)

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        """This unit's options of ``cosmoflow <command>``."""

    def from_arguments(self, args: argparse.Namespace, run: RunLayout, config: Mapping) -> dict:
        """The selection the command line names (``config``: the whole validated configuration)."""
        return self.job_selection({name: getattr(args, name) for name in self.wildcards}, run, config)

    def job_selection(self, selection: Mapping, run: RunLayout, config: Mapping) -> dict:
        """What :func:`run_stage` takes for ``selection`` (``config``: the whole configuration)."""
        return dict(selection)

    def run(self, stage: Stage, run: RunLayout, config: ConfigSlice, **selection):
        return stage.job(run, config, **selection)


class BatchUnit(Unit):
    """``simulation.sims_per_job`` simulations of params.csv, one task (and file) each."""

    name = "batch"
    wildcards = ("batch",)

    def selections(self, stage, config):
        return [{"batch": batch} for batch in range(n_batches(config))]

    def add_options(self, parser):
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--batch", type=int, metavar="B", help="every simulation of batch B (params.csv)")
        which.add_argument("--sim-id", type=int, nargs="+", metavar="ID", help="these simulations only")
        parser.add_argument(
            "--force", action="store_true",
            help="redo simulations whose outputs are already up to date (same inputs and code version)")

    def from_arguments(self, args, run, config):
        return self.job_selection({"batch": args.batch, "sim_ids": args.sim_id, "force": args.force},
                                  run, config)

    def job_selection(self, selection, run, config):
        """Missing inputs (intermediates not kept) are made again: :func:`regenerator`."""
        return {**selection, "regenerate": regenerator(run, config)}

    def run(self, stage, run, config, **selection):
        return run_batch(stage, stage.job, run, config, discard=discarded_inputs(stage, run, config),
                         **selection)


class ShardUnit(Unit):
    """One write_tfrecords shard of one split: the simulations of ``plan(config)[split, shard]``."""

    name = "shard"
    wildcards = ("split", "shard")

    def selections(self, stage, config):
        return [{"split": split, "shard": shard} for split, shard in preprocessing_jobs.shard_batches(config)]

    def wildcard_values(self, selection):
        return {"split": selection["split"], "shard": shard_name(selection["shard"])}

    def add_options(self, parser):
        parser.add_argument("--split", required=True, choices=SPLITS)
        parser.add_argument("--shard", required=True, type=int, metavar="K", help="shard number (0-based)")


class FractionUnit(Unit):
    """One learning-curve point: the stage's job on the first ``fraction`` of the training
    simulations (``training.train_fraction``, for each of ``analysis.learning_curve``), in the
    run's ``learning_curve/train_<fraction>/``."""

    name = "fraction"
    wildcards = ("fraction",)

    def selections(self, stage, config):
        return [{"fraction": f"{fraction:g}"} for fraction in config["analysis"]["learning_curve"]]

    def add_options(self, parser):
        parser.add_argument("--fraction", required=True, type=float, metavar="F",
                            help="fraction of the training simulations (0 < F < 1)")

    def from_arguments(self, args, run, config):
        """``--fraction F``, checked as training.train_fraction = F (whole shards of the split)."""
        validate_config({**config, "training": {**config["training"], "train_fraction": args.fraction}},
                        source=f"--fraction {args.fraction:g}")
        return {"fraction": f"{args.fraction:g}"}

    def run(self, stage, run, config, fraction):
        point = RunLayout(run.root, training_dir=run.learning_curve(fraction))
        section = {**config.as_declared()["training"], "train_fraction": float(fraction)}
        return stage.job(point, ConfigSlice(stage.name, {**config.as_declared(), "training": section},
                                            reads=config.reads))


RUN, BATCH, SHARD, FRACTION = Unit(), BatchUnit(), ShardUnit(), FractionUnit()


# --- the table ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of the pipeline: rule ``name``, its unit, its job and what it reads and writes."""

    name: str
    """Snakemake rule name (users run ``snakemake --until <name>``)."""
    unit: Unit
    job: Callable
    """The job of one unit (its signature: the module docstring)."""
    summary: str
    """What the stage produces, for ``cosmoflow --help``."""
    outputs: Callable[..., list[Path]]
    """The files one job writes last (its Snakemake outputs), from the run directory and the
    unit's selection; wildcard strings give patterns."""
    upstream: tuple[str, ...] = ()
    """The stages whose outputs a job reads. One unit reads, of each: the run's unit, the unit
    of the same selection (same unit type), or every unit (this stage is a run stage) unless
    :attr:`upstream_units` maps it otherwise."""
    upstream_units: Mapping[str, Callable[[Mapping], Callable[[Mapping], list[dict]]]] = field(
        default_factory=dict)
    """For an upstream stage: ``plan(config)``, giving ``units(selection)`` (one unit's
    upstream selections); the plan is made once per configuration."""
    extra_inputs: Callable[[Mapping], list[Path]] = lambda config: []
    """Files a job reads besides upstream outputs, from the full configuration."""
    reads: tuple[str, ...]
    """Config keys (dotted; a section name means all of it) whose values determine the outputs:
    the rule's params and, for batch stages, the provenance in every file written."""
    tuning: tuple[str, ...] = ()
    """Config keys that change how the job runs (threads, parallel copies), not what it writes;
    they are left out of the params even inside a section that :attr:`reads` names."""
    resources: Callable[[Mapping], dict] = lambda config: {}
    """threads, mem_mb, runtime (minutes), and for MPI jobs tasks, nodes, cpus_per_task."""
    mpi: bool = False
    """One process per MPI rank, launched through the rule's ``{resources.mpi}``."""
    output_dir: str | None = None
    """The :class:`RunLayout` field that ``--output-dir`` moves (the stage's own directory)."""
    per_simulation: Callable[[RunLayout, int | str], Path] | None = None
    """Batch stages: the file each simulation's task writes."""
    kept_if: str | None = None
    """Batch stages: the boolean config key saying whether each simulation's file is kept once
    the next stage has used it (None: always kept); the next stage's job deletes it otherwise."""
    tensorflow: bool = False
    """The job runs TensorFlow (the CLI quiets its start-up messages first)."""
    report: str | None = None
    """The category under which ``snakemake --report`` shows the first output (caption:
    workflow/report/<name>.rst)."""
    figures: Callable[[RunLayout], Path] | None = None
    """The directory of the stage's figures (PNG files), also outputs of the rule and shown by
    ``snakemake --report``."""

    @property
    def command(self) -> str:
        """``cosmoflow <command>``."""
        return self.name.replace("_", "-")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key the job may read: :attr:`reads`, :attr:`tuning`, and whether each upstream
        per-simulation file is kept (the job deletes it otherwise)."""
        kept = tuple(STAGE[name].kept_if for name in self.upstream if STAGE[name].kept_if)
        return self.reads + self.tuning + kept

    def keeps(self, config: Mapping) -> bool:
        """Whether each simulation's file of this batch stage stays on disk."""
        if self.kept_if is None:
            return True
        section, key = self.kept_if.split(".")
        return config[section][key]

    def params(self, config: Mapping) -> dict:
        """The values of :attr:`reads` but not :attr:`tuning`, nested by section (the rule's
        params)."""
        params = select_keys(config, self.reads)
        for key in self.tuning:
            *parents, leaf = key.split(".")
            section = params
            for part in parents:
                section = section.get(part, {})
            section.pop(leaf, None)
        return params

    def config_slice(self, config: Mapping) -> ConfigSlice:
        """What the job may read: the values of :attr:`keys`, nothing else."""
        return ConfigSlice(self.name, select_keys(config, self.keys))

    def all_outputs(self, run: RunLayout, config: Mapping) -> list[Path]:
        """The outputs of every unit of the stage."""
        return [path for selection in self.unit.selections(self, config)
                for path in self.outputs(run, **selection)]


def fisher_companion_data(config: Mapping) -> list[Path]:
    """The Fisher companion run's data set (analysis.fisher_companion names its configuration;
    its own Snakemake run makes it: rule fisher_companion)."""
    companion = config["analysis"]["fisher_companion"]
    if not companion:
        return []
    run = RunLayout(run_directory(load_config(companion)))
    return [run.manifest, run.params_csv]


_TRAINING_TUNING = tuple(f"training.{key}" for key in training_jobs.TUNING_KEYS) + (
    "staging.target", "staging.workers")

STAGES: tuple[Stage, ...] = (
    Stage(
        name="sample_parameters", unit=RUN, job=simulation_jobs.sample_parameters,
        summary="sample cosmological parameters, seeds and splits -> params.csv",
        outputs=lambda run: [run.params_csv],
        reads=("seed", "sampling", "simulation.sims_per_job"),
    ),
    Stage(
        name="initial_conditions", unit=BATCH, job=simulation_jobs.initial_conditions,
        summary="2LPT initial conditions (ours or MUSIC) -> sims/<sim_id>/ic.h5, music.conf",
        outputs=lambda run, batch: [run.batch_summary("initial_conditions", batch)],
        upstream=("sample_parameters",), extra_inputs=simulation_jobs.transfer_table,
        reads=("cosmology", "initial_conditions", "simulation.n_particles", "simulation.box_size"),
        tuning=("simulation.threads",),
        resources=lambda config: resources.simulation_job("initial_conditions", config),
        per_simulation=RunLayout.initial_conditions,
        kept_if="simulation.keep_initial_conditions",
    ),
    Stage(
        name="simulate", unit=BATCH, job=simulation_jobs.simulate,
        summary="COLA N-body simulations -> sims/<sim_id>/snapshot.h5",
        outputs=lambda run, batch: [run.batch_summary("simulate", batch)],
        upstream=("initial_conditions",),
        reads=tuple(f"simulation.{key}" for key in (
            "redshifts", "n_steps", "stepping", "cola", "n_cola", "mesh_factor", "backend")),
        tuning=("simulation.threads", "simulation.pycola_python"),
        resources=lambda config: resources.simulation_job("simulate", config),
        per_simulation=RunLayout.snapshot,
        kept_if="simulation.keep_snapshots",
    ),
    Stage(
        name="histogram", unit=BATCH, job=preprocessing_jobs.histogram,
        summary="density histograms of the snapshots -> histograms/<sim_id>.h5",
        outputs=lambda run, batch: [run.batch_summary("histogram", batch)],
        upstream=("simulate",),
        reads=("preprocessing.grid", "preprocessing.assignment", "preprocessing.dtype"),
        per_simulation=RunLayout.histogram,
    ),
    Stage(
        name="validate_simulations", unit=BATCH, job=analysis_jobs.validate_simulation,
        summary="each simulation's histogram against linear theory -> validation/<sim_id>.h5",
        outputs=lambda run, batch: [run.batch_summary("validate_simulations", batch)],
        upstream=("histogram",),
        reads=("analysis.validation", "cosmology.transfer", "cosmology.transfer_table", "cosmology.T_cmb"),
        tuning=("analysis.threads",),
        resources=lambda config: {"threads": config["analysis"]["threads"]},
        per_simulation=RunLayout.simulation_check,
    ),
    Stage(
        name="write_tfrecords", unit=SHARD, job=preprocessing_jobs.write_tfrecords,
        summary="sub-volumes of one shard of one split -> tfrecords/<split>/",
        outputs=lambda run, split, shard: [run.shard_summary(split, shard)],
        upstream=("sample_parameters", "histogram"),
        upstream_units={"histogram": preprocessing_jobs.histograms_of_shard},
        reads=("seed", "sampling.parameters") + tuple(f"preprocessing.{key}" for key in (
            "grid", "subvolume", "samples_per_file", "sims_per_shard", "compression")),
        tensorflow=True,
    ),
    Stage(
        name="manifest", unit=RUN, job=preprocessing_jobs.manifest,
        summary="merge the shard summaries -> tfrecords/manifest.json",
        outputs=lambda run: [run.manifest],
        upstream=("write_tfrecords",),
        reads=("seed", "sampling") + tuple(f"preprocessing.{key}" for key in (
            "grid", "subvolume", "samples_per_file", "sims_per_shard")),
    ),
    Stage(
        name="stage", unit=RUN, job=preprocessing_jobs.stage,
        summary="copy and verify the TFRecords where training reads them -> staged/staged.json",
        outputs=lambda run: [run.staged_record],
        upstream=("manifest",),
        reads=tuple(f"staging.{key}" for key in ("mode", "target", "lustre", "burst_buffer")),
        tuning=("staging.workers",),
        resources=resources.staging_job,
    ),
    Stage(
        name="train", unit=RUN, job=training_jobs.train,
        summary="train the network on the staged data over MPI -> training/",
        outputs=lambda run: [run.training_files.model, run.training_files.run_record],
        upstream=("stage",),
        reads=("training",), tuning=_TRAINING_TUNING,
        resources=resources.training_job, mpi=True, output_dir="training_dir", tensorflow=True,
    ),
    Stage(
        name="train_fraction", unit=FRACTION, job=training_jobs.train,
        summary="one learning-curve point: train on a fraction of the training simulations "
        "-> learning_curve/train_<fraction>/",
        outputs=lambda run, fraction: [run.learning_curve_files(fraction).model,
                                       run.learning_curve_files(fraction).run_record],
        upstream=("stage",),
        reads=("training",), tuning=_TRAINING_TUNING,
        resources=resources.training_job, mpi=True, tensorflow=True,
    ),
    Stage(
        name="analyze", unit=RUN, job=analysis_jobs.analyze,
        summary="evaluate the network and the baselines, validate the simulations -> analysis/report.html",
        outputs=lambda run: [run.analysis_files.report, run.analysis_files.metrics,
                             run.analysis_files.predictions],
        upstream=("train", "train_fraction", "manifest", "sample_parameters", "validate_simulations"),
        extra_inputs=fisher_companion_data,
        # the validation settings come in through validate_simulations' files; the figure's
        # band is analysis.validation.tolerance
        reads=tuple(f"analysis.{key}" for key in schema_keys("analysis") if key != "validation") + (
            "analysis.validation.tolerance", "training.train_split", "training.validation_split",
            "sampling.design", "simulation.box_size", "preprocessing.grid"),
        tuning=("analysis.threads",),
        resources=lambda config: {"threads": config["analysis"]["threads"]},
        output_dir="analysis_dir", tensorflow=True, report="Analysis",
        figures=lambda run: run.analysis_files.figures,
    ),
)

STAGE = {stage.name: stage for stage in STAGES}

TRAIN = STAGE["train"]
"""The training stage, which the trials of a hyperparameter sweep run with other settings."""

def upstream_of(name: str) -> set[str]:
    """The names of every stage upstream of stage ``name``, directly or not."""
    return set().union(*({before} | upstream_of(before) for before in STAGE[name].upstream))


ENSEMBLE = tuple(stage for stage in STAGES if "manifest" not in upstream_of(stage.name))
"""The stages ``cosmoflow ensemble`` runs: the data set's phase, every stage that does not wait
for the data set's manifest (the simulations, their validation, the TFRecords, the manifest)."""


def upstream_units(stage: Stage, config: Mapping) -> Callable[[Mapping], list[tuple[Stage, dict]]]:
    """``units(selection)``: the upstream units (stage, selection) one unit of ``stage`` reads,
    in :attr:`Stage.upstream` order (the plans are made once, here)."""
    plans = []
    for name in stage.upstream:
        before = STAGE[name]
        if name in stage.upstream_units:
            plans.append((before, stage.upstream_units[name](config)))
        elif before.unit is RUN:
            plans.append((before, lambda selection: [{}]))
        elif before.unit is stage.unit:
            plans.append((before, lambda selection: [dict(selection)]))
        elif stage.unit is RUN:
            every = before.unit.selections(before, config)
            plans.append((before, lambda selection, every=every: every))
        else:
            raise PipelineError(f"stage {stage.name}: declare which units of {name} one of its "
                                f"units reads (upstream_units)")
    return lambda selection: [(before, chosen) for before, plan in plans for chosen in plan(selection)]


def run_stage(stage: Stage, run: RunLayout, config: ConfigSlice, **selection):
    """Run one unit of ``stage`` with ``config``, its slice (:meth:`Stage.config_slice`).

    ``selection``: the unit's (:meth:`Unit.from_arguments`; for a batch, ``batch`` or
    ``sim_ids``, and ``force``, ``regenerate``: see :func:`regenerator`). Returns what the job
    returns.
    """
    return stage.unit.run(stage, run, config, **selection)


def discarded_inputs(stage: Stage, run: RunLayout, config: Mapping) -> Callable[[int], list[Path]]:
    """``discard(sim_id)``: the upstream per-simulation files that a batch job of ``stage``
    deletes once its own file is current, those whose producer does not keep them."""
    dropped = [STAGE[name] for name in stage.upstream
               if STAGE[name].per_simulation is not None and not STAGE[name].keeps(config)]
    return lambda sim_id: [before.per_simulation(run, sim_id) for before in dropped]


def regenerator(run: RunLayout, config: Mapping) -> Callable:
    """``regenerate(path, record)`` for batch jobs: makes a missing per-simulation file again
    through the stage that writes it, with that stage's own slice of ``config`` (the full
    configuration), and so on upstream. This is how an intermediate that was not kept
    (simulation.keep_initial_conditions, keep_snapshots) comes back when a rerun needs it."""

    def regenerate(path: Path, record) -> None:
        for stage in STAGES:
            if stage.per_simulation is not None and stage.per_simulation(run, record.sim_id) == path:
                log.info("%s: making %s again for sim %d", stage.name, path, record.sim_id)
                run_batch(stage, stage.job, run, stage.config_slice(config), sim_ids=[record.sim_id],
                          regenerate=regenerate, discard=discarded_inputs(stage, run, config))
                return
        raise PipelineError(f"{path} is missing and no stage of workflow/stages.py writes it")

    return regenerate
