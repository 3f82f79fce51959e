"""The checks of `make gpu-check` (issue 38), one function each; `labkit.course.gpu_check` holds their table
(CHECKS: order, caps), runs each in its own interpreter under its cap, and writes the report.

Each function runs in a fresh interpreter (`python -m labkit.course.gpu_check --one KEY`), so it may
initialise CUDA, hang or crash: only its own check pays. `ctx.left()` is what its cap leaves (less a few
seconds to print the result), the bound every subprocess it starts gets. Written blind: unverified on
hardware until a GPU's report is committed under docs/gpu-check/ (docs/gpu-node.md).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: The profile the checks run (the course's single-GPU profile closest to an H100/H200).
PROFILE = "h100x1"
#: Published references: NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, "Training performance: DGX A100"
#: (AMP, batch 256, 1 GPU); TinyLlama (Zhang et al. 2024, sec. 2.3): 24k tokens/s per A100-40GB, i.e.
#: 6 x 1.1e9 x 24e3 / 312e12 = 51% MFU with FlashAttention-2 and fused kernels.
RESNET50_AMP_IMG_S_A100 = 2470.0
TINYLLAMA_MFU_A100 = 6 * 1.1e9 * 24e3 / 312e12
#: Wheels a stock PyTorch CUDA image (torch, torchvision, transformers, peft, accelerate) lacks, with their
#: sizes in MiB as `make gpu-check-wheels` built them for the lock's versions (Python 3.11, x86_64;
#: deepspeed's is built from its sdist without ops) on 2026-11-29: 16.5 MiB in all. Their own dependencies
#: are not in it (an NGC image has Jupyter's and matplotlib's; a bare one needs pyzmq, jupyter_client,
#: tornado, fonttools, hjson, py-cpuinfo too: `pip download` them beside these). bitsandbytes' wheel
#: (~60 MiB alone) does not fit the 60-MiB budget: its check is skipped unless the image has it.
WHEELS = {"deepspeed": 2.07, "torchao": 3.22, "papermill": 0.08, "nbclient": 0.02, "nbformat": 0.08,
          "ipykernel": 0.11, "matplotlib": 9.40, "ipywidgets": 0.13, "cloudpickle": 0.02, "psutil": 0.15,
          "ninja": 0.17, "click": 0.12, "pyyaml": 0.79, "tqdm": 0.08}
#: The slice of `labkit preflight` that fits its cap: every lab's runs resolved and sized, node health, the
#: matmul probe in a real NCCL launch, and DDP's three variants (fp32, bf16, bf16 + accum) for 2 steps.
#: The whole preflight (30 runs on h100x1, torch.compile and DeepSpeed among them) takes several minutes:
#: run it alone with `labkit preflight --profile h100x1` when the machine is yours for longer.
PREFLIGHT_ARGS = ("--steps", "2", "--strategies", "ddp")


@dataclass
class Result:
    name: str
    status: str
    """'pass', 'fail' or 'skipped'."""
    why: str = ""
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    cap_s: float = 0.0
    """The check's own cap (labkit.course.gpu_check.CHECKS)."""


class Skip(Exception):
    """A check that cannot run here: its message says why."""


#: Printed before the JSON of a check's (partial) result on the child's stdout; the parent keeps the last.
MARK = "@@gpu-check "


@dataclass
class Context:
    out: Path
    gpu: bool
    deadline: float
    profile: str = PROFILE

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def progress(self, data: dict) -> None:
        """What the check measured so far: reported even if its cap kills it before it ends."""
        print(MARK + json.dumps({"partial": data}, default=str), flush=True)


def subprocess_tail(args: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit code or None on timeout, last 4000 characters of output); the process group is killed on timeout."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        return proc.returncode, out[-4000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, (out or "")[-4000:]


#: `labkit ...` without its console script (a stock image runs labkit from the checkout, on PYTHONPATH).
_LABKIT = [sys.executable, "-c", "from labkit.cli import main; main()"]


# ------------------------------------------------------------------------------------------- checks
def check_machine(ctx: Context) -> Result:
    """Driver, CUDA, torch build and its arch list; the GPU's compute capability must be in it."""
    import torch

    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "arch_list": torch.cuda.get_arch_list() if torch.cuda.is_available() else []}
    if not ctx.gpu:
        return Result("machine", "pass", "CPU: torch and Python recorded; no GPU fields", data=data)
    if not torch.cuda.is_available():
        return Result("machine", "fail", f"nvidia-smi lists a GPU but torch {torch.__version__} (CUDA "
                      f"{torch.version.cuda}) sees none: a CPU build of torch, or a driver older than its CUDA", data=data)
    major, minor = torch.cuda.get_device_capability(0)
    code, out = subprocess_tail(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                                min(15, ctx.left()))
    data.update(device=torch.cuda.get_device_name(0), capability=f"{major}.{minor}", nvidia_smi=out.strip(),
                cudnn=torch.backends.cudnn.version())
    ok = f"sm_{major}{minor}" in data["arch_list"] or any(a.startswith(f"sm_{major}") for a in data["arch_list"])
    return Result("machine", "pass" if ok else "fail",
                  f"{data['device']}, driver/name/memory {data['nvidia_smi']}" if ok
                  else f"torch has no kernels for sm_{major}{minor}", data=data)


def check_node_health(ctx: Context) -> Result:
    from labkit.course import node_health

    readings = node_health.read()
    bad = [r["detail"] for r in readings if not r["ok"]]
    return Result("node health", "fail" if bad else "pass", "; ".join(bad), data={"readings": readings})


_BNB_PROBE = ("import json, bitsandbytes as b, bitsandbytes.cextension as c; lib = getattr(c, 'lib', None); "
              "print(json.dumps({'version': b.__version__, 'class': type(lib).__name__, "
              "'file': str(getattr(getattr(lib, '_lib', None), '_name', '')), 'backend': str(getattr(c, 'BNB_BACKEND', ''))}))")


def check_bitsandbytes(ctx: Context) -> Result:
    """The native library bitsandbytes loaded: its CUDA build (libbitsandbytes_cudaXYZ.so), not the CPU one
    nor the stand-in it uses when no library loads (ErrorHandlerMockBNBNativeLibrary)."""
    code, out = subprocess_tail([sys.executable, "-c", _BNB_PROBE], ctx.left())
    if code != 0 and "No module named 'bitsandbytes'" in out:
        raise Skip("bitsandbytes is not installed (its ~60-MiB wheel exceeds the image's wheel budget)")
    try:
        lib = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Result("bitsandbytes CUDA library", "fail", f"exit {code}: {out[-500:]}")
    ok = code == 0 and "cuda" in Path(lib["file"]).name.lower() and "Mock" not in lib["class"]
    why = f"bitsandbytes {lib['version']} loaded {Path(lib['file']).name or 'no library'} ({lib['class']})"
    return Result("bitsandbytes CUDA library", "pass" if ok else "fail", why + (f": {out[-300:]}" if code else ""), data=lib)


_FORK_PROBE = r"""
import json, os, sys
import torch
import transformers.models.llama.modeling_llama  # pulls torchao: torch.cuda.is_available() at import
init = torch.cuda.is_initialized()
pid = os.fork()
if pid == 0:
    try:
        torch.cuda.set_device(0); torch.zeros(1, device="cuda"); os._exit(0)
    except Exception as exc:
        print(exc, file=sys.stderr); os._exit(3)
_, status = os.waitpid(pid, 0)
print(json.dumps({"cuda_initialized_by_import": init, "forked_child_ok": os.WEXITSTATUS(status) == 0}))
"""


def _labkit_gpu_spawn() -> str:
    return ("from labkit.course.exercises.spawn import spawn as s, warm_ranks\n"
            "import torch\n"
            "def f(rank, world):\n    torch.cuda.set_device(rank); return torch.zeros(1, device='cuda').device.type\n"
            "if __name__ == '__main__':\n"
            "    with warm_ranks():\n"
            f"        print(s(f, world=1, profile={PROFILE!r}, imports=('transformers.models.llama.modeling_llama',)))\n")


def _probe(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _FORK_PROBE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **env})


def check_fork_after_llama(ctx: Context) -> Result:
    """G1: fork after the Llama import, set_device in the child: without and with the NVML check (both probes
    at once: each is an import of torch and transformers); then labkit's GPU spawn inside a forkserver that
    preloaded the Llama module."""
    data: dict = {}
    probes = {label: _probe({"PYTORCH_NVML_BASED_CUDA_CHECK": flag}) for label, flag in (("plain", "0"), ("nvml_check", "1"))}
    for label, proc in probes.items():  # killed with this check's process group if its cap runs out
        out, _ = proc.communicate()
        data[label] = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": out[-500:]}
    ctx.progress(data)
    code, out = subprocess_tail([sys.executable, "-c", _labkit_gpu_spawn()], ctx.left())
    data["labkit_spawn"] = out.strip().splitlines()[-1] if code == 0 else out[-800:]
    ok = data["nvml_check"].get("forked_child_ok") is True and code == 0
    return Result("G1: fork after the Llama import", "pass" if ok else "fail",
                  f"reproduced without the NVML check: {data['plain'].get('forked_child_ok') is False}", data=data)


def check_preflight(ctx: Context) -> Result:
    folder = ctx.out / "preflight"
    code, out = subprocess_tail([*_LABKIT, "preflight", "--profile", ctx.profile, *PREFLIGHT_ARGS,
                                 "--out", str(folder)], ctx.left())
    status = "pass" if code == 0 else "fail"
    why = "" if code == 0 else ("over its cap" if code is None else f"exit {code}")
    summary = [line for line in out.splitlines() if " checks ok; " in line]
    return Result(f"labkit preflight --profile {ctx.profile} {' '.join(PREFLIGHT_ARGS)}", status,
                  why or (summary[-1] if summary else ""), data={"tail": out[-2500:]})


def _ensure_kernel() -> None:
    """The notebooks' kernel spec `labkit` (a stock image has none): installed into this Python's prefix."""
    from jupyter_client.kernelspec import find_kernel_specs

    if "labkit" not in find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "labkit"],
                       check=True, capture_output=True, timeout=60)


def check_notebook(ctx: Context, name: str) -> Result:
    """One notebook on the profile, in this interpreter's papermill (its kernel is reaped with the check)."""
    from labkit.course import notebooks

    _ensure_kernel()
    path = notebooks.find_notebooks([name])[0]
    run = notebooks.run_notebook(path, profile=ctx.profile, out_dir=ctx.out / "executed", timeout_s=max(1, int(ctx.left())))
    return Result(f"notebook {name} on {ctx.profile}", "pass" if run.ok else "fail", run.describe(),
                  data={"executed": str(run.output)})


def _memory_row(ctx: Context, strategy: str, model: str, common: dict) -> dict:
    import torch

    from labkit.memory.estimate import estimate
    from labkit.memory.runs import memory_config
    from labkit.train.api import make_config, run

    if ctx.gpu:
        torch.cuda.empty_cache()  # the last variant's cached blocks must not count as this one's reserved
        torch.cuda.reset_peak_memory_stats()
    record = run(strategy, model, **common)
    est = estimate(memory_config(make_config(strategy, model, **common))).total
    measured = max(record.peak_bytes)
    return {"strategy": strategy, "estimate": est, "peak_allocated": measured,
            "peak_reserved": torch.cuda.max_memory_reserved() if ctx.gpu else None,
            "measured_over_estimate": round(measured / est if est else 0.0, 3)}


def check_memory(ctx: Context) -> Result:
    """The estimator against the allocator, one row per single-GPU strategy (single, LoRA, QLoRA when
    bitsandbytes is there) in bf16 (GPU); on CPU one tiny run against MemTracker's tensor accounting.
    fp32 and activation checkpointing were cut to fit the cap: notebook 01 runs them on h100x1."""
    import importlib.util

    strategies = ["single", "lora"] + ["qlora"] * (importlib.util.find_spec("bitsandbytes") is not None)
    model, profile = ("tinyllama-1.1b", ctx.profile) if ctx.gpu else ("tiny-llama", "smoke")
    common = dict(profile=profile, steps=2 if ctx.gpu else 3, warmup_steps=1, eval_batches=0, progress=False,
                  batch=4, out=str(ctx.out / "runs"), amp="bf16" if ctx.gpu else "none")
    rows, bad = [], []
    for strategy in strategies if ctx.gpu else ["single"]:
        rows.append(_memory_row(ctx, strategy, model, common))
        ctx.progress({"model": model, "rows": rows})
        if not 0.5 <= rows[-1]["measured_over_estimate"] <= 1.5:
            bad.append(f"{strategy}: measured {rows[-1]['measured_over_estimate']:.2f} x the estimate")
    summary = ", ".join(f"{r['strategy']} {r['measured_over_estimate']:.2f}" for r in rows)
    return Result("memory: estimator vs " + ("max_memory_allocated / reserved" if ctx.gpu else "MemTracker (CPU)"),
                  "fail" if bad else "pass", "; ".join(bad) or f"{model}: measured / estimated peak {summary}",
                  data={"model": model, "rows": rows})


def check_resnet_amp(ctx: Context) -> Result:
    from labkit.train.api import run

    record = run("single", "resnet50", profile=ctx.profile, steps=30, amp="bf16", channels_last=True, batch=256,
                 data="synthetic", progress=False, eval_batches=0, out=str(ctx.out / "runs"))
    share = record.samples_per_s / RESNET50_AMP_IMG_S_A100
    return Result("ResNet-50 AMP img/s vs NVIDIA's A100 2470", "pass" if share >= 0.5 else "fail",
                  f"{record.samples_per_s:.0f} img/s = {share:.2f} x NVIDIA's A100 number",
                  data={"img_s": record.samples_per_s, "reference": RESNET50_AMP_IMG_S_A100})


def check_llm_mfu(ctx: Context) -> Result:
    from labkit.train.api import run

    record = run("single", "tinyllama-1.1b", profile=ctx.profile, steps=12, amp="bf16", progress=False,
                 eval_batches=0, out=str(ctx.out / "runs"))
    ok = 0.05 < record.mfu < 1.0
    return Result("LLM step MFU vs TinyLlama's published ~51%", "pass" if ok else "fail",
                  f"MFU {record.mfu:.1%} at {record.tokens_per_s:.0f} tokens/s (peak {record.train.peak_tflops_per_device:g} TFLOPS)",
                  data={"mfu": record.mfu, "reference": TINYLLAMA_MFU_A100})


def check_wheels(ctx: Context) -> Result:
    """Which of the wheels beyond a stock image are importable here, and their total against 60 MiB."""
    import importlib.util

    modules = {"pyyaml": "yaml"}
    missing = [w for w in WHEELS if importlib.util.find_spec(modules.get(w, w)) is None]
    total = sum(WHEELS.values())
    ok = not missing and total <= 60
    why = (f"missing: {', '.join(missing)}; " if missing else "") + f"{total:.1f} MiB of wheels (limit 60)"
    return Result("wheels beyond a stock PyTorch image", "pass" if ok else "fail", why, data={"wheels_mib": WHEELS})
