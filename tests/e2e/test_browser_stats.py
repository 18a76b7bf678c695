"""What a person sees of the pack in the real frontend (fixtures and helpers of browser_support.py); scripts/test.sh
also runs this file on the newest frontend, 1.58.1 (LAYERWISE_OFFLOAD_FRONTEND_ROOT).

- The tiny demo opened from the templates dialog and queued from the page's Run button completes, and the Stats
  node draws the run as a picture (block map, VRAM, RAM, copy against compute per step; web/js/stats.js) that reads
  at the zoom the page opened the template at: checked in the screenshot's pixels (the block colours inside the
  node) and the title's size on screen, in the classic canvas and in Nodes 2.0. With `after` unconnected it asks
  for it; on a --cpu server without the CPU loopback it says the model was passed through.
- The node search's preview shows the pack's defaults wherever it shows a core node's.
- The README's demo, step by step as it says, on a fresh --base-directory ComfyUI with the newest frontend: the
  Stats node's block map on the screenshot is the one in the README's picture.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from layerwise_offload.devtools.server import PACK_FOLDER, ComfyServer, prepare_base_dir

from .conftest import CPU_LOOPBACK_ENV, FRONTEND_ROOT_ENV, server_args
from .browser_support import (ARTIFACTS, DISPLAY, NODE, REPO, TINY, UPDATE_PICTURES, browser, close_dialogs, load,
                              open_app, open_node_search, open_tiny_demo_as_a_template, page, picture, run_from_page,
                              shot)

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

    shot(page, name)
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
    shot(page, name)
    with Image.open(ARTIFACTS / f"browser_{name}.png") as im:
        rgb = im.convert("RGB")
        left, top = max(0, int(box["x"])), max(0, int(box["y"] + box["h"] / 2))
        crop = rgb.crop((left, top, min(rgb.width, int(box["x"] + box["w"])), min(rgb.height, int(box["y"] + box["h"]))))
        colours = len(set(zip(*[iter(crop.tobytes())] * 3)))
    assert crop.width > 20 and crop.height > 20 and colours > 50, (box, crop.size, colours)


def _opening_zoom(page) -> float:
    return page.evaluate("() => window.app.canvas.ds.scale")


def _run_the_tiny_demo_from_the_page(page, server, name: str):
    """The tiny demo opened from the templates dialog, ``resident_layers`` set to 2 as the README says, and run from
    the page's Run button: the SaveImage node shows the pictures and the Stats node the run, in the screenshot.
    Returns the /history entry and the Stats node's picture box."""
    open_tiny_demo_as_a_template(page)
    zoom = _opening_zoom(page)  # what the frontend opens the template at (1.49 and 1.58 fit it to the window)
    # ... a zoom at which the frontend draws the nodes' text, not their low-detail outlines (0.55 did not).
    assert zoom >= 0.78 and page.evaluate("() => window.app.canvas.low_quality") is not True, zoom
    # Before any run the node says what it will show.
    assert "Run the workflow" in _stats_box(page, "waiting")["text"]
    # As a user would try next: 2 of the 4 blocks resident instead of auto, so 2 stream.
    page.evaluate("""() => window.app.graph._nodes.find(n => n.type === 'LayerwiseOffload')
        .widgets.find(w => w.name === 'resident_layers').value = 2""")
    entry = run_from_page(page, server)
    shot(page, f"{name}_after_run")
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    prompt = entry["prompt"][2]
    assert any(n["class_type"] == NODE for n in prompt.values())
    assert server.output_files(entry, "latents") and server.output_files(entry, "images")
    # The SaveImage node shows the decoded frames on the page (its own preview: the finished-job toast's thumbnail
    # is gone after a few seconds), drawn in its box in the screenshot.
    _assert_save_image_preview_drawn(page, name)
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
    assert "2 of 4 blocks in VRAM, 2 streamed" in box["text"] and re.search(r"copied per step in .*\d [kMG]B/s", text)
    assert "CPU loopback" in text and "pin_memory" not in text  # the CPU's limits said once, no contradiction
    colours = _colour_pixels(page, box, f"{name}_stats_node")
    # Each block is at least 24 x 12 graph units: two blocks of each colour leave hundreds of pixels at any zoom
    # the frontend opens at (0.8 for a 1600 x 1000 window).
    assert colours["resident"] > 100 and colours["streamed"] > 100, (colours, zoom)
    assert box["title_px"] >= 10, (box, zoom)  # the title (22 graph units) is at least 10 px on screen
    print(f"opening zoom {zoom:.2f}, title {box['title_px']:.1f} px, block pixels {colours}")
    return entry, box


def test_tiny_demo_queued_from_the_page_completes(page, comfy_server):
    """The tiny demo, installed by the README's step (tests/e2e/conftest.py), run from the page. On the newest
    frontend the README's own test below does the same from a fresh base directory."""
    if _frontend_version(page) >= NEWEST_FRONTEND:
        pytest.skip("test_the_readmes_demo_on_a_fresh_base_directory_draws_the_readmes_picture runs it here")
    _run_the_tiny_demo_from_the_page(page, comfy_server, "tiny_demo")
    picture(page, "stats_node", 1.2, (800, 430), (530, 590))  # docs/internals.md's (the README's: below)


def test_stats_node_asks_for_after_when_it_is_unconnected(page, comfy_server):
    close_dialogs(page)
    wf = json.loads(TINY.read_text())
    stats = next(n for n in wf["nodes"] if n["type"] == "LayerwiseOffloadStats")
    after = next(i for i in stats["inputs"] if i["name"] == "after")
    wf["links"] = [link for link in wf["links"] if link[0] != after["link"]]
    after["link"] = None
    load(page, wf, "after_unconnected")
    hint = "Connect the sampler's LATENT output to `after`"
    assert hint in _stats_box(page, "waiting")["text"]
    entry = run_from_page(page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    [text] = [o["text"][0] for o in entry["outputs"].values() if "text" in o]
    # Read before or after the sampler ran (nothing orders them): either way it says to connect `after`.
    assert "connect the sampler's LATENT output to `after`" in text, text
    page.wait_for_function("(t) => document.querySelector('[data-layerwiseoffload-state]')?.innerText.includes(t)",
                           arg="connect the sampler's LATENT output to `after`", timeout=30_000)
    shot(page, "stats_after_unconnected")


def test_the_stats_node_keeps_its_size_when_the_workflow_is_loaded_again(page, comfy_server):
    """The node grows to hold its picture and no more: loading the same workflow again leaves it as it was (it grew
    by a few units at every load while the picture's height was measured from its own stretched box)."""
    close_dialogs(page)
    size = "() => window.app.graph._nodes.find(n => n.type === 'LayerwiseOffloadStats').size.slice()"
    heights = []
    for attempt in range(3):
        load(page, json.loads(TINY.read_text()), f"stats_size_{attempt}")
        page.wait_for_timeout(400)  # the picture is fitted on the next animation frame
        heights.append(page.evaluate(size)[1])
    assert heights[0] == heights[1] == heights[2], heights


def test_stats_picture_is_drawn_in_nodes_2_0(page, comfy_server):
    set_vue = "async (on) => { await window.app.extensionManager.setting.set('Comfy.VueNodes.Enabled', on); }"
    page.evaluate(set_vue, True)
    try:
        close_dialogs(page)
        load(page, json.loads(TINY.read_text()), TINY.stem)
        page.wait_for_selector("[data-node-id]", timeout=15_000)  # Vue nodes are DOM elements
        page.evaluate("""() => window.app.graph._nodes.find(n => n.type === 'LayerwiseOffload')
            .widgets.find(w => w.name === 'resident_layers').value = 2""")
        entry = run_from_page(page, comfy_server)
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
        load(pg, json.loads(TINY.read_text()), TINY.stem)
        entry = run_from_page(pg, passthrough_server)
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
        box = _stats_box(pg, "passed_through")
        [text] = [o["text"][0] for o in entry["outputs"].values() if "text" in o]
        assert text.startswith("passed through: ComfyUI runs on the CPU, nothing to offload"), text
        # The picture: "passed through" as its title, the reason under it.
        assert box["text"].startswith("passed through\nComfyUI runs on the CPU, nothing to offload"), box
        assert "connect the output of a Layerwise Offload node" not in box["text"]
        assert box["title_px"] >= 10, box
        shot(pg, "stats_passed_through")
        log = passthrough_server.log_path.read_text()
        assert "[layerwise-offload] loaded; the Layerwise Offload node will pass models through: ComfyUI runs on " \
               "the CPU" in log
        assert "[layerwise-offload] run: passed through: ComfyUI runs on the CPU, nothing to offload" in log
    finally:
        ctx.close()


# ------------------------------------------------------------------------------------------------ the search preview
# Hovering a node in the node search shows a preview of it with its widgets. Frontends 1.32 and 1.58 draw the
# defaults there; 1.49 (ComfyUI 0.33's own) draws every number as 0 and every toggle as off, for core nodes too
# (KSampler's steps and cfg: 0), while the node placed from the search has the real defaults (test_browser.py). So
# the pack's defaults must show wherever the frontend shows KSampler's (docs/install.md says why 1.49 shows 0).

_PREVIEW = """() => {
    const vue = document.querySelector('[data-node-id^="preview-"]');
    if (vue) return {kind: 'vue', title: vue.innerText.split('\\n')[0],
        numbers: [...vue.querySelectorAll('input')].map(i => i.value),
        toggles: [...vue.querySelectorAll('[aria-checked]')].map(e => e.getAttribute('aria-checked'))};
    const legacy = document.querySelector('._sb_node_preview');
    return legacy ? {kind: 'legacy', title: legacy.innerText.split('\\n')[0],
                     lines: legacy.innerText.split('\\n').map(s => s.trim())} : null; }"""


def _search_preview(page, title: str, numbers, toggles) -> dict:
    """The widget values the node search's preview of ``title`` shows: ``{"numbers": [...], "toggles": [...]}`` in
    the order named (the Vue preview of 1.49 and 1.58 lists them in the node's input order)."""
    close_dialogs(page)
    page.evaluate("() => window.app.graph.clear()")
    box = open_node_search(page)
    box.fill(title)
    option = page.get_by_role("option").filter(has_text=title).first
    option.wait_for(state="visible", timeout=10_000)
    option.hover()
    page.wait_for_function(f"() => ({_PREVIEW})()?.title === {title!r}", timeout=10_000)
    shown = page.evaluate(_PREVIEW)
    shot(page, f"search_preview_{title.split()[0]}")
    page.keyboard.press("Escape")
    if shown["kind"] == "legacy":  # rows of "name", "value"
        lines = shown["lines"]
        value = lambda name: lines[lines.index(name) + 1]  # noqa: E731
        return {"numbers": [value(n) for n in numbers], "toggles": [value(t) for t in toggles]}
    assert len(shown["numbers"]) >= len(numbers) and len(shown["toggles"]) >= len(toggles), shown
    return {"numbers": shown["numbers"][:len(numbers)], "toggles": shown["toggles"][:len(toggles)]}


def _frontend_version(page) -> tuple:
    return tuple(int(p) for p in page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__").split(".")[:2])


def test_node_search_preview_shows_the_defaults_wherever_it_shows_core_nodes(page):
    core = _search_preview(page, "KSampler", ["seed", "steps", "cfg"], [])
    ours = _search_preview(page, DISPLAY, ["resident_layers", "prefetch_size"], ["pin_memory"])
    shows_defaults = [float(v) for v in core["numbers"]] == [0, 20, 8]
    version = _frontend_version(page)
    if version >= (1, 58) or version < (1, 40):
        assert shows_defaults, (version, core)
    if shows_defaults:
        assert [float(v) for v in ours["numbers"]] == [-1, 1] and ours["toggles"] == ["true"], (version, ours)
    else:  # 1.49: the preview's own zeros, as it draws KSampler's
        assert core["numbers"] == ["0", "0", "0"] and ours == {"numbers": ["0", "0"], "toggles": ["false"]}, (
            version, core, ours)


# ------------------------------------------------------------------------------------------------ the README's demo
# The README's steps as a ComfyUI user without a GPU takes them, on the newest frontend: ComfyUI 0.33 started with
# --base-directory on a folder that holds only custom_nodes/layerwise-offload (models/ not made yet) and the CPU
# loopback switch, the demo installer run from the pack's folder while it runs, the template opened from the
# templates dialog, resident_layers set to 2, Run. Then the Stats node's block map on the screenshot must be the one
# in the README's picture (docs/demo_after_run.png), read from that picture's pixels the same way.
# LAYERWISE_OFFLOAD_UPDATE_PICTURES=1 writes the README's picture from this run first.

README = REPO / "README.md"
README_PICTURE = REPO / "docs" / "demo_after_run.png"
# Block colours of web/js/stats.js, by the letter the server sends for the block.
BLOCK_RGB = {"R": RESIDENT_RGB, "P": (0xA3, 0xB1, 0x39), "S": STREAMED_RGB, "D": (0x89, 0x57, 0xE5)}
NEWEST_FRONTEND = (1, 58)


def _colour_regions(rgb, ref, tolerance: int = 40):
    """The 4-connected regions of pixels within ``tolerance`` (sum of channel differences) of ``ref``, as
    ``(left, top, width, height)``."""
    import numpy as np

    a = np.asarray(rgb, dtype=np.int16)
    mask = np.abs(a - np.array(ref, dtype=np.int16)).sum(axis=-1) < tolerance
    todo = set(zip(*np.nonzero(mask)))
    regions = []
    while todo:
        stack = [todo.pop()]
        ys, xs = [], []
        while stack:
            y, x = stack.pop()
            ys.append(y)
            xs.append(x)
            for nb in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if nb in todo:
                    todo.remove(nb)
                    stack.append(nb)
        regions.append((min(xs), min(ys), max(xs) - min(xs) + 1, max(ys) - min(ys) + 1))
    return regions


def block_map_seen(rgb) -> str:
    """The block map a person sees in a picture: the largest squarish cells in the block colours (the legend's
    squares and the time bars are smaller or flat), left to right, row by row, as the letters the server sends."""
    cells = [(key, r) for key, ref in BLOCK_RGB.items() for r in _colour_regions(rgb, ref)
             if r[2] >= 6 and 0.4 <= r[3] / r[2] <= 2.5]
    if not cells:
        return ""
    tallest = max(r[3] for _, r in cells)
    cells = [(key, r) for key, r in cells if r[3] >= 0.75 * tallest]
    return "".join(key for key, r in sorted(cells, key=lambda c: (round(c[1][1] / tallest), c[1][0])))


def _readme_frontend() -> tuple:
    """The frontend this run serves with --front-end-root, from its folder's name (frontend-1.58.1), or ()."""
    root = os.environ.get(FRONTEND_ROOT_ENV, "")
    found = re.search(r"frontend-(\d+)\.(\d+)", root)
    return (int(found.group(1)), int(found.group(2))) if found else ()


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """ComfyUI as the README starts it for a CPU user: its own folders in a --base-directory that holds only the
    pack (cloned there: a link to this repository), the CPU loopback on."""
    if _readme_frontend() < NEWEST_FRONTEND:
        pytest.skip("the README's pictures are of the newest frontend: scripts/test.sh runs this with "
                    f"{FRONTEND_ROOT_ENV} set to frontend 1.58.1")
    base = tmp_path_factory.mktemp("readme_base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(REPO, target_is_directory=True)
    srv = ComfyServer(base, cpu=True, env={CPU_LOOPBACK_ENV: "1"}, extra_args=server_args())
    srv.start(timeout=240)
    try:
        yield srv
    finally:
        srv.stop()


def test_the_readmes_demo_on_a_fresh_base_directory_draws_the_readmes_picture(browser, readme_server):
    readme = README.read_text(encoding="utf-8")
    # The steps below are the README's own.
    for step in ("python demo/install_tiny_demo.py", "Templates > Extensions > layerwise-offload",
                 "`resident_layers` to 2", "LAYERWISE_OFFLOAD_CPU_LOOPBACK=1", "--base-directory"):
        assert step in readme.replace("**", ""), step
    base = readme_server.base_dir
    assert not (base / "models").exists(), "ComfyUI made models/ itself: this is not the case the README covers"
    pack = base / "custom_nodes" / PACK_FOLDER
    r = subprocess.run([sys.executable, "demo/install_tiny_demo.py"], cwd=str(pack), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PWD": str(pack)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"running ComfyUI (pid {readme_server.proc.pid})" in r.stdout, r.stdout
    assert (base / "models" / "diffusion_models").is_dir() and (base / "models" / "vae").is_dir(), r.stdout

    ctx, pg = open_app(browser, readme_server)
    try:
        assert _frontend_version(pg) >= NEWEST_FRONTEND
        _, box = _run_the_tiny_demo_from_the_page(pg, readme_server, "readme_demo")
        from PIL import Image

        shot(pg, "readme_demo")
        with Image.open(ARTIFACTS / "browser_readme_demo.png") as im:
            on_screen = block_map_seen(im.convert("RGB").crop(
                (int(box["x"]), int(box["y"]), int(box["x"] + box["w"]), int(box["y"] + box["h"]))))
        assert on_screen == "RRSS", (on_screen, box)
        if UPDATE_PICTURES:  # this run's pictures become the docs', then the README's is checked like any other
            picture(pg, "demo_after_run", 0.8, (-10, -40), (1200, 770))
            picture(pg, "stats_node", 1.2, (800, 430), (530, 590))
        with Image.open(README_PICTURE) as im:
            in_readme = block_map_seen(im.convert("RGB"))
        assert in_readme == on_screen, (f"README's picture shows {in_readme!r}, the demo {on_screen!r}: "
                                        "LAYERWISE_OFFLOAD_UPDATE_PICTURES=1 rewrites docs/demo_after_run.png")
        assert not pg.page_errors, pg.page_errors
    finally:
        ctx.close()


def test_block_map_is_read_from_the_cells_not_the_legend_or_the_bars():
    """Negative control for block_map_seen: a drawn map R S S D with its legend squares and a long copy bar in the
    streamed colour reads as RSSD; without the map, as nothing."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (420, 260), (0x16, 0x1B, 0x22))
    draw = ImageDraw.Draw(im)
    for i, key in enumerate("RSSD"):
        draw.rectangle((10 + 40 * i, 20, 10 + 40 * i + 37, 57), fill=BLOCK_RGB[key])
    for i, key in enumerate("RSD"):
        draw.rectangle((10 + 90 * i, 70, 21 + 90 * i, 81), fill=BLOCK_RGB[key])  # legend squares
    draw.rectangle((10, 200, 400, 209), fill=STREAMED_RGB)  # a copy bar
    assert block_map_seen(im) == "RSSD"
    draw.rectangle((0, 0, 420, 60), fill=(0x16, 0x1B, 0x22))
    assert block_map_seen(im) != "RSSD"
