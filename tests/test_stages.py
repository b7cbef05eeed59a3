"""The stage table (workflow/stages.py): every job reads only the config keys its stage declares,
and the schema is the only place that lists the configuration's allowed values."""

from __future__ import annotations

import ast
import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KERNEL_CHOICES, REPO, SMALL, run_cli
from workflow.config import load_config, load_schema, n_batches, validate_config
from workflow.paths import RunLayout
from workflow.stages import STAGE, STAGES, run_stage

# Declared keys that the small configuration does not make its job read, each with the setting
# that does: the guard below fails on any other declared key left unread, so that a declaration
# cannot outgrow what the job uses (a changed key must rerun exactly the stages that read it).
READ_ONLY_WITH = {
    "initial_conditions.music_executable": "initial_conditions.backend: music",
    "cosmology.h": "h sampled or not: read only when h is not in sampling.parameters",
    "sampling.fiducial": "sampling.design: fiducial_derivatives",
    "sampling.derivative_steps": "sampling.design: fiducial_derivatives",
    "sampling.ranges": "read by the manifest only for a design other than fiducial_derivatives",
    "staging.target": "staging.mode copy, lustre, burst_buffer or node_local",
    "staging.lustre": "staging.mode: lustre",
    "staging.burst_buffer": "staging.mode: burst_buffer",
    "staging.workers": "read by train only with staging.mode node_local or burst_buffer",
    "sampling.splits.train": "implied: train holds the simulations val and test leave (sum 1)",
}


def declared_leaves(stage, config) -> set[str]:
    """The dotted leaf keys of ``stage``'s slice of ``config``."""
    leaves = set()

    def walk(mapping, prefix):
        for key, value in mapping.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                leaves.add(f"{prefix}{key}")

    walk(stage.config_slice(config).as_declared(), "")
    return leaves


def test_every_stage_reads_exactly_the_keys_it_declares(tmp_path):
    """The small run through every stage, in order, each job on a slice that records its reads."""
    config = validate_config(copy.deepcopy(SMALL) | {
        "results_dir": str(tmp_path),
        "training": {"model": "mlperf", "epochs": 1, "batch_size": 4, "threads": 1},
        "preprocessing": SMALL["preprocessing"] | {"sims_per_shard": 2},  # whole shards for 0.5
        "analysis": SMALL["analysis"] | {"learning_curve": [0.5]}})
    run = RunLayout(tmp_path / "small")
    reads: dict[str, set[str]] = {}
    for stage in STAGES:
        for selection in stage.unit.selections(stage, config):
            view = stage.config_slice(config)
            run_stage(stage, run, view, **selection)  # KeyError on any undeclared key
            reads.setdefault(stage.name, set()).update(view.reads)
    assert (run.training / "run.json").is_file()
    for stage in STAGES:
        unread = declared_leaves(stage, config) - reads[stage.name]
        unexplained = {key for key in unread if not any(
            key == known or key.startswith(known + ".") for known in READ_ONLY_WITH)}
        assert not unexplained, f"stage {stage.name} declares but never reads {sorted(unexplained)}"


def test_reading_an_undeclared_key_names_the_stage_and_the_key():
    view = STAGE["histogram"].config_slice(validate_config({}))
    assert view["preprocessing"]["grid"] == 32
    with pytest.raises(KeyError, match="stage 'histogram' reads config key 'preprocessing.subvolume'"):
        view["preprocessing"]["subvolume"]
    with pytest.raises(KeyError, match="'cosmology'"):
        view["cosmology"]
    assert view.reads == {"preprocessing.grid"}


def test_params_hold_what_changes_the_outputs_not_how_the_job_runs():
    config = validate_config({})
    train = STAGE["train"].params(config)
    assert set(train) == {"training"} and "threads" not in train["training"]
    assert train["training"]["learning_rate"] == config["training"]["learning_rate"]
    assert STAGE["simulate"].params(config) == {"simulation": {
        key: config["simulation"][key] for key in (
            "redshifts", "n_steps", "stepping", "cola", "n_cola", "mesh_factor", "backend")}}
    # every stage in data-flow order, each rule name once, each command once
    assert [stage.name for stage in STAGES] == [
        "sample_parameters", "initial_conditions", "simulate", "histogram", "validate_simulations",
        "write_tfrecords", "manifest", "stage", "train", "train_fraction", "analyze"]
    assert len({stage.command for stage in STAGES}) == len(STAGES)
    for stage in STAGES:
        for key in stage.keys:
            section = load_schema()
            for part in key.split("."):
                section = section["properties"][part]  # every declared key is a schema key


def schema_value_sets() -> dict[frozenset, str]:
    """Every string enum of the schema, and every set of a section's keys, by their values."""
    found = {}

    def walk(schema, path):
        values = schema.get("enum") or schema.get("items", {}).get("enum") or []
        strings = frozenset(v for v in values if isinstance(v, str))
        if len(strings) >= 2:
            found[strings] = path
        properties = schema.get("properties", {})
        if len(properties) >= 2 and path:
            found.setdefault(frozenset(properties), f"{path} (its keys)")
        for name, child in properties.items():
            walk(child, f"{path}.{name}" if path else name)

    walk(load_schema(), "")
    return found


PACKAGES = ("workflow", "simulations", "preprocessing", "training", "analysis", "bench")


def python_sources(root: Path):
    for package in PACKAGES:
        yield from sorted((root / package).rglob("*.py"))


def restated_enums(root: Path) -> list[str]:
    """Tuples, lists and sets of string literals, in the packages under ``root``, equal to a
    schema enum (or to a section's key set), but for the kernels' own sets of what they
    implement that a test ties to the schema (conftest.KERNEL_CHOICES)."""
    enums = schema_value_sets()
    tied = {(f"{module.replace('.', '/')}.py", name) for _, module, name in KERNEL_CHOICES}
    found = []
    for path in python_sources(root):
        tree = ast.parse(path.read_text(), str(path))
        allowed = {id(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   for target in node.targets if isinstance(target, ast.Name)
                   and (str(path.relative_to(root)), target.id) in tied}
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                if values in enums:
                    found.append(f"{path.relative_to(root)}:{node.lineno} restates {enums[values]}")
    return found


def test_no_module_redeclares_a_schema_enum():
    """Restated enums drift from the schema: take them from workflow.config (schema_enum,
    SPLITS), or, for a kernel's set of what it implements, tie it to the schema's enum in
    conftest.KERNEL_CHOICES."""
    enums = schema_value_sets()
    assert frozenset({"train", "val", "test"}) in enums and frozenset({"ngp", "cic"}) in enums
    assert REPO / "training" / "settings.py" in set(python_sources(REPO))  # the scan reads them
    found = restated_enums(REPO)
    assert not found, "\n".join(found)


def test_the_enum_scan_finds_a_restated_enum(tmp_path):
    """The scan above is not vacuous: run on a copy of the packages with the old
    re-declaration planted back in training/settings.py, it reports that line and no other."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    settings = tmp_path / "training" / "settings.py"
    lines = settings.read_text().splitlines()
    settings.write_text("\n".join(lines + ['OPTIMIZERS = ("adam", "sgd")']) + "\n")
    [found] = restated_enums(tmp_path)  # the schema has the optimizer enum in two sections
    assert found.startswith(f"training/settings.py:{len(lines) + 1} restates ")
    assert found.endswith(".optimizer")


CHECKSUM_ROW = '''    Stage(
        name="checksum", unit=BATCH, job=preprocessing_jobs.checksum,
        summary="sha256 of each simulation's histogram -> checksums/<sim_id>.h5",
        outputs=lambda run, batch: [run.batch_summary("checksum", batch)],
        upstream=("histogram",), reads=(),
        per_simulation=lambda run, sim_id: run.root / "checksums" / f"{sim_id}.h5",
    ),
'''

CHECKSUM_JOB = '''

def checksum(run, config, record):
    """A new stage's kernel: the sha256 of one simulation's histogram, as an HDF5 attribute."""
    import h5py

    from workflow.io import sha256_file

    source, out = run.histogram(record.sim_id), run.root / "checksums" / f"{record.sim_id:05d}.h5"

    def write(provenance):
        out.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(out, "w") as handle:
            handle.attrs["sha256"], handle.attrs["provenance"] = sha256_file(source), provenance

    return Task(out, write, inputs=(source,))
'''


def test_a_new_stage_needs_its_table_row_and_its_job_only(tmp_path):
    """A per-batch checksum stage, written as one row of the table and one job function in a copy
    of the code, appears as a Snakemake rule (with its one-simulation rule), a `cosmoflow`
    subcommand with the batch unit's options, and units of the Parsl ensemble."""
    copy_dir = tmp_path / "code"
    for package in ("workflow", "simulations", "preprocessing", "training", "analysis", "config"):
        shutil.copytree(REPO / package, copy_dir / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "Snakefile", copy_dir)
    stages = copy_dir / "workflow" / "stages.py"
    text = stages.read_text()
    anchor = '    Stage(\n        name="write_tfrecords"'
    assert text.count(anchor) == 1
    stages.write_text(text.replace(anchor, CHECKSUM_ROW + anchor))
    with open(copy_dir / "preprocessing" / "jobs.py", "a") as jobs:
        jobs.write(CHECKSUM_JOB)
    env = {**os.environ, "PYTHONPATH": str(copy_dir)}

    def run(*command):
        result = subprocess.run(command, cwd=copy_dir, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    help_text = run(sys.executable, "-m", "workflow.cli", "checksum", "--help")
    assert "--batch B" in help_text and "--sim-id" in help_text and "checksums/<sim_id>.h5" in help_text
    batches = n_batches(load_config(copy_dir / "config" / "config.yaml"))
    plan = run("snakemake", "-n", "--cores", "1", "--until", "checksum", "--quiet", "rules")
    assert re.search(rf"^checksum\s+{batches}$", plan, re.M), plan
    one = run("snakemake", "results/tiny/checksums/00003.h5", "-n", "--cores", "1", "--quiet", "rules")
    assert re.search(r"^checksum_one\s+1$", one, re.M), one
    units = run(sys.executable, "-c", "from workflow.config import load_config; "
                "from workflow.parsl.ensemble import plan; "
                "print(sum(u.stage.name == 'checksum' for u in plan(load_config('config/config.yaml'))))")
    assert int(units) == batches


def string_literals(path: Path) -> list[tuple[int, str]]:
    """The string constants of a Python module that are neither docstrings nor dict keys (a
    record's field ``"stage"`` is not the stage of that name), with their lines."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    keys = {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings | keys]


def stage_names_written_outside_the_table(root: Path) -> list[str]:
    """Stage names as string literals in the rule files and in workflow/parsl/."""
    names = {stage.name for stage in STAGES}
    found = []
    for path in sorted((root / "workflow" / "rules").glob("*.smk")) + [root / "Snakefile"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            found += [f"{path.relative_to(root)}:{number}: {word}"
                      for word in re.findall(r"[\"'](\w+)[\"']", code) if word in names]
    for path in sorted((root / "workflow" / "parsl").glob("*.py")):
        found += [f"{path.relative_to(root)}:{number}: {value}"
                  for number, value in string_literals(path) if value in names]
    return found


def test_no_stage_name_is_written_outside_the_table(tmp_path):
    """Rules and the Parsl driver take every stage from workflow/stages.py; the scan is not vacuous:
    a rule file with a stage's name planted in it is reported."""
    assert stage_names_written_outside_the_table(REPO) == []
    shutil.copytree(REPO / "workflow", tmp_path / "workflow", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "Snakefile", tmp_path)
    with open(tmp_path / "workflow" / "rules" / "sweep.smk", "a") as rules:
        rules.write('\nPLANTED = STAGE["train"]\n')
    with open(tmp_path / "workflow" / "parsl" / "ensemble.py", "a") as module:
        module.write('\nPLANTED = "manifest"\n')
    assert [found.rsplit(": ", 1)[1] for found in stage_names_written_outside_the_table(tmp_path)] == [
        "train", "manifest"]


def test_a_learning_curve_point_is_checked_at_the_door():
    """`cosmoflow train-fraction --fraction F` checks F as training.train_fraction before any
    work: 0.3 of the tiny default's training simulations is not whole shards."""
    result = run_cli("train-fraction", "--fraction", "0.3", "--config", str(REPO / "config" / "config.yaml"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--fraction 0.3" in result.stderr and "training.train_fraction" in result.stderr
