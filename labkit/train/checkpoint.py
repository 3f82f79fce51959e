"""Checkpoint / resume and the lease deadline.

Layout: `OUT/checkpoints/step_N/` holds the strategy's files (DCP shards + `.metadata` by default),
`rank_state_<r>.pt` (RNG, loss scaler) and `labkit.json` (step, losses so far, run settings). A
checkpoint is written into `.tmp-step_N/` and renamed to `step_N/` only after every rank finished,
so a run killed mid-save (SIGKILL, lease end) leaves no half checkpoint that `--resume` could pick;
the newest 2 complete ones are kept. Multi-node runs need OUT on a file system all nodes share.
Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import time
from pathlib import Path

from labkit.errors import ConfigError

KEEP = 2
META = "labkit.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
#: Settings that must match to resume (others, like steps or world size, may change); flat TrainConfig names.
RESUME_KEYS = ("model", "batch", "seed")


def checkpoint_root(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoints"


def complete_checkpoints(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under OUT/checkpoints, oldest first (a complete one has labkit.json)."""
    root = checkpoint_root(out)
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(out)
    return found[-1] if found else None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text(encoding="utf-8"))


def _barrier(ctx) -> None:
    if ctx.group is not None:
        import torch.distributed as dist
        dist.barrier(group=ctx.group)


class Checkpointer:
    """Saves and loads through the strategy hook, atomically, keeping the newest `KEEP`."""

    def __init__(self, out: str | os.PathLike, ctx, cfg):
        self.root, self.ctx, self.cfg = checkpoint_root(out), ctx, cfg
        self.save_times: list[float] = []

    def save(self, hook, step: int, losses: list[float]) -> Path:
        """Collective: every rank calls it at the same step."""
        t0 = time.perf_counter()
        tmp, final = self.root / f".tmp-step_{step}", self.root / f"step_{step}"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left over by a killed run
            tmp.mkdir(parents=True)
        _barrier(self.ctx)
        hook.save_checkpoint(tmp)
        _barrier(self.ctx)
        if self.ctx.is_main:
            meta = {"step": step, "losses": losses, "world_size": self.ctx.world_size, "strategy": self.cfg.run.strategy,
                    "saved_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                    **{k: self.cfg.flat()[k] for k in RESUME_KEYS}}
            (tmp / META).write_text(json.dumps(meta), encoding="utf-8")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # the commit point: step_N appears complete or not at all
            for old in complete_checkpoints(self.root.parent)[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier(self.ctx)
        self.save_times.append(time.perf_counter() - t0)
        return final

    def clean_stale(self) -> None:
        """Remove half-written `.tmp-step_N` folders of a killed run (rank 0, before any save)."""
        if self.ctx.is_main and self.root.is_dir():
            for tmp in self.root.glob(".tmp-step_*"):
                shutil.rmtree(tmp, ignore_errors=True)

    def check_fresh(self) -> None:
        """A new (not resumed) run must not mix its checkpoints with an earlier run's."""
        found = latest_checkpoint(self.root.parent)
        if found is not None:
            raise ConfigError(f"{found} is from an earlier run; pass --resume to continue it, "
                              f"or choose another --out (labkit never overwrites earlier results)")

    def load(self, hook, path: Path) -> dict:
        """Load `path` into the hook's model/optimizer; returns its metadata (step, losses)."""
        meta = read_meta(path)
        for key in RESUME_KEYS:
            if meta.get(key) != self.cfg.flat()[key]:
                raise ConfigError(f"cannot resume {path}: it was saved with {key}={meta.get(key)!r} but this run has "
                                  f"{key}={self.cfg.flat()[key]!r}; use the same --{key} or another --out")
        hook.load_checkpoint(path)
        return meta


class Deadline:
    """Stop cleanly, with a checkpoint, a safety margin before `when` (e.g. the end of a GPU lease)."""

    def __init__(self, when: _dt.datetime | None, margin_s: float | None = None):
        self.when, self.explicit_margin = when, margin_s
        self.slowest_save = 0.0

    @property
    def margin_s(self) -> float:
        """Explicit margin, else max(60 s, 2 x the slowest checkpoint save so far)."""
        if self.explicit_margin is not None:
            return self.explicit_margin
        return max(60.0, 2.0 * self.slowest_save)

    def remaining_s(self) -> float:
        return (self.when - _dt.datetime.now(_dt.timezone.utc)).total_seconds()

    def check_start(self) -> None:
        """ConfigError if the deadline is past, or closer than the margin: nothing useful could run."""
        if self.when is None:
            return
        left = self.remaining_s()
        if left <= self.margin_s:
            state = "has passed" if left <= 0 else f"is only {left:.0f} s away"
            raise ConfigError(f"deadline {self.when.isoformat()} {state}, within the {self.margin_s:.0f} s safety "
                              "margin for the final checkpoint; give a later --deadline (your lease end) or extend the lease")

    def should_stop(self, next_step_s: float) -> bool:
        """True when one more step would end inside the safety margin."""
        return self.when is not None and self.remaining_s() <= next_step_s + self.margin_s
