"""The container recipes install what environment.yml and the class's lock say (parsed: there is no
container engine here)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from labkit import lockfile

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"Dockerfile": ROOT / "Dockerfile", "apptainer": ROOT / "containers" / "labkit.def"}
KERNEL = 'ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)"'
LOCK = lockfile.LOCK_PATH


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def env() -> tuple[dict[str, str], list[str]]:
    """({conda name: spec}, pip lines) of environment.yml."""
    data = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip = {}, []
    for item in data["dependencies"]:
        if isinstance(item, dict):
            pip += [line.split("#")[0].strip() for line in item["pip"] if not line.startswith(("--extra-index-url", "-c "))]
        else:
            name = re.match(r"\s*([A-Za-z0-9_.\-]+)", str(item)).group(1)
            conda[normalize(name)] = str(item)
    return conda, pip


def commands(text: str) -> list[str]:
    """Shell commands of a recipe: comments dropped, backslash continuations and && chains split."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [part.strip() for line in joined.splitlines() for part in line.split("&&") if part.strip()]


def pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` command, shell-split (quotes removed)."""
    out = []
    for cmd in commands(text):
        match = re.search(r"\bpip install\b(.*)", cmd)
        if match:
            out.append(shlex.split(match.group(1)))
    return out


def requirements(text: str) -> dict[str, Requirement]:
    reqs = {}
    for args in pip_installs(text):
        skip = False
        for arg in args:
            if skip or arg.startswith("-"):
                skip = arg in ("-c", "-r", "-e", "--constraint", "--index-url", "--extra-index-url")
                continue
            req = Requirement(arg) if arg != "." else None
            if req:
                reqs[normalize(req.name)] = req
    return reqs


def pyproject_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def base_image(text: str) -> str:
    match = re.search(r"^ARG BASE=(\S+)", text, re.M) or re.search(r"^From:\s*(\S+)", text, re.M)
    assert match, "the recipe names no base image"
    return match.group(1)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def recipe(request) -> tuple[str, str]:
    path = RECIPES[request.param]
    assert path.is_file(), f"{path} is missing"
    return request.param, path.read_text()


def test_every_pip_line_of_environment_yml_is_installed_the_same_way(env, recipe):
    # environment.yml's pip section: the CUDA build of torch, then labkit (`-e .`) with the lock.
    _, pip = env
    name, text = recipe
    installed = requirements(text)
    for line in pip:
        if line == "-e .":
            assert any(args[-2:] == ["-e", "."] for args in pip_installs(text)), f"{name} does not install labkit (-e .)"
            continue
        req = Requirement(line)
        got = installed.get(normalize(req.name))
        assert got is not None, f"{name} does not install {line}"
        assert got.specifier == req.specifier, f"{name}: {got} != {line}"


def test_every_pip_install_uses_the_lock_copied_into_the_image(recipe):
    name, text = recipe
    installs = pip_installs(text)
    assert installs and all(args[args.index("-c") + 1] == LOCK for args in installs if "-c" in args)
    assert all("-c" in args for args in installs), f"{name}: every pip install must use -c {LOCK}"
    assert all(LOCK in [args[i + 1] for i, a in enumerate(args) if a == "-c"] for args in installs), name
    copied = re.search(rf"^COPY {re.escape(LOCK)} {re.escape(LOCK)}$", text, re.M) if name == "Dockerfile" else \
        re.search(rf"^\s+{re.escape(LOCK)} /opt/labkit/{re.escape(LOCK)}$", text, re.M)
    assert copied, f"{name} must copy {LOCK} to where its pip installs read it"


def test_the_images_torch_and_python_are_the_locks(recipe):
    name, text = recipe
    lock = lockfile.parse((ROOT / LOCK).read_text())
    for pkg in ("torch", "torchvision"):
        pinned = next(iter(requirements(text)[pkg].specifier)).version
        assert lockfile.public(pinned) == lock.pins[pkg], f"{name}: {pkg}=={pinned}, the lock has {lock.pins[pkg]}"
    assert re.search(rf"(PYTHON_VERSION={re.escape(lock.python)}\b|== '{re.escape(lock.python)}')", text), \
        f"{name}: the image's Python must be the lock's ({lock.python})"


def test_every_conda_package_is_provided(env, recipe):
    """Each conda dependency maps to what provides it in a container; an unknown one fails this test."""
    conda, _ = env
    name, text = recipe
    image = base_image(text)
    tag = re.match(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-(devel|runtime)$", image)
    assert tag, f"{name}: base {image!r} is not an official pytorch/pytorch CUDA image"
    installed = requirements(text)
    for pkg, spec in conda.items():
        if pkg == "python":
            version = re.search(r"(\d+\.\d+)", spec).group(1)
            check = re.search(rf"(PYTHON_VERSION={version}\b|== '{version}')", text)
            assert check, f"{name}: no check that the image's python is {version}"
        elif pkg == "cuda-version":
            version = re.search(r"(\d+\.\d+)", spec).group(1)
            assert tag.group(2) == version, f"{name}: image CUDA {tag.group(2)} != environment.yml {version}"
            assert re.search(rf"(CUDA_VERSION={version}\b|startswith\('{version}'\))", text)
        elif pkg in ("cuda-nvcc", "cuda-cudart-dev"):
            assert tag.group(3) == "devel" and "nvcc --version" in text, f"{name}: {pkg} needs the devel image"
        elif pkg == "pip":
            assert pip_installs(text)
        else:  # a PyPI package of pyproject.toml (ninja): `-e .` installs it with the same bound
            req = Requirement(spec.replace("=", "==", 1) if re.search(r"[^<>=!]=[^=]", spec) else spec)
            declared = {normalize(Requirement(r).name): Requirement(r) for r in pyproject_dependencies()}
            assert normalize(req.name) in declared, f"{name}: conda package {spec!r} is not a pyproject dependency"
            assert declared[normalize(req.name)].specifier == req.specifier, f"pyproject.toml vs environment.yml: {spec!r}"
            assert any(args[-2:] == ["-e", "."] for args in pip_installs(text)), name


def test_torch_is_the_tested_cuda_wheel_and_labkit_itself_is_installed(env, recipe):
    # torch comes once from PyTorch's index for the image's CUDA (cu126: the 2.14 build with Volta
    # kernels), pinned as environment.yml pins it; every other install keeps it (the constraint).
    _, pip = env
    name, text = recipe
    cuda = re.search(r"-cuda(\d+)\.(\d+)-", base_image(text))
    installs = pip_installs(text)
    torch_installs = [args for args in installs if any(a.startswith("torch==") for a in args)]
    assert len(torch_installs) == 1, f"{name}: install torch exactly once"
    args = torch_installs[0]
    assert args[args.index("--index-url") + 1] == f"https://download.pytorch.org/whl/cu{cuda.group(1)}{cuda.group(2)}"
    pins = {Requirement(a).name: Requirement(a).specifier for a in args if "==" in a}
    for pkg in ("torch", "torchvision"):
        assert pins[pkg] == next(Requirement(p).specifier for p in pip if Requirement(p).name == pkg), name
    others = [a for a in installs if a is not args]
    assert all("/tmp/torch-constraint.txt" in a for a in others), f"{name}: every later pip install keeps the image's torch"
    assert any(args[-2:] == ["-e", "."] for args in installs), f"{name} does not install labkit itself (-e .)"
    assert KERNEL in text, f"{name} does not register the labkit kernel"


def test_both_recipes_install_the_same_packages_and_copy_what_the_package_needs():
    texts = {k: p.read_text() for k, p in RECIPES.items()}
    assert requirements(texts["Dockerfile"]) == requirements(texts["apptainer"])
    assert base_image(texts["Dockerfile"]) == base_image(texts["apptainer"])
    for part in ("pyproject.toml", "labkit", "notebooks", LOCK):
        assert (ROOT / part).exists()
        assert re.search(rf"^COPY .*\b{re.escape(part)}\b", texts["Dockerfile"], re.M), f"Dockerfile: COPY {part}"
        assert re.search(rf"^\s+{re.escape(part)} /opt/labkit/", texts["apptainer"], re.M), f"labkit.def: {part}"


def test_the_readme_documents_both_builds():
    text = (ROOT / "containers" / "README.md").read_text()
    assert "docker build -t labkit:gpu ." in text and "apptainer build labkit.sif containers/labkit.def" in text
    assert "--gpus all" in text and "exec --nv" in text


def test_results_go_to_a_folder_that_outlives_the_container():
    """Issue 25 (13): notebooks in the image are read-only (Apptainer) or vanish with the container
    (Docker): LABKIT_RUNS points at the folder the README mounts (Docker) or at the bound home (Apptainer)."""
    docker, apptainer = RECIPES["Dockerfile"].read_text(), RECIPES["apptainer"].read_text()
    readme = (ROOT / "containers" / "README.md").read_text()
    [root] = re.findall(r"^ENV LABKIT_RUNS=(\S+)$", docker, re.M)
    assert f':{root}"' in readme, f"the README's docker run must mount a host folder at {root}"
    assert re.search(r'^\s+export LABKIT_RUNS="\$\{LABKIT_RUNS:-\$\{HOME\}/', apptainer, re.M)
    assert "LABKIT_RUNS" in readme and "rsync" in readme  # where results go, and how they leave the node
