"""The install files agree: environment.yml lists what pyproject lists, torch is pinned."""
from __future__ import annotations

import os
import tomllib

import pytest

import yaml
from packaging.requirements import Requirement

from labkit.device import package_version


def _pyproject(root) -> list[Requirement]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["lab"] + extras["serve"] + extras["test"]]


def _conda_pip(root) -> list[Requirement]:
    env = yaml.safe_load((root / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e .[lab,serve,test]" in pip, "environment.yml must install labkit itself with its extras"
    return [Requirement(line) for line in pip if not line.startswith("-")]


def _constraints(root) -> dict[str, Requirement]:
    lines = (root / "constraints.txt").read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name: r for r in reqs}


def test_environment_yml_lists_the_pyproject_dependencies(root):
    conda, pins = {r.name: r for r in _conda_pip(root)}, _constraints(root)
    assert set(conda) == {r.name for r in _pyproject(root)}
    for req in _pyproject(root):
        if req.name not in pins:
            assert conda[req.name].specifier == req.specifier, f"{conda[req.name]} differs from {req}"


def test_torch_and_triton_are_pinned_alike_in_constraints_and_conda(root):
    pins = _constraints(root)
    assert str(pins["torch"].specifier) == "==2.13.0"
    conda = {r.name: r for r in _conda_pip(root)}
    for name in ("torch", "triton"):
        assert conda[name].specifier == pins[name].specifier


def test_make_installs_every_extra(root):
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = ",".join(sorted(project["optional-dependencies"]))
    assert f'-e ".[{extras}]"' in (root / "Makefile").read_text(), f"make install must install .[{extras}]"


def test_pyproject_ranges_admit_the_pinned_versions(root):
    pins = _constraints(root)
    for req in _pyproject(root):
        if req.name in pins:
            pinned = next(iter(pins[req.name].specifier)).version
            assert req.specifier.contains(pinned), f"{req} excludes the pinned {pinned}"


def test_triton_is_linux_only(root):
    triton = next(r for r in _pyproject(root) if r.name == "triton")
    assert triton.marker is not None
    assert not triton.marker.evaluate({"sys_platform": "darwin"})
    assert triton.marker.evaluate({"sys_platform": "linux"})


def test_installed_torch_is_the_pinned_build():
    version = package_version("torch")
    assert version is not None and version.startswith("2.13.0")


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI's machine has the CPU build at hand; others may not")
def test_ci_installed_the_cpu_build_not_cuda_wheels():
    import torch

    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build: the pin pulled CUDA wheels"
