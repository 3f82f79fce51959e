"""Lecture decks: `slides/*.md` -> one self-contained offline HTML file per deck -> a PDF per deck.

The deck syntax is documented in docs/slides.md. In short: `key: value` front matter, then one slide
per `# Title` line (`# Title {.split .small}` adds layout classes); bullets, numbered lists, pipe
tables, ``` code, `> ` callouts and `## ` sub-headings; a ```figure block (YAML: `fn`, `args`,
`bars`, `caption`) calls the SAME labkit function the notebooks call (`labkit.viz.plots`, then
`labkit.viz.figures`), `bars` being MemoryConfig fields turned into `labkit.memory.estimate` results;
`{{mem total model=llama2-7b}}` inserts a number computed by labkit at build time; `[@zero]` cites
`slides/references.yaml`, and a Readings slide listing every cited work closes the deck. What a slide's
body may hold, and how it becomes HTML, is `labkit.course.slide_markup`; this module parses the decks
and builds them.

Figures are embedded as SVG data: URIs and the theme's CSS/JS is inlined, so the HTML loads
nothing from the network (or from anywhere). PDFs come from Debian's chromium (`--print-to-pdf`).
CLI: `python -m labkit.course.slides build [--out build/slides] [--no-pdf] [DECK ...]` (`make slides`).
"""
from __future__ import annotations

import argparse
import html
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from labkit.course.slide_markup import _blocks, _Inline
from labkit.errors import ConfigError, LabkitError

REPO = Path(__file__).resolve().parents[2]
SLIDES_DIR = REPO / "slides"
DEFAULT_OUT = REPO / "build" / "slides"
CHROMIUM = "/usr/bin/chromium"  # Debian's package; the Makefile's `slides` target installs it
#: Flags for every headless run: no sandbox (root in CI), nothing fetched, nothing synced.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--hide-scrollbars", "--mute-audio")


@dataclass(frozen=True)
class Slide:
    """One slide: its title, layout classes and rendered body HTML."""

    title: str
    classes: tuple = ()
    body: str = ""


@dataclass(frozen=True)
class Deck:
    """A parsed deck: front matter, slides and the citation keys in order of first use."""

    name: str
    meta: dict
    slides: tuple
    cited: tuple = field(default=())


# ----------------------------------------------------------------------------- decks
def load_references(path: Path | None = None) -> dict:
    import yaml

    return yaml.safe_load((path or SLIDES_DIR / "references.yaml").read_text())


def parse_deck(path: Path, refs: dict | None = None) -> Deck:
    """Front matter (`key: value` lines up to the first `# `) and one Slide per `# Title`."""
    path = Path(path)
    refs = load_references(path.parent / "references.yaml") if refs is None else refs
    lines = path.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("# ")]
    if not starts:
        raise ConfigError(f"{path}: no slides; each slide starts with a '# Title' line")
    meta = {}
    for line in lines[:starts[0]]:
        if line.strip() and not line.startswith("<!--"):
            key, sep, value = line.partition(":")
            if not sep:
                raise ConfigError(f"{path}: front matter line {line!r} is not `key: value`")
            meta[key.strip()] = value.strip()
    if "title" not in meta:
        raise ConfigError(f"{path}: the front matter needs `title: ...`")
    slides, cited = [], []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        head = re.match(r"^# (.*?)\s*(\{([^}]*)\})?\s*$", lines[start])
        classes = tuple(c.lstrip(".") for c in (head.group(3) or "").split())
        inline = _Inline(refs, f"{path.name}:{start + 1}")
        blocks = _blocks(lines[start + 1:end], inline, f"{path.name}:{start + 1}")
        if "split" in classes:
            cols = ["".join(h for k, h in blocks if k != "figure"), "".join(h for k, h in blocks if k == "figure")]
            body = '<div class="cols">' + "".join(f'<div class="col">{c}</div>' for c in cols) + "</div>"
        else:
            body = "".join(h for _, h in blocks)
        slides.append(Slide(inline(head.group(1)), classes, body))
        cited += [k for k in inline.cited if k not in cited]
    return Deck(path.stem, meta, tuple(slides), tuple(cited))


def render_html(deck: Deck, refs: dict, theme_dir: Path | None = None) -> str:
    """The whole deck as one HTML string: title slide, the slides, a Readings slide; CSS/JS inlined."""
    theme_dir = theme_dir or SLIDES_DIR / "theme"
    esc = html.escape
    meta = deck.meta
    sections = [f'<h1>{esc(meta["title"])}</h1><div class="subtitle">{esc(meta.get("subtitle", ""))}</div>'
                f'<div class="meta">{esc(meta.get("course", "labkit: training models at scale"))}<br>'
                f'notebooks: {esc(meta.get("notebooks", "-"))}</div>']
    classes = ["title-slide"]
    for slide in deck.slides:
        sections.append(f"<h2>{slide.title}</h2>{slide.body}")
        classes.append(" ".join(slide.classes))
    if deck.cited:
        items = "".join(f"<li>{esc(refs[k]['full'])}</li>" for k in deck.cited)
        sections.append(f"<h2>Readings</h2><ol>{items}</ol>")
        classes.append("readings")
    total = len(sections)
    body = "\n".join(
        f'<section class="slide {c}" data-n="{n}">{s}<div class="footer"><span>{esc(meta["title"])}</span>'
        f"<span>{n} / {total}</span></div></section>" for n, (s, c) in enumerate(zip(sections, classes), 1))
    css = (theme_dir / "deck.css").read_text()
    js = (theme_dir / "deck.js").read_text()
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(meta['title'])}</title><style>{css}</style></head>\n"
            f'<body><div class="deck">\n{body}\n</div><script>{js}</script></body></html>\n')


def deck_paths(slides_dir: Path | None = None) -> list[Path]:
    """The deck sources, in course order (file names start with the notebook number)."""
    return sorted(Path(slides_dir or SLIDES_DIR).glob("[0-9]*.md"))


# ----------------------------------------------------------------------------- chromium, build, CLI
def find_chromium(path: str | None = None) -> str:
    """`path`, else Debian's /usr/bin/chromium, else chromium on PATH; ConfigError saying how to install."""
    for candidate in (path, CHROMIUM, shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ConfigError(f"chromium not found at {path or CHROMIUM}: install Debian's package "
                      "(`sudo apt-get install -y chromium`), or run `make slides`, which installs it as root")


def run_chromium(args: list[str], *, chromium: str | None = None, timeout: int = 120) -> str:
    """Run headless chromium with the offline flags and a fresh profile; returns stdout (e.g. --dump-dom)."""
    exe = find_chromium(chromium)
    with tempfile.TemporaryDirectory(prefix="labkit-chromium-") as profile:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise LabkitError(f"chromium failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return proc.stdout


def print_pdf(html_path: Path, pdf_path: Path, *, chromium: str | None = None) -> Path:
    """One PDF page per slide (the theme's @page is 1280 x 720 px, print CSS breaks after each slide)."""
    pdf_path = Path(pdf_path)
    pdf_path.unlink(missing_ok=True)
    run_chromium(["--no-pdf-header-footer", f"--print-to-pdf={pdf_path}", Path(html_path).resolve().as_uri()],
                 chromium=chromium)
    if not pdf_path.exists() or pdf_path.stat().st_size == 0:
        raise LabkitError(f"chromium wrote no PDF at {pdf_path}")
    return pdf_path


def build(decks: list[str | Path] | None = None, *, out: Path | None = None, pdf: bool = True,
          slides_dir: Path | None = None, chromium: str | None = None) -> list[Path]:
    """Build each deck (default: all of `slides_dir`) into `out`/<name>.html (+ .pdf) and an index.html."""
    slides_dir = Path(slides_dir or SLIDES_DIR)
    out = Path(out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    refs = load_references(slides_dir / "references.yaml")
    paths = [Path(d) if Path(d).suffix == ".md" else slides_dir / f"{d}.md" for d in decks] if decks \
        else deck_paths(slides_dir)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        valid = ", ".join(p.stem for p in deck_paths(slides_dir))
        raise ConfigError(f"no deck {', '.join(missing)}; valid decks are: {valid}")
    built, titles = [], []
    for path in paths:  # matplotlib is not thread-safe: figures are drawn one deck at a time
        deck = parse_deck(path, refs)
        target = out / f"{deck.name}.html"
        target.write_text(render_html(deck, refs, slides_dir / "theme"))
        built.append(target)
        titles.append((deck.name, deck.meta["title"]))
    if pdf:  # chromium processes are independent: two at a time
        with ThreadPoolExecutor(max_workers=2) as pool:
            built += list(pool.map(lambda h: print_pdf(h, h.with_suffix(".pdf"), chromium=chromium), list(built)))
    links = "".join(f'<li><a href="{n}.html">{html.escape(t)}</a>' + (f' (<a href="{n}.pdf">PDF</a>)' if pdf else "")
                    + "</li>" for n, t in titles)
    (out / "index.html").write_text(f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>labkit '
                                    f"lectures</title></head><body><h1>labkit lectures</h1><ol>{links}</ol></body></html>\n")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit slides", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build decks into HTML (and PDF)")
    b.add_argument("decks", nargs="*", help="deck names (e.g. 03_ddp) or .md paths; default: all")
    b.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default build/slides)")
    b.add_argument("--no-pdf", action="store_true", help="HTML only (no chromium needed)")
    b.add_argument("--chromium", default=None, help=f"chromium executable (default {CHROMIUM})")
    sub.add_parser("list", help="list the decks")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for path in deck_paths():
            print(path.stem)
        return 0
    try:
        for path in build(args.decks, out=args.out, pdf=not args.no_pdf, chromium=args.chromium):
            print(path)
    except LabkitError as exc:
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
