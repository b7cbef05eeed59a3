"""CosmoFlow pipeline (Mathuriya et al. 2018, arXiv:1808.04728), as a Snakemake workflow.

Stages, in order: sample_parameters -> initial_conditions -> simulate -> histogram ->
write_tfrecords -> manifest -> stage -> train -> analyze. Each rule runs one
`cosmoflow <stage>` command; the stage code lives in the Python packages. See README.md.

    snakemake                                   # whole pipeline, tiny default config
    snakemake --configfile config/paper.yaml -n # plan the paper preset
    snakemake --until sample_parameters         # one stage and what it needs
"""

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/sampling.smk"
include: "workflow/rules/simulations.smk"
include: "workflow/rules/preprocessing.smk"
include: "workflow/rules/staging.smk"
include: "workflow/rules/training.smk"
include: "workflow/rules/analysis.smk"
include: "workflow/rules/one_simulation.smk"
include: "workflow/rules/sweep.smk"


rule all:
    """Default target: every stage's results, up to the analysis report."""
    input:
        final_targets(),
        sweep_targets(),
    default_target: True
