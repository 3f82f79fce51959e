"""Which CUDA build of torch a GPU node's NVIDIA driver can run (`make lab`, `labkit env`).

A torch wheel carries its own CUDA runtime; the only thing it takes from the node is the driver. A
driver older than the wheel's CUDA leaves torch without GPUs (`torch.cuda.is_available()` is False:
"The NVIDIA driver on your system is too old"), and a lab then says "use smoke" on a node full of
A100s. So `make lab` asks this module for the wheel index (`python -I labkit/runtime/cudadriver.py`: the
newest torch build whose CUDA the driver supports and which has kernels for every GPU of the node),
and `labkit env` names the mismatch and the fix (`driver_gap`).

Without an NVIDIA driver `make lab` gets the locked torch's CPU build from PyTorch's CPU wheel index (a few
hundred MB instead of gigabytes of CUDA libraries), or PyPI's build, in one line, when that index cannot be
reached. On Colab and Kaggle the notebooks' first cell (labkit.runtime.hosted) loads this file from its clone and asks
`hosted_install`: keep the platform's torch when it is at least labkit's declared minimum (pyproject.toml) and
the driver runs it as well as any locked build would, else install the locked torch's build for the driver
(`choose_torch`; one printed line says which, and what will not work under minor-version compatibility).

Stdlib only, and runnable as a file: the Makefile calls it before the venv has anything installed.
Unverified on hardware (no GPU here): nvidia-smi's output format is parsed as NVIDIA documents it;
tests inject driver versions and GPU lists (a fake nvidia-smi).
"""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

#: NVIDIA's CUDA Toolkit release notes, Table 3 "CUDA Toolkit and Corresponding Driver Versions",
#: Linux x86_64, the GA row of each CUDA minor: the driver a toolkit release ships with, i.e. the
#: newest CUDA a driver fully supports (nvidia-smi's "CUDA Version"). Older drivers of the same major
#: run a build only through minor-version compatibility, without PTX JIT (Triton / torch.compile
#: kernels then fail), so labkit asks for the full support.
CUDA_DRIVERS: dict[tuple[int, int], str] = {
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26",
    (12, 9): "575.51.03", (13, 0): "580.65.06", (13, 1): "590.44.01", (13, 2): "595.45.04",
}
#: The same notes' minor-version compatibility floor of each CUDA major: a driver between it and a
#: build's full support runs the build's cubins but cannot JIT its PTX.
MINOR_COMPAT_DRIVERS = {12: "525.60.13", 13: "580.65.06"}
INDEX_URL = "https://download.pytorch.org/whl/{tag}"
#: The CPU builds (torch 2.14.1+cpu: ~200 MB of wheel, no nvidia-* packages); `make lab CPU_INDEX=...` overrides.
CPU_INDEX = INDEX_URL.format(tag="cpu")
PYPI = "https://pypi.org/simple"


@dataclass(frozen=True)
class TorchBuild:
    """One CUDA build of the locked torch on PyTorch's wheel index."""
    tag: str                      # the index's name: cu126, cu130, ...
    cuda: tuple[int, int]
    min_capability: tuple[int, int]  # the oldest GPU it has kernels for

    @property
    def index(self) -> str:
        return INDEX_URL.format(tag=self.tag)

    @property
    def driver(self) -> str:
        return CUDA_DRIVERS[self.cuda]


#: torch 2.14's CUDA builds, newest first (pytorch/pytorch#190355, the 2.14 CUDA support matrix):
#: CUDA 13.x builds start at Turing (7.5); the legacy 12.6 build also covers Maxwell..Volta, so a
#: V100 (7.0) node gets cu126. PyPI's torch 2.14 is the CUDA 13.0 build.
TORCH_BUILDS = (TorchBuild("cu132", (13, 2), (7, 5)), TorchBuild("cu130", (13, 0), (7, 5)),
                TorchBuild("cu126", (12, 6), (5, 0)))


def version(text: str) -> tuple[int, ...]:
    """'560.35.05' -> (560, 35, 5)."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def driver_cuda(driver: str) -> tuple[int, int] | None:
    """The newest CUDA minor a driver fully supports (None: older than CUDA 12.0's driver)."""
    ok = [cuda for cuda, need in CUDA_DRIVERS.items() if version(driver) >= version(need)]
    return max(ok) if ok else None


def cuda_name(cuda: tuple[int, int] | None) -> str:
    return f"{cuda[0]}.{cuda[1]}" if cuda else "< 12.0"


def pick_build(driver: str, capabilities: list[tuple[int, int]]) -> TorchBuild | None:
    """The newest torch build this driver supports with kernels for every GPU; None if none fits."""
    for build in TORCH_BUILDS:
        if version(driver) >= version(build.driver) and all(c >= build.min_capability for c in capabilities):
            return build
    return None


def oldest_build(capabilities: list[tuple[int, int]]) -> TorchBuild:
    """The build with the oldest driver floor that has kernels for every GPU of `capabilities`."""
    fitting = [b for b in TORCH_BUILDS if all(c >= b.min_capability for c in capabilities)]
    return min(fitting or TORCH_BUILDS, key=lambda b: version(b.driver))


def admin_fix(build: TorchBuild) -> str:
    return (f"ask the node's admins for a driver >= {build.driver} (nvidia-smi then shows "
            f"'CUDA Version: {cuda_name(build.cuda)}' or newer)")


def too_old_message(driver: str, capabilities: list[tuple[int, int]]) -> str:
    """Why no torch build fits this node, and the fix (for `make lab`, where nothing is installed yet)."""
    oldest = oldest_build(capabilities)
    anyway = f"`make lab TORCH_INDEX={oldest.index}`"
    if version(driver) >= version(MINOR_COMPAT_DRIVERS[oldest.cuda[0]]):
        anyway = (f"until then {anyway} runs through CUDA minor-version compatibility, without PTX JIT "
                  "(Triton kernels and torch.compile may fail)")
    else:
        anyway = f"{anyway} installs anyway, but torch will not see the GPUs (only --profile smoke runs)"
    return (f"NVIDIA driver {driver} is too old for every torch build labkit installs: it supports CUDA up to "
            f"{cuda_name(driver_cuda(driver))}, the oldest build that runs on these GPUs ({oldest.tag}) needs "
            f"CUDA {cuda_name(oldest.cuda)} -> {admin_fix(oldest)}; {anyway}")


def driver_gap(torch_version: str, torch_cuda: str | None, driver: str | None,
               capabilities: list[tuple[int, int]]) -> str | None:
    """`labkit env`'s line when the installed torch's CUDA is newer than the driver supports:
    'driver too old for this torch build: ... -> fix'; None when the driver is fine or unknown."""
    if not (torch_cuda and driver):
        return None
    built = tuple(version(torch_cuda)[:2])
    need = CUDA_DRIVERS.get(built)
    if need is None or version(driver) >= version(need):
        return None
    build = pick_build(driver, capabilities)
    public = torch_version.split("+")[0]
    fix = (f"reinstall torch for this driver: make lab TORCH_INDEX={build.index}  (or: pip install "
           f"torch=={public} torchvision --index-url {build.index})" if build else
           admin_fix(oldest_build(capabilities)))
    return (f"driver too old for this torch build: torch {torch_version} is built for CUDA {cuda_name(built)} "
            f"(needs NVIDIA driver >= {need}), this node's driver {driver} supports CUDA up to "
            f"{cuda_name(driver_cuda(driver))} -> {fix}")


PROC_VERSION = Path("/proc/driver/nvidia/version")


def driver_version(proc: Path = PROC_VERSION) -> str | None:
    """The loaded NVIDIA kernel driver's version (/proc, else nvidia-smi); None without one."""
    if proc.is_file():
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", proc.read_text(errors="replace"))
        if match:
            return match.group(1)
    rows = nvidia_smi()
    return rows[0]["driver"] if rows else None


def nvidia_smi() -> list[dict]:
    """One row per GPU: {'driver', 'name', 'capability': (major, minor) or None}; [] without nvidia-smi.
    `compute_cap` is a query field of drivers from ~510 on; older ones get capability None."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    for fields in ("driver_version,name,compute_cap", "driver_version,name"):
        try:
            out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return []
        if out.returncode == 0:
            return [_row(line) for line in out.stdout.splitlines() if line.strip()]
    return []


def _row(line: str) -> dict:
    parts = [p.strip() for p in line.split(",")]
    cap = version(parts[2])[:2] if len(parts) > 2 and re.match(r"\d+\.\d+", parts[2]) else None
    return {"driver": parts[0], "name": parts[1] if len(parts) > 1 else "?", "capability": cap}


# ---- which torch: the platform's, or a locked build (Colab / Kaggle's first cell, labkit.runtime.hosted) ----------------

#: The packages that come with a torch build: the platform's torch keeps its own (never the lock's pins).
TORCH_FAMILY = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-[\w-]+|cuda-[\w-]+)==", re.I)
_SUPPORT = {"none": 0, "minor": 1, "full": 2}


@dataclass(frozen=True)
class TorchChoice:
    """What the first cell does about torch, and the one line it prints to say so."""
    keep: bool
    """True: the platform's torch stays; False: install the locked torch from `index`."""
    index: str
    line: str


def cuda_support(cuda: tuple[int, int], driver: str) -> str:
    """'full' (the driver supports this CUDA), 'minor' (only through minor-version compatibility: no PTX JIT) or
    'none' (torch will not see the GPU)."""
    need = CUDA_DRIVERS.get(cuda) or min((v for k, v in CUDA_DRIVERS.items() if k >= cuda), default="9999", key=version)
    if version(driver) >= version(need):
        return "full"
    floor = MINOR_COMPAT_DRIVERS.get(cuda[0])
    return "minor" if floor and version(driver) >= version(floor) else "none"


MINOR_ONLY = ("through CUDA minor-version compatibility only: Triton kernels and torch.compile (PTX JIT) may fail, "
              "everything else runs")


def choose_torch(driver: str | None, capabilities: list[tuple[int, int]], installed: tuple[str, str | None] | None,
                 minimum: str, locked: str) -> TorchChoice:
    """Keep the platform's torch (`installed`: (version, its CUDA or None)) when it is >= `minimum` and the driver
    runs it as well as the best locked build would; else the locked torch's build for this driver (its CPU build
    without one). Pure: the fake-driver tests call it through `hosted_install`."""
    fits = installed is not None and version(installed[0]) >= version(minimum)
    why_not = ("no torch here" if installed is None else
               f"the platform's torch {installed[0]} is older than labkit's minimum {minimum}" if not fits else "")
    if driver is None:
        if fits:
            return TorchChoice(True, "", f"torch: keeping the platform's torch {installed[0]} (labkit needs >= "
                                         f"{minimum}); no NVIDIA driver: it runs on the CPU (PROFILE = \"smoke\")")
        return TorchChoice(False, CPU_INDEX, f"torch: installing torch {locked}'s CPU build ({why_not}; no NVIDIA "
                                             "driver: only PROFILE = \"smoke\" runs)")
    build = pick_build(driver, capabilities)
    level = "full" if build else None
    if build is None:
        build = oldest_build(capabilities)
        level = cuda_support(build.cuda, driver)
    have = cuda_support(tuple(version(installed[1])[:2]), driver) if fits and installed[1] else "none"
    if fits and _SUPPORT[have] >= _SUPPORT[level] and have != "none":
        how = f"runs its CUDA {installed[1]}" + ("" if have == "full" else f" {MINOR_ONLY}")
        return TorchChoice(True, "", f"torch: keeping the platform's torch {installed[0]} (labkit needs >= {minimum}); "
                                     f"NVIDIA driver {driver} {how}")
    why_not = why_not or (f"the platform's torch {installed[0]} needs a newer driver" if installed[1] else
                          f"the platform's torch {installed[0]} is a CPU build")
    if level == "none":
        return TorchChoice(False, CPU_INDEX, f"torch: installing torch {locked}'s CPU build ({why_not}): NVIDIA driver "
                                             f"{driver} is too old for every torch build -> only PROFILE = \"smoke\" "
                                             f"runs; {admin_fix(build)}")
    how = f"NVIDIA driver {driver} supports CUDA {cuda_name(build.cuda)}" if level == "full" else \
        (f"NVIDIA driver {driver} supports CUDA up to {cuda_name(driver_cuda(driver))}, so it runs {MINOR_ONLY}")
    return TorchChoice(False, build.index, f"torch: installing torch {locked}'s {build.tag} build ({why_not}): {how}")


def installed_torch() -> tuple[str, str | None] | None:
    """(version, CUDA or None) of the torch this interpreter would import, read from torch/version.py without
    importing torch (the kernel must not hold a torch that pip is about to replace); None without torch."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("torch", sys.path)  # not sys.modules: what pip replaces
    if spec is None or not spec.origin:
        return None
    text = (Path(spec.origin).parent / "version.py").read_text(errors="replace")
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)", text, re.M)
    return (found.group(1), cuda.group(1) if cuda else None) if found else None


def hosted_install(clone: str) -> list[list[str]]:
    """The pip commands that install labkit from the clone `clone` (Colab / Kaggle's first cell runs them), after
    printing the one line of `choose_torch`. Reads the lock's pins and pyproject.toml's torch floor from the clone."""
    root = Path(clone)
    lock = (root / "requirements" / "lock.txt").read_text().splitlines()
    pins = [line.strip() for line in lock if re.match(r"^torch(vision)?==", line.strip())]
    minimum = re.search(r'"torch>=([\d.]+)', (root / "pyproject.toml").read_text()).group(1)
    rows = nvidia_smi()
    choice = choose_torch(rows[0]["driver"] if rows else None, [r["capability"] for r in rows if r["capability"]],
                          installed_torch(), minimum, pins[0].split("==")[1])
    print(choice.line)
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if choice.keep:  # the lock without the torch family: pip keeps the platform's torch (pyproject's floor holds)
        constraints = root / "requirements" / "hosted-constraints.txt"
        constraints.write_text("".join(f"{line}\n" for line in lock if not TORCH_FAMILY.match(line.strip())))
        return [pip + ["-c", str(constraints), "-e", clone]]
    lock_c = ["-c", str(root / "requirements" / "lock.txt")]
    return [pip + lock_c + ["--index-url", choice.index, "--extra-index-url", PYPI] + pins, pip + lock_c + ["-e", clone]]


def index_problem(index: str, timeout_s: float = 15.0) -> str | None:
    """Why `index` cannot serve torch (None when its torch page answers): our CI machines reach PyPI only."""
    try:
        with urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=timeout_s) as reply:
            reply.read(1)
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", None) or exc)


def no_driver_index(cpu_index: str = CPU_INDEX, system: str | None = None) -> tuple[str, str]:
    """(the index for the locked torch, the one line that says which) on a machine without an NVIDIA driver."""
    system = system or platform.system()
    if system == "Darwin":  # PyPI's macOS wheel is the CPU build already (with Apple's MPS, which labkit leaves alone)
        return "", "torch: PyPI's macOS build (CPU; no CUDA on a Mac)"
    problem = index_problem(cpu_index)
    if problem is None:
        return cpu_index, f"torch: the locked torch's CPU build from {cpu_index} (no NVIDIA driver here)"
    return "", (f"torch: PyTorch's CPU wheel index {cpu_index} cannot be reached ({problem}): installing PyPI's "
                "build instead, a CUDA build with gigabytes of CUDA libraries this machine cannot use "
                "(`labkit env` says 'CUDA build'; to retry later: make venv after rm -rf .venv)")


def main(argv: list[str] | None = None) -> int:
    """Print the torch wheel index for this machine ('' for PyPI's build), and on stderr the one line saying which;
    exit 1 with the reason on stderr when the driver is too old for every build. `--cpu-index URL`: where the CPU
    build comes from when there is no NVIDIA driver."""
    argv = sys.argv[1:] if argv is None else argv
    cpu_index = argv[argv.index("--cpu-index") + 1] if "--cpu-index" in argv else CPU_INDEX
    rows = nvidia_smi()
    if not rows:
        index, line = no_driver_index(cpu_index or CPU_INDEX)
        print(line, file=sys.stderr)
        print(index)
        return 0
    caps = [r["capability"] for r in rows if r["capability"]]
    build = pick_build(rows[0]["driver"], caps)
    if build is None:
        print("error: " + too_old_message(rows[0]["driver"], caps), file=sys.stderr)
        return 1
    names = ", ".join(sorted({r["name"] for r in rows}))
    print(f"torch build {build.tag} for NVIDIA driver {rows[0]['driver']} ({names})", file=sys.stderr)
    print(build.index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
