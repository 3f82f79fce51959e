"""The widgets work for a student: JupyterLab in headless Chromium, a control moved, the result changes.

JupyterLab listens on loopback with a token; Chromium (Debian's `chromium`) is driven by Playwright for
Python through `executable_path`, so no `playwright install` download is needed. Skipped, with the
reason, only where Chromium or Playwright is not installed.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import TESTS_DIR

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STEP_S = 120  # generous deadline per UI condition on a busy machine (not a timing claim)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 serving copies of notebooks 01 and 07; yields (base url, token)."""
    root = tmp_path_factory.mktemp("lab")
    for name in ("01_memory.ipynb", "07_model_parallel.ipynb"):
        shutil.copy(TESTS_DIR.parent / "notebooks" / name, root / name)
    with jupyterlab(root) as server:
        yield server


@contextlib.contextmanager
def jupyterlab(root: Path):
    """A JupyterLab server on 127.0.0.1 serving `root` (tests/test_grading_review_browser.py uses it too);
    yields (base url, token) and stops the server on exit."""
    pytest.importorskip("playwright", reason="Playwright for Python is not installed (pip install playwright)")
    from labkit.runtime.launch import free_port

    token, port = secrets.token_hex(16), free_port()
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root
    log = open(root / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JUPYTER_NO_CONFIG": "1", "JUPYTER_RUNTIME_DIR": str(root / "runtime")})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STEP_S
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (root / "server.log").read_text()[-3000:])
                time.sleep(0.3)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                        headless=True, args=FLAGS)
        context.set_default_timeout(STEP_S * 1000)
        try:
            yield context.new_page()
        finally:
            context.close()


def run_cell(page, base: str, token: str, notebook: str, marker: str):
    """Open `notebook`, wait for its kernel to be up, run the one cell whose code contains `marker`; returns the
    cell's output area."""
    page.goto(f"{base}/lab/tree/{notebook}?token={token}")
    # A keystroke that meets JupyterLab's kernel start-up can be lost (a loaded CI run lost 01's Ctrl+Enter):
    # wait for the status bar's "Idle" first, a condition, as tests/test_grading_review_browser.py does.
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for()
    cell = page.locator(".jp-CodeCell", has_text=marker).first
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")  # run this cell only
    return cell.locator(".jp-OutputArea")


def test_memory_calculator_in_jupyterlab(lab, page):
    base, token = lab
    out = run_cell(page, base, token, "01_memory.ipynb", "memory_calculator(")
    precision = out.locator(".widget-dropdown", has_text="precision").locator("select")
    precision.wait_for()
    table = out.locator(".jp-OutputArea-output", has_text="GiB (2^30 B)").first
    before = table.inner_text()
    assert "does not fit" in out.inner_text()
    precision.select_option("fp32")  # a control moved: 2 -> 4 B weights and grads
    page.wait_for_function("([el, old]) => el.innerText !== old", arg=[table.element_handle(), before],
                           timeout=STEP_S * 1000)
    assert table.inner_text() != before


def test_planner_in_jupyterlab(lab, page):
    base, token = lab
    out = run_cell(page, base, token, "07_model_parallel.ipynb", "planner_widget()")
    gpus = out.locator(".widget-inline-hbox", has_text="GPUs").locator("input").first
    gpus.wait_for()
    live = out.locator(".widget-output").first
    live.locator("text=layout(s) fit").first.wait_for()
    before = live.inner_text()
    printed = out.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
    assert "layout(s) fit" in printed.first.inner_text()  # printed as ordinary output too
    gpus.fill("32")
    gpus.press("Enter")
    page.wait_for_function("([el, old]) => el.innerText.includes('layout') && el.innerText !== old",
                           arg=[live.element_handle(), before], timeout=STEP_S * 1000)
    assert "on 32 x" in live.inner_text()
