"""`labkit fetch MODEL|food11|dolly`: put what a lab needs on the node before the lease clock matters.

Downloads go to the standard caches (`labkit.zoo.hub`: the HF cache; Food-11: `labkit.zoo.food11`), so runs
never download: they read the cache, offline if HF_HUB_OFFLINE=1. `status(profile)` says what a
profile's labs use and whether it is here (notebook 00_setup); `pretrained_llm`, `image_data` and
`text_data` pick the real thing when it is cached and the stand-in (random init, synthetic or the
shipped tiny set) otherwise, printing one line that says which. Introduced in notebook 00_setup.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from labkit.zoo import food11, hub
from labkit.errors import ConfigError

#: Pretrained weights of a preset architecture on the Hub (GPU profiles fine-tune these in 06 and 08).
PRETRAINED = {"llama-160m": "JackFram/llama-160m", "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "llama2-7b": "meta-llama/Llama-2-7b-hf"}
#: What `labkit fetch` downloads of a preset's pretrained weights, in GB (safetensors in fp16: 2 bytes x
#: 6.74 B parameters for Llama-2-7B), for the line that says how to get them.
DOWNLOAD_GB = {"llama2-7b": 13.5}


@dataclass(frozen=True)
class TextSet:
    """An instruction data set stored as one JSON-lines file in a Hub dataset repository."""

    repo: str
    file: str
    fields: tuple[str, ...]
    """Keys of one record, joined in this order into one training text."""


#: Text data sets for fine-tuning (06, 08): name -> where it is. Dolly: 15k human-written instructions
#: (Databricks 2023, CC BY-SA 3.0), 13 MB.
TEXT_SETS = {"dolly": TextSet("databricks/databricks-dolly-15k", "databricks-dolly-15k.jsonl",
                              ("instruction", "context", "response"))}
#: Files a training run needs from a model repository (not the duplicate .bin / original/ weights).
MODEL_FILES = ["*.json", "*.model", "*.txt", "*.safetensors", "tokenizer*"]


@dataclass(frozen=True)
class Item:
    """One thing a profile's labs use: what, for which labs, and whether it is on this machine."""

    name: str
    labs: str
    present: bool
    where: str
    fetch: str
    """The command that fetches it ('' when nothing needs fetching)."""


# ------------------------------------------------------------------------------------------ fetching
def fetch(target: str, *, dest: str | None = None) -> tuple[str, str]:
    """Fetch a model id, 'food11' or a text set name; returns (where it is, what happened)."""
    if target == "food11":
        path, what = food11.fetch(dest)
        return str(path), what
    if target in TEXT_SETS:
        return str(fetch_text(target)), "cached"
    if target in PRETRAINED:
        target = PRETRAINED[target]
    if hub.is_hub_id(target):
        return fetch_model(target)
    raise ConfigError(f"cannot fetch {target!r}: give a Hugging Face model id ORG/NAME (e.g. "
                      f"{PRETRAINED['tinyllama-1.1b']}), a preset with pretrained weights "
                      f"({', '.join(PRETRAINED)}), food11 or {', '.join(TEXT_SETS)}")


def fetch_model(repo_id: str) -> tuple[str, str]:
    """`snapshot_download` of a model's config, tokenizer and weights (progress bars from huggingface_hub)."""
    cached = hub.cached_snapshot(repo_id)
    if cached is not None and hub.has_weights(cached):
        return str(cached), "already cached"
    if hub.offline():
        raise hub.offline_refusal(repo_id)
    from huggingface_hub import snapshot_download

    # Unverified here (no network in CI): the call and its patterns follow huggingface_hub's docs.
    # Repositories with both formats (Llama-2-7b-hf) would double the download with *.bin: safetensors
    # only, unless the repository has no safetensors at all.
    with hub.hub_errors(repo_id):
        path = snapshot_download(repo_id, cache_dir=hub.cache_dir(), allow_patterns=MODEL_FILES)
        if not hub.has_weights(Path(path)):
            path = snapshot_download(repo_id, cache_dir=hub.cache_dir(), allow_patterns=MODEL_FILES + ["*.bin"])
    return str(path), "downloaded"


def cached_text(name: str) -> Path | None:
    """The cached JSON-lines file of text set `name`, or None."""
    snap = hub.cached_snapshot(TEXT_SETS[name].repo, repo_type="dataset")
    file = snap / TEXT_SETS[name].file if snap is not None else None
    return file if file is not None and file.is_file() else None


def fetch_text(name: str) -> Path:
    found = cached_text(name)
    if found is not None:
        return found
    if hub.offline():
        raise hub.offline_refusal(name, "data set")
    return Path(hub.download_file(TEXT_SETS[name].repo, TEXT_SETS[name].file, repo_type="dataset"))


def text_path(name: str) -> Path:
    """The local file of text set `name` for training; ConfigError naming `labkit fetch NAME` if absent."""
    found = cached_text(name)
    if found is None:
        raise hub.not_cached(name, "data set")
    return found


def jsonl_text(path: Path, fields: tuple[str, ...] = TEXT_SETS["dolly"].fields) -> str:
    """One training text from an instruction JSON-lines file: '### Instruction: ... ### Response: ...'."""
    parts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            parts.append("\n".join(f"### {k.capitalize()}:\n{record[k]}" for k in fields if record.get(k)))
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------ choosing
def pretrained_llm(profile, *presets: str, fallback: str | None = "") -> str | None:
    """On a GPU profile, the HF id of the first of `presets` (default: the profile's LLM) whose pretrained
    weights are cached; otherwise `fallback` (default: the profile's LLM preset, random init). Prints one
    line saying which, so a lab never fine-tunes random weights without saying so."""
    presets = presets or (profile.llm_model,)
    fallback = profile.llm_model if fallback == "" else fallback
    repos = [PRETRAINED[p] for p in presets if p in PRETRAINED]
    for repo in repos if profile.device == "cuda" else ():
        if _model_cached(repo):
            print(f"model: {repo} (pretrained weights from the Hugging Face cache)")
            return repo
    if profile.device == "cpu":
        why = ": the smoke profile trains a tiny preset"
    else:
        why = f": `labkit fetch {repos[0]}` has not been run" if repos else ""
    print(f"model: {profile.llm_model if fallback is None else fallback} (random init{why})")
    return fallback


def cached_pretrained(profile, preset: str) -> str | None:
    """On a GPU profile, the HF id of `preset`'s pretrained weights when they are cached (one line says so,
    as `pretrained_llm` does); else None, after one line saying how to get them (the download's size, and
    that a free Colab runtime's disk holds it). 06 fine-tunes Llama-2-7B on a 16 GB T4 this way."""
    repo = PRETRAINED[preset]
    if profile.device == "cuda" and _model_cached(repo):
        return pretrained_llm(profile, preset)
    size = f" (a ~{DOWNLOAD_GB[preset]:g} GB download; Colab's disk holds it)" if preset in DOWNLOAD_GB else ""
    print(f"{repo} is not cached: run `labkit fetch {repo}`{size}, then this cell again")
    return None


def image_data(profile) -> str:
    """'food11' on GPU profiles when it is here (`labkit fetch food11`), else 'synthetic'; says which.
    Lever timing in 02 compares best on synthetic images (no I/O at all); the line printed says which."""
    root = food11.default_dir()
    if profile.device == "cuda" and food11.is_ready(root):
        print(f"data: Food-11 from {root} (real photos, decoded once into a tensor cache)")
        return "food11"
    why = "the smoke profile" if profile.device == "cpu" else f"Food-11 is not in {root}: `labkit fetch food11`"
    print(f"data: synthetic images ({why})")
    return "synthetic"


def text_data(profile, name: str = "dolly") -> str:
    """A real instruction set on GPU profiles when cached, else 'tiny' (shipped with labkit); says which."""
    if profile.device == "cuda" and cached_text(name) is not None:
        print(f"data: {name} ({TEXT_SETS[name].repo}), last 10 % held out")
        return name
    why = "the smoke profile" if profile.device == "cpu" else f"`labkit fetch {name}` has not been run"
    print(f"data: tiny (labkit/data/tiny_corpus.txt, last 10 % held out; {why})")
    return "tiny"


def _model_cached(repo: str) -> bool:
    snap = hub.cached_snapshot(repo)
    return snap is not None and hub.has_weights(snap)


# ------------------------------------------------------------------------------------------ status
def status(profile) -> list[Item]:
    """What `profile`'s labs use and whether each is on this machine (the table of notebook 00)."""
    if profile.device == "cpu":
        shipped = str(Path(__file__).resolve().parents[1] / "data")
        return [Item(f"{profile.llm_model}, {profile.vision_model}", "all", True, "built from presets", ""),
                Item("tiny text and images", "02-08", True, shipped, "")]
    items = []
    for preset, labs in ((profile.llm_model, "06, 08"), ("llama2-7b", "06")):
        repo = PRETRAINED.get(preset)
        if repo:
            snap = hub.cached_snapshot(repo)
            ok = snap is not None and hub.has_weights(snap)
            items.append(Item(repo, labs, ok, str(snap) if ok else str(hub.cache_dir()), f"labkit fetch {repo}"))
    for name in TEXT_SETS:
        found = cached_text(name)
        items.append(Item(f"{name} ({TEXT_SETS[name].repo})", "06, 08", found is not None,
                          str(found or hub.cache_dir()), f"labkit fetch {name}"))
    root = food11.default_dir()
    items.append(Item("Food-11", "02, 03", food11.is_ready(root), str(root), "labkit fetch food11"))
    return items


def format_status(items: list[Item]) -> str:
    """One line per item: present or missing, for which labs, where, and the command that fetches it."""
    width = max(len(i.name) for i in items)
    lines = [f"{'':<8} {'what':<{width}}  {'labs':<6}  where / how"]
    for i in items:
        how = i.where if i.present else f"{i.fetch}  (looked in {i.where})"
        lines.append(f"{'cached' if i.present else 'MISSING':<8} {i.name:<{width}}  {i.labs:<6}  {how}")
    return "\n".join(lines)


def table(profile) -> str:
    """`format_status(status(profile))`."""
    return format_status(status(profile))
