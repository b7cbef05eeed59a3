"""Snakemake's linter over the Snakefile: fails on any finding but one, and when the linter
does not run to its end (missing, crashed, or printing something that is not a lint).

The one finding allowed: "Specify a conda environment or container for each rule". The rules
run the `cosmoflow` command of the environment Snakemake itself runs in (pyproject.toml, or
environment.yml on HPC sites); a per-rule conda environment would lack the package.
"""

from __future__ import annotations

import subprocess
import sys

ALLOWED = "Specify a conda environment or container for each rule."
# what `snakemake --lint` prints besides its findings, each finding's text being indented
PREAMBLE = ("Using workflow specific profile", "Lints for ")  # rule ... or snakefile ...
NONE_FOUND = "Congratulations, your workflow is in a good condition!"


def lint_findings(output: str) -> list[str]:
    """The findings in the linter's output; ValueError on a line that is not part of a lint."""
    findings = []
    for line in output.splitlines():
        if line.startswith("    * "):
            findings.append(line.strip().removeprefix("* "))
        elif line.strip() and not line.startswith((" ", *PREAMBLE, NONE_FOUND)):
            raise ValueError(f"not a lint: {line!r}")
    if not findings and NONE_FOUND not in output:
        raise ValueError("neither a finding nor its closing line")
    return findings


def main() -> int:
    try:
        result = subprocess.run(["snakemake", "--lint"], capture_output=True, text=True)
    except FileNotFoundError:
        print("lint: no snakemake on PATH", file=sys.stderr)
        return 1
    output = result.stdout + result.stderr
    try:
        findings = lint_findings(output)
    except ValueError as error:
        print(output, f"lint: snakemake --lint did not run to its end ({error})", sep="\n",
              file=sys.stderr)
        return 1
    # snakemake --lint exits 1 when it has findings, 0 when it has none
    if result.returncode != (1 if findings else 0):
        print(output, f"lint: snakemake --lint exited {result.returncode} with "
              f"{len(findings)} finding(s)", sep="\n", file=sys.stderr)
        return 1
    other = [finding for finding in findings if not finding.startswith(ALLOWED)]
    if other:
        print(output, "lint: snakemake --lint found:", *sorted(set(other)), sep="\n",
              file=sys.stderr)
        return 1
    print(f"snakemake --lint: no findings but the per-rule conda environment "
          f"({len(findings)} rules; .ci/lint.py says why)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
