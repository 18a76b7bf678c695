"""Tiny quantized checkpoints in the formats ComfyUI's loaders turn into tensor-subclass weights, with the weights
of :func:`.tiny_dits.build_wan21` (same seed): ComfyUI's "mixed precision" safetensors (fp8 e4m3 block linears, a
``weight_scale`` per layer, the layer list in the ``_quantization_metadata`` header), which
``comfy.sd.load_diffusion_model`` loads as ``QuantizedTensor`` weights, and a GGUF file for ComfyUI-GGUF's
``UnetLoaderGGUF``, block matrices quantized by the ``gguf`` package, everything else float32 (as ComfyUI-GGUF's
own convert tool keeps 1-D tensors). :func:`save_fp8_mixed` and :func:`save_gguf` write any Wan state dict the
same way (bench/bench_formats.py: the benchmark presets' blocks).
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

from .tiny_dits import save_safetensors, tiny_wan21_state_dict

GGUF_TYPES = ("F16", "Q8_0", "Q5_0", "Q4_0")


def _is_block_matrix(key: str, tensor: torch.Tensor) -> bool:
    return key.startswith("blocks.") and key.endswith(".weight") and tensor.ndim == 2


def save_tiny_wan21_fp8_mixed(path: "os.PathLike | str", seed: int = 0) -> str:
    return save_fp8_mixed(tiny_wan21_state_dict(seed), path, "tiny wan2.1 t2v test model, fp8 mixed precision")


def save_fp8_mixed(sd: Dict[str, torch.Tensor], path: "os.PathLike | str", description: str) -> str:
    """A Wan state dict with every 2-D block weight and the text embedding's linears as fp8 e4m3 with a per-tensor
    ``weight_scale`` (the text embedding: a quantized weight outside the blocks, as in ComfyUI's own fp8 files),
    everything else as given; returns the path. ``sd`` is changed in place."""
    layers = {}
    quantized = [k for k, v in sd.items() if _is_block_matrix(k, v) or (k.startswith("text_embedding.") and v.ndim == 2)]
    for key in quantized:
        weight = sd[key].float()
        scale = (weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).to(torch.float32)
        sd[key] = (weight / scale).to(torch.float8_e4m3fn)
        layer = key[: -len(".weight")]
        sd[f"{layer}.weight_scale"] = scale
        layers[layer] = {"format": "float8_e4m3fn"}
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers}),
                "layerwise_offload": description}
    return save_safetensors(sd, path, metadata)


def save_tiny_wan21_gguf(path: "os.PathLike | str", qtype: str = "Q8_0", seed: int = 0) -> str:
    """The tiny Wan 2.1 as a GGUF file (arch ``wan``, what ComfyUI-GGUF's loader reads); block matrices in ``qtype``."""
    return save_gguf(tiny_wan21_state_dict(seed), path, qtype)


def save_gguf(sd: Dict[str, torch.Tensor], path: "os.PathLike | str", qtype: str = "Q8_0") -> str:
    """A Wan state dict as a GGUF file (arch ``wan``): block matrices in ``qtype``, everything else float32."""
    import gguf
    import numpy as np

    if qtype not in GGUF_TYPES:
        raise ValueError(f"qtype {qtype!r} is not one of {GGUF_TYPES}")
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    for key, tensor in sd.items():
        data = tensor.float().numpy()
        if _is_block_matrix(key, tensor):
            packed = gguf.quants.quantize(data, kind)
            writer.add_tensor(key, packed, raw_dtype=kind)
        else:
            writer.add_tensor(key, np.ascontiguousarray(data))
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
