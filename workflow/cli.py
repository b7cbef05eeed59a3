"""The ``cosmoflow`` command: one subcommand per pipeline stage, from workflow/stages.py.

Snakemake rules run these same subcommands (the rules stay thin), so ``cosmoflow <stage>``
reruns one stage by hand exactly as the workflow would. Every subcommand validates the
configuration (with any ``--set KEY=VALUE`` overrides) before any work starts. Exit status: 0 on
success, 1 on an error (one sentence on stderr; ``--debug`` shows the traceback), 2 on a usage
error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from workflow.config import DEFAULT_CONFIG_PATH, load_config, n_batches, run_directory
from workflow.errors import PipelineError
from workflow.locks import hold_run_lock
from workflow.logs import FILE_ONLY, configure_logging, quiet_tensorflow
from workflow.paths import RunLayout
from workflow.process import configure_process
from workflow.stages import STAGES, Stage, run_stage
from workflow.status import format_status, load_run, run_status
from workflow.version import CODE_VERSION

log = logging.getLogger("cosmoflow")


def cmd_validate_config(args: argparse.Namespace) -> None:
    config = load_config(args.config_file, args.set)
    sampling = config["sampling"]
    print(
        f"{args.config_file} is valid: run directory {run_directory(config)}, "
        f"{sampling['n_simulations']} simulations ({sampling['design']} over "
        f"{', '.join(sampling['parameters'])}) in {n_batches(config)} batches"
    )


def cmd_run_stage(args: argparse.Namespace) -> None:
    """Run one unit of ``args.stage`` (the selection options of its unit)."""
    stage: Stage = args.stage
    config = load_config(args.config, args.set)
    moved = {stage.output_dir: Path(args.output_dir)} if getattr(args, "output_dir", None) else {}
    run = RunLayout(run_directory(config), **moved)
    selection = stage.unit.from_arguments(args, run, config)
    if stage.tensorflow:
        quiet_tensorflow()
    hold_run_lock()  # started by a Snakemake run here: its locks stay while this job lives
    run_stage(stage, run, stage.config_slice(config), **selection)


def cmd_ensemble(args: argparse.Namespace) -> None:
    """The simulation ensemble to the manifest as Parsl apps (workflow/parsl/ensemble.py)."""
    config = load_config(args.config, args.set)
    if args.submit_script:
        from workflow.parsl.configs import ensemble_executor, submit_script

        executor = ensemble_executor(config)
        if config["parsl"]["provider"] != "slurm":
            raise PipelineError("--submit-script shows a Slurm block's script; set parsl.provider: slurm")
        print(submit_script(executor.provider, executor.launch_cmd), end="")
        return
    from workflow.parsl.ensemble import run_ensemble

    report = run_ensemble(config, until=args.until, forcerun=tuple(args.forcerun))
    print(f"cosmoflow ensemble: {report.summary()}")


def cmd_sweep(args: argparse.Namespace) -> None:
    """A hyperparameter sweep of training trials through Parsl (workflow/parsl/sweep.py)."""
    from workflow.parsl import sweep

    config = load_config(args.config, args.set)
    if args.list:
        for name, values in sweep.trials(config).items():
            print(name, " ".join(f"{key}={value}" for key, value in values.items()))
        return
    sweep.run_sweep(config)


def cmd_plan_staging(args: argparse.Namespace) -> None:
    """Data volume and staging time per node of the ``stage`` stage; nothing is staged."""
    from preprocessing.jobs import format_plan, staging_plan

    config = load_config(args.config, args.set)
    print(format_plan(staging_plan(config, nodes=args.nodes, mb_per_s=args.mb_per_s)))


def cmd_status(args: argparse.Namespace) -> None:
    """Where one run stands (workflow/status.py); runs nothing."""
    status = run_status(*load_run(args.run_dir, args.config, args.set))
    print(json.dumps(status, indent=2) if args.json else format_status(status))


def cmd_verify_data(args: argparse.Namespace) -> None:
    from preprocessing.jobs import verify_data

    quiet_tensorflow()
    problems = verify_data(args.run_dir)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        raise PipelineError(f"{len(problems)} problem(s) found in the data set of {args.run_dir}")
    print(f"{args.run_dir}: every TFRecord file matches tfrecords/manifest.json")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """--config PATH and --set KEY=VALUE, as every command that loads the configuration takes them."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG_PATH), metavar="PATH",
                        help=f"configuration file (default: {DEFAULT_CONFIG_PATH})")
    _add_set_option(parser)


def _add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a configuration key (dotted, e.g. training.learning_rate=1e-3; VALUE is "
        "YAML); validated like the file; repeatable",
    )


def _add_output_dir_option(parser: argparse.ArgumentParser, stage: Stage) -> None:
    if stage.output_dir:
        parser.add_argument("--output-dir", metavar="DIR",
                            help=f"write this stage's outputs to DIR instead of the run's "
                            f"{stage.output_dir.removesuffix('_dir')}/ (e.g. a sweep trial)")


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
    common.add_argument("--log-file", metavar="PATH",
                        help="write the full log to PATH (appended) and only progress lines and "
                        "warnings to the console, as the Snakemake rules do")
    commands = parser.add_subparsers(dest="command", metavar="STAGE", required=True)

    def add_command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, parents=[common])

    validate = add_command("validate-config", "check a configuration file against the schema")
    validate.add_argument("config_file", metavar="CONFIG")
    _add_set_option(validate)
    validate.set_defaults(handler=cmd_validate_config)

    for stage in STAGES:
        launch = (f" (one process per MPI rank: mpiexec -n N cosmoflow {stage.command} ...)"
                  if stage.mpi else "")
        sub = add_command(stage.command, stage.summary + launch)
        _add_config_options(sub)
        stage.unit.add_options(sub)
        _add_output_dir_option(sub, stage)
        sub.set_defaults(handler=cmd_run_stage, stage=stage)

    ensemble = add_command("ensemble", "the data set's stages, sampling to the manifest (and the "
                           "simulations' validation), as Parsl apps (config section parsl); skips "
                           "what is done, by Parsl or Snakemake")
    _add_config_options(ensemble)
    ensemble.add_argument("--until", metavar="RULE", help="stop after this stage (e.g. histogram)")
    ensemble.add_argument("--forcerun", nargs="+", default=[], metavar="RULE",
                          help="run these stages' jobs even when up to date (and what depends on them)")
    ensemble.add_argument("--submit-script", action="store_true",
                          help="print the sbatch script of one Slurm block (parsl.provider: slurm) and exit")
    ensemble.set_defaults(handler=cmd_ensemble)

    sweep = add_command("sweep", "hyperparameter sweep: training trials run concurrently through "
                        "Parsl (config section sweep) -> sweeps/<name>/sweep.csv")
    _add_config_options(sweep)
    sweep.add_argument("--list", action="store_true", help="print the trials and their values, run nothing")
    sweep.set_defaults(handler=cmd_sweep)

    plan = add_command("plan-staging", "data volume per node and staging time at a read bandwidth, "
                       "against staging.required_mb_per_s_per_node; stages nothing")
    _add_config_options(plan)
    plan.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes of the training job")
    plan.add_argument("--mb-per-s", type=float, default=None, metavar="X",
                      help="read bandwidth per node in MB/s (default: staging.required_mb_per_s_per_node)")
    plan.set_defaults(handler=cmd_plan_staging)

    status = add_command("status", "which stages of one run are done, the simulations missing, a live or "
                         "killed Snakemake run, the disk used and a failed log's end; runs nothing")
    status.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                        help="the run directory (its recorded config.yaml); default: the run of --config")
    status.add_argument("--config", metavar="PATH",
                        help=f"configuration file instead of RUN_DIR (default: {DEFAULT_CONFIG_PATH})")
    _add_set_option(status)
    status.add_argument("--json", action="store_true", help="print the same as one JSON object")
    status.set_defaults(handler=cmd_status)

    verify = add_command("verify-data",
                         "check every TFRecord's CRC, parse, count and sha256 against the manifest")
    verify.add_argument("run_dir", metavar="RUN_DIR")
    verify.set_defaults(handler=cmd_verify_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_process()  # before anything imports TensorFlow or numba
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_file)
    try:
        args.handler(args)
    except (PipelineError, OSError) as error:
        log.error("cosmoflow %s: error: %s", args.command, error, exc_info=True, extra=FILE_ONLY)
        if args.debug:
            raise
        print(f"cosmoflow {args.command}: error: {error}", file=sys.stderr)
        return 1
    except BaseException:
        log.exception("cosmoflow %s failed", args.command, extra=FILE_ONLY)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
