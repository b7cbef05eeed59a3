"""Non-rule code of the workflow: configuration checks, run-directory paths, targets."""

from snakemake.utils import validate

from preprocessing.dataset import shard_summaries, target_ranges
from preprocessing.staging import burst_buffer_sbatch_options, staging_runtime_min
from workflow.config import dump_config, n_batches, run_directory, validate_config
from workflow.io import atomic_write_text
from workflow.paths import RunLayout
from workflow.resources import (
    job_memory_mb, job_runtime_min, training_cores, training_memory_mb, training_runtime_min,
)

# One clear sentence per problem (key, value, what is allowed) and the schema's defaults,
# exactly as every `cosmoflow` entry point checks; then Snakemake's own schema validation.
CONFIG_SOURCE = " + ".join(
    [str(path) for path in workflow.configfiles] + ["--config"] * bool(workflow.config_settings.config)
)
config.update(validate_config(config, source=CONFIG_SOURCE))
validate(config, "../schemas/config.schema.yaml")

RUN = RunLayout(run_directory(config))
# Jobs read the configuration this invocation validated, so `--config KEY=VALUE` overrides
# reach them; the record is written when the run starts (not on dry runs).
RUN_CONFIG = str(RUN.config_record)


wildcard_constraints:
    batch=r"\d+",
    shard=r"\d{4}",
    split="train|val|test",


onstart:
    atomic_write_text(RUN.config_record, dump_config(config))


def batch_outputs(rule):
    return [str(RUN.batch_summary(rule, batch)) for batch in range(n_batches(config))]


def final_targets():
    """Outputs of the last stage implemented so far; grows as stages land."""
    return [str(RUN.params_csv), str(RUN.manifest), str(RUN.training / "run.json")]
