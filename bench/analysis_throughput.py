"""Analysis throughput: our power spectrum against one FFT, network inference against training.

Figures, each against a peer measured in the same run with the same threads:

* ``pk_over_fft``: seconds of :func:`analysis.power_spectrum.power_spectrum` on a 128^3
  (``--grid``) float32 grid of Poisson counts (mean 8; NGP window deconvolution, Poisson shot
  noise subtracted, default logarithmic bins) over seconds of one ``scipy.fft.rfftn`` of the
  same grid, both with ``workers`` = all cores; best of ``--repeats`` each, the two
  alternating. Goal <= 2.
* ``inference_over_training_rate``: samples/s of the compiled forward pass
  (``Model.predict_on_batch``) over samples/s of a training step (``Model.train_on_batch``,
  Adam, MSE) of the same Keras model: the tiny default's (``mlperf`` on 16^3 x 2 samples, batch
  16, three targets), on the same batch of random inputs, after warm-up; each the best of
  ``--rounds`` rounds of ``--steps`` calls, the two alternating. Goal >= 3.
* ``posterior_over_point_rate``: samples/s of inference with the posterior head
  (``training.head: gaussian``: the forward pass and the unpacking of its means and
  covariances, ``training.models.posterior_moments``) over samples/s of the point head's forward
  pass, the same network otherwise, measured alternating with the two above. Goal >= 0.9.

The line before the last gives the details (times, rates, inference at batch 64, threads);
the last line is one JSON object with the three figures.

    python bench/analysis_throughput.py [--grid 128] [--repeats 11] [--rounds 5] [--steps 20]
                                        [--quick]

About a minute on 2 cores; ``--quick`` (32^3, single repeats) checks in seconds that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from workflow.process import configure_process

configure_process()  # first: TensorFlow and numba read these settings when they load

import numpy as np

from quick_mode import parse_arguments

CELL, MEAN_COUNT = 2.0, 8.0  # Mpc/h per voxel, particles per voxel
MODEL, SAMPLE_SHAPE, N_TARGETS, BATCH, LARGE_BATCH = "mlperf", (16, 16, 16, 2), 3, 16, 64
WARMUP = 3
QUICK = {"grid": 32, "repeats": 1, "rounds": 1, "steps": 2}


def pk_over_fft(grid_size: int, repeats: int, workers: int) -> dict:
    import scipy.fft

    from analysis.power_spectrum import power_spectrum

    grid = np.random.default_rng(0).poisson(MEAN_COUNT, (grid_size,) * 3).astype(np.float32)

    def ours():
        power_spectrum(grid, CELL * grid_size, kind="counts", assignment="ngp",
                       shot_noise="poisson", workers=workers)

    def fft():
        scipy.fft.rfftn(grid, workers=workers)

    ours(), fft()  # compile the numba kernels, cache the bin geometry, warm the FFT plans
    times = {"ours": [], "fft": []}
    for _ in range(repeats):
        for name, function in (("ours", ours), ("fft", fft)):
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in times.items()}
    return {"pk_seconds": best["ours"], "rfftn_seconds": best["fft"],
            "pk_over_fft": best["ours"] / best["fft"]}


def inference_over_training(rounds: int, steps: int) -> dict:
    import keras

    from training.models import build_model, posterior_moments

    keras.utils.set_random_seed(0)
    network = build_model(MODEL, SAMPLE_SHAPE, N_TARGETS, dropout=0.0)
    posterior = build_model(MODEL, SAMPLE_SHAPE, N_TARGETS, dropout=0.0, head="gaussian")
    network.compile(optimizer=keras.optimizers.Adam(5e-4), loss="mse", jit_compile=False)
    rng = np.random.default_rng(1)
    x = np.log1p(rng.poisson(8.0, (LARGE_BATCH, *SAMPLE_SHAPE))).astype(np.float32)
    y = rng.uniform(-1, 1, (LARGE_BATCH, N_TARGETS)).astype(np.float32)
    batch_x, batch_y = x[:BATCH], y[:BATCH]

    def train():
        network.train_on_batch(batch_x, batch_y)

    def infer():
        network.predict_on_batch(batch_x)

    def infer_large():
        network.predict_on_batch(x)

    def infer_posterior():
        posterior_moments(posterior.predict_on_batch(batch_x))

    calls = {"train": train, "infer": infer, "infer_large": infer_large, "infer_posterior": infer_posterior}
    for function in calls.values():
        for _ in range(WARMUP):
            function()
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, function in calls.items():
            start = time.perf_counter()
            for _ in range(steps):
                function()
            seconds[name].append((time.perf_counter() - start) / steps)
    rate = {name: (LARGE_BATCH if name == "infer_large" else BATCH) / min(values)
            for name, values in seconds.items()}
    return {"training_samples_per_second": rate["train"],
            "inference_samples_per_second": rate["infer"],
            f"inference_samples_per_second_batch_{LARGE_BATCH}": rate["infer_large"],
            "inference_over_training_rate": rate["infer"] / rate["train"],
            "posterior_inference_samples_per_second": rate["infer_posterior"],
            "posterior_over_point_rate": rate["infer_posterior"] / rate["infer"],
            "model": MODEL, "sample_shape": list(SAMPLE_SHAPE), "batch": BATCH}


def main(grid: int, repeats: int, rounds: int, steps: int) -> dict:
    workers = os.cpu_count() or 1
    spectrum = pk_over_fft(grid, repeats, workers)
    network = inference_over_training(rounds, steps)
    import tensorflow as tf

    details = {**spectrum, **network, "grid": grid, "fft_workers": workers,
               "tf_intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
               "cpu_count": os.cpu_count()}
    print(json.dumps(details))
    return {"inference_over_training_rate": network["inference_over_training_rate"],
            "posterior_over_point_rate": network["posterior_over_point_rate"],
            "pk_over_fft": spectrum["pk_over_fft"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=128,
                        help="voxels per side of the P(k) grid, 2 Mpc/h each (default 128)")
    parser.add_argument("--repeats", type=int, default=11,
                        help="alternated P(k) and FFT timings, best kept (default 11)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternated rounds of training and inference calls (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="calls per round (default 20)")
    args = parse_arguments(parser, QUICK)
    print(json.dumps(main(args.grid, args.repeats, args.rounds, args.steps)))
