TRANSFER_TABLE = [config["cosmology"]["transfer_table"]] if config["cosmology"]["transfer"] == "table" else []


rule initial_conditions:
    """2LPT initial conditions (ours, or the real MUSIC) for one batch of simulations."""
    input:
        str(RUN.params_csv),
        TRANSFER_TABLE,
    output:
        stage_outputs("initial_conditions", batch="{batch}"),
    params:
        **stage_params("initial_conditions"),
    threads: stage_threads("initial_conditions")
    resources:
        **stage_resources("initial_conditions"),
    log:
        str(RUN.log("initial_conditions", "{batch}")),
    benchmark:
        str(RUN.benchmark("initial_conditions", "{batch}"))
    shell:
        stage_command("initial_conditions", " --batch {wildcards.batch}")


rule simulate:
    """COLA N-body simulations of one batch, snapshots at every configured redshift."""
    input:
        str(RUN.batch_summary("initial_conditions", "{batch}")),
    output:
        stage_outputs("simulate", batch="{batch}"),
    params:
        **stage_params("simulate"),
    threads: stage_threads("simulate")
    resources:
        **stage_resources("simulate"),
    log:
        str(RUN.log("simulate", "{batch}")),
    benchmark:
        str(RUN.benchmark("simulate", "{batch}"))
    shell:
        stage_command("simulate", " --batch {wildcards.batch}")
