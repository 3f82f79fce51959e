"""Collective bandwidth benchmark in nccl-tests' conventions (`labkit bench comm`).

Each rank runs every collective (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast) over a
range of message sizes: `warmup` untimed calls, then `iters` timed calls; the time of one call is the
loop's time / iters, and the reported time is the MAX over ranks (the slowest rank is when the
collective is done for everyone). Backend: nccl on GPUs, gloo on CPU.

Bandwidths (NVIDIA nccl-tests, doc/PERFORMANCE.md; GB/s = 10^9 bytes/s):
- `bytes` S is the whole buffer: the tensor all-reduced or broadcast, the gathered OUTPUT of an
  all-gather, the INPUT of a reduce-scatter, each rank's send buffer of an all-to-all.
- algorithm bandwidth algbw = S / time.
- bus bandwidth busbw = algbw x factor(op, n), so that it is comparable with the hardware's link speed
  whatever the number of ranks: a ring all-reduce sends 2 (n-1)/n x S per rank (reduce-scatter then
  all-gather, Patarasuk & Yuan 2009), all-gather, reduce-scatter and all-to-all (n-1)/n x S, broadcast S
  (the course's one model of this: `labkit.parallel.comm`).

Rank 0 writes the measurements to `<out>/comm_bench.json` (format: `save`). By default `<out>` is the
results root (`labkit.results.runs_root`: $LABKIT_RUNS, else runs/), beside the runs: the one place where
notebook 09 and `labkit bench comm` write it and notebook 03's ring model and `labkit preflight` read it
(`default_file`, `load_measured_bandwidth`). On a GPU node the defaults measure like nccl-tests: every GPU
(`default_nproc`), messages up to 1 GiB (`GPU_SIZES`), since busbw only reaches the link's plateau for
large messages. Run on ranks as `python -m labkit.profiling.commbench ...` (the CLI does it through
`labkit.runtime.launch`). Introduced in notebook 09_beyond_3d.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit.errors import ConfigError, choices_error
from labkit.parallel import comm

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: File name of the measurements inside --out (default folder: the results root, `default_file`).
FILE_NAME = "comm_bench.json"
#: Message sizes on CPU (gloo through loopback TCP: larger ones only take longer) and on GPUs: up to 1 GiB,
#: as nccl-tests is run (`all_reduce_perf -b 8 -e 1G`); NCCL's busbw still climbs at 256 MiB (nccl-tests#212).
CPU_SIZES = "1K,16K,256K,4M,16M"
GPU_SIZES = "1K,64K,1M,16M,256M,1G"
#: Below this largest size a GPU measurement is not the link's bandwidth yet (the reader says so).
PLATEAU_BYTES = 256 * 2**20
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_ELEMENT = 4  # fp32
#: Largest message a rehearsal allocates (labkit.runtime.rehearsal): the node's 1G buffers are host RAM here.
REHEARSAL_MAX_BYTES = 2**20


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on `n` ranks (nccl-tests PERFORMANCE.md): the bytes each rank sends per
    byte of S, `labkit.parallel.comm.bus_factor`, for the collectives this benchmark runs."""
    if op not in OPS:
        raise choices_error("collective", op, OPS)
    return comm.bus_factor(op, n)


@dataclass(frozen=True)
class CommMeasurement:
    """One (collective, size) point: seconds per call (max over ranks) and the two bandwidths."""

    op: str
    bytes: int
    """S in nccl-tests' convention (module docstring)."""
    seconds: float
    algbw_gbps: float
    """S / seconds in GB/s (10^9 B/s)."""
    busbw_gbps: float
    """algbw x bus_factor(op, world_size): comparable with the link's data-sheet bandwidth."""
    world_size: int
    backend: str


def measurement(op: str, nbytes: int, seconds: float, world_size: int, backend: str) -> CommMeasurement:
    algbw = nbytes / seconds / 1e9
    return CommMeasurement(op, int(nbytes), seconds, algbw, algbw * bus_factor(op, world_size), world_size, backend)


def parse_sizes(text: str, world_size: int) -> list[int]:
    """'1K,64K,1M' -> bytes (K = 2^10). Each size must split into whole fp32 elements per rank."""
    out = []
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", part.upper())
        if not match:
            raise ConfigError(f"size {part!r}; write sizes like 1K,64K,1M,1G (bytes, K = 1024)")
        nbytes = int(match.group(1)) * _UNITS[match.group(2)]
        unit = _ELEMENT * world_size
        if nbytes < unit or nbytes % unit:
            raise ConfigError(f"size {part.strip()} = {nbytes} B does not split into fp32 chunks over {world_size} "
                              f"ranks; use a multiple of {unit} B (e.g. 1K)")
        out.append(nbytes)
    return sorted(set(out))


# ------------------------------------------------------------------------ on the ranks
def _buffers(op: str, nbytes: int, n: int, device):
    """(input, output) tensors for one call; sizes follow the module docstring's S."""
    import torch

    count = nbytes // _ELEMENT
    full = torch.ones(count, device=device)
    part = torch.empty(count // n, device=device)
    if op == "all_gather":
        return part.fill_(1.0), full
    if op == "reduce_scatter":
        return full, part
    if op == "all_to_all":
        return full, torch.empty_like(full)
    return full, None


def _call(op: str, inp, out, group) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(inp, group=group)
    elif op == "broadcast":
        dist.broadcast(inp, src=0, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, inp, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp, group=group)
    else:
        dist.all_to_all_single(out, inp, group=group)


def _sync(device) -> None:
    from labkit.runtime import allocator

    allocator.synchronize(device)  # GPU path (unverified on hardware here): kernels run async on the stream


def time_collective(op: str, nbytes: int, *, group, device, warmup: int, iters: int) -> float:
    """Seconds per call on this rank, then the max over ranks (every rank gets the same number)."""
    import torch
    import torch.distributed as dist

    inp, out = _buffers(op, nbytes, dist.get_world_size(group), device)
    for _ in range(warmup):
        _call(op, inp, out, group)
    _sync(device)
    dist.barrier(group=group)  # start the timed loop together
    t0 = time.perf_counter()
    for _ in range(iters):
        _call(op, inp, out, group)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def run_rank(ops, sizes, *, warmup: int, iters: int) -> list[CommMeasurement]:
    """Every (op, size) on this rank, inside an initialized default process group."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    n, backend = dist.get_world_size(), dist.get_backend()
    return [measurement(op, size, time_collective(op, size, group=None, device=device, warmup=warmup, iters=iters),
                        n, backend) for op in ops for size in sizes]


def rehearse(nproc: int, sizes: list[int], ops: list[str], *, warmup: int, iters: int, out: str | Path) -> Path:
    """A rehearsal's `labkit bench comm` (labkit.runtime.rehearsal): rank 0 of the `nproc` ranks in this process
    over torch's fake process group, the sizes capped at REHEARSAL_MAX_BYTES; the file is written as on
    the node, its times are of collectives that send nothing (not measurements)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.train import stand_in

    with stand_in.rank_environment(0, nproc, {}):
        dist.init_process_group("fake", rank=0, world_size=nproc, store=FakeStore())
        try:
            rows = run_rank(ops, sorted({min(s, REHEARSAL_MAX_BYTES) for s in sizes}), warmup=warmup, iters=iters)
            return save(rows, out, warmup=warmup, iters=iters)
        finally:
            stand_in.teardown()


def save(rows: list[CommMeasurement], folder: str | Path, *, warmup: int, iters: int) -> Path:
    """Write `<folder>/comm_bench.json`: {"tool", "measured_at", "warmup", "iters", "measurements": [...]}."""
    path = Path(folder).expanduser() / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"tool": "labkit bench comm", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "warmup": warmup, "iters": iters, "measurements": [asdict(r) for r in rows]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def main(argv=None) -> None:
    """Rank program: `python -m labkit.profiling.commbench --sizes 1K,64K --out DIR` under torchrun."""
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m labkit.profiling.commbench")
    p.add_argument("--sizes", default=CPU_SIZES)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from labkit.runtime import device as devices

    # NCCL needs one GPU per local rank; fewer GPUs than ranks (or none) measure gloo on the CPU.
    gpu = len(devices.gpus()) >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    try:
        rows = run_rank(a.ops.split(","), parse_sizes(a.sizes, dist.get_world_size()), warmup=a.warmup,
                        iters=a.iters)
        if dist.get_rank() == 0:
            print(f"wrote {save(rows, a.out, warmup=a.warmup, iters=a.iters)}")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------ reading it back
def load(path: str | Path) -> list[CommMeasurement]:
    """The measurements in a comm_bench.json file (ConfigError naming the file when unreadable)."""
    path = Path(path).expanduser()
    try:
        rows = json.loads(path.read_text())["measurements"]
        return [CommMeasurement(**row) for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read collective measurements from {path}: {exc}; rerun "
                          "`labkit bench comm` or delete the file (format: labkit.profiling.commbench.save)") from None


def default_file() -> Path:
    """`comm_bench.json` in the results root ($LABKIT_RUNS, else runs/): where notebook 09 and `labkit bench
    comm` write it, and notebook 03 and the preflight read it."""
    from labkit.results import runs_root

    return Path(runs_root()) / FILE_NAME


def default_nproc(gpus: int) -> int:
    """Ranks to measure with on a machine with `gpus` CUDA devices: all of them (2 or more), else 2 CPU ranks."""
    return gpus if gpus >= 2 else 2


def default_sizes(on_gpus: bool) -> str:
    return GPU_SIZES if on_gpus else CPU_SIZES


@dataclass(frozen=True)
class MeasuredBandwidth:
    """The bus bandwidth to put into a ring cost model, and where it came from."""

    busbw: float
    """Bytes/s: the op's bus bandwidth at its largest measured size (nccl-tests read large sizes)."""
    op: str
    bytes: int
    world_size: int
    backend: str
    source: str


def load_measured_bandwidth(path: str | Path | None = None, *, op: str = "all_reduce",
                            backend: str | None = None) -> MeasuredBandwidth | None:
    """The measured bus bandwidth of `op` (optionally only from `backend`), or None when there is no
    measurement file (default `default_file()`) or it has no matching row. Notebook 03 uses it in its
    ring model in place of the assumed NVLink figure."""
    path = Path(path).expanduser() if path else default_file()
    if not path.exists():
        return None
    rows = [r for r in load(path) if r.op == op and (backend is None or r.backend == backend)]
    if not rows:
        return None
    best = max(rows, key=lambda r: r.bytes)
    short = (f"; its largest message, {best.bytes / 2**20:g} MiB, is below the bandwidth plateau: rerun "
             "`labkit bench comm` with its defaults (every GPU, up to 1 GiB)"
             if best.backend == "nccl" and best.bytes < PLATEAU_BYTES else "")
    return MeasuredBandwidth(best.busbw_gbps * 1e9, op, best.bytes, best.world_size, best.backend,
                             f"measured by labkit bench comm: {op} {best.bytes:,} B on {best.world_size} ranks "
                             f"({best.backend}), {path}{short}")


# ------------------------------------------------------------------------ showing it
def format_table(rows: list[CommMeasurement]) -> str:
    """nccl-tests-like text table."""
    if not rows:
        return "(no measurements)"
    lines = [f"# {rows[0].world_size} ranks, {rows[0].backend}; time = max over ranks; GB/s = 1e9 B/s",
             f"# {'op':<15}{'size (B)':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in rows:
        lines.append(f"  {r.op:<15}{r.bytes:>12,}{r.seconds * 1e6:>12.1f}{r.algbw_gbps:>12.3f}{r.busbw_gbps:>12.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
