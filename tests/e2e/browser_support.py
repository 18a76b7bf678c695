"""The real ComfyUI frontend in headless Debian Chromium, driven with Playwright's Python API, for the browser tests
(tests/e2e/test_browser.py, test_browser_stats.py) to share: the module-scoped ``browser`` and ``page`` fixtures
(a page on the session's server), opening the app, its dialogs, the node search and the templates dialog, loading a
workflow, running from the page's Run button, screenshots and README pictures (to artifacts/).

Needs /usr/bin/chromium and the playwright Python package (scripts/install_browser.sh, which scripts/test.sh
runs); a test module that imports this one skips when either is missing. Playwright never downloads a browser here:
executable_path points at Debian's Chromium.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from .conftest import run_label

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / run_label()  # each side-by-side run its own (scripts/test.sh)
TINY = next((REPO / "workflows").glob("A tiny demo*.json"))
CHROMIUM = os.environ.get("LAYERWISE_OFFLOAD_CHROMIUM", "/usr/bin/chromium")
# What the machine notes prescribe for Chromium here (root, no GPU, closed network).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NODE = "LayerwiseOffload"
DISPLAY = "Layerwise Offload (DiT)"
PACK_FOLDER = "layerwise-offload"
# Rewrite the committed pictures in docs/ from this run.
UPDATE_PICTURES = os.environ.get("LAYERWISE_OFFLOAD_UPDATE_PICTURES") == "1"

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/install_browser.sh)")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (scripts/install_browser.sh installs Debian's)", allow_module_level=True)


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"browser_{name}.png"))


def picture(page, name: str, scale: float, origin, size) -> Path:
    """A README picture: the graph from ``origin`` (graph units) at ``scale``, ``size`` screen pixels. It goes to
    artifacts/docs/; with LAYERWISE_OFFLOAD_UPDATE_PICTURES=1 also to docs/."""
    x0, y0 = 70, 140  # below the top bars and the workflow name, right of the sidebar
    page.evaluate("""([s, gx, gy, x0, y0]) => { const c = window.app.canvas; c.show_info = false; c.ds.scale = s;
        c.ds.offset = [x0 / s - gx, y0 / s - gy]; c.setDirty(true, true); }""", [scale, *origin, x0, y0])
    page.wait_for_timeout(400)  # DOM widgets (the stats text) follow the next frame
    out = ARTIFACTS / "docs" / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out), clip={"x": x0, "y": y0, "width": size[0], "height": size[1]})
    if UPDATE_PICTURES:
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copyfile(out, REPO / "docs" / out.name)
    return out


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def open_app(browser, comfy_server, **context_options):
    # A returning user: no first-run template browser popping up over the canvas.
    status, _ = comfy_server.request("POST", "/api/settings", {"Comfy.TutorialCompleted": True})
    assert status == 200
    ctx = browser.new_context(viewport={"width": 1600, "height": 1000}, **context_options)
    pg = ctx.new_page()
    pg.page_errors = []
    pg.on("pageerror", lambda e: pg.page_errors.append(str(e)))
    pg.goto(comfy_server.url, wait_until="domcontentloaded")
    pg.wait_for_function("() => window.app && window.app.graph && window.LiteGraph && window.app.canvas",
                         timeout=90_000)
    return ctx, pg


@pytest.fixture(scope="module")
def page(browser, comfy_server):
    ctx, pg = open_app(browser, comfy_server)
    yield pg
    ctx.close()


def close_dialogs(pg) -> None:
    for _ in range(5):
        if pg.get_by_role("dialog").count() == 0:
            return
        pg.keyboard.press("Escape")
        pg.wait_for_timeout(300)


def open_node_search(pg):
    """Double-click the empty canvas as a person does. On a busy machine the page can take the two clicks as two
    single clicks; a person would double-click again, and so does this (each try leaves a screenshot). The box is
    the text field of the search dialog that opens, by what it says: "Search Nodes..." in 1.32 and 1.39, "Add a
    node..." in 1.49 and 1.58 (whose right side panel has a "Search ..." box of its own: not this one)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = pg.locator("input[placeholder*='Search Nodes' i], input[placeholder*='Add a node' i]").first
    for attempt in range(3):
        close_dialogs(pg)
        pg.locator("#graph-canvas").dblclick(position={"x": 800, "y": 500})
        try:
            box.wait_for(state="visible", timeout=5_000)
            return box
        except PlaywrightTimeout:
            shot(pg, f"node_search_try{attempt + 1}")
    raise AssertionError("double-clicking the canvas opened no node search box (artifacts/browser_node_search_try*)")


def dialog_texts(pg):
    d = pg.get_by_role("dialog")
    return [d.nth(i).inner_text() for i in range(d.count())]


def error_toast(pg):
    """1.49's warning after a load: a toast (role status) in the top right corner, "Missing node: <type>" or "<n>
    errors found", whose View details button opens the Errors tab of the right side panel. 1.32 and 1.39 open
    dialogs instead."""
    return pg.get_by_role("status").filter(has=pg.get_by_role("button", name="View details"))


def notices(pg):
    """What the page shows a person after a load: the texts of its dialogs and of its error toast."""
    toast = error_toast(pg)
    return dialog_texts(pg) + [toast.nth(i).inner_text() for i in range(toast.count()) if toast.nth(i).is_visible()]


def load(pg, wf: dict, name: str):
    close_dialogs(pg)
    pg.evaluate("async ([w, name]) => { await window.app.loadGraphData(w, true, true, name); }", [wf, name])
    pg.wait_for_timeout(800)  # the warning dialogs (the error toast) open right after the graph is configured
    return notices(pg)


def open_templates(page):
    close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    page.get_by_role("button", name="Templates").first.click()
    dialog = page.get_by_role("dialog").first
    dialog.get_by_text(PACK_FOLDER, exact=True).first.click()
    return dialog


def open_tiny_demo_as_a_template(page) -> None:
    """The tiny demo opened the way a user opens it: from the templates dialog, at the zoom the frontend picks
    (1.32 and 1.39 keep the workflow's own; 1.49 and 1.58 fit the graph to the window)."""
    open_templates(page).get_by_text(TINY.stem, exact=True).first.click()
    page.wait_for_function("() => window.app.graph._nodes.some(n => n.type === 'LayerwiseOffloadStats')",
                           timeout=15_000)
    page.wait_for_timeout(800)  # the fit happens after the graph is configured
    close_dialogs(page)


def run_from_page(page, comfy_server) -> dict:
    """Press the page's Run button and return the /history entry of the prompt it queued."""
    before = set(comfy_server.get_json("/api/history"))
    page.get_by_role("button", name="Run", exact=True).first.click()
    deadline = time.monotonic() + 120
    new = []
    while time.monotonic() < deadline and not new:
        new = [k for k in comfy_server.get_json("/api/history") if k not in before]
        time.sleep(0.25)
    assert new, "the Run button queued nothing"
    return comfy_server.wait_for(new[0], timeout=120)
