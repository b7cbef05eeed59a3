rule train:
    """Synchronous data-parallel training over MPI on the staged data set (training/)."""
    input:
        str(RUN.staged_record),
    output:
        str(RUN.training / "model.keras"),
        str(RUN.training / "run.json"),
    params:
        training=config["training"],
    threads: training_cores(config)
    resources:
        tasks=config["training"]["ranks"],
        nodes=config["training"]["nodes"],
        cpus_per_task=max(1, config["training"]["threads"]),
        mpi="mpiexec",
        mem_mb=training_memory_mb(config),
        runtime=training_runtime_min(config),
        slurm_extra=burst_buffer_sbatch_options(config),
    log:
        str(RUN.log("train")),
    benchmark:
        str(RUN.benchmark("train"))
    shell:
        f"{{resources.mpi}} -n {{resources.tasks}} cosmoflow train --config {RUN_CONFIG} > {{log}} 2>&1"
