"""Latency of `labkit.memory.estimate` (the issue's goal: well under 1 ms a call, no torch import).

Run: .venv/bin/python bench/memory_estimate.py  (prints microseconds per call for a few setups).
"""
from __future__ import annotations

import sys
import time

from labkit.memory.estimate import MemoryConfig, estimate

SETUPS = {
    "llama2-7b full FT": MemoryConfig(model="llama2-7b"),
    "llama2-7b QLoRA + activations": MemoryConfig(model="llama2-7b", lora_rank=8, quant="nf4-dq", batch=4,
                                                  seq=1024, checkpointing="full"),
    "gpt3-175b 3-D parallel": MemoryConfig(model="gpt3-175b", tp=8, pp=8, gpus=64, batch=8, grad_accum=8,
                                           checkpointing="selective", sequence_parallel=True),
    "resnet50 ZeRO-2 x4": MemoryConfig(model="resnet50", zero=2, dp=4, batch=64),
    "params only": MemoryConfig(params=7_500_000_000, zero=3, dp=64),
}


def per_call_us(cfg: MemoryConfig, calls: int = 2000) -> float:
    estimate(cfg)  # warm the spec cache
    start = time.perf_counter()
    for _ in range(calls):
        estimate(cfg)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    worst = 0.0
    for name, cfg in SETUPS.items():
        us = per_call_us(cfg)
        worst = max(worst, us)
        print(f"{name:<32}{us:10.1f} us/call")
    print(f"torch imported: {'torch' in sys.modules}")
    print(f"worst {worst:.1f} us/call (goal < 1000 us)")
    return 0 if worst < 1000 and "torch" not in sys.modules else 1


if __name__ == "__main__":
    sys.exit(main())
