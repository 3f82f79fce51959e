"""Free cloud notebooks (labkit.hosted): Colab / Kaggle detected from their kernels' variables, the first
cell installs labkit there (and nowhere else), and a 2-GPU lab on Colab's one T4 stops in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import envinfo, hosted
from labkit.errors import HardwareError, NeedsMoreGPUs
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


def _first_cell(calls, monkeypatch, tmp_path):
    """Execute the install part of a notebook's first cell in tmp_path, recording its commands."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "check_call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(compile(hosted.first_cell("02_single_gpu"), "first_cell", "exec"), {})


def test_the_first_cell_installs_labkit_with_the_lock_on_colab_and_kaggle_only(nowhere, tmp_path):
    calls: list = []
    _first_cell(calls, nowhere, tmp_path)  # on this machine: nothing
    assert calls == [] and str(tmp_path / hosted.CLONE_DIR) not in sys.path
    for var in PLATFORM_VARS:
        nowhere.delenv(PLATFORM_VARS[0], raising=False)
        nowhere.setenv(var, "1")
        calls.clear()
        _first_cell(calls, nowhere, tmp_path)
        clone, pip = calls
        assert clone == ["git", "clone", "--depth", "1", hosted.REPOSITORY, hosted.CLONE_DIR]
        assert pip[:3] == [sys.executable, "-m", "pip"]
        assert pip[pip.index("-c") + 1] == "labkit-course/requirements/lock.txt"
        assert pip[-2:] == ["-e", hosted.CLONE_DIR]
        assert sys.path[0] == str(tmp_path / hosted.CLONE_DIR)  # importable in the kernel that installed it
    (tmp_path / hosted.CLONE_DIR).mkdir()  # the next notebook in the same session: already there
    calls.clear()
    _first_cell(calls, nowhere, tmp_path)
    assert calls == [] and sys.path[0] == str(tmp_path / hosted.CLONE_DIR)


def test_the_repository_is_the_sites():
    site = ROOT / "site" / "site.yml"  # the site engineer's config names the same placeholder
    if site.is_file():
        assert hosted.REPOSITORY in site.read_text()
    assert hosted.REPOSITORY.startswith("https://github.com/")


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
