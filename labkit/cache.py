"""labkit's own cache folder: measured facts of this machine and decoded data, kept between runs.

One place decides where it is, so every writer and reader agree (and tests point it at a temporary
folder): `LABKIT_CACHE`, else `$XDG_CACHE_HOME/labkit`, else `~/.cache/labkit`. It holds the
Food-11 tensor cache (`labkit.train.imagecache`), `comm_bench.json` (`labkit bench comm`) and
`matmul_efficiency.json` (`labkit preflight`; the planner reads it only when passed `--measured`).
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LABKIT_CACHE"


def cache_root() -> Path:
    """LABKIT_CACHE, else $XDG_CACHE_HOME/labkit, else ~/.cache/labkit (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "labkit"
