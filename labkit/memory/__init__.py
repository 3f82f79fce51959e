"""Will it fit? Training memory per GPU from three sources of truth, one layout.

- `labkit.memory.estimate.estimate(MemoryConfig(...))`: formulas, pure Python, microseconds;
- `labkit.memory.dry_run.trace(cfg)`: one real step on fake tensors with torch's MemTracker;
- `labkit.memory.measure.measure(cfg)`: one real step on this device.
All three return an `Estimate` whose `to_json()` is the `labkit memory ... --json` layout.
The functions are not re-exported here so that `labkit.memory.estimate` & co. stay the modules.
Importing this package (or `labkit.memory.estimate`) does not import torch. Introduced in
notebook 01_memory.
"""
from labkit.memory.advice import single_changes, verdict, what_fits
from labkit.memory.estimate import Estimate, MemoryConfig, check_topology
from labkit.memory.params import ModelSpec, model_spec

__all__ = ["Estimate", "MemoryConfig", "ModelSpec", "check_topology", "model_spec", "single_changes",
           "verdict", "what_fits"]
