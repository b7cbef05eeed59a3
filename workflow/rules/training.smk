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


rule train_fraction:
    """One point of the learning curve (analysis.learning_curve): the train stage again, on the
    first `fraction` of the training simulations (training.train_fraction), into its own
    directory learning_curve/train_<fraction>/."""
    input:
        str(RUN.staged_record),
    output:
        learning_curve_outputs("{fraction}"),
    params:
        **stage_params("train"),
    threads: stage_threads("train")
    resources:
        **stage_resources("train"),
    log:
        str(RUN.log("train", "train_{fraction}")),
    benchmark:
        str(RUN.benchmark("train", "train_{fraction}"))
    shell:
        stage_command("train", learning_curve_selection())
