"""`make gpu-check`: the acceptance check for the first GPU we get (issue 38), in under 8 minutes.

What a CPU rehearsal cannot see, measured on the first GPU (one H100/H200 for ~15 minutes, a stock
PyTorch CUDA image, no network): the machine (driver, CUDA, torch's arch list, bitsandbytes' CUDA library,
ECC / compute mode), finding G1 reproduced and its fix, `labkit preflight --profile h100x1` (a slice of it),
notebooks 00, 01, 02 and 06 on h100x1, the memory estimator against the allocator's peaks, ResNet-50 AMP
img/s and the LLM step's MFU beside their published references. Each check ends pass, fail or skipped (with
why); build/gpu-check/report.json and report.md are rewritten after every check, so a run cut short still
reports.

Under 8 minutes by construction: every check has its own cap (CHECKS), the caps sum to at most
BUDGET_S - MARGIN_S, and each check runs in its own fresh interpreter (`python -m labkit.course.gpu_check
--one KEY`) killed, with everything it started, at its cap: a hang or a CUDA error is that check's `fail`
("over its N-s cap"), and the others still get their turn. This process never imports torch, let alone
initialises CUDA (G1: it is the parent of every check). Without a GPU the same table runs as a rehearsal:
the GPU-only checks are skipped, saying which CPU test covers them (tests/test_gpu_check.py, `make test`).
Unverified on hardware: the caps are estimates; when a GPU is at hand, commit its report under docs/gpu-check/.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from labkit.course import gpu_checks as C
from labkit.course.gpu_checks import PROFILE, WHEELS, Context, Result, Skip  # noqa: F401 - the public names

#: Seconds for the whole check: the issue's 8 minutes. MARGIN_S is left for what is not a check: starting
#: each check's interpreter, reaping what it left, writing the report (~1 s a check).
BUDGET_S = 480.0
MARGIN_S = 30.0


@dataclass(frozen=True)
class Check:
    key: str
    """`--only KEY` / `--one KEY`."""
    name: str
    """The report's line."""
    cap_s: float
    """Seconds this check may run, its interpreter's start included; killed at it ("over its N-s cap")."""
    run: Callable[[Context], Result]
    cpu: str = ""
    """'' when the check runs on CPU too; else the CPU test that covers it (the rehearsal skips it, naming it)."""


def _notebook(name: str) -> Callable[[Context], Result]:
    return lambda ctx: C.check_notebook(ctx, name)


_REHEARSED = "tests/test_rehearsal.py rehearses {} for h100x1 and tests/test_notebooks.py runs it"
#: Every check, in the order it runs, with its cap. Order: cheap and decisive first (is this machine able to
#: run us at all), then what only a GPU can measure (G1, memory, throughput), then what a CPU rehearsal
#: already covers best (the notebooks, the preflight), the longest last: a session cut short (the lease, a
#: machine that started late) loses the checks with the least new information.
#: Caps for ONE H200 on a stock image, UNVERIFIED ON HARDWARE (written blind; the first GPU report corrects
#: them). A fresh interpreter importing torch + transformers costs ~5-10 s (more for the very first, on a
#: cold page cache); a notebook adds its kernel's start (~8-10 s: python, torch, labkit) to its cells.
CHECKS: tuple[Check, ...] = (
    # first torch import on a cold disk (~10-15 s), CUDA context (~1-3 s), one nvidia-smi query
    Check("machine", "machine", 25, C.check_machine),
    # importlib.util.find_spec of 14 names, no torch
    Check("wheels", "wheels", 5, C.check_wheels),
    # four nvidia-smi queries and the kernel log, ~0.5 s each, no torch
    Check("node-health", "node health", 10, C.check_node_health, "tests/test_node_health.py parses fake nvidia-smi output"),
    # one interpreter importing torch + bitsandbytes (~5 s) and loading its CUDA library
    Check("bitsandbytes", "bitsandbytes CUDA library", 15, C.check_bitsandbytes,
          "tests/test_peft.py runs QLoRA's 4-bit paths on bitsandbytes' CPU backend"),
    # two probes at once (torch + transformers' Llama ~10 s, a fork, a CUDA context), then labkit's spawn
    # through a forkserver that preloads Llama (~15 s)
    Check("g1", "G1: fork after the Llama import", 35, C.check_fork_after_llama,
          "tests/test_spawn_fork.py makes the forkserver's CUDA refuse and checks the GPU path"),
    # imports (~10 s); single, LoRA, QLoRA on TinyLlama 1.1B, 2 steps each at batch 4 x 1024 (~8 s each,
    # mostly building 1.1B parameters); fp32 and checkpointing cut (notebook 01 runs them)
    Check("memory", "memory: estimator vs measured", 40, C.check_memory),
    # imports (~8 s), cuDNN's first batches (~5 s), 30 steps of 256 images at ~3000 img/s (~3 s)
    Check("resnet-amp", "ResNet-50 AMP img/s", 25, C.check_resnet_amp,
          "img/s mean nothing there; tests/test_rehearsal.py runs 02's AMP branch"),
    # imports (~10 s), TinyLlama 1.1B built (~8 s), 12 steps of 4 x 1024 tokens (< 1 s each)
    Check("llm-mfu", "LLM step MFU", 25, C.check_llm_mfu,
          "MFU is not defined there; tests/test_failed_runs.py checks the peaks it divides by"),
    # kernel start and the environment / plan cells: no training
    Check("nb-00", "notebook 00_setup", 20, _notebook("00_setup"), _REHEARSED.format("00_setup")),
    # kernel start, the estimator's cells, a few short measured runs
    Check("nb-01", "notebook 01_memory", 30, _notebook("01_memory"), _REHEARSED.format("01_memory")),
    # kernel start, TinyLlama LoRA / QLoRA runs under the memory cap, the full fine-tune that runs out
    Check("nb-06", "notebook 06_peft", 55, _notebook("06_peft"), _REHEARSED.format("06_peft")),
    # kernel start, five ResNet-50 runs of 50 steps at batch 32 (~3 s each), torch.compile's (~40 s)
    Check("nb-02", "notebook 02_single_gpu", 85, _notebook("02_single_gpu"), _REHEARSED.format("02_single_gpu")),
    # labkit import, every lab's runs sized, node health, one torchrun launch (~10 s) with the matmul probe and
    # DDP's three variants for 2 steps (~10 s each): C.PREFLIGHT_ARGS
    Check("preflight", f"labkit preflight --profile {PROFILE}", 80, C.check_preflight,
          "tests/test_preflight.py runs the smoke preflight and tests/test_rehearsal.py the GPU profiles' runs"),
)
#: The notebooks it runs (tests check they exist).
NOTEBOOKS = tuple(c.name.split()[-1] for c in CHECKS if c.key.startswith("nb-"))


def pinned_wheels(lock: str | Path = "requirements/lock.txt") -> list[str]:
    """'name==version' of each of WHEELS as the class's lock pins it (`make gpu-check-wheels`)."""
    pins = dict(line.strip().split("==", 1) for line in Path(lock).read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    return [f"{name}=={pins[name]}" if name in pins else name for name in WHEELS]


def gpu_present() -> bool:
    """Does nvidia-smi list a GPU? Asked without CUDA: this process must never initialise it (G1)."""
    from labkit.runtime import cudadriver

    return bool(cudadriver.nvidia_smi())


def chosen(only: str | list[str] | None) -> list[Check]:
    """The checks `--only a,b` names (all when None); an unknown key is a ConfigError listing the valid ones."""
    from labkit.errors import choices_error

    if only is None:
        return list(CHECKS)
    keys = [k.strip() for k in (only.split(",") if isinstance(only, str) else only) if k.strip()]
    valid = {c.key: c for c in CHECKS}
    for key in keys:
        if key not in valid:
            raise choices_error("check", key, valid)
    return [c for c in CHECKS if c.key in keys]


# ------------------------------------------------------------------------------------------- runner
def run_checks(out: str | Path = "build/gpu-check", *, budget_s: float = BUDGET_S, gpu: bool | None = None,
               only: str | list[str] | None = None, reap: bool = False) -> list[Result]:
    """Every check in turn (those of `only`, the others kept from the last report), each in its own
    interpreter under its cap; a check whose cap no longer fits what is left of `budget_s` is skipped, saying
    so. The report is rewritten after each (a partial run still reports). `reap`: this process is a child
    subreaper (`main`), so what a check leaves running is adopted here and killed after it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network: never wait on the Hub
    gpu = gpu_present() if gpu is None else gpu
    wanted = chosen(only)
    earlier = _earlier(out) if only is not None else {}
    meta = {"gpu": gpu, "profile": PROFILE, "budget_s": budget_s, "caps_s": sum(c.cap_s for c in CHECKS)}
    start = time.monotonic()
    results: list[Result] = []
    for check in CHECKS:
        left = budget_s - (time.monotonic() - start)
        if check not in wanted:
            result = earlier.get(check.name) or Result(check.name, "skipped", f"not chosen (--only {only})")
        elif check.cpu and not gpu:
            result = Result(check.name, "skipped", f"needs a CUDA GPU (on CPU: {check.cpu})")
        elif check.cap_s > left:
            result = Result(check.name, "skipped", f"its {check.cap_s:.0f}-s cap does not fit the {max(0.0, left):.0f} s "
                            f"left of the {budget_s:.0f}-s budget (--budget)")
        else:
            result = run_one(check, out, gpu=gpu, reap=reap)
        if result.name != check.name:  # one name per check in every report; the check's own title goes in its data
            result.data["title"], result.name = result.name, check.name
        result.cap_s = check.cap_s
        results.append(result)
        write_report(out, results, meta)
    return results


def run_one(check: Check, out: Path, *, gpu: bool, reap: bool = False) -> Result:
    """`check` in a fresh interpreter, killed with its process group at its cap; its output in OUT/logs/KEY.log
    (a file, not a pipe: a process it left behind cannot hold this one waiting)."""
    log = out / "logs" / f"{check.key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "labkit.course.gpu_check", "--one", check.key, "--out", str(out),
            "--cap", str(check.cap_s), "--gpu" if gpu else "--no-gpu"]
    return run_capped(args, check.cap_s, log, reap=reap)


def run_capped(args: list[str], cap_s: float, log: Path, *, reap: bool = False) -> Result:
    """Run `args` (a `--one` child) for at most `cap_s`; its last MARK line is the result."""
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=cap_s)
            over = False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the check and everything in its group
            except ProcessLookupError:  # it ended just now, and its group with it
                pass
            proc.wait()
            over = True
    left_behind = reap_adopted() if reap else []
    final, partial = _marked(log)
    seconds = round(time.monotonic() - start, 1)
    if over:
        result = Result("", "fail", f"over its {cap_s:.0f}-s cap: killed (log: {log})", data=partial or {})
    elif final is None:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        result = Result("", "fail", f"its interpreter exited {proc.returncode} without a result: "
                        f"{tail[0][:300] if tail else 'no output'} (log: {log})", data=partial or {})
    else:
        result = Result(**final)
    if left_behind:
        result.data["left_behind"] = left_behind
    result.seconds = seconds
    return result


def _marked(log: Path) -> tuple[dict | None, dict | None]:
    """(the final result, the last partial data) a child printed after MARK."""
    final = partial = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(C.MARK):
            try:
                item = json.loads(line[len(C.MARK):])
            except ValueError:
                continue
            final, partial = item.get("result", final), item.get("partial", partial)
    return final, partial


def become_subreaper() -> bool:
    """Linux: orphans of this process's descendants (a notebook's kernel, a rank in its own session) are
    re-parented here instead of to init, so `reap_adopted` can kill them when their check ends."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER


def reap_adopted() -> list[str]:
    """Kill and wait for every child of this process (called between checks, when it has no child of its
    own: each is something a finished or killed check left running); their command lines."""
    killed: list[str] = []
    for _ in range(20):  # a killed orphan's own children are adopted next round
        kids = []
        for entry in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            except OSError:
                continue
            if stat and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.append(int(entry))
        if not kids:
            break
        for pid in kids:
            try:
                killed.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:200])
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (OSError, ChildProcessError):
                pass
    return killed


def _earlier(out: Path) -> dict[str, Result]:
    """The last report's results by name (kept for the checks an `--only` run does not rerun)."""
    try:
        report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    fields = {f.name for f in dataclasses.fields(Result)}
    found = {}
    for item in report.get("checks", []):
        result = Result(**{k: v for k, v in item.items() if k in fields})
        result.data.setdefault("earlier", report.get("written", "an earlier run"))
        found[result.name] = result
    return found


def write_report(out: Path, results: list[Result], meta: dict) -> None:
    meta = {**meta, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "counts": {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skipped")}}
    (out / "report.json").write_text(json.dumps({**meta, "checks": [dataclasses.asdict(r) for r in results]},
                                                indent=1, default=str), encoding="utf-8")
    lines = [f"# gpu-check ({'GPU' if meta['gpu'] else 'CPU rehearsal'}, profile {meta['profile']}, {meta['written']})",
             "", f"Caps {meta['caps_s']:.0f} s of the {meta['budget_s']:.0f}-s budget; rerun one check: "
             "`make gpu-check GPU_CHECK_ARGS='--only KEY'` (keys: " + ", ".join(c.key for c in CHECKS) + ").", "",
             "| check | status | seconds | cap (s) | why / result |", "|---|---|---|---|---|"]
    for r in results:
        earlier = f" (from the run of {r.data['earlier']})" if "earlier" in r.data else ""
        lines.append(f"| {r.name} | {r.status} | {r.seconds:g} | {r.cap_s:g} | {r.why.replace('|', '/')}{earlier} |")
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


#: Seconds of its cap a check leaves itself to print its result: its subprocesses are bounded by the rest.
CHILD_SLACK_S = 3.0


def one(key: str, out: str, cap_s: float, gpu: bool) -> Result:
    """Run one check here (the child's side of `run_one`), printing its result after MARK."""
    check = chosen([key])[0]
    ctx = Context(out=Path(out), gpu=gpu, deadline=time.monotonic() + cap_s - CHILD_SLACK_S)
    try:
        if check.cpu and not gpu:
            raise Skip(f"needs a CUDA GPU (on CPU: {check.cpu})")
        result = check.run(ctx)
    except Skip as why:
        result = Result(check.name, "skipped", str(why))
    except Exception as exc:  # noqa: BLE001 - a failed check is a result, said in one line
        result = Result(check.name, "fail", f"{type(exc).__name__}: {str(exc)[:500]}")
    print(C.MARK + json.dumps({"result": dataclasses.asdict(result)}, default=str), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    from labkit.errors import LabkitError

    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gpu-check")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for all checks [{BUDGET_S:.0f}]; a check whose cap no longer fits is skipped")
    parser.add_argument("--only", default=None, metavar="KEY[,KEY]",
                        help="rerun these checks, keeping the others' lines of the last report; keys: "
                             + ", ".join(c.key for c in CHECKS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's side of a check
    parser.add_argument("--cap", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        one(args.one, args.out, args.cap, bool(args.gpu))
        return 0
    try:
        wanted = {c.name for c in chosen(args.only)}
    except LabkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = run_checks(args.out, budget_s=args.budget, gpu=args.gpu, only=args.only, reap=become_subreaper())
    for r in results:
        print(f"{r.status:<8} {r.seconds:6.1f} s / {r.cap_s:3.0f}  {r.name}" + (f": {r.why}" if r.why else ""))
    print(f"report: {args.out}/report.md")
    return 1 if any(r.status == "fail" and r.name in wanted for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
