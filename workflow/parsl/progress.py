"""A Parsl driver's run (:func:`parsl_run`) and its live progress on the console: done, running,
pending per stage, rate, time left.

"Running" counts the marker files the jobs hold while they work (workflow.parsl.apps), so it
means a worker is on the job, not merely that Parsl handed it to the executor. "Done" includes
jobs found up to date (reported apart at the end). The time left is the work left, each stage's
remaining jobs at the mean time of its finished ones, over the concurrency achieved so far (busy
job-seconds per wall-clock second); it is marked ">=" while a stage with jobs left has none
finished yet. A terminal gets the block rewritten in place every second; a log file or pipe gets
it every ``interval`` seconds and whenever a stage finishes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from workflow.errors import PipelineError
from workflow.paths import ParslFiles


@dataclass
class StageCount:
    total: int = 0
    ran: int = 0
    current: int = 0  # found up to date, not run
    failed: int = 0
    seconds: list = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.ran + self.current


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Counts per stage and the console report; :meth:`finished` records each job's result."""

    def __init__(self, title: str, totals: dict[str, int], running_dir: Path,
                 stream: TextIO = sys.stderr, interval: float = 10.0):
        self.title, self.running_dir, self.stream, self.interval = title, Path(running_dir), stream, interval
        self.stages = {name: StageCount(total=n) for name, n in totals.items()}
        self.started = time.monotonic()
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._last_print, self._lines_printed, self._changed = 0.0, 0, True
        self._last_rows: list[str] = []

    def finished(self, stage: str, ran: bool | None, seconds: float = 0.0) -> None:
        """One job of ``stage`` ended: ran (True), was up to date (False) or failed (None)."""
        count = self.stages[stage]
        if ran is None:
            count.failed += 1
        elif ran:
            count.ran += 1
            count.seconds.append(seconds)
        else:
            count.current += 1
        self._changed = self._changed or count.done + count.failed == count.total

    def running(self) -> dict[str, int]:
        """Jobs holding a marker now, by stage (marker names start with the rule name)."""
        try:
            held = Counter(path.name.split(".", 1)[0] for path in self.running_dir.iterdir())
        except FileNotFoundError:
            held = Counter()
        return {stage: held[stage] for stage in self.stages}

    def lines(self) -> list[str]:
        elapsed = time.monotonic() - self.started
        running = self.running()
        rows, left, unknown = [], 0.0, False
        for name, count in self.stages.items():
            remaining = count.total - count.done - count.failed
            if remaining and count.seconds:
                left += remaining * sum(count.seconds) / len(count.seconds)
            elif remaining:
                unknown = True
            failed = f", {count.failed} failed" if count.failed else ""
            rows.append(f"  {name:<20} {count.done:>5} done {running[name]:>4} running "
                        f"{max(remaining - running[name], 0):>5} pending{failed}")
        ran = sum(count.ran for count in self.stages.values())
        busy = sum(sum(count.seconds) for count in self.stages.values())
        concurrency = busy / elapsed if elapsed > 0 and busy else 0.0
        if concurrency and (left or not unknown):
            eta = (">= " if unknown else "~") + duration(left / concurrency)
        else:
            eta = "unknown"
        rate = ran / elapsed * 60 if elapsed > 0 else 0.0
        head = f"{self.title}: {duration(elapsed)} elapsed, {rate:.1f} jobs/min, time left {eta}"
        return [head] + rows

    def show(self, force: bool = False) -> None:
        """Print the report if it is due (every second on a terminal, else every interval)."""
        now = time.monotonic()
        due = now - self._last_print >= (1.0 if self.tty else self.interval)
        if not (force or due or (self._changed and not self.tty)):
            return
        lines = self.lines()
        if lines[1:] == self._last_rows and not self.tty and not due:
            return
        if self.tty and self._lines_printed:
            self.stream.write(f"\x1b[{self._lines_printed}F")
        self.stream.write("".join(f"{line}\x1b[K\n" if self.tty else f"{line}\n" for line in lines))
        self.stream.flush()
        self._last_print, self._lines_printed, self._changed = now, len(lines), False
        self._last_rows = lines[1:]


def as_completed(futures: Iterable[concurrent.futures.Future], progress: "Progress") -> Iterator:
    """Each of ``futures`` as it completes, with ``progress`` redrawn between them (at least
    every half second) and once more at the end."""
    waiting = set(futures)
    while waiting:
        done, waiting = concurrent.futures.wait(waiting, timeout=0.5,
                                                return_when=concurrent.futures.FIRST_COMPLETED)
        yield from done
        progress.show()
    progress.show(force=True)


@contextlib.contextmanager
def parsl_run(parsl_config, files: ParslFiles, title: str, totals: dict[str, int], stream: TextIO,
              interval: float, interrupted: Callable[[], str]):
    """One run of a Parsl driver (``cosmoflow ensemble`` or ``sweep``): yields Parsl's
    DataFlowKernel for ``parsl_config`` and the run's :class:`Progress`, whose ``running_dir``
    holds the jobs' markers.

    Parsl's log goes to its run directory, not the console. SIGTERM (``kill``, a Slurm time
    limit) acts as Ctrl-C, so the workers are shut down (Parsl cancels its blocks) instead of
    left running; either raises PipelineError(``interrupted()``). The kernel is cleaned up and
    the markers removed in any case."""
    from parsl.dataflow.dflow import DataFlowKernel

    session = files.new_session()
    session.mkdir(parents=True, exist_ok=True)
    logging.getLogger("parsl").propagate = False
    progress = Progress(title, totals, session, stream, interval)
    dfk = DataFlowKernel(parsl_config)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if on_main_thread else None
    try:
        yield dfk, progress
    except KeyboardInterrupt:
        raise PipelineError(interrupted()) from None
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
        dfk.cleanup()
        shutil.rmtree(session, ignore_errors=True)
