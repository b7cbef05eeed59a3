"""Staging: put the TFRecords where the training job reads them fastest, verified by sha256.

The CosmoFlow paper's scaling was limited by I/O: Lustre fell behind at scale while the DataWarp
burst buffer kept up, each node reading at least 62 MB/s (Mathuriya et al. 2018; config
``staging.required_mb_per_s_per_node``). Modes (config section ``staging``; docs/execution.md,
"Staging modes"):

* ``none``: training reads ``tfrecords/`` in place (the files are verified there);
* ``copy``: a copy in ``target`` (e.g. a faster file system);
* ``lustre``: like copy, into a directory striped with ``lfs setstripe -c COUNT -S SIZE`` before
  any file is written (striping applies only to files created afterwards);
* ``burst_buffer``: in the training job, into ``$DW_JOB_STRIPED/<run_name>`` (DataWarp; sbatch
  ``--bbf`` requests it and stages ``tfrecords/`` in, :func:`burst_buffer_sbatch_options`), or
  ``target``; rank 0 verifies (or copies) the files there;
* ``node_local``: in the training job, every rank copies only its own files to a directory of
  its own on the node's disk (the MLPerf HPC reference's approach).

The first three run in the ``stage`` rule's job (preprocessing.jobs.stage); the last two
(:data:`IN_JOB_MODES`) exist only inside the job that owns the storage, so the rule records the
plan and ``cosmoflow train`` copies (training.jobs). Every copy hashes each
buffer as it writes it (one read of the source) into ``<target>.partial-<pid>``, which replaces
``target`` only when every file matched the manifest; on an error the partial copy is removed
and the source is untouched. One staging at a time per target.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from tqdm import tqdm

from preprocessing.manifest import load_manifest
from workflow.config import run_directory, sample_voxels, split_samples
from workflow.errors import PipelineError
from workflow.io import sha256_file
from workflow.paths import DatasetFiles, RunLayout

log = logging.getLogger(__name__)

COPY_MODES = ("copy", "lustre")  # copied by the stage job
IN_JOB_MODES = ("burst_buffer", "node_local")  # staged inside the training job (training.jobs)
MODES = ("none", *COPY_MODES, *IN_JOB_MODES)  # none: read in place
# Per read/hash/write. hashlib releases the GIL on it, so threads overlap; 1 MiB stays in the
# core's cache between hashing and writing (8 MiB ran 12% slower, bench/staging.py).
BUFFER_BYTES = 1 << 20
TFRECORD_OVERHEAD_BYTES = 112  # per record beyond x: framing, CRCs, Example keys, y, shape, sim_id
STAGE_RUNTIME_MB_PER_S = 50.0  # conservative shared-file-system rate for the stage job's runtime
STRIPING_NAME = ".striping.json"  # in a lustre target: the `lfs setstripe` settings it was made with
RECORD_KEYS = ("mode", "target", "manifest", "files", "bytes", "seconds", "mb_per_s", "verified",
               "in_job", "source_manifest", "source_manifest_sha256")


# --- copying -----------------------------------------------------------------------------------

def _copy_hashed(source: Path, destination: Path, progress: tqdm) -> str:
    """Copy ``source`` to ``destination`` reading it once; return its sha256 (hex)."""
    digest, buffer = hashlib.sha256(), bytearray(BUFFER_BYTES)
    view = memoryview(buffer)
    with open(source, "rb", buffering=0) as reader, open(destination, "wb") as writer:
        while size := reader.readinto(buffer):
            digest.update(view[:size])
            writer.write(view[:size])
            progress.update(size)
    return digest.hexdigest()


def _matches(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` is a file of ``size`` bytes with this sha256."""
    try:
        return path.stat().st_size == size and sha256_file(path) == sha256
    except OSError:
        return False


def _set_striping(directory: Path, lustre: dict) -> dict:
    """``lfs setstripe`` on the still-empty ``directory``; returns what was applied (or why not)."""
    settings = {"stripe_count": lustre["stripe_count"], "stripe_size": lustre["stripe_size"]}
    command = ["lfs", "setstripe", "-c", str(settings["stripe_count"]), "-S", settings["stripe_size"],
               str(directory)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        problem = None if result.returncode == 0 else (
            result.stderr.strip() or f"exit status {result.returncode}")
    except FileNotFoundError:
        problem = "`lfs` is not on PATH (no Lustre client here)"
    if problem is None:
        return settings | {"applied": True}
    message = f"cannot stripe {directory} with `{' '.join(command)}`: {problem}"
    if not lustre["optional"]:
        raise PipelineError(f"{message}; is the target on Lustre? Set staging.lustre.optional: true "
                            "to copy unstriped instead")
    log.warning("%s; copying unstriped (staging.lustre.optional is true)", message)
    return settings | {"applied": False, "reason": problem}


def _striping_of(target: Path) -> dict | None:
    """The striping record a lustre staging left in ``target`` (None if none)."""
    try:
        return json.loads((target / STRIPING_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def stage_files(manifest_path: str | os.PathLike, target: str | os.PathLike, *,
                names: Sequence[str] | None = None, workers: int = 4, progress: bool = True,
                lustre: dict | None = None) -> dict:
    """Copy the manifest's files (or the manifest-relative ``names``) and the manifest to ``target``.

    Each file is hashed as it is copied and checked against the manifest's sha256. If ``target``
    already holds the same manifest.json and every wanted file matches (an earlier staging, or
    DataWarp's ``#DW stage_in``), nothing is written (``reused``). Otherwise the copy is built in
    ``<target>.partial-<pid>``: files of ``target`` that still match are hard-linked into it (not
    copied again), the others copied; it then replaces ``target``. ``lustre`` (the config's
    ``staging.lustre``) stripes the partial directory before any file is written; matching files
    are reused only if ``target`` was made with the same striping.

    Returns the report: mode ("lustre" if striped, else "copy"), target, manifest (the staged
    manifest.json), files, bytes, seconds, mb_per_s (MB = 1e6 bytes, over everything staged),
    verified, reused, reused_files (verified in ``target`` and kept), and ``lustre`` (the
    stripe settings applied, or why not) when given.
    Raises PipelineError naming the file and the reason (target full, I/O error, checksum
    mismatch); the partial copy is then removed and ``target`` and the source are as they were.
    """
    started = time.perf_counter()
    manifest_path, target = Path(manifest_path).absolute(), Path(target).absolute()
    manifest = load_manifest(manifest_path)
    entries = {f.path: f for f in manifest.files}
    wanted = list(entries) if names is None else list(dict.fromkeys(names))
    unknown = [name for name in wanted if name not in entries]
    if unknown:
        raise PipelineError(f"{unknown[0]} is not a file of {manifest_path}")
    try:
        sizes = {name: (manifest.root / name).stat().st_size for name in wanted}
    except OSError as error:
        raise PipelineError(f"cannot stage {error.filename}: {error.strerror}") from None
    total = sum(sizes.values())

    if target == manifest.root.absolute():
        raise PipelineError(f"staging target {target} is the data set itself; choose another one")
    staged_manifest = DatasetFiles(target).manifest
    if target.exists() and not staged_manifest.is_file() and (
            not target.is_dir() or any(target.iterdir())):
        raise PipelineError(f"staging target {target} exists and is not a staged copy (no "
                            f"{staged_manifest.name}); not replacing it: choose an empty or new "
                            f"directory")
    reusable = target.is_dir() and (lustre is None or _same_striping(target, lustre))
    with ThreadPoolExecutor(workers) as pool:
        matching = set() if not reusable else {
            name for name, ok in zip(wanted, pool.map(
                lambda n: _matches(target / n, sizes[n], entries[n].sha256), wanted)) if ok}
    reused = (reusable and len(matching) == len(wanted)
              and _same_bytes(staged_manifest, manifest_path))
    if reused:
        striping = _striping_of(target) if lustre is not None else None
    else:
        striping = _stage_into_partial(manifest_path, manifest.root, target, wanted, sizes,
                                       {n: entries[n].sha256 for n in wanted}, matching,
                                       workers, progress, lustre)
    seconds = time.perf_counter() - started
    report = {"mode": "lustre" if lustre is not None else "copy", "target": str(target),
              "manifest": str(staged_manifest), "files": len(wanted), "bytes": total,
              "seconds": round(seconds, 3), "mb_per_s": rate(total, seconds), "verified": True,
              "reused": reused, "reused_files": len(matching)}
    if lustre is not None:
        report["lustre"] = striping
    log.info("staged %d files, %.1f MB to %s in %.2f s (%s MB/s; %d already there and verified)",
             len(wanted), total / 1e6, target, seconds, report["mb_per_s"], len(matching))
    return report


def _same_striping(target: Path, lustre: dict) -> bool:
    """Whether ``target`` was staged with the stripe settings of ``lustre``."""
    record = _striping_of(target) or {}
    return (record.get("stripe_count"), record.get("stripe_size")) == (
        lustre["stripe_count"], lustre["stripe_size"])


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def rate(size: int, seconds: float) -> float | None:
    """MB/s (1e6 bytes per second), None for a zero duration."""
    return round(size / 1e6 / seconds, 1) if seconds > 0 else None


def _stage_into_partial(manifest_path: Path, root: Path, target: Path, names: list[str],
                        sizes: dict[str, int], sha256: dict[str, str], matching: set[str],
                        workers: int, progress: bool, lustre: dict | None) -> dict | None:
    """Build ``<target>.partial-<pid>`` (links to ``matching``, copies of the rest), then swap it in.

    Returns the striping record (lustre) or None.
    """
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    for stale in target.parent.glob(f"{target.name}.partial-*"):
        log.warning("removing %s, left by an interrupted staging", stale)
        shutil.rmtree(stale, ignore_errors=True)
    bar = tqdm(total=sum(sizes[n] for n in names if n not in matching), unit="B", unit_scale=True,
               desc=f"staging to {target}", disable=not (progress and sys.stderr.isatty()))

    def place(name: str) -> None:
        if name in matching:
            try:
                os.link(target / name, partial / name)
                return
            except OSError:
                pass  # no hard links on this file system: copy it
        try:
            digest = _copy_hashed(root / name, partial / name, bar)
        except OSError as error:
            raise _io_failure(root / name, target, error) from None
        if digest != sha256[name]:
            raise PipelineError(
                f"staging {root / name} to {target}: its sha256 {digest[:12]}... differs from the "
                f"manifest's {sha256[name][:12]}... (corrupt source file; rerun the write_tfrecords "
                f"job that wrote it); the partial copy was removed")

    striping = None
    try:
        partial.mkdir(parents=True)
        if lustre is not None:
            striping = _set_striping(partial, lustre)
        for directory in sorted({(partial / name).parent for name in names}):
            directory.mkdir(parents=True, exist_ok=True)
        with bar, ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(place, name) for name in names]
            for future in as_completed(futures):
                if future.exception() is not None:
                    for other in futures:
                        other.cancel()
                    raise future.exception()
        shutil.copyfile(manifest_path, DatasetFiles(partial).manifest)
        if striping is not None:
            (partial / STRIPING_NAME).write_text(json.dumps(striping) + "\n", encoding="utf-8")
        old = target.with_name(f"{partial.name}-old")
        if target.exists():
            target.rename(old)
        partial.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise _io_failure(Path(error.filename or manifest_path), target, error) from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return striping


def _io_failure(path: Path, target: Path, error: OSError) -> PipelineError:
    full = " (the target is full)" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return PipelineError(f"staging {path} to {target}: {error.strerror or error}{full}; the partial "
                         f"copy was removed and the source is untouched")


# --- the stage rule ------------------------------------------------------------------------------

def resolve_target(staging: Mapping, run: RunLayout, rank: int | None = None,
                   mode: str | None = None) -> Path:
    """The absolute directory that staging ``mode`` (default ``staging["mode"]``) copies to,
    environment variables expanded; ``staging`` is the config section.

    copy, lustre: ``target`` or ``<run>/staged/data``; burst_buffer: ``$DW_JOB_STRIPED/<run_name>``
    when set, else ``target``; node_local: ``(target or $TMPDIR or /tmp)/cosmoflow-<run_name>/
    rank<rank:05d>`` (``rank`` required). ``run_name`` is the run directory's name.
    """
    target = os.path.expandvars(staging["target"]) if staging["target"] else None
    mode = mode or staging["mode"]
    run_name = run.root.name
    if mode in COPY_MODES:
        path = Path(target) if target else run.staged_data
    elif mode == "burst_buffer":
        striped = os.environ.get("DW_JOB_STRIPED")
        if striped:
            path = Path(striped) / run_name
        elif target:
            path = Path(target)
        else:
            raise PipelineError(
                "staging.mode = 'burst_buffer' needs $DW_JOB_STRIPED (a DataWarp job allocation, "
                "which the train rule requests through sbatch --bbf) or staging.target (a fast "
                "file system such as node-local NVMe, e.g. /mnt/bb/$USER)")
    elif mode == "node_local":
        if rank is None:
            raise PipelineError("staging.mode = 'node_local' stages per MPI rank; give the rank")
        base = Path(target or os.environ.get("TMPDIR") or "/tmp")
        path = base / f"cosmoflow-{run_name}" / f"rank{rank:05d}"
    else:
        raise PipelineError(f"staging.mode = {mode!r} copies nothing; there is no target")
    return path.absolute()


def target_template(staging: Mapping, run: RunLayout) -> str:
    """Where an in-job mode will stage, as recorded by the stage job (resolved in the training job)."""
    run_name = run.root.name
    if staging["mode"] == "burst_buffer":
        fallback = f", else {staging['target']}" if staging["target"] else ""
        return f"$DW_JOB_STRIPED/{run_name}{fallback}"
    base = staging["target"] or "$TMPDIR (or /tmp)"
    return f"{base}/cosmoflow-{run_name}/rank{{rank:05d}}"


def load_staged_record(path: str | os.PathLike) -> dict:
    """``staged/staged.json``, checked for the keys of :data:`RECORD_KEYS`."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path} does not exist; run the stage rule (`cosmoflow stage`) first") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PipelineError(f"{path} is not readable JSON ({error}); rerun `cosmoflow stage`") from None
    if not isinstance(record, dict):
        raise PipelineError(f"{path} is not a JSON object; rerun `cosmoflow stage`")
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise PipelineError(f"{path} has no key '{missing[0]}'; rerun `cosmoflow stage`")
    if record["mode"] not in MODES:
        raise PipelineError(f"{path} has mode = {record['mode']!r}; expected one of {list(MODES)}")
    return record


# --- sizes and plans, from the configuration alone ---------------------------------------------

def split_bytes(config: dict) -> dict[str, int]:
    """Bytes of each split's TFRecords (uncompressed), from the configuration alone.

    samples = simulations of the split x (grid/subvolume)^3; bytes per sample = subvolume^3 x
    channels (redshifts) x dtype size + :data:`TFRECORD_OVERHEAD_BYTES`.
    """
    itemsize = np.dtype(config["preprocessing"]["dtype"]).itemsize
    sample = sample_voxels(config) * itemsize + TFRECORD_OVERHEAD_BYTES
    return {split: n * sample for split, n in split_samples(config).items()}


def dataset_bytes(config: dict) -> int:
    """Bytes of the whole data set (every split, uncompressed TFRecords)."""
    return sum(split_bytes(config).values())


def staging_plan(config: dict, nodes: int, mb_per_s: float | None = None) -> dict:
    """Data volume per node and staging time for ``nodes`` nodes reading ``mb_per_s`` MB/s each.

    Each node reads 1/nodes of the training split per epoch; node_local copies that share to
    each node once, the other modes stage the whole data set once. ``mb_per_s`` defaults to
    ``staging.required_mb_per_s_per_node``.
    """
    if nodes < 1:
        raise PipelineError(f"--nodes = {nodes}; expected at least 1")
    staging = config["staging"]
    required = staging["required_mb_per_s_per_node"]
    rate = required if mb_per_s is None else mb_per_s
    if rate <= 0:
        raise PipelineError(f"--mb-per-s = {rate}; expected a positive bandwidth")
    total = dataset_bytes(config)
    train = split_bytes(config)["train"]
    staged = math.ceil(train / nodes) if staging["mode"] == "node_local" else total
    return {"mode": staging["mode"], "nodes": nodes, "dataset_bytes": total, "train_bytes": train,
            "epoch_read_bytes_per_node": math.ceil(train / nodes), "staged_bytes_per_node": staged,
            "mb_per_s_per_node": rate, "stage_seconds": staged / 1e6 / rate,
            "required_mb_per_s_per_node": required, "meets_requirement": rate >= required}


def format_plan(plan: dict) -> str:
    """The lines that ``cosmoflow plan-staging`` prints (GB = 1e9 bytes)."""
    verdict = "meets" if plan["meets_requirement"] else "does NOT meet"
    rate = plan["mb_per_s_per_node"]
    where = {"none": "verified in place once", "node_local": "staged to each node"}.get(
        plan["mode"], "staged once")
    return "\n".join([
        f"data set: {plan['dataset_bytes'] / 1e9:.2f} GB, of which training "
        f"{plan['train_bytes'] / 1e9:.2f} GB",
        f"staging mode {plan['mode']} on {plan['nodes']} node(s): each node reads "
        f"{plan['epoch_read_bytes_per_node'] / 1e9:.3f} GB per epoch "
        f"({plan['epoch_read_bytes_per_node'] / 1e6 / rate:.0f} s at {rate:g} MB/s); "
        f"{plan['staged_bytes_per_node'] / 1e9:.2f} GB {where}",
        f"at {rate:g} MB/s per node: {plan['stage_seconds'] / 60:.1f} min to stage",
        f"{rate:g} MB/s per node {verdict} the {plan['required_mb_per_s_per_node']:g} MB/s per "
        f"node that training needs (staging.required_mb_per_s_per_node; the paper measured 62)",
    ])


def staging_runtime_min(config: dict) -> int:
    """Slurm runtime (minutes) of the stage job: the data set at 50 MB/s, x 1.5, at least 5.

    In-job modes copy nothing in the stage job: 5.
    """
    if config["staging"]["mode"] in IN_JOB_MODES:
        return 5
    return max(5, math.ceil(1.5 * dataset_bytes(config) / 1e6 / STAGE_RUNTIME_MB_PER_S / 60))


# --- DataWarp ------------------------------------------------------------------------------------

def burst_buffer_directives(staging: Mapping, run: RunLayout, dataset_bytes: int) -> str:
    """The training job's ``#DW`` lines: a scratch allocation of ``dataset_bytes`` x
    capacity_margin (whole GiB) and a stage-in of ``tfrecords/`` into it."""
    bb = staging["burst_buffer"]
    gib = math.ceil(dataset_bytes * bb["capacity_margin"] / 2**30)
    pool = f" pool={bb['pool']}" if bb["pool"] else ""
    return (f"#DW jobdw type=scratch access_mode={bb['access_mode']} capacity={gib}GiB{pool}\n"
            f"#DW stage_in type=directory source={run.tfrecords.absolute()} "
            f"destination=$DW_JOB_STRIPED/{run.root.name}")


def burst_buffer_sbatch_options(config: dict) -> str:
    """The train rule's ``slurm_extra`` ("" unless burst_buffer): ``--bbf=<staged/datawarp.bb>``,
    the directives that the stage job writes.

    snakemake-executor-plugin-slurm appends ``slurm_extra`` to the sbatch command line and
    generates the job script itself, so ``#DW`` script lines cannot be passed; sbatch's
    ``--bbf`` reads the same directives from a file.
    """
    if config["staging"]["mode"] != "burst_buffer":
        return ""
    return f"--bbf={RunLayout(run_directory(config)).datawarp_directives.absolute()}"
