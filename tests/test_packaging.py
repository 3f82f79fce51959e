"""Packaging: the GPU conda environment, the pyproject, the class's lock, the console script, the
Makefile and CI agree; the running venv is the locked one."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from labkit import lockfile

ROOT = Path(__file__).resolve().parent.parent
LOCK_FILE = ROOT / lockfile.LOCK_PATH

# A conda package name -> the PyPI distribution of pyproject.toml it provides or exists for.
# Conda names the torch build differently and ships CUDA pieces that pip gets inside wheels; each of
# them is mapped to the package it serves, so a piece whose package left pyproject fails the test.
# `python` and `pip` are not mapped: they are checked for what they are (see the tests below).
CONDA_TO_PYPI = {
    "pytorch": "torch",            # conda's name for torch
    "pytorch-gpu": "torch",        # conda-forge metapackage selecting the CUDA build of pytorch
    "pytorch-cuda": "torch",       # the pytorch channel's CUDA selector for pytorch
    "cuda-version": "torch",       # pins the CUDA version the torch build is compiled against
    "cuda-nvcc": "deepspeed",      # nvcc, for the CUDA ops DeepSpeed JIT-compiles on first use
    "cuda-cudart-dev": "deepspeed",  # CUDA runtime headers for the same JIT builds
}
# `-e .` in the pip section installs labkit itself, the packages of pyproject.toml and the `labkit`
# command on the GPU nodes, at the versions of the lock (`-c requirements/lock.txt`).
PROJECT_ITSELF = "-e ."
LOCK_OPTION = f"-c {lockfile.LOCK_PATH}"
INSTALLERS = {"pip"}
TORCH_INDEX_OPTION = "--extra-index-url"  # the installer conda needs for the `pip:` section, not a project dependency


def normalize(name: str) -> str:
    """PEP 503 name normalisation: Foo_Bar and foo-bar are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def conda_name(spec: str) -> str:
    """The package name of a conda match spec ('pytorch-gpu>=2.6', 'python=3.11', 'cuda-nvcc')."""
    match = re.match(r"\s*([A-Za-z0-9_.\-]+)", spec)
    assert match, f"environment.yml: cannot read the conda spec {spec!r}"
    return normalize(match.group(1))


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def env() -> dict:
    data = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert isinstance(data, dict) and data.get("dependencies"), "environment.yml needs a dependencies list"
    return data


def split_env(env: dict) -> tuple[list[str], list[str]]:
    """(conda specs, pip lines) of environment.yml."""
    conda, pip = [], []
    for item in env["dependencies"]:
        if isinstance(item, dict):
            assert set(item) == {"pip"}, f"environment.yml: unknown dependency section {sorted(item)}"
            pip += item["pip"]
        else:
            conda.append(str(item))
    return conda, pip


def env_packages(env: dict) -> list[str]:
    """PyPI names environment.yml installs, conda names mapped through CONDA_TO_PYPI (with repeats)."""
    conda, pip = split_env(env)
    names = []
    for spec in conda:
        name = conda_name(spec)
        if name == "python" or name in INSTALLERS:
            continue  # checked by test_env_python_satisfies_requires_python / test_env_has_pip_for_its_pip_section
        names.append(normalize(CONDA_TO_PYPI.get(name, name)))
    for line in pip:
        line = line.split("#")[0].strip()
        if line in (PROJECT_ITSELF, LOCK_OPTION):
            continue  # checked by test_env_installs_labkit_itself_with_the_lock
        if line.startswith(TORCH_INDEX_OPTION):
            continue  # checked by test_environment_yml_uses_a_cuda_build_of_torch
        assert not line.startswith("-"), f"environment.yml pip option {line!r} is not understood by this test"
        names.append(normalize(Requirement(line).name))
    return names


def test_environment_yml_installs_only_packages_of_pyproject(env, pyproject):
    # `-e .` brings every package of pyproject.toml; what environment.yml names beside it (the CUDA build
    # of torch, conda's CUDA tools) must serve one of them.
    declared = {normalize(Requirement(r).name) for r in pyproject["project"]["dependencies"]}
    installed = set(env_packages(env))
    assert sorted(installed - declared) == [], "in environment.yml but not in pyproject.toml (or CONDA_TO_PYPI)"


def test_environment_yml_lists_each_pip_package_once(env):
    conda, pip = split_env(env)
    pip_names = [normalize(Requirement(p.split("#")[0]).name) for p in pip if not p.startswith("-")]
    conda_names = [conda_name(c) for c in conda]
    assert sorted({n for n in pip_names if pip_names.count(n) > 1}) == []
    assert sorted(set(pip_names) & set(conda_names)) == [], "installed by both conda and pip"


def test_environment_yml_uses_a_cuda_build_of_torch(env):
    # The tested torch as PyTorch's CUDA wheel of the pinned cuda-version: cu126 is torch 2.14's only
    # build with Volta (sm_70) kernels, so V100 nodes work too (docs/gpu-node.md).
    conda, pip = split_env(env)
    names = {conda_name(c) for c in conda}
    assert "cuda-version" in names, "pin the CUDA version so every CUDA package agrees"
    cuda = re.search(r"(\d+)\.(\d+)", next(c for c in conda if conda_name(c) == "cuda-version"))
    tag = f"cu{cuda.group(1)}{cuda.group(2)}"
    assert f"{TORCH_INDEX_OPTION} https://download.pytorch.org/whl/{tag}" in pip
    pins = {Requirement(p).name: str(Requirement(p).specifier) for p in pip if not p.startswith("-")}
    locked = lockfile.parse(LOCK_FILE.read_text()).pins
    assert pins["torch"] == f"=={locked['torch']}+{tag}" and pins["torchvision"] == f"=={locked['torchvision']}+{tag}"


def test_env_python_satisfies_requires_python_and_is_the_locks(env, pyproject):
    conda, _ = split_env(env)
    pythons = [c for c in conda if conda_name(c) == "python"]
    assert len(pythons) == 1, "environment.yml must pin python once, e.g. python=3.11"
    version = re.search(r"(\d+\.\d+)", pythons[0]).group(1)
    assert version in SpecifierSet(pyproject["project"]["requires-python"])
    assert version == lockfile.parse(LOCK_FILE.read_text()).python, "the lock was resolved for another Python"


def test_env_has_pip_for_its_pip_section(env):
    conda, pip = split_env(env)
    assert pip, "environment.yml installs the PyPI packages in a pip: section"
    assert "pip" in {conda_name(c) for c in conda}, "list pip itself, or conda warns and may use another pip"


def test_env_installs_labkit_itself_with_the_lock(env):
    _, pip = split_env(env)
    lines = [p.split("#")[0].strip() for p in pip]
    assert PROJECT_ITSELF in lines and LOCK_OPTION in lines
    # conda writes the pip section to a requirements file beside environment.yml: paths are relative to it
    assert (ROOT / "environment.yml").parent / lockfile.LOCK_PATH == LOCK_FILE and LOCK_FILE.is_file()


# -- the class's lock ---------------------------------------------------------------------------------

def test_the_lock_satisfies_pyproject(pyproject):
    locked = lockfile.parse(LOCK_FILE.read_text()).pins
    reqs = pyproject["project"]["dependencies"] + pyproject["project"]["optional-dependencies"]["test"]
    for req in map(Requirement, reqs):
        version = locked.get(normalize(req.name))
        assert version is not None, f"{req.name} is not in {lockfile.LOCK_PATH}: run `make lock`"
        assert req.specifier.contains(version, prereleases=True), f"lock has {req.name}=={version}, pyproject wants {req}"


def test_the_venv_is_the_lock():
    # What `make lock` would write from this venv agrees with the committed lock: every package of
    # labkit's tree installed here is locked at its version, and every locked package is either
    # installed at that version or not installed at all (an extra this venv lacks, e.g. on a GPU node).
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, timeout=120)
    assert freeze.returncode == 0, freeze.stderr
    dists = lockfile.distributions()
    have = set(lockfile.lock_lines(freeze.stdout, lockfile.needed(dists)[1]))
    want = set(LOCK_FILE.read_text().splitlines()) - {line for line in LOCK_FILE.read_text().splitlines()
                                                       if line.startswith("#")}
    drift = sorted(have - want) + sorted(line for line in want - have if line.split("==")[0] in dists)
    assert drift == [], (f"this venv differs from {lockfile.LOCK_PATH} (installed vs locked: {drift}): "
                         "`make venv` installs the lock; after changing pyproject.toml run `make lock`")
    assert lockfile.parse(LOCK_FILE.read_text()).python == "%d.%d" % sys.version_info[:2]


def test_every_makefile_install_uses_the_lock():
    text = (ROOT / "Makefile").read_text()
    assert re.search(rf"^LOCK := {re.escape(lockfile.LOCK_PATH)}$", text, re.M)
    recipe = makefile_recipes()["$(BIN)/.installed"]
    installs = [line for line in recipe.split("\n") if "pip install" in line and "--upgrade pip" not in line]
    assert len(installs) == 2 and all("-c $(LOCK)" in line for line in installs), installs
    assert "$(LOCK)" in next(line for line in text.splitlines() if line.startswith("$(BIN)/.installed:")), \
        "a new lock must reinstall the venv"
    # torch/torchvision pins come from the lock; the wheel index from the node's driver (tests/test_lock.py)
    assert re.search(r"^TORCH_PINS = \$\(shell grep -E '\^torch\(vision\)\?==' \$\(LOCK\)\)$", text, re.M)
    assert "$(TORCH_INDEX_CMD)" in recipe and re.search(
        r"^TORCH_INDEX_CMD = \$\(PYTHON\) -I labkit/runtime/cudadriver\.py --cpu-index \$\(CPU_INDEX\)$", text, re.M)
    lock = makefile_recipes()["lock"]
    assert "pip freeze | $(BIN)/python -m labkit.lockfile > $(LOCK).new" in lock


def test_console_script_labkit(pyproject):
    assert pyproject["project"]["scripts"]["labkit"] == "labkit.cli:main"
    (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "labkit"]
    assert entry.value == "labkit.cli:main" and callable(entry.load())
    script = Path(sys.executable).parent / "labkit"
    assert script.is_file(), f"{script} missing: reinstall with `make venv`"
    result = subprocess.run([str(script), "notebooks", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "run" in result.stdout and "clean" in result.stdout


def makefile_recipes() -> dict[str, str]:
    """target -> its recipe text, for the plain `target: deps` rules of the Makefile."""
    recipes: dict[str, str] = {}
    current = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([A-Za-z0-9_.\-$()/]+)\s*:(?!=)", line)
        if rule:
            current = rule.group(1)
            recipes[current] = ""
        elif line.startswith("\t") and current:
            recipes[current] += line.strip() + "\n"
        elif line.strip() and not line.startswith("#"):
            current = None
    return recipes


def test_makefile_has_the_user_targets():
    recipes = makefile_recipes()
    assert sorted({"lab", "test", "smoke", "clean-notebooks"} - set(recipes)) == []
    assert "pytest" in recipes["test"]
    assert "labkit notebooks run --profile smoke --out $(BUILD)/executed" in recipes["smoke"]
    assert "labkit notebooks clean" in recipes["clean-notebooks"]
    assert "jupyter lab --notebook-dir=notebooks" in recipes["lab"]
    # Course nodes and containers often log in as root, where Jupyter refuses to start without it.
    assert '[ "$$(id -u)" = 0 ] && echo --allow-root' in recipes["lab"]


def test_ci_runs_make_test():
    ci = ROOT / ".ci" / "run"
    assert ci.is_file(), ".ci/run is missing"
    commands = [line.split("#")[0] for line in ci.read_text().splitlines()]
    assert any(re.search(r"(^|[\s;&|])make\s+(.*\s)?test(\s|$)", c) for c in commands), ".ci/run must call `make test`"
