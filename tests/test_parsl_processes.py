"""The processes of a local `cosmoflow ensemble`: Parsl's interchange and worker pool listen and
connect on loopback only, with the local heartbeat threshold, and nothing outlives a driver
killed with SIGKILL (workflow/parsl/configs.py, workflow/parsl/guard.py). Processes are read
with psutil (the test extra).
"""

from __future__ import annotations

import ipaddress
import subprocess
import time

import psutil

from conftest import write_config
from test_parsl import PARSL, RUN
from workflow.parsl.configs import LOCAL_HEARTBEAT

HANG_GUARD_S = 300  # a hang guard: the first job starts after ~20 s here, the pool stops ~20 s
# after the kill (configs.LOCAL_HEARTBEAT)


def block_processes(workdir) -> set[psutil.Process]:
    """The processes whose command line names ``workdir`` and their descendants: the local
    block's shell, worker pool and workers."""
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        if str(workdir) in " ".join(process.info["cmdline"] or ()):
            try:
                found |= {process, *process.children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
    return found


def alive(processes) -> list[psutil.Process]:
    """Those still running (a zombie, waiting to be reaped, has ended)."""
    living = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                living.append(process)
        except psutil.NoSuchProcess:
            pass
    return living


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)  # ZeroMQ's sockets are IPv6, ::ffff:127.0.0.1
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def command(process: psutil.Process) -> str:
    return " ".join(process.cmdline())


def test_local_ensemble_listens_on_loopback_and_ends_with_a_killed_driver(tmp_path):
    console = tmp_path / "console.txt"
    with open(console, "w") as out:
        config = write_config(tmp_path, PARSL).name  # relative: the driver is not a block process
        driver = subprocess.Popen(["cosmoflow", "ensemble", "--config", config], cwd=tmp_path,
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        running = tmp_path / RUN / "parsl" / "running"
        deadline = time.monotonic() + HANG_GUARD_S
        while not any(running.glob("*/*")):  # a worker is on a job: the pool is connected
            assert driver.poll() is None and time.monotonic() < deadline, console.read_text()
            time.sleep(0.05)
        # the driver's descendants (Parsl's interchange) and the block's
        descendants = psutil.Process(driver.pid).children(recursive=True)
        processes = set(descendants) | block_processes(tmp_path)
        (interchange,) = [p for p in processes if "interchange" in command(p)]
        (pool,) = [p for p in processes if "process_worker_pool" in command(p)]

        # every listening socket of the driver, the interchange and the block is on loopback
        listening = {(process.pid, connection.laddr.ip)
                     for process in [psutil.Process(driver.pid), *processes]
                     for connection in process.net_connections("inet")
                     if connection.status == psutil.CONN_LISTEN}
        assert interchange.pid in {pid for pid, _ in listening}, listening
        assert all(is_loopback(ip) for _, ip in listening), listening
        # the workers are told 127.0.0.1 and connected there, and give the interchange up
        # after the local heartbeat threshold (so that they end soon after the driver)
        arguments = pool.cmdline()
        assert arguments[arguments.index("-a") + 1] == "127.0.0.1", arguments
        threshold = LOCAL_HEARTBEAT["heartbeat_threshold"]
        assert f"--hb_threshold={threshold}" in arguments, arguments
        remote = [c.raddr.ip for c in pool.net_connections("inet") if c.raddr]
        assert remote and all(is_loopback(ip) for ip in remote), remote

        driver.kill()
        driver.wait()
        while left := alive(processes | block_processes(tmp_path)):
            assert time.monotonic() < deadline, [command(process) for process in left]
            time.sleep(0.5)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
