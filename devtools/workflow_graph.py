"""The graph writer behind the shipped workflows (devtools/make_workflows.py): UI-format (0.4) nodes and links for
the node types the templates use, their model downloads and colours, and the view a frontend opens them at.
Pure Python: needs neither ComfyUI nor torch."""

from __future__ import annotations

import math
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

NODE_ID, STATS_ID = "LayerwiseOffload", "LayerwiseOffloadStats"
# Load Diffusion Model (Layerwise) (nodes/loader.py): UNETLoader's inputs, the weights left in the file, so the
# blocks that do not fit in RAM are read from the checkpoint (host_store auto).
LOADER_ID = "LayerwiseOffloadLoadDiffusionModel"
PACK_NODES = (NODE_ID, STATS_ID, LOADER_ID)
GGUF_LOADER = "UnetLoaderGGUF"  # city96's ComfyUI-GGUF

#: The templates whose diffusion model(s) load through Load Diffusion Model (Layerwise). The GGUF one keeps
#: ComfyUI-GGUF's loader, the tiny demo ComfyUI's own (19 MB: RAM is no question there, and it shows the node on
#: the stock loader).
FROM_CHECKPOINT = frozenset({"flux1_dev", "wan21_t2v_14b", "wan22_t2v_a14b", "wan22_t2v_a14b_fp8", "qwen_image",
                             "hunyuan_video"})
#: The templates that run from the disk-tier RAM figure up: their loader leaves the blocks in the model file (ours
#: maps the .safetensors, ComfyUI-GGUF's the .gguf, both read-only) and the disk tier reads them from there.
LEFT_IN_THE_FILE = FROM_CHECKPOINT | {"wan22_t2v_a14b_gguf"}

# Slots of every node type used: inputs ("name:TYPE"), outputs ("TYPE", or "name:TYPE"), widget names.
# tests/e2e/test_workflows.py checks the written files against the server's /object_info.
_SPECS = {
    "UNETLoader": ("", "MODEL", "unet_name weight_dtype"),
    LOADER_ID: ("", "MODEL", "unet_name weight_dtype"),
    GGUF_LOADER: ("", "MODEL", "unet_name"),
    "CLIPLoader": ("", "CLIP", "clip_name type device"),
    "DualCLIPLoader": ("", "CLIP", "clip_name1 clip_name2 type device"),
    "VAELoader": ("", "VAE", "vae_name"),
    "CLIPTextEncode": ("clip:CLIP", "CONDITIONING", "text"),
    "FluxGuidance": ("conditioning:CONDITIONING", "CONDITIONING", "guidance"),
    "ConditioningZeroOut": ("conditioning:CONDITIONING", "CONDITIONING", ""),
    "EmptySD3LatentImage": ("", "LATENT", "width height batch_size"),
    "EmptyHunyuanLatentVideo": ("", "LATENT", "width height length batch_size"),
    "KSampler": ("model:MODEL positive:CONDITIONING negative:CONDITIONING latent_image:LATENT", "LATENT",
                 "seed control_after_generate steps cfg sampler_name scheduler denoise"),
    "KSamplerAdvanced": ("model:MODEL positive:CONDITIONING negative:CONDITIONING latent_image:LATENT", "LATENT",
                         "add_noise noise_seed control_after_generate steps cfg sampler_name scheduler "
                         "start_at_step end_at_step return_with_leftover_noise"),
    "ModelSamplingSD3": ("model:MODEL", "MODEL", "shift"),
    "ModelSamplingAuraFlow": ("model:MODEL", "MODEL", "shift"),
    "VAEDecode": ("samples:LATENT vae:VAE", "IMAGE", ""),
    "VAEDecodeTiled": ("samples:LATENT vae:VAE", "IMAGE", "tile_size overlap temporal_size temporal_overlap"),
    "SaveImage": ("images:IMAGE", "", "filename_prefix"),
    # Video as animated WEBP: the same inputs on every tested ComfyUI (0.33 changed CreateVideo and SaveVideo).
    "SaveAnimatedWEBP": ("images:IMAGE", "", "filename_prefix fps lossless quality method"),
    "RandomNoise": ("", "NOISE", "noise_seed control_after_generate"),
    "KSamplerSelect": ("", "SAMPLER", "sampler_name"),
    "BasicScheduler": ("model:MODEL", "SIGMAS", "scheduler steps denoise"),
    "BasicGuider": ("model:MODEL conditioning:CONDITIONING", "GUIDER", ""),
    "SamplerCustomAdvanced": ("noise:NOISE guider:GUIDER sampler:SAMPLER sigmas:SIGMAS latent_image:LATENT",
                              "output:LATENT denoised_output:LATENT", ""),
    "LoadTrainingDataset": ("", "latents:LATENT conditioning:CONDITIONING", "folder_name"),
    "SaveLatent": ("samples:LATENT", "", "filename_prefix"),
    NODE_ID: ("model:MODEL", "MODEL", "resident_layers prefetch_size residency_policy pin_memory host_store"),
    STATS_ID: ("model:MODEL after:LATENT", "STRING", ""),
    "MarkdownNote": ("", "", "text"),
}


def _slots(text: str) -> List[Tuple[str, str]]:
    return [tuple(s.split(":")) if ":" in s else (s, s) for s in text.split()]


SPECS = {t: (_slots(i), _slots(o), w.split()) for t, (i, o, w) in _SPECS.items()}

# Where ComfyUI's templates (or the Comfy-Org repackaged repos) host each file, for the frontend's model download.
_HF, _SPLIT = "https://huggingface.co/", "/resolve/main/split_files/"
_WAN21, _WAN22 = "Comfy-Org/Wan_2.1_ComfyUI_repackaged" + _SPLIT, "Comfy-Org/Wan_2.2_ComfyUI_Repackaged" + _SPLIT
_QWEN, _HUNYUAN = "Comfy-Org/Qwen-Image_ComfyUI" + _SPLIT, "Comfy-Org/HunyuanVideo_repackaged" + _SPLIT
MODEL_URLS = {name: _HF + folder + name for folder, names in {
    "Comfy-Org/flux1-dev/resolve/main/": ["flux1-dev.safetensors"],
    "comfyanonymous/flux_text_encoders/resolve/main/": ["clip_l.safetensors", "t5xxl_fp16.safetensors"],
    "Comfy-Org/Lumina_Image_2.0_Repackaged" + _SPLIT + "vae/": ["ae.safetensors"],
    _WAN21 + "diffusion_models/": ["wan2.1_t2v_14B_bf16.safetensors"],
    _WAN21 + "text_encoders/": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors"],
    _WAN21 + "vae/": ["wan_2.1_vae.safetensors"],
    _WAN22 + "diffusion_models/": [f"wan2.2_t2v_{e}_noise_14B_{q}.safetensors" for e in ("high", "low")
                                   for q in ("fp16", "fp8_scaled")],
    _QWEN + "diffusion_models/": ["qwen_image_fp8_e4m3fn.safetensors"],
    _QWEN + "text_encoders/": ["qwen_2.5_vl_7b_fp8_scaled.safetensors"],
    _QWEN + "vae/": ["qwen_image_vae.safetensors"],
    _HUNYUAN + "diffusion_models/": ["hunyuan_video_t2v_720p_bf16.safetensors"],
    _HUNYUAN + "text_encoders/": ["llava_llama3_fp8_scaled.safetensors"],
    _HUNYUAN + "vae/": ["hunyuan_video_vae_bf16.safetensors"],
}.items() for name in names}
MODEL_DIRS = {"UNETLoader": "diffusion_models", LOADER_ID: "diffusion_models", "CLIPLoader": "text_encoders",
              "DualCLIPLoader": "text_encoders", "VAELoader": "vae"}

# Colours ComfyUI's templates use for loaders (red), ours for the pack's node (green, so it stands out) and notes.
COLORS = {**dict.fromkeys([*MODEL_DIRS, GGUF_LOADER], ("#322", "#533")), NODE_ID: ("#232", "#353"),
          STATS_ID: ("#232", "#353"), "MarkdownNote": ("#432", "#653")}
# Who provides each node type (the frontend's missing-node dialog names the pack); the rest is ComfyUI's core.
SOURCES = {**dict.fromkeys(PACK_NODES, {"cnr_id": "layerwise-offload", "ver": "0.1.0"}),
           GGUF_LOADER: {"cnr_id": "comfyui-gguf", "aux_id": "city96/ComfyUI-GGUF"}, "MarkdownNote": {}}
CORE = {"cnr_id": "comfy-core", "ver": "0.3.75"}


class Graph:
    """LiteGraph's serialised graph (what the frontend saves as version 0.4), its nodes named for :meth:`link`."""

    def __init__(self, name: str) -> None:
        # A stable id, so regenerating gives identical files.
        self.id = str(uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/layerwise-offload/" + name))
        self.nodes: Dict[str, Dict[str, Any]] = {}
        self.links: List[List[Any]] = []

    def add(self, name: str, type_: str, pos: Sequence[float], size: Sequence[float], *widgets: Any,
            title: Optional[str] = None) -> None:
        ins, outs, widget_names = SPECS[type_]
        if len(widgets) != len(widget_names):
            raise ValueError(f"{type_}: {len(widgets)} widget values for {widget_names}")
        source = SOURCES.get(type_, CORE)
        properties = {"Node name for S&R": type_, **source} if source else {}
        models = [{"name": v, "url": MODEL_URLS[v], "directory": MODEL_DIRS[type_]}
                  for v in widgets if type_ in MODEL_DIRS and v in MODEL_URLS]
        if models:
            properties["models"] = models
        node = {"id": len(self.nodes) + 1, "type": type_, "pos": [float(p) for p in pos],
                "size": [float(s) for s in size], "flags": {}, "order": 0, "mode": 0,
                "inputs": [{"name": n, "type": t, "link": None} for n, t in ins],
                "outputs": [{"name": n, "type": t, "links": [], "slot_index": i} for i, (n, t) in enumerate(outs)],
                "properties": properties, "widgets_values": list(widgets)}
        if title:
            node["title"] = title
        if type_ in COLORS:
            node["color"], node["bgcolor"] = COLORS[type_]
        self.nodes[name] = node

    def link(self, wiring: str) -> None:
        """Links in the order given, each ``source>target.input`` (``source:1>...`` for the source's output 1)."""
        for item in wiring.split():
            src_ref, dst_ref = item.split(">")
            src_name, _, src_slot = src_ref.partition(":")
            dst_name, dst_input = dst_ref.split(".")
            src, dst, link_id = self.nodes[src_name], self.nodes[dst_name], len(self.links) + 1
            out = src["outputs"][int(src_slot or 0)]
            slot = next(i for i, inp in enumerate(dst["inputs"]) if inp["name"] == dst_input)
            inp = dst["inputs"][slot]
            if inp["link"] is not None or out["type"] != inp["type"]:
                raise ValueError(f"cannot link {item}")
            out["links"].append(link_id)
            inp["link"] = link_id
            self.links.append([link_id, src["id"], int(src_slot or 0), dst["id"], slot, out["type"]])

    def to_json(self) -> Dict[str, Any]:
        nodes = list(self.nodes.values())
        # Execution order as the frontend stores it: a topological order of the graph (stable by id).
        deps = {n["id"]: {src for _, src, _, dst, _, _ in self.links if dst == n["id"]} for n in nodes}
        done: List[int] = []
        while len(done) < len(nodes):
            done.append(min(i for i, d in deps.items() if i not in done and d <= set(done)))
        for n in nodes:
            n["order"] = done.index(n["id"])
        return {"id": self.id, "revision": 0, "last_node_id": len(nodes), "last_link_id": len(self.links),
                "nodes": nodes, "links": self.links, "groups": [], "config": {},
                "extra": {"ds": fitted_view(nodes)}, "version": 0.4}


# How the frontend opens a template. 1.49 and 1.58 ignore the workflow's own view (extra.ds) and fit the graph to
# the window (LGraphCanvas.ds.fitToBounds over every node's bounding box, title bar included, plus a 10-unit
# margin): the graph then fills 75% of the window's width or height, whichever is reached first. Below a zoom of
# 8 px / 14 px (LiteGraph.Canvas.MinFontSizeForLOD over the node font size, at device pixel ratio 1) they draw
# nodes in low detail, without any text. 1.32 and 1.39 open at extra.ds, which is set to the same fit.
#: The window the templates are laid out for (CSS pixels; the browser tests use it too).
VIEW_WINDOW = (1600, 1000)
TITLE_HEIGHT = 30.0
#: The zoom below which frontends 1.49 and 1.58 hide node text (at device pixel ratio 1).
LOW_DETAIL_ZOOM = 8 / 14


def fitted_view(nodes: Sequence[Dict[str, Any]], window: Sequence[float] = VIEW_WINDOW) -> Dict[str, Any]:
    """The view frontends 1.49 and 1.58 open the graph at in ``window`` (ds.fitToBounds): ``{"scale",
    "offset"}``, the offset in graph units (a node at ``pos`` is drawn at ``(pos + offset) * scale``)."""
    margin = 10.0
    x = min(n["pos"][0] for n in nodes) - margin
    y = min(n["pos"][1] - TITLE_HEIGHT for n in nodes) - margin
    w = max(n["pos"][0] + n["size"][0] for n in nodes) + margin - x
    h = max(n["pos"][1] + n["size"][1] for n in nodes) + margin - y
    scale = math.floor(min(0.75 * window[0] / max(w, 300.0), 0.75 * window[1] / max(h, 300.0)) * 1000) / 1000
    return {"scale": scale, "offset": [round(window[0] / scale / 2 - x - w / 2, 1),
                                       round(window[1] / scale / 2 - y - h / 2, 1)]}
