"""Lecture decks: the deck syntax, the real decks' content, and the built HTML/PDF rendered in headless
Chromium (Debian's /usr/bin/chromium; `make slides` installs it): offline, non-blank, no missing images."""
from __future__ import annotations

import html.parser
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from labkit.course import slide_markup, slides  # noqa: E402
from labkit.errors import ConfigError  # noqa: E402
from labkit.memory.estimate import MemoryConfig, estimate  # noqa: E402

#: Course issue #10: the readings each deck must cite.
READINGS = {
    "01_memory": {"zero", "chen"},
    "02_single_gpu": {"chen", "micikevicius"},
    "03_ddp": {"ddp", "patarasuk", "baidu", "horovod"},
    "04_fsdp_zero": {"zero", "fsdp"},
    "06_peft": {"lora", "qlora"},
    "07_model_parallel": {"megatron", "gpipe"},
    "09_beyond_3d": {"nccltests", "zerobubble", "chinchilla"},
}
SLIDE_W, SLIDE_H = 1280, 720


def _write_deck(tmp_path: Path, body: str) -> Path:
    (tmp_path / "references.yaml").write_text("zero:\n  short: Rajbhandari et al. 2020\n  full: ZeRO paper\n")
    path = tmp_path / "01_demo.md"
    path.write_text("title: Demo deck\nnotebooks: 01_memory\n\n" + body)
    return path


def test_syntax_renders_lists_tables_code_facts_and_citations(tmp_path):
    deck = slides.parse_deck(_write_deck(tmp_path, """# First {.small}
- top **bold** and *em* [@zero]
  - nested `x * y`
1. one
| a | b |
|---|---|
| {{mem total model=llama2-7b}} | 2 |
```
code <b>
```
> callout
# Second
plain text
"""))
    assert [s.title for s in deck.slides] == ["First", "Second"] and deck.slides[0].classes == ("small",)
    body = deck.slides[0].body
    assert "<ul><li>top <strong>bold</strong> and <em>em</em> " in body
    assert '<span class="cite">(Rajbhandari et al. 2020)</span>' in body
    assert "<ul><li>nested <code>x * y</code></li></ul>" in body and "<ol><li>one</li></ol>" in body
    total = estimate(MemoryConfig(model="llama2-7b")).total / 1e9
    assert f"<td>{total:.1f} GB</td>" in body
    assert "<pre><code>code &lt;b&gt;</code></pre>" in body and "<blockquote>callout</blockquote>" in body
    assert deck.cited == ("zero",)
    html = slides.render_html(deck, slides.load_references(tmp_path / "references.yaml"))
    assert _sections(html) == 4  # title + 2 + Readings
    assert "ZeRO paper" in html


def test_figure_block_embeds_the_labkit_figure_as_svg(tmp_path):
    deck = slides.parse_deck(_write_deck(tmp_path, """# Fig {.split}
- left
```figure
fn: memory_stack
bars:
  full: {model: llama2-7b}
caption: "estimate: 7B"
```
"""))
    body = deck.slides[0].body
    assert '<div class="cols"><div class="col"><ul><li>left</li></ul></div><div class="col"><figure>' in body
    assert '<img src="data:image/svg+xml;base64,' in body and "<figcaption>estimate: 7B</figcaption>" in body


def test_ring_and_bubble_facts_come_from_the_comm_model():
    # 4 ranks: 2 (N-1)/N = 1.5; 102 MB of gradients -> 153 MB sent, at 12.5 GB/s 12.3 ms; p=4, m=8: 3/11
    assert slide_markup.fact("ring n=4") == "1.50"
    assert slide_markup.fact("ring n=4 bytes=102_000_000") == "153 MB"
    assert slide_markup.fact("ring n=4 bytes=102_000_000 bandwidth=12.5e+9") == "12 ms"
    assert slide_markup.fact("bubble stages=4 microbatches=8") == "27%"
    # the same idle time over the compute, (p-1)/m = 3/8 (Narayanan et al. 2021); ZeRO at K = 8 micro-batches
    assert slide_markup.fact("bubble_ratio stages=4 microbatches=8") == "38%"
    assert slide_markup.fact("bubble_ratio stages=4 microbatches=8 chunks=2") == "19%"
    assert slide_markup.fact("dp_traffic zero=2 microbatches=8") == "4.5x"
    assert slide_markup.fact("dp_traffic zero=3 microbatches=8") == "12x"


@pytest.mark.parametrize("body,match", [
    ("# S\n- [@nope]\n", r"01_demo.md:4: unknown citation \[@nope\]"),
    ("# S\n{{volume x=1}}\n", "unknown fact 'volume'"),
    ("# S\n{{mem size model=llama2-7b}}\n", "the part must be one of"),
    ("# S\n```figure\nfn: no_such_plot\n```\n", "'no_such_plot' is neither in labkit.viz.plots nor labkit.viz.figures"),
    ("# S\n```figure\nfn: lora_update\ncaption: a: b\n```\n", "not valid YAML"),
    ("# S\n```\nopen\n", "unclosed"),
    ("no slides here\n", "no slides"),
])
def test_deck_errors_name_the_place_and_the_fix(tmp_path, body, match):
    with pytest.raises(ConfigError, match=match):
        slides.parse_deck(_write_deck(tmp_path, body))


def test_build_refuses_an_unknown_deck_listing_the_valid_ones(tmp_path, capsys):
    assert slides.main(["build", "99_nope", "--no-pdf", "--out", str(tmp_path)]) == 1
    assert "valid decks are: 01_memory, 02_single_gpu" in capsys.readouterr().out


def test_real_decks_are_lectures_that_cite_their_readings():
    refs = slides.load_references()
    decks = {p.stem: p for p in slides.deck_paths()}
    assert set(decks) == set(READINGS)
    for name, path in decks.items():
        text = path.read_text()
        cited = set(re.findall(r"@([\w-]+)", " ".join(re.findall(r"\[(@[^\]]+)\]", text))))
        assert READINGS[name] <= cited, f"{name} does not cite {READINGS[name] - cited}"
        assert cited <= set(refs)
        assert 8 <= len(re.findall(r"^# ", text, re.M)) <= 15, name
        assert re.search(r"^fn: ", text, re.M), f"{name} has no labkit figure"


# ----------------------------------------------------------------------------- built and rendered
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not Path(slides.CHROMIUM).exists():
        pytest.fail(f"{slides.CHROMIUM} is missing: `make slides` installs Debian's chromium "
                    "(or `sudo apt-get install -y chromium`)")
    out = tmp_path_factory.mktemp("slides")
    paths = slides.build(out=out, pdf=True, chromium=slides.CHROMIUM)
    return out, {p.stem: p for p in paths if p.suffix == ".html"}


class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs = []

    def handle_starttag(self, tag, attrs):
        self.refs += [(tag, k, v) for k, v in attrs if k in ("src", "href", "srcset", "poster", "data")]


@pytest.mark.slow  # renders every deck in chromium: not in `make test-fast`
def test_html_loads_nothing_from_outside(built):
    out, decks = built
    for page in [*decks.values(), out / "index.html"]:
        text = page.read_text()
        parser = _Refs()
        parser.feed(text)
        for tag, attr, value in parser.refs:
            assert value.startswith("data:") or not re.match(r"^([a-z][a-z0-9+.-]*:|//)", value, re.I), \
                f"{page.name}: <{tag} {attr}={value[:60]}> is not local"
        assert not re.search(r"url\(\s*['\"]?(https?:|//)", text) and "@import" not in text


@pytest.mark.slow  # renders every deck in chromium: not in `make test-fast`
def test_one_pdf_page_per_slide(built):
    out, decks = built
    for name, page in decks.items():
        sections = _sections(page.read_text())
        pdf = (out / f"{name}.pdf").read_bytes()
        assert pdf.startswith(b"%PDF") and len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", pdf)) == sections, name


def _sections(text: str) -> int:
    return len(re.findall(r'<section class="slide[^"]*" data-n="\d+"', text))


def _render(page: Path, shot: Path) -> tuple[str, int]:
    sections = _sections(page.read_text())
    url = page.resolve().as_uri() + "?all"
    dom = slides.run_chromium(["--virtual-time-budget=5000", "--dump-dom", url])
    slides.run_chromium([f"--window-size={SLIDE_W},{SLIDE_H * sections}", f"--screenshot={shot}", url])
    return dom, sections


@pytest.mark.slow  # renders every deck in chromium: not in `make test-fast`
def test_every_slide_renders_non_blank_with_all_images(built, tmp_path):
    from PIL import Image

    _, decks = built
    with ThreadPoolExecutor(max_workers=2) as pool:
        rendered = dict(zip(decks, pool.map(lambda kv: _render(kv[1], tmp_path / f"{kv[0]}.png"), decks.items())))
    for name, (dom, sections) in rendered.items():
        body = re.search(r"<body([^>]*)>", dom).group(1)
        assert 'data-checked="yes"' in body, f"{name}: the deck's self-check did not run"
        assert 'data-broken-images="0"' in body, f"{name}: images failed to load: {body}"
        assert 'data-overflow=""' in body, f"{name}: content overflows slide(s) {body}"
        assert dom.count("<img ") == decks[name].read_text().count("<img ") > 0
        shot = np.asarray(Image.open(tmp_path / f"{name}.png").convert("L"), dtype=float)
        assert shot.shape == (SLIDE_H * sections, SLIDE_W)
        for n in range(sections):
            tile = shot[n * SLIDE_H:(n + 1) * SLIDE_H]
            inked = (np.abs(tile - np.median(tile)) > 40).mean()
            assert tile.std() > 8 and inked > 0.005, f"{name} slide {n + 1} looks blank (ink {inked:.4f})"

