"""The stage table (workflow/stages.py): every job reads only the config keys its stage declares,
and the schema is the only place that lists the configuration's allowed values."""

from __future__ import annotations

import ast
import copy
import shutil
from pathlib import Path

import pytest

from conftest import REPO, SMALL
from workflow.config import load_schema, validate_config
from workflow.paths import RunLayout
from workflow.stages import STAGE, STAGES, run_stage

SELECTIONS = {"batch": [{"batch": 0}, {"batch": 1}], "run": [{}]}

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
    config = validate_config(copy.deepcopy(SMALL) | {"results_dir": str(tmp_path), "training": {
        "model": "mlperf", "epochs": 1, "batch_size": 4, "threads": 1}})
    run = RunLayout(tmp_path / "small")
    reads: dict[str, set[str]] = {}
    for stage in STAGES:
        selections = SELECTIONS.get(stage.unit) or [
            {"split": split, "shard": 0} for split in ("train", "val", "test")]
        for selection in selections:
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
    assert view["preprocessing"]["grid"] == 64
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
            "redshifts", "n_steps", "stepping", "cola", "n_cola", "mesh_factor", "gradient", "backend")}}
    # every stage of DESIGN.md's order, each rule name once, each command once
    assert [stage.name for stage in STAGES] == [
        "sample_parameters", "initial_conditions", "simulate", "histogram", "write_tfrecords",
        "manifest", "stage", "train", "analyze"]
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
    schema enum (or to a section's key set)."""
    enums = schema_value_sets()
    found = []
    for path in python_sources(root):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                if values in enums:
                    found.append(f"{path.relative_to(root)}:{node.lineno} restates {enums[values]}")
    return found


def test_no_module_redeclares_a_schema_enum():
    """Restated enums drift from the schema: take them from workflow.config (schema_enum,
    SPLITS)."""
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
