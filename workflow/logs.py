"""Logging set-up, done once at each entry point (CLI, Parsl apps); modules use getLogger.

A job started by a Snakemake rule writes its full record to the rule's log file and only its
progress (records logged with ``extra=PROGRESS``: a simulation done, an epoch, a file written)
and its warnings to the console, so that ``snakemake`` shows live progress without every
detail. By hand (no log file) everything goes to the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile

from workflow.process import PROCESS_ENVIRONMENT

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
CONSOLE_FORMAT = "%(asctime)s %(message)s"
PROGRESS = {"progress": True}
"""``log.info(..., extra=PROGRESS)``: a line for the console as well as the log file."""
FILE_ONLY = {"file_only": True}
"""``log.error(..., extra=FILE_ONLY)``: for the log file only (the console got it otherwise)."""
TF_LOG_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
QUIET_TF_LOG_LEVEL = PROCESS_ENVIRONMENT[TF_LOG_VARIABLE]


def configure_logging(level: str = "INFO", log_file: str | os.PathLike | None = None) -> None:
    """Log records at ``level`` and above to ``log_file`` (appended; several MPI ranks may share
    it) and progress lines and warnings to stderr; without a log file, everything to stderr."""
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(lambda r: not getattr(r, "file_only", False))
    root = logging.getLogger()
    if log_file is None:
        console.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        root.handlers[:] = [console]
    else:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        record = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        record.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        console.setFormatter(logging.Formatter(CONSOLE_FORMAT, datefmt="%H:%M:%S"))
        console.addFilter(lambda r: r.levelno >= logging.WARNING or getattr(r, "progress", False))
        root.handlers[:] = [record, console]
    root.setLevel(level.upper())


def quiet_tensorflow() -> None:
    """Keep TensorFlow's C++ start-up messages out of the console, unless the user asked for
    them by exporting TF_CPP_MIN_LOG_LEVEL (0 shows everything).

    With TF_CPP_MIN_LOG_LEVEL at 3, as :func:`workflow.process.configure_process` sets it
    unless the user exported another level, imports TensorFlow with the process's stderr
    redirected: the lines it prints while loading, before its logging is initialised, go to
    the log at DEBUG level, or to stderr if the import fails.
    """
    if os.environ.get(TF_LOG_VARIABLE) != QUIET_TF_LOG_LEVEL or "tensorflow" in sys.modules:
        return
    with tempfile.TemporaryFile(mode="w+b") as captured, _stderr_to(captured):
        try:
            import tensorflow  # noqa: F401
        finally:
            sys.stderr.flush()
            captured.seek(0)
            text = captured.read().decode(errors="replace")
    logging.getLogger(__name__).debug("TensorFlow's start-up messages:\n%s", text.rstrip())


@contextlib.contextmanager
def _stderr_to(file):
    """File descriptor 2 goes to ``file`` inside the block; on an exception the captured text
    is written back to the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    except BaseException:
        os.dup2(saved, 2)
        file.seek(0)
        sys.stderr.write(file.read().decode(errors="replace"))
        raise
    finally:
        os.dup2(saved, 2)
        os.close(saved)
