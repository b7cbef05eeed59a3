"""``cosmoflow status``: where one run directory stands, read from its files alone.

Nothing runs and no Snakemake DAG is built: per stage of the table (workflow/stages.py), the
units whose outputs exist (whether they are current is Snakemake's call: ``snakemake -n``); per
batch stage whose per-simulation files are kept, the simulations of its unfinished batches that
lack their file; whether a Snakemake run is alive in the working directory above the run or was
killed (workflow/locks.py); the disk the run uses; and the end of the newest log that ends with
an error (docs/run-directory.md names every path).
"""

from __future__ import annotations

import fcntl
import os
import re
from base64 import urlsafe_b64decode
from collections.abc import Mapping
from pathlib import Path

from workflow.config import DEFAULT_CONFIG_PATH, batch_sim_ids, load_config, run_directory
from workflow.errors import PipelineError
from workflow.locks import LOCK_FILE
from workflow.paths import RunLayout
from workflow.stages import STAGES, Stage

SHOWN_SIMS = 5  # sim_ids listed per stage in the table (the JSON lists all)
LOG_TAIL_BYTES = 16384  # read from the end of each log to find its last record
LOG_LINES = 6  # lines shown of a failed log
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (\w+) ", re.M)  # workflow.logs.FORMAT


def load_run(run_dir: str | None, config_path: str | None, overrides=()) -> tuple[RunLayout, dict]:
    """The run directory and its configuration: ``run_dir`` with the configuration its runs
    recorded (config.yaml), or the run directory of ``config_path`` (default
    config/config.yaml); ``overrides`` (``KEY=VALUE``) apply to either."""
    if run_dir and config_path:
        raise PipelineError("give a run directory or --config, not both")
    if run_dir:
        run = RunLayout(Path(run_dir))
    else:
        config = load_config(config_path or DEFAULT_CONFIG_PATH, overrides)
        run = RunLayout(run_directory(config))
    if not run.root.is_dir():
        raise PipelineError(f"run directory {run.root} not found")
    if run_dir:
        if not run.config_record.is_file():
            raise PipelineError(f"{run.config_record} not found (a snakemake run records it): give the "
                                "run's configuration with --config PATH")
        config = load_config(run.config_record, overrides)
    return run, config


def run_status(run: RunLayout, config: Mapping) -> dict:
    """The status of ``run`` made with ``config`` (the full configuration), as plain data."""
    return {"run_dir": str(run.root), "stages": [stage_status(stage, run, config) for stage in STAGES],
            "snakemake": snakemake_state(run.root), "disk": disk_usage(run.root),
            "failed_log": failed_log(run.logs)}


def stage_status(stage: Stage, run: RunLayout, config: Mapping) -> dict:
    """Units done of all (a unit is done when every output exists) and, for a batch stage whose
    files are kept, the sim_ids of its unfinished batches whose file is missing."""
    units = stage.unit.selections(stage, config)
    done = [all(path.is_file() for path in stage.outputs(run, **selection)) for selection in units]
    state = ("no units" if not units else "done" if all(done) else "partial" if any(done)
             else "not started")
    status = {"stage": stage.name, "state": state, "done": sum(done), "total": len(units)}
    if stage.per_simulation is not None and stage.keeps(config):
        status["missing_sims"] = [sim_id for selection, finished in zip(units, done) if not finished
                                  for sim_id in batch_sim_ids(config, selection["batch"])
                                  if not stage.per_simulation(run, sim_id).is_file()]
    return status


def snakemake_state(root: Path) -> dict:
    """Whether a Snakemake run (or a job of one) holds the workflow's lock in the working
    directory above ``root``, else whether a killed one left Snakemake's locks or incomplete
    markers of outputs inside ``root`` there (the next run removes the locks and, with the
    profile's rerun-incomplete, redoes those jobs)."""
    root = Path(root).resolve()
    workdir = next((parent for parent in root.parents if (parent / ".snakemake").is_dir()), None)
    if workdir is None:
        return {"workdir": None, "state": "no working directory", "locks": [], "incomplete": []}
    metadata = workdir / ".snakemake"
    locks = sorted(str(path) for path in (metadata / "locks").glob("*.lock"))
    incomplete = [str(path) for path in incomplete_outputs(metadata)
                  if (workdir / path).resolve().is_relative_to(root)]
    state = ("running" if lock_held(metadata / LOCK_FILE) else "killed" if locks or incomplete
             else "not running")
    return {"workdir": str(workdir), "state": state, "locks": locks, "incomplete": incomplete}


def lock_held(path: Path) -> bool:
    """Whether a live process holds ``path`` (workflow.locks): tried exclusively, let go at once."""
    try:
        with open(path) as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file (no run of this workflow here yet), or no flock on this file system
        pass
    return False


def incomplete_outputs(metadata: Path) -> list[Path]:
    """The outputs Snakemake marked as being made (``incomplete/``: each a file named by the
    path's urlsafe base64, cut into directories of ``@``-prefixed pieces), relative to the
    working directory."""
    paths = []
    for marker in (metadata / "incomplete").rglob("*"):
        if marker.is_file() and marker.name != "migration_underway":
            pieces = marker.relative_to(metadata / "incomplete").parts
            try:
                paths.append(Path(urlsafe_b64decode("".join(p.removeprefix("@") for p in pieces)).decode()))
            except ValueError:  # not a marker of this format
                continue
    return paths


def disk_usage(root: Path) -> dict:
    """Bytes on disk (allocated blocks, as ``du``) of the run and of each of its subdirectories
    (sims/, histograms/, tfrecords/, training/, ...), largest first."""
    with os.scandir(root) as listing:
        entries = [(entry, _bytes(entry)) for entry in listing]
    directories = sorted(((entry.name + "/", used) for entry, used in entries
                          if entry.is_dir(follow_symlinks=False)), key=lambda item: -item[1])
    return {"total_bytes": sum(used for _, used in entries), "directories": dict(directories)}


def _bytes(entry: os.DirEntry) -> int:
    used = entry.stat(follow_symlinks=False).st_blocks * 512
    if entry.is_dir(follow_symlinks=False):
        with os.scandir(entry.path) as listing:
            used += sum(_bytes(child) for child in listing)
    return used


def failed_log(logs: Path) -> dict | None:
    """The newest log under ``logs`` whose last record is an error, with its last lines."""
    for path in sorted(logs.rglob("*.log"), key=lambda path: path.stat().st_mtime, reverse=True):
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = handle.read().decode(errors="replace")
        levels = RECORD.findall(tail)
        if levels and levels[-1] in ("ERROR", "CRITICAL"):
            return {"path": str(path), "last_lines": tail.rstrip().splitlines()[-LOG_LINES:]}
    return None


def format_status(status: Mapping) -> str:
    """The status as a short table for a terminal."""
    lines = [f"Run {status['run_dir']}",
             f"  {'stage':<22} {'state':<12} {'units':^9}  missing simulations (sim_id)"]
    for row in status["stages"]:
        missing = row.get("missing_sims", [])
        named = " ".join(map(str, missing[:SHOWN_SIMS])) + " ..." * (len(missing) > SHOWN_SIMS)
        lines.append(f"  {row['stage']:<22} {row['state']:<12} {row['done']:>4}/{row['total']:<4}  "
                     + (f"{named} ({len(missing)})" if missing else ""))
    snakemake = status["snakemake"]
    where = f" in {snakemake['workdir']}" if snakemake["workdir"] else ""
    lines.append(f"Snakemake: {snakemake['state']}{where}")
    if snakemake["state"] == "killed":
        lines.append(f"  {len(snakemake['locks'])} lock file(s), {len(snakemake['incomplete'])} incomplete "
                     "output(s) of this run: the next snakemake run removes the locks and redoes them")
    disk = status["disk"]
    parts = ", ".join(f"{name} {_size(used)}" for name, used in list(disk["directories"].items())[:5])
    lines.append(f"Disk: {_size(disk['total_bytes'])} ({parts})")
    if status["failed_log"]:
        lines.append(f"Failed: {status['failed_log']['path']} ends with an error:")
        lines += [f"  | {line}" for line in status["failed_log"]["last_lines"]]
    return "\n".join(line.rstrip() for line in lines)


def _size(n_bytes: int) -> str:
    """``n_bytes`` in KiB, MiB or GiB (1024-based)."""
    for unit in ("KiB", "MiB", "GiB"):
        n_bytes /= 1024
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.1f} {unit}"
