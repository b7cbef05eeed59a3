rule train:
    """Synchronous data-parallel training over MPI on the staged data set (training/)."""
    input:
        str(RUN.staged_record),
    output:
        stage_outputs("train"),
    params:
        **stage_params("train"),
    threads: stage_threads("train")
    resources:
        **stage_resources("train"),
    log:
        str(RUN.log("train")),
    benchmark:
        str(RUN.benchmark("train"))
    shell:
        stage_command("train")
