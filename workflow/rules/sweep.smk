"""Rule sweep: the hyperparameter sweep (workflow/parsl/sweep.py), part of `all` when the config's
sweep.enabled is true. Its trials run through Parsl (config section parsl): on this machine by
default, or as Slurm blocks of their own with parsl.provider: slurm."""

from workflow.parsl.sweep import sweep_directory, sweep_params

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


rule sweep:
    """Short trainings over the sweep's space on the staged data set; sweep.csv names the best."""
    input:
        str(RUN.staged_record),
    output:
        SWEEP_CSV,
    params:
        **sweep_params(config),
    threads: sweep_threads()
    log:
        str(RUN.log("sweep", config["sweep"]["name"])),
    shell:
        f"cosmoflow sweep --config {RUN_CONFIG} > {{log}} 2>&1"
