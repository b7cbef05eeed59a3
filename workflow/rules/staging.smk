rule stage:
    """Copy the TFRecords where training reads them (or plan the in-job copy), verified by sha256."""
    input:
        str(RUN.manifest),
    output:
        str(RUN.staged_record),
    params:
        staging=config["staging"],
    resources:
        runtime=staging_runtime_min(config),
    log:
        str(RUN.log("stage")),
    benchmark:
        str(RUN.benchmark("stage"))
    shell:
        f"cosmoflow stage --config {RUN_CONFIG} > {{log}} 2>&1"
