rule initial_conditions:
    """2LPT initial conditions (ours, or the real MUSIC) for one batch of simulations."""
    input:
        str(RUN.params_csv),
        [config["cosmology"]["transfer_table"]] if config["cosmology"]["transfer"] == "table" else [],
    output:
        str(RUN.batch_summary("initial_conditions", "{batch}")),
    params:
        cosmology=config["cosmology"],
        initial_conditions=config["initial_conditions"],
        lattice=[config["simulation"]["n_particles"], config["simulation"]["box_size"]],
    threads: config["simulation"]["threads"]
    resources:
        mem_mb=job_memory_mb("initial_conditions", config),
        runtime=job_runtime_min("initial_conditions", config),
    log:
        str(RUN.log("initial_conditions", "{batch}")),
    benchmark:
        str(RUN.benchmark("initial_conditions", "{batch}"))
    shell:
        f"cosmoflow initial-conditions --config {RUN_CONFIG} --batch {{wildcards.batch}} > {{log}} 2>&1"


rule simulate:
    """COLA N-body simulations of one batch, snapshots at every configured redshift."""
    input:
        str(RUN.batch_summary("initial_conditions", "{batch}")),
    output:
        str(RUN.batch_summary("simulate", "{batch}")),
    params:
        simulation={k: v for k, v in config["simulation"].items() if k not in ("batch_size", "threads")},
    threads: config["simulation"]["threads"]
    resources:
        mem_mb=job_memory_mb("simulate", config),
        runtime=job_runtime_min("simulate", config),
    log:
        str(RUN.log("simulate", "{batch}")),
    benchmark:
        str(RUN.benchmark("simulate", "{batch}"))
    shell:
        f"cosmoflow simulate --config {RUN_CONFIG} --batch {{wildcards.batch}} > {{log}} 2>&1"
