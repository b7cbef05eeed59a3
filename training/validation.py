"""The trained network against the predict-the-training-mean baseline, per parameter.

In the scaled targets of the input pipeline (each parameter mapped to [-1, 1] over the
manifest's target range), over the N samples of the validation split, for each parameter p
(prediction: the network's output; with ``training.head: gaussian``, its posterior mean,
training.models.mean_network):

    mse_p      = sum (prediction_p - y_p)^2 / N
    baseline_p = sum (mean_train(y_p) - y_p)^2 / N
               = (sum y_p^2 - 2 m_p sum y_p + N m_p^2) / N,  m_p = mean_train(y_p)
    ratio_p    = mse_p / baseline_p   (below 1: the network beats the constant predictor)

The expanded baseline needs only sums (:func:`mean_predictor_mse`, which the analysis stage's
predict-the-training-mean baseline uses too), so every rank sums over its own files (the split's
unshuffled sharding, training.pipeline.validation_part) and one allreduce combines them. The
training mean parses only the training records' ``y`` (no ``x`` is decoded, no network runs),
but still reads the training files' bytes once: one epoch's I/O, under 1% of a 130-epoch run.
"""

from __future__ import annotations

import numpy as np

from preprocessing.manifest import Manifest
from preprocessing.tfrecords import read_targets
from training.pipeline import validation_dataset, validation_part


def mean_predictor_mse(count, y_sum, y_sq, mean) -> np.ndarray:
    """Mean squared error of predicting ``mean`` for N = ``count`` targets y, from their sums
    only (per parameter): sum (m - y)^2 / N = (sum y^2 - 2 m sum y + N m^2) / N. Sums add up over
    MPI ranks, so training computes the baseline of its validation figures with one allreduce."""
    mean = np.asarray(mean, np.float64)
    return (np.asarray(y_sq, np.float64) - 2 * mean * np.asarray(y_sum, np.float64)
            + count * mean**2) / count


def _training_target_sums(manifest: Manifest, split: str, rank: int, n_ranks: int) -> np.ndarray:
    """[count, sum of scaled y per parameter...] over ``rank``'s part of the training split."""
    def read(files):
        return read_targets(files, manifest.compression, len(manifest.parameters)).map(
            manifest.scale_targets)

    targets, count = validation_part(manifest, split, rank, n_ranks, read)
    total = np.zeros(len(manifest.parameters))
    for batch in targets.batch(1024):
        total += batch.numpy().sum(axis=0, dtype=np.float64)
    return np.concatenate([[count], total])


def validation_against_mean(network, manifest: Manifest, train_split: str, validation_split: str,
                            batch_size: int, comm) -> dict:
    """Each parameter's validation MSE, the training-mean baseline's, and their ratio.

    Collective: every rank of ``comm`` (mpi4py, or training.mpi.SerialCommunicator)
    calls it. Returns ``{"split", "samples", "parameters": {name: {"mse", "baseline_mse",
    "ratio"}}, "mean_ratio"}`` (scaled targets).
    """
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    n = len(manifest.parameters)
    sums = np.zeros(1 + 3 * n)  # count, sum (p - y)^2, sum y, sum y^2
    data, _ = validation_dataset(manifest, validation_split, batch_size, rank, n_ranks)
    for x, y in data:
        predicted = network(x, training=False).numpy().astype(np.float64)
        y = y.numpy().astype(np.float64)
        sums += np.concatenate([[len(y)], ((predicted - y) ** 2).sum(0), y.sum(0), (y**2).sum(0)])
    local = np.concatenate([sums, _training_target_sums(manifest, train_split, rank, n_ranks)])
    total = np.empty_like(local)
    comm.Allreduce(local, total)  # op: sum
    count, squared_error, y_sum, y_sq = total[0], *total[1:1 + 3 * n].reshape(3, n)
    train_count, train_sum = total[1 + 3 * n], total[2 + 3 * n:]
    train_mean = train_sum / train_count
    mse = squared_error / count
    baseline = mean_predictor_mse(count, y_sum, y_sq, train_mean)
    ratios = mse / baseline
    return {
        "split": validation_split, "samples": int(count),
        "parameters": {name: {"mse": float(m), "baseline_mse": float(b), "ratio": float(r)}
                       for name, m, b, r in zip(manifest.parameters, mse, baseline, ratios)},
        "mean_ratio": float(ratios.mean()),
    }
