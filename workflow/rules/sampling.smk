rule sample_parameters:
    """Sample (Omega_m, sigma_8, n_s[, h]) over the configured design; seeds and splits."""
    output:
        str(RUN.params_csv),
    params:
        seed=config["seed"],
        sampling=config["sampling"],
        batch_size=config["simulation"]["batch_size"],
    log:
        str(RUN.log("sample_parameters")),
    benchmark:
        str(RUN.benchmark("sample_parameters"))
    shell:
        f"cosmoflow sample --config {RUN_CONFIG} > {{log}} 2>&1"
