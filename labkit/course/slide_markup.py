"""The body of a lecture slide, from the deck's markdown to HTML (`labkit.course.slides` parses the decks
and builds them): blocks (bullets, numbered lists, pipe tables, ``` code, `> ` callouts, `## `
sub-headings), inline text (`code`, **bold**, *italics*, `[@key]` citations of `slides/references.yaml`),
`{{...}}` facts computed by labkit at build time (`fact`: memory from `labkit.memory.estimate`, the
collectives' and the pipeline's numbers from `labkit.parallel.comm`), and ```figure blocks, drawn by
the SAME labkit function the notebooks call (`labkit.viz.plots`, then `labkit.viz.figures`) and
embedded as SVG data: URIs. The syntax is documented in docs/slides.md.
"""
from __future__ import annotations

import base64
import html
import io
import re

from labkit.errors import ConfigError

MEMORY_PARTS = ("weights", "grads", "optimizer", "activations", "total", "model_states", "cpu_bytes")


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
