"""Hugging Face model and data set ids through the standard HF cache (no network at training time).

`--model TinyLlama/TinyLlama-1.1B-Chat-v1.0` names a Hub repository. labkit never downloads inside a
training run: `labkit fetch ID` puts the repository into the cache first (`huggingface_hub.
snapshot_download`, with a progress bar, before the lease clock matters), and every later use reads
the cached snapshot folder -- the same `from_pretrained(folder)` call a local checkpoint gets. The
cache is the standard one, found from the environment at call time:

- `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; layout
  `models--ORG--NAME/{refs/main, snapshots/<commit>/...}` (datasets: `datasets--ORG--NAME`);
- `HF_HUB_OFFLINE=1`: never touch the network (what the tests and a firewalled node use);
- `HF_TOKEN`: the token for gated models (Llama-2: accept the license on the model's page first).

Introduced in notebook 00_setup (what is cached) and 06_peft (a pretrained base).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from labkit.errors import ConfigError

#: ORG/NAME as the Hub spells repository ids (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
#: Files that hold a checkpoint's weights (a snapshot with config.json only cannot be trained).
WEIGHT_GLOBS = ("*.safetensors", "*.bin")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(name: str) -> bool:
    """True for 'ORG/NAME' that is not an existing local path (a local folder always wins)."""
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and not Path(name).exists()


def cache_dir() -> Path:
    """The hub cache folder, read from the environment now (huggingface_hub reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: the network must not be used."""
    return any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot folder of `repo_id` (refs/main), or None when it is not in the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def has_weights(folder: Path) -> bool:
    return any(next(folder.glob(g), None) is not None for g in WEIGHT_GLOBS)


class NotCachedError(ConfigError):
    """A model or data set is not in the cache: `labkit fetch` it first (one line, exit 2 from the CLI)."""


def not_cached(repo_id: str, what: str = "model") -> NotCachedError:
    """The one-line error for a repository that must be fetched first."""
    where = f"the Hugging Face cache {cache_dir()}" + (" (HF_HUB_OFFLINE=1)" if offline() else "")
    where += " nor a local folder" if what == "model" else ""
    return NotCachedError(f"{what} {repo_id!r} is not in {where}: run `labkit fetch {repo_id}` "
                          "on a machine with network access first (or set HF_HOME to a cache that holds it)")


def offline_refusal(repo_id: str, what: str = "model") -> ConfigError:
    """`labkit fetch` under HF_HUB_OFFLINE=1 for something not cached."""
    return ConfigError(f"{what} {repo_id!r} is not in the Hugging Face cache {cache_dir()} and HF_HUB_OFFLINE=1 "
                       f"forbids downloading it: run `HF_HUB_OFFLINE=0 labkit fetch {repo_id}` on a machine with "
                       "network access")


def resolve(repo_id: str, *, weights: bool = True) -> Path:
    """The local snapshot folder of model `repo_id`; `weights=False` needs only its config.json.

    Online, a missing config.json is downloaded (a few KB: what `labkit memory estimate` needs);
    weights are never downloaded here -- that is `labkit fetch`'s job, before a run starts.
    """
    snap = cached_snapshot(repo_id)
    if snap is not None and (snap / "config.json").is_file() and (not weights or has_weights(snap)):
        return snap
    if not weights and not offline():
        return Path(download_file(repo_id, "config.json")).parent
    raise not_cached(repo_id)


def download_file(repo_id: str, filename: str, repo_type: str = "model") -> str:
    """One file of a repository into the cache (online); Hub errors become one-line ConfigErrors."""
    from huggingface_hub import hf_hub_download

    with hub_errors(repo_id):
        return hf_hub_download(repo_id, filename, repo_type=repo_type, cache_dir=cache_dir())


class hub_errors:
    """Context turning huggingface_hub's errors into a ConfigError that names the fix."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        from huggingface_hub import errors

        if exc is None or not isinstance(exc, Exception):
            return False
        rid = self.repo_id
        if isinstance(exc, errors.GatedRepoError):
            raise ConfigError(f"{rid!r} is gated: accept its license on https://huggingface.co/{rid} and set "
                              "HF_TOKEN to a token of that account") from exc
        if isinstance(exc, errors.RepositoryNotFoundError):
            raise ConfigError(f"no repository {rid!r} on the Hugging Face Hub (or it is private: set HF_TOKEN); "
                              "check the spelling ORG/NAME") from exc
        if isinstance(exc, errors.LocalEntryNotFoundError):
            raise not_cached(rid) from exc
        if isinstance(exc, (errors.HfHubHTTPError, OSError)):
            raise ConfigError(f"could not download {rid!r} ({str(exc).splitlines()[0][:160]}); "
                              "check the network, or HF_HUB_OFFLINE=1 with a filled cache") from exc
        return False
