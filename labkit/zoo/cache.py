"""labkit's own cache folder: measured facts of this machine and decoded data, kept between runs.

One place decides where it is, so every writer and reader agree (and tests point it at a temporary
folder): `LABKIT_CACHE`, else `$XDG_CACHE_HOME/labkit`, else `~/.cache/labkit`. It holds the
Food-11 tensor cache (`labkit.train.imagecache`). Measurements of a node are not kept here: the comm
benchmark lives beside the runs (`labkit.results.runs_root`), the preflight's in its own --out folder.
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
