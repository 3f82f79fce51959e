"""No dead link in the student release: `labkit assign` carries the course files the notebooks link to."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.cli import main
from labkit.course import links
from labkit.errors import GradingError

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "notebooks"


def test_links_finds_relative_targets_only():
    text = ('[a](../docs/memory.md#zero) [b](https://x.org/y.md) <a href="../reservations/README.md">c</a> '
            '[d](#section) [e](policy.yaml "title") [a again](../docs/memory.md) ![img](data:image/png;base64,xx)')
    assert links.links(text) == ["../docs/memory.md", "../reservations/README.md", "policy.yaml"]


def test_the_course_links_only_to_files_that_exist():
    found = {str(p) for p in links.linked_files(SOURCE)}
    # the notebooks' own links, and what the reservations README links to in turn
    assert {"docs/memory.md", "reservations/README.md", "reservations/policy.yaml",
            "reservations/reserve.ipynb"} <= found


def test_a_released_notebook_has_no_dead_link(tmp_path, capsys):
    out = tmp_path / "release"
    with pytest.raises(SystemExit) as exit_:
        main(["assign", "--out", str(out), "--source", str(SOURCE)])
    assert exit_.value.code == 0 and "linked course file(s) beside them" in capsys.readouterr().out
    pages = sorted((out / "notebooks").glob("*.ipynb")) + sorted(p for p in out.rglob("*.md"))
    checked = 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if page.suffix == ".ipynb":
            text = "\n".join(c.source for c in nbformat.reads(text, 4).cells if c.cell_type == "markdown")
        for target in links.links(text):
            assert (page.parent / target).exists(), f"{page.relative_to(out)} links to {target}, missing in the release"
            checked += 1
    assert checked >= 5


def test_a_dead_link_stops_the_release_in_one_line(tmp_path, capsys):
    src = tmp_path / "notebooks"
    src.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("see [the docs](../docs/nowhere.md)")])
    nbformat.write(nb, str(src / "01_x.ipynb"))
    with pytest.raises(GradingError, match="01_x.ipynb links to '../docs/nowhere.md', which does not exist"):
        links.linked_files(src)
    with pytest.raises(SystemExit) as exit_:
        main(["assign", "--out", str(tmp_path / "out"), "--source", str(src)])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing written
