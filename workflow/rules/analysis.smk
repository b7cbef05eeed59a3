rule analyze:
    """Evaluate the network and the baselines on the test split, validate the simulations, report."""
    input:
        stage_outputs("train"),
        str(RUN.manifest),
        str(RUN.params_csv),
        batch_summaries("histogram"),
        analysis_extra_inputs(),
    output:
        report=report(stage_outputs("analyze")[0], caption="../report/analysis.rst", category="Analysis"),
        tables=stage_outputs("analyze")[1:],
        figures=report(
            directory(str(RUN.analysis / "figures")),
            patterns=["{name}.png"],
            caption="../report/figures.rst",
            category="Figures",
        ),
    params:
        **stage_params("analyze"),
    threads: stage_threads("analyze")
    log:
        str(RUN.log("analyze")),
    benchmark:
        str(RUN.benchmark("analyze"))
    shell:
        stage_command("analyze")


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
            companion_outputs(),
        params:
            snakefile=workflow.main_snakefile,
        threads: workflow.cores
        log:
            str(RUN.log("fisher_companion")),
        benchmark:
            str(RUN.benchmark("fisher_companion"))
        shell:
            "snakemake --snakefile {params.snakefile:q} --configfile {input:q} "
            "--until manifest --cores {threads} --nolock > {log:q} 2>&1"
