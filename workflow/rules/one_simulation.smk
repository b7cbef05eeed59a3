# One-simulation rules, `<stage>_one` for each batch stage: each makes one simulation's file
# (sims/<sim_id>/ic.h5, snapshot.h5, histograms/<sim_id>.h5) alone, bit for bit, from the
# upstream stages' files of that simulation (or their run-wide outputs, e.g. params.csv). A plain
# `snakemake` uses them for a file of a finished batch that went missing
# (missing_simulation_files); `snakemake <that file>` asks for one directly. Snakemake cannot
# list a batch job's per-simulation files as its outputs (a rule's outputs are fixed patterns of
# its wildcards), so these rules own them.

for stage in STAGES:
    if stage.per_simulation is None:
        continue

    rule:
        name:
            f"{stage.name}_one"
        input:
            simulation_inputs(stage),
        output:
            str(stage.per_simulation(RUN, "{sim_id}")),
        log:
            str(RUN.log(stage.name, "sim{sim_id}")),
        threads: stage.resources(config).get("threads", 1)
        params:
            **stage.params(config),
            command=stage_command(stage, " --sim-id {sim_id}"),
        shell:
            "{params.command} --log-file {log}"
