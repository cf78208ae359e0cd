"""The install files agree: environment.yml lists what pyproject lists, torch is pinned."""
from __future__ import annotations

import os
import subprocess
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


def _install_commands(root, tmp_path, stamp: str) -> list[str]:
    """What make would run to install `stamp` into a venv at tmp_path that it takes for missing."""
    venv = tmp_path / "venv"
    ran = subprocess.run(["make", "-n", "-B", f"{venv}/{stamp}", f"VENV={venv}"], cwd=root, capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.splitlines()


def test_make_lab_installs_the_lab_and_make_test_every_extra_in_one_pip_run(root, tmp_path):
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = ",".join(sorted(project["optional-dependencies"]))
    test = _install_commands(root, tmp_path, ".labkit-test-installed")
    installs = [line for line in test if " -e " in line]
    assert len(installs) == 1 and f'-e ".[{extras}]"' in installs[0], f"make test must install .[{extras}] once"
    assert any(line.startswith("touch") and ".labkit-installed" in line for line in test), \
        "make test's install is the lab's too: it must mark the lab installed, or make lab installs again"
    lab = [line for line in _install_commands(root, tmp_path, ".labkit-installed") if " -e " in line]
    assert len(lab) == 1 and lab[0].endswith('-e ".[lab,serve]"'), \
        "make lab must install the lab and the server, without the test tools"
    makefile = (root / "Makefile").read_text()
    for target in ("test", "test-unit", "test-notebooks", "test-browser"):
        assert f"{target}: $(TEST_STAMP)" in makefile


def _imports(source: str) -> set[str]:
    """The top-level modules that Python ``source`` imports (IPython's % and ! lines left out)."""
    import ast

    names = set()
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _lab_imports(root) -> set[str]:
    """What the solution notebooks and labkit's own modules import."""
    import json

    names = set()
    for path in (root / "solutions").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        names |= _imports("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"))
    for path in (root / "labkit").rglob("*.py"):
        names |= _imports(path.read_text())
    return names


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def _with_dependencies(names: set[str]) -> set[str]:
    """``names`` and every installed distribution they need, transitively (no extras)."""
    import importlib.metadata

    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_canonical(req.name))
    return found


def test_make_lab_installs_everything_the_notebooks_and_labkit_import(root):
    """make lab leaves out the test extras: a notebook, or a labkit module, that imports one of them
    fails for a student."""
    import importlib.metadata
    import sys

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    lab = _with_dependencies({_canonical(Requirement(r).name)
                              for r in project["dependencies"] + extras["lab"] + extras["serve"]})
    distributions = importlib.metadata.packages_distributions()
    imports = _lab_imports(root)
    assert {"labkit", "torch", "openai", "fastapi"} <= imports  # the parse found the notebooks' and labkit's
    for name in sorted(imports - set(sys.stdlib_module_names) - {"labkit"}):
        provided = {_canonical(d) for d in distributions.get(name, [])}
        assert provided & lab, (
            f"the notebooks or labkit import {name} ({', '.join(sorted(provided)) or 'no installed package'}), which make "
            f"lab does not install: add it to pyproject.toml's dependencies or its lab or serve extra")


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
