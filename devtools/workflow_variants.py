"""Quantized variants of a shipped workflow: the same graph, other diffusion-model files or another loader.

devtools/make_workflows.py builds the fp16 Wan 2.2 graph and passes it through these functions; they only rewrite
the loader nodes and the model part of the note, so every variant keeps the layout, the offload nodes and the
samplers of its original. Pure Python (no ComfyUI, no torch), like make_workflows.py.
"""

from __future__ import annotations

from typing import Any, Dict

#: The diffusion-model loaders a variant rewrites: ComfyUI's own, or the pack's (workflow_graph.LOADER_ID).
DIT_LOADERS = ("UNETLoader", "LayerwiseOffloadLoadDiffusionModel")

__all__ = ["GGUF_LOADER", "GGUF_PACK", "WAN22_GGUF_FILES", "WAN22_GGUF_REPO", "wan22_fp8", "wan22_gguf"]

#: city96's ComfyUI-GGUF: its diffusion-model loader and how the frontend names the pack (Comfy Registry id and
#: GitHub repository, what its missing-node dialog offers to install).
GGUF_LOADER = "UnetLoaderGGUF"
GGUF_PACK = {"cnr_id": "comfyui-gguf", "aux_id": "city96/ComfyUI-GGUF"}
WAN22_GGUF_REPO = "https://huggingface.co/QuantStack/Wan2.2-T2V-A14B-GGUF"
#: The Q4_K_M files of QuantStack's repository (folders HighNoise/ and LowNoise/ there), by expert.
WAN22_GGUF_FILES = {"high_noise": "Wan2.2-T2V-A14B-HighNoise-Q4_K_M.gguf",
                    "low_noise": "Wan2.2-T2V-A14B-LowNoise-Q4_K_M.gguf"}

_WAN22_HEADING = "### Wan 2.2"


def _replace_model_note(wf: Dict[str, Any], text: str) -> None:
    for node in wf["nodes"]:
        values = node.get("widgets_values")
        if node["type"] == "MarkdownNote" and values and _WAN22_HEADING in values[0]:
            values[0] = values[0][: values[0].index(_WAN22_HEADING)] + text
            return
    raise ValueError("no Wan 2.2 note in the workflow")


def wan22_fp8(wf: Dict[str, Any], workflow_id: str, plan_text: str) -> Dict[str, Any]:
    """The Wan 2.2 template with ComfyUI's own fp8 files: half the bytes per streamed block (README, Quantized
    models), so twice the resident blocks in the same VRAM."""
    wf["id"] = workflow_id
    for node in wf["nodes"]:
        if node["type"] in DIT_LOADERS:
            values = node["widgets_values"]
            values[0] = values[0].replace("_fp16.", "_fp8_scaled.")
            for model in node["properties"].get("models", []):  # same Comfy-Org repackaged folder
                model["name"], model["url"] = (model[k].replace("_fp16.", "_fp8_scaled.") for k in ("name", "url"))
    _replace_model_note(wf, """### Wan 2.2 T2V A14B, fp8 (two experts)

ComfyUI's fp8 "scaled" files: each block is half its fp16 size, and the offload streams it at that size, so
auto keeps about twice as many blocks resident as with fp16.

""" + plan_text + """

Files: `wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors` and `wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors` in
models/diffusion_models, `umt5_xxl_fp8_e4m3fn_scaled.safetensors` in models/text_encoders,
`wan_2.1_vae.safetensors` in models/vae.
""")
    return wf


def wan22_gguf(wf: Dict[str, Any], workflow_id: str, plan_text: str) -> Dict[str, Any]:
    """The Wan 2.2 template with ComfyUI-GGUF's *Unet Loader (GGUF)* in place of each diffusion-model loader.

    The loaders carry no download URL: the frontend's missing-models dialog downloads only .safetensors files,
    so the note says where the .gguf files come from and which folder they go in."""
    wf["id"] = workflow_id
    for node in wf["nodes"]:
        if node["type"] not in DIT_LOADERS:
            continue
        expert = next(e for e in WAN22_GGUF_FILES if e in node["widgets_values"][0])
        node.update(type=GGUF_LOADER, widgets_values=[WAN22_GGUF_FILES[expert]], size=[340.0, 58.0],
                    title=f"Unet Loader (GGUF): {expert.replace('_', ' ')} expert",
                    properties={"Node name for S&R": GGUF_LOADER, **GGUF_PACK})
    _replace_model_note(wf, f"""### Wan 2.2 T2V A14B, GGUF Q4_K_M (two experts)

**Needs city96's ComfyUI-GGUF** custom nodes (the *Unet Loader (GGUF)* nodes): install "ComfyUI-GGUF" from
ComfyUI Manager, or `git clone https://github.com/city96/ComfyUI-GGUF` into ComfyUI/custom_nodes and
`pip install gguf` with ComfyUI's Python, then restart ComfyUI. Without it the two loaders show as missing nodes.

In Q4_K_M a block is about a third of its fp16 size, and the offload streams it at that size (ComfyUI-GGUF
dequantizes it on the GPU as it runs), so auto keeps about three times as many blocks resident as with fp16.
Other quantizations of the same repository (Q8_0, Q5_K_M, ...) work the same way: pick them in the loaders.

{plan_text}

Files: `{WAN22_GGUF_FILES["high_noise"]}` (folder HighNoise) and `{WAN22_GGUF_FILES["low_noise"]}`
(folder LowNoise) from {WAN22_GGUF_REPO} in **models/unet** or models/diffusion_models (ComfyUI-GGUF lists
the .gguf files of both), `umt5_xxl_fp8_e4m3fn_scaled.safetensors` in models/text_encoders,
`wan_2.1_vae.safetensors` in models/vae.
""")
    return wf
