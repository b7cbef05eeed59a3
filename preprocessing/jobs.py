"""The preprocessing stages' jobs: histogram, write_tfrecords, manifest and stage.

Each job takes the run directory and its slice of the configuration (workflow/stages.py); the
histogram stage returns one simulation's :class:`Task`, which workflow.batch runs for every
simulation of a batch. The kernels and formats live in :mod:`preprocessing.histogram`,
:mod:`preprocessing.tfrecords`, :mod:`preprocessing.manifest` and :mod:`preprocessing.staging`.

Outputs (run directory): ``histograms/<sim_id>.h5`` and ``batches/histogram/<batch>.json``;
``tfrecords/<split>/<split>_<NNNN>.tfrecord[.gz]`` with one ``<split>_shard_<NNNN>.json`` per
write_tfrecords job; ``tfrecords/manifest.json``; ``staged/staged.json`` (and the staged copy).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from preprocessing.manifest import build_manifest, load_manifest, verify_files
from preprocessing.subvolumes import blocks_per_side
from preprocessing.tfrecords import SplitPlan, plan_shards, plan_split
from workflow.task import Task
from workflow.config import SPLITS, split_counts
from workflow.io import atomic_write_text, sha256_file
from workflow.logs import PROGRESS
from workflow.params_table import SimulationRecord, read_params_csv
from workflow.paths import RunLayout

# The adapter API besides the jobs: what the orchestration takes from preprocessing (`cosmoflow
# plan-staging` and `verify-data`, the stage and train jobs' Slurm resources, the sweep's staged
# record) it imports from here, never from the modules that define it (pyproject.toml,
# [tool.importlinter]). ``name as name`` marks a re-export.
from preprocessing.staging import (
    burst_buffer_sbatch_options as burst_buffer_sbatch_options,
    format_plan as format_plan,
    load_staged_record as load_staged_record,
    staging_plan as staging_plan,
    staging_runtime_min as staging_runtime_min,
)
from preprocessing.tfrecords import verify_data as verify_data

log = logging.getLogger(__name__)

COMPRESSION = {"none": None, "gzip": "GZIP"}  # config value -> TensorFlow's compression type


def histogram(run: RunLayout, config, record: SimulationRecord) -> Task:
    """One simulation's voxel counts, a channel per snapshot redshift -> histograms/<sim_id>.h5."""
    from preprocessing.histogram import histogram_snapshot

    pre = config["preprocessing"]
    snapshot, out = run.snapshot(record.sim_id), run.histogram(record.sim_id)
    grid, assignment, dtype = pre["grid"], pre["assignment"], pre["dtype"]

    def write(provenance: str):
        return histogram_snapshot(snapshot, out, grid, assignment, dtype, provenance=provenance)

    return Task(out, write, inputs=(snapshot,))


# --- TFRecords ----------------------------------------------------------------------------------

def split_plan(config, split: str, sim_ids: list[int]) -> SplitPlan:
    """The seeded assignment of one split's samples to files and shards (same config, same plan)."""
    pre = config["preprocessing"]
    return plan_split(
        sim_ids, n_subvolumes=blocks_per_side(pre["grid"], pre["subvolume"]) ** 3,
        samples_per_file=pre["samples_per_file"], seed=config["seed"], split=split,
        sims_per_shard=pre["sims_per_shard"], compression=COMPRESSION[pre["compression"]],
    )


def shard_simulations(config, members: dict[str, list[int]]) -> dict[tuple[str, int], list[int]]:
    """The simulations each write_tfrecords job reads, by (split, shard), given each split's
    simulations (``members``); cheap enough to plan the paper preset's 198 shards."""
    pre = config["preprocessing"]
    return {(split, shard): sims for split in SPLITS if members.get(split)
            for shard, sims in enumerate(plan_shards(
                members[split], blocks_per_side(pre["grid"], pre["subvolume"]) ** 3,
                pre["samples_per_file"], config["seed"], split, pre["sims_per_shard"]))}


def shard_batches(config) -> dict[tuple[str, int], list[int]]:
    """The simulation batches whose histograms each write_tfrecords job reads, by (split,
    shard), from the configuration alone (split membership as sample_parameters draws it): the
    inputs the rules and the Parsl ensemble give each shard."""
    from simulations.sampling import assign_splits

    sampling = config["sampling"]
    labels = assign_splits(sampling["n_simulations"], sampling["splits"], config["seed"])
    members = {split: [i for i, label in enumerate(labels) if label == split] for split in SPLITS}
    size = config["simulation"]["sims_per_job"]
    return {key: sorted({sim_id // size for sim_id in sim_ids})
            for key, sim_ids in shard_simulations(config, members).items()}


def histograms_of_shard(config):
    """``batches(selection)``: the histogram batches (``{"batch": b}``) that the write_tfrecords
    shard ``selection`` (``{"split", "shard"}``) reads (:func:`shard_batches`)."""
    batches = shard_batches(config)
    return lambda selection: [{"batch": batch}
                              for batch in batches[selection["split"], int(selection["shard"])]]


def shard_summaries(run: RunLayout, config) -> list[Path]:
    """Every shard summary the manifest merges: the outputs of all write_tfrecords jobs (their
    number follows from the split sizes; which simulations they hold does not matter here)."""
    counts = split_counts(config["sampling"]["n_simulations"], config["sampling"]["splits"])
    shards = shard_simulations(config, {split: list(range(n)) for split, n in counts.items()})
    return [run.shard_summary(split, shard) for split, shard in shards]


def write_tfrecords(run: RunLayout, config, split: str, shard: int) -> None:
    """Write the TFRecord files of one shard of ``split`` from its simulations' histograms."""
    from preprocessing.tfrecords import write_split_shard

    records = [r for r in read_params_csv(run.params_csv) if r.split == split]
    plan = split_plan(config, split, [r.sim_id for r in records])
    names = config["sampling"]["parameters"]
    write_split_shard(
        plan, shard,
        histograms={r.sim_id: run.histogram(r.sim_id) for r in records},
        targets={r.sim_id: [r.parameters[name] for name in names] for r in records},
        parameter_names=list(names), tfrecord_dir=run.tfrecords,
        subvolume=config["preprocessing"]["subvolume"],
    )


def target_ranges(sampling) -> dict:
    """(low, high) of each target, for scaling to [-1, 1]: the sampled region of parameter space."""
    if sampling["design"] == "fiducial_derivatives":
        return {name: [sampling["fiducial"][name] - sampling["derivative_steps"][name],
                       sampling["fiducial"][name] + sampling["derivative_steps"][name]]
                for name in sampling["parameters"]}
    return {name: list(sampling["ranges"][name]) for name in sampling["parameters"]}


def manifest(run: RunLayout, config) -> None:
    """Merge the shard summaries into tfrecords/manifest.json, then remove stale files.

    TFRecord files and shard summaries that this configuration did not write (left by an
    earlier run with other preprocessing settings) are deleted, so the data set on disk is
    exactly the one the manifest lists.
    """
    summaries = shard_summaries(run, config)
    build_manifest(run.tfrecords, target_ranges(config["sampling"]), summaries=summaries)
    keep = {run.tfrecords / f.path for f in load_manifest(run.manifest).files} | set(summaries)
    for path in sorted(run.tfrecords.glob("*/*")):
        if path.name.endswith((".tfrecord", ".tfrecord.gz", ".json")) and path not in keep:
            log.warning("removing %s: not part of this configuration's data set", path)
            path.unlink()


# --- staging ------------------------------------------------------------------------------------

def stage(run: RunLayout, config) -> dict:
    """The ``stage`` rule's job: stage (in-job modes: plan) and write ``staged/staged.json``.

    none: verify every file in place; copy, lustre: :func:`~preprocessing.staging.stage_files`
    into :func:`~preprocessing.staging.resolve_target`; burst_buffer, node_local: record the
    target template with ``in_job: true``, the files and bytes the training job will stage and
    ``verified: false`` (burst_buffer also writes the DataWarp directives for sbatch ``--bbf``).
    ``manifest`` is the manifest training opens (in-job modes: the source, which the training job
    stages from). Returns the record (keys staging.RECORD_KEYS and the stage_files report's).
    """
    from preprocessing import staging

    section = config["staging"]
    mode = section["mode"]
    started = time.perf_counter()
    data = load_manifest(run.manifest)
    if mode == "none":
        size = verify_files(data, run.manifest, workers=section["workers"])
        seconds = time.perf_counter() - started
        report = {"target": str(data.root.absolute()), "manifest": str(run.manifest.absolute()),
                  "files": len(data.files), "bytes": size, "seconds": round(seconds, 3),
                  "mb_per_s": staging.rate(size, seconds), "verified": True}
    elif mode in staging.IN_JOB_MODES:
        size = sum((data.root / f.path).stat().st_size for f in data.files)
        if mode == "burst_buffer":
            atomic_write_text(run.datawarp_directives,
                              staging.burst_buffer_directives(section, run, size) + "\n")
        report = {"target": staging.target_template(section, run), "manifest": str(run.manifest.absolute()),
                  "files": len(data.files), "bytes": size, "seconds": 0.0, "mb_per_s": None,
                  "verified": False}
    else:
        report = staging.stage_files(run.manifest, staging.resolve_target(section, run),
                                     workers=section["workers"],
                                     lustre=section["lustre"].plain() if mode == "lustre" else None)
    record = {**report, "mode": mode, "in_job": mode in staging.IN_JOB_MODES,
              "source_manifest": str(run.manifest.absolute()),
              "source_manifest_sha256": sha256_file(run.manifest)}
    atomic_write_text(run.staged_record, json.dumps(record, indent=1) + "\n")
    if mode in staging.IN_JOB_MODES:
        log.info("staging mode %s: the training job stages %d files to %s", mode,
                 len(data.files), record["target"], extra=PROGRESS)
    else:
        log.info("stage (%s): %d files, %.1f MB verified at %s in %.2f s (%s MB/s)", mode,
                 record["files"], record["bytes"] / 1e6, record["target"], record["seconds"],
                 record["mb_per_s"], extra=PROGRESS)
    return record
