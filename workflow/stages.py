"""The pipeline's stages, in order: the one table behind the CLI, the Snakemake rules and Parsl.

Each :class:`Stage` names its Snakemake rule (DESIGN.md, "Rules") and its ``cosmoflow``
subcommand, its unit of work, the configuration keys it reads, the job that does one unit of
it and the job's resources. Everything else is derived from the table:

* ``cosmoflow <command>`` (workflow/cli.py) is one subcommand per stage, with the options of
  its unit (``--batch``/``--sim-id`` for a batch, ``--split``/``--shard`` for a shard);
* each rule's ``params`` are the keys the stage reads (:meth:`Stage.params`), so a changed key
  reruns exactly the stages that read it, and its threads and resources come from
  :attr:`Stage.resources`;
* a batch job records the same keys in every file it writes and skips a simulation whose file
  already holds them (workflow.batch);
* the Parsl apps run :func:`run_stage`, as the CLI does.

A job receives only its declared slice of the configuration (:class:`ConfigSlice`): reading a
key the table does not list for the stage fails at once, naming the stage and the key.

Jobs, one signature per unit (``run`` is the :class:`~workflow.paths.RunLayout`, ``config`` the
stage's :class:`ConfigSlice`):

* ``run``: ``job(run, config)``;
* ``batch``: ``job(run, config, record) -> Task`` for one simulation (a params.csv row), run by
  :func:`workflow.batch.run_batch` over a batch or chosen simulations;
* ``shard``: ``job(run, config, split, shard)``.
"""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from workflow import resources
from workflow.paths import RunLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: rule ``name``, subcommand ``command``, and how it runs."""

    name: str
    """Snakemake rule name (users run ``snakemake --until <name>``)."""
    command: str
    """``cosmoflow <command>``."""
    unit: str
    """One job does: ``run`` (the whole run), ``batch`` (simulation.batch_size simulations),
    ``shard`` (one write_tfrecords shard of one split) or ``trial`` (one sweep trial)."""
    job: str
    """``module:function`` of the job, imported only when it runs."""
    summary: str
    """What the stage produces, for ``cosmoflow --help``."""
    outputs: Callable[..., list[Path]]
    """The files one job writes last (its Snakemake outputs), from the run directory and the
    unit's selection (``batch``; ``split``, ``shard``); wildcard strings give patterns."""
    reads: tuple[str, ...]
    """Config keys (dotted; a section name means all of it) whose values determine the outputs:
    the rule's params and, for batch stages, the provenance in every file written."""
    tuning: tuple[str, ...] = ()
    """Config keys that change how the job runs (threads, parallel copies), not what it writes;
    they are left out of the params even inside a section that :attr:`reads` names."""
    resources: Callable[[dict], dict] = field(default=lambda config: {})
    """threads, mem_mb, runtime (minutes), and for MPI jobs tasks, nodes, cpus_per_task."""
    mpi: bool = False
    """One process per MPI rank, launched through the rule's ``{resources.mpi}``."""
    output_dir: str | None = None
    """The :class:`RunLayout` field that ``--output-dir`` moves (the stage's own directory)."""
    per_simulation: Callable[[RunLayout, int], Path] | None = None
    """Batch stages: the file each simulation's task writes."""
    kept_if: str | None = None
    """Batch stages: the boolean config key saying whether each simulation's file is kept once
    the next stage has used it (None: always kept)."""
    tensorflow: bool = False
    """The job runs TensorFlow (the CLI quiets its start-up messages first)."""

    @property
    def keys(self) -> tuple[str, ...]:
        return self.reads + self.tuning

    def keeps(self, config: Mapping) -> bool:
        """Whether each simulation's file of this batch stage stays on disk."""
        if self.kept_if is None:
            return True
        section, key = self.kept_if.split(".")
        return config[section][key]

    def job_function(self) -> Callable:
        module, name = self.job.split(":")
        return getattr(importlib.import_module(module), name)

    def params(self, config: Mapping) -> dict:
        """The values of :attr:`reads` but not :attr:`tuning`, nested by section (the rule's
        params)."""
        params = _nested(config, self.reads)
        for key in self.tuning:
            *parents, leaf = key.split(".")
            section = params
            for part in parents:
                section = section.get(part, {})
            section.pop(leaf, None)
        return params

    def config_slice(self, config: Mapping) -> "ConfigSlice":
        """What the job may read: the values of :attr:`keys`, nothing else."""
        return ConfigSlice(self.name, _nested(config, self.keys))


def _nested(config: Mapping, keys: tuple[str, ...]) -> dict:
    """``{section: {key: value}}`` holding exactly the dotted ``keys`` of ``config`` (copies)."""
    out: dict = {}
    for key in keys:
        *parents, leaf = key.split(".")
        source, target = config, out
        for part in parents:
            source = source[part]
            target = target.setdefault(part, {})
        target[leaf] = copy.deepcopy(source[leaf])
    return out


class ConfigSlice(Mapping):
    """A read-only view of the keys one stage declared; it records what the job reads.

    ``config["simulation"]["n_steps"]`` works as on the full configuration; a key outside the
    slice raises KeyError naming the stage and the key (declare it in workflow/stages.py).
    """

    def __init__(self, stage: str, data: Mapping, prefix: str = "", reads: set | None = None):
        self._stage, self._data, self._prefix = stage, data, prefix
        self.reads = set() if reads is None else reads
        """Dotted keys read so far (leaves; a whole section read as a mapping counts as all of it)."""

    def __getitem__(self, key: str):
        path = f"{self._prefix}{key}"
        if key not in self._data:
            raise KeyError(f"stage '{self._stage}' reads config key '{path}', which it does not "
                           f"declare in workflow/stages.py")
        value = self._data[key]
        if isinstance(value, Mapping):
            return ConfigSlice(self._stage, value, f"{path}.", self.reads)
        self.reads.add(path)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def plain(self) -> dict:
        """A plain dict of the whole slice (read in full: every key counts as read)."""
        return {key: value.plain() if isinstance(value, ConfigSlice) else value
                for key, value in self.items()}

    def as_declared(self) -> Mapping:
        """The declared keys and values, without recording any read (for provenance records)."""
        return self._data


def _shard_summary(run: RunLayout, split: str, shard: int | str) -> Path:
    from preprocessing.manifest import shard_summary_path

    return shard_summary_path(run.tfrecords, split, shard)


STAGES: tuple[Stage, ...] = (
    Stage(
        "sample_parameters", "sample", "run", "simulations.jobs:sample_parameters",
        "sample cosmological parameters, seeds and splits -> params.csv",
        outputs=lambda run: [run.params_csv],
        reads=("seed", "sampling", "simulation.batch_size"),
    ),
    Stage(
        "initial_conditions", "initial-conditions", "batch", "simulations.jobs:initial_conditions",
        "2LPT initial conditions (ours or MUSIC) -> sims/<sim_id>/ic.h5, music.conf",
        outputs=lambda run, batch: [run.batch_summary("initial_conditions", batch)],
        reads=("cosmology", "initial_conditions", "simulation.n_particles", "simulation.box_size"),
        tuning=("simulation.threads",),
        resources=lambda config: resources.simulation_job("initial_conditions", config),
        per_simulation=RunLayout.initial_conditions,
        kept_if="simulation.keep_initial_conditions",
    ),
    Stage(
        "simulate", "simulate", "batch", "simulations.jobs:simulate",
        "COLA N-body simulations -> sims/<sim_id>/snapshot.h5",
        outputs=lambda run, batch: [run.batch_summary("simulate", batch)],
        reads=tuple(f"simulation.{key}" for key in (
            "redshifts", "n_steps", "stepping", "cola", "n_cola", "mesh_factor", "gradient", "backend")),
        tuning=("simulation.threads", "simulation.pycola_python", "simulation.keep_initial_conditions"),
        resources=lambda config: resources.simulation_job("simulate", config),
        per_simulation=RunLayout.snapshot,
        kept_if="simulation.keep_snapshots",
    ),
    Stage(
        "histogram", "histogram", "batch", "preprocessing.jobs:histogram",
        "density histograms of the snapshots -> histograms/<sim_id>.h5",
        outputs=lambda run, batch: [run.batch_summary("histogram", batch)],
        reads=("preprocessing.grid", "preprocessing.assignment", "preprocessing.dtype"),
        tuning=("simulation.keep_snapshots",),
        per_simulation=RunLayout.histogram,
    ),
    Stage(
        "write_tfrecords", "write-tfrecords", "shard", "preprocessing.jobs:write_tfrecords",
        "sub-volumes of one shard of one split -> tfrecords/<split>/",
        outputs=lambda run, split, shard: [_shard_summary(run, split, shard)],
        reads=("seed", "sampling.parameters") + tuple(f"preprocessing.{key}" for key in (
            "grid", "subvolume", "samples_per_file", "sims_per_shard", "compression")),
        tensorflow=True,
    ),
    Stage(
        "manifest", "manifest", "run", "preprocessing.jobs:manifest",
        "merge the shard summaries -> tfrecords/manifest.json",
        outputs=lambda run: [run.manifest],
        reads=("seed", "sampling") + tuple(f"preprocessing.{key}" for key in (
            "grid", "subvolume", "samples_per_file", "sims_per_shard")),
    ),
    Stage(
        "stage", "stage", "run", "preprocessing.jobs:stage",
        "copy and verify the TFRecords where training reads them -> staged/staged.json",
        outputs=lambda run: [run.staged_record],
        reads=tuple(f"staging.{key}" for key in ("mode", "target", "lustre", "burst_buffer")),
        tuning=("staging.workers",),
        resources=resources.staging_job,
    ),
    Stage(
        "train", "train", "run", "training.jobs:train",
        "train the network on the staged data over MPI -> training/",
        outputs=lambda run: [run.training / "model.keras", run.training / "run.json"],
        reads=("training",),
        tuning=("training.threads", "training.inter_op_threads", "training.nodes",
                "staging.target", "staging.workers"),
        resources=resources.training_job,
        mpi=True,
        output_dir="training_dir",
        tensorflow=True,
    ),
    Stage(
        "analyze", "analyze", "run", "analysis.jobs:analyze",
        "evaluate the network and the baselines, validate the simulations -> analysis/report.html",
        outputs=lambda run: [run.analysis / name for name in ("report.html", "metrics.json", "predictions.csv")],
        reads=("analysis", "training.train_split", "training.validation_split", "sampling.design",
               "simulation.box_size", "preprocessing.grid",
               "cosmology.transfer", "cosmology.transfer_table", "cosmology.T_cmb"),
        tuning=("analysis.threads",),
        resources=lambda config: {"threads": config["analysis"]["threads"]},
        output_dir="analysis_dir",
        tensorflow=True,
    ),
)

STAGE = {stage.name: stage for stage in STAGES}


def run_stage(stage: Stage, run: RunLayout, config: "ConfigSlice", **selection):
    """Run one unit of ``stage`` with ``config``, its slice (:meth:`Stage.config_slice`).

    ``selection``: ``batch`` or ``sim_ids`` (and ``force``, ``regenerate``: see
    :func:`regenerator`) for a batch stage, ``split`` and ``shard`` for a shard stage, nothing
    for a run stage. Returns what the job returns.
    """
    from workflow.batch import run_batch

    if stage.unit == "batch":
        return run_batch(stage, stage.job_function(), run, config, **selection)
    return stage.job_function()(run, config, **selection)


def regenerator(run: RunLayout, config: Mapping) -> Callable:
    """``regenerate(path, record)`` for batch jobs: makes a missing per-simulation file again
    through the stage that writes it, with that stage's own slice of ``config`` (the full
    configuration), and so on upstream. This is how an intermediate that was not kept
    (simulation.keep_initial_conditions, keep_snapshots) comes back when a rerun needs it."""
    from workflow.batch import run_batch
    from workflow.errors import PipelineError

    def regenerate(path: Path, record) -> None:
        for stage in STAGES:
            if stage.per_simulation is not None and stage.per_simulation(run, record.sim_id) == path:
                log.info("%s: making %s again for sim %d", stage.name, path, record.sim_id)
                run_batch(stage, stage.job_function(), run, stage.config_slice(config),
                          sim_ids=[record.sim_id], regenerate=regenerate)
                return
        raise PipelineError(f"{path} is missing and no stage of workflow/stages.py writes it")

    return regenerate
