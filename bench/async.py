"""Asynchronous against synchronous training (training.mode), with and without a straggler.

The tiny default's training settings (MLPerf network, batch 16 per rank, Adam 5e-4 without LARC,
no dropout) on the tests' learnable synthetic data (tests/mpi_training.py: 48 (``--simulations``)
training simulations of 8 sub-volumes of 16^3, in files of 8; 8 validation simulations), 10
(``--epochs``) epochs, each rank one thread, under ``mpiexec``; ``--optimizer sgd`` trains with
SGD and momentum 0.9 at a learning rate of 0.01 instead (not tuned). 2 ranks are bound to a
core each (as on a cluster); 3 ranks share the 2 cores of this machine unbound. Every
configuration runs
``--rounds`` times (3, the default: about 20 minutes on 2 idle cores), the runs of a round
alternating sync and async so that a slow spell hits both alike. Each figure is a ratio, async
over sync, of the two runs of one round, and the median of the rounds' ratios (pairing within a
round: on a shared machine a mode's speed varies by up to 30% between rounds, and picking one
round by the speed of one mode would select its lucky spells). The figures:

* ``straggler_speedup``: on 2 and 3 ranks, the last rank sleeping after every step
  (``--slowdown`` - 1) times a step's time (COSMOFLOW_STRAGGLER_DELAY_S, calibrated
  on the synchronous run without a straggler of the same round), training samples/s (= steps/s,
  a step being a global batch) over the epochs after the first (which includes tracing); the
  two runs of a round share the delay. Goal >= 1.3 for "one
  rank slowed by 50%": read as 1.5 times the step time (the default) or as half the speed
  (``--slowdown 2``). The ceilings (every rank busy all the time, no overhead) are printed with
  the details: for N ranks one of which is X times slower, (N - 1 + 1/X) / (N / X), 1.25 on 2
  ranks and 1.33 on 3 for X = 1.5, 1.5 and 1.67 for X = 2.
* ``time_to_loss_ratio``: with the same straggler, training seconds (all epochs, validation
  excluded) until the validation loss reaches, for good, the worse of the two runs' final ones.
  Goal <= 0.85.
* ``rma_overhead``: without a straggler, on 2 ranks, time per step of async over sync, steps of
  equal size: the time all ranks spent inside their steps (``step_seconds`` in the history, from
  Keras's on_train_batch_begin to on_train_batch_end, fetching the batch included) per training
  sample, in the epochs after the first. Per sample, because a rank
  of ``async`` may end an epoch with a short batch. Goal <= 1.05. The details add the 3-rank
  figure and the ratios of whole epochs (the inverse ratio of samples/s), which also count what
  happens between steps and at an epoch's end: there the ranks of ``async`` wait for the last
  step of the rank that finishes last (up to one step per epoch: 8% of this benchmark's epochs
  on 2 ranks, 12.5% on 3), and the next epoch's data set is only then set up.

Async runs use ``max_staleness`` = ``MAX_STALENESS``. Last line: one JSON object with these
three keys (per rank count where the figure has one); the line before has the details.

    python bench/async.py [--rounds N] [--slowdown X] [--optimizer adam|sgd] [--ranks 2 3]
                          [--epochs 10] [--simulations 48] [--quick]

``--quick`` (2 ranks only, one round of 2 epochs on 16 simulations; about a minute on 2 cores)
checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from importlib import util
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first, as every entry point of the pipeline (the ranks inherit it)

from machine import cpu_description
from quick_mode import parse_arguments
from training.settings import STRAGGLER_DELAY_VARIABLE
from workflow.config import schema_enum

WORKER = Path(__file__).resolve().parents[1] / "tests" / "mpi_training.py"
"""The tests' training script (and synthetic data set): ``WORKER MANIFEST OUT SETTINGS_JSON``."""

MAX_STALENESS = 4
SETTINGS = {"model": "mlperf", "batch_size": 16, "optimizer": "adam",
            "learning_rate": 5e-4, "larc": False, "dropout": 0.0, "shuffle_buffer": 16,
            "threads": 1, "inter_op_threads": 1, "seed": 0}
OPTIMIZERS = {"adam": {}, "sgd": {"optimizer": "sgd", "learning_rate": 0.01, "momentum": 0.9}}
"""``--optimizer``: the tiny default's Adam, or SGD with momentum (learning rate not tuned)."""
BINDING = {2: ["-bind-to", "user:0,1"], 3: []}
MODES = schema_enum("training.mode")


def run(manifest: Path, out: Path, ranks: int, straggler_delay_s: float = 0.0, **changes) -> dict:
    """run.json of one training run of ``ranks`` ranks with SETTINGS and ``changes``, the last
    rank sleeping ``straggler_delay_s`` after every step."""
    settings = json.dumps({**SETTINGS, **changes})
    process = subprocess.run(["mpiexec", *BINDING[ranks], "-n", str(ranks), sys.executable,
                              str(WORKER), str(manifest), str(out), settings],
                             env=os.environ | {STRAGGLER_DELAY_VARIABLE: str(straggler_delay_s)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if process.returncode:
        raise RuntimeError(f"{process.args} failed:\n{process.stderr[-3000:]}")
    return json.loads((out / "run.json").read_text())


def rate(record: dict) -> float:
    """Training samples/s over the epochs after the first."""
    rows = record["history"][1:]
    return record["train_samples"] * len(rows) / sum(row["epoch_seconds"] for row in rows)


def epoch_seconds_per_step(record: dict) -> float:
    """Seconds per synchronous step over the epochs after the first (whole epochs)."""
    rows = record["history"][1:]
    return sum(row["epoch_seconds"] for row in rows) / (len(rows) * record["steps_per_epoch"])


def in_step_seconds_per_sample(record: dict) -> float:
    """Seconds all ranks spent inside steps per training sample, over the epochs after the
    first: step_seconds (a mean over every rank's steps) times the steps of all ranks."""
    steps = ({row["epoch"]: sum(row["steps"]) for row in record["async"]["epochs"]}
             if record.get("async") else None)
    rows = record["history"][1:]
    total = sum(row["step_seconds"] * (steps[int(row["epoch"])] if steps else
                                       record["steps_per_epoch"] * record["ranks"])
                for row in rows)
    return total / (record["train_samples"] * len(rows))


def seconds_to_loss(record: dict, target: float) -> float:
    """Training seconds until the end of the first epoch from which the validation loss stays
    <= target (a run whose loss barely falls can dip below the target by chance in an early
    epoch: 3 ranks, async, epoch 1 of 10, in one run)."""
    rows = record["history"]
    reached = len(rows)
    while reached > 0 and rows[reached - 1]["val_loss"] <= target:
        reached -= 1
    if reached == len(rows):
        return float("inf")
    return sum(row["epoch_seconds"] for row in rows[:reached + 1])


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(rounds: int, slowdown: float, optimizer: str, ranks_tried: list[int], epochs: int,
         simulations: int) -> dict:
    spec = util.spec_from_file_location("mpi_training", WORKER)
    mpi_training = util.module_from_spec(spec)
    spec.loader.exec_module(mpi_training)

    details = {"cpu": cpu_description(), "cores": os.cpu_count(),
               "load_average_before": load_average(), "epochs": epochs, "rounds": rounds,
               "training_simulations": simulations, "max_staleness": MAX_STALENESS,
               "straggler_slowdown": slowdown, "settings": {**SETTINGS, **OPTIMIZERS[optimizer]}}
    figures = {"straggler_speedup": {}, "time_to_loss_ratio": {}, "rma_overhead": {}}
    changes = {"epochs": epochs, "max_staleness": MAX_STALENESS, **OPTIMIZERS[optimizer]}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        tmp = Path(tmp)
        manifest = mpi_training.write_dataset(tmp / "data", {"train": simulations, "val": 8},
                                              seed=1)
        for ranks in ranks_tried:
            plain = {mode: [] for mode in MODES}
            straggled = {mode: [] for mode in MODES}
            delays = []
            for attempt in range(rounds):
                for mode in MODES:
                    plain[mode].append(run(manifest, tmp / f"{ranks}{mode}{attempt}", ranks,
                                           mode=mode, **changes))
                # a share of a step of this round's synchronous run: the straggler is
                # `slowdown` times slower under the load of the moment
                delay = (slowdown - 1) * epoch_seconds_per_step(plain["sync"][-1])
                delays.append(delay)
                for mode in MODES:
                    straggled[mode].append(run(manifest, tmp / f"{ranks}{mode}{attempt}s", ranks,
                                               mode=mode, straggler_delay_s=delay,
                                               **changes))
            # each figure: the median over rounds of async over sync within a round
            speedups = [rate(a) / rate(b) for a, b in zip(straggled["async"], straggled["sync"])]
            targets = [max(a["history"][-1]["val_loss"], b["history"][-1]["val_loss"])
                       for a, b in zip(straggled["async"], straggled["sync"])]
            seconds = {mode: [seconds_to_loss(r, t) for r, t in zip(straggled[mode], targets)]
                       for mode in MODES}
            to_loss = [a / b for a, b in zip(seconds["async"], seconds["sync"])]
            in_step = {mode: [in_step_seconds_per_sample(r) for r in plain[mode]] for mode in MODES}
            overheads = [a / b for a, b in zip(in_step["async"], in_step["sync"])]
            figures["straggler_speedup"][str(ranks)] = statistics.median(speedups)
            figures["time_to_loss_ratio"][str(ranks)] = statistics.median(to_loss)
            figures["rma_overhead"][str(ranks)] = statistics.median(overheads)
            details[f"{ranks}_ranks"] = {
                "straggler_delay_s_per_round": delays,
                "straggler_speedup_per_round": speedups,
                "straggler_speedup_ceiling": (ranks - 1 + 1 / slowdown) / (ranks / slowdown),
                "time_to_loss_ratio_per_round": to_loss,
                "rma_overhead_per_round": overheads,
                "samples_per_second": {
                    f"{name}_{mode}": [rate(r) for r in runs[mode]]
                    for name, runs in (("plain", plain), ("straggled", straggled))
                    for mode in runs},
                "in_step_seconds_per_sample": in_step,
                "epoch_time_ratio_no_straggler_per_round": [
                    rate(b) / rate(a) for a, b in zip(plain["async"], plain["sync"])],
                "target_val_loss_per_round": targets,
                "seconds_to_target_per_round": seconds,
                "val_loss": {mode: [[row["val_loss"] for row in r["history"]]
                                    for r in straggled[mode]] for mode in MODES},
                "validation_mean_ratio": {mode: [r["validation"]["mean_ratio"]
                                                 for r in straggled[mode]] for mode in MODES},
                "async_plain": [{k: v for k, v in r["async"].items() if k != "epochs"}
                                for r in plain["async"]],
                "async_straggled": [{k: v for k, v in r["async"].items() if k != "epochs"}
                                    for r in straggled["async"]],
                "async_straggled_steps_per_rank_last_epoch": [r["async"]["epochs"][-1]["steps"]
                                                              for r in straggled["async"]],
            }
    details["load_average_after"] = load_average()
    if "3" in figures["rma_overhead"]:
        details["rma_overhead_3_ranks"] = figures["rma_overhead"].pop("3")
    print(json.dumps(details))
    figures["rma_overhead"] = figures["rma_overhead"]["2"]
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of every configuration; each figure is the median over rounds")
    parser.add_argument("--slowdown", type=float, default=1.5,
                        help="the straggler's step time over the others' (default 1.5)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam",
                        help="adam (the tiny default's) or sgd (momentum 0.9, learning rate 0.01)")
    parser.add_argument("--ranks", type=int, nargs="+", choices=sorted(BINDING), default=[2, 3],
                        help="rank counts to run, 2 among them (default 2 3)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of every run (default 10)")
    parser.add_argument("--simulations", type=int, default=48,
                        help="training simulations of 8 samples each (default 48)")
    args = parse_arguments(parser, {"rounds": 1, "ranks": [2], "epochs": 2, "simulations": 16})
    if args.slowdown < 1:
        parser.error(f"--slowdown {args.slowdown}: a straggler's step cannot be faster (>= 1)")
    if 2 not in args.ranks or args.epochs < 2:
        parser.error("--ranks must include 2 (rma_overhead is the 2-rank figure) and --epochs be "
                     ">= 2 (the first, with tracing, is not timed)")
    print(json.dumps(main(args.rounds, args.slowdown, args.optimizer, args.ranks, args.epochs,
                          args.simulations)))
