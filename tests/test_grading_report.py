"""OUT_DIR/report.html (issue #40 item 8): the class at a glance, a static page with matplotlib figures.

A made-up notebook `t_report` (registered for the test) with two checks and recorded runs: each student's
1-rank and 4-rank ddp runs and an fsdp run, hand-sealed (tests/test_grading_units.py's helpers). The page is
checked as text here, and rendered in headless Chromium (every figure decodes, nothing runs).
"""
from __future__ import annotations

import nbformat
import pytest

from labkit.course.grading import checks as K
from labkit.course.grading import registry
from labkit.course.grading.batch import GradeOptions, run_batch
from test_grading_units import _answer, _nb, _run
from test_widgets_browser import CHROMIUM, FLAGS

NB = "t_report"
GIB = 2**30


@pytest.fixture
def report(tmp_path):
    registry.register(NB, [K.answer_equals("the answer", 1, "x", 42), K.cell_ran("every cell ran", 1)])
    subs = tmp_path / "subs"
    for i, student in enumerate(("ann", "bob", "cy")):
        (subs / student).mkdir(parents=True)
        runs = [_run("one", strategy="ddp", world_size=1, samples_per_s=100.0, peak_bytes=[20 * GIB]),
                _run("four", strategy="ddp", world_size=4, samples_per_s=300.0 + 20 * i, peak_bytes=[20 * GIB] * 4),
                _run("fsdp", strategy="fsdp", world_size=4, samples_per_s=250.0, peak_bytes=[8 * GIB] * 4)]
        nb = _nb(_answer("x", 42 if student != "cy" else 7), *runs, identity=NB)
        nbformat.write(nb, subs / student / f"{NB}.ipynb")
    result = run_batch(subs, tmp_path / "out", GradeOptions())
    yield tmp_path / "out" / "report.html", result
    registry.unregister(NB)


def test_the_report_shows_scores_pass_rates_failures_and_the_classs_runs(report):
    path, result = report
    page = path.read_text()
    assert page.count('<img alt="') == 3 and page.count("data:image/png;base64,") == 3
    assert "score distribution per lab" in page and "speedup vs GPUs" in page and "peak memory per strategy" in page
    assert "<td>t_report</td><td>the answer</td><td>2/3</td><td>67%</td>" in page
    assert "answer &#x27;x&#x27; = 7 is not the expected answer" in page  # the most common failure, escaped
    assert "<script" not in page
    assert {r.student: len(r.runs) for r in result.rows} == {"ann": 3, "bob": 3, "cy": 3}


@pytest.mark.slow  # starts Chromium
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_the_report_renders_in_chromium_with_every_figure(report, tmp_path):
    pytest.importorskip("playwright", reason="Playwright for Python is not installed (pip install playwright)")
    from playwright.sync_api import sync_playwright

    path, _ = report
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(path.as_uri())
            page.wait_for_function("() => [...document.images].every(i => i.complete)")
            widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth)")
            assert len(widths) == 3 and all(w > 100 for w in widths), widths
            assert page.locator("h2", has_text="Pass rate per check and test").count() == 1
            assert page.locator("table tr").count() > 3 and errors == []
        finally:
            browser.close()
