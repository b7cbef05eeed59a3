"""The run directory's layout (DESIGN.md, "Run directory"), in one place.

Snakemake rules and ``cosmoflow`` subcommands both take their paths from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory, ``<results_dir>/<run_name>/``."""

    root: Path

    @property
    def config_record(self) -> Path:
        """The validated configuration, defaults filled, that the run's jobs read."""
        return self.root / "config.yaml"

    @property
    def params_csv(self) -> Path:
        return self.root / "params.csv"

    def sim_dir(self, sim_id: int) -> Path:
        return self.root / "sims" / f"{sim_id:05d}"

    def music_conf(self, sim_id: int) -> Path:
        return self.sim_dir(sim_id) / "music.conf"

    def initial_conditions(self, sim_id: int) -> Path:
        return self.sim_dir(sim_id) / "ic.h5"

    def snapshot(self, sim_id: int) -> Path:
        return self.sim_dir(sim_id) / "snapshot.h5"

    def histogram(self, sim_id: int) -> Path:
        return self.root / "histograms" / f"{sim_id:05d}.h5"

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
    def training(self) -> Path:
        """The training stage's directory (checkpoints/, model.keras, history.csv, run.json)."""
        return self.root / "training"

    def batch_summary(self, rule: str, batch: int | str) -> Path:
        """The JSON summary a batch job of ``rule`` writes last: the rule's Snakemake output."""
        return self.root / "batches" / rule / f"{batch}.json"

    def log(self, rule: str, name: str | None = None) -> Path:
        return self.root / "logs" / rule / f"{name or rule}.log"

    def benchmark(self, rule: str, name: str | None = None) -> Path:
        return self.root / "benchmarks" / rule / f"{name or rule}.tsv"
