"""The site's HTML: MyST's build (`jupyter-book build --site` with a local, empty template: config.json with the
project's pages and content/<slug>.json with each page's AST) rendered by labkit into static pages.

Every page keeps the name of its source (labs/03_ddp.ipynb -> labs/03_ddp.html, so lab numbers stay in the
URLs; MyST's own slugs drop them), links are relative (the site works from any folder or sub-path), a
navigation sidebar lists the project's table of contents, and the files a page uses (figures, long outputs
moved out by MyST) are copied from MyST's public/ folder into files/. Nothing is loaded from a network:
one stylesheet (site/site.css), no JavaScript.
"""
from __future__ import annotations

import html
import json
import posixpath
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from labkit.course.site.mdast import Html, Terms, plain_text
from labkit.errors import LabkitError


@dataclass(frozen=True)
class Page:
    slug: str
    """MyST's name for the page (its content/<slug>.json and its internal URLs, /<slug>)."""
    source: str
    """The page's file in the MyST project, e.g. 'labs/03_ddp.ipynb'."""
    out: str
    """Our file for it, e.g. 'labs/03_ddp.html'."""
    title: str


@dataclass
class Rendered:
    pages: dict[str, Page]
    """{out: Page} of every page written."""
    unhandled: dict[str, Counter] = field(default_factory=dict)
    """{out: node types without a handler}: their text children are shown."""
    unhandled_text: dict[str, Counter] = field(default_factory=dict)
    """{out: those of them that carried text} (shown as plain text: the page may look wrong there)."""
    broken: list[str] = field(default_factory=list)
    """'<page>: <link>' for every link that leads to no page or file of the site."""


def _out_name(source: str) -> str:
    return str(PurePosixPath(source).with_suffix(".html"))


def load_pages(myst_site: Path) -> tuple[dict[str, Page], dict]:
    """{slug: Page} of MyST's build in `myst_site` (…/_build/site), and its config.json."""
    config = json.loads((myst_site / "config.json").read_text())
    pages = {}
    for path in sorted((myst_site / "content").glob("*.json")):
        data = json.loads(path.read_text())
        source = data["location"].lstrip("/")
        pages[data["slug"]] = Page(data["slug"], source, _out_name(source), data["frontmatter"].get("title", source))
    return pages, config


def nav_entries(config: dict, pages: dict[str, Page]) -> list[tuple[int, str, Page | None]]:
    """(level, title, page or None for a group heading) in the order of the project's table of contents."""
    project = config["projects"][0]
    entries = [(1, pages[project["index"]].title, pages[project["index"]])] if project.get("index") in pages else []
    for item in project.get("pages", []):
        page = pages.get(item.get("slug", ""))
        entries.append((int(item.get("level", 1)), item.get("title", ""), page))
    return entries


class _PageLinks:
    """The `Links` of one page: MyST's URLs (/slug, /file-hash.png) as URLs relative to this page."""

    def __init__(self, site: "SiteWriter", page: Page):
        self.site, self.page = site, page

    def rel(self, target: str) -> str:
        return posixpath.relpath(target, posixpath.dirname(self.page.out) or ".")

    def _page_url(self, url: str, anchor: str = "") -> str | None:
        slug = url.strip("/").split("#")[0] or self.site.index
        page = self.site.pages.get(slug)
        if page is None:
            return None
        target = "" if page is self.page else self.rel(page.out)
        return f"{target}#{anchor}" if anchor else (target or "#")

    def link(self, node: dict) -> str:
        url = node.get("url", "")
        if node.get("internal"):
            base, _, anchor = url.partition("#")
            found = self._page_url(base, anchor)
        elif node.get("static"):
            found = self._static(node)
        elif re.match(r"[a-z]+:", url) or url.startswith("#"):
            return url
        else:
            found = None
        if found is None:
            self.site.broken.append(f"{self.page.out}: {node.get('urlSource') or url}")
            return url
        return found

    def xref(self, node: dict) -> str:
        anchor = node.get("html_id") or node.get("identifier", "")
        if node.get("remote") and node.get("url"):
            found = self._page_url(node["url"], anchor)
            if found is None:
                self.site.broken.append(f"{self.page.out}: {node.get('urlSource') or node['url']}")
                return "#"
            return found
        return f"#{anchor}"

    def _static(self, node: dict) -> str | None:
        """A file link: the file the site already has there (a slide deck), else MyST's copy in files/."""
        source = node.get("urlSource", "")
        local = posixpath.normpath(posixpath.join(posixpath.dirname(self.page.source), source))
        if (self.site.out / local).is_file():
            return self.rel(local)
        return self.asset(node.get("url", ""))

    def asset(self, public_path: str) -> str:
        return self.rel(self.site.copy_asset(public_path))

    def asset_text(self, public_path: str) -> str:
        return (self.site.public / public_path.lstrip("/")).read_text(errors="replace")


class SiteWriter:
    """Writes every page of MyST's build in `myst_site` into `out` (which already holds the static files:
    slides, the stylesheet)."""

    def __init__(self, myst_site: Path, out: Path, *, site_title: str, terms: dict[str, str] | None = None,
                 glossary: str | None = None, term_pages: tuple[str, ...] = ()):
        self.myst, self.out, self.public = myst_site, out, myst_site / "public"
        self.pages, self.config = load_pages(myst_site)
        self.index = self.config["projects"][0].get("index", "index")
        self.site_title = site_title
        self.words = terms or {}
        self.glossary, self.term_pages = glossary, term_pages
        self.broken: list[str] = []

    def copy_asset(self, public_path: str) -> str:
        """Copy a file of MyST's public/ folder into files/; returns its site path."""
        name = PurePosixPath(public_path).name
        src = self.public / name
        if not src.is_file():
            raise LabkitError(f"MyST's build names {public_path} but {src} does not exist")
        dest = self.out / "files" / name
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
        return f"files/{name}"

    def _term_anchors(self) -> dict[str, str]:
        """{term: 'glossary.html#term-…'} from the glossary page's definition terms."""
        page = next((p for p in self.pages.values() if p.source == self.glossary), None)
        if page is None:
            return {}
        anchors: dict[str, str] = {}

        def walk(node):
            if node.get("type") == "definitionTerm" and node.get("html_id"):
                anchors[plain_text(node).strip()] = f"{page.out}#{node['html_id']}"
            for child in node.get("children", []):
                walk(child)

        walk(json.loads((self.myst / "content" / f"{page.slug}.json").read_text())["mdast"])
        return anchors

    def write(self) -> Rendered:
        anchors = self._term_anchors()
        entries = nav_entries(self.config, self.pages)
        order = [p for _, _, p in entries if p is not None]
        result = Rendered({p.out: p for p in self.pages.values()})
        for page in self.pages.values():
            links = _PageLinks(self, page)
            terms = None
            if any(page.source.startswith(prefix) for prefix in self.term_pages):
                terms = Terms(self.words, {t: links.rel(a) for t, a in anchors.items()})
            writer = Html(links, terms)
            data = json.loads((self.myst / "content" / f"{page.slug}.json").read_text())
            body = writer.render(data["mdast"])
            if writer.unhandled:
                result.unhandled[page.out] = writer.unhandled
            if writer.carrying:
                result.unhandled_text[page.out] = writer.carrying
            target = self.out / page.out
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self._shell(page, body, entries, order, links))
        result.broken = sorted(set(self.broken))
        return result

    # ---- the page around the content --------------------------------------------------------------------

    def _nav(self, page: Page, entries, links: _PageLinks) -> str:
        items, open_group = [], False
        for level, title, target in entries:
            if target is None:  # a group heading (Labs, Docs)
                items.append(("</ul></li>" if open_group else "") + f'<li class="group"><span>{html.escape(title)}</span><ul>')
                open_group = True
                continue
            if level == 1 and open_group:
                items.append("</ul></li>")
                open_group = False
            current = ' aria-current="page"' if target is page else ""
            items.append(f'<li><a href="{html.escape(links.rel(target.out))}"{current}>{html.escape(title)}</a></li>')
        return "<ul>" + "".join(items) + ("</ul></li>" if open_group else "") + "</ul>"

    def _shell(self, page: Page, body: str, entries, order: list[Page], links: _PageLinks) -> str:
        i = order.index(page) if page in order else -1
        prev_next = "".join(
            f'<a class="{cls}" href="{html.escape(links.rel(p.out))}">{label} {html.escape(p.title)}</a>'
            for cls, label, p in (("prev", "&larr;", order[i - 1] if i > 0 else None),
                                  ("next", "&rarr;", order[i + 1] if 0 <= i < len(order) - 1 else None)) if p)
        home = links.rel(self.pages[self.index].out) if self.index in self.pages else "#"
        title = html.escape(page.title)
        return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · {html.escape(self.site_title)}</title><link rel="stylesheet" href="{html.escape(links.rel('site.css'))}"></head>
<body><header class="top"><a href="{html.escape(home)}">{html.escape(self.site_title)}</a></header>
<div class="layout"><nav class="sidebar" aria-label="Contents">{self._nav(page, entries, links)}</nav>
<main><article><h1>{title}</h1>
{body}
</article><footer class="pager">{prev_next}</footer></main></div></body></html>
"""
