"""The preprocessing stages over the ensemble: histograms per batch, TFRecord shards, manifest.

Called by ``cosmoflow histogram`` / ``write-tfrecords`` / ``manifest`` (and so by the Snakemake
rules of the same names) with the run's configuration. The kernels and formats live in
:mod:`preprocessing.histogram`, :mod:`preprocessing.tfrecords` and :mod:`preprocessing.manifest`.

Outputs (run directory): ``histograms/<sim_id>.h5``, ``batches/histogram/<batch>.json``,
``tfrecords/<split>/<split>_<NNNN>.tfrecord[.gz]`` with one ``<split>_shard_<NNNN>.json`` per
job, and ``tfrecords/manifest.json``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from preprocessing.histogram import histogram_snapshot
from preprocessing.manifest import build_manifest, load_manifest, shard_summary_path
from preprocessing.subvolumes import blocks_per_side
from preprocessing.tfrecords import SplitPlan, plan_split, write_split_shard
from simulations.ensemble import select_simulations
from simulations.sampling import SimulationRecord, read_params_csv
from workflow.batch import Task, run_tasks
from workflow.config import run_directory, split_counts
from workflow.paths import RunLayout
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

COMPRESSION = {"none": None, "gzip": "GZIP"}


def histogram_task(layout: RunLayout, record: SimulationRecord, config: dict) -> Task:
    pre = config["preprocessing"]
    snapshot, out = layout.snapshot(record.sim_id), layout.histogram(record.sim_id)

    def run():
        return histogram_snapshot(snapshot, out, pre["grid"], pre["assignment"], pre["dtype"])

    provenance = {
        "sim_id": record.sim_id, "grid": pre["grid"], "assignment": pre["assignment"], "dtype": pre["dtype"],
        "redshifts": config["simulation"]["redshifts"], "code_version": CODE_VERSION,
    }
    return Task(record.sim_id, out, provenance, run, inputs=(snapshot,))


def run_histograms(config: dict, batch: int | None = None, sim_ids: list[int] | None = None, force: bool = False) -> list[dict]:
    """Histogram the snapshots of one batch (writing its summary) or of chosen simulations."""
    layout = RunLayout(run_directory(config))
    tasks = [histogram_task(layout, record, config) for record in select_simulations(layout, batch, sim_ids)]
    summary = layout.batch_summary("histogram", batch) if batch is not None else None
    return run_tasks("histogram", tasks, force=force, summary_path=summary)


def split_plan(config: dict, split: str, sim_ids: list[int]) -> SplitPlan:
    """The seeded assignment of one split's samples to files and shards (same config, same plan)."""
    pre = config["preprocessing"]
    return plan_split(
        sim_ids, n_subvolumes=blocks_per_side(pre["grid"], pre["subvolume"]) ** 3,
        samples_per_file=pre["samples_per_file"], seed=config["seed"], split=split,
        sims_per_shard=pre["sims_per_shard"], compression=COMPRESSION[pre["compression"]],
    )


def n_shards(config: dict, split: str) -> int:
    """Number of write_tfrecords jobs of ``split``; known from the config alone, for the DAG."""
    count = split_counts(config["sampling"]["n_simulations"], config["sampling"]["splits"])[split]
    return split_plan(config, split, list(range(count))).n_shards if count else 0


def shard_summaries(config: dict) -> list[Path]:
    """Every shard summary the manifest merges: the outputs of all write_tfrecords jobs."""
    tfrecords = RunLayout(run_directory(config)).tfrecords
    return [
        shard_summary_path(tfrecords, split, shard)
        for split in ("train", "val", "test") for shard in range(n_shards(config, split))
    ]


def write_tfrecords_shard(config: dict, split: str, shard: int) -> None:
    """Write the TFRecord files of one shard of ``split`` from its simulations' histograms."""
    layout = RunLayout(run_directory(config))
    records = [r for r in read_params_csv(layout.params_csv) if r.split == split]
    plan = split_plan(config, split, [r.sim_id for r in records])
    write_split_shard(
        plan, shard,
        histograms={r.sim_id: layout.histogram(r.sim_id) for r in records},
        targets={r.sim_id: [r.parameters[name] for name in config["sampling"]["parameters"]] for r in records},
        parameter_names=config["sampling"]["parameters"],
        tfrecord_dir=layout.tfrecords, subvolume=config["preprocessing"]["subvolume"],
    )


def target_ranges(sampling: dict) -> dict:
    """(low, high) of each target, for scaling to [-1, 1]: the sampled region of parameter space."""
    if sampling["design"] == "fiducial_derivatives":
        return {
            name: [sampling["fiducial"][name] - step, sampling["fiducial"][name] + step]
            for name, step in ((n, sampling["derivative_steps"][n]) for n in sampling["parameters"])
        }
    return {name: sampling["ranges"][name] for name in sampling["parameters"]}


def write_manifest(config: dict) -> None:
    """Merge the shard summaries into tfrecords/manifest.json, then remove stale files.

    TFRecord files and shard summaries that this configuration did not write (left by an
    earlier run with other preprocessing settings) are deleted, so the data set on disk is
    exactly the one the manifest lists.
    """
    layout = RunLayout(run_directory(config))
    summaries = shard_summaries(config)
    build_manifest(layout.tfrecords, target_ranges(config["sampling"]), summaries=summaries)
    keep = {layout.tfrecords / f.path for f in load_manifest(layout.manifest).files} | set(summaries)
    for path in sorted(layout.tfrecords.glob("*/*")):
        if path.name.endswith((".tfrecord", ".tfrecord.gz", ".json")) and path not in keep:
            log.warning("removing %s: not part of this configuration's data set", path)
            path.unlink()

