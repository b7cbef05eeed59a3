"""The simulation stages over the ensemble: batches of params.csv rows -> per-simulation files.

Called by ``cosmoflow initial-conditions`` / ``cosmoflow simulate`` (and so by the Snakemake
rules ``initial_conditions`` and ``simulate``, one job per batch) and by the Parsl driver.
Each simulation's inputs come from its params.csv row (parameters, seed) and the config.

Outputs (run directory): ``sims/<sim_id>/music.conf`` and ``ic.h5`` (initial_conditions),
``sims/<sim_id>/snapshot.h5`` (simulate), ``batches/<rule>/<batch>.json`` (batch summaries).
"""

from __future__ import annotations

import logging
from pathlib import Path

from simulations.cosmology import Cosmology
from simulations.sampling import SimulationRecord, read_params_csv
from workflow.batch import Task, run_tasks
from workflow.config import run_directory
from workflow.errors import PipelineError
from workflow.paths import RunLayout
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)


def simulation_cosmology(record: SimulationRecord, cosmology: dict) -> Cosmology:
    """Flat LCDM of one simulation: its sampled parameters plus the config's fixed ones."""
    p = record.parameters
    return Cosmology(
        Omega_m=p["Omega_m"], sigma_8=p["sigma_8"], n_s=p["n_s"], h=p.get("h", cosmology["h"]),
        Omega_b=cosmology["Omega_b"], T_cmb=cosmology["T_cmb"],
        transfer=cosmology["transfer"], transfer_table=cosmology["transfer_table"],
    )


def select_simulations(layout: RunLayout, batch: int | None = None, sim_ids: list[int] | None = None) -> list[SimulationRecord]:
    """The params.csv rows of one batch, or of the given sim_ids."""
    records = read_params_csv(layout.params_csv)
    if batch is not None:
        chosen = [r for r in records if r.batch == batch]
        if not chosen:
            raise PipelineError(f"batch {batch} is not in {layout.params_csv} (batches 0..{records[-1].batch})")
        return chosen
    by_id = {r.sim_id: r for r in records}
    unknown = [i for i in sim_ids if i not in by_id]
    if unknown:
        raise PipelineError(f"sim_id {unknown[0]} is not in {layout.params_csv} (sim_ids 0..{len(records) - 1})")
    return [by_id[i] for i in sim_ids]


def initial_conditions_task(layout: RunLayout, record: SimulationRecord, config: dict) -> Task:
    from simulations.initial_conditions import generate_initial_conditions
    from simulations.music import music_initial_conditions, write_music_conf

    ics, simulation = config["initial_conditions"], config["simulation"]
    cosmo = simulation_cosmology(record, config["cosmology"])
    out = layout.initial_conditions(record.sim_id)
    common = dict(
        cosmo=cosmo, n_particles=simulation["n_particles"], box_size=simulation["box_size"],
        z_init=ics["z_init"], seed=record.seed, sim_id=record.sim_id, lpt_order=ics["lpt_order"],
    )

    def run():
        if ics["backend"] == "music":
            return music_initial_conditions(out, ics["music_executable"], **common)
        try:  # the configuration the real MUSIC would take for this same run
            write_music_conf(
                layout.music_conf(record.sim_id), cosmo, simulation["box_size"], simulation["n_particles"],
                ics["z_init"], record.seed, ics["lpt_order"], output_file="ic_music.hdf5",
            )
        except PipelineError as reason:
            log.warning("sim %d: no music.conf written: %s", record.sim_id, reason)
        return generate_initial_conditions(
            out, **common, fixed_amplitude=ics["fixed_amplitude"], phase_flip=ics["phase_flip"],
            threads=simulation["threads"],
        )

    provenance = {
        "sim_id": record.sim_id, "seed": record.seed, "n_particles": simulation["n_particles"],
        "box_size": float(simulation["box_size"]), "z_init": float(ics["z_init"]),
        "lpt_order": ics["lpt_order"], "backend": ics["backend"], "code_version": CODE_VERSION,
        "Omega_m": cosmo.Omega_m, "Omega_b": cosmo.Omega_b, "h": cosmo.h, "sigma_8": cosmo.sigma_8,
        "n_s": cosmo.n_s, "T_cmb": cosmo.T_cmb, "transfer": cosmo.transfer,
    }
    if ics["backend"] == "native":
        provenance.update(fixed_amplitude=ics["fixed_amplitude"], phase_flip=ics["phase_flip"])
    table = cosmo.transfer_table
    if table is not None:
        provenance["transfer_table"] = table
    return Task(record.sim_id, out, provenance, run, inputs=(Path(table),) if table else ())


def simulate_task(layout: RunLayout, record: SimulationRecord, config: dict) -> Task:
    from simulations.cola import run_simulation

    simulation = config["simulation"]
    settings = {key: simulation[key] for key in ("n_steps", "stepping", "cola", "n_cola", "mesh_factor", "gradient", "backend")}
    out = layout.snapshot(record.sim_id)

    def run():
        return run_simulation(
            layout.initial_conditions(record.sim_id), out, redshifts=simulation["redshifts"],
            threads=simulation["threads"], **settings,
        )

    # The cosmology and the lattice come with ic.h5: a regenerated ic.h5 (newer) redoes the run.
    provenance = {
        "sim_id": record.sim_id, "seed": record.seed, "redshifts": simulation["redshifts"],
        "code_version": CODE_VERSION, **settings,
    }
    return Task(record.sim_id, out, provenance, run, inputs=(layout.initial_conditions(record.sim_id),))


STAGE_TASKS = {"initial_conditions": initial_conditions_task, "simulate": simulate_task}


def run_stage(stage: str, config: dict, batch: int | None = None, sim_ids: list[int] | None = None, force: bool = False) -> list[dict]:
    """Run ``stage`` for one batch (writing its summary) or for chosen simulations."""
    layout = RunLayout(run_directory(config))
    records = select_simulations(layout, batch, sim_ids)
    tasks = [STAGE_TASKS[stage](layout, record, config) for record in records]
    summary = layout.batch_summary(stage, batch) if batch is not None else None
    return run_tasks(stage, tasks, force=force, summary_path=summary)
