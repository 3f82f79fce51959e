"""What do warm torchrun and ranks save? CPU and wall seconds per 2-rank launch, cold and warm, and their ratio.

A 2-rank gloo job that imports what labkit's ranks import (torch.distributed, transformers' Llama) and
all-reduces once runs `--launches` times cold (torchrun and both ranks fresh interpreters, as for a student)
and `--launches` times warm (forked from warmstart.rank_zygote's zygote, as in `make test`), alternating, in one
run. CPU seconds: this process's reaped children (torchrun, ranks, or their shims) plus, warm, what the
zygotes used meanwhile (their own and their reaped forks'); the zygote's one-off imports are shown apart.

    python bench/warm_ranks.py [--launches 3]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

JOB = textwrap.dedent("""
    import torch, torch.distributed as dist, transformers.models.llama.modeling_llama
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"sum={t.item():.0f}")
    dist.destroy_process_group()
""")


def reaped() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def zygotes_cpu(manager) -> float:
    import psutil

    total = 0.0
    for z in psutil.Process(manager.pid).children():
        t = z.cpu_times()
        total += t.user + t.system + t.children_user + t.children_system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    import warmstart

    warmstart.install()  # the test suite's warm starts, through labkit's one seam (labkit.runtime.hooks)
    from labkit.runtime import launch
    from warmstart import rank_zygote

    folder = Path(tempfile.mkdtemp(prefix="labkit-bench-ranks-"))
    (folder / "bench_rank_job.py").write_text(JOB)
    env = {"PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": "1"}
    manager = rank_zygote.start_manager(str(folder / "manager.sock"))
    results: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    zygote_start = None
    try:
        for i in range(args.launches + 1):  # launch 0 of warm starts the zygote: reported apart
            for kind in ("cold", "warm"):
                run_env = dict(env, **({rank_zygote.SWITCH_ENV: str(folder / "manager.sock")} if kind == "warm"
                                       else {rank_zygote.SWITCH_ENV: ""}))
                cpu0, z0, t0 = reaped(), zygotes_cpu(manager), time.monotonic()
                out = launch.run("bench_rank_job", [], nproc=2, env=run_env, stream=False, timeout_s=600).output
                assert "sum=2" in out, out
                cpu, wall = reaped() - cpu0 + zygotes_cpu(manager) - z0, time.monotonic() - t0
                if kind == "warm" and i == 0:
                    zygote_start = (cpu, wall)
                elif i > 0 or kind == "cold":
                    results[kind].append((cpu, wall))
    finally:
        rank_zygote.stop_manager(manager)
        shutil.rmtree(folder, ignore_errors=True)
    cold, warm = results["cold"][1:], results["warm"]  # the first cold launch warmed the page cache
    print(f"cold: CPU s per launch {[round(c, 1) for c, _ in cold]}, wall s {[round(w, 1) for _, w in cold]}")
    print(f"warm: CPU s per launch {[round(c, 1) for c, _ in warm]}, wall s {[round(w, 1) for _, w in warm]}")
    print(f"zygote: first warm launch (zygote imports included) {zygote_start[0]:.1f} CPU s, {zygote_start[1]:.1f} s wall")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    c_cpu, w_cpu = mean([c for c, _ in cold]), mean([c for c, _ in warm])
    c_wall, w_wall = mean([w for _, w in cold]), mean([w for _, w in warm])
    print(f"warm / cold per launch: CPU {w_cpu / c_cpu:.2f} ({w_cpu:.1f} / {c_cpu:.1f}), wall {w_wall / c_wall:.2f} "
          f"({w_wall:.1f} / {c_wall:.1f})")


if __name__ == "__main__":
    sys.exit(main())
