"""The import floors (pyproject.toml, [tool.importlinter]): the core, then the kernels in data-flow
order, then the orchestration, which reaches a kernel only through ``<kernel>.jobs``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO

KERNELS = ("simulations", "preprocessing", "training", "analysis")
# `from a.b import c, d` or `import a.b, c`, at any indentation (rules' run: blocks too)
IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+(.+)|import\s+(.+))$")


def test_import_contracts_hold():
    result = subprocess.run(["lint-imports"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_workflow_module_has_a_floor():
    """A layers contract constrains only the modules it names: a new workflow module must join one."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [contract["layers"] for contract in contracts if contract["type"] == "layers"]
    named = {module.strip() for layer in layers for module in layer.split(":")}
    modules = {f"workflow.{path.stem}" for path in (REPO / "workflow").iterdir()
               if path.suffix == ".py" and path.stem != "__init__" or (path / "__init__.py").exists()}
    assert modules - named == set()


def test_training_loads_no_analysis_and_needs_no_scikit_learn():
    """Training sits below analysis: its entry point loads no analysis module and imports without
    scikit-learn, which only the analysis baselines use. (Keras loads scikit-learn when it can,
    for its wrappers, and does without it: so the test makes it unimportable.)"""
    loaded = subprocess.run(
        [sys.executable, "-c", "import json, sys; sys.modules['sklearn'] = None; import training.run; "
         "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'analysis')))"],
        capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout.splitlines()[-1]) == []


def kernel_imports(line: str) -> list[str]:
    """The kernel modules a Python import ``line`` names (a kernel package alone is not one)."""
    match = IMPORT.match(line)
    if not match:
        return []
    package, names, plain = match.groups()
    if plain is not None:
        modules = [name.split(" as ")[0].strip() for name in plain.split(",")]
    elif package in KERNELS:  # `from training import run`: the names are its modules
        modules = [f"{package}.{name.split(' as ')[0].strip(' ()')}" for name in names.split(",")]
    else:
        modules = [package]
    return [module for module in modules if module.split(".")[0] in KERNELS and "." in module]


@pytest.mark.parametrize("line,modules", [
    ("from preprocessing.jobs import shard_batches", ["preprocessing.jobs"]),
    ("    from preprocessing.staging import format_plan", ["preprocessing.staging"]),
    ("from training import jobs as training_jobs, run", ["training.jobs", "training.run"]),
    ("import analysis.metrics, numpy", ["analysis.metrics"]),
    ("from workflow.stages import STAGES", []),
    ("what the rules take from the stage table", []),
])
def test_kernel_imports_of_a_line(line, modules):
    assert kernel_imports(line) == modules


def test_snakefile_and_rules_reach_kernels_only_through_their_jobs():
    """import-linter sees Python packages only; the Snakefile and rules are orchestration too."""
    violations = [
        f"{path.relative_to(REPO)}:{number}: {module}"
        for path in [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for module in kernel_imports(line) if module.split(".")[1] != "jobs"]
    assert not violations
