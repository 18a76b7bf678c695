"""The real ComfyUI frontend (the one the session's ComfyUI pins: 1.32.9 for 0.3.75, 1.39 for 0.14.1, 1.49.6 for
0.33.0; or another served with --front-end-root, e.g. PyPI's comfyui-frontend-package 1.58.1:
LAYERWISE_OFFLOAD_FRONTEND_ROOT=<its static folder>) in headless Debian Chromium, driven with Playwright's Python
API: the app loads with the node registered, the node search finds it, every workflow in workflows/ loads with no
missing-node warning (1.32, 1.39: a dialog; 1.49: a toast and the Errors tab of the right side panel; the GGUF one
through ComfyUI-GGUF, installed next to this pack where shared/peers has it; without it, its loaders must be the
only missing nodes), a template's missing diffusion model (its Load Diffusion Model (Layerwise) file) is listed with
a Download button that opens the template's URL (this one on 1.58.1 too: scripts/test.sh), the templates dialog
lists the pack and loads the tiny demo, the tiny demo queued from the page's Run button completes
(test_browser_stats.py, with what the Stats node draws; screenshots go to artifacts/).

Needs /usr/bin/chromium and the playwright Python package (scripts/install_browser.sh, which scripts/test.sh
runs); skips when either is missing. Playwright never downloads a browser here: executable_path points at
Debian's Chromium.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from layerwise_offload.devtools.peers import PEER_NODES

from .browser_support import (ARTIFACTS, DISPLAY, NODE, REPO, TINY, browser, close_dialogs, dialog_texts, error_toast,
                              load, notices, open_app, open_node_search, open_templates, page, shot)

__all__ = ["browser", "page"]  # module-scoped fixtures, used here through the import

WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
LAYERWISE_LOADER = "LayerwiseOffloadLoadDiffusionModel"
# The canvas below the frontend's top bars, right of its sidebar (viewport 1600x1000).
THUMBNAIL_CLIP = {"x": 60, "y": 130, "width": 1120, "height": 840}


def _thumbnail(page, workflow: Path) -> Path:
    """The loaded graph at thumbnail size (4:3), to artifacts/thumbnails/. The served card pictures beside the
    workflows are drawn by devtools/make_workflows.py (block map and RAM), not taken from here."""
    from PIL import Image

    out = ARTIFACTS / "thumbnails" / f"{workflow.stem}.jpg"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Loaders, offload node and sampler at a readable zoom (from the column right of the note); no LiteGraph info.
    page.evaluate("""() => { const c = window.app.canvas; c.show_info = false; c.ds.scale = 0.9;
        const x = Math.min(...window.app.graph._nodes.filter(n => n.type !== 'MarkdownNote').map(n => n.pos[0]));
        c.ds.offset = [80 / 0.9 - x, 170 / 0.9]; c.setDirty(true, true); }""")
    page.wait_for_timeout(100)
    page.screenshot(path=str(out.with_suffix(".png")), clip=THUMBNAIL_CLIP)
    with Image.open(out.with_suffix(".png")) as im:
        im.convert("RGB").resize((480, 360), Image.LANCZOS).save(out, quality=82, optimize=True)
    out.with_suffix(".png").unlink()
    return out


def _open_error_details(pg) -> bool:
    """1.49: press View details on the error toast and wait for the Errors tab it opens. False: no toast."""
    toast = error_toast(pg)
    if not (toast.count() and toast.first.is_visible()):
        return False
    toast.first.get_by_role("button", name="View details").click()
    pg.locator("[data-testid=errors-summary-hero]").first.wait_for(state="visible", timeout=10_000)
    return True


def _missing_nodes_listing(pg):
    """Where the frontend names the node types a loaded workflow uses but nobody registered: the "This workflow has
    missing nodes" dialog (1.32, 1.39), or the Missing Node Packs group of the Errors tab that the error toast's
    View details opens (1.49; it lists them by the pack their cnr_id names, each pack expanded here to show the
    node types, as a person does). None when it names none (1.49: no toast, or an Errors tab without that group)."""
    import re

    dialog = pg.get_by_role("dialog").filter(has_text=re.compile("missing nodes", re.I))
    if dialog.count():
        return dialog.first
    group = pg.locator("[data-testid=error-group-missing-node]")
    if not (group.count() and group.first.is_visible()):
        _open_error_details(pg)
    if not (group.count() and group.first.is_visible()):
        return None
    collapsed = group.first.locator("[data-testid=missing-node-pack-expand][aria-expanded=false]")
    while collapsed.count():
        collapsed.first.click()
        pg.wait_for_timeout(200)
    return group.first


def _broken_nodes(pg):
    """The types of the nodes the frontend could not build: a type nobody registered, LiteGraph's missing-node
    placeholder (it keeps the node's JSON in last_serialization to save it back), or a node flagged has_errors for
    another reason than a model file the server lacks (1.32 and 1.39 flag only missing nodes; 1.49 also flags every
    loader whose combo names a file that is not in the server's list -- the templates' big models -- and lists
    those files under Missing Models)."""
    return pg.evaluate("""() => window.app.graph._nodes.filter(n => {
            const missingFile = (n.widgets || []).some(w => w.type === 'combo' && typeof w.value === 'string'
                && Array.isArray(w.options?.values) && !w.options.values.includes(w.value));
            return !window.LiteGraph.registered_node_types[n.type] || !!n.last_serialization
                || (n.has_errors && !missingFile); })
        .map(n => n.type)""")


def _undrawn_nodes(pg):
    """The types of the graph's nodes that LiteGraph did not draw in the last frame (not in canvas.visible_nodes)."""
    return pg.evaluate("""() => { const drawn = new Set((window.app.canvas.visible_nodes || []).map(n => n.id));
        return window.app.graph._nodes.filter(n => !drawn.has(n.id)).map(n => n.type); }""")


# ------------------------------------------------------------------------------------------------ tests

def test_frontend_loads_with_the_node_registered(page):
    assert page.evaluate("() => !!window.LiteGraph.registered_node_types['LayerwiseOffload']")
    assert page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__")
    assert not page.page_errors, page.page_errors


def test_node_search_finds_and_adds_the_node(page):
    import re

    close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    box = open_node_search(page)
    box.fill("Layerwise")
    option = page.get_by_role("option").filter(has_text=DISPLAY).first
    option.wait_for(state="visible", timeout=10_000)
    # The category path shown under the name: "model_patches > layerwise_offload" (1.32, 1.39), "model_patches /
    # layerwise_offload" (1.49, beside the pack's chip "layerwise-offload" and the description).
    assert re.search(r"model_patches\s*[>/]\s*layerwise_offload", option.inner_text()), option.inner_text()
    shot(page, "node_search")
    option.click()
    page.wait_for_timeout(300)
    assert page.evaluate("() => window.app.graph._nodes.map(n => n.type)") == [NODE]
    widgets = page.evaluate("() => Object.fromEntries(window.app.graph._nodes[0].widgets.map(w => [w.name, w.value]))")
    assert widgets == {"resident_layers": -1, "prefetch_size": 1, "residency_policy": "auto", "pin_memory": True,
                       "host_store": "auto"}


def test_missing_node_detector_sees_a_missing_node(page):
    # Negative control for the next test: a node type nobody registered must be caught by both checks: what the
    # frontend shows a person (1.32, 1.39: a "missing nodes" dialog naming it; 1.49: a toast "Missing node: <type>",
    # its View details opening the Errors tab whose Missing Node Packs group names it) and _broken_nodes.
    wf = json.loads(TINY.read_text())
    wf["nodes"][0]["type"] = "DefinitelyNotARealNode"
    texts = load(page, wf, "missing_control")
    assert any("missing node" in t.lower() and "DefinitelyNotARealNode" in t for t in texts), texts
    shot(page, "missing_node_control")
    listing = _missing_nodes_listing(page)
    assert listing is not None, notices(page)
    assert "DefinitelyNotARealNode" in listing.inner_text(), listing.inner_text()
    _seen_on_screen(page, listing, "the listing of the missing node")
    shot(page, "missing_node_control_listing")
    assert _broken_nodes(page) == ["DefinitelyNotARealNode"]
    close_dialogs(page)


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_workflow_loads_without_missing_nodes(page, path, missing_peers):
    import re

    wf = json.loads(path.read_text())
    texts = load(page, wf, path.stem)
    # Node types of peer packs the session's server lacks (their source is not on this machine) are the only
    # ones allowed to be missing, and the frontend must say so.
    absent = sorted(n["type"] for n in wf["nodes"] if PEER_NODES.get(n["type"], ("",))[0] in missing_peers)
    listing = _missing_nodes_listing(page)
    if absent:
        assert listing is not None and all(name in listing.inner_text() for name in absent), texts
        assert sorted(_broken_nodes(page)) == absent
        close_dialogs(page)
        pytest.skip(f"{', '.join(sorted(set(absent)))} missing as expected: "
                    + "; ".join(sorted(set(missing_peers.values()))))
    assert listing is None, listing.inner_text()
    assert not any("missing nodes" in t.lower() or "missing node:" in t.lower() for t in texts), texts
    # Every node is registered (ours and the template's core nodes), built from its class, and drawn.
    assert _broken_nodes(page) == []
    assert page.evaluate("""() => window.app.graph._nodes.filter(n => {
        const cls = window.LiteGraph.registered_node_types[n.type]; return !cls || !(n instanceof cls); })
        .map(n => n.type)""") == []
    assert _undrawn_nodes(page) == []
    graph = page.evaluate("() => ({nodes: window.app.graph._nodes.length, links: Object.keys("
                          "window.app.graph.links instanceof Map ? Object.fromEntries(window.app.graph.links) "
                          ": window.app.graph.links).length, types: window.app.graph._nodes.map(n => n.type)})")
    assert graph == {"nodes": len(wf["nodes"]), "links": len(wf["links"]), "types": [n["type"] for n in wf["nodes"]]}
    loaders = [n["widgets_values"][0] for n in wf["nodes"] if n["type"] in ("UNETLoader", LAYERWISE_LOADER)]
    if path == TINY:
        assert not texts, texts  # every file the tiny demo loads is on the server
    else:
        # The real models are not here: the frontend offers to download them, from the URLs the workflow carries
        # (1.32, 1.39: a "Missing Models" dialog; 1.49: the Missing Models group of the Errors tab).
        listing = _missing_models_listing(page)
        text = listing.inner_text()
        assert all(name in text for name in loaders), text
        with_url = sorted({m["name"] for n in wf["nodes"] for m in n.get("properties", {}).get("models", [])})
        for name in with_url:
            _model_row(listing, name)
        # .gguf files carry no URL (these frontends download only .safetensors); the note says where they come
        # from. 1.32 and 1.39 leave them out; 1.49 lists them (folder Unknown, the loader's title) with no Download.
        downloads = listing.get_by_role("button", name=re.compile(r"^Download\b(?! all)"))
        assert downloads.count() == len(with_url), text
        if listing.get_attribute("role") == "dialog":
            assert ".gguf" not in text, text
    shot(page, f"workflow_{path.stem}")
    close_dialogs(page)
    _thumbnail(page, path)


def test_templates_dialog_lists_the_pack_and_loads_the_tiny_demo(page):
    dialog = open_templates(page)
    for path in WORKFLOWS:
        dialog.get_by_text(path.stem, exact=True).first.wait_for(state="visible", timeout=10_000)
    # Each card shows its thumbnail (<name>.jpg beside the workflow), not a broken image.
    page.wait_for_function("""(n) => [...document.querySelectorAll('[role=dialog] img')]
        .filter(i => i.complete && i.naturalWidth === 480).length >= n""", arg=len(WORKFLOWS), timeout=15_000)
    shot(page, "templates_dialog")
    dialog.get_by_text(TINY.stem, exact=True).first.click()
    page.wait_for_function("() => window.app.graph._nodes.some(n => n.type === 'LayerwiseOffload')", timeout=15_000)
    assert page.get_by_role("dialog").count() == 0, dialog_texts(page)
    assert _broken_nodes(page) == []


# ------------------------------------------------------------------------------------------------ missing models
# Frontends 1.32 and 1.39 list the files a workflow names in properties.models but the server lacks in a "Missing
# Models" dialog, by folder, whatever the node type; 1.58 scans every combo widget whose value looks like a model
# file, marks it missing when the server's list lacks it, takes folder and URL from properties.models by name, and
# lists it under Issues in the right side panel ("View details" on its toast). Either way a Download button opens
# the URL (a browser: a link click, which the page hook below records instead of leaving the page). Before that the
# frontends ask Hugging Face for the size (HEAD); on a failed HEAD 1.32 and 1.39 open the repository page instead
# (their sign-in path for gated models), so the test answers the HEAD as the site does (page_online).

def _record_downloads(page) -> None:
    page.evaluate("""() => { window.__lwoDownloads = [];
        if (window.__lwoDownloadHook) return;
        window.__lwoDownloadHook = true;
        const click = HTMLAnchorElement.prototype.click;
        HTMLAnchorElement.prototype.click = function () {
            if (this.href && !this.href.startsWith(location.origin)) { window.__lwoDownloads.push(this.href); return; }
            return click.call(this); };
        window.open = (url) => { window.__lwoDownloads.push(String(url)); return null; }; }""")


def _answer_size_requests(route) -> None:
    if route.request.method != "HEAD":
        route.abort()
        return
    route.fulfill(status=200, body="", headers={"content-length": str(FAKE_SIZE), "access-control-allow-origin": "*"})


FAKE_SIZE = 23_802_932_552  # what the frontend shows as the file's size


def _missing_models_listing(page):
    """The element that lists the missing models, where this frontend shows it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    dialog = page.get_by_role("dialog").filter(has_text="Missing Models")
    group = page.locator("[data-testid=error-group-missing-model]")
    details = page.get_by_role("button", name="View details")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if dialog.count():
            return dialog.first
        if group.count() and group.first.is_visible():  # the Errors tab is open already (_missing_nodes_listing)
            return group.first
        if details.count() and details.first.is_visible():
            details.first.click()
            try:
                group.first.wait_for(state="visible", timeout=10_000)
            except PlaywrightTimeout:
                continue
            return group.first
        page.wait_for_timeout(250)
    shot(page, "missing_models_not_shown")
    raise AssertionError("no missing-models listing (artifacts/browser_missing_models_not_shown.png): "
                         + page.evaluate("() => document.body.innerText")[-2000:])


def _model_row(listing, name: str):
    """The innermost part of ``listing`` that names ``name`` and has a Download button: that file's row."""
    import re

    rows = listing.locator("li, div").filter(has_text=name).filter(
        has=listing.page.get_by_role("button", name=re.compile(r"^Download\b(?! all)")))
    assert rows.count(), f"{name} is not listed with a Download button: {listing.inner_text()}"
    return rows.last


def _seen_on_screen(page, locator, what: str) -> None:
    """What a person sees there: ``locator`` lies inside the viewport and the screenshot of its box is not blank
    (text drawn on it: dark and light pixels both)."""
    import io

    from PIL import Image

    box, viewport = locator.bounding_box(), page.viewport_size
    assert box and box["width"] > 4 and box["height"] > 4, f"{what}: not laid out on the page"
    assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= viewport["width"] + 1 and (
        box["y"] + box["height"] <= viewport["height"] + 1), f"{what}: outside the visible page at {box}"
    darkest, lightest = Image.open(io.BytesIO(page.screenshot(clip=box))).convert("L").getextrema()
    assert lightest - darkest > 80, f"{what}: blank on the screenshot (grey levels {darkest}..{lightest})"


def _close_missing_models(page) -> None:
    close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    page.wait_for_timeout(300)


@pytest.fixture
def page_online(browser, comfy_server):
    """A page that may reach Hugging Face as a user's does: the session's server runs with --disable-api-nodes,
    whose Content-Security-Policy (connect-src 'self') blocks the frontend's size request; the page ignores that
    policy and the test answers the request (the machine is offline)."""
    ctx, pg = open_app(browser, comfy_server, bypass_csp=True)
    pg.route("https://huggingface.co/**", _answer_size_requests)
    yield pg
    ctx.close()


def test_missing_diffusion_model_of_a_template_is_offered_for_download(page_online):
    """Flux.1 dev's template, as shipped: its *Load Diffusion Model (Layerwise)* names flux1-dev.safetensors, which
    this server lacks. The frontend lists that file in its diffusion_models folder with a Download button that
    opens the URL the template carries. Control: the same graph with the loader set to a file the server has
    (the tiny Wan) lists everything else but not that loader's file."""
    import re

    page = page_online
    path = next(p for p in WORKFLOWS if p.stem.startswith("Flux.1 dev"))
    wf = json.loads(path.read_text())
    loader = next(n for n in wf["nodes"] if n["type"] == LAYERWISE_LOADER)
    model = loader["properties"]["models"][0]
    assert (model["name"], model["directory"]) == (loader["widgets_values"][0], "diffusion_models")
    others = [m["name"] for n in wf["nodes"] if n is not loader for m in n["properties"].get("models", [])]
    assert others, "the text encoders and the VAE carry their downloads too"

    load(page, wf, path.stem)
    assert page.evaluate("(t) => window.app.graph._nodes.filter(n => n.type === t).length", LAYERWISE_LOADER) == 1
    listing = _missing_models_listing(page)
    row = _model_row(listing, model["name"])
    assert "diffusion_models" in row.inner_text(), row.inner_text()
    for name in others:
        _model_row(listing, name)
    shot(page, "missing_model_download")
    _seen_on_screen(page, row, f"the row of {model['name']}")
    _seen_on_screen(page, row.get_by_role("button", name=re.compile(r"^Download")).first, "its Download button")
    _record_downloads(page)
    row.get_by_role("button", name=re.compile(r"^Download")).first.click()
    page.wait_for_function("() => window.__lwoDownloads.length > 0", timeout=5_000)
    assert page.evaluate("() => window.__lwoDownloads") == [model["url"]]
    _close_missing_models(page)

    present = json.loads(TINY.read_text())
    tiny_file = next(n for n in present["nodes"] if n["type"] == "UNETLoader")["widgets_values"][0]
    loader["widgets_values"][0] = tiny_file
    loader["properties"]["models"] = [dict(model, name=tiny_file)]
    load(page, wf, path.stem + " (control)")
    listing = _missing_models_listing(page)
    for name in others:
        _model_row(listing, name)
    text = listing.inner_text()
    assert model["name"] not in text and tiny_file not in text, text
    shot(page, "missing_model_control")
    _close_missing_models(page)
