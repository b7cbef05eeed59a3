"""Analysis throughput: our power spectrum against one FFT, network inference against training.

Figures, each against a peer measured in the same run with the same threads:

* ``pk_over_fft``: seconds of :func:`analysis.power_spectrum.power_spectrum` on a 128^3 float32
  grid of Poisson counts (mean 8; NGP window deconvolution, Poisson shot noise subtracted,
  default logarithmic bins) over seconds of one ``scipy.fft.rfftn`` of the same grid, both
  with ``workers`` = all cores; best of ``REPEATS`` each, the two alternating. Goal <= 2.
* ``inference_over_training_rate``: samples/s of the compiled forward pass
  (``Model.predict_on_batch``) over samples/s of a training step (``Model.train_on_batch``,
  Adam, MSE) of the same Keras model: the tiny default's (``mlperf`` on 16^3 x 2 samples, batch
  16, three targets), on the same batch of random inputs, after warm-up; each the best of
  ``ROUNDS`` rounds of ``STEPS`` calls, the two alternating. Goal >= 3.

The line before the last gives the details (times, rates, inference at batch 64, threads);
the last line is one JSON object with the two figures.

    python bench/analysis.py
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

GRID, BOX, MEAN_COUNT = 128, 256.0, 8.0
REPEATS = 11
MODEL, SAMPLE_SHAPE, N_TARGETS, BATCH, LARGE_BATCH = "mlperf", (16, 16, 16, 2), 3, 16, 64
STEPS, ROUNDS, WARMUP = 20, 5, 3


def pk_over_fft(workers: int) -> dict:
    import scipy.fft

    from analysis.power_spectrum import power_spectrum

    grid = np.random.default_rng(0).poisson(MEAN_COUNT, (GRID,) * 3).astype(np.float32)

    def ours():
        power_spectrum(grid, BOX, kind="counts", assignment="ngp", shot_noise="poisson",
                       workers=workers)

    def fft():
        scipy.fft.rfftn(grid, workers=workers)

    ours(), fft()  # compile the numba kernels, cache the bin geometry, warm the FFT plans
    times = {"ours": [], "fft": []}
    for _ in range(REPEATS):
        for name, function in (("ours", ours), ("fft", fft)):
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in times.items()}
    return {"pk_seconds": best["ours"], "rfftn_seconds": best["fft"],
            "pk_over_fft": best["ours"] / best["fft"]}


def inference_over_training() -> dict:
    import keras

    from training.models import build_model

    keras.utils.set_random_seed(0)
    network = build_model(MODEL, SAMPLE_SHAPE, N_TARGETS, dropout=0.0)
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

    calls = {"train": train, "infer": infer, "infer_large": infer_large}
    for function in calls.values():
        for _ in range(WARMUP):
            function()
    seconds = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, function in calls.items():
            start = time.perf_counter()
            for _ in range(STEPS):
                function()
            seconds[name].append((time.perf_counter() - start) / STEPS)
    rate = {name: (LARGE_BATCH if name == "infer_large" else BATCH) / min(values)
            for name, values in seconds.items()}
    return {"training_samples_per_second": rate["train"],
            "inference_samples_per_second": rate["infer"],
            f"inference_samples_per_second_batch_{LARGE_BATCH}": rate["infer_large"],
            "inference_over_training_rate": rate["infer"] / rate["train"],
            "model": MODEL, "sample_shape": list(SAMPLE_SHAPE), "batch": BATCH}


def main() -> dict:
    workers = os.cpu_count() or 1
    spectrum = pk_over_fft(workers)
    network = inference_over_training()
    import tensorflow as tf

    details = {**spectrum, **network, "fft_workers": workers,
               "tf_intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
               "cpu_count": os.cpu_count()}
    print(json.dumps(details))
    return {"inference_over_training_rate": network["inference_over_training_rate"],
            "pk_over_fft": spectrum["pk_over_fft"]}


if __name__ == "__main__":
    print(json.dumps(main()))
