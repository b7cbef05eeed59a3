"""The run directory's layout (workflow.paths): every path it names lies inside the run
directory, and the pipeline writes only what it names."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from pathlib import Path

from conftest import REPO
from test_stages import string_literals
from workflow.paths import AnalysisFiles, DatasetFiles, RunLayout, TrainingFiles

# an argument for every parameter a layout method takes
ARGUMENTS = {"sim_id": 3, "split": "train", "shard": 2, "fraction": 0.5, "rule": "simulate",
             "batch": 1, "name": "trial"}


def named_paths(layout, prefix: str = "") -> dict[str, Path]:
    """Every path that ``layout`` (a RunLayout or one of its file groups) names, by member name:
    its properties and methods (called with :data:`ARGUMENTS`), and those of every file group
    they return, recursively."""
    fields = {field.name for field in dataclasses.fields(layout)}
    found = {}
    for name, member in inspect.getmembers(type(layout)):
        if name.startswith("_") or name in fields:
            continue
        if isinstance(member, property):
            value = getattr(layout, name)
        elif inspect.isfunction(member):
            parameters = list(inspect.signature(member).parameters)[1:]
            value = getattr(layout, name)(**{p: ARGUMENTS[p] for p in parameters})
        else:
            continue
        if isinstance(value, list):  # what is on disk now (DatasetFiles.shard_summaries)
            continue
        if dataclasses.is_dataclass(value):
            found[f"{prefix}{name}"] = value.directory
            found.update(named_paths(value, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = value
    return found


def test_every_named_path_lies_inside_the_run_directory(tmp_path):
    root = tmp_path / "results" / "run"
    paths = named_paths(RunLayout(root))
    assert {"training_files.model", "analysis_files.report", "sweep.trial.log",
            "parsl_files.running", "shard_summary", "staged_data"} <= set(paths)
    outside = {name: path for name, path in paths.items() if not path.is_relative_to(root) or path == root}
    assert not outside


def test_moved_stage_directories_take_their_files_along(tmp_path):
    root, elsewhere = tmp_path / "run", tmp_path / "trial"
    paths = named_paths(RunLayout(root, training_dir=elsewhere / "t", analysis_dir=elsewhere / "a"))
    for name, path in paths.items():
        moved = name.startswith(("training", "analysis"))
        assert path.is_relative_to(elsewhere if moved else root), name


def test_the_files_of_a_directory_have_distinct_names(tmp_path):
    for files in (DatasetFiles(tmp_path), TrainingFiles(tmp_path), AnalysisFiles(tmp_path),
                  RunLayout(tmp_path).sweep("s"), RunLayout(tmp_path).parsl_files):
        paths = list(named_paths(files).values())
        assert len(set(paths)) == len(paths), type(files).__name__


def test_the_pipeline_writes_only_what_the_layout_names(small_run):
    """Walk the small pipeline run: each entry of the run directory, of training/, analysis/,
    staged/ and of the data set's split directories is a path the layout names."""
    _, _, root = small_run
    run = RunLayout(root)
    paths = named_paths(run)
    tops = {path.relative_to(root).parts[0] for path in paths.values()}
    assert {p.name for p in root.iterdir()} <= tops
    for directory in (run.training, run.analysis, run.staged):
        assert set(directory.iterdir()) <= set(paths.values()), directory
    assert run.training_files.model.is_file() and run.training_files.run_record.is_file()
    assert any(run.training_files.checkpoints.iterdir()) and run.training_files.history.is_file()
    # Snakemake stamps a directory() output; the figures are the analysis's own
    figures = {p for p in run.analysis_files.figures.iterdir() if p.name != ".snakemake_timestamp"}
    assert figures == {run.analysis_files.figure(p.stem) for p in figures} and figures
    assert {run.analysis_files.report, run.analysis_files.metrics, run.analysis_files.predictions} <= set(
        run.analysis.iterdir())
    summaries = run.tfrecord_files.shard_summaries()
    assert summaries and all(path == run.shard_summary(path.parent.name, int(path.stem[-4:]))
                             for path in summaries)


PACKAGES = ("workflow", "simulations", "preprocessing", "training", "analysis")


def run_file_names() -> set[str]:
    """The file names that workflow/paths.py gives the run directory's files (with an extension)."""
    return {value for _, value in string_literals(REPO / "workflow" / "paths.py")
            if "." in value.strip(".") and not any(c in value for c in " *{")}


def run_file_names_outside_the_layout(root: Path) -> list[str]:
    """String literals naming a run-directory file (``model.keras``, ``tfrecords/manifest.json``)
    in the packages under ``root``, outside workflow/paths.py; messages (with spaces) and paths of
    the repository itself (``config/config.yaml``) are not names of run files."""
    names, found = run_file_names(), []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path == root / "workflow" / "paths.py":
                continue
            found += [f"{path.relative_to(root)}:{number}: {value}"
                      for number, value in string_literals(path)
                      if " " not in value and not (REPO / value).exists()
                      and any(value == name or value.endswith("/" + name) for name in names)]
    return found


def test_no_run_file_name_is_written_outside_the_layout(tmp_path):
    """Every run-directory file is named in workflow/paths.py only; the scan is not vacuous: a
    name planted in training/run.py is reported."""
    assert {"model.keras", "run.json", "manifest.json", "report.html", "ic.h5"} <= run_file_names()
    assert run_file_names_outside_the_layout(REPO) == []
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "training" / "run.py", "a") as module:
        module.write('\nPLANTED = "training/model.keras"\n')
    [found] = run_file_names_outside_the_layout(tmp_path)
    assert found.startswith("training/run.py:") and found.endswith("training/model.keras")
