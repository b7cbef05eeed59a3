"""Run a command that receives SIGTERM when the process that started it dies (Linux).

    python -m workflow.parsl.guard COMMAND [ARGS...]

Parsl starts its interchange as a child of the driver (``cosmoflow ensemble`` or ``sweep``) and
nothing ends it if the driver is killed with SIGKILL; its worker pools, still hearing from it,
would then wait for work forever. Started through this module (the executors'
``interchange_launch_cmd``), the interchange ends with the driver, and the worker pools stop
after Parsl's heartbeat threshold. Trials started by workers use :func:`die_with_parent` too.
Elsewhere than Linux the command simply runs.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel for SIGTERM when this process's parent dies (a no-op off Linux); exit at
    once if the parent is already gone."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m workflow.parsl.guard COMMAND [ARGS...]")
    die_with_parent()  # kept across exec
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
