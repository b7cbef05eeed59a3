"""Parsl's interchange, ended with the driver that started it (Linux).

    cosmoflow-parsl-interchange        (console script: Parsl's ``interchange.py``, guarded)

Parsl starts its interchange as a child of the driver (``cosmoflow ensemble`` or ``sweep``) and
nothing ends it if the driver is killed with SIGKILL; its worker pools, still hearing from it,
would then wait for work forever. Started as this command (the executors'
``interchange_launch_cmd``), the interchange receives SIGTERM when the driver dies, and the
worker pools stop after Parsl's heartbeat threshold. Trials started by workers use
:func:`die_with_parent` too. Elsewhere than Linux the interchange simply runs.
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


INTERCHANGE = "interchange.py"  # Parsl's own command (its executors' default)


def interchange() -> None:
    """Exec Parsl's interchange (which reads its configuration from stdin), asking first for
    SIGTERM when the driver dies; the request is kept across exec."""
    die_with_parent()
    os.execvp(INTERCHANGE, [INTERCHANGE, *sys.argv[1:]])
