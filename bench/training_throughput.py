"""Training throughput: the paper network at 128^3 through the real input pipeline, over MPI.

Synthetic TFRecords (Poisson counts, int16, written by the real preprocessing functions) are
read through ``training.pipeline``; training runs through ``training.run.train_network``
(``--samples`` samples of ``--grid``^3 voxels, by default 16 of 128^3, batch 2, ``--epochs``
epochs).
Figures, each against a floor or peer measured in the same run:

* ``gflops_over_sgemm``: achieved training Gflop/s of ``cosmoflow_paper`` at 128^3 x 1, float32,
  one rank with all cores (analytic flops per sample x samples/s, best epoch after the first,
  best of ``--rounds`` runs),
  divided by numpy float32 matmul Gflop/s (4096^3 by default, best of 5, same cores; the best
  of such measurements before every round and after the last, like the training rate), measured
  in a subprocess with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE removed from its environment; the
  BLAS kernel threadpoolctl reports is printed. Goal >= 0.75. Its ceiling, printed with the details:
  the network's Conv3D layers alone, each timed by itself (forward, backward to the weights and,
  but for the first, to the inputs; best of the same before-and-after measurements), over the
  same sgemm.
* ``pipeline_over_training``: samples/s of the input pipeline alone (read, decode, normalise,
  augment, batch) over the training samples/s above. Goal >= 5.
* ``weak_scaling_2``: samples/s of 2 ranks x 1 thread over twice that of 1 rank x 1 thread,
  same network, batch and number of samples per rank (``mpiexec``, each rank bound to a core of
  its own, as on a cluster: ``-bind-to``). Goal >= 0.9. Its ceiling on this machine, with no
  communication at all, is printed with the details: two independent 1-rank runs at the same
  time, on cores 0 and 1, over twice one alone (cores sharing cache, memory bandwidth and turbo
  clock). The three alternate over ``--rounds`` rounds; each keeps its best epoch.
* ``overhead_vs_fit``: epoch time of our data-parallel ``train_step`` at 1 rank over that of
  plain ``keras.Model.fit`` with the same network, optimiser and batches, minus 1 (each the best
  epoch of ``--rounds`` runs, the two alternating). Goal <= 0.05.

Where a training step's time goes (``step_seconds``, also in the last line): TensorFlow's profiler
(``tf.profiler.experimental``) records one epoch of our ``train_step`` (one rank, all cores, after
an untimed first epoch); the TensorFlow operations in the profile it writes (``*.xplane.pb``,
what TensorBoard's trace viewer shows) are summed by kind (``OPERATION_KINDS``), in seconds of
operation time per step. TensorFlow's inter-op threads run operations at the same time, so the
sum can exceed the step's wall time (``profiled_step_wall_seconds`` in the details). A fused
operation counts under its main one (a convolution with its bias and activation under
convolutions). A table of them is printed first.

Last line: one JSON object with these five keys (the line before has the details).

    python bench/training_throughput.py [--grid 128] [--samples 16] [--epochs 6] [--rounds 2]
                                        [--sgemm-size 4096] [--quick]

About 18 minutes on 2 cores; ``--quick`` (32^3, 1024^3 matmul, one round of 2 epochs) about a
minute, to check that it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first: TensorFlow reads these settings when it is imported

import numpy as np

from quick_mode import parse_arguments

PARAMETERS = ("Omega_m", "sigma_8", "n_s")
RANGES = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.9, 1.0)}
BATCH = 2
QUICK = {"grid": 32, "samples": 8, "epochs": 2, "rounds": 1, "sgemm_size": 1024}
WORKER = Path(__file__).resolve().parents[1] / "tests" / "mpi_training.py"
"""The tests' training script, run by each rank: ``WORKER MANIFEST OUT SETTINGS_JSON``."""

SGEMM = r"""
import json, sys, time, numpy as np
from threadpoolctl import threadpool_info
n = int(sys.argv[1])
a, b = (np.random.default_rng(i).standard_normal((n, n), dtype=np.float32) for i in (0, 1))
a @ b
times = []
for _ in range(5):
    start = time.perf_counter()
    a @ b
    times.append(time.perf_counter() - start)
best = min(times)
blas = [{k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
        for i in threadpool_info() if i.get("user_api") == "blas"]
print(json.dumps({"gflops": 2 * n**3 / best / 1e9, "blas": blas}))
"""


def sgemm_gflops(n: int) -> dict:
    """numpy float32 matmul Gflop/s (n x n by n x n), measured in a subprocess without the
    OpenBLAS overrides."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    out = subprocess.run([sys.executable, "-c", SGEMM, str(n)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_data(directory: Path, size: int, n_samples: int, samples_per_file: int) -> Path:
    """``n_samples`` one-sub-volume simulations of Poisson counts (size^3, int16) -> manifest."""
    from preprocessing.histogram import write_histogram
    from preprocessing.manifest import build_manifest
    from preprocessing.tfrecords import plan_split, write_split_shard

    rng = np.random.default_rng(0)
    histograms, targets = {}, {}
    for sim_id in range(n_samples):
        counts = rng.poisson(8.0, (1, size, size, size)).astype(np.int16)
        histograms[sim_id] = write_histogram(directory / f"{sim_id:05d}.h5", counts, 2.0 * size,
                                             (0.0,), "ngp", sim_id)
        targets[sim_id] = tuple(float(rng.uniform(*RANGES[p])) for p in PARAMETERS)
    plan = plan_split(list(histograms), 1, samples_per_file, 0, "train")
    for shard in range(plan.n_shards):
        write_split_shard(plan, shard, histograms, targets, PARAMETERS, directory / "tfrecords",
                          size)
    return build_manifest(directory / "tfrecords", RANGES)


def best_rate(run_json: dict) -> float:
    """Highest samples/s over the epochs after the first (which includes tracing)."""
    return max(row["samples_per_second"] for row in run_json["history"][1:])


def settings(epochs: int, **changes):
    """The paper's network and optimiser (Adam with LARC), one rank on every core."""
    from training.settings import TrainingSettings
    from workflow.config import validate_config

    paper = {"model": "cosmoflow_paper", "larc": True, "learning_rate": 0.001, "dropout": None,
             "threads": 0, "epochs": epochs, "batch_size": BATCH}
    return TrainingSettings.from_mapping(validate_config({"training": paper})["training"]
                                         | {"validation_split": None, **changes})


def compiled_model(manifest_path: Path, train_settings, data_parallel: bool):
    """(model, training batches of all epochs, plan): the network of ``train_settings`` with its
    optimiser, compiled as ``train_network`` compiles it, wrapped in our ``DataParallelModel``
    (one rank) if ``data_parallel``, else plain."""
    import keras

    from preprocessing.manifest import load_manifest
    from training.distributed import DataParallelModel
    from training.models import build_model
    from training.mpi import world_communicator
    from training.optimizers import make_optimizer
    from training.pipeline import make_plan, training_dataset

    manifest = load_manifest(manifest_path)
    plan = make_plan(manifest, "train", 1, train_settings.batch_size)
    keras.utils.set_random_seed(train_settings.seed)
    model = build_model(train_settings.model, manifest.shape, 3)
    if data_parallel:
        model = DataParallelModel(model, world_communicator())
    model.compile(optimizer=make_optimizer(train_settings, plan.steps_per_epoch), loss="mse",
                  jit_compile=False)
    data = training_dataset(manifest, plan, "train", 0, train_settings.seed,
                            train_settings.shuffle_buffer, train_settings.augment,
                            range(train_settings.epochs))
    return model, data, plan


def plain_fit_rate(manifest_path: Path, train_settings) -> float:
    """Best samples/s of plain keras fit() on the same network, optimiser and batches."""
    import keras

    network, data, plan = compiled_model(manifest_path, train_settings, data_parallel=False)

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.began)

    seconds: list[float] = []
    network.fit(data, epochs=train_settings.epochs, steps_per_epoch=plan.steps_per_epoch,
                verbose=0, callbacks=[Timer()])
    return plan.n_samples / min(seconds[1:])


OPERATION_KINDS = {
    "convolutions": "Conv3D forward (fused with bias and activation where TensorFlow fuses them) "
                    "and its gradients",
    "bias_activation": "BiasAdd, LeakyRelu and their gradients, where not fused",
    "pooling": "average or max pooling and its gradient",
    "dense": "the dense head's matrix products (fused with bias and activation where fused)",
    "optimizer": "the optimiser's update (Adam, LARC)",
    "allreduce": "the MPI allreduce of the gradients (none at one rank)",
    "other": "loss, its gradient, the gradients' division by the batch weight, metrics",
}


TF_OPERATION = re.compile(r"([A-Za-z0-9.][\w.\-/>]*):([A-Z_]\w*)")
"""A profiler event of a TensorFlow operation, ``name:type`` (the profiler's own test of a
TensorFlow op's full name, tsl/profiler/utils/tf_op_utils.cc); other events are not operations."""


def step_seconds(manifest_path: Path, train_settings, logdir: Path) -> tuple[dict[str, float], float]:
    """Seconds of TensorFlow operations per step of our ``train_step``, by kind of operation
    (:func:`operation_kind`), and wall seconds per step, in the second of two epochs (the
    profiled one)."""
    import keras
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    class Profile(keras.callbacks.Callback):  # the second epoch: the first traces the step
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                tf.profiler.experimental.start(str(logdir))
                self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.seconds = time.perf_counter() - self.began
                tf.profiler.experimental.stop()

    model, data, plan = compiled_model(manifest_path, train_settings, data_parallel=True)
    steps = plan.steps_per_epoch
    profile = Profile()
    model.fit(data, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[profile])
    space = xplane_pb2.XSpace()
    space.ParseFromString(next(logdir.glob("plugins/profile/*/*.xplane.pb")).read_bytes())
    seconds = dict.fromkeys(OPERATION_KINDS, 0.0)
    for plane in space.planes:
        for line in plane.lines:
            if line.name.startswith("tf_data"):  # the input pipeline, preparing later batches
                continue
            for event in line.events:
                operation = TF_OPERATION.fullmatch(plane.event_metadata[event.metadata_id].name)
                if operation:
                    seconds[operation_kind(*operation.groups(), model.optimizer.name)] += (
                        event.duration_ps * 1e-12 / steps)
    return seconds, profile.seconds / steps


def operation_kind(name: str, op_type: str, optimizer: str) -> str:
    """The kind (a key of OPERATION_KINDS) of the TensorFlow operation ``name`` of type
    ``op_type``; ``optimizer``: the optimiser's name scope."""
    if op_type in ("PyFunc", "EagerPyFunc"):  # tf.numpy_function: training.distributed's allreduce
        return "allreduce"
    if f"/{optimizer}/" in f"/{name}":
        return "optimizer"
    for kind, marks in (("convolutions", ("Conv3D",)), ("pooling", ("Pool",)), ("dense", ("MatMul",)),
                        ("bias_activation", ("BiasAdd", "Relu"))):
        if any(mark in op_type for mark in marks):
            return kind
    return "other"


def pipeline_rate(manifest_path: Path, train_settings) -> float:
    """Samples/s of the input pipeline alone, all epochs, after the first batch."""
    from preprocessing.manifest import load_manifest
    from training.pipeline import make_plan, training_dataset

    manifest = load_manifest(manifest_path)
    plan = make_plan(manifest, "train", 1, train_settings.batch_size)
    data = iter(training_dataset(manifest, plan, "train", 0, train_settings.seed,
                                 train_settings.shuffle_buffer, train_settings.augment,
                                 range(train_settings.epochs)))
    next(data)
    start, batches = time.perf_counter(), 0
    for _ in data:
        batches += 1
    return batches * plan.batch_size / (time.perf_counter() - start)


def convolution_ceiling(grid: int, batch: int) -> float:
    """Gflop/s of the paper network's Conv3D layers alone at grid^3, each timed by itself (best
    of 3): forward, backward to the weights and, but for the first layer, to the inputs."""
    import keras
    import tensorflow as tf

    from training.flops import TRAINING_PASSES, layer_costs
    from training.models import build_model

    network = build_model("cosmoflow_paper", (grid, grid, grid, 1), len(PARAMETERS))
    costs = {cost.name: cost for cost in layer_costs(network)}
    seconds = flops = 0.0
    for layer in network.layers:
        if not isinstance(layer, keras.layers.Conv3D):
            continue
        first = layer.input is network.input
        x = tf.random.normal((batch,) + tuple(layer.input.shape[1:]))

        @tf.function(autograph=False)  # plain Python: nothing for AutoGraph to convert
        def step(x, layer=layer, first=first):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
            sources = layer.trainable_variables + ([] if first else [x])
            return tape.gradient(y, sources, output_gradients=tf.ones_like(y))

        step(x)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            [g.numpy() for g in step(x)]
            times.append(time.perf_counter() - start)
        seconds += min(times)
        passes = TRAINING_PASSES - 1 if first else TRAINING_PASSES  # no gradient to the data
        flops += batch * costs[layer.name].forward_flops * passes
    return flops / seconds / 1e9


def mpi_runs(runs: list[tuple[Path, Path, int, str]], epochs: int) -> list[dict]:
    """run.json of each (manifest, output, ranks, cores) run, ranks x 1 thread under mpiexec with
    rank i bound to the i-th of the comma-separated ``cores``; the runs execute at the same time."""
    config = json.dumps(settings(epochs, threads=1, inter_op_threads=1).to_dict())
    processes = [subprocess.Popen(["mpiexec", "-bind-to", f"user:{cores}", "-n", str(ranks),
                                   sys.executable, str(WORKER), str(manifest_path),
                                   str(out), config],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for manifest_path, out, ranks, cores in runs]
    for process in processes:
        _, stderr = process.communicate()
        if process.returncode:
            raise RuntimeError(f"{process.args} failed:\n{stderr.decode()[-2000:]}")
    return [json.loads((out / "run.json").read_text()) for _, out, _, _ in runs]


def main(grid: int, samples: int, epochs: int, rounds: int, sgemm_size: int) -> dict:
    from training.run import train_network

    logging.basicConfig(level=logging.WARNING)
    sgemms, convolutions = [], []

    def measure_peers() -> None:  # before every round and after the last; the best is kept
        sgemms.append(sgemm_gflops(sgemm_size))
        convolutions.append(convolution_ceiling(grid, BATCH))

    with tempfile.TemporaryDirectory(prefix="bench_training_") as tmp:
        tmp = Path(tmp)
        manifest = write_data(tmp / "data", grid, samples, 4)
        half = write_data(tmp / "half", grid, samples // 2, 4)
        ours_rates, fit_rates, one_rates, two_rates, pair_rates = [], [], [], [], []
        for attempt in range(rounds):  # interleaved, so that a slow spell hits all alike
            measure_peers()
            ours = train_network(manifest, tmp / f"ours{attempt}", settings(epochs))
            ours_rates.append(best_rate(ours))
            fit_rates.append(plain_fit_rate(manifest, settings(epochs)))
            one_rank, = mpi_runs([(half, tmp / f"one{attempt}", 1, "0")], epochs)
            two_ranks, = mpi_runs([(manifest, tmp / f"two{attempt}", 2, "0,1")], epochs)
            pair = mpi_runs([(half, tmp / f"pair{attempt}_{core}", 1, str(core))
                             for core in (0, 1)], epochs)
            one_rates.append(best_rate(one_rank))
            two_rates.append(best_rate(two_ranks))
            pair_rates.append(sum(best_rate(run) for run in pair))
        input_rate = pipeline_rate(manifest, settings(4))
        breakdown, step_wall = step_seconds(manifest, settings(2), tmp / "profile")
    measure_peers()
    sgemm = max(sgemms, key=lambda measured: measured["gflops"])
    conv_gflops = max(convolutions)
    ours_rate, fit_rate, one_rate, two_rate = (max(r) for r in (ours_rates, fit_rates, one_rates,
                                                                 two_rates))
    achieved = ours_rate * ours["model"]["training_flops_per_sample"] / 1e9
    details = {
        "sgemm_gflops": sgemm["gflops"], "sgemm_gflops_runs": [m["gflops"] for m in sgemms],
        "blas": sgemm["blas"],
        "training_samples_per_second": ours_rate, "training_gflops": achieved,
        "convolutions_alone_gflops": conv_gflops,
        "convolutions_alone_over_sgemm": conv_gflops / sgemm["gflops"],
        "onednn": ours["threads"]["onednn"], "training_samples_per_second_runs": ours_rates,
        "plain_fit_samples_per_second_runs": fit_rates,
        "training_flops_per_sample": ours["model"]["training_flops_per_sample"],
        "paper_knl_gflops": 535.0, "allreduce_fraction_1_rank": ours["allreduce_fraction"],
        "plain_fit_samples_per_second": fit_rate, "pipeline_samples_per_second": input_rate,
        "one_rank_one_thread_samples_per_second_runs": one_rates,
        "two_ranks_one_thread_samples_per_second_runs": two_rates,
        "allreduce_fraction_2_ranks": two_ranks["allreduce_fraction"], "threads": ours["threads"],
        "two_independent_one_rank_runs_efficiency": max(pair_rates) / (2 * one_rate),
        "profiled_step_wall_seconds": step_wall,
    }
    total = sum(breakdown.values())
    print(f"operation seconds per training step at {grid}^3 x batch {BATCH} (TensorFlow profiler; "
          f"{total:.3g} s in all, the step's wall time {step_wall:.3g} s):")
    for kind, seconds in breakdown.items():
        print(f"  {kind:16s} {seconds:8.4f} s {seconds / total:6.1%}  {OPERATION_KINDS[kind]}")
    print(json.dumps(details))
    return {
        "gflops_over_sgemm": achieved / sgemm["gflops"],
        "pipeline_over_training": input_rate / ours_rate,
        "weak_scaling_2": two_rate / (2 * one_rate),
        "overhead_vs_fit": fit_rate / ours_rate - 1.0,
        "step_seconds": breakdown,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=128, help="voxels per side (default 128)")
    parser.add_argument("--samples", type=int, default=16,
                        help="training samples, in files of 4 (default 16)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs of every run (default 6)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternated rounds of every measured run, best kept (default 2)")
    parser.add_argument("--sgemm-size", type=int, default=4096,
                        help="rows and columns of the matmul floor (default 4096)")
    args = parse_arguments(parser, QUICK)
    if args.epochs < 2 or args.samples < 8:
        parser.error("--epochs >= 2 (the first, tracing, is not timed) and --samples >= 8 "
                     "(half of them in files of 4 for each of 2 ranks)")
    print(json.dumps(main(args.grid, args.samples, args.epochs, args.rounds, args.sgemm_size)))
