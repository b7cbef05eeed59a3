"""The run directory's layout (docs/run-directory.md), in one place.

Snakemake rules, ``cosmoflow`` subcommands and Parsl apps all take their paths from
:class:`RunLayout`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


def _file(*parts: str, doc: str, base: str = "directory") -> property:
    """The path ``parts`` below the object's ``base`` directory, as a documented attribute."""
    return property(lambda self: getattr(self, base).joinpath(*parts), doc=doc)


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory, ``<results_dir>/<run_name>/``.

    ``training_dir`` and ``analysis_dir`` move one stage's own outputs elsewhere (``cosmoflow
    train --output-dir``, e.g. one trial of a hyperparameter sweep); by default they are
    ``training/`` and ``analysis/`` of the run. The files inside a directory that a kernel is
    handed (a data set, a training, an analysis, a sweep, a Parsl driver's) are named by the
    classes below it: :class:`DatasetFiles`, :class:`TrainingFiles`, :class:`AnalysisFiles`,
    :class:`SweepFiles`, :class:`ParslFiles`.
    """

    root: Path
    training_dir: Path | None = None
    analysis_dir: Path | None = None

    config_record = _file("config.yaml", base="root",
                          doc="The validated configuration, defaults filled, that the run's jobs read.")
    params_csv = _file("params.csv", base="root", doc="The simulations: parameters, seed, batch, split.")

    def sim_dir(self, sim_id: int | str) -> Path:
        """``sims/<sim_id as 5 digits>``; a string (a Snakemake wildcard) is used as given."""
        return self.root / "sims" / _sim_name(sim_id)

    def music_conf(self, sim_id: int | str) -> Path:
        """The configuration the real MUSIC reads for this simulation (written for ours too)."""
        return self.sim_dir(sim_id) / "music.conf"

    def music_log(self, sim_id: int | str) -> Path:
        """MUSIC's console output (initial_conditions.backend: music)."""
        return self.sim_dir(sim_id) / "music.log"

    def initial_conditions(self, sim_id: int | str) -> Path:
        return self.sim_dir(sim_id) / "ic.h5"

    def snapshot(self, sim_id: int | str) -> Path:
        return self.sim_dir(sim_id) / "snapshot.h5"

    def simulation_check(self, sim_id: int | str) -> Path:
        """The simulation's histogram checked against linear theory (stage validate_simulations)."""
        return self.root / "validation" / f"{_sim_name(sim_id)}.h5"

    def histogram(self, sim_id: int | str) -> Path:
        return self.root / "histograms" / f"{_sim_name(sim_id)}.h5"

    tfrecords = _file("tfrecords", base="root", doc="The data set's directory, as the preprocessing "
                      "stages write it.")

    @property
    def tfrecord_files(self) -> DatasetFiles:
        return DatasetFiles(self.tfrecords)

    @property
    def manifest(self) -> Path:
        return self.tfrecord_files.manifest

    def shard_summary(self, split: str, shard: int | str) -> Path:
        """What the ``write_tfrecords`` job of ``shard`` of ``split`` leaves last (its output)."""
        return self.tfrecord_files.shard_summary(split, shard)

    staged = _file("staged", base="root", doc="The staging stage's directory.")
    staged_record = _file("staged", "staged.json", base="root", doc="Where the data set was staged.")
    staged_data = _file("staged", "data", base="root", doc="The staged copy of the data set when "
                        "staging.mode is copy or lustre and staging.target is not set.")
    datawarp_directives = _file("staged", "datawarp.bb", base="root", doc="The ``#DW`` lines that the "
                                "train job's sbatch reads with ``--bbf`` (burst_buffer mode).")

    @property
    def training(self) -> Path:
        """The training stage's directory (:class:`TrainingFiles`)."""
        return self.training_dir or self.root / "training"

    @property
    def training_files(self) -> TrainingFiles:
        return TrainingFiles(self.training)

    def learning_curve(self, fraction: float | str) -> Path:
        """The training directory of one learning-curve point: the network trained on this
        fraction of the training simulations (``learning_curve/train_<fraction>/``, as
        ``training/``); a string (a Snakemake wildcard) is used as given."""
        name = fraction if isinstance(fraction, str) else f"{fraction:g}"
        return self.root / "learning_curve" / f"train_{name}"

    def learning_curve_files(self, fraction: float | str) -> TrainingFiles:
        return TrainingFiles(self.learning_curve(fraction))

    @property
    def analysis(self) -> Path:
        """The analysis stage's directory (:class:`AnalysisFiles`)."""
        return self.analysis_dir or self.root / "analysis"

    @property
    def analysis_files(self) -> AnalysisFiles:
        return AnalysisFiles(self.analysis)

    def sweep(self, name: str) -> SweepFiles:
        """``sweeps/<name>/``: the hyperparameter sweep ``name`` (config sweep.name)."""
        return SweepFiles(self.root / "sweeps" / name)

    @property
    def parsl_files(self) -> ParslFiles:
        """``parsl/``: the Parsl driver of ``cosmoflow ensemble``."""
        return ParslFiles(self.root / "parsl")

    parsl_ensemble = _file("parsl", "ensemble", base="root", doc="Parsl's own run directories of "
                           "``cosmoflow ensemble`` (``NNN/``: parsl.log, worker logs, submit scripts).")

    def parsl_job_record(self, rule: str, name: str | None = None) -> Path:
        """What a job of ``rule`` that ``cosmoflow ensemble`` ran was made from (its stage's
        params, the code version, its outputs' mtimes): whether it is current at the next run."""
        return self.parsl_files.directory / "jobs" / rule / f"{name or rule}.json"

    def batch_summary(self, rule: str, batch: int | str) -> Path:
        """The JSON summary a batch job of ``rule`` writes last: the rule's Snakemake output."""
        return self.root / "batches" / rule / f"{batch}.json"

    logs = _file("logs", base="root", doc="Every job's log, ``<rule>/<unit>.log`` (:meth:`log`).")

    def log(self, rule: str, name: str | None = None) -> Path:
        return self.logs / rule / f"{name or rule}.log"

    def benchmark(self, rule: str, name: str | None = None) -> Path:
        return self.root / "benchmarks" / rule / f"{name or rule}.tsv"


@dataclass(frozen=True)
class DatasetFiles:
    """A TFRecord data set's directory: the run's ``tfrecords/`` or a staged copy of it. The
    TFRecord files, ``<split>/<split>_<NNNN>.tfrecord[.gz]``, are named by
    :mod:`preprocessing.tfrecords` and listed, relative to this directory, in the manifest."""

    directory: Path
    manifest = _file("manifest.json", doc="Every file with its sha256, the sample shape, the targets, "
                     "the normalisation statistics (:mod:`preprocessing.manifest`).")

    def shard_summary(self, split: str, shard: int | str) -> Path:
        """``<split>/<split>_shard_<NNNN>.json``: the files and log1p moments of one shard,
        merged into the manifest."""
        return self.directory / split / f"{split}_shard_{shard_name(shard)}.json"

    def shard_summaries(self) -> list[Path]:
        """Every shard summary in the directory now, sorted."""
        return sorted(self.directory.glob("*/*_shard_*.json"))


@dataclass(frozen=True)
class TrainingFiles:
    """What one training (:func:`training.run.train_network`) writes into its directory."""

    directory: Path
    checkpoints = _file("checkpoints", doc="The resumable state, the newest two positions "
                        "(:mod:`training.checkpoints` names them).")
    superseded_checkpoints = _file("checkpoints.superseded", doc="The checkpoints of another run "
                                   "(other settings or data), moved aside when the workflow trains afresh.")
    history = _file("history.csv", doc="One row of losses, rates and timings per epoch (Keras CSVLogger).")
    tensorboard = _file("tensorboard", doc="TensorBoard's event files, one point per epoch.")
    model = _file("model.keras", doc="The trained network (without the optimiser), written at the end.")
    run_record = _file("run.json", doc="Settings, throughput, validation against the training mean, "
                       "history, versions; written last.")


@dataclass(frozen=True)
class TrialFiles(TrainingFiles):
    """One trial of a sweep: a training directory, plus what the Parsl app running it keeps."""

    log = _file("trial.log", doc="The trial's command lines and their output, every attempt appended.")
    lock = _file(".lock", doc="Held (``flock``) while a training runs in the directory: one at a time.")


@dataclass(frozen=True)
class AnalysisFiles:
    """What the analysis (:func:`analysis.jobs.analyze`) writes into its directory."""

    directory: Path
    predictions = _file("predictions.csv", doc="Every model's prediction per sample and per simulation.")
    metrics = _file("metrics.json", doc="Per parameter and model the errors, the baselines' choices, "
                    "the flagged simulations, the Fisher forecast.")
    figures = _file("figures", doc="The report's figures (:mod:`analysis.figures`), each a file of its own.")
    report = _file("report.html", doc="One self-contained page (:mod:`analysis.report`).")

    def figure(self, name: str) -> Path:
        """``figures/<name>.png``."""
        return self.figures / f"{name}.png"


@dataclass(frozen=True)
class SweepFiles:
    """One hyperparameter sweep's directory (:mod:`workflow.parsl.sweep`)."""

    directory: Path
    config = _file("config.yaml", doc="The run's configuration that the trials start from, its "
                   "results_dir absolute.")
    table = _file("sweep.csv", doc="Each trial's values, validation figures and status; the best marked.")
    node_file = _file("parsl", "nodefile", doc="The host list that the trials' MPIExecutor reads as "
                      "$PBS_NODEFILE.")

    def trial(self, name: str) -> TrialFiles:
        """``<name>/``: the training directory of the trial ``name``."""
        return TrialFiles(self.directory / name)

    @property
    def parsl_files(self) -> ParslFiles:
        """``parsl/``: the sweep's Parsl driver; Parsl's run directories and the memoizer's
        checkpoints of finished trials go to this directory itself."""
        return ParslFiles(self.directory / "parsl")


@dataclass(frozen=True)
class ParslFiles:
    """A Parsl driver's directory (``cosmoflow ensemble`` or ``cosmoflow sweep``)."""

    directory: Path
    running = _file("running", doc="One directory per live driver, a marker file in it per running "
                    "job (the console's running count).")

    def new_session(self) -> Path:
        """The running directory of the calling driver process, named by its pid and start."""
        return self.running / f"{os.getpid()}-{time.time_ns()}"


def _sim_name(sim_id: int | str) -> str:
    return sim_id if isinstance(sim_id, str) else f"{sim_id:05d}"


def shard_name(shard: int | str) -> str:
    """A shard number as file names hold it (4 digits); a string (a Snakemake wildcard) as given."""
    return shard if isinstance(shard, str) else f"{shard:04d}"
