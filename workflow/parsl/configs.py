"""Parsl configurations from the validated configuration (schema section ``parsl``).

Nothing here is a hand-written Parsl configuration: every executor, provider and launcher is
built from the config's keys, so ``cosmoflow validate-config`` has checked them before Parsl
starts.

* the ensemble: a :class:`~parsl.executors.HighThroughputExecutor` whose blocks come from a
  :class:`~parsl.providers.LocalProvider` (this machine; workers = cores by default) or a
  :class:`~parsl.providers.SlurmProvider` (sbatch jobs; workers started with
  :class:`~parsl.launchers.SrunLauncher`, one worker pool per node);
* a sweep: an :class:`~parsl.executors.MPIExecutor` (the provider must use a
  :class:`~parsl.launchers.SimpleLauncher`: one worker pool on the block's first node, whose
  workers launch each trial's ranks with ``$PARSL_MPI_PREFIX``, i.e. ``mpiexec`` or ``srun``
  over the nodes Parsl gives the trial), and a :class:`~parsl.dataflow.memoization.BasicMemoizer`
  (:func:`sweep_config`).

Both start Parsl's interchange through :mod:`workflow.parsl.guard`, so that it ends with the
driver even when the driver is killed with SIGKILL (the worker pools then stop after the
heartbeat threshold: :data:`LOCAL_HEARTBEAT`). The interchange listens for workers on one
address only, the one they are told to connect to: loopback (127.0.0.1) for a local block, the
address of ``parsl.interface`` on Slurm. Every block runs the process settings of
:mod:`workflow.process` first, as the ``cosmoflow`` command does.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import shlex
import socket
from pathlib import Path

from parsl.config import Config
from parsl.dataflow.memoization import BasicMemoizer
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import SimpleLauncher, SingleNodeLauncher, SrunLauncher
from parsl.providers import LocalProvider, SlurmProvider
from parsl.utils import get_all_checkpoints

from workflow.errors import ConfigError
from workflow.process import shell_exports

log = logging.getLogger(__name__)

ENSEMBLE_LABEL = "ensemble"
SWEEP_LABEL = "sweep"
STRATEGY_PERIOD_S = 1  # Parsl's default of 5 s delays the first block by as much
SRUN_MPI_OPTIONS = "--mpi=pmi2"  # the mpich wheel's PMI (docs/cluster.md)


INTERCHANGE_COMMAND = "cosmoflow-parsl-interchange"
"""workflow.parsl.guard's; one word, as the HighThroughputExecutor (a sequence) and the
MPIExecutor (a string) both take it."""


LOOPBACK = "127.0.0.1"
LOCAL_HEARTBEAT = {"heartbeat_period": 5, "heartbeat_threshold": 20}
"""Seconds between a local worker pool's heartbeats and without one before the pool (or the
interchange) gives the other up: a local pool whose driver was killed stops within 20 s instead
of Parsl's 120 s. No network delays a heartbeat over loopback; 20 s is four missed ones."""


def network(section: dict) -> dict:
    """The executor options of the ``parsl`` config ``section`` on where the interchange listens
    and what the workers are told to connect to (the same address), and the heartbeats."""
    if section["provider"] == "local":
        return {"address": LOOPBACK, "loopback_address": LOOPBACK, **LOCAL_HEARTBEAT}
    return {"address": interface_address(section["interface"]), "loopback_address": LOOPBACK}


def interface_address(name: str | None) -> str:
    """The IPv4 address of this machine's network interface ``name`` (``parsl.interface``);
    null: the address this machine's hostname resolves to."""
    from parsl.addresses import address_by_hostname, address_by_interface

    names = ", ".join(interface for _, interface in socket.if_nameindex())
    try:
        address = address_by_hostname() if name is None else address_by_interface(name)
    except OSError as error:
        what = repr(name) if name else f"null, and the hostname {socket.gethostname()!r},"
        raise ConfigError(f"key 'parsl.interface' = {what} has no IPv4 address on this machine "
                          f"({error.strerror or error}); its network interfaces: {names}") from None
    if name is None and ipaddress.ip_address(address).is_loopback:
        log.warning("parsl.interface is null and the hostname %r resolves to %s, a loopback "
                    "address: workers on other nodes cannot connect to it; set parsl.interface "
                    "to the interface they reach this machine on (here: %s)",
                    socket.gethostname(), address, names)
    return address


def provider(section: dict, launcher, worker_init: str = "", blocks: int | None = None):
    """The block provider of the ``parsl`` config ``section`` with ``launcher``.

    ``worker_init`` is run in each block before the workers start (after the config's own
    ``parsl.slurm.worker_init``); ``blocks`` overrides ``parsl.blocks``.
    """
    blocks = section["blocks"] if blocks is None else blocks
    init = shell_exports() + worker_init
    if section["provider"] == "local":
        return LocalProvider(launcher=launcher, init_blocks=1, min_blocks=0, max_blocks=blocks,
                             worker_init=init)
    slurm = section["slurm"]
    return SlurmProvider(
        partition=slurm["partition"], account=slurm["account"], qos=slurm["qos"],
        nodes_per_block=section["nodes_per_block"], cores_per_node=slurm["cores_per_node"],
        mem_per_node=slurm["mem_per_node"], init_blocks=blocks, min_blocks=0, max_blocks=blocks,
        walltime=slurm["walltime"], exclusive=slurm["exclusive"],
        scheduler_options=slurm["scheduler_options"],
        worker_init=slurm["worker_init"] + "\n" + init, launcher=launcher,
    )


def ensemble_executor(config: dict) -> HighThroughputExecutor:
    """The HighThroughputExecutor of ``cosmoflow ensemble``: ``parsl.workers_per_node`` workers
    (null: one per core) on each node of each block."""
    section = config["parsl"]
    launcher = SingleNodeLauncher() if section["provider"] == "local" else SrunLauncher()
    return HighThroughputExecutor(
        label=ENSEMBLE_LABEL, provider=provider(section, launcher), cores_per_worker=1.0,
        max_workers_per_node=section["workers_per_node"],
        interchange_launch_cmd=[INTERCHANGE_COMMAND], **network(section),
    )


def ensemble_config(config: dict, run_dir: str | os.PathLike) -> Config:
    """The Parsl ``Config`` of ``cosmoflow ensemble``; Parsl's run directories go to ``run_dir``."""
    return Config(executors=[ensemble_executor(config)], retries=config["parsl"]["retries"],
                  run_dir=str(run_dir), strategy_period=STRATEGY_PERIOD_S, usage_tracking=0)


def trial_resources(config: dict) -> dict:
    """The MPIExecutor's resource specification of a sweep trial: ``sweep.nodes`` nodes, ``sweep.ranks``
    ranks, and what follows the MPI launcher's own options in ``$PARSL_MPI_PREFIX`` when there is
    anything (``parsl.mpi.launcher_options``; null: none for mpiexec, the mpich wheel's PMI for srun)."""
    sweep, options = config["sweep"], config["parsl"]["mpi"]["launcher_options"]
    resources = {"num_nodes": sweep["nodes"], "ranks_per_node": sweep["ranks"] // sweep["nodes"],
                 "num_ranks": sweep["ranks"]}
    if config["parsl"]["mpi"]["launcher"] == "srun" or options:
        resources["launcher_options"] = SRUN_MPI_OPTIONS if options is None else options
    return resources


def sweep_executor(config: dict, node_file: str | os.PathLike) -> MPIExecutor:
    """The MPIExecutor of ``cosmoflow sweep``: ``sweep.concurrent`` trials at once.

    Locally one block runs them all; the MPIExecutor still needs a node list there, which Parsl
    reads from ``$SLURM_NODELIST`` or ``$PBS_NODEFILE``: ``node_file``, naming this machine once
    per concurrent trial (Parsl's own tests of the MPIExecutor do the same). On Slurm a block
    runs the trials of ``sweep.nodes`` whole nodes each that fit ``parsl.nodes_per_block`` (the
    MPIExecutor gives a trial whole nodes), more blocks making up ``sweep.concurrent``.
    """
    section, concurrent = config["parsl"], config["sweep"]["concurrent"]
    if section["provider"] == "local":  # this machine, even inside a Slurm allocation
        per_block, blocks = concurrent, 1
        init = f"unset SLURM_NODELIST\nexport PBS_NODEFILE={shlex.quote(str(Path(node_file).absolute()))}\n"
    else:
        per_block = max(1, min(concurrent, section["nodes_per_block"] // config["sweep"]["nodes"]))
        blocks, init = math.ceil(concurrent / per_block), ""
    return MPIExecutor(
        label=SWEEP_LABEL, max_workers_per_block=per_block, mpi_launcher=section["mpi"]["launcher"],
        provider=provider(section, SimpleLauncher(), worker_init=init, blocks=blocks),
        interchange_launch_cmd=INTERCHANGE_COMMAND, **network(section),
    )


def sweep_config(config: dict, run_dir: str | os.PathLike, node_file: str | os.PathLike) -> Config:
    """The Parsl ``Config`` of ``cosmoflow sweep``: checkpoints at every trial's end, and those
    of every earlier run under ``run_dir`` loaded, so a rerun skips the trials already done."""
    memoizer = BasicMemoizer(checkpoint_mode="task_exit", checkpoint_files=get_all_checkpoints(str(run_dir)))
    return Config(executors=[sweep_executor(config, node_file)], memoizer=memoizer,
                  retries=config["parsl"]["retries"], run_dir=str(run_dir),
                  strategy_period=STRATEGY_PERIOD_S, usage_tracking=0)


def submit_script(block_provider, command: str, tasks_per_node: int = 1,
                  job_name: str = "parsl.cosmoflow") -> str:
    """The batch script ``block_provider`` (a SlurmProvider) would submit for one block running
    ``command`` (``tasks_per_node`` launches per node), rendered from Parsl's own template and
    launcher as its ``submit`` does, without submitting anything."""
    from string import Template

    from parsl.providers.slurm.template import template_string
    from parsl.utils import wtime_to_minutes

    scheduler_options, worker_init = block_provider.scheduler_options, block_provider.worker_init
    if block_provider.mem_per_node is not None:
        scheduler_options += f"#SBATCH --mem={block_provider.mem_per_node}g\n"
    if block_provider.cores_per_node is not None:
        scheduler_options += f"#SBATCH --cpus-per-task={block_provider.cores_per_node // tasks_per_node}"
    script_dir = block_provider.script_dir or "."
    return Template(template_string).substitute(
        jobname=job_name, nodes=block_provider.nodes_per_block, tasks_per_node=tasks_per_node,
        walltime=wtime_to_minutes(block_provider.walltime), scheduler_options=scheduler_options,
        worker_init=worker_init, job_stdout_path=f"{script_dir}/{job_name}.stdout",
        job_stderr_path=f"{script_dir}/{job_name}.stderr",
        user_script=block_provider.launcher(command, tasks_per_node, block_provider.nodes_per_block,
                                            script_dir),
    )
