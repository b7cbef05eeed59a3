# One-simulation rules, `<stage>_one` for each batch stage: each makes one simulation's file
# (sims/<sim_id>/ic.h5, snapshot.h5, histograms/<sim_id>.h5) alone, bit for bit, from the file
# before it (or params.csv). A plain `snakemake` uses them for a file of a finished batch that
# went missing (missing_simulation_files); `snakemake <that file>` asks for one directly.
# Snakemake cannot list a batch job's per-simulation files as its outputs (a rule's outputs are
# fixed patterns of its wildcards), so these rules own them.

BATCH_STAGES = [stage for stage in STAGES if stage.unit == "batch"]

for stage, before in zip(BATCH_STAGES, [None] + BATCH_STAGES[:-1]):

    rule:
        name:
            f"{stage.name}_one"
        input:
            [str(before.per_simulation(RUN, "{sim_id}"))] if before else [str(RUN.params_csv), TRANSFER_TABLE],
        output:
            str(stage.per_simulation(RUN, "{sim_id}")),
        params:
            command=stage.command,  # the shell line is evaluated when the job runs, after the loop
            **stage_params(stage.name),
        threads: stage_threads(stage.name)
        log:
            str(RUN.log(stage.name, "sim{sim_id}")),
        shell:
            f"cosmoflow {{params.command}} --config {RUN_CONFIG} --sim-id {{wildcards.sim_id}} --log-file {{log}}"
