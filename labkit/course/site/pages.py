"""The site's generated pages (MyST markdown): the landing page, the glossary, the slides page, and the
header each lab page gets; links to repository files rewritten. Pure text in, text out (no build here).
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import yaml

from labkit.errors import ConfigError

# ---- data -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    term: str
    definition: str
    match: tuple[str, ...]


@dataclass(frozen=True)
class LabInfo:
    name: str
    """Notebook stem, e.g. '03_ddp'."""
    title: str
    learn: str
    gpus: int
    t4x1: str | None
    t4x2: str | None


@dataclass(frozen=True)
class SiteConfig:
    title: str
    repository: str
    branch: str
    release_dir: str

    def notebook_url(self, lab: str) -> str:
        return f"{self.repository}/blob/{self.branch}/{self.release_dir}/{lab}.ipynb"

    @property
    def blob_url(self) -> str:
        """Where the site links a repository file it has no page for (the course's main branch)."""
        return f"{self.repository}/blob/main"

    def colab_url(self, lab: str) -> str:
        return "https://colab.research.google.com/github/" + self.notebook_url(lab).split("github.com/", 1)[1]

    def kaggle_url(self, lab: str) -> str:
        return "https://www.kaggle.com/kernels/welcome?src=" + quote(self.notebook_url(lab), safe=":/")


def load_config(path: Path, repository: str | None = None) -> SiteConfig:
    data = yaml.safe_load(path.read_text())
    repo = (repository or data["repository"]).rstrip("/")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo):
        raise ConfigError(f"site repository {repo!r} is not https://github.com/OWNER/NAME: Colab opens notebooks "
                          f"from GitHub only; set `repository` in {path} or pass --repo")
    return SiteConfig(data["title"], repo, str(data["branch"]), str(data["release_dir"]).strip("/"))


def load_glossary(path: Path) -> tuple[Term, ...]:
    terms = []
    for i, entry in enumerate(yaml.safe_load(path.read_text())):
        if not isinstance(entry, dict) or not {"term", "definition"} <= set(entry):
            raise ConfigError(f"{path}: entry {i + 1} needs `term:` and `definition:`")
        terms.append(Term(entry["term"], " ".join(entry["definition"].split()),
                          tuple(entry.get("match") or [entry["term"]])))
    return tuple(terms)


def load_labs(path: Path, titles: dict[str, str]) -> tuple[LabInfo, ...]:
    """The labs of labs.yml, in notebook order; every notebook must have an entry and vice versa."""
    data = yaml.safe_load(path.read_text())
    if set(data) != set(titles):
        raise ConfigError(f"{path} lists {sorted(data)} but the notebooks are {sorted(titles)}: "
                          "give every lab one entry")
    return tuple(LabInfo(name, titles[name], d["learn"], int(d["gpus"]), d.get("t4x1"), d.get("t4x2"))
                 for name, d in sorted(data.items()))


# ---- glossary ---------------------------------------------------------------------------------------------

def term_words(terms: tuple[Term, ...]) -> dict[str, str]:
    """{word as a lab may write it: glossary term} (the labs' first uses link to the glossary: site.mdast.Terms)."""
    return {w: t.term for t in terms for w in t.match}


def glossary_page(terms: tuple[Term, ...]) -> str:
    entries = "\n\n".join(f"{t.term}\n: {t.definition}" for t in sorted(terms, key=lambda t: t.term.lower()))
    return (_front("Glossary") + "\nThe terms the labs use. A lab links the first use of each term on its "
            f"page to its entry here.\n\n:::{{glossary}}\n{entries}\n:::\n")


# ---- pages ------------------------------------------------------------------------------------------------

def _front(title: str) -> str:
    return "---\n" + yaml.safe_dump({"title": title}, width=200) + "---\n"


def _free_gpu(value: str | None) -> str:
    return value if value else "profile not yet available"


def landing_page(cfg: SiteConfig, labs: tuple[LabInfo, ...], decks: dict[str, str], executed: set[str]) -> str:
    rows = "\n".join(
        f"| [{lab.title}](labs/{lab.name}.ipynb) | {lab.learn} | yes | "
        f"{'none' if lab.gpus == 0 else f'{lab.gpus}+ GPUs' if lab.gpus > 1 else '1 GPU'} | "
        f"{_free_gpu(lab.t4x1)} | {_free_gpu(lab.t4x2)} |" for lab in labs)
    deck_lines = "\n".join(f"- [{title}](slides/{name}.html)" for name, title in decks.items())
    return _front(cfg.title) + f"""
A hands-on course on training models at scale: from one GPU through data parallel (DDP), sharding (FSDP,
DeepSpeed ZeRO), parameter-efficient fine-tuning (LoRA, QLoRA) to pipeline, tensor, context and expert
parallelism, with every memory and speed claim measured. Read it here first; then run it.

## What you will learn

- Where GPU memory goes in training, and how to tell before a run whether it will fit.
- The one-GPU levers (mixed precision, accumulation, checkpointing, compile) and what each buys.
- How data parallel, sharded and model-parallel training split the work, what each collective costs, and
  which layout fits a given model on given GPUs.
- How to fine-tune a 7B model on one 24 GB GPU, profile a run, read an out-of-memory error and fix it.
- To write the core of each method yourself (20 code exercises, each checked beside the library's version).

## The labs and the hardware each needs

Every lab runs on a laptop CPU in the `smoke` profile (tiny models, 2 CPU ranks, real training); the pages
below show a smoke run done when this site was built{' (labs without outputs were not executed in this build)' if len(executed) < len(labs) else ''}.
On a GPU machine a lab needs:

| lab | what you learn | laptop (CPU, smoke) | course node (4x A100) | Colab (1x T4) | Kaggle (2x T4) |
|---|---|---|---|---|---|
{rows}

## How to work through it

1. Read a lab here (the [slides](slides.md) give the ideas in brief, the [glossary](glossary.md) the terms).
2. Get your own copy of the labs: `make student` writes `my-labs/` (exercises to fill in, visible tests).
3. Run it on your laptop in `smoke`, or open it on a free GPU with the lab's "Open in Colab" / "Open in Kaggle" link.
4. Check your work with `labkit check my-labs/NN_lab.ipynb`; see a reference solution only when you ask:
   `labkit solution 03_ddp ring_allreduce`. The [self-study guide](docs/self-study.md) walks through it.

## Slides

{deck_lines}
"""


def slides_page(decks: dict[str, str], deck_labs: dict[str, list[str]]) -> str:
    lines = [f"- [{title}](slides/{name}.html) (labs {', '.join(deck_labs.get(name, [])) or '-'})"
             for name, title in decks.items()]
    return (_front("Slides") + "\nOne lecture deck per topic; each opens as a self-contained page "
            "(arrow keys to move, `p` to print).\n\n" + "\n".join(lines) + "\n")


def lab_header(cfg: SiteConfig, lab: str, decks: list[tuple[str, str]], executed: bool) -> str:
    run = ("The outputs on this page come from a run in the `smoke` profile (a CPU, tiny sizes) when the site was "
           "built: your numbers on a GPU will differ." if executed else
           "This page is shown without outputs: it was not executed in this build.")
    slides = "".join(f" · Slides: [{title}](../slides/{name}.html)" for name, title in decks)
    return (f":::{{div}}\n:class: lab-header\n[Open in Colab]({cfg.colab_url(lab)}) · "
            f"[Open in Kaggle]({cfg.kaggle_url(lab)}){slides}\n\n"
            f"{run} The exercises are stubbed: write them in your own copy (`make student`, then "
            f"`my-labs/{lab}.ipynb`) and check them with `labkit check`.\n:::\n")


def rewrite_links(markdown: str, page: str, site_paths: dict[str, str], repo_blob: str) -> str:
    """The relative links of the repository file `page` (e.g. 'notebooks/03_ddp.ipynb'), for its copy on the site:
    to the site's copy of the target where `site_paths` ({repository path: site project path}) has one, else
    to the file in the repository (`repo_blob`/path), so no link on the site points nowhere."""
    here = posixpath.dirname(site_paths.get(page, page))

    def sub(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#|/", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        clean = posixpath.normpath(posixpath.join(posixpath.dirname(page), path))
        new = posixpath.relpath(site_paths[clean], here or ".") if clean in site_paths else f"{repo_blob}/{clean}"
        return f"[{text}]({new}{'#' + anchor if anchor else ''})"

    return re.sub(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)", sub, markdown)
