"""The workflow's code outside its rules: configuration, run-directory paths, the targets, and
what the rules take from the stage table (workflow/stages.py): params, threads, resources and
their `cosmoflow` command lines."""

import sys

from preprocessing.jobs import shard_batches
from workflow.config import (
    SPLITS, batch_sim_ids, dump_config, load_config, n_batches, run_directory, validate_config,
)
from workflow.io import atomic_write_text
from workflow.locks import release_stale_locks
from workflow.parsl.sweep import sweep_directory, sweep_params
from workflow.paths import RunLayout
from workflow.stages import STAGE, STAGES
from workflow.summary import closing_summary

# After a run killed with kill -9 the documented command alone recovers: a run that finds no
# other run of this workflow, nor a job of one, alive in the directory removes the locks the
# killed one left (workflow/locks.py), and the profile's rerun-incomplete redoes the jobs it
# was running.
if workflow.is_main_process:
    if stale_locks := release_stale_locks():
        print(f"Removed {len(stale_locks)} lock file(s) that a killed run left in .snakemake/locks",
              file=sys.stderr)

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


def stage_params(name):
    """The config keys the stage reads, by section: a changed value reruns its jobs."""
    return STAGE[name].params(config)


def stage_threads(name):
    return STAGE[name].resources(config).get("threads", 1)


def stage_resources(name):
    return {key: value for key, value in STAGE[name].resources(config).items() if key != "threads"}


def stage_command(name, selection=""):
    """The shell line of a job of stage `name`: `cosmoflow <command>` on the run's config, its
    full record to the rule's log file, its progress lines to the console."""
    stage = STAGE[name]
    launch = "{resources.mpi} -n {resources.tasks} " if stage.mpi else ""
    return f"{launch}cosmoflow {stage.command} --config {RUN_CONFIG}{selection} --log-file {{log}}"


def stage_outputs(name, **selection):
    """What one job of stage `name` writes last (wildcard patterns for `selection`)."""
    return [str(path) for path in STAGE[name].outputs(RUN, **selection)]


def learning_curve_outputs(fraction):
    """What one learning-curve training writes last (as rule train, in its own directory)."""
    return [str(RUN.learning_curve(fraction) / path.name) for path in STAGE["train"].outputs(RUN)]


def learning_curve_selection():
    """The train command's options for one learning-curve point: the fraction, the directory."""
    return (" --set training.train_fraction={wildcards.fraction} --output-dir "
            + str(RUN.learning_curve("{wildcards.fraction}")))


def analysis_extra_inputs():
    """What analyze reads besides the main training: the learning-curve trainings
    (analysis.learning_curve) and the Fisher companion's data set (analysis.fisher_companion,
    made by its own run: snakemake --configfile <its config> --until manifest)."""
    section = config["analysis"]
    paths = [path for fraction in section["learning_curve"]
             for path in learning_curve_outputs(f"{fraction:g}")]
    if section["fisher_companion"]:
        paths += companion_outputs()
    return paths


def companion_outputs():
    """The Fisher companion run's data set (analysis.fisher_companion names its config)."""
    companion = RunLayout(run_directory(load_config(config["analysis"]["fisher_companion"])))
    return [str(companion.manifest), str(companion.params_csv)]


def batch_summaries(name, batches=BATCHES):
    return [str(RUN.batch_summary(name, batch)) for batch in batches]


SHARD_BATCHES = shard_batches(config)
SHARD_SUMMARIES = [path for split, shard in SHARD_BATCHES
                   for path in stage_outputs("write_tfrecords", split=split, shard=shard)]


def missing_simulation_files():
    """Per-simulation files of finished batches that have gone missing since (deleted by hand,
    lost): the one-simulation rules (`<stage>_one`) regenerate each alone, bit for bit. Files
    the configuration does not keep (simulation.keep_initial_conditions, keep_snapshots) are
    not missed."""
    missing = []
    for stage in STAGES:
        if stage.unit != "batch" or not stage.keeps(config):
            continue
        for batch in BATCHES:
            if RUN.batch_summary(stage.name, batch).exists():
                paths = (stage.per_simulation(RUN, sim_id) for sim_id in batch_sim_ids(config, batch))
                missing += [str(path) for path in paths if not path.exists()]
    return missing


def final_targets():
    """The outputs of every stage run once per run, and any per-simulation file to regenerate."""
    return [path for stage in STAGES if stage.unit == "run" for path in stage_outputs(stage.name)] + (
        missing_simulation_files())


SWEEP_CSV = str(sweep_directory(RUN, config) / "sweep.csv")


def sweep_targets():
    """sweeps/<name>/sweep.csv when the sweep is enabled, else nothing."""
    return [SWEEP_CSV] if config["sweep"]["enabled"] else []


def sweep_threads():
    """Cores of the trials running at once on this machine (one core when they go to Slurm)."""
    sweep = config["sweep"]
    if config["parsl"]["provider"] != "local":
        return 1
    return sweep["concurrent"] * sweep["ranks"] * sweep["threads"]
