"""Lecture decks: `slides/*.md` -> one self-contained offline HTML file per deck -> a PDF per deck.

The deck syntax is documented in docs/slides.md. In short: `key: value` front matter, then one slide
per `# Title` line (`# Title {.split .small}` adds layout classes); bullets, numbered lists, pipe
tables, ``` code, `> ` callouts and `## ` sub-headings; a ```figure block (YAML: `fn`, `args`,
`bars`, `caption`) calls the SAME labkit function the notebooks call (`labkit.viz.plots`, then
`labkit.viz.figures`), `bars` being MemoryConfig fields turned into `labkit.memory.estimate` results;
`{{mem total model=llama2-7b}}` inserts a number computed by labkit at build time; `[@zero]` cites
`slides/references.yaml`, and a Readings slide listing every cited work closes the deck.

Figures are embedded as SVG data: URIs and the theme's CSS/JS is inlined, so the HTML loads
nothing from the network (or from anywhere). PDFs come from Debian's chromium (`--print-to-pdf`).
CLI: `python -m labkit.course.slides build [--out build/slides] [--no-pdf] [DECK ...]` (`make slides`).
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from labkit.errors import ConfigError, LabkitError

REPO = Path(__file__).resolve().parents[2]
SLIDES_DIR = REPO / "slides"
DEFAULT_OUT = REPO / "build" / "slides"
CHROMIUM = "/usr/bin/chromium"  # Debian's package; the Makefile's `slides` target installs it
#: Flags for every headless run: no sandbox (root in CI), nothing fetched, nothing synced.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--hide-scrollbars", "--mute-audio")
MEMORY_PARTS = ("weights", "grads", "optimizer", "activations", "total", "model_states", "cpu_bytes")


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


# ----------------------------------------------------------------------------- facts and inline text
def _kwargs(tokens: list[str], where: str) -> dict:
    import yaml

    out = {}
    for tok in tokens:
        if "=" not in tok:
            raise ConfigError(f"{where}: {tok!r} is not key=value")
        key, value = tok.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


def fact(text: str, where: str = "deck") -> str:
    """Evaluate one `{{...}}`: `mem PART cfg...`, `params cfg...`, `trainable cfg...`, `bubble stages=
    microbatches= [schedule=]`, `bubble_ratio stages= microbatches= [chunks=]` ((p-1)/(v m)), `dp_traffic
    zero= microbatches=` (bytes over DDP's), `ring n= [bytes=] [bandwidth=]` (bytes each rank sends per byte of
    gradient; with bytes=, the MB it sends; with bandwidth= in B/s too, the ms that takes)."""
    from labkit.parallel import comm

    name, *rest = text.split()
    if name in ("mem", "params", "trainable"):
        from labkit.memory.estimate import MemoryConfig, estimate

        part = rest.pop(0) if name == "mem" and rest else None
        if name == "mem" and part not in MEMORY_PARTS:
            raise ConfigError(f"{where}: {{{{mem {part} ...}}}}: the part must be one of {', '.join(MEMORY_PARTS)}")
        est = estimate(MemoryConfig(**_kwargs(rest, where)))
        if name == "params":
            return f"{est.params / 1e9:.2f}B"
        if name == "trainable":
            return f"{est.trainable_params:,}"
        value = est.model_states if part == "model_states" else getattr(est, part)
        return _bytes(value)
    if name == "bubble":
        return f"{comm.grid_bubble(comm.schedule_grid(**_kwargs(rest, where))):.0%}"
    if name in ("bubble_ratio", "dp_traffic"):  # (p-1)/m over ideal compute; ZeRO's bytes over DDP's
        return (f"{comm.bubble_ratio(**_kwargs(rest, where)):.0%}" if name == "bubble_ratio"
                else f"{comm.dp_traffic_vs_ddp(**_kwargs(rest, where)):.3g}x")
    if name == "ring":
        kw = _kwargs(rest, where)
        if "bandwidth" in kw:
            return f"{comm.seconds('all_reduce', kw['bytes'], kw['n'], kw['bandwidth']) * 1e3:.0f} ms"
        if "bytes" in kw:
            return f"{comm.bytes_sent('all_reduce', kw['bytes'], kw['n']) / 1e6:.0f} MB"
        return f"{comm.bus_factor('all_reduce', kw['n']):.2f}"
    raise ConfigError(f"{where}: unknown fact {name!r}; use mem, params, trainable, bubble, bubble_ratio, "
                      "dp_traffic or ring")


def _bytes(value: float) -> str:
    """Decimal units, as labkit.memory prints them: 2.79 TB, 107.8 GB, 8 MB."""
    if value >= 1e12:
        return f"{value / 1e12:.2f} TB"
    return f"{value / 1e9:.1f} GB" if value >= 1e8 else f"{value / 1e6:.0f} MB"


class _Inline:
    """Renders inline text: facts, `code`, [@cites], **bold**, *em*; collects the cited keys."""

    def __init__(self, refs: dict, where: str):
        self.refs, self.where, self.cited = refs, where, []

    def cite(self, match) -> str:
        keys = [k.strip().lstrip("@") for k in match.group(1).split(";")]
        for key in keys:
            if key not in self.refs:
                raise ConfigError(f"{self.where}: unknown citation [@{key}]; add it to slides/references.yaml "
                                  f"(known: {', '.join(sorted(self.refs))})")
            if key not in self.cited:
                self.cited.append(key)
        return '<span class="cite">(' + "; ".join(self.refs[k]["short"] for k in keys) + ")</span>"

    def __call__(self, text: str) -> str:
        text = re.sub(r"\{\{(.+?)\}\}", lambda m: fact(m.group(1), self.where), text)
        parts = re.split(r"(`[^`]+`)", text)
        out = []
        for part in parts:
            if part.startswith("`") and part.endswith("`") and len(part) > 1:
                out.append(f"<code>{html.escape(part[1:-1])}</code>")
                continue
            s = html.escape(part, quote=False)
            s = re.sub(r"\[(@[\w-]+(?:\s*;\s*@[\w-]+)*)\]", self.cite, s)
            s = re.sub(r"\*\*(\S(?:.*?\S)?)\*\*", r"<strong>\1</strong>", s)
            s = re.sub(r"(?<![\w*])\*(\S(?:.*?\S)?)\*(?![\w*])", r"<em>\1</em>", s)
            out.append(s)
        return "".join(out)


# ----------------------------------------------------------------------------- figures
def figure_function(name: str):
    """The labkit drawing function called `name`: `labkit.viz.plots` first (what the notebooks import)."""
    from labkit.viz import figures

    from labkit.viz import plots
    for module in (plots, figures):
        fn = getattr(module, name, None)
        if callable(fn) and not name.startswith("_"):
            return fn
    raise ConfigError(f"figure fn {name!r} is neither in labkit.viz.plots nor labkit.viz.figures")


def render_figure(spec: dict, where: str) -> str:
    """Call the spec's labkit function and return an SVG data: URI (matplotlib, text as paths)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unknown = set(spec) - {"fn", "args", "bars", "caption"}
    if unknown or "fn" not in spec:
        raise ConfigError(f"{where}: a figure block needs `fn` and may have args, bars, caption; got {sorted(spec)}")
    fn = figure_function(spec["fn"])
    args = [] if "bars" not in spec else [_bars(spec["bars"], where)]
    try:
        fig = fn(*args, **(spec.get("args") or {}))
    except TypeError as exc:
        raise ConfigError(f"{where}: figure {spec['fn']}: {exc}") from exc
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _bars(bars: dict, where: str) -> dict:
    from labkit.memory.estimate import MemoryConfig, estimate

    if not isinstance(bars, dict) or not bars:
        raise ConfigError(f"{where}: `bars` maps a label to MemoryConfig fields, e.g. full: {{model: llama2-7b}}")
    return {str(label): estimate(MemoryConfig(**fields)) for label, fields in bars.items()}


# ----------------------------------------------------------------------------- blocks
_LIST = re.compile(r"^(\s*)([-*]|\d+\.)\s+(.*)$")
_BLOCK_STARTS = ("```", "## ", "|", ">")


def _list_html(items: list[tuple[int, bool, str]], inline) -> str:
    """Nested <ul>/<ol> from (indent, ordered, text) items; deeper indent = a sub-list."""
    out, stack = [], []  # stack of (indent, tag)
    for indent, ordered, text in items:
        tag = "ol" if ordered else "ul"
        while stack and indent < stack[-1][0]:
            out.append(f"</li></{stack.pop()[1]}>")
        if stack and indent == stack[-1][0] and tag != stack[-1][1]:  # bullets -> numbers: a new list
            out.append(f"</li></{stack.pop()[1]}>")
        if not stack or indent > stack[-1][0]:
            stack.append((indent, tag))
            out.append(f"<{tag}><li>")
        else:
            out.append("</li><li>")
        out.append(inline(text))
    while stack:
        out.append(f"</li></{stack.pop()[1]}>")
    return "".join(out)


def _table_html(rows: list[str], inline) -> str:
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    body = [r for r in cells[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]
    head = "".join(f"<th>{inline(c)}</th>" for c in cells[0])
    rows_html = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows_html}</tbody></table>"


def _fenced(lang: str, body: str, inline, where: str) -> tuple[str, str]:
    """A ``` block: a labkit figure when the language is `figure` (YAML spec), else code."""
    import yaml

    if lang != "figure":
        return "text", f"<pre><code>{html.escape(body)}</code></pre>"
    try:
        spec = yaml.safe_load(body) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: the figure block is not valid YAML (quote text with ': '): "
                          f"{str(exc).splitlines()[0]}") from exc
    uri = render_figure(spec, where)
    cap = f"<figcaption>{inline(spec['caption'])}</figcaption>" if spec.get("caption") else ""
    alt = html.escape(spec.get("caption") or spec["fn"])
    return "figure", f'<figure><img src="{uri}" alt="{alt}">{cap}</figure>'


def _blocks(lines: list[str], inline, where: str) -> list[tuple[str, str]]:
    """Markdown-ish body -> [(kind, html)]; kind 'figure' or 'text' (the split layout uses it)."""
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            lang, j = line[3:].strip(), i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                raise ConfigError(f"{where}: unclosed ``` block")
            blocks.append(_fenced(lang, "\n".join(lines[i + 1:j]), inline, where))
            i = j + 1
        elif line.startswith("## "):
            blocks.append(("text", f"<h3>{inline(line[3:].strip())}</h3>"))
            i += 1
        elif line.lstrip().startswith("|"):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            blocks.append(("text", _table_html(lines[i:j], inline)))
            i = j
        elif _LIST.match(line):
            items = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(_BLOCK_STARTS):
                m = _LIST.match(lines[i])
                if m:
                    items.append((len(m.group(1)), m.group(2)[0].isdigit(), m.group(3)))
                else:  # a continuation line of the previous item
                    items[-1] = items[-1][:2] + (items[-1][2] + " " + lines[i].strip(),)
                i += 1
            blocks.append(("text", _list_html(items, inline)))
        else:
            quote = line.startswith(">")
            j, text = i, []
            while j < len(lines) and lines[j].strip() and not lines[j].startswith(_BLOCK_STARTS[:3]) \
                    and (quote or not _LIST.match(lines[j])):
                text.append(lines[j].lstrip(">").strip() if quote else lines[j].strip())
                j += 1
            body = inline(" ".join(text))
            blocks.append(("text", f"<blockquote>{body}</blockquote>" if quote else f"<p>{body}</p>"))
            i = j
    return blocks


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
