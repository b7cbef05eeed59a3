"""``params.csv``, the table of the run's simulations: one row each, its sim_id, batch, sampled
parameters (in target order), seed and split (docs/formats.md). The sampling stage writes it;
every later stage reads the simulations it works on from it through :func:`read_params_csv` /
:func:`select_simulations`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workflow.errors import PipelineError
from workflow.io import read_csv
from workflow.paths import RunLayout

PARAMS_CSV_COLUMNS = ("sim_id", "batch", "seed", "split")
"""The columns around the sampled parameters (whose order is the target order)."""


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
