"""CI cannot pass by accident: a failing step fails .ci/run before the next one starts, and the
linter's check fails when the linter finds something, crashes or is missing (commands planted
first on PATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

CONDA_LINT = """Lints for rule train (line 1, workflow/rules/training.smk):
    * Specify a conda environment or container for each rule.:
      This way, the used software for each specific step is documented.
"""
OTHER_LINT = """Lints for snakefile workflow/rules/training.smk:
    * Mixed rules and functions in same snakefile.:
      Small one-liner functions used only once should be defined as lambda expressions.
"""


def plant(directory: Path, name: str, script: str) -> None:
    """An executable ``name`` in ``directory`` that runs this shell ``script``."""
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


CHECKS = ("lint-imports", "ruff", "snakefmt")  # in .ci/run's order, after the install
LATER = ("pytest", "snakemake")  # the tests and the linter


def run_ci(tools: Path) -> subprocess.CompletedProcess:
    """.ci/run with the commands planted in ``tools`` first on PATH."""
    return subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True,
                          env=os.environ | {"PATH": f"{tools}:{os.environ['PATH']}"},
                          timeout=600)  # a hang guard only


def test_a_failing_install_fails_ci_before_the_tests(tmp_path):
    plant(tmp_path, "pip", "echo 'ERROR: No matching distribution found' >&2; exit 1\n")
    ran = tmp_path / "ran"
    for later in CHECKS + LATER:
        plant(tmp_path, later, f"echo {later} >> {ran}\n")
    result = run_ci(tmp_path)
    assert result.returncode != 0
    assert "No matching distribution found" in result.stderr
    assert not ran.exists()  # neither the checks, the tests nor the linter ran after it


@pytest.mark.parametrize("failing", CHECKS)
def test_a_failing_check_fails_ci_before_the_tests(tmp_path, failing):
    ran = tmp_path / "ran"
    plant(tmp_path, "pip", "exit 0\n")
    for tool in CHECKS + LATER:
        plant(tmp_path, tool, f"echo {tool} >> {ran}\n" + ("exit 1\n" if tool == failing else ""))
    result = run_ci(tmp_path)
    assert result.returncode != 0
    assert ran.read_text().split() == list(CHECKS[:CHECKS.index(failing) + 1])  # and nothing after


@pytest.mark.parametrize("output,status,passes", [
    (CONDA_LINT, 1, True),  # the one finding .ci/lint.py allows
    ("Congratulations, your workflow is in a good condition!\n", 0, True),
    ("", 0, False),  # the linter always says something
    (CONDA_LINT + OTHER_LINT, 1, False),
    ("Traceback (most recent call last):\nWorkflowError: bad Snakefile\n", 1, False),
    (CONDA_LINT, 0, False),  # findings and success do not go together
    ("", 1, False),  # failed without saying why
])
def test_lint_check_fails_unless_the_linter_ran_and_found_only_the_allowed(
        tmp_path, output, status, passes):
    (tmp_path / "output.txt").write_text(output)
    plant(tmp_path, "snakemake", f"cat {tmp_path / 'output.txt'} >&2; exit {status}\n")
    result = subprocess.run([sys.executable, str(REPO / ".ci" / "lint.py")], cwd=REPO,
                            capture_output=True, text=True,
                            env=os.environ | {"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert (result.returncode == 0) == passes, result.stdout + result.stderr


def test_lint_check_fails_without_snakemake(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / ".ci" / "lint.py")], cwd=REPO,
                            capture_output=True, text=True,
                            env=os.environ | {"PATH": str(tmp_path)})
    assert result.returncode != 0 and "no snakemake" in result.stderr
