"""Build DeepSpeed's CPU ops before their first use: `python -m labkit.parallel.ds_ops` (run by `make venv`
on a machine without an NVIDIA GPU).

DeepSpeed compiles its C++ ops the first time a run needs them: `deepspeed_shm_comm` at every CPU
run's `deepspeed.initialize` (its collectives), `cpu_adam` for ZeRO-Offload's DeepSpeedCPUAdam. On 2
cores that is minutes, paid by the first DeepSpeed run of a notebook (or test) while every other
DeepSpeed process waits on the build's lock file. Built here once, into TORCH_EXTENSIONS_DIR (the
Makefile keeps it in build/torch_extensions), with the very builders and flags the runtime uses, so a
run finds them and loads them in a second (torch's JIT loader rebuilds only when sources or flags change).

On a GPU node nothing is built here: DeepSpeed's CUDA accelerator builds its own ops on first use
(needs nvcc; unverified on hardware), and CPU builds would be the wrong ones.
"""
from __future__ import annotations

import os
import sys

#: The CPU accelerator's builders the course's runs load (DeepSpeed's names).
OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def build(ops: tuple[str, ...] = OPS) -> list[str]:
    """Build (or find already built) each op of `ops` for DeepSpeed's CPU accelerator; their names."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # labkit's import already quietened third-party noise
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from labkit.errors import ConfigError

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        raise ConfigError(f"DeepSpeed chose accelerator {accelerator.device_name()!r}: its CPU ops are built with "
                          "DS_ACCELERATOR=cpu (unset it, or set it to cpu)")
    built = []
    for name in ops:
        builder = accelerator.create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue  # this DeepSpeed or machine has no such op: the runtime skips it the same way
        builder.load(verbose=False)
        built.append(builder.NAME)
    return built


def has_nvidia_gpu() -> bool:
    from labkit.runtime import cudadriver

    return bool(cudadriver.nvidia_smi())


def main() -> int:
    if has_nvidia_gpu():
        print("DeepSpeed ops: GPU node, DeepSpeed builds its CUDA ops on first use (nothing built now)")
        return 0
    from labkit.errors import LabkitError

    try:
        names = build()
    except LabkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = os.environ.get("TORCH_EXTENSIONS_DIR", "torch's default extensions folder")
    print(f"DeepSpeed CPU ops ready in {where}: {', '.join(names) or 'none this DeepSpeed builds'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
