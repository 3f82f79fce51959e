"""What does a warm (forked) notebook kernel save? Prints CPU seconds per kernel, cold and warm, and their ratio.

A one-cell notebook that imports what every lab kernel imports (torch, transformers' Llama, matplotlib)
runs `--kernels` times with cold kernels (LABKIT_WARM_KERNELS=0: `python -m ipykernel_launcher` each time)
and `--kernels` times with warm ones (forked from warmstart.warm_kernels' zygote), alternating, in one
run. CPU seconds are the kernels' (and, for warm, the zygote's one-off imports, shown apart), measured as
this process's reaped children plus what the zygote reports; wall seconds are printed too.

    python bench/warm_kernels.py [--kernels 3]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

CELL = "import torch, transformers.models.llama.modeling_llama, matplotlib.pyplot\nprint(torch.__version__)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    import warmstart

    warmstart.install()  # the test suite's warm starts, through labkit's one seam (labkit.runtime.hooks)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MPLBACKEND", "Agg")
    import nbformat

    from labkit.course import notebooks as nbk
    from warmstart import warm_kernels

    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        work = Path(tmp)
        path = work / "probe.ipynb"
        nbformat.write(nbk.build_notebook("probe", [CELL]), path)

        def once(mode: str, name: str) -> tuple[float, float]:
            """(CPU s, wall s) of one kernel: run_notebook counts a warm kernel's CPU as its zygote reports it."""
            os.environ[warm_kernels.SWITCH_ENV] = "1" if mode == "warm" else "0"
            run = nbk.run_notebook(path, out_dir=work / name)
            if not run.ok:
                sys.exit(f"{mode} kernel failed: {run.describe()}")
            return run.cpu_seconds, run.seconds

        _, first_wall = once("warm", "first")  # starts the zygote: its imports are counted when it is reaped
        rows = {"cold": [], "warm": []}
        for i in range(args.kernels):  # alternating, so a change in the machine's load hits both
            for mode in ("cold", "warm"):
                rows[mode].append(once(mode, f"{mode}-{i}"))
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        warm_kernels.shutdown()  # reaps the zygote: its own CPU is the difference
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        zygote = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    for mode, runs in rows.items():
        print(f"{mode}: CPU s per kernel {[round(c, 1) for c, _ in runs]}, wall s {[round(w, 1) for _, w in runs]}")
    print(f"zygote: {zygote:.1f} CPU s of imports, once per environment (first warm kernel, zygote start "
          f"included: {first_wall:.1f} s wall)")
    cold, warm = (sum(c for c, _ in rows[m]) / args.kernels for m in ("cold", "warm"))
    print(f"warm / cold CPU s per kernel: {warm / cold:.2f} ({warm:.1f} / {cold:.1f}); "
          f"break-even after {zygote / max(cold - warm, 1e-9):.1f} kernels per environment")


if __name__ == "__main__":
    main()
