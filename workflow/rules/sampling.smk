rule sample_parameters:
    """Sample (Omega_m, sigma_8, n_s[, h]) over the configured design; seeds and splits."""
    output:
        stage_outputs("sample_parameters"),
    params:
        **stage_params("sample_parameters"),
    log:
        str(RUN.log("sample_parameters")),
    benchmark:
        str(RUN.benchmark("sample_parameters"))
    shell:
        stage_command("sample_parameters")
