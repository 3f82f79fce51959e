"""Is this node ready for the labs? `labkit preflight --profile P`, run by the instructor the day before.

Four kinds of checks, one `Check` each (docs/gpu-node.md):
- `labs`: every lab notebook's runs resolve on the profile and fit its GPUs (`labkit.course.profile_check`);
- `strategy`: every (strategy, precision, variant) the profile's labs train -- the fp32 and the bf16 (fp16
  on V100) FSDP run, 06's memory-capped LoRA / QLoRA, ... (`runs_for`) -- trains a few steps with finite
  losses. All of them run inside ONE torchrun launch (`labkit.train.many.run_many`), so the ranks start
  once; if a run fails, the runs before it keep their result, it is reported with the error, and the rest
  run in a new launch. `single` runs in this process. On `smoke*` profiles: every strategy of `labkit train`;
- `accelerate`: FSDP1 through accelerate (notebook 04): each variant's YAML makes accelerate build the
  plugin it asks for; on GPU profiles `fsdp` trains under `accelerate launch` and must be real FSDP;
- `probe`: all-reduce busbw of every GPU pair and of all GPUs (nccl-tests' sizes), matmul TFLOPS of every
  GPU (`labkit.course.node_probes`), run on the ranks of the first launch; on a GPU profile each fails below
  its profile's share of the expected number (`node_probes.BARS`); plus the comm_bench.json notebook 03 reads.

Safe to run twice in one folder: every run of the preflight has its own run id (`new_run_id`); it reads only
the records and probes tagged with it, never yesterday's. Everything it measured stays in OUT: preflight.json,
probes.json, comm_bench.json, and the matmul efficiency as matmul_efficiency.json -- nothing in a shared cache,
so `labkit plan` and the graded planner answers keep their fitted efficiency (`record_matmul`).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import secrets
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from labkit import parallel
from labkit.course import node_health, node_probes, profile_check
from labkit.errors import LabkitError
from labkit.profiles import Profile

#: File in the output folder holding the probes and every check (docs/gpu-node.md).
RESULT_FILE = "preflight.json"
#: The probes rank 0 wrote in this run (tagged with its run id).
PROBES_FILE = "probes.json"


@dataclass(frozen=True)
class Check:
    """One preflight line."""

    kind: str
    """'labs', 'health', 'strategy', 'accelerate' or 'probe'."""
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


def new_run_id() -> str:
    """'preflight-20261125T010203Z-3f9a': this preflight's records and probes carry it."""
    return f"preflight-{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"


def runs_for(profile: Profile) -> list[tuple[str, str, dict]]:
    """(strategy, model, options) to train: every strategy on smoke profiles; on GPU profiles every distinct
    (strategy, model, options) the labs run, the precision resolved (a run that states no amp trains at
    the profile's), so fp32 and bf16 FSDP, fp16 on V100 and the memory-capped PEFT runs all train."""
    if profile.device == "cpu":
        return [(name, parallel.strategy_class(name).example_model or profile.llm_model, {})
                for name in parallel.STRATEGIES]
    amp = profile_check.AMP_OF_DTYPE[profile.dtype]
    seen: dict[tuple, tuple[str, str, dict]] = {}
    for _lab, _label, strategy, model, options in profile_check.lab_runs(profile):
        own = {k: v for k, v in options.items() if k != "nproc" and v not in (None, False)}
        own["amp"] = own.get("amp") or amp
        seen.setdefault((strategy, model, tuple(sorted(own.items()))), (strategy, model, own))
    return list(seen.values())


def variant(options: dict) -> str:
    """'amp=bf16 checkpointing memory_cap_gb=24': how a run differs from the strategy's defaults."""
    return " ".join(k if v is True else f"{k}={v}" for k, v in sorted(options.items()) if k not in ("model", "run_id"))


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


def run(profile: str | Profile, *, out: str | Path = "build/preflight", steps: int = 3,
        burn_in_s: float = 0.0, strategies: tuple[str, ...] | None = None) -> list[Check]:
    """Every check for `profile` on this machine, under a new run id; everything measured lands in OUT. `burn_in_s`
    (at most `node_health.BURN_IN_S`): every GPU at dense matmuls that long; `strategies`: train only their runs."""
    from labkit.runtime.envinfo import require

    node_health.check_burn_in(burn_in_s)

    prof = require(profile)  # a GPU profile without its GPUs stops here, in one line
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    checks = labs_checks(prof) + health_checks(node_health.read())
    common = dict(profile=prof.name, steps=steps, warmup_steps=1, eval_batches=0, progress=False, out=str(out))
    plan = [(s, m, o, f"{run_id}-{i:02d}-{s}") for i, (s, m, o) in enumerate(runs_for(prof)) if s in (strategies or [s])]
    checks += [_single(model, options, {**common, "run_id": rid}) for s, model, options, rid in plan if s == "single"]
    many = [(s, {**o, "model": m, "run_id": rid}) for s, m, o, rid in plan if s != "single"]
    checks += accelerate_checks(prof, out, steps, train=strategies is None or "fsdp" in strategies)
    checks += _train_many(prof, many, common, out, run_id, burn_in_s)
    probes = load_probes(out, run_id)
    topology = node_probes.rank_topology(node_probes.read_topology(), prof.nproc) if prof.device == "cuda" else {}
    checks += probe_checks(probes, prof, topology)
    checks += comm_file_check(prof, probes)
    checks += record_matmul(out, prof, probes)
    _write(out / RESULT_FILE, prof, run_id, probes, topology, checks)
    return checks


def load_probes(out: Path, run_id: str) -> dict | None:
    """The probes rank 0 wrote in THIS preflight (OUT/probes.json tagged with `run_id`), else None."""
    path = out / PROBES_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if data.get("run_id") == run_id else None


#: The planner's name (labkit.parallel.perf_model.GPUS) of each GPU profile's card.
PLANNER_GPU = {"a100x1": "a100-80gb", "a100x4": "a100-80gb", "h100x1": "h100-80gb", "v100x4": "v100-32gb"}


def record_matmul(out: Path, profile: Profile, probes: dict | None) -> list[Check]:
    """On a GPU node, keep the matmul probe (median over the GPUs) as OUT/matmul_efficiency.json, beside the
    preflight's other output, and say how to plan with it. Never in a shared cache: `labkit plan` and the
    graded 07/09 planner answers keep their fitted efficiency unless told (`--measured FILE`). CPU: nothing."""
    from labkit.parallel import perf_model

    gpu = PLANNER_GPU.get(profile.name)
    tflops = [m["tflops"] for m in (probes or {}).get("matmul", []) if m.get("tflops")]
    if profile.device != "cuda" or gpu is None or not tflops:
        return []
    precision = "fp16" if profile.dtype == "float16" else "bf16"
    measured = statistics.median(tflops)
    saved = perf_model.record_measurement(gpu, precision, measured, tool="labkit preflight",
                                          path=out / perf_model.PERF_FILE_NAME)
    share = min(1.0, measured / perf_model.GPUS[gpu].peak_tflops)
    planner = perf_model.default_efficiency(gpu, precision)
    return [Check("probe", "matmul efficiency", "ok", 0.0,
                  f"{measured:.1f} TFLOPS = {share:.0%} of {gpu}'s {precision} peak, saved to {saved}; `labkit plan` "
                  f"keeps its fitted {planner.value:.0%} (to plan with this node's: --measured {saved}, "
                  f"or --matmul-efficiency {share:.2f})")]


def accelerate_checks(profile: Profile, out: Path, steps: int, train: bool = True) -> list[Check]:
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
    if profile.device == "cuda" and train:
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


def _single(model: str, options: dict, common: dict) -> Check:
    """One single-device variant, in this process (`options`: the variant; `common`: profile, steps, out...)."""
    from labkit.train.api import run as train

    start = time.perf_counter()
    try:
        record = train("single", model, **options, **common)
    except (LabkitError, RuntimeError) as exc:  # a failed run (e.g. CUDA OOM) is a result, not a crash
        return _failed("single", model, time.perf_counter() - start, exc, common["profile"], options)
    return _from_record(record, time.perf_counter() - start, options)


def _train_many(prof: Profile, runs: list, common: dict, out: Path, run_id: str, burn_in_s: float = 0.0) -> list[Check]:
    """Runs in one launch; after a failure, the runs after the failed one in a new launch. Records are
    found by this preflight's run ids only, so an earlier preflight's records in OUT never count."""
    from labkit.errors import LaunchError
    from labkit.train.api import record_of
    from labkit.train.many import run_many

    checks: list[Check] = []
    probe = ("labkit.course.node_probes:probe_rank", {"out": str(out / PROBES_FILE), "run_id": run_id,
                                                       "burn_in_s": burn_in_s})
    pending = list(runs)
    while pending:
        start = time.time()
        try:
            run_many(pending, prof.llm_model, nproc=prof.nproc, stream=False, before=probe,
                     timeout_s=launch_limit(prof, len(pending)), **common)
            error = None
        except (LaunchError, RuntimeError) as exc:
            error = exc
        probe = None  # probes run once, in the first launch
        done = []
        for name, own in pending:
            try:
                done.append((own, record_of(common["out"], own["run_id"])))
            except LabkitError:
                break
        last = start
        for own, record in done:
            stamp = _dt.datetime.fromisoformat(record.timestamp).timestamp()
            checks.append(_from_record(record, stamp - last, own))
            last = stamp
        if error is None:
            break
        if len(done) == len(pending):  # every run recorded, then the launch failed (e.g. at teardown)
            checks.append(_failed("launch", prof.llm_model, time.time() - last, error, prof.name))
            break
        failed_name, failed_own = pending[len(done)]
        checks.append(_failed(failed_name, failed_own["model"], time.time() - last, error, prof.name, failed_own))
        pending = pending[len(done) + 1:]
    return checks


#: Seconds one preflight run (a few steps, its model's load included) may take (issue 38, G4).
RUN_LIMIT_S = 300.0


def launch_limit(prof: Profile, runs: int) -> float:
    """One launch's wall limit: `RUN_LIMIT_S` a run (+ probes, burn-in), never more than the profile's own."""
    runs = max(1, runs)
    return min(prof.timeout_s * runs, RUN_LIMIT_S * (runs + 1) + node_health.BURN_IN_S)


def _from_record(record, seconds: float, options: dict) -> Check:
    finite = bool(record.losses) and all(math.isfinite(x) for x in record.losses)
    losses = f"loss {record.losses[0]:.3f} -> {record.losses[-1]:.3f}" if record.losses else "no loss recorded"
    detail = " | ".join(filter(None, (variant(options), f"{record.model} x{record.world_size} {record.dtype}: {losses}")))
    return Check("strategy", record.strategy, "ok" if finite else "failed", seconds, detail,
                 "" if finite else "the loss is not finite: check the precision (fp16 needs a GradScaler)",
                 max(record.peak_bytes, default=None), record.model)


def _failed(strategy: str, model: str, seconds: float, exc: Exception, profile: str, options: dict | None = None) -> Check:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    flags = "".join(f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                    for k, v in sorted((options or {}).items()) if k not in ("model", "run_id"))
    fix = (f"see the error; rerun alone for the full traceback: labkit train --strategy {strategy} "
           f"--model {model} --profile {profile} --steps 3{flags}" + ("" if strategy == "single" else " --nproc N"))
    return Check("strategy", strategy, "failed", seconds, " | ".join(filter(None, (variant(options or {}), first))), fix,
                 None, model)


# ----------------------------------------------------------------------------------- probes, judged
_LINK_FIX = ("a slow pair or ring: `nvidia-smi topo -m` (NV# = NVLink), `nvidia-smi nvlink --status`, NCCL_DEBUG=INFO "
             "(P2P or SHM transport?), NCCL_P2P_DISABLE / NCCL_P2P_LEVEL in the environment, PCIe ACS; expected "
             "numbers: docs/gpu-node.md")
_GPU_FIX = ("a slow GPU: `nvidia-smi -q -d PERFORMANCE,CLOCK,POWER` (clocks-event reasons: power brake, HW slowdown, "
            "a low power limit), other processes on it (`nvidia-smi`); rerun after it idles")


def probe_checks(probes: dict | None, profile: Profile, topology: dict | None = None) -> list[Check]:
    """One line per measured pair, the all-GPU all-reduce and each GPU's matmul. On a GPU profile each is
    judged against `node_probes.BARS[profile]` (a share of the expected number); on CPU nothing is judged.
    `topology`: {(rank, rank): 'NV12' | 'SYS' | ...} from `nvidia-smi topo -m` ({} = unknown)."""
    if probes is None:
        fix = "the first launch failed before the probes ran: see the strategy lines; NCCL_DEBUG=INFO shows why"
        return [Check("probe", "all-reduce", "failed", 0.0, "no probe results from this preflight", fix)]
    bar = node_probes.BARS.get(profile.name) if profile.device == "cuda" else None
    topology = topology or {}
    checks = []
    expected_pairs = []
    for r in probes["allreduce"]:
        pair = tuple(r["ranks"])
        cell = topology.get(pair)
        exp = node_probes.expected_busbw(profile.gpu_name, cell, bar.link) if bar else None
        expected_pairs.append(exp)
        name = f"all-reduce {pair[0]}-{pair[1]}"
        measured = f"{r['busbw_GBps']:.2f} GB/s busbw ({r['bytes'] / 2**20:.0f} MiB)"
        if r.get("wrong_elements"):  # wrong data is a broken node at any speed (issue 38, G5)
            checks.append(Check("probe", name, "failed", r["seconds"], f"{measured}, but {r['wrong_elements']} "
                                f"element(s) of the sum came back wrong", "a corrupting link: " + _LINK_FIX))
        elif exp is not None and bar.link == "nvlink" and exp.link == "pcie":
            checks.append(Check("probe", name, "failed", r["seconds"], f"{measured} over PCIe (topology {cell}); "
                                f"profile {profile.name} expects NVLink between its GPUs", _LINK_FIX))
        else:
            where = f" ({cell or 'topology unknown'})" if bar else ""
            checks.append(_judged(name, r["seconds"], r["busbw_GBps"], exp, bar and bar.busbw_share, measured,
                                  where, "GB/s", _LINK_FIX))
    if profile.nproc > 1 and not probes["allreduce"]:
        checks.append(Check("probe", "all-reduce", "failed", 0.0, "no rank pair measured", "rerun the preflight"))
    if probes.get("comm"):
        top = max(probes["comm"], key=lambda r: r["bytes"])
        ring = min((e for e in expected_pairs if e), key=lambda e: e.gbs, default=None)  # the ring's slowest link
        measured = f"{top['busbw_gbps']:.2f} GB/s busbw at {top['bytes'] / 2**20:g} MiB on {top['world_size']} ranks"
        checks.append(_judged(f"all-reduce x{top['world_size']}", top["seconds"], top["busbw_gbps"], ring,
                              bar and bar.busbw_share, measured, "", "GB/s", _LINK_FIX))
    for m in probes["matmul"]:
        half = m["dtype"] in ("bfloat16", "float16")
        exp = node_probes.expected_tflops(m["device"]) if bar and half else None
        who = "GPU" if profile.device == "cuda" else "rank"
        measured = f"{who} {m['rank']} {m['device']}: {m['n']}^2 {m['dtype']} {m['tflops']:.3g} TFLOPS"
        checks.append(_judged(f"matmul {m['rank']}", m["seconds"], m["tflops"], exp, bar and bar.tflops_share,
                              measured, "", "TFLOPS", _GPU_FIX))
    checks += health_checks(node_health.judge_burn_ins(probes.get("burn_in", []), _GPU_FIX), "probe")
    return checks


def health_checks(readings: list[dict], kind: str = "health") -> list[Check]:
    """`node_health` readings (ECC, remapped rows, Xid, MIG, compute mode, other processes; burn-ins) as checks."""
    return [Check(kind, r["name"], "ok" if r["ok"] else "failed", r.get("seconds", 0.0), r["detail"], r["fix"])
            for r in readings]


def _judged(name: str, seconds: float, value: float, exp, share, measured: str, where: str, unit: str,
            fix: str) -> Check:
    """ok when there is nothing to judge against (CPU) or value >= share x expected."""
    if exp is None:
        return Check("probe", name, "ok", seconds, measured + where)
    ok = value >= share * exp.gbs
    detail = (f"{measured}{where} {'>=' if ok else '<'} {share:.0%} of {exp.gbs:.1f} {unit} expected "
              f"({exp.what})")
    return Check("probe", name, "ok" if ok else "failed", seconds, detail, "" if ok else fix)


def comm_file_check(profile: Profile, probes: dict | None) -> list[Check]:
    """The comm_bench.json notebook 03 reads (results root, `commbench.default_file`): on a GPU profile it
    must be an NCCL measurement of every GPU up to the bandwidth plateau, near this preflight's own."""
    from labkit.profiling import commbench

    path = commbench.default_file()
    if profile.device != "cuda":
        return []
    if not path.is_file():
        return [Check("probe", "comm_bench.json", "ok", 0.0, f"none at {path.resolve()}: notebook 03 shows the "
                      "nominal link speeds until notebook 09 or `labkit bench comm` measures this node")]
    rows = [r for r in commbench.load(path) if r.op == "all_reduce" and r.backend == "nccl"]
    top = max(rows, key=lambda r: r.bytes, default=None)
    if top is None:
        return [Check("probe", "comm_bench.json", "failed", 0.0, f"{path.resolve()} has no NCCL all-reduce",
                      "run `labkit bench comm` on the node (defaults: every GPU, up to 1 GiB)")]
    own = max((probes or {}).get("comm", []), key=lambda r: r["bytes"], default=None)
    problems = ([f"{top.world_size} of {profile.nproc} GPUs"] * (top.world_size < profile.nproc)
                + [f"largest message {top.bytes / 2**20:g} MiB"] * (top.bytes < commbench.PLATEAU_BYTES)
                + [f"{top.busbw_gbps:.1f} GB/s, under half of this preflight's {own['busbw_gbps']:.1f}"]
                * bool(own and top.busbw_gbps < 0.5 * own["busbw_gbps"]))
    detail = f"{path.resolve()}: {top.busbw_gbps:.2f} GB/s busbw, {top.bytes / 2**20:g} MiB on {top.world_size} ranks"
    return [Check("probe", "comm_bench.json", "failed" if problems else "ok", 0.0,
                  detail + (f" ({'; '.join(problems)})" if problems else ", what notebook 03 uses"),
                  "rerun `labkit bench comm` on the node (defaults: every GPU, up to 1 GiB): notebook 03 reads "
                  "this file" if problems else "")]


def _write(path: Path, profile: Profile, run_id: str, probes: dict | None, topology: dict, checks: list[Check]) -> None:
    """OUT/preflight.json: profile, run id, time, topology, probes (pairs, all-GPU, matmul per GPU), checks."""
    probes = probes or {}
    data = {"profile": profile.name, "run_id": run_id, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "topology": {f"{a}-{b}": cell for (a, b), cell in sorted(topology.items())},
            "allreduce": probes.get("allreduce", []), "comm": probes.get("comm", []),
            "matmul": probes.get("matmul", []), "checks": [dataclasses.asdict(c) for c in checks]}
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def passed(checks: list[Check]) -> bool:
    return all(c.status == "ok" for c in checks)
