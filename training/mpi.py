"""The MPI world of a training job, without TensorFlow: launch check, collective errors, abort.

* :func:`world_communicator` returns mpi4py's COMM_WORLD (or :class:`SerialCommunicator` for
  one process without mpi4py) and refuses N separate one-rank worlds started by a launcher
  that shares no process-management interface with the MPI library (``srun --mpi=none``).
* :func:`collectively` runs a set-up step on every rank and, if it raised PipelineError on
  any, raises it on all (:class:`AllRanksError`), so bad input ends every rank cleanly.
* :func:`abort_on_failure` ends every rank (``comm.Abort(1)``) when one rank raises anything
  else, so a failure cannot leave the others waiting forever in a collective.

Nothing here imports TensorFlow or Keras, so a job started the wrong way fails at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Iterator, TypeVar

import numpy as np

from workflow.errors import PipelineError

log = logging.getLogger(__name__)
T = TypeVar("T")

# MPI_Abort makes the launcher kill every rank at once, and what the failing rank wrote to stderr
# just before can still sit in the pipe to the launcher's forwarder and be lost (seen with MPICH's
# Hydra, `mpiexec -n 2`, in 1 run of 16 under load). Waiting this long before aborting lets it through.
ABORT_GRACE_S = 1.0


class SerialCommunicator:
    """The subset of an mpi4py communicator that training uses, for a single process."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Allreduce(self, sendbuf, recvbuf, op=None) -> None:
        np.copyto(recvbuf, sendbuf)

    def bcast(self, obj, root: int = 0):
        return obj

    def allgather(self, obj) -> list:
        return [obj]

    def Barrier(self) -> None:
        pass


def world_communicator(comm=None):
    """``comm`` itself, else mpi4py's COMM_WORLD, else a :class:`SerialCommunicator`."""
    if comm is not None:
        return comm
    try:
        from mpi4py import MPI
    except ImportError:
        world = SerialCommunicator()
    else:
        world = MPI.COMM_WORLD
    _check_launcher_agrees(world.Get_size())
    return world


# Variables in which launchers state the number of processes they started.
LAUNCHER_SIZE_VARIABLES = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _check_launcher_agrees(world_size: int) -> None:
    """Refuse N separate one-rank worlds where the launcher started N tasks.

    ``srun`` without a PMI plugin that the MPI library understands (Slurm's default
    ``--mpi=none`` with the mpich wheel) starts N processes that each see a world of size 1;
    they would train N independent copies, each believing it is rank 0 of 1.
    """
    if world_size > 1:
        return
    for variable in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            raise PipelineError(
                f"{variable}={value} tasks were launched but this process's MPI world has size 1: "
                f"the launcher and the MPI library do not share a process-management interface "
                f"(with Slurm and the mpich wheel use `srun --mpi=pmi2`, or MpiDefault=pmi2)."
            )


def mpi_library_version(comm) -> str:
    """The MPI library's version line, or 'none' without mpi4py."""
    if isinstance(comm, SerialCommunicator):
        return "none"
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


class AllRanksError(PipelineError):
    """A PipelineError raised on every rank at the same point (no rank is left waiting)."""


def collectively(comm, step: Callable[[], T]) -> T:
    """Run ``step`` on every rank; if it raises PipelineError on any, raise it on all.

    A rank that failed raises its own message; the others raise the first rank's.
    """
    try:
        result, error = step(), None
    except PipelineError as exc:
        result, error = None, str(exc)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise AllRanksError(error or errors[0])
    return result


@contextlib.contextmanager
def abort_on_failure(comm) -> Iterator[None]:
    """Run the block; if it raises on one rank of several (anything but an
    :class:`AllRanksError`), log the error and abort all ranks."""
    try:
        yield
    except AllRanksError:
        raise
    except (Exception, KeyboardInterrupt) as error:
        if comm.Get_size() > 1:
            log.critical("rank %d of %d failed, aborting all ranks: %s",
                         comm.Get_rank(), comm.Get_size(), error)
            logging.shutdown()
            time.sleep(ABORT_GRACE_S)
            comm.Abort(1)
        raise
