"""Write the templates in ``workflows/`` (UI-format workflows and their card pictures) and the README's memory table.

The templates follow ComfyUI's own (comfyui-workflow-templates 0.7.25: flux_dev_full_text_to_image,
text_to_video_wan, video_wan2_2_14B_t2v, image_qwen_image, hunyuan_video_text_to_video) with a ``LayerwiseOffload``
node after the diffusion-model loader. Their notes (devtools/template_notes.md), file names, pictures
(devtools/template_cards.py) and the README table all come from one planner run, devtools/template_plans.json
(written by devtools/template_memory.py --write).

    .venv/bin/python -P devtools/make_workflows.py            # rewrite workflows/ and the README table
    .venv/bin/python -P devtools/make_workflows.py --check    # exit 1 if a file differs from what it would write
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path
from typing import List, Optional

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).with_name("comfy_env.py")))["enter_pack"](globals())

from . import template_cards as cards, template_memory as memory  # noqa: E402
from .workflow_graph import (FROM_CHECKPOINT, GGUF_LOADER, LEFT_IN_THE_FILE, LOADER_ID, NODE_ID,  # noqa: E402
                             STATS_ID, Graph)

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_DIR, README = REPO / "workflows", REPO / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- devtools/make_workflows.py: memory table -->", "<!-- end of memory table -->"
#: The planner run every note, card picture and the README table are written from.
PLANS = memory.load_plans()
GB = 10**9

#: The notes' text by section (devtools/template_notes.md): how_to, tiny_demo and one per template key.
_PARTS = re.split(r"^<!-- (\w+) -->\n", Path(__file__).with_name("template_notes.md").read_text(encoding="utf-8"),
                  flags=re.M)
NOTES = {name: body.strip("\n") + "\n" for name, body in zip(_PARTS[1::2], _PARTS[2::2])}


# --------------------------------------------------------------------------------------------- numbers in words
def plan_note(key: str, setting: str) -> str:
    """The note's block sizes, per-card counts and RAM for the template ``key``."""
    t = memory.plan_for(PLANS, key)
    groups = [(len(list(run)), size) for size, run in itertools.groupby(round(b / GB, 2) for b in t["block_bytes"])]
    blocks = ", then ".join(f"{n} of {size:.2f} GB" for n, size in groups)
    blocks = (f"{groups[0][0]} blocks of {groups[0][1]:.2f} GB" if len(groups) == 1 else
              f"{len(t['block_bytes'])} blocks in call order: {blocks}")
    per = " per expert" if t["experts"] > 1 else ""
    counts = ", ".join(f"{c} GB: {'0*' if r is None else r}" for c, r in zip(PLANS["cards_gib"], t["resident"]))
    text = (f"{blocks}{per}. **Auto keeps resident at {setting}**{per}: {counts} "
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


def file_name(key: Optional[str], title: str) -> str:
    """A template's file name, which the template browser shows as its title and description: what it is, the
    RAM it needs (from the disk-tier figure up where its loader leaves the weights in the file) and the smallest
    card auto plans for; the tiny demo (``key`` None): its title."""
    if key is None:
        return f"{title}.json"
    t = memory.plan_for(PLANS, key)
    ram = f"{t['ram_bytes'] / GB:.0f} GB RAM"
    if key in LEFT_IN_THE_FILE:
        ram = f"{memory.disk_tier_ram_bytes(PLANS, t) / GB:.0f}+ GB RAM ({t['ram_bytes'] / GB:.0f} GB for full speed)"
    card = next(c for c, r in zip(PLANS["cards_gib"], t["resident"]) if r is not None)
    return f"{title}, {ram}, {card}+ GB GPU.json"


def card_spec(key: Optional[str], card_title: str, subtitle: str):
    if key is None:
        return cards.demo_spec(card_title, subtitle, 4, "python demo/install_tiny_demo.py")
    t = memory.plan_for(PLANS, key)
    low = memory.disk_tier_ram_bytes(PLANS, t) if key in LEFT_IN_THE_FILE else None
    return cards.model_spec(card_title, subtitle, PLANS, t, low)


def readme_with_table(text: str) -> str:
    """``text`` (the README) with the memory table between its markers written from :data:`PLANS`."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"README.md lacks the markers {TABLE_BEGIN} ... {TABLE_END}")
    head, rest = text.split(TABLE_BEGIN, 1)
    table = "\n".join(memory.markdown_table(PLANS))
    return f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}" + rest.split(TABLE_END, 1)[1]


# --------------------------------------------------------------------------------------------------- workflows
# The layout: a note on the left, then columns of nodes 30 apart, compact enough that the frontend's fit to the
# window (workflow_graph.fitted_view) draws the node text (tests/e2e/test_workflows.py checks the zoom). One-model
# templates, after a 400-wide note: loaders, the offload node and its stats (420 wide: web/js/stats.js);
# conditioning and latent (320); sampler and output.
A, B, C = 430, 880, 1230
POSITIVE, NEGATIVE = "CLIP Text Encode (Positive Prompt)", "CLIP Text Encode (Negative Prompt)"
WAN_POSITIVE = "a fox moving quickly in a beautiful winter scenery nature trees mountains daytime tracking camera"
WAN_NEGATIVE = "static, blurry, low quality, worst quality, jpeg artifacts, deformed, extra fingers, messy background"
ONE_MODEL_LINKS = ("unet>off.model off>ms.model ms>ks.model clip>pos.clip clip>neg.clip pos>ks.positive "
                   "neg>ks.negative lat>ks.latent_image ks>dec.samples vae>dec.vae dec>save.images")


def offload(g: Graph, name: str, pos, prefetch: int = 1, title: Optional[str] = None) -> None:
    """Every shipped workflow starts in auto mode (-1); the notes give fixed counts for each card size."""
    g.add(name, NODE_ID, pos, (320, 154), -1, prefetch, "auto", True, "auto", title=title)


def stats(g: Graph, pos, offload_node: str, sampler: str, title: Optional[str] = None) -> None:
    """A Layerwise Offload Stats node reading the offload's MODEL after ``sampler`` ran (420 wide, as
    web/js/stats.js makes it)."""
    g.add(f"{offload_node}_stats", STATS_ID, pos, (420, 228), title=title)
    g.link(f"{offload_node}>{offload_node}_stats.model {sampler}>{offload_node}_stats.after")


def prompts(g: Graph, x: int, y: int, positive: str, negative: str, negative_height: int = 160, width: int = 320):
    g.add("pos", "CLIPTextEncode", (x, y), (width, 160), positive, title=POSITIVE)
    g.add("neg", "CLIPTextEncode", (x, y + 206), (width, negative_height), negative, title=NEGATIVE)


def note(g: Graph, height: int, key: str, setting: str, width: int = 400) -> None:
    """The note of a real-model template: how to choose ``resident_layers``, then its own section with the plan
    for ``setting`` (the resolution) in place of ``{plan}``."""
    text = NOTES["how_to"] + "\n" + NOTES[key].replace("{plan}", plan_note(key, setting))
    g.add("note", "MarkdownNote", (0, 0), (width, height), text)


def flux1_dev(g: Graph) -> None:
    g.add("unet", LOADER_ID, (A, 0), (340, 82), "flux1-dev.safetensors", "default")
    g.add("clip", "DualCLIPLoader", (A, 128), (340, 130), "clip_l.safetensors", "t5xxl_fp16.safetensors", "flux",
          "default")
    g.add("vae", "VAELoader", (A, 304), (340, 58), "ae.safetensors")
    offload(g, "off", (A, 418))
    g.add("pos", "CLIPTextEncode", (B, 0), (320, 180), "a red fox sitting in fresh snow at sunrise, golden light, "
          "shallow depth of field, detailed fur", title=POSITIVE)
    g.add("guid", "FluxGuidance", (B, 226), (320, 58), 3.5)
    g.add("neg", "ConditioningZeroOut", (B, 330), (320, 26))
    g.add("lat", "EmptySD3LatentImage", (B, 402), (320, 106), 1024, 1024, 1)
    g.add("ks", "KSampler", (C, 0), (320, 262), 42, "fixed", 20, 1.0, "euler", "simple", 1.0)
    g.add("dec", "VAEDecode", (C, 308), (210, 46))
    g.add("save", "SaveImage", (C, 400), (320, 340), "layerwise_offload/flux1_dev")
    g.link("unet>off.model off>ks.model clip>pos.clip pos>guid.conditioning guid>ks.positive pos>neg.conditioning "
           "neg>ks.negative lat>ks.latent_image ks>dec.samples vae>dec.vae dec>save.images")
    stats(g, (A, 628), "off", "ks")
    note(g, 864, "flux1_dev", "1024x1024")


def wan21_t2v_14b(g: Graph) -> None:
    g.add("unet", LOADER_ID, (A, 0), (340, 82), "wan2.1_t2v_14B_bf16.safetensors", "default")
    g.add("clip", "CLIPLoader", (A, 128), (340, 106), "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default")
    g.add("vae", "VAELoader", (A, 280), (340, 58), "wan_2.1_vae.safetensors")
    offload(g, "off", (A, 394))
    g.add("ms", "ModelSamplingSD3", (B, 0), (320, 58), 8.0)
    prompts(g, B, 104, WAN_POSITIVE, WAN_NEGATIVE)
    g.add("lat", "EmptyHunyuanLatentVideo", (B, 516), (320, 130), 832, 480, 33, 1)
    g.add("ks", "KSampler", (C, 0), (320, 262), 42, "fixed", 30, 6.0, "uni_pc", "simple", 1.0)
    g.add("dec", "VAEDecode", (C, 308), (210, 46))
    g.add("save", "SaveAnimatedWEBP", (C, 400), (320, 180), "video/layerwise_offload_wan21", 16.0, False, 90,
          "default")
    g.link(ONE_MODEL_LINKS)
    stats(g, (A, 604), "off", "ks")
    note(g, 840, "wan21_t2v_14b", "832x480, 33 frames")


#: QuantStack's Q4_K_M files for ComfyUI-GGUF (https://huggingface.co/QuantStack/Wan2.2-T2V-A14B-GGUF), by expert.
WAN22_GGUF_FILES = {"high": "Wan2.2-T2V-A14B-HighNoise-Q4_K_M.gguf", "low": "Wan2.2-T2V-A14B-LowNoise-Q4_K_M.gguf"}


def wan22_t2v_a14b(g: Graph, quant: str = "fp16") -> None:
    """Two experts, each through its own offload node; ``quant``: fp16, fp8_scaled (ComfyUI's fp8 files) or gguf
    (ComfyUI-GGUF's loader; no download URL: the frontend downloads only .safetensors, so the note links them)."""
    a, b, c = 450, 860, 1330  # loaders and prompts; each expert's offload, model sampling and stats; samplers
    for i, expert in enumerate(("high", "low")):
        if quant == "gguf":
            g.add(expert, GGUF_LOADER, (a, 138 * i), (340, 58), WAN22_GGUF_FILES[expert],
                  title=f"Unet Loader (GGUF): {expert} noise expert")
        else:
            g.add(expert, LOADER_ID, (a, 138 * i), (380, 82), f"wan2.2_t2v_{expert}_noise_14B_{quant}.safetensors",
                  "default", title=f"Load Diffusion Model (Layerwise): {expert} noise")
    g.add("clip", "CLIPLoader", (a, 266), (380, 106), "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default")
    g.add("vae", "VAELoader", (a, 418), (380, 58), "wan_2.1_vae.safetensors")
    offload(g, "off_hi", (b, 0), title="Layerwise Offload (high noise)")
    offload(g, "off_lo", (b, 210), title="Layerwise Offload (low noise)")
    g.add("ms_hi", "ModelSamplingSD3", (b, 410), (210, 58), 8.0)
    g.add("ms_lo", "ModelSamplingSD3", (b + 230, 410), (210, 58), 8.0)
    prompts(g, a, 522, WAN_POSITIVE, WAN_NEGATIVE, negative_height=140, width=380)
    g.add("lat", "EmptyHunyuanLatentVideo", (a, 914), (320, 130), 640, 640, 81, 1)
    g.add("ks_hi", "KSamplerAdvanced", (c, 0), (345, 334), "enable", 42, "fixed", 20, 3.5, "euler", "simple", 0, 10,
          "enable", title="KSampler (Advanced): high noise, steps 0-10")
    g.add("ks_lo", "KSamplerAdvanced", (c, 380), (345, 334), "disable", 0, "fixed", 20, 3.5, "euler", "simple", 10,
          10000, "disable", title="KSampler (Advanced): low noise, steps 10-20")
    g.add("dec", "VAEDecode", (c, 760), (140, 46))
    g.add("save", "SaveAnimatedWEBP", (c, 852), (345, 180), "video/layerwise_offload_wan22", 16.0, False, 90,
          "default")
    g.link("high>off_hi.model low>off_lo.model off_hi>ms_hi.model off_lo>ms_lo.model ms_hi>ks_hi.model "
           "ms_lo>ks_lo.model clip>pos.clip clip>neg.clip pos>ks_hi.positive neg>ks_hi.negative pos>ks_lo.positive "
           "neg>ks_lo.negative lat>ks_hi.latent_image ks_hi>ks_lo.latent_image ks_lo>dec.samples vae>dec.vae "
           "dec>save.images")
    stats(g, (b, 524), "off_hi", "ks_hi", title="Layerwise Offload Stats (high noise)")
    stats(g, (b, 816), "off_lo", "ks_lo", title="Layerwise Offload Stats (low noise)")
    key = {"fp16": "wan22_t2v_a14b", "fp8_scaled": "wan22_t2v_a14b_fp8", "gguf": "wan22_t2v_a14b_gguf"}[quant]
    note(g, 1052, key, "640x640, 81 frames", width=420)


def qwen_image(g: Graph) -> None:
    g.add("unet", LOADER_ID, (A, 0), (340, 82), "qwen_image_fp8_e4m3fn.safetensors", "default")
    g.add("clip", "CLIPLoader", (A, 128), (340, 106), "qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image",
          "default")
    g.add("vae", "VAELoader", (A, 280), (340, 58), "qwen_image_vae.safetensors")
    offload(g, "off", (A, 394))
    g.add("ms", "ModelSamplingAuraFlow", (B, 0), (320, 58), 3.1)
    prompts(g, B, 104, "a cozy bookshop window at night, warm light, a hand-painted sign that reads \"Layerwise "
            "Offload\"", "", negative_height=120)
    g.add("lat", "EmptySD3LatentImage", (B, 476), (320, 106), 1328, 1328, 1)
    g.add("ks", "KSampler", (C, 0), (320, 262), 42, "fixed", 20, 2.5, "euler", "simple", 1.0)
    g.add("dec", "VAEDecode", (C, 308), (210, 46))
    g.add("save", "SaveImage", (C, 400), (320, 340), "layerwise_offload/qwen_image")
    g.link(ONE_MODEL_LINKS)
    stats(g, (A, 604), "off", "ks")
    note(g, 840, "qwen_image", "1328x1328")


def hunyuan_video(g: Graph) -> None:
    g.add("unet", LOADER_ID, (A, 0), (340, 82), "hunyuan_video_t2v_720p_bf16.safetensors", "default")
    g.add("clip", "DualCLIPLoader", (A, 128), (340, 130), "clip_l.safetensors", "llava_llama3_fp8_scaled.safetensors",
          "hunyuan_video", "default")
    g.add("vae", "VAELoader", (A, 304), (340, 58), "hunyuan_video_vae_bf16.safetensors")
    offload(g, "off", (A, 418), prefetch=2)
    g.add("pos", "CLIPTextEncode", (B, 0), (320, 160), "a cat walks on the grass, realistic style, soft afternoon "
          "light", title=POSITIVE)
    g.add("guid", "FluxGuidance", (B, 206), (320, 58), 6.0)
    g.add("ms", "ModelSamplingSD3", (B, 310), (320, 58), 7.0)
    g.add("lat", "EmptyHunyuanLatentVideo", (B, 414), (320, 130), 848, 480, 73, 1)
    g.add("noise", "RandomNoise", (B, 590), (320, 82), 42, "fixed")
    g.add("sampler", "KSamplerSelect", (B, 718), (320, 58), "euler")
    g.add("sched", "BasicScheduler", (B, 822), (320, 106), "simple", 20, 1.0)
    g.add("guider", "BasicGuider", (C, 0), (240, 46))
    g.add("sca", "SamplerCustomAdvanced", (C, 92), (320, 326))
    g.add("dec", "VAEDecodeTiled", (C, 464), (320, 150), 256, 64, 64, 8)
    g.add("save", "SaveAnimatedWEBP", (C, 660), (320, 180), "video/layerwise_offload_hunyuan", 24.0, False, 90,
          "default")
    g.link("unet>off.model off>ms.model ms>guider.model ms>sched.model clip>pos.clip pos>guid.conditioning "
           "guid>guider.conditioning noise>sca.noise guider>sca.guider sampler>sca.sampler sched>sca.sigmas "
           "lat>sca.latent_image sca>dec.samples vae>dec.vae dec>save.images")
    stats(g, (A, 628), "off", "sca")
    note(g, 928, "hunyuan_video", "848x480, 73 frames with `prefetch_size = 2`")


def tiny_demo(g: Graph) -> None:
    a, b, c = 430, 810, 1160  # loaders, offload and what feeds the sampler; sampler, decode and stats; outputs
    g.add("unet", "UNETLoader", (a, 0), (350, 82), "layerwise_offload_tiny_wan21.safetensors", "default")
    g.add("data", "LoadTrainingDataset", (a, 128), (350, 82), "layerwise_offload_tiny_wan21_cond",
          title="Tiny conditioning (stands in for a text encoder)")
    g.add("vae", "VAELoader", (a, 256), (350, 58), "layerwise_offload_tiny_wan21_vae.safetensors")
    offload(g, "off", (a, 370))
    g.add("ms", "ModelSamplingSD3", (a, 570), (320, 58), 8.0)
    g.add("neg", "ConditioningZeroOut", (a, 674), (320, 26))
    g.add("lat", "EmptyHunyuanLatentVideo", (a, 746), (320, 130), 64, 64, 5, 1)
    g.add("ks", "KSampler", (b, 0), (320, 262), 42, "fixed", 4, 2.0, "euler", "simple", 1.0)
    g.add("save_lat", "SaveLatent", (c, 0), (320, 58), "layerwise_offload/tiny_wan21")
    g.add("dec", "VAEDecode", (b, 308), (210, 46))
    g.add("save", "SaveImage", (c, 104), (320, 300), "layerwise_offload/tiny_wan21")
    g.link("unet>off.model off>ms.model ms>ks.model data:1>ks.positive data:1>neg.conditioning neg>ks.negative "
           "lat>ks.latent_image ks>save_lat.samples ks>dec.samples vae>dec.vae dec>save.images")
    stats(g, (b, 470), "off", "ks")
    g.add("note", "MarkdownNote", (0, 0), (400, 876), NOTES["tiny_demo"])


# (planner key, file title, card title, card subtitle, builder). ComfyUI's template browser (frontends 1.32 to
# 1.58) shows a pack's template by its file name, as title and as description, in the order the server lists
# the files, with <name>.jpg as its card picture; so the names say what each needs, and the tiny demo's name
# sorts first.
TEMPLATES = [
    (None, "A tiny demo - random 4-block Wan 2.1, runs on any GPU or CPU", "A tiny demo",
     "random 4-block Wan 2.1, 19 MB", tiny_demo),
    ("flux1_dev", "Flux.1 dev - text to image", "Flux.1 dev", "text to image, 1024x1024, bf16", flux1_dev),
    ("wan21_t2v_14b", "Wan 2.1 T2V 14B - text to video", "Wan 2.1 T2V 14B", "text to video, 832x480x33, bf16",
     wan21_t2v_14b),
    ("wan22_t2v_a14b", "Wan 2.2 T2V A14B - text to video, two experts", "Wan 2.2 T2V A14B",
     "two experts, 640x640x81, fp16", wan22_t2v_a14b),
    ("wan22_t2v_a14b_fp8", "Wan 2.2 T2V A14B fp8 - text to video, two experts", "Wan 2.2 A14B fp8",
     "two experts, 640x640x81, fp8 scaled", lambda g: wan22_t2v_a14b(g, "fp8_scaled")),
    ("wan22_t2v_a14b_gguf", "Wan 2.2 T2V A14B GGUF - text to video, two experts", "Wan 2.2 A14B GGUF",
     "two experts, 640x640x81, Q4_K_M (ComfyUI-GGUF)", lambda g: wan22_t2v_a14b(g, "gguf")),
    ("qwen_image", "Qwen-Image - text to image", "Qwen-Image", "text to image, 1328x1328, fp8", qwen_image),
    ("hunyuan_video", "HunyuanVideo T2V 720p - text to video", "HunyuanVideo T2V", "text to video, 848x480x73, bf16",
     hunyuan_video),
]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a file would change")
    ap.add_argument("--out", default=str(WORKFLOW_DIR))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    writes, wanted = {}, set()  # file name -> what writes it
    for key, title, card_title, subtitle, build in TEMPLATES:
        path, g = out / file_name(key, title), Graph(key or "tiny_wan21_demo")
        build(g)
        picture, spec = path.with_suffix(".jpg"), card_spec(key, card_title, subtitle)
        text = json.dumps(g.to_json(), indent=2, ensure_ascii=False) + "\n"
        wanted |= {path.name, picture.name}
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            writes[path.name] = lambda path=path, text=text: path.write_text(text, encoding="utf-8")
        if not cards.card_is_current(picture, spec):
            writes[picture.name] = lambda picture=picture, spec=spec: cards.write_card(picture, spec)
    stale = sorted(f.name for f in out.iterdir() if f.suffix in (".json", ".jpg") and f.name not in wanted)
    readme = README.read_text(encoding="utf-8")
    if out == WORKFLOW_DIR and readme_with_table(readme) != readme:
        writes[README.name] = lambda: README.write_text(readme_with_table(readme), encoding="utf-8")
    if a.check:
        for name in writes:
            print(f"differs: {name}")
        for name in stale:
            print(f"not a template any more: {out / name}")
        return 1 if writes or stale else 0
    for write in writes.values():
        write()
    for c in stale:
        (out / c).unlink()
    print(f"wrote {len(TEMPLATES)} workflows and their pictures to {out} ({len(writes)} changed, "
          f"{len(stale)} stale removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
