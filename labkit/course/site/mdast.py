"""One page of MyST's AST ("mdast", what `jupyter-book build --site` writes to content/<slug>.json) as HTML.

Our own small renderer: each node type the course's pages use has a handler below; notebook cell outputs
(stream text, images, HTML / plain results, errors, widgets) are rendered from their Jupyter data. A node
type without a handler shows its text children and is counted in `Html.unhandled`, which the build logs.
Links, cross-references and files are resolved by the caller (a `Links`: labkit.course.site.render), so
this module knows nothing of the site's folders. Math is MathML (MyST's KaTeX output carries it; browsers
render it natively, nothing loaded from a network), TeX text where KaTeX failed.
"""
from __future__ import annotations

import html
import re
from collections import Counter
from typing import Protocol

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_MATHML = re.compile(r"<math\b.*?</math>", re.S)

#: Text inside these is never turned into a glossary link (it is code, a link already, or a title).
_NO_TERMS = {"heading", "link", "crossReference", "code", "inlineCode", "math", "inlineMath", "summary",
             "admonitionTitle", "captionNumber", "definitionTerm", "footnoteReference"}
_INLINE_TAGS = {"emphasis": "em", "strong": "strong", "delete": "del", "subscript": "sub",
                "superscript": "sup", "underline": "u", "smallcaps": "span", "abbreviation": "abbr"}
_BLOCK_TAGS = {"blockquote": "blockquote", "caption": "figcaption", "legend": "div", "aside": "aside",
               "definitionList": "dl", "definitionDescription": "dd", "glossary": "div"}
#: Nodes that carry nothing to show.
_SKIP = {"comment", "mystTarget", "footnoteDefinition"}
_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")
_WIDGET = "application/vnd.jupyter.widget-view+json"


class Links(Protocol):
    """What the page writer asks of the site: where a link, a cross-reference or a file of MyST's build goes."""

    def link(self, node: dict) -> str: ...

    def xref(self, node: dict) -> str: ...

    def asset(self, public_path: str) -> str:
        """The page-relative URL of a file of MyST's public/ folder (copied into the site)."""

    def asset_text(self, public_path: str) -> str:
        """The text of a file of MyST's public/ folder (a long output MyST moved out of the page)."""


class Terms:
    """Glossary links: the first use of each term on a page, outside code, links and titles."""

    def __init__(self, words: dict[str, str], href: dict[str, str]):
        self.href = href  # term -> URL of its glossary entry, relative to the page
        alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        self.pattern = re.compile(rf"(?<![\w./-])({alternatives})(?![\w/]|-\w)", re.I) if words else None
        self.words = {w.lower(): t for w, t in words.items()}
        self.done: set[str] = set()

    def link(self, text: str) -> str:
        """`text` escaped, with first uses linked."""
        if self.pattern is None:
            return html.escape(text, quote=False)
        out, last = [], 0
        for m in self.pattern.finditer(text):
            term = self.words[m.group(1).lower()]
            if term in self.done or term not in self.href:
                continue
            self.done.add(term)
            out += [html.escape(text[last:m.start()], quote=False),
                    f'<a class="term" href="{html.escape(self.href[term])}" title="glossary: {html.escape(term)}">'
                    f'{html.escape(m.group(1), quote=False)}</a>']
            last = m.end()
        return "".join(out + [html.escape(text[last:], quote=False)])


def _attr(value) -> str:
    return html.escape(str(value), quote=True)


def plain_text(node) -> str:
    """The text a node carries (its own value and its children's)."""
    if isinstance(node, list):
        return "".join(plain_text(n) for n in node)
    if not isinstance(node, dict):
        return ""
    return (node.get("value") if isinstance(node.get("value"), str) and node.get("type") != "html" else "") + \
        plain_text(node.get("children", []))


def highlight(code: str, lang: str) -> str:
    """Code as HTML, coloured by Pygments where it knows the language (classes styled by site.css)."""
    try:
        from pygments import highlight as pyg
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name
        from pygments.util import ClassNotFound
    except ImportError:  # pragma: no cover - Pygments comes with IPython, which the kernel needs
        return html.escape(code, quote=False)
    try:
        lexer = get_lexer_by_name(lang or "text", stripnl=False, ensurenl=False)
    except ClassNotFound:
        return html.escape(code, quote=False)
    return pyg(code, lexer, HtmlFormatter(nowrap=True))


class Html:
    """Render one page's mdast. `unhandled` counts node types without a handler, `carrying` those that
    held text (shown as plain text, so nothing is lost, but the page may look wrong)."""

    def __init__(self, links: Links, terms: Terms | None = None):
        self.links, self.terms = links, terms
        self.unhandled: Counter[str] = Counter()
        self.carrying: Counter[str] = Counter()
        self.footnotes: list[dict] = []
        self._protect = 0

    # ---- dispatch ---------------------------------------------------------------------------------------

    def render(self, node) -> str:
        if isinstance(node, list):
            return "".join(self.render(n) for n in node)
        kind = node.get("type", "")
        if kind == "footnoteDefinition":
            self.footnotes.append(node)
        if kind in _SKIP or node.get("visibility") == "remove":
            return ""
        protect = kind in _NO_TERMS
        self._protect += protect
        try:
            if kind in _INLINE_TAGS:
                return f"<{_INLINE_TAGS[kind]}>{self.children(node)}</{_INLINE_TAGS[kind]}>"
            if kind in _BLOCK_TAGS:
                return f"<{_BLOCK_TAGS[kind]}>{self.children(node)}</{_BLOCK_TAGS[kind]}>"
            handler = getattr(self, f"n_{kind}", None)
            if handler is not None:
                return handler(node)
            self.unhandled[kind] += 1
            if plain_text(node).strip():
                self.carrying[kind] += 1
            return f'<span class="unhandled" data-type="{_attr(kind)}">{self.children(node)}</span>'
        finally:
            self._protect -= protect

    def children(self, node: dict) -> str:
        return self.render(node.get("children", []))

    @staticmethod
    def _id(node: dict) -> str:
        return f' id="{_attr(node["html_id"])}"' if node.get("html_id") else ""

    # ---- text and inline --------------------------------------------------------------------------------

    def n_text(self, node):
        value = node.get("value", "")
        return self.terms.link(value) if self.terms and not self._protect else html.escape(value, quote=False)

    def n_inlineCode(self, node):
        return f"<code>{html.escape(node.get('value', ''), quote=False)}</code>"

    def n_break(self, node):
        return "<br>"

    def n_span(self, node):
        cls = f' class="{_attr(node["class"])}"' if node.get("class") else ""
        return f"<span{cls}{self._id(node)}>{self.children(node)}</span>"

    def n_link(self, node):
        href = self.links.link(node)
        external = ' rel="noopener"' if re.match(r"[a-z]+://", href) else ""
        return f'<a href="{_attr(href)}"{external}>{self.children(node)}</a>'

    def n_crossReference(self, node):
        return f'<a class="xref" href="{_attr(self.links.xref(node))}">{self.children(node)}</a>'

    def n_footnoteReference(self, node):
        n = _attr(node.get("enumerator") or node.get("identifier", ""))
        return f'<sup class="fn"><a id="fnref-{n}" href="#fn-{n}">{n}</a></sup>'

    def n_inlineMath(self, node):
        return self._math(node, block=False)

    def n_math(self, node):
        return self._math(node, block=True)

    def _math(self, node, block: bool) -> str:
        found = _MATHML.search(node.get("html") or "")
        body = found.group(0) if found else f'<code class="tex">{html.escape(node.get("value", ""), quote=False)}</code>'
        if not block:
            return f'<span class="math">{body}</span>'
        number = f'<span class="eqno">({_attr(node["enumerator"])})</span>' if node.get("enumerator") and node.get("label") else ""
        return f'<div class="math display"{self._id(node)}>{body}{number}</div>'

    def n_image(self, node):
        url = node.get("url", "")
        src = url if re.match(r"[a-z]+:", url) else self.links.asset(url)
        width = f' style="width:{_attr(node["width"])}"' if node.get("width") else ""
        return f'<img src="{_attr(src)}" alt="{_attr(node.get("alt", ""))}"{width}>'

    def n_html(self, node):  # raw HTML a page holds (our own course text)
        return node.get("value", "")

    # ---- blocks -----------------------------------------------------------------------------------------

    def n_root(self, node):
        body = self.children(node)
        if self.footnotes:
            items = "".join(f'<li id="fn-{_attr(f.get("enumerator") or f.get("identifier"))}">'
                            f'{self.children(f)}</li>' for f in self.footnotes)
            body += f'<section class="footnotes"><ol>{items}</ol></section>'
        return body

    def n_block(self, node):
        kind = node.get("kind", "")
        cls = {"notebook-code": "cell code-cell", "notebook-content": "cell"}.get(kind, "block")
        return f'<div class="{cls}"{self._id(node)}>{self.children(node)}</div>'

    def n_paragraph(self, node):
        return f"<p{self._id(node)}>{self.children(node)}</p>"

    def n_heading(self, node):
        depth = max(2, min(int(node.get("depth", 2)), 6))  # the page title is the only h1
        anchor = f' <a class="anchor" href="#{_attr(node["html_id"])}">#</a>' if node.get("html_id") else ""
        return f"<h{depth}{self._id(node)}>{self.children(node)}{anchor}</h{depth}>"

    def n_thematicBreak(self, node):
        return "<hr>"

    def n_list(self, node):
        tag = "ol" if node.get("ordered") else "ul"
        start = f' start="{int(node["start"])}"' if node.get("ordered") and node.get("start", 1) != 1 else ""
        return f"<{tag}{start}>{self.children(node)}</{tag}>"

    def n_listItem(self, node):
        box = "" if node.get("checked") is None else \
            f'<input type="checkbox" disabled{" checked" if node["checked"] else ""}> '
        return f"<li>{box}{self.children(node)}</li>"

    def n_table(self, node):
        return f'<div class="table"><table{self._id(node)}>{self.children(node)}</table></div>'

    def n_tableRow(self, node):
        return f"<tr>{self.children(node)}</tr>"

    def n_tableCell(self, node):
        tag = "th" if node.get("header") else "td"
        align = f' style="text-align:{_attr(node["align"])}"' if node.get("align") else ""
        return f"<{tag}{align}>{self.children(node)}</{tag}>"

    def n_code(self, node):
        lang = node.get("lang") or ""
        return (f'<pre class="code"{self._id(node)} data-lang="{_attr(lang)}"><code>'
                f'{highlight(node.get("value", ""), lang)}</code></pre>')

    def n_admonition(self, node):
        kind = node.get("kind") or (node.get("class") or "note").split()[0]
        return f'<aside class="admonition {_attr(kind)}"{self._id(node)}>{self.children(node)}</aside>'

    def n_admonitionTitle(self, node):
        return f'<p class="admonition-title">{self.children(node)}</p>'

    def n_details(self, node):
        return f'<details{" open" if node.get("open") else ""}>{self.children(node)}</details>'

    def n_summary(self, node):
        return f"<summary>{self.children(node)}</summary>"

    def n_div(self, node):
        cls = f' class="{_attr(node["class"])}"' if node.get("class") else ""
        return f"<div{cls}{self._id(node)}>{self.children(node)}</div>"

    def n_container(self, node):
        return f'<figure class="{_attr(node.get("kind", "figure"))}"{self._id(node)}>{self.children(node)}</figure>'

    def n_captionNumber(self, node):
        return f'<span class="caption-number">{self.children(node)}</span> '

    def n_definitionTerm(self, node):
        return f"<dt{self._id(node)}>{self.children(node)}</dt>"

    # ---- notebook outputs -------------------------------------------------------------------------------

    def n_outputs(self, node):
        inner = self.children(node)
        return f'<div class="outputs">{inner}</div>' if inner else ""

    def n_output(self, node):
        data = node.get("jupyter_data") or {}
        kind = data.get("output_type")
        if kind == "stream":
            text = self._text(data.get("text"), data.get("path"))
            return f'<pre class="output stream {_attr(data.get("name", ""))}">{html.escape(text, quote=False)}</pre>'
        if kind == "error":
            tb = data.get("traceback")
            text = "\n".join(tb) if isinstance(tb, list) else str(tb or f"{data.get('ename')}: {data.get('evalue')}")
            return f'<pre class="output error">{html.escape(_ANSI.sub("", text), quote=False)}</pre>'
        if kind in ("display_data", "execute_result", "update_display_data"):
            return self._rich(data.get("data") or {})
        self.unhandled[f"output:{kind}"] += 1
        return ""

    def _text(self, value, path=None) -> str:
        if isinstance(value, dict):
            value, path = value.get("content"), value.get("path")
        if path and (value is None or str(value).endswith("...")):  # MyST moved a long output to a file
            value = self.links.asset_text(path)
        return _ANSI.sub("", "".join(value) if isinstance(value, list) else str(value or ""))

    def _rich(self, bundle: dict) -> str:
        for mime in _IMAGE_TYPES:
            if mime in bundle:
                item = bundle[mime]
                alt = self._text(bundle.get("text/plain", "")) if "text/plain" in bundle else "figure"
                if isinstance(item, dict) and item.get("path"):
                    src = self.links.asset(item["path"])
                else:
                    content = item.get("content") if isinstance(item, dict) else item
                    src = f"data:{mime};base64,{content}" if mime != "image/svg+xml" else \
                        "data:image/svg+xml;charset=utf-8," + re.sub(r"[\s#%<>\"]", lambda m: f"%{ord(m.group(0)):02X}", content)
                return f'<div class="output image"><img src="{_attr(src)}" alt="{_attr(alt[:200])}"></div>'
        if _WIDGET in bundle:
            return ('<div class="output widget">An interactive widget is here when you run the notebook '
                    "(Jupyter, Colab or Kaggle).</div>")
        if "text/html" in bundle:
            return f'<div class="output html">{self._text(bundle["text/html"])}</div>'
        if "text/markdown" in bundle or "text/plain" in bundle:
            text = self._text(bundle.get("text/plain") or bundle.get("text/markdown"))
            return f'<pre class="output result">{html.escape(text, quote=False)}</pre>'
        self.unhandled["output:" + ",".join(sorted(bundle))] += 1
        return ""
