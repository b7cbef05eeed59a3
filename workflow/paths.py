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

    def log(self, rule: str, name: str | None = None) -> Path:
        return self.root / "logs" / rule / f"{name or rule}.log"

    def benchmark(self, rule: str, name: str | None = None) -> Path:
        return self.root / "benchmarks" / rule / f"{name or rule}.tsv"
