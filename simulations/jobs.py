"""The simulation stages' jobs: sample_parameters, initial_conditions and simulate.

Each job takes the run directory and its slice of the configuration (workflow/stages.py, which
also says which keys that is); the batch stages return one simulation's :class:`Task`, which
workflow.batch runs for every simulation of a batch. Each simulation's parameters and seed come
from its params.csv row.

Outputs (run directory): ``params.csv`` (sample_parameters), ``sims/<sim_id>/music.conf`` and
``ic.h5`` (initial_conditions), ``sims/<sim_id>/snapshot.h5`` (simulate), and the batch
summaries ``batches/<rule>/<batch>.json``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from workflow.errors import PipelineError
from workflow.params_table import SimulationRecord
from workflow.paths import RunLayout
from workflow.task import Task

if TYPE_CHECKING:
    from simulations.cosmology import Cosmology

log = logging.getLogger(__name__)


def sample_parameters(run: RunLayout, config) -> None:
    """Sample the ensemble's parameters, seeds and splits and write params.csv."""
    from simulations.sampling import sample_ensemble, write_params_csv

    sampling = config["sampling"]
    ensemble = sample_ensemble(
        n_simulations=sampling["n_simulations"], design=sampling["design"],
        parameters=sampling["parameters"], ranges=sampling["ranges"], splits=sampling["splits"],
        sims_per_job=config["simulation"]["sims_per_job"], master_seed=config["seed"],
        fiducial=sampling["fiducial"], derivative_steps=sampling["derivative_steps"],
    )
    write_params_csv(run.params_csv, ensemble)


def simulation_cosmology(record: SimulationRecord, cosmology) -> Cosmology:
    """Flat LCDM of one simulation: its sampled parameters plus the config's fixed ones."""
    from simulations.cosmology import Cosmology  # scipy: only in the jobs that need it

    p = record.parameters
    return Cosmology(
        Omega_m=p["Omega_m"], sigma_8=p["sigma_8"], n_s=p["n_s"], h=p.get("h", cosmology["h"]),
        Omega_b=cosmology["Omega_b"], T_cmb=cosmology["T_cmb"],
        transfer=cosmology["transfer"], transfer_table=cosmology["transfer_table"],
    )


def transfer_table(config) -> list[Path]:
    """The file the initial conditions read besides params.csv: the transfer table, if any."""
    cosmology = config["cosmology"]
    return [Path(cosmology["transfer_table"])] if cosmology["transfer"] == "table" else []


def initial_conditions(run: RunLayout, config, record: SimulationRecord) -> Task:
    """One simulation's 2LPT initial conditions (ours, or the real MUSIC) -> ic.h5, music.conf."""
    from simulations.initial_conditions import generate_initial_conditions
    from simulations.music import music_initial_conditions, write_music_conf

    ics, simulation = config["initial_conditions"], config["simulation"]
    cosmo = simulation_cosmology(record, config["cosmology"])
    out = run.initial_conditions(record.sim_id)
    common = dict(
        cosmo=cosmo, n_particles=simulation["n_particles"], box_size=simulation["box_size"],
        z_init=ics["z_init"], seed=record.seed, sim_id=record.sim_id, lpt_order=ics["lpt_order"],
    )
    backend = ics["backend"]

    def write(provenance: str):
        if backend == "music":
            return music_initial_conditions(out, run.music_conf(record.sim_id), run.music_log(record.sim_id),
                                            ics["music_executable"], **common, provenance=provenance)
        try:  # the configuration the real MUSIC would take for this same run
            write_music_conf(
                run.music_conf(record.sim_id), cosmo, simulation["box_size"], simulation["n_particles"],
                ics["z_init"], record.seed, ics["lpt_order"], output_file="ic_music.hdf5",
            )
        except PipelineError as reason:
            log.warning("sim %d: no music.conf written: %s", record.sim_id, reason)
        return generate_initial_conditions(
            out, **common, fixed_amplitude=ics["fixed_amplitude"], phase_flip=ics["phase_flip"],
            threads=simulation["threads"], provenance=provenance,
        )

    table = cosmo.transfer_table
    return Task(out, write, inputs=(Path(table),) if table else ())


def simulate(run: RunLayout, config, record: SimulationRecord) -> Task:
    """One simulation's COLA run from its ic.h5 -> snapshot.h5 at every configured redshift."""
    from simulations.cola import run_simulation

    simulation = config["simulation"]
    ic, out = run.initial_conditions(record.sim_id), run.snapshot(record.sim_id)
    settings = {key: simulation[key] for key in (
        "redshifts", "n_steps", "stepping", "cola", "n_cola", "mesh_factor", "backend", "threads",
        "pycola_python")}

    def write(provenance: str):
        return run_simulation(ic, out, **settings, provenance=provenance)

    # The cosmology and the lattice come with ic.h5: a regenerated ic.h5 (newer) redoes the run.
    return Task(out, write, inputs=(ic,))
