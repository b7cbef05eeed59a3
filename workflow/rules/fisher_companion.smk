if config["analysis"]["fisher_companion"]:

    rule fisher_companion:
        """The data set of the Fisher companion run (analysis.fisher_companion: a
        fiducial_derivatives configuration at this run's resolution): the pipeline on that
        configuration up to its manifest, in its own run directory. The one rule that runs
        Snakemake rather than a `cosmoflow` command: the companion is a whole run of its own,
        planned by its own configuration (--nolock: this run holds the lock of the files it
        waits for)."""
        input:
            config["analysis"]["fisher_companion"],
        output:
            [str(path) for path in fisher_companion_data(config)],
        log:
            str(RUN.log("fisher_companion")),
        benchmark:
            str(RUN.benchmark("fisher_companion"))
        threads: workflow.cores
        params:
            snakefile=workflow.main_snakefile,
            until=ENSEMBLE[-1].name,
        shell:
            "snakemake --snakefile {params.snakefile:q} --configfile {input:q} "
            "--until {params.until} --cores {threads} --nolock > {log:q} 2>&1"
