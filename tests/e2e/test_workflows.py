"""Every file in workflows/ is a clean UI-format graph for the ComfyUI under test: node types registered (so no
missing-node warning), links consistent on both ends and with the server's declared types, required inputs
connected, widget values accepted, a LayerwiseOffload node fed straight by a model loader, and a note on
choosing resident_layers. A workflow that needs another pack (the GGUF one: ComfyUI-GGUF's loader) is checked
against the session's server, which has that pack installed next to this one; it is skipped, saying why, where
the pack's source is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerwise_offload.devtools.peers import PEER_NODES
from layerwise_offload.devtools.server import PACK_FOLDER
from layerwise_offload.devtools.workflow_api import FRONTEND_ONLY, validate_workflow, workflow_to_prompt

REPO = Path(__file__).resolve().parents[2]
FILES = sorted((REPO / "workflows").glob("*.json"))
NODE = "LayerwiseOffload"
LAYERWISE_LOADER = "LayerwiseOffloadLoadDiffusionModel"
LOADERS = ("UNETLoader", LAYERWISE_LOADER, "UnetLoaderGGUF")

# The families the brief asks for, each with the diffusion model file(s) its loader must name.
EXPECTED = {
    "Flux.1 dev": ["flux1-dev.safetensors"],
    "Wan 2.1 T2V 14B": ["wan2.1_t2v_14B_bf16.safetensors"],
    "Wan 2.2 T2V A14B fp8": ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                             "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"],  # before its prefix below
    "Wan 2.2 T2V A14B GGUF": ["Wan2.2-T2V-A14B-HighNoise-Q4_K_M.gguf", "Wan2.2-T2V-A14B-LowNoise-Q4_K_M.gguf"],
    "Wan 2.2 T2V A14B": ["wan2.2_t2v_high_noise_14B_fp16.safetensors", "wan2.2_t2v_low_noise_14B_fp16.safetensors"],
    "Qwen-Image": ["qwen_image_fp8_e4m3fn.safetensors"],
    "HunyuanVideo": ["hunyuan_video_t2v_720p_bf16.safetensors"],
    "A tiny demo": ["layerwise_offload_tiny_wan21.safetensors"],
}


def _load(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def test_every_family_has_a_workflow():
    names = [p.stem for p in FILES]
    for prefix in EXPECTED:
        assert any(n.startswith(prefix) for n in names), f"no workflow for {prefix} in {names}"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_workflow_is_valid_for_this_comfyui(path, object_info, missing_peers):
    wf = _load(path)
    needs = {PEER_NODES[n["type"]][0] for n in wf["nodes"] if n["type"] in PEER_NODES}
    if needs & set(missing_peers):
        pytest.skip("; ".join(missing_peers[folder] for folder in sorted(needs & set(missing_peers))))
    tiny = path.stem.startswith("A tiny demo")
    problems = validate_workflow(wf, object_info, check_files=tiny)
    assert not problems, "\n".join(problems)
    # The frontend would produce a prompt the server accepts (checked for real on the tiny one in test_server).
    workflow_to_prompt(wf, object_info)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_offload_sits_between_loader_and_sampler(path):
    wf = _load(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = {lk[0]: lk for lk in wf["links"]}
    offload = [n for n in wf["nodes"] if n["type"] == NODE]
    loaders = [n for n in wf["nodes"] if n["type"] in LOADERS]
    expected_files = next(v for k, v in EXPECTED.items() if path.stem.startswith(k))
    assert sorted(n["widgets_values"][0] for n in loaders) == sorted(expected_files)
    assert len(offload) == len(loaders) >= 1, "one LayerwiseOffload per diffusion model"
    for n in offload:
        src = nodes[links[n["inputs"][0]["link"]][1]]
        assert src["type"] in LOADERS, f"node {n['id']} is fed by {src['type']}"
        assert n["outputs"][0]["links"], f"node {n['id']}'s MODEL output goes nowhere"
        resident, prefetch, policy, pin, host_store = n["widgets_values"]
        assert resident == -1, "shipped workflows start in auto mode; the note gives fixed counts"
        assert prefetch >= 1 and policy in ("auto", "leading", "strided") and isinstance(pin, bool)
        assert host_store == "auto", "shipped workflows keep blocks in RAM while they fit, the rest on disk"
        assert n["properties"].get("cnr_id") == "layerwise-offload"
    for st in (n for n in wf["nodes"] if n["type"] == "LayerwiseOffloadStats"):
        model_src = nodes[links[st["inputs"][0]["link"]][1]]
        assert model_src["type"] == NODE, f"stats node {st['id']} reads {model_src['type']}, not the offload"
    notes = [n for n in wf["nodes"] if n["type"] in FRONTEND_ONLY and n["type"] != "Reroute"]
    assert any("resident_layers" in (n.get("widgets_values") or [""])[0] for n in notes), \
        "no Note/MarkdownNote explains resident_layers"


WAN22 = [p for p in FILES if p.stem.startswith("Wan 2.2")]


@pytest.mark.parametrize("path", WAN22, ids=[p.stem for p in WAN22])
def test_wan22_runs_each_expert_through_its_own_offload_and_sampler(path):
    wf = _load(path)
    samplers = [n for n in wf["nodes"] if n["type"] == "KSamplerAdvanced"]
    assert len(samplers) == 2
    by_start = sorted(samplers, key=lambda n: n["widgets_values"][7])
    hi, lo = by_start
    assert hi["widgets_values"][0] == "enable" and hi["widgets_values"][9] == "enable"
    assert lo["widgets_values"][0] == "disable" and lo["widgets_values"][9] == "disable"
    assert hi["widgets_values"][8] == lo["widgets_values"][7], "the low-noise pass starts where the high one ends"
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = {lk[0]: lk for lk in wf["links"]}

    def loader_of(node):  # walk the MODEL input upstream to the loader
        while node["type"] not in LOADERS:
            model_in = next(i for i in node["inputs"] if i["type"] == "MODEL")
            node = nodes[links[model_in["link"]][1]]
        return node["widgets_values"][0]

    assert "high_noise" in loader_of(hi).lower().replace("highnoise", "high_noise")
    assert "low_noise" in loader_of(lo).lower().replace("lownoise", "low_noise")


def test_gguf_wan22_is_the_fp16_graph_with_comfyui_gguf_loaders():
    fp16 = _load(next(p for p in WAN22 if p.stem.startswith("Wan 2.2 T2V A14B - ")))
    gguf = _load(next(p for p in WAN22 if p.stem.startswith("Wan 2.2 T2V A14B GGUF")))
    assert gguf["links"] == fp16["links"] and gguf["id"] != fp16["id"]
    swapped = []
    for a, b in zip(fp16["nodes"], gguf["nodes"]):
        if a["type"] in LOADERS:
            swapped.append(b)
            assert b["type"] == "UnetLoaderGGUF" and len(b["widgets_values"]) == 1  # unet_name only
            assert b["properties"]["cnr_id"] == "comfyui-gguf"  # the missing-node dialog names the pack
            assert (b["inputs"], b["outputs"]) == (a["inputs"], a["outputs"])
        elif a["type"] != "MarkdownNote":
            assert a == b
    assert len(swapped) == 2
    note = next(n for n in gguf["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
    files = [n["widgets_values"][0] for n in swapped]
    for needed in ("ComfyUI-GGUF", "https://github.com/city96/ComfyUI-GGUF", "models/unet", "models/diffusion_models",
                   "https://huggingface.co/QuantStack/Wan2.2-T2V-A14B-GGUF", *files):
        assert needed in note, needed


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_template_has_its_thumbnail_served(path, comfy_server):
    # The template browser shows <name>.jpg from beside the workflow (made by tests/e2e/test_browser.py).
    thumb = path.with_suffix(".jpg")
    assert thumb.is_file(), f"no thumbnail {thumb.name}: LAYERWISE_OFFLOAD_UPDATE_PICTURES=1 pytest tests/e2e/test_browser.py"
    data = thumb.read_bytes()
    assert data[:3] == b"\xff\xd8\xff" and 5_000 < len(data) < 120_000, (thumb.name, len(data))
    status, body = comfy_server.request("GET", f"/api/workflow_templates/{PACK_FOLDER}/{thumb.name}")
    assert status == 200 and body == data


# ------------------------------------------------------------------------------------------------ the opening view
# Frontends 1.49 and 1.58 fit a template to the window when they open it and draw nodes without any text below a
# zoom of 8/14 (devtools/workflow_graph.py); 1.32 and 1.39 open at the workflow's own view, set to that same fit.

@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_template_opens_at_a_zoom_that_draws_node_text(path):
    from layerwise_offload.devtools import workflow_graph

    wf = _load(path)
    view = workflow_graph.fitted_view(wf["nodes"])  # what the browser tests measure (test_browser_stats.py)
    assert wf["extra"]["ds"] == view, "python -P devtools/make_workflows.py"
    # On a 1600 x 1000 window: a good margin above where the text goes; the tiny demo, opened first, at 0.8.
    least = 0.8 if path.stem.startswith("A tiny demo") else 0.65
    assert view["scale"] >= least > workflow_graph.LOW_DETAIL_ZOOM + 0.05, view
    # A compact layout, not a crowded one: no node's box (title bar and the pack's badge above it included; a
    # Stats node as wide as web/js/stats.js makes it) meets another's.
    boxes = []
    for n in wf["nodes"]:
        above = workflow_graph.TITLE_HEIGHT + (24 if n["type"] in workflow_graph.PACK_NODES else 0)
        width = max(n["size"][0], 420 if n["type"] == workflow_graph.STATS_ID else 0)
        boxes.append((n.get("title", n["type"]), n["pos"][0], n["pos"][1] - above, n["pos"][0] + width,
                      n["pos"][1] + n["size"][1]))
    touching = [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                if a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]]
    assert not touching, touching


# ------------------------------------------------------------------------------------------------ one set of numbers
# devtools/template_plans.json is one planner run; the README table, every template's note, file name and card
# picture are written from it by devtools/make_workflows.py.

def test_plans_file_is_a_fresh_planner_run():
    from layerwise_offload.devtools import template_memory

    fresh = template_memory.plan_templates()
    assert fresh == template_memory.load_plans(), (
        "the planner or a template changed: python -P devtools/template_memory.py --write, then "
        "python -P devtools/make_workflows.py")


def test_workflows_notes_pictures_and_readme_are_written_from_the_plans(capsys):
    from layerwise_offload.devtools import make_workflows

    assert make_workflows.main(["--check"]) == 0, capsys.readouterr().out + \
        "\nrun: python -P devtools/make_workflows.py"


def test_real_safetensors_templates_load_through_the_layerwise_loader():
    """The real-model .safetensors templates load their DiT(s) with Load Diffusion Model (Layerwise) and carry its
    download (the frontend's missing-models dialog); the GGUF one keeps ComfyUI-GGUF's loader (it maps the .gguf
    read-only, so the disk tier reads from that file too). Those say in their name both RAM figures; the tiny demo
    keeps ComfyUI's loader and names none."""
    from layerwise_offload.devtools import make_workflows, template_memory
    from layerwise_offload.devtools.workflow_graph import FROM_CHECKPOINT, LEFT_IN_THE_FILE, MODEL_URLS

    plans = template_memory.load_plans()
    assert FROM_CHECKPOINT == {"flux1_dev", "wan21_t2v_14b", "wan22_t2v_a14b", "wan22_t2v_a14b_fp8", "qwen_image",
                               "hunyuan_video"}
    assert LEFT_IN_THE_FILE == FROM_CHECKPOINT | {"wan22_t2v_a14b_gguf"}
    for key, title, *_ in make_workflows.TEMPLATES:
        name = make_workflows.file_name(key, title)
        wf = _load(REPO / "workflows" / name)
        loaders = [n for n in wf["nodes"] if n["type"] in LOADERS]
        if key not in FROM_CHECKPOINT:
            assert {n["type"] for n in loaders} == {"UnetLoaderGGUF" if key else "UNETLoader"}, name
            assert ("for full speed" in name) == (key in LEFT_IN_THE_FILE), name
            if key in LEFT_IN_THE_FILE:
                note = next(n for n in wf["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
                assert "*Unet Loader (GGUF)* maps the .gguf file" in note and "host_store = auto" in note, note
            continue
        assert loaders and {n["type"] for n in loaders} == {LAYERWISE_LOADER}, name
        for n in loaders:
            file, dtype = n["widgets_values"]
            assert dtype == "default", "a converting weight_dtype would copy the weights into RAM"
            url = MODEL_URLS.get(file, n["properties"]["models"][0]["url"])  # fp8: the fp16 one renamed
            assert n["properties"]["models"] == [{"name": file, "url": url, "directory": "diffusion_models"}], name
            assert url.startswith("https://huggingface.co/") and url.endswith("/" + file)
            assert n["properties"]["cnr_id"] == "layerwise-offload"
        t = template_memory.plan_for(plans, key)
        full, least = round(t["ram_bytes"] / 1e9), round(template_memory.disk_tier_ram_bytes(plans, t) / 1e9)
        assert least < full and f", {least}+ GB RAM ({full} GB for full speed), " in name, name
        note = next(n for n in wf["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
        assert f"about {full} GB for full speed, {least} GB at the least" in note, name
        assert "Load Diffusion Model (Layerwise)" in note and "host_store = auto" in note


def test_the_templates_layerwise_loader_runs_the_tiny_model_like_comfyuis(comfy_server, object_info):
    """The loader node exactly as the real-model templates carry it (type, weight_dtype, properties), given the tiny
    Wan 2.1 in place of the tiny demo's UNETLoader, runs in the real server behind the demo's offload node and
    saves bitwise the demo's latent, with the weights left in the file (its log line)."""
    import copy
    import safetensors.torch
    import torch

    shipped = {json.dumps({k: n[k] for k in ("type", "properties")} | {"dtype": n["widgets_values"][1]},
                          sort_keys=True): n
               for p in FILES for n in _load(p)["nodes"] if n["type"] == LAYERWISE_LOADER}
    assert len(shipped) >= 6, "one per real-model .safetensors template file (Wan 2.2: two each)"
    demo = _load(next(p for p in FILES if p.stem.startswith("A tiny demo")))

    def latent(wf, prefix):
        for n in wf["nodes"]:
            if n["type"] == "SaveLatent":
                n["widgets_values"] = [prefix]
        entry = comfy_server.run_prompt(workflow_to_prompt(wf, object_info))
        files = comfy_server.output_files(entry, "latents")
        assert len(files) == 1, entry.get("outputs")
        return safetensors.torch.load_file(str(files[0]))["latent_tensor"]

    want = latent(copy.deepcopy(demo), "e2e/templates_loader_ref")
    dtypes = {n["widgets_values"][1] for n in shipped.values()}
    assert dtypes == {"default"}
    swapped = copy.deepcopy(demo)
    tiny_file = next(n for n in swapped["nodes"] if n["type"] == "UNETLoader")["widgets_values"][0]
    template_node = copy.deepcopy(next(iter(shipped.values())))
    for n in swapped["nodes"]:
        if n["type"] == "UNETLoader":
            n.update(type=LAYERWISE_LOADER, properties=template_node["properties"],
                     widgets_values=[tiny_file, template_node["widgets_values"][1]])
    log_before = len(comfy_server.log_text())
    got = latent(swapped, "e2e/templates_loader")
    assert torch.equal(got, want)
    log = comfy_server.log_text()[log_before:]
    assert "[layerwise-offload] loaded" in log and "left in the file" in log, log[-3000:]


def _readme_rows():
    rows = {}
    for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 10 and cells[0] != "template" and cells[0] != "---":
            rows[cells[0]] = cells
    return rows


def test_every_note_and_readme_row_give_the_same_counts():
    from layerwise_offload.devtools import make_workflows, template_memory

    plans = template_memory.load_plans()
    files = {key: make_workflows.file_name(key, title) for key, title, *_ in make_workflows.TEMPLATES if key}
    rows = _readme_rows()
    notes = {}
    for path in FILES:
        for n in _load(path)["nodes"]:
            if n["type"] == "MarkdownNote":
                notes[path.stem] = n["widgets_values"][0]
    assert len(plans["templates"]) == len(FILES) - 1 == len(rows), (sorted(rows), [p.stem for p in FILES])
    for t in plans["templates"]:
        counts = ["0*" if r is None else str(r) for r in t["resident"]]
        assert rows[t["name"]][6:] == counts, (t["name"], rows[t["name"]])
        assert f"{t['ram_bytes'] / 1e9:.0f} GB" == rows[t["name"]][3]
        assert f"{template_memory.disk_tier_ram_bytes(plans, t) / 1e9:.0f} GB" == rows[t["name"]][4]
        note = notes[Path(files[t["key"]]).stem]
        for card, count in zip(plans["cards_gib"], counts):
            assert f"{card} GB: {count}" in note, (t["key"], card, count)


def test_the_tiny_demo_sorts_first():
    # The server lists a pack's templates in the order its file system gives them; sorted (Windows, macOS, the
    # frontend's A-Z) the tiny demo comes first.
    assert sorted(FILES, key=lambda p: p.stem.lower())[0].stem.startswith("A tiny demo")
    assert sorted(FILES)[0].stem.startswith("A tiny demo")
