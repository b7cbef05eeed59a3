"""Snakemake's locks after a killed run.

Snakemake records the files a run is making in ``.snakemake/locks/`` and removes the record when
the run ends. A run killed with SIGKILL (``kill -9``, the OOM killer, a lost node) cannot, and
Snakemake then refuses every later run of the directory until ``snakemake --unlock``. So every
run of this workflow holds an OS lock (``flock``) on ``.snakemake/cosmoflow.lock`` for as long
as its process lives; the kernel drops it however the process ends. A run that gets the lock
knows that no other run of this workflow is alive in the directory: Snakemake's locks there are
stale, and it removes them before Snakemake looks at them.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

_HELD = []  # this process's open lock file: it stays locked until the process exits


def release_stale_locks(directory: str | Path = ".snakemake") -> list[Path]:
    """Hold the lock of live runs for the rest of this process and, if no other run held it,
    remove Snakemake's locks in ``directory``; return the lock files removed."""
    directory = Path(directory)
    directory.mkdir(exist_ok=True)
    handle = open(directory / "cosmoflow.lock", "a")  # noqa: SIM115 (held until exit)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another run is alive (or the file system has no flock): locks stay
        handle.close()
        return []
    _HELD.append(handle)
    stale = sorted((directory / "locks").glob("*.lock"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
