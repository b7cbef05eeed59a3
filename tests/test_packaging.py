"""pyproject.toml and environment.yml name the same runtime dependencies with the same bounds."""

import tomllib

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO


def pyproject_requirements() -> dict:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(r.name): str(r.specifier) for r in map(Requirement, project["dependencies"])}


def conda_requirements() -> dict:
    """Conda and pip entries of environment.yml, without python and pip themselves."""
    entries = []
    for item in yaml.safe_load((REPO / "environment.yml").read_text())["dependencies"]:
        entries += item["pip"] if isinstance(item, dict) else [item]
    requirements = {}
    for entry in entries:
        requirement = Requirement(entry.replace(" ", ""))
        requirements[canonicalize_name(requirement.name)] = str(requirement.specifier)
    requirements.pop("python")
    requirements.pop("pip")
    return requirements


def test_runtime_dependencies_agree():
    assert pyproject_requirements() == conda_requirements()


def test_every_dependency_has_a_lower_bound():
    for name, specifier in pyproject_requirements().items():
        assert ">=" in specifier, f"{name} has no verified lower bound"
