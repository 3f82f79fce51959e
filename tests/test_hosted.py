"""Free cloud notebooks (labkit.runtime.hosted): Colab / Kaggle detected from their kernels' variables, the first
cell installs labkit there (and nowhere else) with a torch the driver runs (a fake nvidia-smi for drivers 535,
550, 570, 580 and none), and a 2-GPU lab on Colab's one T4 stops in one line."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.runtime import envinfo, hosted
from labkit.errors import ConfigError, HardwareError, NeedsMoreGPUs
from labkit.profiles import get_profile

ROOT = Path(__file__).resolve().parent.parent
#: The labs that train on several ranks (tests/test_gpu_profiles.py lists the same for nproc > 1).
TWO_GPU_LABS = {"03_ddp", "04_fsdp", "05_zero", "07_model_parallel", "08_profiling_and_stacking", "09_beyond_3d"}
PLATFORM_VARS = [var for _name, var, _profile in hosted.PLATFORMS.values()]


@pytest.fixture
def nowhere(monkeypatch):
    for var in PLATFORM_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("var, key, name", [("COLAB_RELEASE_TAG", "colab", "Colab"),
                                            ("KAGGLE_KERNEL_RUN_TYPE", "kaggle", "Kaggle")])
def test_each_platform_is_named_from_its_kernels_variable(nowhere, var, key, name):
    assert hosted.platform() is None and hosted.platform_name() == "none"
    nowhere.setenv(var, "release-colab_20261120-060000_RC00" if key == "colab" else "Interactive")
    assert hosted.platform() == key and hosted.platform_name() == name
    facts = envinfo.collect()
    assert facts["platform"] == name
    profile = hosted.PLATFORMS[key][2]
    assert f"platform     {name}: use --profile {profile}" in envinfo.format_report(facts).splitlines()
    assert hosted.platform({var: ""}) is None  # set but empty is not the platform


LOCK = (ROOT / "requirements" / "lock.txt").read_text()
PINS = [line for line in LOCK.splitlines() if line.startswith(("torch==", "torchvision=="))]


def _fake_clone(cmd):
    """What `git clone` brings that the cell reads before labkit is installed."""
    clone = Path(cmd[-1])
    for rel in ("labkit/runtime/cudadriver.py", "requirements/lock.txt", "pyproject.toml"):
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        (clone / rel).write_bytes((ROOT / rel).read_bytes())


def _first_cell(calls, monkeypatch, tmp_path, lab="02_single_gpu", gpus=1):
    """Execute the install part of a notebook's first cell in tmp_path, recording its commands (git clone is
    faked with the files the cell reads; pip is recorded, not run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "check_call",
                        lambda cmd: calls.append(cmd) or (_fake_clone(cmd) if cmd[0] == "git" else 0))
    monkeypatch.setattr(sys, "path", list(sys.path))
    source = hosted.first_cell(lab, gpus).split("\n\nfrom labkit.runtime.hosted import require_gpus")[0]
    exec(compile(source, "first_cell", "exec"), {})


def fake_nvidia_smi(folder: Path, driver: str | None) -> Path:
    """An nvidia-smi on a T4 with `driver` (None: one that cannot reach a driver, as on a CPU runtime)."""
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    body = (f'echo "{driver}, Tesla T4, 7.5"' if driver else
            "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\" >&2; exit 9")
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return folder


def fake_platform_torch(folder: Path, version: str, cuda: str | None) -> Path:
    """A platform's torch as the first cell reads it: torch/version.py (never imported)."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text("raise ImportError('the first cell must not import torch')\n")
    (folder / "torch" / "version.py").write_text(
        f"from typing import Optional\n__version__ = '{version}'\ncuda: Optional[str] = {cuda!r}\n")
    return folder


@pytest.fixture
def colab(nowhere):
    nowhere.setenv("COLAB_RELEASE_TAG", "release-colab_20261120-060000_RC00")
    return nowhere


def test_the_first_cell_installs_labkit_with_the_lock_on_colab_and_kaggle_only(nowhere, tmp_path):
    calls: list = []
    _first_cell(calls, nowhere, tmp_path)  # on this machine: nothing
    assert calls == [] and str(tmp_path / hosted.CLONE_DIR) not in sys.path
    nowhere.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', '580.95.05')}:{os.environ['PATH']}")
    for var in PLATFORM_VARS:
        nowhere.delenv(PLATFORM_VARS[0], raising=False)
        nowhere.setenv(var, "1")
        calls.clear()
        shutil.rmtree(tmp_path / hosted.CLONE_DIR, ignore_errors=True)
        _first_cell(calls, nowhere, tmp_path)
        clone, *pips = calls
        assert clone == ["git", "clone", "--depth", "1", hosted.repository(), hosted.CLONE_DIR]
        assert pips and all(pip[:3] == [sys.executable, "-m", "pip"] for pip in pips)
        assert pips[-1][-2:] == ["-e", hosted.CLONE_DIR]
        assert sys.path[0] == str(tmp_path / hosted.CLONE_DIR)  # importable in the kernel that installed it
    calls.clear()  # the next notebook in the same session: installed already
    _first_cell(calls, nowhere, tmp_path)
    assert calls == [] and sys.path[0] == str(tmp_path / hosted.CLONE_DIR)
    (tmp_path / hosted.CLONE_DIR / hosted.INSTALLED).unlink()  # an install that failed half-way runs again
    _first_cell(calls, nowhere, tmp_path)
    assert calls and calls[0][0] != "git"


#: driver, the platform's torch (version, CUDA), then: None (kept) or the locked build's index; what the line says
CASES = [
    ("535.104.05", ("2.9.0+cu126", "12.6"), None, "runs its CUDA 12.6 through CUDA minor-version compatibility only"),
    ("535.104.05", ("2.5.1+cu124", "12.4"), "cu126", "older than labkit's minimum 2.6): NVIDIA driver 535.104.05 "
                                                     "supports CUDA up to 12.2, so it runs through CUDA minor-version"),
    ("550.54.15", ("2.14.1+cu130", "13.0"), "cu126", "needs a newer driver): NVIDIA driver 550.54.15 supports CUDA up "
                                                     "to 12.4, so it runs through CUDA minor-version compatibility"),
    ("550.54.15", ("2.9.0+cu126", "12.6"), None, "Triton kernels and torch.compile (PTX JIT) may fail"),
    ("570.133.20", ("2.14.1+cu130", "13.0"), "cu126", "needs a newer driver): NVIDIA driver 570.133.20 supports "
                                                      "CUDA 12.6"),
    ("570.133.20", ("2.9.0+cu126", "12.6"), None, "NVIDIA driver 570.133.20 runs its CUDA 12.6"),
    ("580.95.05", ("2.14.1+cu130", "13.0"), None, "NVIDIA driver 580.95.05 runs its CUDA 13.0"),
    ("580.95.05", ("2.5.1+cu124", "12.4"), "cu130", "supports CUDA 13.0"),
    (None, ("2.9.0+cu126", "12.6"), None, "no NVIDIA driver: it runs on the CPU"),
    (None, ("2.5.1+cu124", "12.4"), "cpu", "CPU build (the platform's torch 2.5.1+cu124 is older than labkit's "
                                           "minimum 2.6; no NVIDIA driver"),
]


@pytest.mark.parametrize("driver, torch, build, says", CASES)
def test_the_first_cell_keeps_a_torch_the_driver_runs_or_installs_the_locked_build_for_it(
        colab, tmp_path, capsys, driver, torch, build, says):
    colab.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', driver)}:{os.environ['PATH']}")
    platform_torch = fake_platform_torch(tmp_path / "site-packages", *torch)
    calls: list = []
    (tmp_path / "nb").mkdir()
    colab.setattr(sys, "path", [str(platform_torch)] + sys.path)
    _first_cell(calls, colab, tmp_path / "nb")
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("torch: ") and says in printed[0], printed
    _clone, *pips = calls
    if build is None:  # kept: one install, with the lock minus the torch family (pip keeps the platform's)
        assert printed[0].startswith(f"torch: keeping the platform's torch {torch[0]} (labkit needs >= 2.6)")
        (pip,) = pips
        constraints = (tmp_path / "nb" / pip[pip.index("-c") + 1]).read_text()
        assert not any(line.startswith(("torch==", "torchvision==")) for line in constraints.splitlines())
        assert "transformers==" in constraints and pip[-2:] == ["-e", hosted.CLONE_DIR]
    else:  # the locked torch from this driver's index, then labkit with the lock
        torch_pip, labkit_pip = pips
        assert torch_pip[torch_pip.index("--index-url") + 1] == f"https://download.pytorch.org/whl/{build}"
        assert torch_pip[-2:] == PINS and "--extra-index-url" in torch_pip
        assert labkit_pip[-4:] == ["-c", f"{hosted.CLONE_DIR}/requirements/lock.txt", "-e", hosted.CLONE_DIR]


def test_the_repository_is_one_setting_in_site_yml():
    import yaml

    site = yaml.safe_load((ROOT / "site" / "site.yml").read_text())
    assert hosted.repository() == site["repository"] and hosted.repository().startswith("https://github.com/")
    assert f'"{hosted.repository()}"' in hosted.first_cell("01_memory")
    named = [p.relative_to(ROOT) for p in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("labkit/**/*.py")]
             if "github.com/labkit-course" in p.read_text()]
    assert named == [Path("labkit/runtime/hosted.py")], named  # the docs name the setting, not the URL (hosted: placeholder)


def test_a_repository_that_is_not_on_github_is_refused(tmp_path):
    bad = tmp_path / "site.yml"
    bad.write_text("repository: https://gitlab.com/x/y\n")
    with pytest.raises(ConfigError, match="is not https://github.com/OWNER/NAME; set it there"):
        hosted.repository(bad)
    assert hosted.is_placeholder(hosted.PLACEHOLDER_REPOSITORY + "/")


def test_every_notebook_starts_with_the_hosted_cell():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        gpus = 2 if path.stem in TWO_GPU_LABS else 1
        assert nb.cells[params + 1].source == hosted.first_cell(path.stem, gpus), path.stem


def test_a_two_gpu_lab_on_colab_stops_in_one_line_naming_kaggle():
    with pytest.raises(NeedsMoreGPUs) as info:
        hosted.require_gpus("t4x1", 2, "03_ddp")
    text = str(info.value)
    assert "\n" not in text and "03_ddp needs 2 GPUs" in text and "Kaggle's T4 x2" in text and '"t4x2"' in text
    assert info.value._render_traceback_() == [f"NeedsMoreGPUs: {text}"]
    assert isinstance(info.value, HardwareError)
    assert hosted.require_gpus("t4x2", 2, "03_ddp").nproc == 2
    assert hosted.require_gpus("t4x1", 1, "02_single_gpu").name == "t4x1"
    for name in ("smoke", "h100x1", "a100x1"):  # only free-GPU profiles stop; the course's run every lab
        assert hosted.require_gpus(name, 2, "03_ddp").name == name


def test_t4_profiles_are_fp16_t4s_with_the_same_sizes():
    one, two = get_profile("t4x1"), get_profile("t4x2")
    assert (one.nproc, two.nproc) == (1, 2) and one.dtype == two.dtype == "float16"
    assert one.gpu_name == "Tesla T4" and one.gpu_memory_gb == 16.0 and one.backend == "nccl"
    assert (one.image_batch, one.llm_batch, one.seq_len) == (two.image_batch, two.llm_batch, two.seq_len)


def test_lab_06_caps_a_t4_at_its_own_16_gb_not_the_24_gb_scenario():
    from labkit.memory.report import GPU_CAPACITIES
    from labkit.train import memcap

    assert memcap.scenario_cap_gb(get_profile("t4x1"), "tinyllama-1.1b") == 16.0
    for course in ("a100x4", "v100x4", "h100x1"):  # the course's GPUs are bigger: the 24 GB card, as before
        cap = memcap.scenario_cap_gb(get_profile(course), "tinyllama-1.1b")
        assert cap == pytest.approx(GPU_CAPACITIES["RTX 4090 24GB"] / 1e9)


def test_make_site_says_in_one_line_while_the_repository_is_the_placeholder():
    from labkit.cli.site import repository_lines

    lines = repository_lines(hosted.PLACEHOLDER_REPOSITORY).splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"note: {hosted.PLACEHOLDER_REPOSITORY} is still the placeholder")
    assert repository_lines("https://github.com/someone/labs").splitlines() == [
        "Open in Colab / Kaggle links point to https://github.com/someone/labs (site/site.yml, or --repo)"]


def test_rewriting_the_first_cells_changes_that_cell_only(tmp_path):
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        shutil.copy2(path, tmp_path / path.name)
    assert hosted.rewrite_first_cells(tmp_path) == []  # the course's notebooks are current
    path = tmp_path / "03_ddp.ipynb"
    nb = nbformat.read(path, as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    before = [(c.id, c.source) for c in nb.cells]
    nb.cells[params + 1].source = nb.cells[params + 1].source.replace(hosted.repository(), "https://github.com/old/x")
    nbformat.write(nb, path)
    assert hosted.rewrite_first_cells(tmp_path) == [path]
    assert path.read_bytes() == (ROOT / "notebooks" / "03_ddp.ipynb").read_bytes()  # byte for byte, 2 GPUs kept
    assert [(c.id, c.source) for c in nbformat.read(path, as_version=4).cells] == before
