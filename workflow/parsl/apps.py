"""What Parsl workers run: one unit of a stage (the ensemble) and one training trial (a sweep).

These functions are shipped to the workers by reference, so they import only what they need,
when they run. Both write their log where the Snakemake rule of the same job writes its own
(``logs/<rule>/<unit>.log``; a trial's beside its outputs), appending one header per attempt.

A unit decides on the worker whether it has anything to do, as Snakemake decides for a job: it
runs when it is forced, when a unit it depends on ran, or when its outputs are missing, older
than its inputs or made from other settings. "Made from other settings" is read from what each
output records: every simulation's HDF5 file holds its provenance (workflow.batch), and the run
and shard jobs that this module ran have a record under ``parsl/jobs/`` (their settings, the
code version and the outputs' mtimes). Outputs that Snakemake made have no such record; like
Snakemake with outputs it did not make, they count as current when newer than their inputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path


def run_unit(stage_name: str, root: str, config: dict, selection: dict, log_name: str | None,
             marker: str, force: bool, inputs: list = ()) -> dict:
    """Run one unit of stage ``stage_name`` in the run directory ``root`` unless it is current.

    ``config``: the validated configuration; the job sees only the stage's slice of it (the
    whole of it serves to make again an intermediate that was not kept, as the CLI does);
    ``selection``: the unit (``{}``, ``{"batch": b}`` or ``{"split": s, "shard": k}``);
    ``log_name``: the unit's name in ``logs/<rule>/``; ``marker``: see :func:`holding`;
    ``inputs``: the results of the units it depends on (Parsl passes them once they are done),
    each ``{"ran": bool, "outputs": [...]}``. Returns ``{"ran", "seconds", "outputs"}``.
    """
    from workflow.io import atomic_write_text, remove_stale_temporaries
    from workflow.paths import RunLayout
    from workflow.stages import STAGE, run_stage

    stage = STAGE[stage_name]
    run = RunLayout(Path(root))
    sliced = stage.config_slice(config)
    outputs = [Path(p) for p in stage.outputs(run, **selection)]
    names = [str(p) for p in outputs]
    upstream_outputs = [Path(p) for result in inputs for p in result["outputs"]]
    record = run.parsl_job_record(stage.name, log_name)
    if not force and not any(result["ran"] for result in inputs) and unit_is_current(
            stage, run, sliced, selection, upstream_outputs, outputs, record, stage.keeps(config)):
        # the record is not written again, which would have removed the temporary file of a
        # driver killed while writing it
        remove_stale_temporaries(record)
        return {"ran": False, "seconds": 0.0, "outputs": names}
    with holding(marker), job_log(run.log(stage.name, log_name), f"{stage.name} {selection or ''}".strip()):
        started = time.perf_counter()
        run_stage(stage, run, sliced, **stage.unit.job_selection(selection, run, config))
        seconds = time.perf_counter() - started
    if stage.per_simulation is None:  # a batch's files record their provenance themselves
        made = _record(stage, sliced.as_declared(), outputs)
        atomic_write_text(record, json.dumps(made, indent=1, sort_keys=True) + "\n")
    return {"ran": True, "seconds": seconds, "outputs": names}


def unit_is_current(stage, run, config, selection: dict, inputs: list[Path], outputs: list[Path],
                    record: Path, kept: bool = True) -> bool:
    """Whether one unit's outputs exist, are at least as new as ``inputs`` and were made from
    ``config``, the stage's slice (see the module docstring). ``kept``: whether a batch stage's
    per-simulation files stay on disk; one that was not kept (deleted once the next stage used
    it) counts as current when the batch summary records it made from these settings."""
    from workflow.batch import batch_tasks

    try:
        oldest = min(path.stat().st_mtime_ns for path in outputs)
    except FileNotFoundError:
        return False
    if any(path.exists() and path.stat().st_mtime_ns > oldest for path in inputs):
        return False
    if stage.per_simulation is not None:
        try:
            summary = json.loads(outputs[0].read_text(encoding="utf-8"))
            made = {entry["sim_id"]: entry.get("provenance") for entry in summary["simulations"]}
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all(current or not (kept or task.output.exists()) and made.get(sim.sim_id) == expected
                   for sim, task, expected, current in batch_tasks(stage, stage.job, run, config,
                                                                      selection["batch"]))
    if not record.exists():  # made by Snakemake (or by hand): current when newer than its inputs
        return True
    try:
        made = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return made == _record(stage, config.as_declared(), outputs)


def _record(stage, declared: dict, outputs: list[Path]) -> dict:
    """A run or shard job's record (``parsl/jobs/``), as read back from its JSON."""
    from workflow.version import CODE_VERSION

    return json.loads(json.dumps({
        "stage": stage.name, "params": stage.params(declared), "code_version": CODE_VERSION,
        "outputs": {str(path): path.stat().st_mtime_ns for path in outputs},
    }, sort_keys=True))


@contextlib.contextmanager
def holding(marker: str):
    """``marker``, a file that exists while the job runs (the console's "running" count)."""
    path = Path(marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def job_log(path: Path, what: str):
    """Log records of the job (INFO and above) appended to ``path``, after a header line."""
    from workflow.logs import FORMAT

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        handler.stream.write(f"=== cosmoflow (parsl): {what} on {socket.gethostname()}, pid {os.getpid()}, "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        yield
    except Exception:
        logging.getLogger("workflow.parsl").exception("%s failed", what)
        raise
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def run_trial(name: str, command: list[str], trial_dir: str, fingerprint: str, launch: list[str], marker: str,
              parsl_resource_specification: dict | None = None) -> dict:
    """Run one sweep trial, ``$PARSL_MPI_PREFIX`` + ``command`` + ``launch`` (``cosmoflow train
    ... --output-dir trial_dir``), and return its result: validation loss, validation MSE over
    the training-mean baseline's (run.json ``validation``) and seconds.

    Parsl's memoizer hashes ``name``, ``command``, ``trial_dir`` and ``fingerprint`` (the data
    and settings a trial starts from): a change in any reruns the trial. ``launch`` (options
    that change how it runs, e.g. threads), ``marker`` (see :func:`holding`) and the
    resource specification (set by the MPIExecutor) are left out of the hash. Raises
    PipelineError naming the trial and its log when the training fails.
    """
    import fcntl
    import shlex

    from workflow.errors import PipelineError
    from workflow.parsl.guard import die_with_parent
    from workflow.paths import TrialFiles

    files = TrialFiles(Path(trial_dir))
    files.directory.mkdir(parents=True, exist_ok=True)
    command = shlex.split(os.environ.get("PARSL_MPI_PREFIX", "")) + list(command) + list(launch)
    started = time.perf_counter()
    # one training at a time in a directory: a trial left by a killed driver may still be
    # running here; this attempt waits for it (the lock is released when the worker and the
    # launcher that hold it are gone)
    with holding(marker), open(files.lock, "w") as lock, open(files.log, "a", encoding="utf-8") as out:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out.write(f"=== cosmoflow (parsl): trial {name} on {socket.gethostname()}, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)}\n")
        out.flush()
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                              pass_fds=(lock.fileno(),), preexec_fn=die_with_parent).returncode
    seconds = time.perf_counter() - started
    if code != 0:
        raise PipelineError(f"trial {name} failed (exit status {code}); see {files.log}")
    record = json.loads(files.run_record.read_text(encoding="utf-8"))
    validation = record.get("validation") or {}
    history = record.get("history") or [{}]
    return {
        "trial": name,
        "val_loss": history[-1].get("val_loss"),
        "val_mse_over_baseline": validation.get("mean_ratio"),
        "ratios": {key: value["ratio"] for key, value in validation.get("parameters", {}).items()},
        "seconds": round(seconds, 3),
    }
