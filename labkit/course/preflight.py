"""Is this node ready for the labs? `labkit preflight --profile P`, run by the instructor the day before.

Four kinds of checks, one `Check` each (docs/gpu-node.md):
- `labs`: every lab notebook's runs resolve on the profile and fit its GPUs (`labkit.course.profile_check`);
- `strategy`: every strategy the profile's labs use trains a few steps with finite losses. All of them
  run inside ONE torchrun launch (`labkit.train.many.run_many`), so the ranks start once; if a run
  fails, the runs before it keep their result, it is reported with the error, and the rest run in a
  new launch. `single` runs in this process. On `smoke*` profiles: every strategy of `labkit train`;
- `accelerate`: FSDP1 through accelerate (notebook 04): each variant's YAML makes accelerate build the
  plugin it asks for; on GPU profiles `fsdp` trains under `accelerate launch` and must be real FSDP;
- `probe`: an all-reduce bandwidth probe (every GPU pair on a GPU node, one 2-rank probe on CPU) and
  a matmul throughput probe, run on the ranks of the same launch before the first strategy.
  Rank 0 writes them to OUT/preflight.json (format in docs/gpu-node.md), where planners read them.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from labkit import parallel
from labkit.course import profile_check
from labkit.errors import LabkitError
from labkit.parallel import comm
from labkit.profiles import Profile

#: File in the output folder holding the probes and every check (docs/gpu-node.md).
RESULT_FILE = "preflight.json"
#: All-reduce probe payload (fp32 elements): 64 MiB on GPU (bandwidth-bound), 4 MiB on CPU.
PROBE_ELEMENTS = {"cuda": 16 * 2**20, "cpu": 2**20}
#: Square matmul side of the throughput probe.
MATMUL_N = {"cuda": 8192, "cpu": 512}


@dataclass(frozen=True)
class Check:
    """One preflight line."""

    kind: str
    """'labs', 'strategy', 'accelerate' or 'probe'."""
    strategy: str
    """The strategy trained, 'labs' or the probe's name ('all-reduce', 'matmul')."""
    status: str
    """'ok' or 'failed'."""
    seconds: float
    detail: str = ""
    fix: str = ""
    """What to do about a failure ('' when ok)."""
    peak_bytes: int | None = None
    """Largest peak over ranks (training runs)."""
    model: str = ""

    def line(self) -> str:
        peak = f"peak {self.peak_bytes / 2**20:9.1f} MiB" if self.peak_bytes else " " * 19
        text = f"{self.status:<6} {self.kind:<10} {self.strategy:<22} {self.seconds:7.1f} s  {peak}  {self.detail}"
        return text + (f"\n       fix: {self.fix}" if self.fix else "")


def runs_for(profile: Profile) -> list[tuple[str, str, dict]]:
    """(strategy, model, options) to train: every strategy on smoke profiles, else the labs' ones."""
    if profile.device == "cpu":
        return [(name, parallel.strategy_class(name).example_model or profile.llm_model, {})
                for name in parallel.STRATEGIES]
    # One run per (strategy, model, precision, memory cap): bf16 FSDP2 beside fp32 FSDP, fp16 on V100 and
    # 06's capped LoRA/QLoRA each train here (issue #25, finding 9: keyed on strategy and model they did not).
    seen: dict[tuple, tuple[str, str, dict]] = {}
    for _lab, _label, strategy, model, options in profile_check.lab_runs(profile):
        own = {k: v for k, v in options.items() if k != "nproc"}
        seen.setdefault((strategy, model, own.get("amp"), own.get("memory_cap_gb")), (strategy, model, own))
    return list(seen.values())


def launched_runs(plan: list[tuple[str, str, dict]]) -> list[tuple[str, dict]]:
    """The multi-rank runs of `plan` for `run_many`, with run ids no earlier preflight in the same folder
    used: a second preflight must never read yesterday's records (issue #25, finding 5)."""
    token = uuid.uuid4().hex[:8]
    return [(s, {**o, "model": m, "run_id": f"preflight-{token}-{i}-{s}"})
            for i, (s, m, o) in enumerate(plan) if s != "single"]


def labs_checks(profile: Profile) -> list[Check]:
    """One check per lab: its runs resolve and fit (`labkit.course.profile_check.check_profile`)."""
    start = time.perf_counter()
    items = profile_check.check_profile(profile)
    seconds = time.perf_counter() - start
    out = []
    for lab in dict.fromkeys(i.lab for i in items):
        mine = [i for i in items if i.lab == lab]
        bad = [i for i in mine if not i.ok]
        worst = max((i.bytes_per_gpu or 0 for i in mine), default=0)
        detail = f"{lab}: {len(mine)} run(s) resolve" + (f", largest {worst / 1e9:.1f} GB per GPU" if worst else "")
        if lab == "profile":
            detail = f"precision {profile.dtype} suits {profile.gpu_name or 'CPU'}"
        fix = "; ".join(f"{i.label}: {i.reason}" for i in bad)
        out.append(Check("labs", "labs", "failed" if bad else "ok", seconds / len(items) * len(mine),
                         detail if not bad else f"{lab}: {len(bad)} of {len(mine)} run(s) do not resolve", fix))
    return out


def run(profile: str | Profile, *, out: str | Path = "build/preflight", steps: int = 3) -> list[Check]:
    """Every check for `profile` on this machine; rank 0's probes land in OUT/preflight.json."""
    from labkit.envinfo import require

    prof = require(profile)  # a GPU profile without its GPUs stops here, in one line
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    checks = labs_checks(prof)
    common = dict(profile=prof.name, steps=steps, warmup_steps=1, eval_batches=0, progress=False, out=str(out))
    plan = runs_for(prof)
    checks += [_single(model, {**options, **common}) for s, model, options in plan if s == "single"]
    many = launched_runs(plan)
    checks += accelerate_checks(prof, out, steps)
    (out / "probes.json").unlink(missing_ok=True)  # a stale file must not pass for this run's probes
    checks += _train_many(prof, many, common, out)
    checks += probe_checks(out, prof)
    checks += record_matmul(out, prof)
    _write(out / RESULT_FILE, prof, checks)
    return checks


#: The planner's name (labkit.parallel.perf_model.GPUS) of each GPU profile's card.
PLANNER_GPU = {"a100x1": "a100-80gb", "a100x4": "a100-80gb", "h100x1": "h100-80gb", "v100x4": "v100-32gb"}


def record_matmul(out: Path, profile: Profile) -> list[Check]:
    """On a GPU node, hand the matmul probe to the planner: `labkit plan` then uses this node's measured
    efficiency instead of the published default (labkit.parallel.perf_model.record_measurement). CPU: nothing."""
    from labkit.parallel import perf_model

    path = out / "probes.json"
    gpu = PLANNER_GPU.get(profile.name)
    if profile.device != "cuda" or gpu is None or not path.is_file():
        return []
    m = json.loads(path.read_text(encoding="utf-8")).get("matmul") or {}
    if not m.get("tflops"):
        return []
    precision = "fp16" if profile.dtype == "float16" else "bf16"
    saved = perf_model.record_measurement(gpu, precision, m["tflops"], tool="labkit preflight")
    return [Check("probe", "matmul -> planner", "ok", 0.0,
                  f"{m['tflops']:.1f} TFLOPS = {m['tflops'] / perf_model.GPUS[gpu].peak_tflops:.0%} of {gpu}'s "
                  f"{precision} peak, saved to {saved} for `labkit plan`")]


def accelerate_checks(profile: Profile, out: Path, steps: int) -> list[Check]:
    """FSDP1 through accelerate (notebook 04): each variant's config builds the plugin it asks for
    (accelerate's own parsing, `accelerate_config.plugin_problems`); on a GPU profile `fsdp` also
    trains under `accelerate launch` and must really be FSDP, not silently DDP (unverified on GPUs here)."""
    from labkit.parallel import accelerate_config, accelerate_fsdp

    checks = []
    for strategy in accelerate_config.STRATEGY_MAP:
        start = time.perf_counter()
        problems = accelerate_config.plugin_problems(strategy, profile.name, out / "accelerate")
        detail = "; ".join(problems) or "config builds the FSDP1 plugin it asks for"
        fix = "fix labkit.parallel.accelerate_config.config_dict for this accelerate version" if problems else ""
        checks.append(Check("accelerate", f"accelerate-{strategy}", "failed" if problems else "ok",
                            time.perf_counter() - start, detail, fix))
    if profile.device == "cuda":
        start = time.perf_counter()
        try:
            record = accelerate_fsdp.run("fsdp", profile.llm_model, profile=profile.name, nproc=profile.nproc,
                                         steps=steps, out=str(out))
            ok = record.accelerate.fsdp_effective
            detail = f"accelerate built {record.accelerate.wrapper} ({record.accelerate.distributed_type})"
        except LabkitError as exc:
            ok, detail = False, (str(exc).splitlines() or ["accelerate launch failed"])[0][:200]
        fix = "" if ok else "run labkit.parallel.accelerate_fsdp.run('fsdp', ...) alone for the output"
        checks.append(Check("accelerate", "accelerate-fsdp run", "ok" if ok else "failed",
                            time.perf_counter() - start, detail, fix))
    return checks


def _single(model: str, options: dict) -> Check:
    from labkit.train.api import run as train

    start = time.perf_counter()
    try:
        record = train("single", model, **options)
    except (LabkitError, RuntimeError) as exc:  # a failed run (e.g. CUDA OOM) is a result, not a crash
        return _failed("single", model, time.perf_counter() - start, exc, options["profile"])
    return _from_record(record, time.perf_counter() - start)


def _train_many(prof: Profile, runs: list, common: dict, out: Path) -> list[Check]:
    """Runs in one launch; after a failure, the runs after the failed one in a new launch."""
    from labkit.errors import LaunchError
    from labkit.train.api import record_of
    from labkit.train.many import run_many

    checks: list[Check] = []
    probe = ("labkit.course.preflight:probe_rank", {"out": str(out / "probes.json")})
    pending = list(runs)
    while pending:
        start = time.time()
        try:
            run_many(pending, prof.llm_model, nproc=prof.nproc, stream=False, before=probe, **common)
            error = None
        except (LaunchError, RuntimeError) as exc:
            error = exc
        probe = None  # probes run once, in the first launch
        done = []
        for name, own in pending:
            try:
                done.append(record_of(common["out"], own["run_id"]))
            except LabkitError:
                break
        last = start
        for record in done:
            stamp = _dt.datetime.fromisoformat(record.timestamp).timestamp()
            checks.append(_from_record(record, stamp - last))
            last = stamp
        if error is None:
            break
        failed_name, failed_own = pending[len(done)]
        checks.append(_failed(failed_name, failed_own["model"], time.time() - last, error, prof.name))
        pending = pending[len(done) + 1:]
    return checks


def _from_record(record, seconds: float) -> Check:
    finite = all(math.isfinite(x) for x in record.losses)
    detail = (f"{record.model} x{record.world_size} {record.dtype}: "
              f"loss {record.losses[0]:.3f} -> {record.losses[-1]:.3f}")
    return Check("strategy", record.strategy, "ok" if finite else "failed", seconds, detail,
                 "" if finite else "the loss is not finite: check the precision (fp16 needs a GradScaler)",
                 max(record.peak_bytes), record.model)


def _failed(strategy: str, model: str, seconds: float, exc: Exception, profile: str) -> Check:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    fix = (f"see the error; rerun alone for the full traceback: labkit train --strategy {strategy} "
           f"--model {model} --profile {profile} --steps 3" + ("" if strategy == "single" else " --nproc N"))
    return Check("strategy", strategy, "failed", seconds, first, fix, None, model)


# ----------------------------------------------------------------------------------- probes
def probe_rank(spec: dict, cfg, ctx) -> None:
    """`run_many` hook on every rank: all-reduce bandwidth per rank pair, and matmul throughput.

    GPU: every pair (i, j) gets its own group (`dist.new_group` is collective: every rank creates
    every pair), so a slow NVLink/PCIe path shows up on its own. CPU: one 2-rank probe.
    Unverified on GPUs here: CUDA event timing and NCCL pair groups are written blind.
    """
    import itertools

    import torch
    import torch.distributed as dist

    device = ctx.device
    n = PROBE_ELEMENTS[device.type]
    world = ctx.world_size
    if device.type == "cuda":
        pairs = list(itertools.combinations(range(world), 2))
    else:
        pairs = [(0, 1)] if world > 1 else []
    rows = []
    for pair in pairs:
        group = dist.new_group(list(pair))
        if ctx.rank in pair:
            seconds = _time_allreduce(torch.ones(n, device=device), group, device)
            # Ring all-reduce moves 2 (p-1)/p of the payload per rank: NCCL-tests' "bus bandwidth".
            nbytes, p = n * 4, len(pair)
            algbw = nbytes / seconds / 1e9
            rows.append({"ranks": list(pair), "bytes": nbytes, "seconds": seconds,
                         "algbw_GBps": algbw, "busbw_GBps": algbw * comm.bus_factor("all_reduce", p)})
        dist.barrier()
    all_rows = [None] * world
    dist.all_gather_object(all_rows, rows)
    matmul = _matmul_tflops(device, cfg.precision.amp)
    if ctx.is_main:
        merged = sorted((r for part in all_rows for r in part), key=lambda r: r["ranks"])
        unique = list({tuple(r["ranks"]): r for r in merged}.values())
        Path(spec["out"]).write_text(json.dumps({"allreduce": unique, "matmul": matmul}), encoding="utf-8")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_allreduce(tensor, group, device, repeats: int = 5) -> float:
    """Median seconds of one all-reduce of `tensor` in `group` (one warm-up)."""
    import statistics

    import torch.distributed as dist

    dist.all_reduce(tensor, group=group)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_tflops(device, amp: str) -> dict:
    """Dense matmul TFLOPS at the run's compute dtype (2 n^3 FLOPs per n x n product)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp, torch.float32)
    n = MATMUL_N[device.type]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    _sync(device)
    start, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "seconds": seconds,
            "tflops": 2 * n**3 / seconds / 1e12, "device": name}


def probe_checks(out: Path, profile: Profile) -> list[Check]:
    """The probes' lines from OUT/probes.json (written by rank 0); 'failed' when the launch died first."""
    path = out / "probes.json"
    if not path.is_file():
        fix = "the first launch failed before the probes ran: see the strategy lines; NCCL_DEBUG=INFO shows why"
        return [Check("probe", "all-reduce", "failed", 0.0, "no probe results", fix)]
    data = json.loads(path.read_text(encoding="utf-8"))
    checks = [Check("probe", "all-reduce", "ok", r["seconds"], f"ranks {r['ranks'][0]}-{r['ranks'][1]}: "
                    f"{r['busbw_GBps']:.2f} GB/s bus bandwidth ({r['bytes'] / 2**20:.0f} MiB)")
              for r in data["allreduce"]]
    if profile.nproc > 1 and not data["allreduce"]:
        checks.append(Check("probe", "all-reduce", "failed", 0.0, "no rank pair measured", "rerun the preflight"))
    m = data["matmul"]
    peak = ""
    if profile.peak_tflops:
        peak = f" ({m['tflops'] / profile.peak_tflops:.0%} of the {profile.peak_tflops:g} peak)"
    checks.append(Check("probe", "matmul", "ok", m["seconds"],
                        f"{m['n']}^2 {m['dtype']}: {m['tflops']:.2f} TFLOPS{peak}"))
    return checks


def _write(path: Path, profile: Profile, checks: list[Check]) -> None:
    """OUT/preflight.json: profile, time, probes (all-reduce per pair, matmul) and every check."""
    probes_file = path.parent / "probes.json"
    probes = json.loads(probes_file.read_text(encoding="utf-8")) if probes_file.is_file() else {}
    data = {"profile": profile.name, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "allreduce": probes.get("allreduce", []), "matmul": probes.get("matmul"),
            "checks": [dataclasses.asdict(c) for c in checks]}
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def passed(checks: list[Check]) -> bool:
    return all(c.status == "ok" for c in checks)
