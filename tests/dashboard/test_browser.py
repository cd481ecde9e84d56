"""The dashboard in a real browser: ``instrumented-alloc dashboard`` (a subprocess, streamlit on 127.0.0.1)
opened in headless Chromium through Playwright.

- Incident review of a recording with injected faults: the violation id is on the page, the page map is drawn
  (an image with pixels), and the screenshot is kept under ``test-artifacts/`` (git-ignored).
- Live: while a demo process writes a recording (a double free injected early: violations keep coming), the
  page's violation count grows, with no reload of the page (a marker set in the page's window survives); the
  instrumentation's self-cost is shown: iterations per second (no more than the demo's pace) and host µs per
  iteration (more than nothing, less than an iteration lasts).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dashboard.pagemap import layout
from exporters.recorder import Recording
from tests.ci import missing
from tests.dashboard.conftest import demo_process, violations_in, wait_for

REPO = Path(__file__).resolve().parents[2]
PACE = 20  # the live test's demo: steps per second
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
READ_STEP = """() => {
  for (const m of document.querySelectorAll('[data-testid="stMetric"]')) {
    const label = m.querySelector('[data-testid="stMetricLabel"]');
    if (label && label.innerText.trim() === 'step')
      return parseInt(m.querySelector('[data-testid="stMetricValue"]').innerText.replace(/,/g, ''));
  }
  return -1;
}"""
# The value text of the metric labelled LABEL ("" when there is none), one read in the page.
READ_METRIC = """(label) => {
  for (const m of document.querySelectorAll('[data-testid="stMetric"]')) {
    const l = m.querySelector('[data-testid="stMetricLabel"]');
    if (l && l.innerText.trim() === label) return m.querySelector('[data-testid="stMetricValue"]').innerText.trim();
  }
  return '';
}"""
SELF_COST_METRICS = f"() => [({READ_METRIC})('iterations/s'), ({READ_METRIC})('host µs per iteration')]"
VIOLATIONS_METRIC = '[data-testid="stMetric"]:has-text("violations") [data-testid="stMetricValue"]'
# The same value read in the page (CSS has no :has-text): the metric whose label is "violations".
READ_VIOLATIONS = """() => {
  for (const m of document.querySelectorAll('[data-testid="stMetric"]')) {
    const label = m.querySelector('[data-testid="stMetricLabel"]');
    if (label && label.innerText.trim() === 'violations')
      return parseInt(m.querySelector('[data-testid="stMetricValue"]').innerText.replace(/,/g, ''));
  }
  return -1;
}"""


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed (pip install -e '.[dashboard,test]')")
    if not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)):
        missing(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dashboard:
    """``instrumented-alloc dashboard RECORDING... --port N`` as a subprocess, until ``stop()``; ``recording``: one
    path or a list of them (side by side)."""

    def __init__(self, recording, *extra):
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        paths = [str(p) for p in recording] if isinstance(recording, list) else [str(recording)]
        self.log = Path(paths[0]).with_suffix(".dashboard.log")
        self.out = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "instrumented_alloc.cli", "dashboard", *paths, "--port", str(self.port), *extra],
            cwd=REPO, env=env, stdout=self.out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}/"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        pytest.fail(f"the dashboard did not come up: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.out.close()


def test_incident_review_in_chromium(browser, recordings):
    (_, s1, rid1, inv1), _ = recordings.faults
    with Recording(recordings.dir / "faults.sqlite") as r:
        n_here = len(r.violations(s1, s1 + 1))
        pools = r.meta["pools"]
    dash = Dashboard(recordings.dir / "faults.sqlite")
    try:
        # Streamlit scrolls inside its own container: a tall window is what puts the whole page in the screenshot.
        page = browser.new_page(viewport={"width": 1500, "height": 2600})
        page.goto(dash.url)
        page.wait_for_selector(f"text=Violations at step {s1}: {n_here}", timeout=60_000)
        page.wait_for_selector('[data-testid="stImage"] img', timeout=30_000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('[data-testid=\"stImage\"] img')]"
            ".filter(i => i.complete && i.naturalWidth > 0).length >= 2",
            timeout=30_000,
        )
        body = page.inner_text("body")
        assert inv1 in body and f"request {rid1}" in body
        assert "Traceback" not in body
        sizes = page.eval_on_selector_all(
            '[data-testid="stImage"] img', "els => els.map(i => [i.naturalWidth, i.naturalHeight])"
        )
        # One cell per page (page 0 too): full 2,049 and swa 769 entries, 64 cells per row of 12 px.
        expected = []
        for p in pools:
            _, cells, columns, scale = layout(p["num_pages"] + 1)
            expected.append([columns * scale, -(-cells // columns) * scale])
        assert sizes == expected == [[768, 396], [768, 156]]
        page.wait_for_selector('[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg',
                               timeout=30_000)  # fmt: skip
        time.sleep(1.0)  # let the charts finish drawing before the picture
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-incident.png"), full_page=True)
        page.get_by_text("Live", exact=True).click()
        page.wait_for_selector(VIOLATIONS_METRIC, timeout=30_000)
        page.wait_for_selector('[data-testid="stImage"] img', timeout=30_000)
        time.sleep(1.0)
        page.screenshot(path=str(ARTIFACTS / "dashboard-live-finished.png"), full_page=True)
        page.close()
    finally:
        dash.stop()


def test_live_view_follows_a_recording_being_written(browser, tmp_path):
    path = tmp_path / "live.sqlite"
    # A paced demo that runs until killed; the double free corrupts the pool, and violations keep coming.
    writer = demo_process(
        path, "--preset", "swa-128", "--pace", str(PACE), "--seed", "4", "--inject", "double-free@20"
    )
    dash = None
    try:
        wait_for(lambda: violations_in(path) != [], 120, "the demo's first violation")
        dash = Dashboard(path, "--refresh", "2")
        page = browser.new_page(viewport={"width": 1500, "height": 2200})
        page.goto(dash.url)
        page.get_by_text("Live", exact=True).click()
        page.wait_for_selector(VIOLATIONS_METRIC, timeout=60_000)
        page.evaluate("() => { window.__not_reloaded = 'yes'; }")
        # One read in the page: the metric is redrawn by every refresh, so two separate reads (the locator's text,
        # then the page's) can straddle one and disagree.
        first = page.evaluate(READ_VIOLATIONS)
        assert first >= 1  # the demo had recorded a violation before the dashboard opened
        assert page.locator(VIOLATIONS_METRIC).count() == 1
        # The count grows while we only watch: the fragment re-runs on its own, the page is never reloaded.
        page.wait_for_function(f"() => ({READ_VIOLATIONS})() >= {first + 2}", timeout=60_000)
        later = page.evaluate(READ_VIOLATIONS)
        assert later >= first + 2
        assert page.evaluate("() => window.__not_reloaded") == "yes"
        assert "open" in page.inner_text('[data-testid="stMetric"]:has-text("recording")')
        # The self-cost figures, once the window holds iterations (two step boundaries), from one read of the page.
        page.wait_for_function(
            f"() => {{ const [its, us] = ({SELF_COST_METRICS})(); "
            r"return /^[\d,.]+$/.test(its) && /^[\d,.]+ µs$/.test(us); }",
            timeout=60_000,
        )
        its_text, us_text = page.evaluate(SELF_COST_METRICS)
        its, us = float(its_text.replace(",", "")), float(us_text.removesuffix(" µs").replace(",", ""))
        assert 0 < its <= 1.5 * PACE, its_text  # the demo sleeps to its pace, never faster
        # Time the instrumentation spent in an iteration: some, and less than the iteration lasted (1 / its).
        assert 0 < us < 1e6 / its, (its_text, us_text)
        caption = page.locator('[data-testid="stCaptionContainer"]:has-text("Host time the instrumentation")')
        assert "1% of it is 100 µs" in caption.first.inner_text()
        # For the picture: stop the writer, then wait for a refresh that has drawn the whole page from one state
        # (during a refresh the parts not yet redrawn still show the previous one).
        writer.kill()
        writer.communicate(timeout=10)
        settled = (
            f"() => {{ const s = ({READ_STEP})(); return s >= 0 && "
            "document.body.innerText.includes('Now (step ' + s + ')') && "
            "!document.querySelector('[data-testid=\"stStatusWidget\"]'); }"
        )
        page.wait_for_function(settled, timeout=60_000)
        time.sleep(1.0)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)
        page.close()
    finally:
        if dash is not None:
            dash.stop()
        writer.kill()
        writer.communicate(timeout=10)


def test_ranks_side_by_side_in_chromium(browser, ranks):
    # `instrumented-alloc dashboard run-tp0.sqlite run-tp1.sqlite`: each rank in its own column, headed by its
    # engine and rank, rank 0 left of rank 1 on one row.
    dash = Dashboard([ranks / "run-tp0.sqlite", ranks / "run-tp1.sqlite"])
    try:
        page = browser.new_page(viewport={"width": 1500, "height": 2600})
        page.goto(dash.url)
        captions = []
        for rank, steps in ((0, "0..6"), (1, "0..9")):
            who = f"engine e0 · rank {rank} · tp_rank {rank} · steps {steps}"
            sel = f'[data-testid="stCaptionContainer"]:has-text("{who}")'
            page.wait_for_selector(sel, timeout=60_000)
            captions.append(page.locator(sel))
        assert [c.count() for c in captions] == [1, 1]
        assert captions[0].inner_text().startswith("run-tp0.sqlite · engine e0 · rank 0 · tp_rank 0 · steps 0..6")
        assert captions[1].inner_text().startswith("run-tp1.sqlite · engine e0 · rank 1 · tp_rank 1 · steps 0..9")
        boxes = [c.bounding_box() for c in captions]
        assert boxes[0]["x"] + boxes[0]["width"] <= boxes[1]["x"] and abs(boxes[0]["y"] - boxes[1]["y"]) < 5
        page.wait_for_selector("text=Violations at step 4: 1", timeout=30_000)
        page.wait_for_selector("text=Violations at step 7: 1", timeout=30_000)
        body = page.inner_text("body")
        assert "double_free" in body and "request_leak" in body and "Traceback" not in body
        page.wait_for_function(
            "() => [...document.querySelectorAll('[data-testid=\"stImage\"] img')]"
            ".filter(i => i.complete && i.naturalWidth > 0).length >= 2",
            timeout=30_000,
        )
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-ranks.png"), full_page=True)
        page.get_by_text("Live", exact=True).click()
        page.wait_for_function(
            "() => [...document.querySelectorAll('[data-testid=\"stMetric\"]')].filter(m => "
            "m.querySelector('[data-testid=\"stMetricLabel\"]').innerText.trim() === 'step')"
            ".map(m => m.querySelector('[data-testid=\"stMetricValue\"]').innerText).join(',') === '6,9'",
            timeout=60_000,
        )
        page.close()
    finally:
        dash.stop()
