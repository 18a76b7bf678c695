"""What the timing table feeds the model per template: its blocks' bytes (devtools/template_plans.json), the
FLOPs of each block counted on ComfyUI's own class on the meta device (flash attention's own count added), the
host time per streamed block of its weight format, and the same with a LoRA applied on the device."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..devtools import comfy_env, dit_presets, template_memory
from ..offload.timing import costs as tm
from .dit_families import FAMILIES
from .meta_forward import flash_like_attention, meta_forward

LORA_BYTES_PER_WEIGHT = tm.LORA_BYTES_PER_WEIGHT
# The weight format each template's file loads as, for the host time per streamed block (bench/results/host_time.csv):
# Wan 2.2's fp8 file is fp8 scaled (ComfyUI's QuantizedTensor), Qwen-Image's plain fp8 e4m3fn.
HOST_FORMAT = {"wan22_t2v_a14b_fp8": "quantized", "wan22_t2v_a14b_gguf": "gguf", "qwen_image": "fp8"}
FAMILY_OF_CONFIG = {"Flux": "flux1", "WAN21_T2V": "wan_14b", "QwenImage": "qwen_image",
                    "HunyuanVideo": "hunyuan_video"}
GB = 10 ** 9


@dataclass
class TemplateCosts:
    key: str
    name: str
    costs: object  # offload.timing.costs.ModelCosts
    lora_costs: object
    lists: Tuple[int, ...]  # blocks per block list, in call order
    list_flops: Tuple[float, ...]  # counted FLOPs of one block of each list
    list_estimate: Tuple[float, ...]  # shape_estimate of one block of each list
    list_weights: Tuple[int, ...]  # weights (parameters) of one block of each list
    tokens: int
    batch: int
    non_block_bytes: int
    activation_bytes: int
    prefetch: int  # the template's own prefetch_size


def counted_attention(calls: List[int], attention_flops: List[float]):
    """meta_forward.py's flash-like attention stand-in that adds the flash kernel's own FLOPs
    (``4 x batch x heads x query tokens x key tokens x head dim``) to ``attention_flops[0]``."""
    flash = flash_like_attention(calls)

    def attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
        if skip_reshape:  # (batch, heads, tokens, head dim)
            b, _, lq, dq = q.shape
            lk, dv = k.shape[2], v.shape[-1]
            attention_flops[0] += 2.0 * b * heads * lq * lk * (dq + dv)
        else:  # (batch, tokens, heads x head dim), or (batch, tokens, heads, head dim)
            b, lq = q.shape[:2]
            lk = k.shape[1]
            attention_flops[0] += 2.0 * b * lq * lk * (q[0, 0].numel() + v[0, 0].numel())
        return flash(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                     skip_output_reshape=skip_output_reshape, **kwargs)
    return attention


def count_flops(spec, latent: Sequence[int], batch: int):
    """(FLOPs of each block of the one-block-per-list model, whole forward's FLOPs, the blocks, attention calls)."""
    calls: List[int] = []
    attention_flops = [0.0]
    attention = counted_attention(calls, attention_flops)
    counter = FlopCounterMode(display=False)
    marks, per_block = {}, Counter()

    def total():
        return counter.get_total_flops() + attention_flops[0]

    def leave(i):
        per_block[i] += total() - marks.pop(i)

    blocks = meta_forward(spec.build(torch.bfloat16).eval(), spec, latent, batch, torch.bfloat16, attention, counter,
                          lambda i: marks.__setitem__(i, total()), leave)
    return [float(per_block[i]) for i in range(len(blocks))], total(), blocks, len(calls)


def shape_estimate(block, tokens: int, batch: int = 1) -> float:
    """The rule of thumb: ``2 x linear weights x tokens + 4 x tokens^2 x width`` per batch item, ``width`` the block's
    narrowest linear input (its hidden size); every linear taken to see every token."""
    linear = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.in_features * m.out_features for m in linear)
    width = min((m.in_features for m in linear), default=0)
    return float(batch) * (2.0 * weights * tokens + 4.0 * tokens * tokens * width)


def template_costs(keys=None) -> List[TemplateCosts]:
    """Imports ComfyUI (CPU) and counts every template's FLOPs on the meta device."""
    comfy_env.import_comfyui(cpu=True, import_nodes=False)

    plans = template_memory.load_plans()
    out = []
    for t in template_memory._templates(dit_presets):  # the templates' latents, batches and dtypes
        if keys and t.key not in keys:
            continue
        plan = template_memory.plan_for(plans, t.key)
        spec = FAMILIES[FAMILY_OF_CONFIG[t.comfy_config]]
        latent = tuple(t.latent[1:])
        per_block, total, blocks, _ = count_flops(spec, latent, t.cfg_batch)
        if len(blocks) == 2:
            lists = (t.unet_config["depth"], t.unet_config["depth_single_blocks"])
        else:
            lists = (t.unet_config["num_layers"],)
        block_bytes = tuple(plan["block_bytes"])
        if sum(lists) != len(block_bytes):
            raise AssertionError(f"{t.key}: {lists} blocks by config, {len(block_bytes)} in template_plans.json")
        kinds = [k for k, n in enumerate(lists) for _ in range(n)]
        tokens = math.prod(latent[1:]) // spec.patch_area
        with torch.device("meta"):
            text = spec.inputs(torch.empty(0), 1, torch.bfloat16)["context"].shape[1]
        joint = spec.name != "wan_14b"
        estimate = tuple(shape_estimate(b, tokens + (text if joint else 0), t.cfg_batch) for b in blocks)
        weights = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
        flops = tuple(per_block[k] for k in kinds)
        cast = None
        if t.stored_bytes != 2:
            cast = tuple(int(b + 2 * b / t.stored_bytes) for b in block_bytes)
        host = tm.HOST_S_PER_STREAMED_BLOCK_BY_FORMAT[HOST_FORMAT.get(t.key, "bf16")]
        costs = tm.ModelCosts(block_bytes, flops, outside_flops=total - sum(per_block), cast_bytes=cast,
                              host_s_per_streamed_block=host)
        lora = tm.ModelCosts(block_bytes, flops, outside_flops=total - sum(per_block), cast_bytes=cast,
                             lora_bytes=tuple(LORA_BYTES_PER_WEIGHT * weights[k] for k in kinds),
                             host_s_per_streamed_block=host)
        out.append(TemplateCosts(t.key, t.name, costs, lora, lists, tuple(per_block), estimate, weights,
                                 tokens, t.cfg_batch, plan["non_block_bytes"], plan["activation_bytes"], t.prefetch))
    return out
