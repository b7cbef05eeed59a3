"""The ``cosmoflow`` command: one subcommand per pipeline stage.

Snakemake rules run these same subcommands (the rules stay thin), so ``cosmoflow <stage>``
reruns one stage by hand exactly as the workflow would. Every subcommand validates the
configuration before any work starts. Exit status: 0 on success, 1 on an error (one sentence on
stderr; ``--debug`` shows the traceback), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from workflow.config import DEFAULT_CONFIG_PATH, load_config, n_batches, run_directory
from workflow.errors import PipelineError
from workflow.logs import configure_logging
from workflow.paths import RunLayout
from workflow.version import CODE_VERSION

log = logging.getLogger("cosmoflow")


def cmd_validate_config(args: argparse.Namespace) -> None:
    config = load_config(args.config_file)
    sampling = config["sampling"]
    print(
        f"{args.config_file} is valid: run directory {run_directory(config)}, "
        f"{sampling['n_simulations']} simulations ({sampling['design']} over "
        f"{', '.join(sampling['parameters'])}) in {n_batches(config)} batches"
    )


def cmd_sample(args: argparse.Namespace) -> None:
    from simulations.sampling import sample_ensemble, write_params_csv

    config = load_config(args.config)
    sampling = config["sampling"]
    ensemble = sample_ensemble(
        n_simulations=sampling["n_simulations"],
        design=sampling["design"],
        parameters=sampling["parameters"],
        ranges=sampling["ranges"],
        splits=sampling["splits"],
        batch_size=config["simulation"]["batch_size"],
        master_seed=config["seed"],
        fiducial=sampling["fiducial"],
        derivative_steps=sampling["derivative_steps"],
    )
    write_params_csv(RunLayout(run_directory(config)).params_csv, ensemble)


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG_PATH), metavar="PATH",
        help=f"configuration file (default: {DEFAULT_CONFIG_PATH})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cosmoflow",
        description="CosmoFlow pipeline: simulation-based cosmology with deep learning. "
        "Each subcommand runs one stage; `snakemake` chains them all.",
    )
    parser.add_argument("--version", action="version", version=f"cosmoflow {CODE_VERSION}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    stages = parser.add_subparsers(dest="command", metavar="STAGE", required=True)

    def add_stage(name: str, help: str) -> argparse.ArgumentParser:
        return stages.add_parser(name, help=help, description=help, parents=[common])

    validate = add_stage("validate-config", "check a configuration file against the schema")
    validate.add_argument("config_file", metavar="CONFIG")
    validate.set_defaults(handler=cmd_validate_config)

    sample = add_stage("sample", "sample cosmological parameters -> params.csv")
    _add_config_option(sample)
    sample.set_defaults(handler=cmd_sample)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        args.handler(args)
    except (PipelineError, OSError) as error:
        if args.debug:
            raise
        print(f"cosmoflow {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
