"""Fault injection: SIGKILL at seeded moments, recovery with the documented command alone
(bench/faults.py, small), and the two mechanisms it relies on: stale Snakemake locks and
temporary files left by killed writers are cleared by the next run."""

import json
import signal
import socket
import subprocess
import sys

from conftest import REPO

from workflow.io import atomic_write_text

HOLD = ("import time; from {module} import {function}; {call}; print('ready', flush=True); "
        "time.sleep(600)")


def holding(module: str, function: str, call: str, cwd) -> subprocess.Popen:
    """A process that runs ``call`` and then lives until it is killed."""
    code = HOLD.format(module=module, function=function, call=call)
    process = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline() == "ready\n"
    return process


def test_three_kills_recover_with_the_documented_command_and_identical_outputs(tmp_path):
    """Snakemake killed (whole process group, SIGKILL) while writing params.csv, a snapshot and a
    histogram; `snakemake --until histogram` alone finishes each time; outputs as uninterrupted."""
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "faults.py"), "--drivers", "snakemake",
         "--kills", "3",
         "--seed", "0", "--until", "histogram", "--dir", str(tmp_path / "faults")],
        capture_output=True, text=True, check=False, timeout=900,  # a hang guard only
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["kills"] == 3, result.stderr[-3000:]
    assert summary["recovered"] == 3 and summary["manual_steps"] == 0, result.stderr[-3000:]
    assert summary["identical"] == 1, summary["differences"]
    assert summary["extra_jobs_per_kill"] <= 1
    assert set(summary["moments"]) == {"writing params.csv", "writing snapshot.h5",
                                       "writing histogram HDF5"}


def test_stale_snakemake_locks_are_removed_only_when_no_run_nor_job_is_alive(tmp_path):
    """Runs (release_stale_locks) and the jobs they start (hold_run_lock), each a process of
    its own in the working directory, killed in turn: Snakemake's locks are removed only by a
    run that starts when none of the others lives."""
    locks = tmp_path / ".snakemake" / "locks"
    locks.mkdir(parents=True)

    def plant():
        (locks / "0.output.lock").write_text("results/run/params.csv\n")

    def new_run_removes_locks() -> bool:
        """A run starts (and ends): did it remove the locks?"""
        subprocess.run([sys.executable, "-c", "from workflow.locks import release_stale_locks; "
                        "release_stale_locks()"], cwd=tmp_path, check=True)
        return not any(locks.iterdir())

    plant()
    first = holding("workflow.locks", "release_stale_locks", "release_stale_locks()", tmp_path)
    assert not any(locks.iterdir())  # nothing else was alive: the old locks were stale
    plant()  # the first run's own
    second = holding("workflow.locks", "release_stale_locks", "release_stale_locks()", tmp_path)
    job = holding("workflow.locks", "hold_run_lock", "hold_run_lock()", tmp_path)
    try:
        for process in (first, second, job):  # the runs killed, then the job that outlived them
            assert not new_run_removes_locks()
            process.send_signal(signal.SIGKILL)
            process.wait()
        assert new_run_removes_locks()  # none is left
    finally:
        for process in (first, second, job):
            process.kill()
            process.wait()


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "snapshot.h5"
    call = f"writer = atomic_path({str(target)!r}); writer.__enter__()"  # stopped mid-write

    def temporaries():
        """The writers' process ids, from the names of the temporary files left beside target."""
        return {int(path.name.split(f"{socket.gethostname()}-")[1].split(".")[0])
                for path in tmp_path.glob(".snapshot.h5.*.tmp")}

    killed = holding("workflow.io", "atomic_path", call, tmp_path)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert temporaries() == {killed.pid}
    writing = holding("workflow.io", "atomic_path", call, tmp_path)
    try:
        assert temporaries() == {writing.pid}  # the killed writer's file went when it started
        atomic_write_text(target, "complete")
        assert temporaries() == {writing.pid}  # a live writer's file stays
    finally:
        writing.send_signal(signal.SIGKILL)
        writing.wait()
    assert target.read_text() == "complete"
