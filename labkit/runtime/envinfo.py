"""What this machine has, and which labkit profiles it can run (`labkit env`).

`collect()` gathers facts (versions, devices, cores, RAM) as plain JSON data; `profile_support(facts)`
is a pure function of those facts, so the GPU branches are testable on a CPU machine. Package
versions come from `importlib.metadata`: importing DeepSpeed would JIT-build ops, importing
bitsandbytes prints warnings. It also says whether the environment is the class's locked one
(labkit.lockfile) and, on a GPU node, whether the NVIDIA driver runs this torch build
(labkit.runtime.cudadriver). Introduced in notebook 00_setup.
"""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

from labkit.runtime import cudadriver, hosted
from labkit import lockfile
from labkit.errors import HardwareError
from labkit.profiles import PROFILES, Profile, get_profile

#: distribution name -> the command that installs it (everything is in pyproject.toml: `make venv`).
PACKAGES = {
    "torch": "make venv  (or: pip install torch)",
    "torchvision": "make venv  (or: pip install torchvision)",
    "deepspeed": "pip install deepspeed",
    "bitsandbytes": "pip install bitsandbytes",
    "transformers": "pip install transformers",
    "peft": "pip install peft",
    "accelerate": "pip install accelerate",
    "papermill": "pip install papermill",
    "jupyterlab": "pip install jupyterlab",
}
#: A device must report at least this share of a profile's nominal GB ("80GB" cards show ~79-85 GB).
MEMORY_TOLERANCE = 0.9
#: bf16 tensor cores arrive with compute capability 8.0 (Ampere); V100 is 7.0.
BF16_CAPABILITY = (8, 0)


def package_versions() -> dict[str, str | None]:
    """Installed version of each course package, None when it is missing (nothing is imported)."""
    out: dict[str, str | None] = {}
    for dist in PACKAGES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def torch_facts() -> dict[str, Any]:
    """torch build, distributed backends and CUDA devices; {'installed': False} without torch."""
    try:
        import torch
        import torch.distributed as dist

        from labkit.runtime import device as devices
    except ImportError:
        return {"installed": False}
    facts: dict[str, Any] = {
        "installed": True, "version": torch.__version__, "cuda_build": torch.version.cuda,
        "cuda_available": devices.cuda_present(), "distributed": dist.is_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl_backend": dist.is_available() and dist.is_nccl_available(), "nccl": None, "devices": [],
    }
    if torch.version.cuda:
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a CUDA build without its NCCL library
            facts["nccl"] = None
    if facts["cuda_available"]:
        facts["devices"] = [{**d, "bf16": tuple(d["capability"]) >= BF16_CAPABILITY} for d in devices.gpus()]
        facts["arch_list"] = torch.cuda.get_arch_list()  # e.g. ['sm_75', 'sm_80', ...]: kernels in this build
    return facts


def host_facts() -> dict[str, Any]:
    import psutil

    return {"platform": platform.platform(), "system": platform.system(), "cpu_cores": os.cpu_count() or 1,
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1)}


def driver_facts() -> dict[str, Any]:
    """The NVIDIA driver's version (None without one) and, from nvidia-smi, its GPUs: what explains a
    node whose torch sees no GPU. Cheap without a driver (no file, no nvidia-smi on the PATH)."""
    version = cudadriver.driver_version()
    gpus = [{"name": r["name"], "capability": list(r["capability"]) if r["capability"] else None}
            for r in (cudadriver.nvidia_smi() if version else [])]
    return {"version": version, "gpus": gpus}


def collect() -> dict[str, Any]:
    """Everything `labkit env` reports, as JSON-ready data."""
    facts: dict[str, Any] = {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": package_versions(), "torch": torch_facts(), "host": host_facts(),
        "driver": driver_facts(), "lock": lockfile.status(), "platform": hosted.platform_name(),
    }
    facts["profiles"] = profile_support(facts)
    facts["fixes"] = fixes(facts)
    return facts


def profile_support(facts: dict[str, Any], profiles=PROFILES) -> dict[str, dict[str, Any]]:
    """For each profile: {'ok': bool, 'missing': [reason -> fix, ...]} from `collect()`-style facts.
    In a rehearsal (`labkit.runtime.rehearsal`) GPU profiles are supported by assumption, and say so."""
    from labkit.runtime import rehearsal

    torch, driver = facts.get("torch", {}), facts.get("driver")
    support = {name: _check_profile(make(), torch, driver) for name, make in profiles.items()}
    if rehearsal.active():
        for name, make in profiles.items():
            if make().device == "cuda":
                support[name] = {"ok": True, "missing": [], "rehearsal": True}
    return support


def driver_gap(torch: dict[str, Any], driver: dict[str, Any] | None) -> str | None:
    """'driver too old for this torch build: ... -> fix' when the NVIDIA driver is older than the CUDA
    the installed torch is built for (labkit.runtime.cudadriver); None when it is not, or nothing is known."""
    if not (torch.get("installed") and driver and driver.get("version")):
        return None
    caps = [tuple(g["capability"]) for g in driver.get("gpus") or [] if g.get("capability")]
    caps += [tuple(d["capability"]) for d in torch.get("devices") or []]
    return cudadriver.driver_gap(torch.get("version", "?"), torch.get("cuda_build"), driver["version"], caps)


def _check_profile(profile: Profile, torch: dict[str, Any], driver: dict[str, Any] | None = None) -> dict[str, Any]:
    missing: list[str] = []
    if not torch.get("installed"):
        missing.append("torch is not installed -> make venv")
    elif profile.device == "cpu":
        if not torch.get("gloo"):
            missing.append("torch.distributed has no gloo backend -> reinstall torch: make venv")
    else:
        missing += _gpu_gaps(profile, torch, driver)
    return {"ok": not missing, "missing": missing}


def _gpu_gaps(profile: Profile, torch: dict[str, Any], driver: dict[str, Any] | None = None) -> list[str]:
    devices = torch.get("devices") or []
    if not devices:
        return [driver_gap(torch, driver) or "no CUDA device found -> use --profile smoke"]
    gaps = []
    if profile.backend == "nccl" and not torch.get("nccl_backend"):
        gaps.append("torch has no NCCL backend -> install a CUDA build of torch (environment.yml)")
    big = [d for d in devices if d["memory_gb"] >= MEMORY_TOLERANCE * profile.gpu_memory_gb]
    if len(big) < profile.nproc:
        gaps.append(f"needs {profile.nproc} GPU(s) with >= {profile.gpu_memory_gb:g} GB, found {len(big)} "
                    f"-> use a profile with fewer or smaller GPUs, or reserve a bigger node")
    chosen = (big or devices)[:profile.nproc]
    missing_arch = [d for d in chosen if not has_kernels(torch.get("arch_list"), d["capability"])]
    if missing_arch:
        cap = missing_arch[0]["capability"]
        gaps.append(f"torch {torch.get('version')} has no kernels for {missing_arch[0]['name']} (sm_{cap[0]}{cap[1]}) "
                    "-> pip install torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu126")
    if profile.dtype == "bfloat16" and not all(d["bf16"] for d in chosen):
        gaps.append("needs bfloat16 (compute capability >= 8.0) -> use --profile v100x4 (fp16)")
    return gaps


def require(profile: str | Profile, facts: dict[str, Any] | None = None) -> Profile:
    """The profile, if this machine can run it; else HardwareError naming what is missing and the
    fix in one line (the CLI prints it and exits 2; a notebook shows it without a traceback)."""
    profile = get_profile(profile)
    if profile.device == "cpu":  # smoke profiles run wherever torch does; no device query needed
        return profile
    from labkit.runtime import rehearsal
    if rehearsal.active():  # this machine stands in for the node (labkit.runtime.rehearsal): its GPUs are assumed
        return profile
    torch = (facts or {}).get("torch") or torch_facts()
    driver = facts.get("driver") if facts is not None else driver_facts()
    missing = _check_profile(profile, torch, driver)["missing"]
    if missing:
        reasons = "; ".join(m.split(" -> ")[0] for m in missing)
        other = [m.split(" -> ")[1] for m in missing if " -> " in m and "--profile smoke" not in m]
        need = f"{profile.nproc} x {profile.gpu_name} ({profile.gpu_memory_gb:g} GB each, {profile.dtype})"
        raise HardwareError(f"profile {profile.name!r} needs {need}; this machine: {reasons}. "
                            "Use --profile smoke (PROFILE = \"smoke\" in a notebook)"
                            + "".join(f", or {fix}" for fix in other))
    return profile


def has_kernels(arch_list: list[str] | None, capability: list[int]) -> bool:
    """Whether a torch build with `arch_list` runs on a GPU of `capability`: a cubin of the same major
    and no higher minor (sm_80 runs on 8.6), or PTX (compute_XY) it can JIT. Unknown list: assume yes.
    CUDA 13 builds start at sm_75, so a V100 (7.0) needs the cu126 build (docs/gpu-node.md)."""
    if not arch_list:
        return True
    cap = capability[0] * 10 + capability[1]
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        if not number.isdigit():
            continue
        if kind == "sm" and int(number) // 10 == capability[0] and int(number) <= cap:
            return True
        if kind == "compute" and int(number) <= cap:
            return True
    return False


def build_name(torch: dict[str, Any]) -> str:
    """'CPU build' or 'CUDA build 13.0': which torch wheel is installed (`make venv` picks it, labkit.runtime.cudadriver)."""
    return f"CUDA build {torch['cuda_build']}" if torch.get("cuda_build") else "CPU build"


#: A CUDA build on a machine without an NVIDIA driver: what `make venv` installs where PyTorch's CPU index is unreachable.
UNUSED_CUDA = ("a CUDA build of torch without an NVIDIA driver: its CUDA libraries (gigabytes) are never used -> the "
               "CPU build: rm -rf .venv && make venv (where https://download.pytorch.org/whl/cpu answers)")


def fixes(facts: dict[str, Any]) -> list[str]:
    """One line per missing thing: what is missing -> the command that fixes it."""
    out = [f"{dist} is not installed -> {cmd}" for dist, cmd in PACKAGES.items()
           if facts.get("packages", {}).get(dist) is None]
    torch = facts.get("torch", {})
    gap = driver_gap(torch, facts.get("driver"))
    if gap:  # with GPUs seen: the build runs through CUDA minor-version compatibility only
        out.append(gap)
    elif torch.get("installed") and not torch.get("devices"):
        out.append("no GPU: only the smoke profile runs here -> use --profile smoke")
        if torch.get("cuda_build") and not (facts.get("driver") or {}).get("version") and facts.get("host", {}).get(
                "system", "Linux") == "Linux":
            out.append(UNUSED_CUDA)
    lock = facts.get("lock") or {}
    if lock.get("matches") is False:
        out.append(f"this environment differs from {lockfile.LOCK_PATH} (see `lock` above) -> reinstall with the "
                   f"lock: make venv, or pip install -c {lockfile.LOCK_PATH} -e . in the repository")
    return out


def runnable(facts: dict[str, Any]) -> list[str]:
    """Names of the profiles this machine can run."""
    return [name for name, info in facts["profiles"].items() if info["ok"]]


def lock_report(lock: dict[str, Any]) -> list[str]:
    """`labkit env`'s lines on the class's lock: matches, or what differs (one line each)."""
    if not lock:
        return []
    if lock.get("matches"):
        return [f"lock         matches {lock['path']}"]
    if lock.get("path") is None:
        return [f"lock         none: {lock['differences'][0]}"]
    diffs = lock["differences"]
    return [f"lock         DIFFERS from {lock['path']} ({len(diffs)}):"] + [f"  {line}" for line in diffs]


def format_report(facts: dict[str, Any]) -> str:
    """The human-readable `labkit env` text."""
    torch, host, pkgs = facts["torch"], facts["host"], facts["packages"]
    lines = [f"python       {facts['python']['version']}  ({facts['python']['executable']})"]
    for dist, version in pkgs.items():
        lines.append(f"{dist:<12} {version or 'MISSING'}")
    if torch.get("installed"):
        lines.append(f"torch build  {build_name(torch)}; NCCL {torch['nccl'] or '-'}; gloo {'yes' if torch['gloo'] else 'no'}")
    if facts.get("platform"):  # Colab / Kaggle / none (labkit.runtime.hosted), with the profile to run there
        profile = next((p for name, _var, p in hosted.PLATFORMS.values() if name == facts["platform"]), None)
        lines.append(f"platform     {facts['platform']}" + (f": use --profile {profile}" if profile else ""))
    lines.append(f"cpu          {host['cpu_cores']} cores, {host['ram_gb']:g} GB RAM ({host['platform']})")
    if torch.get("devices"):
        for d in torch["devices"]:
            lines.append(f"gpu {d['index']:<8} {d['name']}, {d['memory_gb']:g} GB, capability "
                         f"{d['capability'][0]}.{d['capability'][1]}, bf16 {'yes' if d['bf16'] else 'no'}")
    else:
        lines.append("gpu          no GPU: only the smoke profile runs here")
    driver = facts.get("driver") or {}
    if driver.get("version"):
        cuda = cudadriver.cuda_name(cudadriver.driver_cuda(driver["version"]))
        gpus = ", ".join(g["name"] for g in driver.get("gpus") or [])
        lines.append(f"driver       NVIDIA {driver['version']} (CUDA up to {cuda})" + (f": {gpus}" if gpus else ""))
    lines += lock_report(facts.get("lock") or {})
    lines.append("profiles")
    for name, info in facts["profiles"].items():
        lines.append(f"  {name:<10} {'yes' if info['ok'] else 'no: ' + '; '.join(info['missing'])}")
    if facts["fixes"]:
        lines.append("to fix")
        lines += [f"  {line}" for line in facts["fixes"]]
    return "\n".join(lines)
