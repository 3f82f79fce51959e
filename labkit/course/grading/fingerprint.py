"""Tamper-evidence seals on results recorded in notebooks (`labkit.results.show` / `answer`).

Each payload published under `application/vnd.labkit+json` carries a `fingerprint`:

    {"v": 1, "cell_sha256": sha256 of the producing cell's source (None outside IPython),
     "execution_count": the cell's In[n], "env": {device, device_count, world_size, versions},
     "time": UTC ISO time, "nonce": 16 random hex digits, "digest": sha256 over all of it}

The digest covers (payload, printed text, cell hash, execution count, env, time, nonce), so a hand-edited
value, a payload pasted into another cell, or a cell edited after it ran no longer matches. It is a seal,
not cryptographic proof: the salt is in this open source file, so a student who reads it can forge a
seal (docs/grading.md says what this does and does not prevent).
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

SEAL_VERSION = 1
_SALT = b"labkit-seal-v1:"


def normalize_source(source: str) -> str:
    """Cell source as hashed: newlines unified, trailing spaces and surrounding blank lines dropped.

    IPython's history strips trailing newlines of the cell it stores, so both sides normalize the same way.
    """
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def cell_sha256(source: str) -> str:
    return hashlib.sha256(normalize_source(source).encode("utf-8")).hexdigest()


def jsonable(value: Any) -> Any:
    """`value` as the JSON data a notebook will store: what Jupyter's message serializer makes of it.

    jupyter_client turns NaN/inf into the strings 'nan'/'inf' (json_clean); doing it here first means the
    digest is computed over exactly the data that lands in the .ipynb.
    """
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def current_cell() -> tuple[str | None, int | None]:
    """(source, execution count) of the IPython cell running now, or (None, None) outside IPython."""
    if "IPython" not in sys.modules:
        return None, None
    from IPython import get_ipython

    shell = get_ipython()
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if not history:
        return None, None
    # input_hist_raw[0] is '' and entry n is In[n]; the running cell is stored before it executes.
    return history[-1], len(history) - 1


def _nvidia_models() -> list[str]:
    models = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                models.append(line.split(":", 1)[1].strip())
    return models


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.machine()


def device() -> tuple[str, int]:
    """(name, count) of the accelerators this kernel sees, without initializing CUDA ('cpu: <model>', 0)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.get_device_name(torch.cuda.current_device()), torch.cuda.device_count()
    except Exception:  # a broken CUDA install must not break the student's cell
        pass
    models = _nvidia_models()
    if models:
        return models[0], len(models)
    return f"cpu: {_cpu_model()}", 0


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str], ...]:
    from labkit.results import versions
    return tuple(sorted(versions().items()))


def environment(world_size: int = 1) -> dict[str, Any]:
    """The environment part of a seal: device name and count, world size, stack versions."""
    from labkit.runtime import rehearsal

    name, count = device()
    env = {"device": name, "device_count": count, "world_size": int(world_size), "versions": dict(_versions())}
    if rehearsal.active():  # a rehearsal's results are never graded (labkit.course.grading.tamper.rehearsed)
        env["rehearsal"] = True
    return env


def _digest(body: dict[str, Any], text: str | None, fp: dict[str, Any]) -> str:
    material = {"payload": body, "text": text, **{k: v for k, v in fp.items() if k != "digest"}}
    return hashlib.sha256(_SALT + canonical(material).encode("utf-8")).hexdigest()


def _world_size(payload: dict[str, Any]) -> int:
    record = payload.get("record")
    if isinstance(record, dict) and isinstance(record.get("world_size"), int):
        return record["world_size"]
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def seal(payload: dict[str, Any], text: str | None, *, cell: tuple[str, int] | None = None) -> dict[str, Any]:
    """`payload` (made JSON-clean) plus its `fingerprint`; `cell` overrides the IPython cell (tests)."""
    body = jsonable({k: v for k, v in payload.items() if k != "fingerprint"})
    source, count = cell if cell is not None else current_cell()
    fp = {"v": SEAL_VERSION, "cell_sha256": None if source is None else cell_sha256(source),
          "execution_count": count, "env": environment(_world_size(body)),
          "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
          "nonce": secrets.token_hex(8)}
    fp["digest"] = _digest(body, text, fp)
    return {**body, "fingerprint": fp}


def seal_problem(payload: dict[str, Any], text: str | None) -> str | None:
    """Why `payload`'s seal does not hold (missing, malformed, digest mismatch), or None if it holds."""
    fp = payload.get("fingerprint")
    if not isinstance(fp, dict):
        return "has no labkit seal (added by hand, not by labkit.results)"
    if fp.get("v") != SEAL_VERSION or not isinstance(fp.get("digest"), str):
        return f"has a malformed seal (version {fp.get('v')!r})"
    body = {k: v for k, v in payload.items() if k != "fingerprint"}
    try:
        expected = _digest(jsonable(body), text, fp)
    except (TypeError, ValueError) as exc:
        return f"has a seal over data that is not JSON ({exc})"
    if expected != fp["digest"]:
        return "was edited after it was recorded (payload or printed text no longer matches its seal)"
    return None
