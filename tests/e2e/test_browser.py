"""The real ComfyUI frontend (comfyui-frontend-package 1.32.9, served by the session's server) in headless Debian
Chromium, driven with Playwright's Python API: the app loads with the node registered, the node search finds it,
every workflow in workflows/ loads with no missing-node warning, the templates dialog lists the pack and loads the
tiny demo, and the tiny demo queued from the page's Run button completes (screenshots go to artifacts/).

Needs /usr/bin/chromium and the playwright Python package (scripts/install_browser.sh, which scripts/test.sh
runs); skips when either is missing. Playwright never downloads a browser here: executable_path points at
Debian's Chromium.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
TINY = REPO / "workflows" / "layerwise_offload_tiny_wan21_demo.json"
CHROMIUM = os.environ.get("LAYERWISE_OFFLOAD_CHROMIUM", "/usr/bin/chromium")
# What the machine notes prescribe for Chromium here (root, no GPU, closed network).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NODE = "LayerwiseOffload"
DISPLAY = "Layerwise Offload (DiT)"
PACK_FOLDER = "layerwise-offload"

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/install_browser.sh)")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (scripts/install_browser.sh installs Debian's)", allow_module_level=True)


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"browser_{name}.png"))


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def page(browser, comfy_server):
    # A returning user: no first-run template browser popping up over the canvas.
    status, _ = comfy_server.request("POST", "/api/settings", {"Comfy.TutorialCompleted": True})
    assert status == 200
    ctx = browser.new_context(viewport={"width": 1600, "height": 1000})
    pg = ctx.new_page()
    pg.page_errors = []
    pg.on("pageerror", lambda e: pg.page_errors.append(str(e)))
    pg.goto(comfy_server.url, wait_until="domcontentloaded")
    pg.wait_for_function("() => window.app && window.app.graph && window.LiteGraph && window.app.canvas",
                         timeout=90_000)
    yield pg
    ctx.close()


def _close_dialogs(pg) -> None:
    for _ in range(5):
        if pg.get_by_role("dialog").count() == 0:
            return
        pg.keyboard.press("Escape")
        pg.wait_for_timeout(300)


def _dialog_texts(pg):
    d = pg.get_by_role("dialog")
    return [d.nth(i).inner_text() for i in range(d.count())]


def _load(pg, wf: dict, name: str):
    _close_dialogs(pg)
    pg.evaluate("async ([w, name]) => { await window.app.loadGraphData(w, true, true, name); }", [wf, name])
    pg.wait_for_timeout(800)  # the warning dialogs open right after the graph is configured
    return _dialog_texts(pg)


def _broken_nodes(pg):
    return pg.evaluate("""() => window.app.graph._nodes
        .filter(n => n.has_errors || !window.LiteGraph.registered_node_types[n.type])
        .map(n => n.type)""")


# ------------------------------------------------------------------------------------------------ tests

def test_frontend_loads_with_the_node_registered(page):
    assert page.evaluate("() => !!window.LiteGraph.registered_node_types['LayerwiseOffload']")
    assert page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__")
    assert not page.page_errors, page.page_errors


def test_node_search_finds_and_adds_the_node(page):
    _close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    page.locator("#graph-canvas").dblclick(position={"x": 800, "y": 500})
    box = page.locator("input[placeholder*='Search']").first
    box.wait_for(state="visible", timeout=10_000)
    box.fill("Layerwise")
    option = page.get_by_role("option").filter(has_text=DISPLAY).first
    option.wait_for(state="visible", timeout=10_000)
    assert "layerwise_offload" in option.inner_text()  # the category path shown under the name
    _shot(page, "node_search")
    option.click()
    page.wait_for_timeout(300)
    assert page.evaluate("() => window.app.graph._nodes.map(n => n.type)") == [NODE]
    widgets = page.evaluate("() => Object.fromEntries(window.app.graph._nodes[0].widgets.map(w => [w.name, w.value]))")
    assert widgets == {"resident_layers": -1, "prefetch_size": 1, "residency_policy": "leading", "pin_memory": True}


def test_missing_node_detector_sees_a_missing_node(page):
    # Negative control for the next test: a node type nobody registered must be caught by both checks.
    wf = json.loads(TINY.read_text())
    wf["nodes"][0]["type"] = "DefinitelyNotARealNode"
    texts = _load(page, wf, "missing_control")
    assert any("missing nodes" in t.lower() for t in texts), texts
    assert _broken_nodes(page) == ["DefinitelyNotARealNode"]
    _close_dialogs(page)


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_workflow_loads_without_missing_nodes(page, path):
    wf = json.loads(path.read_text())
    texts = _load(page, wf, path.stem)
    assert not any("missing nodes" in t.lower() for t in texts), texts
    assert _broken_nodes(page) == []
    graph = page.evaluate("() => ({nodes: window.app.graph._nodes.length, links: Object.keys("
                          "window.app.graph.links instanceof Map ? Object.fromEntries(window.app.graph.links) "
                          ": window.app.graph.links).length})")
    assert graph == {"nodes": len(wf["nodes"]), "links": len(wf["links"])}
    missing_models = [t for t in texts if "Missing Models" in t]
    loaders = [n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "UNETLoader"]
    if "tiny" in path.stem:
        assert not texts, texts  # every file the tiny demo loads is on the server
    else:
        # The real models are not here: the frontend offers to download them, from the URLs the workflow carries.
        assert missing_models and all(name in missing_models[0] for name in loaders), texts
    _shot(page, f"workflow_{path.stem}")
    _close_dialogs(page)


def test_templates_dialog_lists_the_pack_and_loads_the_tiny_demo(page):
    _close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    page.get_by_role("button", name="Templates").first.click()
    dialog = page.get_by_role("dialog").first
    dialog.get_by_text(PACK_FOLDER, exact=True).first.click()
    for path in WORKFLOWS:
        dialog.get_by_text(path.stem, exact=True).first.wait_for(state="visible", timeout=10_000)
    _shot(page, "templates_dialog")
    dialog.get_by_text(TINY.stem, exact=True).first.click()
    page.wait_for_function("() => window.app.graph._nodes.some(n => n.type === 'LayerwiseOffload')", timeout=15_000)
    assert page.get_by_role("dialog").count() == 0, _dialog_texts(page)
    assert _broken_nodes(page) == []


def test_tiny_demo_queued_from_the_page_completes(page, comfy_server):
    _close_dialogs(page)
    _load(page, json.loads(TINY.read_text()), TINY.stem)
    before = set(comfy_server.get_json("/api/history"))
    page.get_by_role("button", name="Run", exact=True).first.click()
    deadline = time.monotonic() + 120
    new = []
    while time.monotonic() < deadline and not new:
        new = [k for k in comfy_server.get_json("/api/history") if k not in before]
        time.sleep(0.25)
    assert new, "the Run button queued nothing"
    entry = comfy_server.wait_for(new[0], timeout=120)
    _shot(page, "tiny_demo_after_run")
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    prompt = entry["prompt"][2]
    assert any(n["class_type"] == NODE for n in prompt.values())
    assert comfy_server.output_files(entry, "latents") and comfy_server.output_files(entry, "images")
    # The SaveImage node shows the decoded frames on the page.
    page.wait_for_function("""() => [...document.querySelectorAll('img')]
        .some(i => i.src.includes('/view') && i.src.includes('tiny_wan21'))""", timeout=30_000)
    _shot(page, "tiny_demo")
