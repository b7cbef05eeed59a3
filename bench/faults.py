"""Fault injection: SIGKILL the pipeline at seeded random moments, recover with the documented
command alone, and compare every output with an uninterrupted run of the same configuration.

Three drivers, each first run once uninterrupted (the reference), then again in a fresh
directory, killed ``kills`` times:

* ``snakemake``: ``snakemake --cores all --configfile config.yaml`` (the README's main command), the
  whole pipeline up to the report;
* ``ensemble``: ``cosmoflow ensemble --config config.yaml`` (Parsl), up to the manifest;
* ``mpi``: ``mpiexec -n 2 cosmoflow train`` on the reference's staged data set.

A kill waits for a moment chosen with the seeded RNG: the temporary file of an atomic write of
a given kind appearing (params.csv, ic.h5, snapshot.h5, histogram, TFRecord, manifest, staged
record, checkpoint, model, report: the kill lands during that write) or a random delay after a
stage's job started (during its computation). Kills are spread over the stages in pipeline
order. The whole process group of the command is killed (``os.killpg``, SIGKILL), and the same
command is started again, which must finish on its own (or be killed at the next moment). Only
if it fails is a manual step taken (``snakemake --unlock`` after a lock error) and counted.

Figures: ``kills``; ``recovered`` (kills after which the documented command alone went on);
``identical`` (drivers whose outputs equal their reference: the bytes of every data file, the
weights' sha256 for training); ``extra_jobs_per_kill`` (jobs that had finished before a kill
and ran again after it, per kill; for ``mpi``, checkpoint intervals redone); ``manual_steps``.
Not compared, as they legitimately differ between any two runs: ``logs/``, ``benchmarks/``,
``parsl/`` (run directories, logs), the durations in JSON files (keys ``seconds`` and
``mb_per_s``: batch summaries, ``staged.json``, ``metrics.json``) and the working directory in
their paths, ``training/run.json`` (timings; its ``weights_sha256_per_rank`` is compared),
``training/history.csv`` (times per epoch; its other columns are compared),
``training/tensorboard/`` (wall times), ``model.keras`` (its ``metadata.json`` holds the save
date, its ``config.json`` Python object ids; its weights are compared),
``analysis/figures/.snakemake_timestamp``. A temporary file left by a killed write counts as a
difference. Last line: one JSON object.

    python bench/faults.py [--kills 20] [--seed 0] [--config CONFIG] [--drivers ...] [--dir DIR]
                           [--until RULE]

``--until RULE`` stops the snakemake and ensemble drivers after that stage (the documented
``snakemake --until`` and ``cosmoflow ensemble --until``), with kills only up to it.

Without ``--config`` it runs MICRO (every stage; a few minutes per Snakemake run on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import fnmatch
import hashlib
import io
import json
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from workflow.process import configure_process

configure_process()  # first, as every entry point of the pipeline

REPO = Path(__file__).resolve().parents[1]

# Every stage, as small as it gets: 8 simulations of 16^3 particles in 2 batches, 3 epochs of
# 8 steps with a checkpoint every 2 steps, deterministic training (weights equal bit for bit).
MICRO = {
    "run_name": "faults",
    "seed": 11,
    "sampling": {"n_simulations": 8, "splits": {"train": 0.5, "val": 0.25, "test": 0.25}},
    "simulation": {"sims_per_job": 4, "box_size": 64.0, "n_particles": 16, "n_steps": 4, "redshifts": [0.0],
                   "threads": 1, "keep_initial_conditions": True, "keep_snapshots": True},
    "initial_conditions": {"z_init": 15.0},
    "preprocessing": {"grid": 16, "subvolume": 8, "samples_per_file": 8},
    "training": {"model": "mlperf", "epochs": 3, "batch_size": 4, "deterministic": True,
                 "threads": 1, "checkpoint_every_steps": 2},
    "analysis": {"validation": {"halofit": False}, "bootstrap": 50, "baselines": ["mean", "ridge"],
                 "threads": 1},
}

MPI_TRAINING = "training_mpi"  # the mpi driver's --output-dir, inside the run directory


RULES = ["sample_parameters", "initial_conditions", "simulate", "histogram", "write_tfrecords",
         "manifest", "stage", "train", "analyze"]


@dataclass(frozen=True)
class Moment:
    """When to kill, in a job of ``rule``: a new file matching ``pattern`` (relative to the run
    directory; "": the command started) appears, then ``delay`` seconds at most (drawn
    uniformly) pass."""

    rule: str
    name: str
    pattern: str
    delay: float = 0.0


def write(rule: str, name: str, pattern: str) -> Moment:
    """The moment a temporary file of an atomic write appears (workflow/io.py: .<name>.*.tmp)."""
    return Moment(rule, f"writing {name}", pattern)


def during(rule: str, seconds: float, log: str | None = None) -> Moment:
    """A random moment within ``seconds`` after a job of ``rule`` started (its log appeared)."""
    return Moment(rule, f"during {rule}", f"logs/{rule}/*.log" if log is None else log, seconds)


# In pipeline order, per driver.
DATA_MOMENTS = [
    write("sample_parameters", "params.csv", ".params.csv.*.tmp"),
    write("initial_conditions", "ic.h5", "sims/*/.ic.h5.*.tmp"),
    during("simulate", 3.0),
    write("simulate", "snapshot.h5", "sims/*/.snapshot.h5.*.tmp"),
    write("histogram", "histogram HDF5", "histograms/.*.h5.*.tmp"),
    write("write_tfrecords", "TFRecord", "tfrecords/*/.*.tfrecord.*.tmp"),
    write("manifest", "manifest", "tfrecords/.manifest.json.*.tmp"),
]
MOMENTS = {
    "snakemake": DATA_MOMENTS + [
        write("stage", "staged record", "staged/.staged.json.*.tmp"),
        during("train", 20.0),
        write("train", "checkpoint", "training/checkpoints/.*.h5.*.tmp"),
        write("train", "model", "training/.model*.tmp.keras"),
        during("analyze", 15.0),
        write("analyze", "report", "analysis/.report.html.*.tmp"),
    ],
    "ensemble": DATA_MOMENTS,
    "mpi": [
        during("train", 20.0, ""),
        write("train", "checkpoint", f"{MPI_TRAINING}/checkpoints/.*.h5.*.tmp"),
        write("train", "model", f"{MPI_TRAINING}/.model*.tmp.keras"),
        write("train", "run.json", f"{MPI_TRAINING}/.run.json.*.tmp"),
    ],
}

# Paths (relative to the run directory) that differ between any two runs; see the docstring.
NOT_COMPARED = re.compile(
    r"^(logs|benchmarks|parsl)/|/tensorboard/|\.snakemake_timestamp$"
    r"|(^|/)run\.json$|(^|/)history\.csv$|(^|/)model\.keras$")
TIMINGS = {"seconds", "mb_per_s"}  # JSON keys of durations (batch summaries, staged.json, ...)
TEMPORARY = re.compile(r"(^|/)\.[^/]+\.tmp(\.keras)?$")


@dataclass
class Driver:
    """A documented command, run in ``workdir`` on the run directory ``run``."""

    name: str
    command: list[str]
    workdir: Path
    run: Path
    invocations: list[dict] = field(default_factory=list)

    def start(self) -> tuple[subprocess.Popen, Path]:
        output = self.workdir / "invocations" / f"{len(self.invocations):03d}.txt"
        output.parent.mkdir(exist_ok=True)
        with open(output, "w") as handle:
            process = subprocess.Popen(self.command, cwd=self.workdir, stdout=handle,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        return process, output


def drivers(root: Path, config: dict, until: str | None) -> dict[str, Driver]:
    """The three drivers; the mpi driver runs in the snakemake driver's reference directory."""
    run_name = config.get("run_name", "tiny")
    made = {}
    for name, command in [
        ("snakemake", ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", ".",
                       "--cores", "all", "--configfile", "config.yaml"]),
        ("ensemble", ["cosmoflow", "ensemble", "--config", "config.yaml"]),
    ]:
        workdir = root / name
        command += ["--until", until] if until else []
        made[name] = Driver(name, command, workdir, workdir / "results" / run_name)
    run = root / "reference-snakemake" / "results" / run_name
    made["mpi"] = Driver("mpi", ["mpiexec", "-n", "2", "cosmoflow", "train", "--config",
                                 str(run / "config.yaml"), "--set", "training.ranks=2",
                                 "--output-dir", str(run / MPI_TRAINING)],
                         run.parents[1], run)
    return made


class Watch:
    """The files created or changed under a directory, as the kernel reports them (inotify):
    a temporary file that lives for a millisecond is seen too. Hidden directories are not
    watched (.snakemake/, Snakemake's records), hidden files are (the temporary files)."""

    EVENTS = 0x2 | 0x80 | 0x100  # IN_MODIFY | IN_MOVED_TO | IN_CREATE
    IS_DIR = 0x40000000

    def __init__(self, root: Path, skip: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        self.skip, self.directories = skip, {}
        self._add(root)

    def _add(self, directory: Path) -> list[Path]:
        """Watch ``directory`` and its subdirectories; return the files already in them."""
        if directory.name.startswith(".") or directory == self.skip:
            return []
        descriptor = self.libc.inotify_add_watch(self.fd, bytes(directory), self.EVENTS)
        if descriptor < 0:  # removed meanwhile
            return []
        self.directories[descriptor] = directory
        found = []
        for entry in list(os.scandir(directory)):
            path = Path(entry.path)
            found += self._add(path) if entry.is_dir() else [path]
        return found

    def changed(self, timeout: float) -> list[Path]:
        """The files created, written or renamed into place within ``timeout`` seconds."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        data, found = os.read(self.fd, 1 << 16), []
        while data:
            descriptor, mask, _, length = struct.unpack_from("iIII", data)
            name = data[16:16 + length].rstrip(b"\0").decode()
            data = data[16 + length:]
            if descriptor in self.directories and name:
                path = self.directories[descriptor] / name
                found += self._add(path) if mask & self.IS_DIR else [path]
        return found

    def close(self) -> None:
        os.close(self.fd)


def wait_and_kill(process: subprocess.Popen, driver: Driver, pending: list[Moment],
                  rng: random.Random) -> dict | None:
    """Kill the command at the first of the ``pending`` moments, or at a later one if that comes
    first (a stage may finish unseen, e.g. in the delay before the previous kill); the moments
    passed are dropped from ``pending``. None when the process ended first."""
    if not pending[0].pattern:
        return kill(process, driver, pending.pop(0), driver.run, rng)
    watch = Watch(driver.workdir, driver.workdir / "invocations")
    try:
        while process.poll() is None:
            for path in watch.changed(0.1):
                name = str(path.relative_to(driver.run)) if path.is_relative_to(driver.run) else ""
                hit = [i for i, m in enumerate(pending) if fnmatch.fnmatch(name, m.pattern)]
                if name and hit:
                    moment = pending[hit[0]]
                    del pending[:hit[0] + 1]
                    return kill(process, driver, moment, path, rng)
    finally:
        watch.close()
    return None


def kill(process: subprocess.Popen, driver: Driver, moment: Moment, path: Path,
         rng: random.Random) -> dict | None:
    """SIGKILL, after at most the moment's delay, every process the command started."""
    delay = rng.uniform(0.0, moment.delay)
    time.sleep(delay)
    if process.poll() is not None:  # it finished meanwhile
        return None
    groups = {process.pid} | session_groups(process.pid)
    for group in groups:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.killpg(group, signal.SIGKILL)
    process.wait()
    for group in groups:
        _wait_group_gone(group)
    return {"moment": moment.name, "file": str(path.relative_to(driver.run)),
            "delay_s": round(delay, 4),
            "during_write": moment.delay == 0.0 and path.exists()}


def session_groups(sid: int) -> set[int]:
    """The process groups of session ``sid``. The command starts the session; its jobs and
    Parsl's worker pools stay in it, though not all in its process group nor among its
    descendants (a worker pool's parent shell exits)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == sid:
            found.add(int(fields[2]))
    return found


def _wait_group_gone(pgid: int) -> None:
    for _ in range(1000):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def snakemake_jobs(text: str) -> tuple[list[tuple], set[tuple]]:
    """Jobs (rule, output) that a Snakemake output started, and those it finished."""
    started, by_id, finished = [], {}, set()
    for block in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)+)", text, re.MULTILINE):
        fields = dict(re.findall(r"^    (\w+): (.*)$", block.group(2), re.MULTILINE))
        job = (block.group(1), fields.get("output", fields.get("input", "")))
        started.append(job)
        by_id[fields.get("jobid")] = job
    for jobid in re.findall(r"^Finished jobid: (\d+)", text, re.MULTILINE):
        finished.add(by_id.get(jobid))
    return started, finished - {None}


def parsl_jobs(run: Path) -> dict[tuple, list[str]]:
    """The header lines of every Parsl job's log, by (rule, unit): one per attempt, each with
    its process id and time (a run rewrites the log of each job it runs)."""
    return {(log.parent.name, log.stem): re.findall(r"^=== cosmoflow.*$", log.read_text(
        errors="replace"), re.MULTILINE) for log in run.glob("logs/*/*.log")}


def parsl_done(run: Path) -> set[tuple]:
    """Parsl jobs whose record says they finished (batch summary or job record)."""
    records = list(run.glob("batches/*/*.json")) + list(run.glob("parsl/jobs/*/*.json"))
    return {(path.parent.name, path.stem) for path in records}


def checkpoint_position(path: Path, steps_per_epoch: int) -> int:
    epoch, step = map(int, re.findall(r"epoch(\d+)-step(\d+)", path.name)[0])
    return epoch * steps_per_epoch + step


def newest_checkpoint(run: Path, steps_per_epoch: int) -> int:
    found = [checkpoint_position(p, steps_per_epoch)
             for p in (run / MPI_TRAINING / "checkpoints").glob("epoch*-step*.h5")]
    return max(found, default=0)


def campaign(driver: Driver, moments: list[Moment], rng: random.Random,
             steps_per_epoch: int, every: int) -> dict:
    """Run the driver's command, killing it at each moment in turn, until it finishes."""
    kills, manual, extra = [], 0, 0
    finished: set[tuple] = set()
    pending = list(moments)
    while True:
        before_attempts = parsl_jobs(driver.run) if driver.name == "ensemble" else {}
        before_done = parsl_done(driver.run) if driver.name == "ensemble" else set()
        process, output = driver.start()
        kill = wait_and_kill(process, driver, pending, rng) if pending else None
        if kill is None:
            process.wait()
        text = output.read_text(errors="replace")
        failed = kill is None and process.returncode != 0
        if kills and "recovered" not in kills[-1]:  # the first run after a kill decides
            kills[-1]["recovered"] = not failed
        # jobs that had finished before this run and ran again in it
        if driver.name == "snakemake":
            started, done = snakemake_jobs(text)
            extra += sum(job in finished and job[0] != "all" for job in started)
            finished |= done
        elif driver.name == "ensemble":
            attempts = parsl_jobs(driver.run)
            extra += sum(attempts[job] != before_attempts.get(job) for job in before_done
                         if job in attempts)
        else:
            for resumed in re.findall(r"resuming from (\S+)", text):
                redone = kills[-1]["newest_checkpoint"] - checkpoint_position(
                    Path(resumed), steps_per_epoch) if kills else 0
                extra += max(0, redone // every)
        driver.invocations.append({"returncode": process.returncode, "killed": kill is not None})
        if kill is not None and driver.name == "mpi":
            kill["newest_checkpoint"] = newest_checkpoint(driver.run, steps_per_epoch)
        if kill is not None:
            kills.append(kill)
            continue
        if not failed:
            break
        if driver.name == "snakemake" and ("LockException" in text or "cannot be locked" in text):
            subprocess.run(driver.command + ["--unlock"], cwd=driver.workdir, capture_output=True,
                           check=False)
            manual += 1
            continue
        print(f"{driver.name}: the documented command failed after a kill ({output}):\n"
              f"{text[-3000:]}", file=sys.stderr)
        break
    return {"kills": kills, "recovered": sum(k["recovered"] for k in kills),
            "manual_steps": manual, "extra_jobs": extra, "finished": not failed}


def run_reference(driver: Driver, config: dict, reference: Path) -> Driver:
    """The driver's command, uninterrupted, in ``reference`` (for mpi: the same directory)."""
    if driver.name != "mpi":
        reference.mkdir(parents=True)
        (reference / "config.yaml").write_text(yaml.safe_dump(config))
        driver = Driver(driver.name, driver.command, reference,
                        reference / "results" / driver.run.name)
    started = time.monotonic()
    result = subprocess.run(driver.command, cwd=driver.workdir, capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise SystemExit(f"the uninterrupted {driver.name} run failed:\n{result.stdout[-2000:]}"
                         f"{result.stderr[-3000:]}")
    print(f"{driver.name}: uninterrupted run in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return driver


def file_digest(path: Path, workdir: Path) -> str:
    """sha256 of a file's bytes; of a .keras archive's weights; of a JSON file's content with
    the working directory's path replaced and the timings (TIMINGS) left out."""
    if path.suffix == ".keras":
        with zipfile.ZipFile(path) as archive:
            return hashlib.sha256(archive.read("model.weights.h5")).hexdigest()
    if path.suffix == ".json":
        text = path.read_text().replace(str(workdir), "<workdir>")
        return hashlib.sha256(json.dumps(_untimed(json.loads(text))).encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def outputs(run: Path, workdir: Path, only: str | None = None) -> dict[str, str]:
    """Digest of every compared output under ``run`` (or its ``only`` subdirectory), and the
    weights' hash and history's values of every training directory."""
    found = {}
    for path in sorted((run / only if only else run).rglob("*")):
        name = str(path.relative_to(run))
        if not path.is_file() or (only is None and name.startswith(MPI_TRAINING)):
            continue
        if TEMPORARY.search(name):
            found[name] = "temporary file left by a killed write"
        elif path.name == "run.json":
            found[name + ":weights_sha256_per_rank"] = str(
                json.loads(path.read_text())["weights_sha256_per_rank"])
        elif path.name == "history.csv":
            rows = list(csv.DictReader(io.StringIO(path.read_text())))
            found[name + ":values"] = str([{k: v for k, v in row.items() if "time" not in k
                                            and "second" not in k} for row in rows])
        elif path.name == "model.keras" or not NOT_COMPARED.search(name):
            found[name] = file_digest(path, workdir)
    return found


def compare(reference: dict[str, str], faulted: dict[str, str]) -> list[str]:
    """What differs: missing, extra or changed outputs."""
    return ([f"missing {name}" for name in sorted(set(reference) - set(faulted))]
            + [f"extra {name}" for name in sorted(set(faulted) - set(reference))]
            + [f"differs {name}" for name in sorted(set(reference) & set(faulted))
               if reference[name] != faulted[name]])


def plan(kills: int, names: list[str], rng: random.Random,
         until: str = RULES[-1]) -> dict[str, list[Moment]]:
    """Kills per driver (a fifth each to ensemble and mpi, the rest to snakemake, when all
    run), each driver's moments (up to rule ``until``) drawn without repetition while they
    last, in pipeline order."""
    shares = {"ensemble": kills // 5, "mpi": kills // 5} if len(names) > 1 else {}
    counts = {name: max(1, shares[name]) if name in shares else 0 for name in names}
    counts[names[0]] = max(1, kills - sum(counts.values()) + counts[names[0]])
    moments = {}
    for name in names:
        choices = [m for m in MOMENTS[name] if RULES.index(m.rule) <= RULES.index(until)]
        drawn = rng.sample(range(len(choices)), min(counts[name], len(choices)))
        drawn += rng.choices(range(len(choices)), k=counts[name] - len(drawn))
        moments[name] = [choices[i] for i in sorted(drawn)]
    return moments


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kills in all (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the moments (default 0)")
    parser.add_argument("--config", help="configuration file (default: MICRO, see the source)")
    parser.add_argument("--drivers", nargs="+", default=["snakemake", "ensemble", "mpi"],
                        choices=["snakemake", "ensemble", "mpi"])
    parser.add_argument("--dir", help="working directory (default: a new temporary one)")
    parser.add_argument("--until", choices=RULES[:-1],
                        help="stop after this stage (snakemake and ensemble drivers only)")
    args = parser.parse_args(argv)
    if args.until and "mpi" in args.drivers:
        parser.error("--until: the mpi driver trains on the whole pipeline's data set; "
                     "choose --drivers snakemake ensemble")
    config = yaml.safe_load(Path(args.config).read_text()) if args.config else MICRO
    root = Path(args.dir or tempfile.mkdtemp(prefix="faults-"))
    rng = random.Random(args.seed)
    moments = plan(args.kills, [n for n in ["snakemake", "ensemble", "mpi"] if n in args.drivers],
                   rng, args.until or RULES[-1])
    training = {**MICRO["training"], **config.get("training", {})}
    every = training.get("checkpoint_every_steps") or 1
    made = drivers(root, config, args.until)
    results, different = {}, {}
    for name, driver in made.items():
        if name not in args.drivers:
            continue
        if name == "mpi" and not (root / "reference-snakemake").exists():
            run_reference(made["snakemake"], config, root / "reference-snakemake")
        reference = run_reference(driver, config, root / f"reference-{name}")
        if name == "mpi":  # the reference's training moves aside; the faulted one takes its place
            os.rename(driver.run / MPI_TRAINING, driver.run / "training_mpi_reference")
            kept = outputs(driver.run, driver.workdir, "training_mpi_reference")
            expected = {k.replace("training_mpi_reference", MPI_TRAINING): v
                        for k, v in kept.items()}
        else:
            expected = outputs(reference.run, reference.workdir)
            driver.workdir.mkdir(parents=True)
            (driver.workdir / "config.yaml").write_text(yaml.safe_dump(config))
        steps_per_epoch = _steps_per_epoch(
            driver.run / ("training_mpi_reference" if name == "mpi" else "training"))
        results[name] = campaign(driver, moments[name], rng, steps_per_epoch, every)
        got = outputs(driver.run, driver.workdir, MPI_TRAINING if name == "mpi" else None)
        different[name] = compare(expected, got)
        results[name]["identical"] = not different[name]
        print(f"{name}: {json.dumps(results[name])}\n  differences: {different[name]}",
              file=sys.stderr)
    kills = sum(len(r["kills"]) for r in results.values())
    summary = {
        "kills": kills,
        "recovered": sum(r["recovered"] for r in results.values()),
        "identical": sum(r["identical"] for r in results.values()),
        "drivers": len(results),
        "extra_jobs_per_kill": round(sum(r["extra_jobs"] for r in results.values())
                                     / max(kills, 1), 3),
        "manual_steps": sum(r["manual_steps"] for r in results.values()),
        "kills_per_driver": {n: len(r["kills"]) for n, r in results.items()},
        "moments": sorted({k["moment"] for r in results.values() for k in r["kills"]}),
        "differences": different,
        "seed": args.seed,
        "dir": str(root),
    }
    print(json.dumps(summary))
    return summary


def _steps_per_epoch(training: Path) -> int:
    record = training / "run.json"
    return json.loads(record.read_text())["steps_per_epoch"] if record.exists() else 1


if __name__ == "__main__":
    main()
