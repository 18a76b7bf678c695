"""The real ComfyUI frontend (the one the session's ComfyUI pins: 1.32.9 for 0.3.75, 1.39 for 0.14.1; or another
served with --front-end-root, e.g. PyPI's comfyui-frontend-package 1.58.1: LAYERWISE_OFFLOAD_FRONTEND_ROOT=<its
static folder>) in headless Debian Chromium, driven with Playwright's Python API: the app loads with the node
registered, the node search finds it, every workflow in workflows/ loads with no missing-node warning (the GGUF one
through ComfyUI-GGUF, installed next to this pack where shared/peers has it; without it, its loaders must be the only
missing nodes), the templates dialog lists the pack and loads the tiny demo, the tiny demo queued from the page's Run
button completes (test_browser_stats.py, with what the Stats node draws; screenshots go to artifacts/).

Needs /usr/bin/chromium and the playwright Python package (scripts/install_browser.sh, which scripts/test.sh
runs); skips when either is missing. Playwright never downloads a browser here: executable_path points at
Debian's Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from layerwise_offload.devtools.peers import PEER_NODES

from .conftest import run_label

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / run_label()  # each side-by-side run its own (scripts/test.sh)
WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
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
# The canvas below the frontend's top bars, right of its sidebar (viewport 1600x1000).
THUMBNAIL_CLIP = {"x": 60, "y": 130, "width": 1120, "height": 840}

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/install_browser.sh)")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (scripts/install_browser.sh installs Debian's)", allow_module_level=True)


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"browser_{name}.png"))


def _thumbnail(page, workflow: Path) -> Path:
    """The loaded graph at thumbnail size (4:3), to artifacts/thumbnails/. The served card pictures beside the
    workflows are drawn by devtools/make_workflows.py (block map and RAM), not taken from here."""
    from PIL import Image

    out = ARTIFACTS / "thumbnails" / f"{workflow.stem}.jpg"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Loaders, offload node and sampler at a readable zoom (the note is left of x = 0); no LiteGraph info text.
    page.evaluate("""() => { const c = window.app.canvas; c.show_info = false; c.ds.scale = 0.9;
        c.ds.offset = [80 / 0.9, 170 / 0.9]; c.setDirty(true, true); }""")
    page.wait_for_timeout(100)
    page.screenshot(path=str(out.with_suffix(".png")), clip=THUMBNAIL_CLIP)
    with Image.open(out.with_suffix(".png")) as im:
        im.convert("RGB").resize((480, 360), Image.LANCZOS).save(out, quality=82, optimize=True)
    out.with_suffix(".png").unlink()
    return out


def _picture(page, name: str, scale: float, origin, size) -> Path:
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


def _open_node_search(pg):
    """Double-click the empty canvas as a person does. On a busy machine the page can take the two clicks as two
    single clicks; a person would double-click again, and so does this (each try leaves a screenshot)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = pg.locator("input[placeholder*='Search']").first
    for attempt in range(3):
        _close_dialogs(pg)
        pg.locator("#graph-canvas").dblclick(position={"x": 800, "y": 500})
        try:
            box.wait_for(state="visible", timeout=5_000)
            return box
        except PlaywrightTimeout:
            _shot(pg, f"node_search_try{attempt + 1}")
    raise AssertionError("double-clicking the canvas opened no node search box (artifacts/browser_node_search_try*)")


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
    box = _open_node_search(page)
    box.fill("Layerwise")
    option = page.get_by_role("option").filter(has_text=DISPLAY).first
    option.wait_for(state="visible", timeout=10_000)
    assert "layerwise_offload" in option.inner_text()  # the category path shown under the name
    _shot(page, "node_search")
    option.click()
    page.wait_for_timeout(300)
    assert page.evaluate("() => window.app.graph._nodes.map(n => n.type)") == [NODE]
    widgets = page.evaluate("() => Object.fromEntries(window.app.graph._nodes[0].widgets.map(w => [w.name, w.value]))")
    assert widgets == {"resident_layers": -1, "prefetch_size": 1, "residency_policy": "leading", "pin_memory": True,
                       "host_store": "auto"}


def test_missing_node_detector_sees_a_missing_node(page):
    # Negative control for the next test: a node type nobody registered must be caught by both checks.
    wf = json.loads(TINY.read_text())
    wf["nodes"][0]["type"] = "DefinitelyNotARealNode"
    texts = _load(page, wf, "missing_control")
    assert any("missing nodes" in t.lower() for t in texts), texts
    assert _broken_nodes(page) == ["DefinitelyNotARealNode"]
    _close_dialogs(page)


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_workflow_loads_without_missing_nodes(page, path, missing_peers):
    wf = json.loads(path.read_text())
    texts = _load(page, wf, path.stem)
    # Node types of peer packs the session's server lacks (their source is not on this machine) are the only
    # ones allowed to be missing, and the frontend must say so.
    absent = sorted(n["type"] for n in wf["nodes"] if PEER_NODES.get(n["type"], ("",))[0] in missing_peers)
    if absent:
        missing = [t for t in texts if "missing nodes" in t.lower()]
        assert missing and all(name in missing[0] for name in absent), texts
        assert sorted(_broken_nodes(page)) == absent
        _close_dialogs(page)
        pytest.skip(f"{', '.join(sorted(set(absent)))} missing as expected: "
                    + "; ".join(sorted(set(missing_peers.values()))))
    assert not any("missing nodes" in t.lower() for t in texts), texts
    assert _broken_nodes(page) == []
    graph = page.evaluate("() => ({nodes: window.app.graph._nodes.length, links: Object.keys("
                          "window.app.graph.links instanceof Map ? Object.fromEntries(window.app.graph.links) "
                          ": window.app.graph.links).length})")
    assert graph == {"nodes": len(wf["nodes"]), "links": len(wf["links"])}
    missing_models = [t for t in texts if "Missing Models" in t]
    loaders = [n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "UNETLoader"]
    if path == TINY:
        assert not texts, texts  # every file the tiny demo loads is on the server
    else:
        # The real models are not here: the frontend offers to download them, from the URLs the workflow carries.
        assert missing_models and all(name in missing_models[0] for name in loaders), texts
        # .gguf files carry no URL (this frontend downloads only .safetensors); the note says where they come from.
        assert not any(".gguf" in t for t in missing_models), texts
    _shot(page, f"workflow_{path.stem}")
    _close_dialogs(page)
    _thumbnail(page, path)


def _open_templates(page):
    _close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    page.get_by_role("button", name="Templates").first.click()
    dialog = page.get_by_role("dialog").first
    dialog.get_by_text(PACK_FOLDER, exact=True).first.click()
    return dialog


def _open_tiny_demo_as_a_template(page) -> None:
    """The tiny demo opened the way a user opens it: from the templates dialog, at the zoom the frontend picks
    (1.32 and 1.39 keep the workflow's own; 1.58 fits the graph to the window)."""
    _open_templates(page).get_by_text(TINY.stem, exact=True).first.click()
    page.wait_for_function("() => window.app.graph._nodes.some(n => n.type === 'LayerwiseOffloadStats')",
                           timeout=15_000)
    page.wait_for_timeout(800)  # the fit happens after the graph is configured
    _close_dialogs(page)


def test_templates_dialog_lists_the_pack_and_loads_the_tiny_demo(page):
    dialog = _open_templates(page)
    for path in WORKFLOWS:
        dialog.get_by_text(path.stem, exact=True).first.wait_for(state="visible", timeout=10_000)
    # Each card shows its thumbnail (<name>.jpg beside the workflow), not a broken image.
    page.wait_for_function("""(n) => [...document.querySelectorAll('[role=dialog] img')]
        .filter(i => i.complete && i.naturalWidth === 480).length >= n""", arg=len(WORKFLOWS), timeout=15_000)
    _shot(page, "templates_dialog")
    dialog.get_by_text(TINY.stem, exact=True).first.click()
    page.wait_for_function("() => window.app.graph._nodes.some(n => n.type === 'LayerwiseOffload')", timeout=15_000)
    assert page.get_by_role("dialog").count() == 0, _dialog_texts(page)
    assert _broken_nodes(page) == []


def _run_from_page(page, comfy_server) -> dict:
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
