"""Snakemake's locks after a killed run.

Snakemake records the files a run is making in ``.snakemake/locks/`` and removes the record when
the run ends. A run killed with SIGKILL (``kill -9``, the OOM killer, a lost node) cannot, and
Snakemake then refuses every later run of the directory until ``snakemake --unlock``. So every
run of this workflow, and every ``cosmoflow`` job that a run started in its directory, holds a
shared OS lock (``flock``) on ``.snakemake/cosmoflow.lock`` for as long as its process lives;
the kernel drops it however the process ends. A run that can take the lock exclusively knows
that no other run of this workflow, nor any job of one, is alive in the directory: Snakemake's
locks there are stale, and it removes them before Snakemake looks at them. While a killed run's
jobs still run, its locks stay, and Snakemake refuses to start them a second time.

On a cluster file system the lock is only as good as its ``flock`` (Lustre mounted with
``flock`` is coherent across nodes; ``localflock`` is not): after killing the driver of a Slurm
run, cancel its jobs (``squeue --me``, ``scancel``) before running it again.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

LOCK_FILE = "cosmoflow.lock"
_HELD = []  # this process's open lock file: its shared lock lasts until the process exits


def release_stale_locks(directory: str | Path = ".snakemake") -> list[Path]:
    """Remove Snakemake's locks in ``directory`` if no run or job of this workflow holds the
    lock, then hold it shared for the rest of this process; return the lock files removed."""
    directory = Path(directory)
    directory.mkdir(exist_ok=True)
    handle = open(directory / LOCK_FILE, "a")  # noqa: SIM115 (held until exit)
    stale = []
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a run or a job of one is alive (or the file system has no flock)
        pass
    else:
        stale = sorted((directory / "locks").glob("*.lock"))
        for path in stale:
            path.unlink(missing_ok=True)
    _hold_shared(handle)
    return stale


def hold_run_lock(directory: str | Path = ".snakemake") -> None:
    """A job started by a run in ``directory``'s parent holds the run's lock shared while it
    lives, so that its run's locks outlive a kill of the run itself (nothing elsewhere)."""
    path = Path(directory) / LOCK_FILE
    if path.is_file():
        _hold_shared(open(path, "a"))  # noqa: SIM115 (held until exit)


def _hold_shared(handle) -> None:
    try:
        fcntl.flock(handle, fcntl.LOCK_SH)  # waits out another run's brief exclusive clean-up
    except OSError:  # no flock on this file system: nothing to hold
        handle.close()
        return
    _HELD.append(handle)
