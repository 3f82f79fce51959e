"""The course website: labkit's renderer of MyST's AST (pure, cheap), and the built site in headless Chromium:
every lab page loads, shows its figures, links only to pages and anchors that exist, offers Open in Colab /
Kaggle, and holds no solution or hidden-test text, outputs included.

Budget (`make test` <= 20 min): the site is built once per session (Jupyter Book over the student release,
labkit's pages; no npm) with one executed lab, 01_memory, whose smoke run tests/test_exercises_release.py
shares (imported from there: one xdist unit, one run); the other labs are rendered from the release without
outputs, and the slide decks' figures are stand-ins (tests/test_slides.py draws the real ones). `make site`
executes every lab, draws every figure and runs the same leak scan over every file before it writes build/site
(labkit.course.site.leaks.scan_site). Chromium is Debian's (`make test` installs it), driven by Playwright.
"""
from __future__ import annotations

import functools
import html.parser
import http.server
import shutil
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from labkit.course import slide_markup
from labkit.course.site import leaks, pages
from labkit.course.site.build import build_site
from labkit.course.site.mdast import Html, Terms
from test_exercises_release import released_memory_run

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
EXECUTED = ("01_memory",)
STEP_S = 120  # generous deadline per page condition on a busy machine (not a timing claim)


# ---- pure parts: cheap, no build --------------------------------------------------------------------------

class _Links:
    """A stand-in for the site's link resolution: MyST URLs as they are, files under files/."""

    def link(self, node):
        return "page.html" if node.get("internal") else node["url"]

    def xref(self, node):
        return f"#{node['html_id']}"

    def asset(self, path):
        return "files/" + path.lstrip("/")

    def asset_text(self, path):
        return f"(long output from {path})"


def _t(value):
    return {"type": "text", "value": value}


def _p(*children):
    return {"type": "paragraph", "children": list(children)}


def test_glossary_links_the_first_use_outside_code_links_and_headings():
    terms = pages.term_words(pages.load_glossary(ROOT / "site" / "glossary.yml"))
    html = Html(_Links(), Terms(terms, {"all-reduce": "../glossary.html#term-all-reduce",
                                        "DDP": "../glossary.html#term-ddp"}))
    out = html.render({"type": "root", "children": [
        {"type": "heading", "depth": 2, "children": [_t("All-reduce heading")]},
        _p(_t("DDP runs an "), {"type": "inlineCode", "value": "all-reduce"}, _t(" in code, "),
           {"type": "link", "url": "x.md", "children": [_t("all-reduce")]}, _t(", then an all-reduce.")),
        {"type": "code", "lang": "python", "value": "all_reduce()  # all-reduce"},
        _p(_t("Another all-reduce; allreduce_seconds is code-like."))]})
    assert out.count('href="../glossary.html#term-all-reduce"') == 1 and out.count("term-ddp") == 1
    assert "<h2>All-reduce heading" in out and "<code>all-reduce</code> in code, <a href=\"x.md\">all-reduce</a>" in out
    assert 'then an <a class="term" href="../glossary.html#term-all-reduce"' in out
    assert "Another all-reduce;" in out  # once per page
    assert not html.unhandled


def test_the_renderer_shows_every_node_kind_a_lab_uses_and_counts_unknown_ones():
    html = Html(_Links())
    out = html.render({"type": "root", "children": [
        {"type": "block", "kind": "notebook-content", "children": [
            {"type": "details", "children": [{"type": "summary", "children": [_t("Hint 1")]}, _p(_t("bytes"))]},
            {"type": "admonition", "kind": "note", "children": [
                {"type": "admonitionTitle", "children": [_t("Note")]}, _p(_t("careful"))]},
            _p({"type": "inlineMath", "value": "a^2", "html": '<span class="katex"><math><mi>a</mi></math><b>x</b></span>'},
               {"type": "inlineMath", "value": "\\bad"}, {"type": "emphasis", "children": [_t("em")]}),
            {"type": "table", "children": [{"type": "tableRow", "children": [
                {"type": "tableCell", "header": True, "children": [_t("h")]}]}]},
            {"type": "list", "ordered": True, "start": 3, "children": [{"type": "listItem", "children": [_t("item")]}]},
            {"type": "mystery", "children": [_t("kept text")]}, {"type": "emptyThing"}]},
        {"type": "block", "kind": "notebook-code", "children": [
            {"type": "code", "lang": "python", "value": "print('hi')"},
            {"type": "outputs", "children": [
                {"type": "output", "jupyter_data": {"output_type": "stream", "name": "stdout", "text": "\x1b[1mhi\x1b[0m\n"}},
                {"type": "output", "jupyter_data": {"output_type": "stream", "name": "stdout", "text": "lo...",
                                                    "path": "/abc.txt"}},
                {"type": "output", "jupyter_data": {"output_type": "display_data", "data": {
                    "image/png": {"content_type": "image/png", "path": "/fig.png"}, "text/plain": {"content": "<Figure>"}}}},
                {"type": "output", "jupyter_data": {"output_type": "execute_result", "data": {
                    "text/html": {"content": "<table><td>df</td></table>"}, "text/plain": {"content": "df"}}}},
                {"type": "output", "jupyter_data": {"output_type": "display_data", "data": {
                    "application/vnd.jupyter.widget-view+json": {"content": "{}"}, "text/plain": {"content": "VBox()"}}}},
                {"type": "output", "jupyter_data": {"output_type": "error", "ename": "ValueError", "evalue": "bad",
                                                    "traceback": "\x1b[31mValueError\x1b[0m: bad"}}]}]}]})
    assert "<details><summary>Hint 1</summary><p>bytes</p></details>" in out
    assert '<aside class="admonition note"><p class="admonition-title">Note</p>' in out
    assert '<span class="math"><math><mi>a</mi></math></span>' in out and '<code class="tex">\\bad</code>' in out
    assert "<th>h</th>" in out and '<ol start="3">' in out and "<em>em</em>" in out
    assert '<pre class="output stream stdout">hi\n</pre>' in out and "(long output from /abc.txt)" in out
    assert '<img src="files/fig.png" alt="&lt;Figure&gt;">' in out and "<table><td>df</td></table>" in out
    assert "interactive widget" in out and "VBox()" not in out and "ValueError: bad" in out
    assert 'print</span>' in out or "print(" in out  # Pygments colours it where installed
    assert "kept text" in out and html.unhandled == {"mystery": 1, "emptyThing": 1} and html.carrying == {"mystery": 1}


def test_links_to_repository_files_go_to_their_site_page_or_to_github():
    site_paths = {"notebooks/03_ddp.ipynb": "labs/03_ddp.ipynb", "docs/memory.md": "docs/memory.md",
                  "reservations/README.md": "docs/reservations.md"}
    blob = "https://github.com/me/course/blob/main"
    text = ("See [memory](../docs/memory.md#budget), [leases](../reservations/README.md), [tests](tests/03_ddp.py), "
            "[web](https://x.org) and [here](#top).")
    out = pages.rewrite_links(text, "notebooks/03_ddp.ipynb", site_paths, blob)
    assert out == ("See [memory](../docs/memory.md#budget), [leases](../docs/reservations.md), "
                   f"[tests]({blob}/notebooks/tests/03_ddp.py), [web](https://x.org) and [here](#top).")
    assert pages.rewrite_links("[policy](policy.yaml) [lab](../notebooks/03_ddp.ipynb)", "reservations/README.md",
                               site_paths, blob) == f"[policy]({blob}/reservations/policy.yaml) [lab](../labs/03_ddp.ipynb)"


def test_colab_and_kaggle_urls_come_from_the_configured_repository(tmp_path):
    cfg = pages.load_config(ROOT / "site" / "site.yml", "https://github.com/me/course")
    assert cfg.colab_url("03_ddp") == (f"https://colab.research.google.com/github/me/course/blob/{cfg.branch}/"
                                       f"{cfg.release_dir}/03_ddp.ipynb")
    assert cfg.kaggle_url("03_ddp") == ("https://www.kaggle.com/kernels/welcome?src=https://github.com/me/course/"
                                        f"blob/{cfg.branch}/{cfg.release_dir}/03_ddp.ipynb")
    with pytest.raises(Exception, match="is not https://github.com/OWNER/NAME"):
        pages.load_config(ROOT / "site" / "site.yml", "https://gitlab.com/me/course")


def test_the_leak_scan_finds_a_solution_line_and_a_hidden_test_in_a_page(tmp_path):
    known = leaks.secrets(ROOT / "notebooks")
    solution = next(s for s in known if "(solution)" in s.origin and "03_ddp" in s.origin)
    hidden = next(s for s in known if s.origin.startswith("tests/hidden/"))
    (tmp_path / "page.html").write_text(f"<html><body><pre><span>{solution.text[:10]}</span>"
                                        f"{solution.text[10:]}</pre></body></html>")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "long.txt").write_text(f"output\n{hidden.text}\n")
    (tmp_path / "clean.html").write_text("<p>nothing here</p>")
    found = leaks.scan_site(tmp_path, ROOT / "notebooks")
    assert any(f.startswith("page.html:") and "(solution)" in f for f in found)
    assert any(f.startswith("files/long.txt:") and "tests/hidden/" in f for f in found)
    assert "clean.html" not in " ".join(found)


# ---- the built site in Chromium ---------------------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


#: A slide figure as the site test draws it (a 1x1 SVG): drawing the decks' real figures takes longer than the
#: whole site build, and tests/test_slides.py checks them.
STAND_IN_FIGURE = ("data:image/svg+xml;base64,PHN2ZyB4bWxucz0iaHR0cDovL3d3dy53My5vcmcvMjAwMC9zdmciIHdpZHRoPSIx"
                   "IiBoZWlnaHQ9IjEiLz4=")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _, run = released_memory_run(tmp_path_factory)
    assert run.ok, run.describe()
    tmp = tmp_path_factory.mktemp("site")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slide_markup, "render_figure", lambda spec, where: STAND_IN_FIGURE)
        result = build_site(tmp / "site", execute=(), executed_dir=run.output.parent, work=tmp / "src",
                            log=lambda m: None)
    assert result.ok, (result.failed, result.broken)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(result.out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield result, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def browser(site):
    pytest.importorskip("playwright", reason="Playwright for Python is not installed (pip install playwright)")
    if CHROMIUM is None:
        pytest.fail("Chromium is not installed: `make test` installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k in ("id", "name") and v)


@functools.lru_cache(maxsize=None)
def _fetch(url: str) -> tuple[int, frozenset[str]]:
    try:
        with urllib.request.urlopen(url, timeout=STEP_S) as resp:
            parser = _Ids()
            parser.feed(resp.read().decode(errors="replace"))
            return resp.status, frozenset(parser.ids)
    except urllib.error.HTTPError as exc:
        return exc.code, frozenset()


@pytest.mark.slow
def test_every_lab_page_loads_with_figures_links_and_no_solution(site, browser):
    result, base = site
    known = leaks.secrets(ROOT / "notebooks")
    page = browser.new_page()
    page.set_default_timeout(STEP_S * 1000)
    page.goto(base + "/", wait_until="load")
    urls = sorted({h for h in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href.split('#')[0])")
                   if h.startswith(base + "/labs/")})
    seen = []
    for url in urls:
        response = page.goto(url, wait_until="load")
        assert response is not None and response.status == 200, url
        page.wait_for_function("[...document.images].every(i => i.complete)")
        hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
        colab = [h for h in hrefs if h.startswith("https://colab.research.google.com/github/")]
        assert len(colab) == 1 and colab[0].endswith(".ipynb"), f"{url}: Open in Colab links {colab}"
        name = colab[0].rsplit("/", 1)[1][:-len(".ipynb")]
        seen.append(name)
        assert any(h.startswith("https://www.kaggle.com/kernels/welcome?src=") and h.endswith(f"/{name}.ipynb")
                   for h in hrefs), f"{url}: no Open in Kaggle link"
        # figures: every image loaded, and an executed lab shows every image its run produced
        images = page.eval_on_selector_all("img", "els => els.map(i => [i.src, i.naturalWidth])")
        assert all(width > 0 for _, width in images), f"{url}: images that did not load: {images}"
        assert len(images) >= result.figures[name], f"{url} shows {len(images)} of {result.figures[name]} figures"
        # internal links: the page exists, and so does the anchor
        for href in sorted({h for h in hrefs if h.startswith(base)}):
            target, _, anchor = href.partition("#")
            status, ids = _fetch(target)
            assert status == 200, f"{url} links to {href}: HTTP {status}"
            assert not anchor or urllib.parse.unquote(anchor) in ids, f"{url} links to a missing anchor: {href}"
        # no solution or hidden test, in code and outputs alike
        text = page.evaluate("document.body.textContent")
        found = leaks.find_leaks(text, known) + leaks.find_leaks(page.content(), known)
        assert not found, f"{url} shows {[f'{s.text} ({s.origin})' for s in found]}"
    page.close()
    assert sorted(seen) == sorted(result.labs), f"lab pages found from the landing page: {seen}"
    assert result.executed == EXECUTED and all(result.figures[lab] > 0 for lab in EXECUTED)
    assert {f"labs/{lab}.html" for lab in result.labs} <= set(result.pages)  # lab numbers kept in the URLs
    assert not {p: k for p, k in result.unhandled_text.items() if p.startswith("labs/")}, result.unhandled_text
    assert any(h for h in _glossary_links(base, browser)), "no lab links a term to the glossary"


def _glossary_links(base: str, browser) -> list[str]:
    page = browser.new_page()
    try:
        page.goto(base + "/", wait_until="load")
        lab = next(h for h in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)") if "/labs/" in h)
        page.goto(lab, wait_until="load")
        return [h for h in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)") if "/glossary" in h]
    finally:
        page.close()
