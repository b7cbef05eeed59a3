"""The workflow's code outside its rules: configuration, run-directory paths, the targets, and
what the rules take from the stage table (workflow/stages.py): inputs, outputs, resources and
their `cosmoflow` command lines."""

import sys

from workflow.config import SPLITS, batch_sim_ids, dump_config, n_batches, run_directory, validate_config
from workflow.io import atomic_write_text
from workflow.locks import release_stale_locks
from workflow.parsl.sweep import sweep_params
from workflow.paths import RunLayout
from workflow.stages import ENSEMBLE, STAGE, STAGES, fisher_companion_data, upstream_units
from workflow.summary import closing_summary

# After a run killed with kill -9 the documented command alone recovers: a run that finds no
# other run of this workflow, nor a job of one, alive in the directory removes the locks the
# killed one left (workflow/locks.py), and the profile's rerun-incomplete redoes the jobs it
# was running.
if workflow.is_main_process:
    if stale_locks := release_stale_locks():
        print(
            f"Removed {len(stale_locks)} lock file(s) that a killed run left in .snakemake/locks",
            file=sys.stderr,
        )

# One clear sentence per problem (key, value, what is allowed) and the schema's defaults,
# exactly as every `cosmoflow` entry point checks.
CONFIG_SOURCE = " + ".join(
    [str(path) for path in workflow.configfiles] + ["--config"] * bool(workflow.config_settings.config)
)
config.update(validate_config(config, source=CONFIG_SOURCE))

RUN = RunLayout(run_directory(config))
# Jobs read the configuration this invocation validated, so `--config KEY=VALUE` overrides
# reach them; the record is written when the run starts (not on dry runs). Which keys each
# job may read, and so which changes rerun it, is the stage's params.
RUN_CONFIG = str(RUN.config_record)
BATCHES = range(n_batches(config))


wildcard_constraints:
    batch=r"\d+",
    shard=r"\d\d\d\d",
    split="|".join(SPLITS),
    sim_id=r"\d\d\d\d\d+",  # sims/<sim_id as 5 digits or more>
    fraction=r"0\.\d+",  # learning_curve/train_<fraction of the training simulations>


onstart:
    atomic_write_text(RUN.config_record, dump_config(config))


onsuccess:
    print(closing_summary(RUN))


def stage_command(stage, options=None):
    """The rule's `command` param: `cosmoflow <command>` on the run's config with its unit's
    options (or ``options``), as a string of wildcard patterns that Snakemake fills in per job;
    for a stage that runs over MPI, a function adding the launcher from the job's resources."""
    options = stage.unit.shell_options() if options is None else options
    line = f"cosmoflow {stage.command} --config {RUN_CONFIG}{options}"
    if not stage.mpi:
        return line
    return lambda wildcards, resources: f"{resources.mpi} -n {resources.tasks} {line.format(**wildcards)}"


def stage_outputs(stage):
    """What one job of ``stage`` writes last, as patterns of its unit's wildcards. A stage with
    a report category shows its first output in `snakemake --report` (caption
    workflow/report/<stage>.rst) and its figures directory's PNG files (<stage>_figures.rst)."""
    paths = [str(path) for path in stage.outputs(RUN, **stage.unit.patterns())]
    if stage.report:
        paths[0] = report(paths[0], caption=f"../report/{stage.name}.rst", category=stage.report)
    if stage.figures:
        figures, caption = directory(str(stage.figures(RUN))), f"../report/{stage.name}_figures.rst"
        paths.append(report(figures, patterns=["{name}.png"], caption=caption, category="Figures"))
    return paths


def unit_inputs(stage):
    """The rule's input function: the outputs of the upstream units that one unit of ``stage``
    reads (workflow.stages.upstream_units), and its extra inputs (e.g. a transfer table)."""
    upstream = upstream_units(stage, config)
    extra = [str(path) for path in stage.extra_inputs(config)]
    outputs = {}  # of each upstream unit, made once: many shards read the same histogram batch
    inputs = {}
    for selection in stage.unit.selections(stage, config):
        key = tuple(stage.unit.wildcard_values(selection).values())
        inputs[key] = []
        for before, chosen in upstream(selection):
            unit = (before.name, *chosen.values())
            if unit not in outputs:
                outputs[unit] = [str(path) for path in before.outputs(RUN, **chosen)]
            inputs[key] += outputs[unit]
        inputs[key] += extra
    return lambda wildcards: inputs[tuple(wildcards[name] for name in stage.unit.wildcards)]


def simulation_inputs(stage):
    """What one simulation's file of batch stage ``stage`` is made from: each upstream stage's
    file of the same simulation, or that stage's outputs if it runs once per run."""
    paths = [str(path) for path in stage.extra_inputs(config)]
    for name in stage.upstream:
        before = STAGE[name]
        if before.per_simulation is not None:
            paths.append(str(before.per_simulation(RUN, "{sim_id}")))
        else:
            paths += [str(path) for path in before.all_outputs(RUN, config)]
    return paths


def missing_simulation_files():
    """Per-simulation files of finished batches that have gone missing since (deleted by hand,
    lost): the one-simulation rules (`<stage>_one`) regenerate each alone, bit for bit. Files
    the configuration does not keep (simulation.keep_initial_conditions, keep_snapshots) are
    not missed."""
    missing = []
    for stage in STAGES:
        if stage.per_simulation is None or not stage.keeps(config):
            continue
        for batch in BATCHES:
            if RUN.batch_summary(stage.name, batch).exists():
                paths = (stage.per_simulation(RUN, sim_id) for sim_id in batch_sim_ids(config, batch))
                missing += [str(path) for path in paths if not path.exists()]
    return missing


def final_targets():
    """The outputs of the stages no other stage reads (their inputs bring in all the others),
    and any per-simulation file to regenerate."""
    read = {name for stage in STAGES for name in stage.upstream}
    return [
        str(path) for stage in STAGES if stage.name not in read for path in stage.all_outputs(RUN, config)
    ] + missing_simulation_files()


SWEEP_CSV = str(RUN.sweep(config["sweep"]["name"]).table)


def sweep_threads():
    """Cores of the trials running at once on this machine (one core when they go to Slurm)."""
    sweep = config["sweep"]
    if config["parsl"]["provider"] != "local":
        return 1
    return sweep["concurrent"] * sweep["ranks"] * sweep["threads"]
