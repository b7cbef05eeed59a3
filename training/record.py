"""The record of a run of :func:`training.run.train_network`: ``model.keras`` and ``run.json``
(its content: training.run), written by rank 0 once training is done."""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import keras
import numpy as np

from training.models import mean_network
from training.mpi import mpi_library_version
from training.validation import validation_against_mean
from workflow.io import atomic_path, atomic_write_text
from workflow.logs import PROGRESS
from workflow.version import CODE_VERSION

if TYPE_CHECKING:
    from training.run import TrainingRun

log = logging.getLogger(__name__)

PAPER_TRAINING_FLOPS_128 = 69.33e9  # Mathuriya et al. 2018, Sec. V-A, batch size one


def write_run_record(run: TrainingRun, network: keras.Model, model, cost: dict, rows: list[dict],
                     started: str, resumed: tuple[int, int], asynchronous_record: dict | None) -> dict:
    """Collective: validate ``network``, compare the ranks' weights, and on rank 0 save it and
    write ``run.json``; return its content.

    ``model`` is its data-parallel wrapper, ``cost`` its training.flops.summary, ``rows`` the
    epochs' rows of training.fit.Progress, ``resumed`` the (epoch, step) training resumed from,
    ``asynchronous_record`` what AsyncDataParallelModel.close returned (None in sync mode).
    """
    settings, comm, n_ranks = run.settings, run.comm, run.n_ranks
    rates = [row["samples_per_second"] for row in rows]
    mean_rate = float(np.mean(rates)) if rates else None
    train_seconds = sum(row["epoch_seconds"] for row in rows)
    record = {
        "code_version": CODE_VERSION,
        "manifest": str(run.manifest_path),
        "settings": settings.to_dict(),
        "seed": settings.seed,
        "ranks": n_ranks,
        "threads": _threads(),
        "versions": _versions(comm),
        "model": {"name": settings.model, "input_shape": list(run.manifest.shape), **cost},
        "paper_training_flops_per_sample_128": PAPER_TRAINING_FLOPS_128,
        "global_batch": settings.batch_size * n_ranks,
        "steps_per_epoch": run.plan.steps_per_epoch,
        "train_samples": run.plan.n_samples,
        "train_simulations": len(run.manifest.simulations(settings.train_split)),
        "samples_per_second": mean_rate,
        "achieved_gflops": mean_rate * cost["training_flops_per_sample"] / 1e9 if rates else None,
        "mode": settings.mode,
        "allreduce_seconds": None if asynchronous_record else model.allreduce.seconds,
        "allreduce_fraction": (model.allreduce.seconds / train_seconds
                               if train_seconds and not asynchronous_record else None),
        "async": asynchronous_record,
        "weights_sha256_per_rank": comm.allgather(_weights_digest(network)),
        "node_local_staging": comm.allgather(run.staged) if run.staged else None,
        "resumed_from": {"epoch": resumed[0], "step": resumed[1]} if any(resumed) else None,
        "started": started,
        "finished": now(),
    }
    point = mean_network(network)  # a gaussian head's posterior means
    if settings.validation_split:
        record["validation"] = validation_against_mean(
            point, run.manifest, settings.train_split, settings.validation_split,
            settings.batch_size, comm)
        if run.is_writer:
            log.info("%s MSE / predict-the-training-mean MSE: %s; mean %.3f",
                     settings.validation_split, ", ".join(
                         f"{name} {score['ratio']:.3f}"
                         for name, score in record["validation"]["parameters"].items()),
                     record["validation"]["mean_ratio"], extra=PROGRESS)
    if len(set(record["weights_sha256_per_rank"])) > 1:
        log.error("the ranks' weights differ after training: %s", record["weights_sha256_per_rank"])
    if run.is_writer:
        record["history"] = _read_history(run.files.history)
        _save_network(point, run.files.model)
        atomic_write_text(run.files.run_record, json.dumps(record, indent=1) + "\n")
        log.info("training done: %s", run.files.directory, extra=PROGRESS)
    comm.Barrier()
    return record


def _save_network(network: keras.Model, path: Path) -> None:
    """``network.save`` written atomically (Keras wants the ``.keras`` suffix)."""
    with atomic_path(path, suffix=".tmp.keras") as tmp:
        keras.Model(network.inputs, network.outputs, name=network.name).save(tmp)


def _weights_digest(network: keras.Model) -> str:
    """SHA-256 of the network's weights (equal on all ranks if they stayed synchronised)."""
    digest = hashlib.sha256()
    for weight in network.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()


def _read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as handle:
        return [{k: float(v) if v not in ("", "NA") else None for k, v in row.items()}
                for row in csv.DictReader(handle)]


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its oneDNN kernels (see workflow/process.py)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def _threads() -> dict:
    import tensorflow as tf

    return {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            "cpu_count": os.cpu_count(), "onednn": onednn_enabled()}


def _versions(comm) -> dict:
    import h5py
    import tensorflow as tf

    try:
        import mpi4py
        mpi4py_version = mpi4py.__version__
    except ImportError:
        mpi4py_version = None
    return {"python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras.__version__, "numpy": np.__version__, "h5py": h5py.__version__,
            "mpi4py": mpi4py_version, "mpi": mpi_library_version(comm)}


def now() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
