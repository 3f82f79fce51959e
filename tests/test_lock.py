"""The class's lock (labkit.lockfile) and the driver -> torch build choice (labkit.runtime.cudadriver), with
injected pip freeze output, environments and NVIDIA driver versions (no GPU here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.runtime import cudadriver, envinfo
from labkit import lockfile
from labkit.errors import HardwareError

ROOT = Path(__file__).resolve().parent.parent
A100, H100, V100 = (8, 0), (9, 0), (7, 0)

FREEZE = """\
accelerate==1.15.0
# Editable Git install with no remote (labkit==0.1.0)
-e /work/main
Jinja2==3.1.6
nvidia-cublas==13.1.1.3
cuda-toolkit==13.0.3.0
triton==3.8.0
torch==2.14.1+cu126
PyYAML==6.0.4
somepkg @ file:///tmp/somepkg-1.0-py3-none-any.whl
pip==26.1
"""


def test_lock_lines_keep_pypi_pins_only_normalized_and_sorted():
    # labkit (editable), local files, installers and torch's CUDA runtime are not pins of the lock;
    # the +cu126 label goes: any CUDA build of the locked torch satisfies it.
    assert lockfile.lock_lines(FREEZE) == ["accelerate==1.15.0", "jinja2==3.1.6", "pyyaml==6.0.4", "torch==2.14.1"]
    # `make lock` keeps labkit's dependency tree: a tool installed into the venv by hand stays out
    assert lockfile.lock_lines(FREEZE, {"torch", "jinja2"}) == ["jinja2==3.1.6", "torch==2.14.1"]


def test_render_is_deterministic_and_parses_back():
    text = lockfile.render(FREEZE, python="3.11", machine="Linux x86_64")
    assert text == lockfile.render(FREEZE, python="3.11", machine="Linux x86_64")  # `make lock` is rerunnable
    assert "make lock" in text and "pip freeze" in text and "-c requirements/lock.txt" in text
    lock = lockfile.parse(text)
    assert lock.python == "3.11"
    assert lock.pins == {"accelerate": "1.15.0", "jinja2": "3.1.6", "pyyaml": "6.0.4", "torch": "2.14.1"}


LOCK = lockfile.Lock("3.11", {"torch": "2.14.1", "transformers": "5.24.0", "tokenizers": "0.23.3",
                              "pytest": "9.2.0"})
BASE = {"torch", "transformers"}


def test_compare_matches_the_locked_environment_and_ignores_what_labkit_does_not_use():
    have = {"torch": "2.14.1+cu126", "transformers": "5.24.0", "tokenizers": "0.23.3", "labkit": "0.1.0",
            "nvidia-cublas-cu12": "12.6.4.1", "conda": "25.1.0"}  # a GPU node's conda env, no test tools
    reach = {"torch", "transformers", "tokenizers", "labkit", "nvidia-cublas-cu12"}
    assert lockfile.compare(LOCK, have, BASE, reach, "3.11") == []


def test_compare_names_every_difference():
    have = {"torch": "2.14.1", "transformers": "5.25.0", "tokenizers": "0.23.3", "pytest-xdist": "3.9.0"}
    reach = {"torch", "transformers", "tokenizers", "pytest-xdist"}
    diffs = lockfile.compare(LOCK, have, BASE | {"accelerate"}, reach, "3.12")
    assert diffs == ["python 3.12 runs here, the lock was made with 3.11",
                     "pytest-xdist 3.9.0 installed, not in the lock (run `make lock`)",
                     "transformers 5.25.0 installed, the lock has 5.24.0",
                     "accelerate is not installed"]


def test_labkit_reaches_its_dependencies_through_the_extras_they_ask_for():
    base, reach = lockfile.needed(lockfile.distributions())
    assert {"torch", "transformers", "deepspeed"} <= base and "pytest" not in base
    assert {"huggingface-hub", "tokenizers", "numpy", "pytest"} <= reach  # transitive; labkit's test extra
    assert "fqdn" in reach  # jupyter-events -> jsonschema[format-nongpl] -> fqdn; an extra another package asks for
    assert "pip" not in reach


def test_labkit_env_finds_this_checkouts_lock_and_it_matches():
    status = lockfile.status()
    assert status == {"path": str(ROOT / lockfile.LOCK_PATH), "matches": True, "differences": []}, \
        "the venv differs from the lock: `make venv` installs the lock; after a pyproject change, `make lock`"


def test_a_vendored_folder_on_sys_path_is_not_an_installed_package():
    """setuptools puts setuptools/_vendor on sys.path once imported (its own tomli, zipp, importlib-metadata):
    seen in CI, a test that imported setuptools made every later lock check in that process fail."""
    code = ("import sys, setuptools\n"
            "from labkit import lockfile\n"
            "assert any(p.endswith('_vendor') for p in sys.path), sys.path\n"
            "print(sorted(set(lockfile.distributions()) & {'tomli', 'zipp', 'importlib-metadata'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr + run.stdout


def test_labkit_env_reports_the_lock():
    base = {"torch": {"installed": False}, "host": {"cpu_cores": 2, "ram_gb": 24, "platform": "x"},
            "python": {"version": "3.11.7", "executable": "py"}, "packages": {}, "profiles": {}}
    same = envinfo.format_report({**base, "fixes": [], "lock": {"path": "/r/lock.txt", "matches": True,
                                                                 "differences": []}})
    assert "lock         matches /r/lock.txt" in same
    differs = {"path": "/r/lock.txt", "matches": False, "differences": ["peft 0.22.0 installed, the lock has 0.21.2"]}
    facts = {**base, "lock": differs}
    facts["fixes"] = envinfo.fixes(facts)
    text = envinfo.format_report(facts)
    assert "lock         DIFFERS from /r/lock.txt (1):\n  peft 0.22.0 installed, the lock has 0.21.2" in text
    assert any("differs from requirements/lock.txt" in f and "pip install -c requirements/lock.txt" in f
               for f in facts["fixes"])



def test_labkit_env_without_a_lock_says_so(tmp_path):
    status = lockfile.status(tmp_path / "lock.txt")  # labkit installed without its repository
    assert status["matches"] is None and "no requirements/lock.txt beside labkit" in status["differences"][0]
    assert envinfo.lock_report(status) == [f"lock         none: {status['differences'][0]}"]
    assert not any("differs" in f for f in envinfo.fixes({"lock": status}))


# -- the NVIDIA driver -> the torch build ---------------------------------------------------------

@pytest.mark.parametrize("driver, caps, tag", [
    ("595.58.03", [A100] * 4, "cu132"),   # newest driver: the newest build
    ("590.48.01", [H100], "cu130"),       # CUDA 13.1 driver: 13.2 is too new, 13.0 fits
    ("580.65.06", [A100], "cu130"),       # exactly CUDA 13.0's driver
    ("575.57.08", [A100] * 4, "cu126"),   # CUDA 12.9: no CUDA 13 build runs
    ("560.28.03", [H100], "cu126"),
    ("595.58.03", [V100] * 4, "cu126"),   # Volta: only the 12.6 build has sm_70 kernels (the Makefile's V100 note)
    ("570.124.06", [], "cu126"),          # GPUs unknown: the driver alone decides
])
def test_the_driver_picks_the_newest_build_it_supports(driver, caps, tag):
    build = cudadriver.pick_build(driver, caps)
    assert build.tag == tag and build.index == f"https://download.pytorch.org/whl/{tag}"


@pytest.mark.parametrize("driver, caps", [("550.54.15", [A100]), ("560.28.02", [V100]), ("470.82.01", [A100])])
def test_a_driver_older_than_every_build_is_said_so_with_the_fix(driver, caps):
    assert cudadriver.pick_build(driver, caps) is None
    text = cudadriver.too_old_message(driver, caps)
    assert f"NVIDIA driver {driver} is too old" in text and "driver >= 560.28.03" in text
    assert "'CUDA Version: 12.6' or newer" in text and "TORCH_INDEX=https://download.pytorch.org/whl/cu126" in text
    # 12.x drivers from 525.60.13 run the 12.6 build through minor-version compatibility; older ones not at all
    assert ("minor-version compatibility" in text) == (cudadriver.version(driver) >= (525, 60, 13))


def test_driver_cuda_follows_nvidias_table():
    assert cudadriver.driver_cuda("550.54.15") == (12, 4)
    assert cudadriver.driver_cuda("580.95.05") == (13, 0)
    assert cudadriver.driver_cuda("595.45.04") == (13, 2)
    assert cudadriver.driver_cuda("470.82.01") is None


def test_the_proc_file_gives_the_driver_version(tmp_path):
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert cudadriver.driver_version(proc) == "550.54.15"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\n")
    assert cudadriver.driver_version(proc) == "580.95.05"


def fake_nvidia_smi(tmp_path: Path, rows: str) -> dict:
    """An environment whose PATH has an nvidia-smi printing `rows` for the GPU query."""
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ncase \"$1\" in --query-gpu=driver_version,name,compute_cap) printf '{rows}\\n';;"
                   " *) exit 9;; esac\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}


def run_make_helper(env: dict) -> subprocess.CompletedProcess:
    # Exactly what the Makefile runs before the venv exists: the file, isolated from site-packages.
    return subprocess.run([sys.executable, "-I", str(ROOT / "labkit" / "runtime" / "cudadriver.py")], env=env,
                          capture_output=True, text=True, timeout=60)


def test_make_lab_takes_the_index_from_nvidia_smi(tmp_path):
    v100s = "560.35.05, Tesla V100-SXM2-32GB, 7.0\\n" * 4
    out = run_make_helper(fake_nvidia_smi(tmp_path, v100s))
    assert out.returncode == 0 and out.stdout.strip() == "https://download.pytorch.org/whl/cu126", out.stderr
    out = run_make_helper(fake_nvidia_smi(tmp_path, "580.95.05, NVIDIA A100-SXM4-80GB, 8.0"))
    assert out.stdout.strip() == "https://download.pytorch.org/whl/cu130"
    old = run_make_helper(fake_nvidia_smi(tmp_path, "535.104.05, NVIDIA A100-SXM4-80GB, 8.0"))
    assert old.returncode == 1 and old.stdout == "" and "error: NVIDIA driver 535.104.05 is too old" in old.stderr


def no_driver(tmp_path: Path) -> dict:
    """PATH with an nvidia-smi that cannot reach a driver (as where the utility is installed but no driver loads)."""
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'"
                   " >&2; exit 9\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture
def local_index(tmp_path):
    """A wheel index on 127.0.0.1 with a torch page (PyTorch's CPU index, as this machine cannot reach it)."""
    import functools
    import http.server
    import threading

    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a href='torch-2.14.1+cpu-cp311.whl'>torch</a>\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


def make_torch_index(env: dict, cpu_index: str) -> subprocess.CompletedProcess:
    """What `make venv` installs torch from ('' = PyPI), through the Makefile's own line (`make torch-index`)."""
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "torch-index",
                           f"PYTHON={sys.executable}", f"CPU_INDEX={cpu_index}"],
                          env=env, capture_output=True, text=True, timeout=60)


def test_make_lab_without_a_driver_installs_the_cpu_build_from_the_cpu_index(tmp_path, local_index):
    out = make_torch_index(no_driver(tmp_path), local_index)
    assert out.returncode == 0 and out.stdout.strip() == local_index, out.stderr
    assert out.stderr.strip() == f"torch: the locked torch's CPU build from {local_index} (no NVIDIA driver here)"


def test_make_lab_falls_back_to_pypi_in_one_line_when_the_cpu_index_is_unreachable(tmp_path, local_index):
    dead = local_index + "nowhere/"  # answers 404: an index without torch
    for index in (dead, "http://127.0.0.1:9/whl/cpu"):  # port 9: refused
        out = make_torch_index(no_driver(tmp_path), index)
        assert out.returncode == 0 and out.stdout.strip() == "", out.stderr  # '' = PyPI's build
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"torch: PyTorch's CPU wheel index {index} cannot be reached (")
        assert "installing PyPI's build instead, a CUDA build" in line


def test_a_mac_takes_pypis_build_which_is_the_cpu_one():
    assert cudadriver.no_driver_index("http://127.0.0.1:9/", system="Darwin") == \
        ("", "torch: PyPI's macOS build (CPU; no CUDA on a Mac)")


def node(cuda_build: str, driver: str) -> dict:
    """Facts of a 4x A100 node whose torch sees no GPU (its driver cannot run the build)."""
    return {"torch": {"installed": True, "version": "2.14.1", "cuda_build": cuda_build, "gloo": True,
                      "nccl_backend": True, "devices": []},
            "driver": {"version": driver, "gpus": [{"name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0]}] * 4},
            "packages": {}}


def test_labkit_env_says_driver_too_old_instead_of_use_smoke():
    facts = node("13.0", "550.54.15")
    missing = envinfo.profile_support(facts)["a100x4"]["missing"]
    assert len(missing) == 1 and missing[0].startswith(
        "driver too old for this torch build: torch 2.14.1 is built for CUDA 13.0 (needs NVIDIA driver >= 580.65.06), "
        "this node's driver 550.54.15 supports CUDA up to 12.4 -> ")
    fixes = envinfo.fixes(facts)
    assert any(f.startswith("driver too old") for f in fixes)
    assert not any("only the smoke profile" in f for f in fixes)
    with pytest.raises(HardwareError, match=r"driver too old for this torch build.*driver >= 560\.28\.03"):
        envinfo.require("a100x4", facts)


def test_a_driver_that_runs_another_build_names_it():
    missing = envinfo.profile_support(node("13.2", "580.95.05"))["a100x4"]["missing"][0]
    assert "built for CUDA 13.2" in missing
    assert "make lab TORCH_INDEX=https://download.pytorch.org/whl/cu130" in missing
    assert "pip install torch==2.14.1 torchvision --index-url https://download.pytorch.org/whl/cu130" in missing


def test_a_fitting_driver_or_none_changes_nothing():
    assert envinfo.profile_support(node("13.0", "580.95.05"))["a100x4"]["missing"] == \
        ["no CUDA device found -> use --profile smoke"]
    cpu = {"torch": {"installed": True, "cuda_build": "13.0", "devices": []}, "driver": {"version": None}}
    assert envinfo.driver_gap(cpu["torch"], cpu["driver"]) is None


def test_make_lab_on_macos_skips_deepspeeds_ops_and_native_windows_stops_in_one_line(tmp_path):
    """The Makefile's own recipes with `uname -s` as a Mac and as Git Bash report it (neither OS is tried here)."""
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    (venv_bin / ".installed").touch()  # a venv already built: `lab` goes straight to its own lines
    (venv_bin / "jupyter").write_text('#!/bin/sh\necho "jupyter $1"\n')
    (venv_bin / "jupyter").chmod(0o755)

    def make(*args):
        return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True,
                              text=True, timeout=60)

    mac = make("lab", "UNAME_S=Darwin", f"BIN={venv_bin}")  # ds-ops would need $(BIN)/python: it is not run
    assert mac.returncode == 0, mac.stderr
    note, started = mac.stdout.strip().splitlines()
    assert note.startswith("macOS (untested): the labs run on the CPU in PROFILE = \"smoke\"; not here: DeepSpeed's")
    assert started == "jupyter lab"
    windows = make("venv", "UNAME_S=MINGW64_NT-10.0", f"BIN={tmp_path / 'none'}")
    assert windows.returncode != 0 and windows.stdout.strip().splitlines() == [
        "error: native Windows (MINGW64_NT-10.0) cannot run the labs (torchrun's gloo ranks, DeepSpeed, bubblewrap): "
        "install WSL2 and run make lab inside it (docs/self-study.md)"]
    assert not (tmp_path / "none").exists()  # nothing was built
