"""The ``cosmoflow`` command: one subcommand per pipeline stage.

Snakemake rules run these same subcommands (the rules stay thin), so ``cosmoflow <stage>``
reruns one stage by hand exactly as the workflow would. Every subcommand validates the
configuration before any work starts. Exit status: 0 on success, 1 on an error (one sentence on
stderr; ``--debug`` shows the traceback), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
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


def cmd_simulation_stage(args: argparse.Namespace) -> None:
    from simulations.ensemble import run_stage

    config = load_config(args.config)
    run_stage(args.stage, config, batch=args.batch, sim_ids=args.sim_id, force=args.force)


def cmd_histogram(args: argparse.Namespace) -> None:
    from preprocessing.dataset import run_histograms

    run_histograms(load_config(args.config), batch=args.batch, sim_ids=args.sim_id, force=args.force)


def cmd_write_tfrecords(args: argparse.Namespace) -> None:
    from preprocessing.dataset import write_tfrecords_shard

    write_tfrecords_shard(load_config(args.config), args.split, args.shard)


def cmd_manifest(args: argparse.Namespace) -> None:
    from preprocessing.dataset import write_manifest

    write_manifest(load_config(args.config))


def cmd_stage(args: argparse.Namespace) -> None:
    from preprocessing import staging

    config = load_config(args.config)
    if args.plan:
        print(staging.format_plan(staging.staging_plan(config, nodes=args.nodes, mb_per_s=args.mb_per_s)))
    else:
        staging.run_stage(config)


def cmd_train(args: argparse.Namespace) -> None:
    from training.stage import run_training_stage

    run_training_stage(load_config(args.config))


def cmd_verify_data(args: argparse.Namespace) -> None:
    from preprocessing.tfrecords import verify_data

    problems = verify_data(args.run_dir)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        raise PipelineError(f"{len(problems)} problem(s) found in the data set of {args.run_dir}")
    print(f"{args.run_dir}: every TFRecord file matches tfrecords/manifest.json")


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG_PATH), metavar="PATH",
        help=f"configuration file (default: {DEFAULT_CONFIG_PATH})",
    )


def _add_selection_options(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--batch", type=int, metavar="B", help="every simulation of batch B (params.csv)")
    which.add_argument("--sim-id", type=int, nargs="+", metavar="ID", help="these simulations only")
    parser.add_argument(
        "--force", action="store_true",
        help="redo simulations whose outputs are already up to date (same inputs and code version)",
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

    for name, stage, what in [
        ("initial-conditions", "initial_conditions", "2LPT initial conditions -> sims/<sim_id>/ic.h5, music.conf"),
        ("simulate", "simulate", "COLA N-body simulations -> sims/<sim_id>/snapshot.h5"),
    ]:
        parser_ = add_stage(name, what)
        _add_config_option(parser_)
        _add_selection_options(parser_)
        parser_.set_defaults(handler=cmd_simulation_stage, stage=stage)

    histogram = add_stage("histogram", "density histograms of the snapshots -> histograms/<sim_id>.h5")
    _add_config_option(histogram)
    _add_selection_options(histogram)
    histogram.set_defaults(handler=cmd_histogram)

    tfrecords = add_stage("write-tfrecords", "sub-volumes of one shard of one split -> tfrecords/<split>/")
    _add_config_option(tfrecords)
    tfrecords.add_argument("--split", required=True, choices=["train", "val", "test"])
    tfrecords.add_argument("--shard", required=True, type=int, metavar="K", help="shard number (0-based)")
    tfrecords.set_defaults(handler=cmd_write_tfrecords)

    manifest = add_stage("manifest", "merge the shard summaries -> tfrecords/manifest.json")
    _add_config_option(manifest)
    manifest.set_defaults(handler=cmd_manifest)

    stage = add_stage("stage", "copy and verify the TFRecords where training reads them -> staged/staged.json")
    _add_config_option(stage)
    stage.add_argument("--plan", action="store_true",
                       help="print data volume and staging time per node instead of staging")
    stage.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes of the training job (with --plan)")
    stage.add_argument("--mb-per-s", type=float, default=None, metavar="X",
                       help="read bandwidth per node in MB/s (with --plan; default: "
                       "staging.required_mb_per_s_per_node)")
    stage.set_defaults(handler=cmd_stage)

    train = add_stage("train", "train the network on the staged data -> training/ "
                      "(one process per MPI rank: mpiexec -n N cosmoflow train ...)")
    _add_config_option(train)
    train.set_defaults(handler=cmd_train)

    verify = add_stage("verify-data", "check every TFRecord's CRC, parse, count and sha256 against the manifest")
    verify.add_argument("run_dir", metavar="RUN_DIR")
    verify.set_defaults(handler=cmd_verify_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter
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
