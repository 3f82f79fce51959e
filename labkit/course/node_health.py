"""What the driver knows about a node's GPUs that a speed probe cannot see (issue 38, G5), and the burn-in.

`labkit preflight` reads, per GPU (`nvidia-smi --query-gpu`, `--query-remapped-rows`, `--query-compute-apps`)
and from the kernel log (`dmesg`):
- uncorrected ECC errors since the driver loaded (volatile): the GPU's memory returned bad data;
- remapped rows: an uncorrectable or pending remap (A100/H100 replace a bad row at the next reset; until
  then the GPU should not train), or a remap failure (the GPU needs service);
- Xid errors (`NVRM: Xid`): 48 (double-bit ECC), 63/64 (row remapping), 79 (fell off the bus), 92-95
  (ECC / contained errors), 13/31/43 (a program's fault: listed, not failed);
- MIG mode on: a lab's rank sees a slice, not the GPU its profile sizes;
- compute mode other than Default: a second process per GPU (the grader, a student's second kernel) fails;
- foreign processes holding GPU memory: their memory and clocks are not the lab's.
Each reading is parsed by a pure function tested on fake `nvidia-smi` output; on a machine without
`nvidia-smi` nothing is read and nothing is judged. Unverified on hardware: the field names are from
`nvidia-smi --help-query-gpu` / `--help-query-remapped-rows` of driver 5xx, not read on our nodes.

The burn-in (`labkit preflight --burn-in 60`) keeps every GPU at dense matmuls for that many seconds and
compares the last window's TFLOPS with the first: a GPU that throttles once hot (power brake, cooling)
passes the 0.1-s matmul probe but loses more than `THROTTLE_SHARE` here.
"""
from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import time

#: Longest burn-in the preflight's launch allows for (seconds); `--burn-in` asks for up to this.
BURN_IN_S = 60.0
#: A burn-in fails when its last window delivers less than this share of its first (throttling).
THROTTLE_SHARE = 0.85
#: Xid codes that mean the GPU or its memory is at fault (NVIDIA's "Xid Errors" table); others are listed.
BAD_XIDS = {48: "double-bit ECC error", 63: "row remapping event", 64: "row remapping failure",
            74: "NVLink error", 79: "GPU fell off the bus", 92: "high single-bit ECC rate",
            94: "contained ECC error", 95: "uncontained ECC error"}

GPU_FIELDS = ("index", "name", "uuid", "ecc.errors.uncorrected.volatile.total", "mig.mode.current", "compute_mode")
ROW_FIELDS = ("gpu_uuid", "remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending",
              "remapped_rows.failure")
APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")


def _rows(text: str, fields: tuple[str, ...]) -> list[dict]:
    """`--format=csv,noheader` output as dicts (fields stripped; '[N/A]' and 'N/A' become '')."""
    out = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) == len(fields):
            out.append({f: ("" if v.strip() in ("[N/A]", "N/A", "[Not Supported]") else v.strip())
                        for f, v in zip(fields, row)})
    return out


def _int(value: str) -> int:
    match = re.match(r"\d+", value or "")
    return int(match.group()) if match else 0


def parse_gpus(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=GPU_FIELDS --format=csv,noheader` -> one dict per GPU."""
    return _rows(text, GPU_FIELDS)


def parse_remapped(text: str) -> dict[str, dict]:
    """`nvidia-smi --query-remapped-rows=ROW_FIELDS --format=csv,noheader` -> {uuid: {correctable,
    uncorrectable (counts), pending, failure (yes/no)}}."""
    out = {}
    for r in _rows(text, ROW_FIELDS):
        out[r["gpu_uuid"]] = {"correctable": _int(r["remapped_rows.correctable"]),
                              "uncorrectable": _int(r["remapped_rows.uncorrectable"]),
                              "pending": r["remapped_rows.pending"].lower() in ("yes", "1", "true"),
                              "failure": r["remapped_rows.failure"].lower() in ("yes", "1", "true")}
    return out


def parse_apps(text: str, own_pids: set[int] = frozenset()) -> list[dict]:
    """`nvidia-smi --query-compute-apps=APP_FIELDS --format=csv,noheader` -> the processes not in `own_pids`."""
    return [r for r in _rows(text, APP_FIELDS) if _int(r["pid"]) not in own_pids]


def parse_xids(text: str) -> list[tuple[int, str]]:
    """(Xid code, line) for each `NVRM: Xid (PCI:0000:3b:00): 79, ...` line of the kernel log."""
    return [(int(m.group(1)), line.strip()) for line in text.splitlines()
            if (m := re.search(r"NVRM: Xid \([^)]*\): (\d+)", line))]


def judge(gpus: list[dict], remapped: dict[str, dict], apps: list[dict], xids: list[tuple[int, str]]) -> list[dict]:
    """[{name, ok, detail, fix}] for the node: one per GPU, the foreign processes and the kernel log."""
    out = []
    for gpu in gpus:
        bad = []
        if _int(gpu["ecc.errors.uncorrected.volatile.total"]):
            bad.append(f"{gpu['ecc.errors.uncorrected.volatile.total']} uncorrected ECC errors")
        rows = remapped.get(gpu["uuid"], {})
        if rows.get("uncorrectable") or rows.get("pending") or rows.get("failure"):
            bad.append(f"remapped rows: {rows.get('uncorrectable', 0)} uncorrectable, pending={rows.get('pending')}, "
                       f"failure={rows.get('failure')}")
        if gpu["mig.mode.current"].lower() == "enabled":
            bad.append("MIG mode on")
        if gpu["compute_mode"] and gpu["compute_mode"].lower() != "default":
            bad.append(f"compute mode {gpu['compute_mode']}")
        detail = f"GPU {gpu['index']} {gpu['name']}: " + ("; ".join(bad) if bad else
                                                          f"ECC 0, {rows.get('correctable', 0)} correctable row remaps, "
                                                          f"MIG {gpu['mig.mode.current'] or 'n/a'}, "
                                                          f"compute mode {gpu['compute_mode'] or 'n/a'}")
        out.append({"name": f"health {gpu['index']}", "ok": not bad, "detail": detail,
                    "fix": "" if not bad else "report the node (ECC, row remaps need a GPU reset or service); "
                    "`sudo nvidia-smi -i N -mig 0` / `-c DEFAULT` turn MIG and exclusive modes off"})
    if apps:
        listed = ", ".join(f"pid {a['pid']} {a['process_name']} ({a['used_memory']})" for a in apps)
        out.append({"name": "gpu processes", "ok": False, "detail": f"{len(apps)} other process(es) on the GPUs: {listed}",
                    "fix": "stop them (`nvidia-smi`, then kill their pid) or wait: their memory and clocks are not the lab's"})
    elif gpus:
        out.append({"name": "gpu processes", "ok": True, "detail": "no other process on the GPUs", "fix": ""})
    bad_xids = [(c, line) for c, line in xids if c in BAD_XIDS]
    if xids:
        codes = ", ".join(f"{c} ({BAD_XIDS.get(c, 'a program fault')})" for c in sorted({c for c, _ in xids}))
        out.append({"name": "xid", "ok": not bad_xids, "detail": f"kernel log: Xid {codes}",
                    "fix": "" if not bad_xids else f"a hardware Xid: report the node ({bad_xids[-1][1][:120]})"})
    return out


def _run(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def read(own_pids: set[int] | None = None) -> list[dict]:
    """`judge` of this machine's `nvidia-smi` and kernel log; [] without `nvidia-smi` (CPU)."""
    if not shutil.which("nvidia-smi"):
        return []
    smi = ["nvidia-smi", "--format=csv,noheader"]
    gpus = parse_gpus(_run(smi + ["--query-gpu=" + ",".join(GPU_FIELDS)]))
    remapped = parse_remapped(_run(smi + ["--query-remapped-rows=" + ",".join(ROW_FIELDS)]))
    apps = parse_apps(_run(smi + ["--query-compute-apps=" + ",".join(APP_FIELDS)]), own_pids or {os.getpid()})
    xids = parse_xids(_run(["dmesg"]))  # needs root or kernel.dmesg_restrict=0; else no lines, nothing judged
    return judge(gpus, remapped, apps, xids)


def check_burn_in(seconds: float) -> None:
    """ConfigError unless 0 <= `seconds` <= BURN_IN_S (the preflight's launch limit counts on it)."""
    from labkit.errors import ConfigError

    if not 0 <= seconds <= BURN_IN_S:
        raise ConfigError(f"burn-in of {seconds!r} s; give 0 (none) to {BURN_IN_S:g} seconds")


# ----------------------------------------------------------------------------------- on the ranks
def burn_in(device, amp: str, seconds: float, *, n: int = 8192, window_s: float = 5.0) -> dict:
    """Dense matmuls on this rank's device for `seconds`: TFLOPS of each `window_s` window. CPU: n=256."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp, torch.float32)
    n = n if device.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    windows, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or not windows:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < min(window_s, max(seconds, 1e-3)):
            a @ b
            count += 1
            if device.type == "cuda" and count % 10 == 0:
                torch.cuda.synchronize(device)  # keep the host close to the GPU (unverified on hardware)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        windows.append(2 * n**3 * count / (time.perf_counter() - start) / 1e12)
    return {"seconds": seconds, "n": n, "windows_tflops": windows}


def judge_burn_ins(results: list[dict], fix: str = "") -> list[dict]:
    """[{name, ok, detail, fix, seconds}] per rank's burn-in (`judge_burn_in`)."""
    out = []
    for r in results:
        ok, detail = judge_burn_in(r)
        out.append({"name": f"burn-in {r.get('rank', 0)}", "ok": ok, "detail": detail, "seconds": r["seconds"],
                    "fix": "" if ok else "a GPU that slows down once hot: " + fix})
    return out


def judge_burn_in(result: dict) -> tuple[bool, str]:
    """(ok, detail): the last window against the first (a throttling GPU slows down once hot)."""
    w = result["windows_tflops"]
    share = w[-1] / w[0] if w and w[0] else 1.0
    detail = (f"{result['seconds']:g} s burn-in: {w[0]:.3g} -> {w[-1]:.3g} TFLOPS ({share:.0%} of the first "
              f"window, {len(w)} windows)") if w else "no burn-in window"
    return share >= THROTTLE_SHARE, detail
