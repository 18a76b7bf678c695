"""Generate the UI-format (version 0.4) workflow files in ``workflows/``.

The files are written by this script so that all of them share one layout and one explanation of
``resident_layers``; they follow ComfyUI's own templates (comfyui-workflow-templates 0.7.25: flux_dev_full_text_to_
image, text_to_video_wan, video_wan2_2_14B_t2v, image_qwen_image, hunyuan_video_text_to_video) with a
``LayerwiseOffload`` node after the diffusion-model loader, and that loader is *Load Diffusion Model (Layerwise)*
(``UNETLoader``'s inputs, the weights left in the file) in the templates of workflow_graph.FROM_CHECKPOINT.
After editing a workflow in the UI you may save it over the file instead; tests/e2e/test_workflows.py checks
every file against the live ``/object_info`` either way.

    .venv/bin/python -P devtools/make_workflows.py            # rewrite workflows/*.json
    .venv/bin/python -P devtools/make_workflows.py --check    # exit 1 if a file differs from what it would write

It also writes each template's card picture (devtools/template_cards.py, with Pillow) and the README's memory
table, all from one planner run (devtools/template_plans.json, written by devtools/template_memory.py --write).
Needs neither ComfyUI nor torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


# The graph writer beside this script, loaded by path: it runs with ``-P`` (no script folder on sys.path).
_spec = importlib.util.spec_from_file_location("_lwo_workflow_graph", Path(__file__).with_name("workflow_graph.py"))
_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_graph)
Graph, HOW_TO, LOADER_COLOR, WORKFLOW_DIR = _graph.Graph, _graph.HOW_TO, _graph.LOADER_COLOR, _graph.WORKFLOW_DIR
LOADER = _graph.LOADER_ID
_note, _offload, _stats, _wid = _graph._note, _graph._offload, _graph._stats, _graph._wid
plan_note = _graph.plan_note


# --------------------------------------------------------------------------------------------------- workflows
# The layout: a note on the left, then columns of nodes, compact enough that the frontend's fit to the window
# (workflow_graph.fitted_view) draws the node text (tests/e2e/test_workflows.py checks the zoom). One-model
# templates: loaders, the offload node and its stats (420 wide: web/js/stats.js); conditioning and latent; sampler
# and output.
GAP = 30
NOTE_WIDTH = 400
COL_A = NOTE_WIDTH + GAP
COL_B = COL_A + 420 + GAP
COL_C = COL_B + 320 + GAP
WAN22_NOTE_WIDTH = 420
TINY_NOTE_WIDTH = 400


def flux1_dev() -> Dict[str, Any]:
    g = Graph(_wid("flux1_dev"))
    unet = g.add(LOADER, (COL_A, 0), ["flux1-dev.safetensors", "default"], size=(340, 82), color=LOADER_COLOR)
    clip = g.add("DualCLIPLoader", (COL_A, 128), ["clip_l.safetensors", "t5xxl_fp16.safetensors", "flux",
                                                  "default"], size=(340, 130), color=LOADER_COLOR)
    vae = g.add("VAELoader", (COL_A, 304), ["ae.safetensors"], size=(340, 58), color=LOADER_COLOR)
    off = _offload(g, (COL_A, 418))
    pos = g.add("CLIPTextEncode", (COL_B, 0), [
        "a red fox sitting in fresh snow at sunrise, golden light, shallow depth of field, detailed fur"],
        size=(320, 180), title="CLIP Text Encode (Positive Prompt)")
    guid = g.add("FluxGuidance", (COL_B, 226), [3.5], size=(320, 58))
    neg = g.add("ConditioningZeroOut", (COL_B, 330), [], size=(320, 26))
    lat = g.add("EmptySD3LatentImage", (COL_B, 402), [1024, 1024, 1], size=(320, 106))
    ks = g.add("KSampler", (COL_C, 0), [42, "fixed", 20, 1.0, "euler", "simple", 1.0], size=(320, 262))
    dec = g.add("VAEDecode", (COL_C, 308), [], size=(210, 46))
    save = g.add("SaveImage", (COL_C, 400), ["layerwise_offload/flux1_dev"], size=(320, 340))
    g.connect(unet, 0, off, "model")
    g.connect(off, 0, ks, "model")
    g.connect(clip, 0, pos, "clip")
    g.connect(pos, 0, guid, "conditioning")
    g.connect(guid, 0, ks, "positive")
    g.connect(pos, 0, neg, "conditioning")
    g.connect(neg, 0, ks, "negative")
    g.connect(lat, 0, ks, "latent_image")
    g.connect(ks, 0, dec, "samples")
    g.connect(vae, 0, dec, "vae")
    g.connect(dec, 0, save, "images")
    _stats(g, (COL_A, 628), off, ks)
    _note(g, (0, 0), HOW_TO + """
### Flux.1 [dev] (bf16)

""" + plan_note("flux1_dev", "1024x1024") + """

Files: `flux1-dev.safetensors` in models/diffusion_models, `clip_l.safetensors` and `t5xxl_fp16.safetensors` in
models/text_encoders, `ae.safetensors` in models/vae.
""", size=(NOTE_WIDTH, 864))
    return g.to_json()


WAN_POSITIVE = "a fox moving quickly in a beautiful winter scenery nature trees mountains daytime tracking camera"
WAN_NEGATIVE = "static, blurry, low quality, worst quality, jpeg artifacts, deformed, extra fingers, messy background"


def _prompt_pair(g, x: int, y: int, positive: str, negative: str, negative_height: int = 160, width: int = 320):
    """The positive and negative CLIPTextEncode nodes, stacked at (x, y) and (x, y + 206)."""
    pos = g.add("CLIPTextEncode", (x, y), [positive], size=(width, 160), title="CLIP Text Encode (Positive Prompt)")
    neg = g.add("CLIPTextEncode", (x, y + 206), [negative], size=(width, negative_height),
                title="CLIP Text Encode (Negative Prompt)")
    return pos, neg


def wan21_t2v_14b() -> Dict[str, Any]:
    g = Graph(_wid("wan21_t2v_14b"))
    unet = g.add(LOADER, (COL_A, 0), ["wan2.1_t2v_14B_bf16.safetensors", "default"], size=(340, 82),
                 color=LOADER_COLOR)
    clip = g.add("CLIPLoader", (COL_A, 128), ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default"],
                 size=(340, 106), color=LOADER_COLOR)
    vae = g.add("VAELoader", (COL_A, 280), ["wan_2.1_vae.safetensors"], size=(340, 58), color=LOADER_COLOR)
    off = _offload(g, (COL_A, 394))
    ms = g.add("ModelSamplingSD3", (COL_B, 0), [8.0], size=(320, 58))
    pos, neg = _prompt_pair(g, COL_B, 104, WAN_POSITIVE, WAN_NEGATIVE)
    lat = g.add("EmptyHunyuanLatentVideo", (COL_B, 516), [832, 480, 33, 1], size=(320, 130))
    ks = g.add("KSampler", (COL_C, 0), [42, "fixed", 30, 6.0, "uni_pc", "simple", 1.0], size=(320, 262))
    dec = g.add("VAEDecode", (COL_C, 308), [], size=(210, 46))
    save = g.add("SaveAnimatedWEBP", (COL_C, 400), ["video/layerwise_offload_wan21", 16.0, False, 90, "default"],
                 size=(320, 180))
    g.connect(unet, 0, off, "model")
    g.connect(off, 0, ms, "model")
    g.connect(ms, 0, ks, "model")
    g.connect(clip, 0, pos, "clip")
    g.connect(clip, 0, neg, "clip")
    g.connect(pos, 0, ks, "positive")
    g.connect(neg, 0, ks, "negative")
    g.connect(lat, 0, ks, "latent_image")
    g.connect(ks, 0, dec, "samples")
    g.connect(vae, 0, dec, "vae")
    g.connect(dec, 0, save, "images")
    _stats(g, (COL_A, 604), off, ks)
    _note(g, (0, 0), HOW_TO + """
### Wan 2.1 T2V 14B (bf16)

""" + plan_note("wan21_t2v_14b", "832x480, 33 frames") + """

Files: `wan2.1_t2v_14B_bf16.safetensors` in models/diffusion_models, `umt5_xxl_fp8_e4m3fn_scaled.safetensors` in
models/text_encoders, `wan_2.1_vae.safetensors` in models/vae.
""", size=(NOTE_WIDTH, 840))
    return g.to_json()


def wan22_t2v_a14b() -> Dict[str, Any]:
    g = Graph(_wid("wan22_t2v_a14b"))
    # Columns: loaders and prompts; the offload, model sampling and stats of each expert; samplers and output.
    a, b, c = WAN22_NOTE_WIDTH + GAP, WAN22_NOTE_WIDTH + 2 * GAP + 380, WAN22_NOTE_WIDTH + 3 * GAP + 380 + 440
    hi = g.add(LOADER, (a, 0), ["wan2.2_t2v_high_noise_14B_fp16.safetensors", "default"], size=(380, 82),
               title="Load Diffusion Model (Layerwise): high noise", color=LOADER_COLOR)
    lo = g.add(LOADER, (a, 138), ["wan2.2_t2v_low_noise_14B_fp16.safetensors", "default"], size=(380, 82),
               title="Load Diffusion Model (Layerwise): low noise", color=LOADER_COLOR)
    clip = g.add("CLIPLoader", (a, 266), ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default"],
                 size=(380, 106), color=LOADER_COLOR)
    vae = g.add("VAELoader", (a, 418), ["wan_2.1_vae.safetensors"], size=(380, 58), color=LOADER_COLOR)
    off_hi = _offload(g, (b, 0), title="Layerwise Offload (high noise)")
    off_lo = _offload(g, (b, 210), title="Layerwise Offload (low noise)")
    ms_hi = g.add("ModelSamplingSD3", (b, 410), [8.0], size=(210, 58))
    ms_lo = g.add("ModelSamplingSD3", (b + 230, 410), [8.0], size=(210, 58))
    pos, neg = _prompt_pair(g, a, 522, WAN_POSITIVE, WAN_NEGATIVE, negative_height=140, width=380)
    lat = g.add("EmptyHunyuanLatentVideo", (a, 914), [640, 640, 81, 1], size=(320, 130))
    ks_hi = g.add("KSamplerAdvanced", (c, 0),
                  ["enable", 42, "fixed", 20, 3.5, "euler", "simple", 0, 10, "enable"], size=(345, 334),
                  title="KSampler (Advanced): high noise, steps 0-10")
    ks_lo = g.add("KSamplerAdvanced", (c, 380),
                  ["disable", 0, "fixed", 20, 3.5, "euler", "simple", 10, 10000, "disable"], size=(345, 334),
                  title="KSampler (Advanced): low noise, steps 10-20")
    dec = g.add("VAEDecode", (c, 760), [], size=(140, 46))
    save = g.add("SaveAnimatedWEBP", (c, 852), ["video/layerwise_offload_wan22", 16.0, False, 90, "default"],
                 size=(345, 180))
    g.connect(hi, 0, off_hi, "model")
    g.connect(lo, 0, off_lo, "model")
    g.connect(off_hi, 0, ms_hi, "model")
    g.connect(off_lo, 0, ms_lo, "model")
    g.connect(ms_hi, 0, ks_hi, "model")
    g.connect(ms_lo, 0, ks_lo, "model")
    g.connect(clip, 0, pos, "clip")
    g.connect(clip, 0, neg, "clip")
    g.connect(pos, 0, ks_hi, "positive")
    g.connect(neg, 0, ks_hi, "negative")
    g.connect(pos, 0, ks_lo, "positive")
    g.connect(neg, 0, ks_lo, "negative")
    g.connect(lat, 0, ks_hi, "latent_image")
    g.connect(ks_hi, 0, ks_lo, "latent_image")
    g.connect(ks_lo, 0, dec, "samples")
    g.connect(vae, 0, dec, "vae")
    g.connect(dec, 0, save, "images")
    _stats(g, (b, 524), off_hi, ks_hi, title="Layerwise Offload Stats (high noise)")
    _stats(g, (b, 816), off_lo, ks_lo, title="Layerwise Offload Stats (low noise)")
    _note(g, (0, 0), HOW_TO + """
### Wan 2.2 T2V A14B (two fp16 experts)

The experts run one after the other (high noise for steps 0-10, low noise for 10-20), each through its own
Layerwise Offload node, so `resident_layers` is for ONE expert: when the low-noise expert needs the room,
ComfyUI unloads the high-noise one (its resident blocks included).

""" + plan_note("wan22_t2v_a14b", "640x640, 81 frames") + """

Files: `wan2.2_t2v_high_noise_14B_fp16.safetensors` and `wan2.2_t2v_low_noise_14B_fp16.safetensors` in
models/diffusion_models, `umt5_xxl_fp8_e4m3fn_scaled.safetensors` in models/text_encoders,
`wan_2.1_vae.safetensors` in models/vae.
""", size=(WAN22_NOTE_WIDTH, 1052))
    return g.to_json()


def qwen_image() -> Dict[str, Any]:
    g = Graph(_wid("qwen_image"))
    unet = g.add(LOADER, (COL_A, 0), ["qwen_image_fp8_e4m3fn.safetensors", "default"], size=(340, 82),
                 color=LOADER_COLOR)
    clip = g.add("CLIPLoader", (COL_A, 128), ["qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image", "default"],
                 size=(340, 106), color=LOADER_COLOR)
    vae = g.add("VAELoader", (COL_A, 280), ["qwen_image_vae.safetensors"], size=(340, 58), color=LOADER_COLOR)
    off = _offload(g, (COL_A, 394))
    ms = g.add("ModelSamplingAuraFlow", (COL_B, 0), [3.1], size=(320, 58))
    pos, neg = _prompt_pair(g, COL_B, 104, "a cozy bookshop window at night, warm light, a hand-painted sign that "
                            "reads \"Layerwise Offload\"", "", negative_height=120)
    lat = g.add("EmptySD3LatentImage", (COL_B, 476), [1328, 1328, 1], size=(320, 106))
    ks = g.add("KSampler", (COL_C, 0), [42, "fixed", 20, 2.5, "euler", "simple", 1.0], size=(320, 262))
    dec = g.add("VAEDecode", (COL_C, 308), [], size=(210, 46))
    save = g.add("SaveImage", (COL_C, 400), ["layerwise_offload/qwen_image"], size=(320, 340))
    g.connect(unet, 0, off, "model")
    g.connect(off, 0, ms, "model")
    g.connect(ms, 0, ks, "model")
    g.connect(clip, 0, pos, "clip")
    g.connect(clip, 0, neg, "clip")
    g.connect(pos, 0, ks, "positive")
    g.connect(neg, 0, ks, "negative")
    g.connect(lat, 0, ks, "latent_image")
    g.connect(ks, 0, dec, "samples")
    g.connect(vae, 0, dec, "vae")
    g.connect(dec, 0, save, "images")
    _stats(g, (COL_A, 604), off, ks)
    _note(g, (0, 0), HOW_TO + """
### Qwen-Image (fp8 e4m3fn)

""" + plan_note("qwen_image", "1328x1328") + """
For reference, SGLang measured 34 of 60 resident blocks at 1.67x the speed of streaming all of them (RTX 5090).

Files: `qwen_image_fp8_e4m3fn.safetensors` in models/diffusion_models, `qwen_2.5_vl_7b_fp8_scaled.safetensors` in
models/text_encoders, `qwen_image_vae.safetensors` in models/vae.
""", size=(NOTE_WIDTH, 840))
    return g.to_json()


def hunyuan_video() -> Dict[str, Any]:
    g = Graph(_wid("hunyuan_video"))
    unet = g.add(LOADER, (COL_A, 0), ["hunyuan_video_t2v_720p_bf16.safetensors", "default"], size=(340, 82),
                 color=LOADER_COLOR)
    clip = g.add("DualCLIPLoader", (COL_A, 128),
                 ["clip_l.safetensors", "llava_llama3_fp8_scaled.safetensors", "hunyuan_video", "default"],
                 size=(340, 130), color=LOADER_COLOR)
    vae = g.add("VAELoader", (COL_A, 304), ["hunyuan_video_vae_bf16.safetensors"], size=(340, 58),
                color=LOADER_COLOR)
    off = _offload(g, (COL_A, 418), prefetch=2)
    pos = g.add("CLIPTextEncode", (COL_B, 0), [
        "a cat walks on the grass, realistic style, soft afternoon light"],
        size=(320, 160), title="CLIP Text Encode (Positive Prompt)")
    guid = g.add("FluxGuidance", (COL_B, 206), [6.0], size=(320, 58))
    ms = g.add("ModelSamplingSD3", (COL_B, 310), [7.0], size=(320, 58))
    lat = g.add("EmptyHunyuanLatentVideo", (COL_B, 414), [848, 480, 73, 1], size=(320, 130))
    noise = g.add("RandomNoise", (COL_B, 590), [42, "fixed"], size=(320, 82))
    sampler = g.add("KSamplerSelect", (COL_B, 718), ["euler"], size=(320, 58))
    sched = g.add("BasicScheduler", (COL_B, 822), ["simple", 20, 1.0], size=(320, 106))
    guider = g.add("BasicGuider", (COL_C, 0), [], size=(240, 46))
    sca = g.add("SamplerCustomAdvanced", (COL_C, 92), [], size=(320, 326))
    dec = g.add("VAEDecodeTiled", (COL_C, 464), [256, 64, 64, 8], size=(320, 150))
    save = g.add("SaveAnimatedWEBP", (COL_C, 660), ["video/layerwise_offload_hunyuan", 24.0, False, 90, "default"],
                 size=(320, 180))
    g.connect(unet, 0, off, "model")
    g.connect(off, 0, ms, "model")
    g.connect(ms, 0, guider, "model")
    g.connect(ms, 0, sched, "model")
    g.connect(clip, 0, pos, "clip")
    g.connect(pos, 0, guid, "conditioning")
    g.connect(guid, 0, guider, "conditioning")
    g.connect(noise, 0, sca, "noise")
    g.connect(guider, 0, sca, "guider")
    g.connect(sampler, 0, sca, "sampler")
    g.connect(sched, 0, sca, "sigmas")
    g.connect(lat, 0, sca, "latent_image")
    g.connect(sca, 0, dec, "samples")
    g.connect(vae, 0, dec, "vae")
    g.connect(dec, 0, save, "images")
    _stats(g, (COL_A, 628), off, sca)
    _note(g, (0, 0), HOW_TO + """
### HunyuanVideo T2V 720p (bf16)

""" + plan_note("hunyuan_video", "848x480, 73 frames with `prefetch_size = 2`") + """
Lower `tile_size` in VAE Decode (Tiled) if decoding runs out of memory.

Files: `hunyuan_video_t2v_720p_bf16.safetensors` in models/diffusion_models, `clip_l.safetensors` and
`llava_llama3_fp8_scaled.safetensors` in models/text_encoders, `hunyuan_video_vae_bf16.safetensors` in models/vae.
""", size=(NOTE_WIDTH, 928))
    return g.to_json()


def tiny_demo() -> Dict[str, Any]:
    g = Graph(_wid("tiny_wan21_demo"))
    # Columns: the note; loaders, offload and what feeds the sampler; sampler, decode and stats; outputs.
    a, b, c = TINY_NOTE_WIDTH + GAP, TINY_NOTE_WIDTH + 2 * GAP + 350, TINY_NOTE_WIDTH + 3 * GAP + 350 + 320
    unet = g.add("UNETLoader", (a, 0), ["layerwise_offload_tiny_wan21.safetensors", "default"], size=(350, 82),
                 color=LOADER_COLOR)
    data = g.add("LoadTrainingDataset", (a, 128), ["layerwise_offload_tiny_wan21_cond"], size=(350, 82),
                 title="Tiny conditioning (stands in for a text encoder)")
    vae = g.add("VAELoader", (a, 256), ["layerwise_offload_tiny_wan21_vae.safetensors"], size=(350, 58),
                color=LOADER_COLOR)
    off = _offload(g, (a, 370))
    ms = g.add("ModelSamplingSD3", (a, 570), [8.0], size=(320, 58))
    neg = g.add("ConditioningZeroOut", (a, 674), [], size=(320, 26))
    lat = g.add("EmptyHunyuanLatentVideo", (a, 746), [64, 64, 5, 1], size=(320, 130))
    ks = g.add("KSampler", (b, 0), [42, "fixed", 4, 2.0, "euler", "simple", 1.0], size=(320, 262))
    save_lat = g.add("SaveLatent", (c, 0), ["layerwise_offload/tiny_wan21"], size=(320, 58))
    dec = g.add("VAEDecode", (b, 308), [], size=(210, 46))
    save = g.add("SaveImage", (c, 104), ["layerwise_offload/tiny_wan21"], size=(320, 300))
    g.connect(unet, 0, off, "model")
    g.connect(off, 0, ms, "model")
    g.connect(ms, 0, ks, "model")
    g.connect(data, 1, ks, "positive")
    g.connect(data, 1, neg, "conditioning")
    g.connect(neg, 0, ks, "negative")
    g.connect(lat, 0, ks, "latent_image")
    g.connect(ks, 0, save_lat, "samples")
    g.connect(ks, 0, dec, "samples")
    g.connect(vae, 0, dec, "vae")
    g.connect(dec, 0, save, "images")
    _stats(g, (b, 470), off, ks)
    _note(g, (0, 0), _graph.TINY_DEMO_NOTE, size=(TINY_NOTE_WIDTH, 876))
    return g.to_json()


def _refit(wf: Dict[str, Any]) -> Dict[str, Any]:
    """``wf`` opening at the view that fits its nodes (a variant may resize its loaders)."""
    wf["extra"]["ds"] = _graph.fitted_view(wf["nodes"])
    return wf


def wan22_t2v_a14b_fp8() -> Dict[str, Any]:
    return _refit(_variants.wan22_fp8(wan22_t2v_a14b(), _wid("wan22_t2v_a14b_fp8"),
                                      plan_note("wan22_t2v_a14b_fp8", "640x640, 81 frames")))


def wan22_t2v_a14b_gguf() -> Dict[str, Any]:
    return _refit(_variants.wan22_gguf(wan22_t2v_a14b(), _wid("wan22_t2v_a14b_gguf"),
                                       plan_note("wan22_t2v_a14b_gguf", "640x640, 81 frames")))


_variants = _graph._sibling("workflow_variants")
_cards, file_name, card_spec = _graph.cards, _graph.file_name, _graph.card_spec
TINY_TITLE = "A tiny demo - random 4-block Wan 2.1, runs on any GPU or CPU"
# (planner key, file title, card title, card subtitle, builder). ComfyUI's template browser (frontends 1.32 to
# 1.58) shows a pack's template by its file name, as title and as description, in the order the server lists
# the files, with <name>.jpg as its card picture; so the names say what each needs, and the tiny demo's name
# sorts first.
TEMPLATES = [
    (None, TINY_TITLE, "A tiny demo", "random 4-block Wan 2.1, 19 MB", tiny_demo),
    ("flux1_dev", "Flux.1 dev - text to image", "Flux.1 dev", "text to image, 1024x1024, bf16", flux1_dev),
    ("wan21_t2v_14b", "Wan 2.1 T2V 14B - text to video", "Wan 2.1 T2V 14B", "text to video, 832x480x33, bf16",
     wan21_t2v_14b),
    ("wan22_t2v_a14b", "Wan 2.2 T2V A14B - text to video, two experts", "Wan 2.2 T2V A14B",
     "two experts, 640x640x81, fp16", wan22_t2v_a14b),
    ("wan22_t2v_a14b_fp8", "Wan 2.2 T2V A14B fp8 - text to video, two experts", "Wan 2.2 A14B fp8",
     "two experts, 640x640x81, fp8 scaled", wan22_t2v_a14b_fp8),
    ("wan22_t2v_a14b_gguf", "Wan 2.2 T2V A14B GGUF - text to video, two experts", "Wan 2.2 A14B GGUF",
     "two experts, 640x640x81, Q4_K_M (ComfyUI-GGUF)", wan22_t2v_a14b_gguf),
    ("qwen_image", "Qwen-Image - text to image", "Qwen-Image", "text to image, 1328x1328, fp8", qwen_image),
    ("hunyuan_video", "HunyuanVideo T2V 720p - text to video", "HunyuanVideo T2V", "text to video, 848x480x73, bf16",
     hunyuan_video),
]


#: File name -> builder.
WORKFLOWS = {file_name(key, title): build for key, title, _, _, build in TEMPLATES}
readme_with_table = _graph.readme_with_table


def render(build) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a file would change")
    ap.add_argument("--out", default=str(WORKFLOW_DIR))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    changed, wanted = [], set()
    for key, title, card_title, subtitle, build in TEMPLATES:
        name = file_name(key, title)
        p, picture, spec = out / name, (out / name).with_suffix(".jpg"), card_spec(key, card_title, subtitle)
        wanted |= {p.name, picture.name}
        text = render(build)
        if not p.is_file() or p.read_text(encoding="utf-8") != text:
            changed.append(p.name)
            if not a.check:
                p.write_text(text, encoding="utf-8")
        if not _cards.card_is_current(picture, spec):
            changed.append(picture.name)
            if not a.check:
                _cards.write_card(picture, spec)
    stale = sorted(f.name for f in out.iterdir() if f.suffix in (".json", ".jpg") and f.name not in wanted)
    README = _graph.README
    readme = README.read_text(encoding="utf-8")
    if out == WORKFLOW_DIR and readme_with_table(readme) != readme:
        changed.append(README.name)
        if not a.check:
            README.write_text(readme_with_table(readme), encoding="utf-8")
    if a.check:
        for c in changed:
            print(f"differs: {c}")
        for c in stale:
            print(f"not a template any more: {out / c}")
        return 1 if changed or stale else 0
    for c in stale:
        (out / c).unlink()
    print(f"wrote {len(TEMPLATES)} workflows and their pictures to {out} ({len(changed)} changed, "
          f"{len(stale)} stale removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
