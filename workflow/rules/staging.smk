rule stage:
    """Copy the TFRecords where training reads them (or plan the in-job copy), verified by sha256."""
    input:
        str(RUN.manifest),
    output:
        stage_outputs("stage"),
    params:
        **stage_params("stage"),
    resources:
        **stage_resources("stage"),
    log:
        str(RUN.log("stage")),
    benchmark:
        str(RUN.benchmark("stage"))
    shell:
        stage_command("stage")
