"""Which CUDA build of torch a GPU node's NVIDIA driver can run (`make lab`, `labkit env`).

A torch wheel carries its own CUDA runtime; the only thing it takes from the node is the driver. A
driver older than the wheel's CUDA leaves torch without GPUs (`torch.cuda.is_available()` is False:
"The NVIDIA driver on your system is too old"), and a lab then says "use smoke" on a node full of
A100s. So `make lab` asks this module for the wheel index (`python -I labkit/cudadriver.py`: the
newest torch build whose CUDA the driver supports and which has kernels for every GPU of the node),
and `labkit env` names the mismatch and the fix (`driver_gap`).

Stdlib only, and runnable as a file: the Makefile calls it before the venv has anything installed.
Unverified on hardware (no GPU here): nvidia-smi's output format is parsed as NVIDIA documents it;
tests inject driver versions and GPU lists.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
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


def main() -> int:
    """Print the torch wheel index for this node ('' without an NVIDIA driver: PyPI's default build);
    exit 1 with the reason on stderr when the driver is too old for every build."""
    rows = nvidia_smi()
    if not rows:
        print("")
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
