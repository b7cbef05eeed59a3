"""Training test helpers: a synthetic but learnable TFRecord data set, and a script entry point.

Each synthetic "simulation" is a log-normal density field on a periodic grid whose statistics
depend on the three parameters, so that a network can learn them:

* Omega_m sets the mean particle count per voxel, lambda = 20 (Omega_m / 0.3)^3,
* sigma_8 sets the standard deviation of the Gaussian log-density (sigma_g = 3 sigma_8 - 1.9),
* n_s sets the slope of its power spectrum, P(k) ~ k^(-1 + 20 (n_s - 0.95)),

and the voxel counts are Poisson draws. The histograms go through the real preprocessing
(plan_split, write_split_shard, build_manifest), like the pipeline's own data.

Run as a script (also under ``mpiexec -n N``)::

    python tests/mpi_training.py MANIFEST OUTPUT_DIR SETTINGS_JSON

it trains with :func:`training.run.train_network` (:func:`training_settings` of the JSON object
of changes) and exits 1 with the message on a PipelineError.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PARAMETERS = ("Omega_m", "sigma_8", "n_s")
RANGES = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.9, 1.0)}


def synthetic_counts(omega_m: float, sigma_8: float, n_s: float, grid: int,
                     rng: np.random.Generator) -> np.ndarray:
    """Poisson counts (grid^3, int16) of a log-normal field with the statistics described above."""
    k = np.fft.fftfreq(grid) * grid
    k_norm = np.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + k[None, None, :grid // 2 + 1] ** 2)
    k_norm[0, 0, 0] = 1.0
    amplitude = k_norm ** ((-1.0 + 20.0 * (n_s - 0.95)) / 2.0)
    amplitude[0, 0, 0] = 0.0  # zero-mean Gaussian field
    noise = np.fft.rfftn(rng.standard_normal((grid,) * 3))
    gaussian = np.fft.irfftn(noise * amplitude, s=(grid,) * 3, axes=(0, 1, 2))
    gaussian *= (3.0 * sigma_8 - 1.9) / gaussian.std()
    density = np.exp(gaussian - gaussian.var() / 2.0)
    return rng.poisson(20.0 * (omega_m / 0.3) ** 3 * density).astype(np.int16)


def write_dataset(directory: Path, splits: dict[str, int], grid: int = 32, subvolume: int = 16,
                  samples_per_file: int = 8, seed: int = 0) -> Path:
    """Write histograms, TFRecords and the manifest of a synthetic run; return the manifest path.

    ``splits`` maps split name -> number of simulations; each simulation gives
    (grid / subvolume)^3 samples of shape (subvolume,)*3 + (1,).
    """
    from preprocessing.histogram import write_histogram
    from preprocessing.manifest import build_manifest
    from preprocessing.tfrecords import plan_split, write_split_shard

    directory = Path(directory)
    rng = np.random.default_rng(seed)
    n_subvolumes = (grid // subvolume) ** 3
    sim_id = 0
    for split, n_sims in splits.items():
        histograms, targets = {}, {}
        for _ in range(n_sims):
            values = tuple(float(rng.uniform(*RANGES[p])) for p in PARAMETERS)
            counts = synthetic_counts(*values, grid, rng)[None]
            histograms[sim_id] = write_histogram(directory / "histograms" / f"{sim_id:05d}.h5",
                                                 counts, 2.0 * grid, (0.0,), "ngp", sim_id)
            targets[sim_id] = values
            sim_id += 1
        plan = plan_split(list(histograms), n_subvolumes, samples_per_file, seed, split)
        for shard in range(plan.n_shards):
            write_split_shard(plan, shard, histograms, targets, PARAMETERS,
                              directory / "tfrecords", subvolume)
    return build_manifest(directory / "tfrecords", RANGES)


TEST_TRAINING = {"model": "cosmoflow_paper", "batch_size": 4, "epochs": 8, "learning_rate": 0.001,
                 "larc": True, "dropout": None, "threads": 0}
"""What the training tests train unless they say otherwise: the paper's network, Adam with LARC at
1e-3, in batches of 4, on every core. (The pipeline's default, config/config.yaml, is the MLPerf
network without LARC at 5e-4 in batches of 16: the pipeline's tests train that one.)"""


def training_settings(changes: dict):
    """TrainingSettings: the configuration's training section with :data:`TEST_TRAINING`, validated
    (defaults filled in), then ``changes`` as they are."""
    from training.settings import TrainingSettings
    from workflow.config import validate_config

    return TrainingSettings.from_mapping(validate_config({"training": TEST_TRAINING})["training"] | changes)


def main(argv: list[str]) -> int:
    from workflow.process import configure_process

    configure_process()  # as the cosmoflow command does, before TensorFlow is imported
    from training.run import train_network
    from workflow.errors import PipelineError
    from workflow.logs import configure_logging

    configure_logging("INFO")
    manifest, output_dir, settings = argv
    try:
        train_network(manifest, output_dir, training_settings(json.loads(settings)))
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
