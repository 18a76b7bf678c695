"""The building blocks of the shipped workflows: a UI-format (0.4) graph writer that knows the slots of every node
type the templates use, model download links, colours, and the offload/stats/note nodes every template shares.
devtools/make_workflows.py builds the templates from these. Pure Python: needs neither ComfyUI nor torch."""

from __future__ import annotations

import importlib.util
import math
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_DIR = REPO / "workflows"

PACK_CNR_ID = "layerwise-offload"
PACK_VERSION = "0.1.0"
CORE_VERSION = "0.3.75"
NODE_ID = "LayerwiseOffload"
STATS_ID = "LayerwiseOffloadStats"
# Load Diffusion Model (Layerwise) (nodes/loader.py): UNETLoader's inputs, the weights left in the file, so the
# blocks that do not fit in RAM are read from the checkpoint (host_store auto).
LOADER_ID = "LayerwiseOffloadLoadDiffusionModel"
PACK_NODES = (NODE_ID, STATS_ID, LOADER_ID)

# Slots of every node type used: (inputs [(name, type)], outputs [(name, type)], widget names).
# tests/e2e/test_workflows.py checks these against ComfyUI 0.3.75's /object_info.
SPECS: Dict[str, Tuple[List[Tuple[str, str]], List[Tuple[str, str]], List[str]]] = {
    "UNETLoader": ([], [("MODEL", "MODEL")], ["unet_name", "weight_dtype"]),
    LOADER_ID: ([], [("MODEL", "MODEL")], ["unet_name", "weight_dtype"]),
    "CLIPLoader": ([], [("CLIP", "CLIP")], ["clip_name", "type", "device"]),
    "DualCLIPLoader": ([], [("CLIP", "CLIP")], ["clip_name1", "clip_name2", "type", "device"]),
    "VAELoader": ([], [("VAE", "VAE")], ["vae_name"]),
    "CLIPTextEncode": ([("clip", "CLIP")], [("CONDITIONING", "CONDITIONING")], ["text"]),
    "FluxGuidance": ([("conditioning", "CONDITIONING")], [("CONDITIONING", "CONDITIONING")], ["guidance"]),
    "ConditioningZeroOut": ([("conditioning", "CONDITIONING")], [("CONDITIONING", "CONDITIONING")], []),
    "EmptySD3LatentImage": ([], [("LATENT", "LATENT")], ["width", "height", "batch_size"]),
    "EmptyHunyuanLatentVideo": ([], [("LATENT", "LATENT")], ["width", "height", "length", "batch_size"]),
    "KSampler": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                  ("latent_image", "LATENT")], [("LATENT", "LATENT")],
                 ["seed", "control_after_generate", "steps", "cfg", "sampler_name", "scheduler", "denoise"]),
    "KSamplerAdvanced": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                          ("latent_image", "LATENT")], [("LATENT", "LATENT")],
                         ["add_noise", "noise_seed", "control_after_generate", "steps", "cfg", "sampler_name",
                          "scheduler", "start_at_step", "end_at_step", "return_with_leftover_noise"]),
    "ModelSamplingSD3": ([("model", "MODEL")], [("MODEL", "MODEL")], ["shift"]),
    "ModelSamplingAuraFlow": ([("model", "MODEL")], [("MODEL", "MODEL")], ["shift"]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [("IMAGE", "IMAGE")], []),
    "VAEDecodeTiled": ([("samples", "LATENT"), ("vae", "VAE")], [("IMAGE", "IMAGE")],
                       ["tile_size", "overlap", "temporal_size", "temporal_overlap"]),
    "SaveImage": ([("images", "IMAGE")], [], ["filename_prefix"]),
    # Video as animated WEBP: the same inputs on every tested ComfyUI (0.33 changed CreateVideo and SaveVideo).
    "SaveAnimatedWEBP": ([("images", "IMAGE")], [], ["filename_prefix", "fps", "lossless", "quality", "method"]),
    "RandomNoise": ([], [("NOISE", "NOISE")], ["noise_seed", "control_after_generate"]),
    "KSamplerSelect": ([], [("SAMPLER", "SAMPLER")], ["sampler_name"]),
    "BasicScheduler": ([("model", "MODEL")], [("SIGMAS", "SIGMAS")], ["scheduler", "steps", "denoise"]),
    "BasicGuider": ([("model", "MODEL"), ("conditioning", "CONDITIONING")], [("GUIDER", "GUIDER")], []),
    "SamplerCustomAdvanced": ([("noise", "NOISE"), ("guider", "GUIDER"), ("sampler", "SAMPLER"),
                               ("sigmas", "SIGMAS"), ("latent_image", "LATENT")],
                              [("output", "LATENT"), ("denoised_output", "LATENT")], []),
    "LoadTrainingDataset": ([], [("latents", "LATENT"), ("conditioning", "CONDITIONING")], ["folder_name"]),
    "SaveLatent": ([("samples", "LATENT")], [], ["filename_prefix"]),
    NODE_ID: ([("model", "MODEL")], [("MODEL", "MODEL")],
              ["resident_layers", "prefetch_size", "residency_policy", "pin_memory", "host_store"]),
    STATS_ID: ([("model", "MODEL"), ("after", "LATENT")], [("STRING", "STRING")], []),
    "MarkdownNote": ([], [], ["text"]),
    "Note": ([], [], ["text"]),
}

#: Frontend-only node types (not in /object_info): they never reach the server.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}

# Where ComfyUI's templates (or the Comfy-Org repackaged repos) host each file, for the frontend's model download.
MODEL_URLS = {
    "flux1-dev.safetensors": "https://huggingface.co/Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors",
    "clip_l.safetensors": "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
    "t5xxl_fp16.safetensors":
        "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors",
    "ae.safetensors":
        "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
    "wan2.1_t2v_14B_bf16.safetensors":
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/diffusion_models/"
        "wan2.1_t2v_14B_bf16.safetensors",
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors":
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/text_encoders/"
        "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
    "wan_2.1_vae.safetensors":
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/"
        "wan_2.1_vae.safetensors",
    "wan2.2_t2v_high_noise_14B_fp16.safetensors":
        "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/diffusion_models/"
        "wan2.2_t2v_high_noise_14B_fp16.safetensors",
    "wan2.2_t2v_low_noise_14B_fp16.safetensors":
        "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/diffusion_models/"
        "wan2.2_t2v_low_noise_14B_fp16.safetensors",
    "qwen_image_fp8_e4m3fn.safetensors":
        "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/diffusion_models/"
        "qwen_image_fp8_e4m3fn.safetensors",
    "qwen_2.5_vl_7b_fp8_scaled.safetensors":
        "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/text_encoders/"
        "qwen_2.5_vl_7b_fp8_scaled.safetensors",
    "qwen_image_vae.safetensors":
        "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/vae/qwen_image_vae.safetensors",
    "hunyuan_video_t2v_720p_bf16.safetensors":
        "https://huggingface.co/Comfy-Org/HunyuanVideo_repackaged/resolve/main/split_files/diffusion_models/"
        "hunyuan_video_t2v_720p_bf16.safetensors",
    "llava_llama3_fp8_scaled.safetensors":
        "https://huggingface.co/Comfy-Org/HunyuanVideo_repackaged/resolve/main/split_files/text_encoders/"
        "llava_llama3_fp8_scaled.safetensors",
    "hunyuan_video_vae_bf16.safetensors":
        "https://huggingface.co/Comfy-Org/HunyuanVideo_repackaged/resolve/main/split_files/vae/"
        "hunyuan_video_vae_bf16.safetensors",
}
MODEL_DIRS = {"UNETLoader": "diffusion_models", LOADER_ID: "diffusion_models", "CLIPLoader": "text_encoders",
              "DualCLIPLoader": "text_encoders", "VAELoader": "vae"}

# Colours ComfyUI's templates use for loaders (red) and for our node (green, so it stands out).
LOADER_COLOR = ("#322", "#533")
OFFLOAD_COLOR = ("#232", "#353")
NOTE_COLOR = ("#432", "#653")


class Graph:
    """A tiny builder for LiteGraph's serialised graph (what the frontend saves as version 0.4)."""

    def __init__(self, workflow_id: str) -> None:
        self.id = workflow_id
        self.nodes: List[Dict[str, Any]] = []
        self.links: List[List[Any]] = []
        self.groups: List[Dict[str, Any]] = []

    def add(self, type_: str, pos: Sequence[float], widgets: Sequence[Any] = (), size: Sequence[float] = (300, 100),
            title: Optional[str] = None, color: Optional[Tuple[str, str]] = None) -> Dict[str, Any]:
        ins, outs, widget_names = SPECS[type_]
        if len(widgets) != len(widget_names):
            raise ValueError(f"{type_}: {len(widgets)} widget values for {widget_names}")
        node: Dict[str, Any] = {
            "id": len(self.nodes) + 1,
            "type": type_,
            "pos": [float(pos[0]), float(pos[1])],
            "size": [float(size[0]), float(size[1])],
            "flags": {},
            "order": 0,
            "mode": 0,
            "inputs": [{"name": n, "type": t, "link": None} for n, t in ins],
            "outputs": [{"name": n, "type": t, "links": [], "slot_index": i} for i, (n, t) in enumerate(outs)],
            "properties": {},
            "widgets_values": list(widgets),
        }
        if type_ not in FRONTEND_ONLY:
            node["properties"]["Node name for S&R"] = type_
            if type_ in PACK_NODES:
                node["properties"].update({"cnr_id": PACK_CNR_ID, "ver": PACK_VERSION})
            else:
                node["properties"].update({"cnr_id": "comfy-core", "ver": CORE_VERSION})
        if type_ in MODEL_DIRS:
            models = [{"name": v, "url": MODEL_URLS[v], "directory": MODEL_DIRS[type_]}
                      for v in widgets if isinstance(v, str) and v in MODEL_URLS]
            if models:
                node["properties"]["models"] = models
        if title:
            node["title"] = title
        if color:
            node["color"], node["bgcolor"] = color
        self.nodes.append(node)
        return node

    def connect(self, src: Dict[str, Any], src_slot: int, dst: Dict[str, Any], dst_input: str) -> None:
        link_id = len(self.links) + 1
        out = src["outputs"][src_slot]
        slot = next(i for i, inp in enumerate(dst["inputs"]) if inp["name"] == dst_input)
        inp = dst["inputs"][slot]
        if inp["link"] is not None:
            raise ValueError(f"{dst['type']}.{dst_input} is already linked")
        if out["type"] != inp["type"]:
            raise ValueError(f"type mismatch {src['type']}.{out['name']} -> {dst['type']}.{dst_input}")
        out["links"].append(link_id)
        inp["link"] = link_id
        self.links.append([link_id, src["id"], src_slot, dst["id"], slot, out["type"]])

    def group(self, title: str, bounding: Sequence[float], color: str = "#3f789e") -> None:
        self.groups.append({"id": len(self.groups) + 1, "title": title, "bounding": [float(b) for b in bounding],
                            "color": color, "font_size": 24, "flags": {}})

    def _order(self) -> None:
        # Execution order as the frontend stores it: a topological order of the graph (stable by id).
        deps = {n["id"]: set() for n in self.nodes}
        for _, src, _, dst, _, _ in self.links:
            deps[dst].add(src)
        done: List[int] = []
        while len(done) < len(self.nodes):
            ready = sorted(i for i, d in deps.items() if i not in done and d <= set(done))
            if not ready:
                raise ValueError("cycle in graph")
            done.append(ready[0])
        for n in self.nodes:
            n["order"] = done.index(n["id"])

    def to_json(self) -> Dict[str, Any]:
        self._order()
        return {
            "id": self.id,
            "revision": 0,
            "last_node_id": len(self.nodes),
            "last_link_id": len(self.links),
            "nodes": self.nodes,
            "links": self.links,
            "groups": self.groups,
            "config": {},
            "extra": {"ds": fitted_view(self.nodes)},
            "version": 0.4,
        }


# How the frontend opens a template. 1.49 and 1.58 ignore the workflow's own view (extra.ds) and fit the graph to
# the window (LGraphCanvas.ds.fitToBounds over every node's bounding box, title bar included, plus a 10-unit
# margin): the graph then fills 75% of the window's width or height, whichever is reached first. Below a zoom of
# 8 px / 14 px (LiteGraph.Canvas.MinFontSizeForLOD over the node font size, at device pixel ratio 1) they draw
# nodes in low detail, without any text. 1.32 and 1.39 open at extra.ds, which is set to the same fit.
#: The window the templates are laid out for (CSS pixels; the browser tests use it too).
VIEW_WINDOW = (1600, 1000)
FIT_FILL = 0.75
FIT_MARGIN = 10.0
TITLE_HEIGHT = 30.0
#: The zoom below which frontends 1.49 and 1.58 hide node text (at device pixel ratio 1).
LOW_DETAIL_ZOOM = 8 / 14


def graph_bounds(nodes: Sequence[Dict[str, Any]]) -> Tuple[float, float, float, float]:
    """``(x, y, width, height)`` of the nodes' bounding boxes as the frontend takes them (title bars included)."""
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] - TITLE_HEIGHT for n in nodes)
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes)
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes)
    return x0, y0, x1 - x0, y1 - y0


def fitted_view(nodes: Sequence[Dict[str, Any]], window: Sequence[float] = VIEW_WINDOW) -> Dict[str, Any]:
    """The view frontends 1.49 and 1.58 open the graph at in ``window`` (ds.fitToBounds): ``{"scale",
    "offset"}``, the offset in graph units (a node at ``pos`` is drawn at ``(pos + offset) * scale``)."""
    x, y, w, h = graph_bounds(nodes)
    x, y, w, h = x - FIT_MARGIN, y - FIT_MARGIN, w + 2 * FIT_MARGIN, h + 2 * FIT_MARGIN
    scale = min(FIT_FILL * window[0] / max(w, 300.0), FIT_FILL * window[1] / max(h, 300.0))
    scale = math.floor(scale * 1000) / 1000
    return {"scale": scale, "offset": [round(window[0] / scale / 2 - x - w / 2, 1),
                                       round(window[1] / scale / 2 - y - h / 2, 1)]}


def _wid(name: str) -> str:
    # Stable ids, so regenerating gives identical files.
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/layerwise-offload/" + name))


HOW_TO = """## Layerwise Offload: how many blocks stay in VRAM

The **Layerwise Offload (DiT)** node keeps the first `resident_layers` transformer blocks on the GPU and streams
the others from system RAM (those that do not fit in RAM from disk: `host_store = auto`) while sampling,
`prefetch_size` blocks ahead. More resident blocks = faster (fewer bytes cross PCIe at each step); fewer = less
VRAM.

This workflow starts with `-1` (auto): at the first step of each run the node keeps as many blocks as fit in the
VRAM free then, after room for the activations of this resolution. The counts below are what auto picks on each
card size for this workflow (the node's own planner; README, "Which card needs what"): set one as a fixed
`resident_layers` to start from, lower it by a few if sampling runs out of memory, raise it if VRAM is left.
`0` streams every block; a count at or above the number of blocks keeps the whole model resident.

After a run, the **Layerwise Offload Stats** node shows which blocks were resident and which streamed, the VRAM
and RAM used, and how the copy time compares with the compute time. `pin_memory` (on) makes copies fast and
asynchronous; turn it off only if the system runs short of RAM.
"""


def _sibling(name: str):
    """A module beside this one, loaded by path (scripts run with ``-P``), registered before it runs (dataclasses
    look their module up in sys.modules) and loaded once."""
    import sys

    key = f"_lwo_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


#: The planner run every note, card picture and the README table are written from (devtools/template_memory.py).
memory = _sibling("template_memory")
PLANS = memory.load_plans()
cards = _sibling("template_cards")
GB = 10**9


def _blocks_text(t: Dict[str, Any]) -> str:
    groups: List[List[Any]] = []  # [count, GB] of consecutive blocks of one size
    for b in t["block_bytes"]:
        size = round(b / GB, 2)
        if groups and groups[-1][1] == size:
            groups[-1][0] += 1
        else:
            groups.append([1, size])
    if len(groups) == 1:
        return f"{groups[0][0]} blocks of {groups[0][1]:.2f} GB"
    return f"{len(t['block_bytes'])} blocks in call order: " + ", then ".join(f"{n} of {s:.2f} GB" for n, s in groups)


def plan_note(key: str, setting: str) -> str:
    """The note's block sizes, per-card counts and RAM for the template ``key``, from :data:`PLANS`."""
    t = memory.plan_for(PLANS, key)
    per = " per expert" if t["experts"] > 1 else ""
    counts = ", ".join(f"{c} GB: {'0*' if r is None else r}" for c, r in zip(PLANS["cards_gib"], t["resident"]))
    text = (f"{_blocks_text(t)}{per}. **Auto keeps resident at {setting}**{per}: {counts} "
            f"(of {len(t['block_bytes'])}). More pixels or frames need more activation memory, so fewer blocks.")
    if None in t["resident"]:
        text += (" 0*: even with every block streamed the activations do not fit that card; auto streams "
                 "everything, and fewer frames or a lower resolution is the fix if it runs out of memory.")
    both = " (both experts)" if t["experts"] > 1 else ""
    if key not in LEFT_IN_THE_FILE:
        return text + (f"\n\nSystem RAM needed: about {t['ram_bytes'] / GB:.0f} GB: the diffusion model{both} "
                       f"{t['dit_bytes'] / GB:.1f} GB, plus the text encoder, the VAE and ComfyUI.")
    full, least = f"{t['ram_bytes'] / GB:.0f} GB", f"{memory.disk_tier_ram_bytes(PLANS, t) / GB:.0f} GB"
    text += (f"\n\n**System RAM: about {full} for full speed, {least} at the least.** With {full} every "
             f"streamed block stays in RAM: the diffusion model{both} {t['dit_bytes'] / GB:.1f} GB, plus the "
             f"text encoder, the VAE and ComfyUI. With less it still runs, down to about {least}, slower: ")
    reads = ("`host_store = auto` reads the blocks that do not fit in RAM straight from that file at each step (each "
             "costs its read time; a fast NVMe SSD helps; the Stats node counts them).")
    if key not in FROM_CHECKPOINT:  # the GGUF template: ComfyUI-GGUF's loader maps the .gguf
        return text + f"*Unet Loader (GGUF)* maps the .gguf file instead of copying it into RAM, and {reads}"
    return text + (f"*Load Diffusion Model (Layerwise)* leaves the weights in the .safetensors file instead of "
                   f"copying them into RAM, and {reads} ComfyUI's own *Load Diffusion Model* takes the same inputs "
                   f"but copies the whole model into RAM: with it, the full {full} is needed.")


def min_card(key: str) -> int:
    t = memory.plan_for(PLANS, key)
    return next(c for c, r in zip(PLANS["cards_gib"], t["resident"]) if r is not None)


#: The templates whose diffusion model(s) load through Load Diffusion Model (Layerwise). The GGUF one keeps
#: ComfyUI-GGUF's loader, the tiny demo ComfyUI's own (19 MB: RAM is no question there, and it shows the node on
#: the stock loader).
FROM_CHECKPOINT = frozenset({"flux1_dev", "wan21_t2v_14b", "wan22_t2v_a14b", "wan22_t2v_a14b_fp8", "qwen_image",
                             "hunyuan_video"})
#: The templates that run from the disk-tier RAM figure up: their loader leaves the blocks in the model file (ours
#: maps the .safetensors, ComfyUI-GGUF's the .gguf, both read-only) and the disk tier reads them from there.
LEFT_IN_THE_FILE = FROM_CHECKPOINT | {"wan22_t2v_a14b_gguf"}


def _ram_range(key: str) -> str:
    t = memory.plan_for(PLANS, key)
    return (f"{memory.disk_tier_ram_bytes(PLANS, t) / GB:.0f}+ GB RAM ({t['ram_bytes'] / GB:.0f} GB for full "
            f"speed)")


def file_name(key: Optional[str], title: str) -> str:
    """A template's file name, which the template browser shows as its title and description: what it is, the
    RAM it needs and the smallest card auto plans for (the tiny demo, ``key`` None: its title). A template that
    loads through Load Diffusion Model (Layerwise) runs from the disk-tier figure up and at full speed with
    every streamed block in RAM: the name gives both."""
    if key is None:
        return f"{title}.json"
    t = memory.plan_for(PLANS, key)
    ram = _ram_range(key) if key in LEFT_IN_THE_FILE else f"{t['ram_bytes'] / GB:.0f} GB RAM"
    return f"{title}, {ram}, {min_card(key)}+ GB GPU.json"


def card_spec(key: Optional[str], card_title: str, subtitle: str) -> Dict[str, Any]:
    """What the template's card picture shows (devtools/template_cards.py)."""
    if key is None:
        return cards.demo_spec(card_title, subtitle, 4, "python demo/install_tiny_demo.py")
    t = memory.plan_for(PLANS, key)
    low = memory.disk_tier_ram_bytes(PLANS, t) if key in LEFT_IN_THE_FILE else None
    return cards.model_spec(card_title, subtitle, PLANS, t, low)


def _note(g: Graph, pos, text: str, size=(520, 560)) -> None:
    g.add("MarkdownNote", pos, [text], size=size, color=NOTE_COLOR)


#: Every shipped workflow starts in auto mode; the notes give fixed counts for each card size.
AUTO = -1


def _offload(g: Graph, pos, resident: int = AUTO, prefetch: int = 1, title: Optional[str] = None) -> Dict[str, Any]:
    return g.add(NODE_ID, pos, [resident, prefetch, "leading", True, "auto"], size=(320, 154), title=title,
                 color=OFFLOAD_COLOR)


def _stats(g: Graph, pos, offload: Dict[str, Any], sampler: Dict[str, Any], title: Optional[str] = None) -> None:
    """A Layerwise Offload Stats node reading the offload's MODEL after ``sampler`` (output 0) ran."""
    # 420 wide: web/js/stats.js widens the node to that for its picture (and a little higher) when it loads.
    st = g.add(STATS_ID, pos, [], size=(420, 228), title=title, color=OFFLOAD_COLOR)
    g.connect(offload, 0, st, "model")
    g.connect(sampler, 0, st, "after")


TINY_DEMO_NOTE = """## A tiny demo: Layerwise Offload on a 19 MB random Wan 2.1

**First, once:** in a terminal, from this pack's folder, with the Python that runs your ComfyUI:

    cd ComfyUI/custom_nodes/layerwise-offload
    python demo/install_tiny_demo.py

It writes the three files this graph loads into that ComfyUI (no restart needed):
`layerwise_offload_tiny_wan21.safetensors` (models/diffusion_models: a Wan 2.1 T2V with 4 blocks, random
weights), `layerwise_offload_tiny_wan21_vae.safetensors` (models/vae) and `layerwise_offload_tiny_wan21_cond/`
(one saved conditioning, in datasets/ or output/: where this ComfyUI's core node *Load Training Dataset* reads
it. A real Wan needs the 5.7B UMT5-XXL text encoder, so that node loads a saved one instead, and
*ConditioningZeroOut* makes the negative).

Then press Run. It takes seconds on any NVIDIA GPU; elsewhere (CPU, Apple, Intel) the node passes the model
through unchanged and the Stats node says so. The pictures are noise (random weights). Auto (`-1`) keeps all
4 blocks on a roomy card: set `resident_layers` to 2 (2 resident, 2 streamed), 0, or `residency_policy =
strided` and run again; the *Layerwise Offload Stats* node shows what each run did. The saved latent
(output/layerwise_offload/) is bitwise the same as the graph without the offload node (bypass it with Ctrl+B
and run again to compare).
"""

README = REPO / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- devtools/make_workflows.py: memory table -->", "<!-- end of memory table -->"


def readme_with_table(text: str) -> str:
    """``text`` (the README) with the memory table between its markers written from :data:`PLANS`."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"README.md lacks the markers {TABLE_BEGIN} ... {TABLE_END}")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n" + "\n".join(memory.markdown_table(PLANS)) + f"\n{TABLE_END}{tail}"
