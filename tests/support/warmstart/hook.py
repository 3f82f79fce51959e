"""What tests/conftest.py installs as labkit's test hook (labkit.runtime.hooks says what each function is for).

Warm torchrun and ranks while LABKIT_RANK_ZYGOTE names a running manager (rank_zygote), warm notebook kernels
while LABKIT_WARM_KERNELS=1 (warm_kernels); otherwise every answer is labkit's cold one.
"""
from __future__ import annotations

from warmstart import rank_zygote, warm_kernels

process_tree = rank_zygote.process_tree
reaped_cpu = warm_kernels.reaped_cpu


def torchrun_command(cmd: list[str], env=None) -> list[str]:
    return rank_zygote.warm_command(cmd, env)


def run_rank(argv: list[str]) -> None:
    code = rank_zygote.delegate(argv)
    if code is not None:
        rank_zygote.exit_like(code)


def kernel_manager_class():
    return warm_kernels.manager_class() if warm_kernels.enabled() else None
