"""The Stats node in the real frontend (fixtures and helpers of test_browser.py): the tiny demo opened from the
templates dialog and queued from the page's Run button completes, and the node draws the run as a picture (block
map, VRAM, RAM, copy against compute per step; web/js/stats.js) that reads at the zoom the page opened the template
at: checked in the screenshot's pixels (the block colours inside the node) and the title's size on screen, on
frontends 1.32, 1.39 and 1.58 (LAYERWISE_OFFLOAD_FRONTEND_ROOT), in the classic canvas and in Nodes 2.0. With `after`
unconnected it asks for it; on a --cpu server without the CPU loopback it says the model was passed through.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from layerwise_offload.devtools.server import ComfyServer, prepare_base_dir

from .conftest import CPU_LOOPBACK_ENV, server_args
from .test_browser import (ARTIFACTS, NODE, TINY, _close_dialogs, _load, _open_tiny_demo_as_a_template, _picture,
                           _run_from_page, _shot, browser, page)

__all__ = ["browser", "page"]  # module-scoped fixtures, used here through the import


# The Stats node's picture (web/js/stats.js): its state, text, on-screen rectangle and title font size.
_STATS_BOX = """() => { const b = document.querySelector('[data-layerwiseoffload-state]'); if (!b) return null;
        const r = b.getBoundingClientRect(), t = b.firstElementChild.getBoundingClientRect();
        return {state: b.dataset.layerwiseoffloadState, text: b.innerText, x: r.left, y: r.top, w: r.width,
                h: r.height, title_px: t.height, blocks: b.querySelector('[data-layerwiseoffload-blocks]')
                ?.dataset.layerwiseoffloadBlocks ?? null, visible: r.width > 20 && r.height > 20 && r.bottom > 0
                && r.right > 0 && r.top < innerHeight && r.left < innerWidth
                && getComputedStyle(b).visibility !== 'hidden'}; }"""
# Block colours of web/js/stats.js: in VRAM, streamed from RAM.
RESIDENT_RGB, STREAMED_RGB = (0x2E, 0xA0, 0x43), (0xF0, 0x88, 0x3E)


def _stats_box(page, state: str) -> dict:
    page.wait_for_function(f"() => ({_STATS_BOX})()?.state === {state!r}", timeout=30_000)
    page.wait_for_timeout(300)  # the node grows to the picture on the next frame
    box = page.evaluate(_STATS_BOX)
    assert box["visible"], box
    return box


def _colour_pixels(page, box: dict, name: str) -> dict:
    """Screenshot of the page; how many pixels inside the Stats node's picture have each block colour."""
    from PIL import Image

    _shot(page, name)
    with Image.open(ARTIFACTS / f"browser_{name}.png") as im:
        rgb = im.convert("RGB")
        left, top = max(0, int(box["x"])), max(0, int(box["y"]))
        crop = rgb.crop((left, top, min(rgb.width, int(box["x"] + box["w"])), min(rgb.height, int(box["y"] + box["h"]))))
        counts = {"resident": 0, "streamed": 0}
        raw = crop.tobytes()
        for pixel in zip(raw[0::3], raw[1::3], raw[2::3]):
            for key, ref in (("resident", RESIDENT_RGB), ("streamed", STREAMED_RGB)):
                if sum(abs(a - b) for a, b in zip(pixel, ref)) < 40:
                    counts[key] += 1
    return counts


# The SaveImage node's preview: loaded images of this run, and the node's box on screen (CSS pixels).
_SAVE_IMAGE_PREVIEW = """() => { const n = window.app.graph._nodes.find(n => n.type === 'SaveImage');
        const imgs = (n?.imgs ?? []).filter(i => i.src.includes('tiny_wan21') && i.complete && i.naturalWidth > 0);
        if (!imgs.length) return null;
        const ds = window.app.canvas.ds, r = window.app.canvas.canvas.getBoundingClientRect();
        return {images: imgs.length, x: r.left + (n.pos[0] + ds.offset[0]) * ds.scale,
                y: r.top + (n.pos[1] + ds.offset[1]) * ds.scale, w: n.size[0] * ds.scale, h: n.size[1] * ds.scale}; }"""


def _assert_save_image_preview_drawn(page, name: str) -> None:
    """The SaveImage node holds this run's images, loaded, and the lower half of its box in the screenshot (where
    the preview goes, under the filename widget) shows a picture: many colours, not the node's flat background."""
    from PIL import Image

    page.wait_for_function(f"() => ({_SAVE_IMAGE_PREVIEW})() !== null", timeout=30_000)
    page.evaluate("() => window.app.canvas.setDirty(true, true)")
    page.wait_for_timeout(300)  # drawn on the next frame
    box = page.evaluate(_SAVE_IMAGE_PREVIEW)
    _shot(page, name)
    with Image.open(ARTIFACTS / f"browser_{name}.png") as im:
        rgb = im.convert("RGB")
        left, top = max(0, int(box["x"])), max(0, int(box["y"] + box["h"] / 2))
        crop = rgb.crop((left, top, min(rgb.width, int(box["x"] + box["w"])), min(rgb.height, int(box["y"] + box["h"]))))
        colours = len(set(zip(*[iter(crop.tobytes())] * 3)))
    assert crop.width > 20 and crop.height > 20 and colours > 50, (box, crop.size, colours)


def _opening_zoom(page) -> float:
    return page.evaluate("() => window.app.canvas.ds.scale")


def test_tiny_demo_queued_from_the_page_completes(page, comfy_server):
    """The tiny demo, installed by the README's step (tests/e2e/conftest.py), opened from the templates dialog
    and run from the page: the SaveImage node shows the pictures and the Stats node the run, in the screenshot."""
    _open_tiny_demo_as_a_template(page)
    zoom = _opening_zoom(page)  # what the frontend opens the template at (1.49 and 1.58 fit it to the window)
    # ... a zoom at which the frontend draws the nodes' text, not their low-detail outlines (issue 25: 0.55).
    assert zoom >= 0.78 and page.evaluate("() => window.app.canvas.low_quality") is not True, zoom
    # Before any run the node says what it will show.
    assert "Run the workflow" in _stats_box(page, "waiting")["text"]
    # As a user would try next: 2 of the 4 blocks resident instead of auto, so 2 stream.
    page.evaluate("""() => window.app.graph._nodes.find(n => n.type === 'LayerwiseOffload')
        .widgets.find(w => w.name === 'resident_layers').value = 2""")
    entry = _run_from_page(page, comfy_server)
    _shot(page, "tiny_demo_after_run")
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    prompt = entry["prompt"][2]
    assert any(n["class_type"] == NODE for n in prompt.values())
    assert comfy_server.output_files(entry, "latents") and comfy_server.output_files(entry, "images")
    # The SaveImage node shows the decoded frames on the page (its own preview: the finished-job toast's thumbnail
    # is gone after a few seconds), drawn in its box in the screenshot.
    _assert_save_image_preview_drawn(page, "tiny_demo")
    # ... and the stats node draws the run at the zoom the page opened at: the lines the server sent, the block map
    # (2 in VRAM, 2 streamed, in call order) in its colours, in pixels of the screenshot, and a title that reads.
    assert _opening_zoom(page) == zoom
    box = _stats_box(page, "run")
    data = [o["layerwise_offload"][0] for o in entry["outputs"].values() if "layerwise_offload" in o]
    [text] = [o["text"][0] for o in entry["outputs"].values() if "text" in o]
    assert len(data) == 1 and data[0]["blocks"] == box["blocks"] == "RRSS"
    # The lines the bars do not show are under the picture; the bars carry the figures of the memory line.
    assert set(data[0]["caption"]) <= set(text.splitlines())
    assert all(line in box["text"] for line in data[0]["caption"]), (data[0]["caption"], box["text"])
    assert data[0]["vram"]["text"] in box["text"] and data[0]["ram"]["text"] in box["text"], box["text"]
    assert "2 of 4 blocks in VRAM, 2 streamed" in box["text"] and re.search(r"copied per step in .*GB/s", text)
    assert "CPU loopback" in text and "pin_memory" not in text  # the CPU's limits said once, no contradiction
    colours = _colour_pixels(page, box, "stats_node_classic")
    # Each block is at least 24 x 12 graph units: two blocks of each colour leave hundreds of pixels at any zoom
    # the frontend opens at (0.8 for a 1600 x 1000 window).
    assert colours["resident"] > 100 and colours["streamed"] > 100, (colours, zoom)
    assert box["title_px"] >= 10, (box, zoom)  # the title (22 graph units) is at least 10 px on screen
    print(f"opening zoom {zoom:.2f}, title {box['title_px']:.1f} px, block pixels {colours}")
    _picture(page, "demo_after_run", 0.8, (-10, -40), (1200, 770))
    _picture(page, "stats_node", 1.2, (800, 430), (530, 590))


def test_stats_node_asks_for_after_when_it_is_unconnected(page, comfy_server):
    _close_dialogs(page)
    wf = json.loads(TINY.read_text())
    stats = next(n for n in wf["nodes"] if n["type"] == "LayerwiseOffloadStats")
    after = next(i for i in stats["inputs"] if i["name"] == "after")
    wf["links"] = [link for link in wf["links"] if link[0] != after["link"]]
    after["link"] = None
    _load(page, wf, "after_unconnected")
    hint = "Connect the sampler's LATENT output to `after`"
    assert hint in _stats_box(page, "waiting")["text"]
    entry = _run_from_page(page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    [text] = [o["text"][0] for o in entry["outputs"].values() if "text" in o]
    # Read before or after the sampler ran (nothing orders them): either way it says to connect `after`.
    assert "connect the sampler's LATENT output to `after`" in text, text
    page.wait_for_function("(t) => document.querySelector('[data-layerwiseoffload-state]')?.innerText.includes(t)",
                           arg="connect the sampler's LATENT output to `after`", timeout=30_000)
    _shot(page, "stats_after_unconnected")


def test_the_stats_node_keeps_its_size_when_the_workflow_is_loaded_again(page, comfy_server):
    """The node grows to hold its picture and no more: loading the same workflow again leaves it as it was (it grew
    by a few units at every load while the picture's height was measured from its own stretched box)."""
    _close_dialogs(page)
    size = "() => window.app.graph._nodes.find(n => n.type === 'LayerwiseOffloadStats').size.slice()"
    heights = []
    for attempt in range(3):
        _load(page, json.loads(TINY.read_text()), f"stats_size_{attempt}")
        page.wait_for_timeout(400)  # the picture is fitted on the next animation frame
        heights.append(page.evaluate(size)[1])
    assert heights[0] == heights[1] == heights[2], heights


def test_stats_picture_is_drawn_in_nodes_2_0(page, comfy_server):
    set_vue = "async (on) => { await window.app.extensionManager.setting.set('Comfy.VueNodes.Enabled', on); }"
    page.evaluate(set_vue, True)
    try:
        _close_dialogs(page)
        _load(page, json.loads(TINY.read_text()), TINY.stem)
        page.wait_for_selector("[data-node-id]", timeout=15_000)  # Vue nodes are DOM elements
        page.evaluate("""() => window.app.graph._nodes.find(n => n.type === 'LayerwiseOffload')
            .widgets.find(w => w.name === 'resident_layers').value = 2""")
        entry = _run_from_page(page, comfy_server)
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
        box = _stats_box(page, "run")
        assert box["blocks"] == "RRSS" and "2 of 4 blocks in VRAM" in box["text"], box
        colours = _colour_pixels(page, box, "stats_node_nodes2")
        assert colours["resident"] > 100 and colours["streamed"] > 100, colours
    finally:
        page.evaluate(set_vue, False)


@pytest.fixture(scope="module")
def passthrough_server(tmp_path_factory, comfy_base):
    """A second server as a user without a GPU starts it: --cpu, no LAYERWISE_OFFLOAD_CPU_LOOPBACK."""
    base = prepare_base_dir(tmp_path_factory.mktemp("comfy_base_cpu"))
    for sub in ("models/diffusion_models", "models/vae"):
        for src in (comfy_base / sub).iterdir():
            (base / sub / src.name).symlink_to(src.resolve())
    for sub in ("output", "datasets"):  # the saved conditioning: where each ComfyUI reads it
        for src in (comfy_base / sub).iterdir():
            shutil.copytree(src, base / sub / src.name)
    srv = ComfyServer(base, cpu=True, env={CPU_LOOPBACK_ENV: ""}, extra_args=server_args())
    srv.start(timeout=240)
    try:
        yield srv
    finally:
        srv.stop()


def test_a_cpu_server_says_the_model_was_passed_through(browser, passthrough_server):
    status, _ = passthrough_server.request("POST", "/api/settings", {"Comfy.TutorialCompleted": True})
    assert status == 200
    ctx = browser.new_context(viewport={"width": 1600, "height": 1000})
    pg = ctx.new_page()
    try:
        pg.goto(passthrough_server.url, wait_until="domcontentloaded")
        pg.wait_for_function("() => window.app && window.app.graph && window.app.canvas", timeout=90_000)
        _load(pg, json.loads(TINY.read_text()), TINY.stem)
        entry = _run_from_page(pg, passthrough_server)
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
        box = _stats_box(pg, "passed_through")
        [text] = [o["text"][0] for o in entry["outputs"].values() if "text" in o]
        assert text.startswith("passed through: ComfyUI runs on the CPU, nothing to offload"), text
        # The picture: "passed through" as its title, the reason under it.
        assert box["text"].startswith("passed through\nComfyUI runs on the CPU, nothing to offload"), box
        assert "connect the output of a Layerwise Offload node" not in box["text"]
        assert box["title_px"] >= 10, box
        _shot(pg, "stats_passed_through")
        log = passthrough_server.log_path.read_text()
        assert "[layerwise-offload] loaded; the Layerwise Offload node will pass models through: ComfyUI runs on " \
               "the CPU" in log
        assert "[layerwise-offload] run: passed through: ComfyUI runs on the CPU, nothing to offload" in log
    finally:
        ctx.close()
