# One rule per row of the stage table (workflow/stages.py), written in this one loop: a stage's
# rule reads the outputs of the upstream units its table row names, writes its outputs, and
# runs `cosmoflow <command>` on one unit (its wildcards as the command's options). Its params
# are the configuration keys the stage reads, so changing one reruns exactly those stages.

for stage in STAGES:

    rule:
        name:
            stage.name
        input:
            unit_inputs(stage),
        output:
            stage_outputs(stage),
        log:
            str(RUN.log(stage.name, stage.unit.log_name(stage.unit.patterns()))),
        benchmark:
            str(RUN.benchmark(stage.name, stage.unit.log_name(stage.unit.patterns())))
        threads: stage.resources(config).get("threads", 1)
        resources:
            **{key: value for key, value in stage.resources(config).items() if key != "threads"},
        params:
            **stage.params(config),
            command=stage_command(stage),
        shell:
            "{params.command} --log-file {log}"
