"""CosmoFlow pipeline (Mathuriya et al. 2018, arXiv:1808.04728), as a Snakemake workflow.

One rule per stage of the stage table (workflow/stages.py), in its order, each running one
`cosmoflow <stage>` command; the stage code lives in the Python packages. See README.md.

    snakemake                                   # whole pipeline, tiny default config
    snakemake --configfile config/paper.yaml -n # plan the paper preset
    snakemake --until histogram                 # one stage and what it needs
"""

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/stages.smk"
include: "workflow/rules/fisher_companion.smk"
include: "workflow/rules/one_simulation.smk"
include: "workflow/rules/sweep.smk"


# The default target: every stage's results, up to the analysis report, and the sweep's table
# when the sweep is enabled.
rule all:
    default_target: True
    input:
        final_targets(),
        [SWEEP_CSV] if config["sweep"]["enabled"] else [],
