"""The run directory's layout (DESIGN.md, "Run directory"), and its parameter table, in one place.

Snakemake rules, ``cosmoflow`` subcommands and Parsl apps all take their paths from
:class:`RunLayout`; every stage reads the simulations it works on from ``params.csv`` through
:func:`read_params_csv` / :func:`select_simulations` (the sampling stage writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workflow.errors import PipelineError
from workflow.io import read_csv

# The columns of params.csv around the sampled parameters (whose order is the target order).
PARAMS_CSV_COLUMNS = ("sim_id", "batch", "seed", "split")


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory, ``<results_dir>/<run_name>/``.

    ``training_dir`` and ``analysis_dir`` move one stage's own outputs elsewhere (``cosmoflow
    train --output-dir``, e.g. one trial of a hyperparameter sweep); by default they are
    ``training/`` and ``analysis/`` of the run.
    """

    root: Path
    training_dir: Path | None = None
    analysis_dir: Path | None = None

    @property
    def config_record(self) -> Path:
        """The validated configuration, defaults filled, that the run's jobs read."""
        return self.root / "config.yaml"

    @property
    def params_csv(self) -> Path:
        return self.root / "params.csv"

    def sim_dir(self, sim_id: int | str) -> Path:
        """``sims/<sim_id as 5 digits>``; a string (a Snakemake wildcard) is used as given."""
        return self.root / "sims" / _sim_name(sim_id)

    def music_conf(self, sim_id: int | str) -> Path:
        return self.sim_dir(sim_id) / "music.conf"

    def initial_conditions(self, sim_id: int | str) -> Path:
        return self.sim_dir(sim_id) / "ic.h5"

    def snapshot(self, sim_id: int | str) -> Path:
        return self.sim_dir(sim_id) / "snapshot.h5"

    def histogram(self, sim_id: int | str) -> Path:
        return self.root / "histograms" / f"{_sim_name(sim_id)}.h5"

    @property
    def tfrecords(self) -> Path:
        return self.root / "tfrecords"

    @property
    def manifest(self) -> Path:
        return self.tfrecords / "manifest.json"

    @property
    def staged(self) -> Path:
        """The staging stage's directory; ``staged.json`` records where the data set was staged."""
        return self.root / "staged"

    @property
    def staged_record(self) -> Path:
        return self.staged / "staged.json"

    @property
    def datawarp_directives(self) -> Path:
        """The ``#DW`` lines that the train job's sbatch reads with ``--bbf`` (burst_buffer mode)."""
        return self.staged / "datawarp.bb"

    @property
    def training(self) -> Path:
        """The training stage's directory (checkpoints/, model.keras, history.csv, run.json)."""
        return self.training_dir or self.root / "training"

    def learning_curve(self, fraction: float | str) -> Path:
        """The training directory of one learning-curve point: the network trained on this
        fraction of the training simulations (``learning_curve/train_<fraction>/``, as
        ``training/``); a string (a Snakemake wildcard) is used as given."""
        name = fraction if isinstance(fraction, str) else f"{fraction:g}"
        return self.root / "learning_curve" / f"train_{name}"

    @property
    def analysis(self) -> Path:
        """The analysis stage's directory (predictions.csv, metrics.json, figures/, report.html)."""
        return self.analysis_dir or self.root / "analysis"

    def batch_summary(self, rule: str, batch: int | str) -> Path:
        """The JSON summary a batch job of ``rule`` writes last: the rule's Snakemake output."""
        return self.root / "batches" / rule / f"{batch}.json"

    def log(self, rule: str, name: str | None = None) -> Path:
        return self.root / "logs" / rule / f"{name or rule}.log"

    def benchmark(self, rule: str, name: str | None = None) -> Path:
        return self.root / "benchmarks" / rule / f"{name or rule}.tsv"


def _sim_name(sim_id: int | str) -> str:
    return sim_id if isinstance(sim_id, str) else f"{sim_id:05d}"


@dataclass(frozen=True)
class SimulationRecord:
    """One row of params.csv: a simulation, its parameters (target order), seed and split."""

    sim_id: int
    batch: int
    parameters: dict
    seed: int
    split: str


def read_params_csv(path: str | Path) -> list[SimulationRecord]:
    """Read params.csv; raises PipelineError naming the file for a missing or bad table."""
    path = Path(path)
    _, rows = read_csv(path, f"parameter table {path} does not exist; run the sample_parameters stage first")
    if not rows:
        raise PipelineError(f"parameter table {path} holds no simulations")
    names = [name for name in rows[0] if name not in PARAMS_CSV_COLUMNS]
    records = []
    for line, row in enumerate(rows, start=2):
        try:
            records.append(SimulationRecord(
                int(row["sim_id"]), int(row["batch"]), {n: float(row[n]) for n in names},
                int(row["seed"]), row["split"],
            ))
        except (KeyError, TypeError, ValueError) as error:
            raise PipelineError(
                f"parameter table {path}, line {line}, is malformed ({error}); rerun sample_parameters"
            ) from None
    return records


def select_simulations(run: RunLayout, batch: int | None = None,
                       sim_ids: list[int] | None = None) -> list[SimulationRecord]:
    """The params.csv rows of one batch, or of the given sim_ids."""
    records = read_params_csv(run.params_csv)
    if batch is not None:
        chosen = [r for r in records if r.batch == batch]
        if not chosen:
            raise PipelineError(f"batch {batch} is not in {run.params_csv} (batches 0..{records[-1].batch})")
        return chosen
    by_id = {r.sim_id: r for r in records}
    unknown = [i for i in sim_ids if i not in by_id]
    if unknown:
        raise PipelineError(f"sim_id {unknown[0]} is not in {run.params_csv} (sim_ids 0..{len(records) - 1})")
    return [by_id[i] for i in sim_ids]
