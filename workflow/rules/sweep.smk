"""Rule sweep: the hyperparameter sweep (workflow/parsl/sweep.py), part of `all` when the config's
sweep.enabled is true. Its trials run through Parsl (config section parsl): on this machine by
default, or as Slurm blocks of their own with parsl.provider: slurm."""


rule sweep:
    """Short trainings over the sweep's space on the staged data set; sweep.csv names the best."""
    input:
        str(RUN.staged_record),
    output:
        SWEEP_CSV,
    log:
        str(RUN.log("sweep", config["sweep"]["name"])),
    threads: sweep_threads()
    params:
        **sweep_params(config),
    shell:
        f"cosmoflow sweep --config {RUN_CONFIG} > {{log}} 2>&1"
