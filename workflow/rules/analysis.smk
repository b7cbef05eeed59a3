rule analyze:
    """Evaluate the network and the baselines on the test split, validate the simulations, report."""
    input:
        stage_outputs("train"),
        str(RUN.manifest),
        str(RUN.params_csv),
        batch_summaries("histogram"),
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
