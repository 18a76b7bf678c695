"""The timing model's table: predicted step time vs the bound for every template, resident count, policy and
prefetch depth on four reference GPUs (offload/timing/ predicts; the .md it writes says how and on what).

    .venv/bin/python -P bench/timing_table.py              # -> bench/results/timing_model.{csv,md,png}
    .venv/bin/python -P bench/timing_table.py --out /tmp/x --templates flux1_dev --gpus "RTX 4090 24GB"
    .venv/bin/python -P bench/timing_table.py --replay     # also choose by replaying the real manager: agreement

Per template (devtools/template_memory.py's list, block bytes from devtools/template_plans.json), FLOPs per block
are COUNTED, not derived: ComfyUI's own class at the released dimensions, one block per block list
(dit_families.py), runs one forward on the ``meta`` device at the template's latent and batch under
``FlopCounterMode`` (matmuls, convolutions), attention replaced by meta_forward.py's flash-like stand-in plus
the flash kernel's own count (``4 x batch x heads x query tokens x key tokens x head dim``). Element-wise work is
the part of ``DIT_EFFICIENCY`` that is not matmul. The shape-only rule of thumb (:func:`shape_estimate`) counts
the modulation linears at every token and the text stream's linears at the image's tokens, so it overestimates
double-stream blocks up to 2.6x: whoever feeds the engine FLOPs should count. fp8 and GGUF weights are cast to
bf16 every forward (``stored + 2 x weights`` bytes of device-memory traffic); LoRA rows apply ComfyUI's float32
LoRA math on a stream of its own (about 28 bytes of traffic per weight) at every streamed copy.

Rows: every resident count 0..N, every setting of ``offload.timing.choice.SETTINGS`` (leading and strided at prefetch 1-4,
leading at 6, 8, 12, 16; LoRA rows prefetch 1). ``fits``: the plan
(residents + slots + non-block weights + activations + ComfyUI's reserve + 0.5 GiB context) fits the card;
``auto``: the count the planner picks there. ``--replay``: auto's choice made again by replaying the real
manager (bench/timing_replay.py), the agreement and the host seconds of each in the .md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from ..devtools import dit_presets  # noqa: E402
from .dit_families import FAMILIES  # noqa: E402
from .meta_forward import flash_like_attention, meta_forward  # noqa: E402
from .measure import RESULTS  # noqa: E402
from ..devtools import comfy_env, template_memory  # noqa: E402
from ..offload import choose_resident_blocks, footprint, planner  # noqa: E402
from ..offload.timing import costs as tm  # noqa: E402
from ..offload.timing.choice import CLOSE_STEP, SETTINGS, choose_plan  # noqa: E402
from ..offload.timing.step import predict  # noqa: E402
from . import timing_replay  # noqa: E402

FIELDS = ("GPU", "template", "resident_count", "policy", "chosen", "prefetch", "predicted_step_ms", "bound_ms", "ratio",
          "copy_idle_ms", "compute_stall_ms", "compute_ms", "copy_ms", "host_ms", "lora", "fits", "auto",
          "device_gib")
BEFORE = ("leading", 1)  # the defaults before residency_policy auto


def is_default(row) -> bool:
    """A row of the node's defaults: residency_policy auto, the setting the timing model chooses at that count."""
    return row["policy"] == "auto"


def is_before(row) -> bool:
    return (row["policy"], row["prefetch"]) == BEFORE
WITHIN = 1.05
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


def auto_resident(tc: TemplateCosts, gpu, plans) -> int:
    """The count the planner picks on this card, fed as devtools/template_memory.py feeds it."""
    free = gpu.vram_bytes - plans["context_and_desktop_bytes"] - tc.non_block_bytes
    plan = planner.plan_residency(list(tc.costs.block_bytes), max(free, 0), reserve_bytes=plans["comfy_reserve_bytes"],
                                  activation_bytes=tc.activation_bytes, prefetch_size=tc.prefetch)
    return plan.resident_count if plan.fits else -1


def rows_for(tc: TemplateCosts, gpu, plans, check=None) -> List[dict]:
    n = tc.costs.num_blocks
    auto = auto_resident(tc, gpu, plans)
    fixed = plans["context_and_desktop_bytes"] + plans["comfy_reserve_bytes"] + tc.non_block_bytes + tc.activation_bytes
    rows = []
    for r in range(n + 1):
        variants = [(s, False) for s in SETTINGS] + [((p, 1), True) for p in ("leading", "strided")]
        # residency_policy auto, as the node runs it: the fastest predicted setting among those that fit the card.
        fitting = [(policy, prefetch, r) for policy, prefetch in SETTINGS
                   if footprint(tc.costs.block_bytes, choose_resident_blocks(n, r, policy), prefetch).total
                   + fixed <= gpu.vram_bytes]
        candidates = fitting or [(policy, prefetch, r) for policy, prefetch in SETTINGS]
        choice = choose_plan(tc.costs, gpu, candidates)
        if check is not None:
            check.compare(tc, gpu, r, candidates, choice)
        variants.append((("auto", choice.prefetch), False))
        for (policy, prefetch), lora in variants:
            costs = tc.lora_costs if lora else tc.costs
            chosen = choice.policy if policy == "auto" else policy
            p = choice.prediction if policy == "auto" else predict(costs, gpu, r, policy, prefetch)
            device = footprint(costs.block_bytes, choose_resident_blocks(n, r, chosen), prefetch).total + fixed
            rows.append(dict(GPU=gpu.name, template=tc.key, resident_count=r, policy=policy, chosen=chosen,
                             prefetch=prefetch,
                             predicted_step_ms=round(p.step_s * 1e3, 2), bound_ms=round(p.bound_s * 1e3, 2),
                             ratio=round(p.ratio, 4), copy_idle_ms=round(p.copy_idle_s * 1e3, 2),
                             compute_stall_ms=round(p.compute_stall_s * 1e3, 2), compute_ms=round(p.compute_s * 1e3, 2),
                             copy_ms=round(p.copy_s * 1e3, 2), host_ms=round(p.host_s * 1e3, 2), lora=int(lora),
                             fits=int(device <= gpu.vram_bytes), auto=int(r == auto),
                             device_gib=round(device / 2 ** 30, 2)))
    return rows


class ReplayCheck:
    """Auto's choice at every (GPU, template, r) made twice, by the product's model and by replaying the real manager
    (bench/timing_replay.py), and the host seconds of each planning: the replay on the first card as in a fresh
    process (no recording kept), on the others with the first card's recordings (their timing alone)."""

    def __init__(self, cold_gpu: str):
        self.cold_gpu = cold_gpu
        self.plans = 0
        self.differing: List[str] = []
        self.seconds: Dict[str, List[float]] = {"model": [], "replay kept": [], "replay cold": []}

    def compare(self, tc: TemplateCosts, gpu, r: int, candidates, choice) -> None:
        cold = gpu.name == self.cold_gpu
        started = time.perf_counter()
        choose_plan(tc.costs, gpu, candidates)
        self.seconds["model"].append(time.perf_counter() - started)
        if cold:
            timing_replay.clear_recordings()
        started = time.perf_counter()
        replayed = choose_plan(tc.costs, gpu, candidates, model=timing_replay.predict)
        self.seconds["replay cold" if cold else "replay kept"].append(time.perf_counter() - started)
        self.plans += 1
        if (replayed.policy, replayed.prefetch) != (choice.policy, choice.prefetch):
            self.differing.append(f"| {gpu.name} | {tc.key} | {r} | {choice.policy} {choice.prefetch} "
                                  f"({choice.prediction.ratio:.3f}) | {replayed.policy} {replayed.prefetch} "
                                  f"({replayed.prediction.ratio:.3f}) |")

    def lines(self) -> List[str]:
        def per_planning(key):
            times = sorted(self.seconds[key])
            return (f"{sum(times) / len(times):.4f} s mean, {times[len(times) // 2]:.4f} median, {times[-1]:.4f} max "
                    f"over {len(times)}") if times else "not measured"
        out = ["", "## The replay check", "",
               f"Auto's setting chosen by the model and by replaying the real manager (`bench/timing_replay.py`): "
               f"{self.plans - len(self.differing)} of {self.plans} plans agree.", "",
               "Host seconds per planning (`choose_plan` over the candidates, this machine): "
               f"the model {per_planning('model')}; the replay in a fresh process (recording every candidate's "
               f"schedule) {per_planning('replay cold')}; the replay with the schedules recorded before "
               f"{per_planning('replay kept')}."]
        if self.differing:
            out += ["", "| GPU | template | r | model (ratio) | replay (ratio) |", "| --- | --- | --- | --- | --- |",
                    *self.differing]
        return out


# ----------------------------------------------------------------------------------------------- reporting

def _key(row) -> tuple:
    return row["GPU"], row["template"], int(row["resident_count"])


def fixes(rows: List[dict]) -> Dict[tuple, dict]:
    """Per (GPU, template, r): the setting within WITHIN that holds the fewest device bytes (ties: the order of
    ``SETTINGS``)."""
    order = {s: i for i, s in enumerate(SETTINGS)}
    best: Dict[tuple, dict] = {}
    for row in rows:
        if row["lora"] or row["ratio"] > WITHIN or is_default(row):
            continue
        k = _key(row)
        rank = (row["device_gib"], order[(row["policy"], row["prefetch"])])
        if k not in best or rank < best[k]["_rank"]:
            best[k] = dict(row, _rank=rank)
    return best


SENSITIVITY = (("DiT efficiency 0.5", 0.5, 1.0), ("DiT efficiency 1.0 (the matmul rate)", 1.0, 1.0),
               ("H2D -20 %", None, 0.8), ("H2D -20 %, DiT efficiency 1.0", 1.0, 0.8))


def sensitivity(templates: List[TemplateCosts], gpus, plans) -> List[str]:
    """How the defaults' misses move with the two figures the model leans on most (leading, prefetch 1 only)."""
    lines = ["| variant | plans over 1.05x at the defaults (fitting the card), by template and GPU | worst |",
             "| --- | --- | --- |"]
    for label, efficiency, h2d in SENSITIVITY:
        over, worst = [], (0.0, "")
        for g in gpus:
            flops = g.matmul_flops_per_s * (efficiency / tm.DIT_EFFICIENCY if efficiency else 1.0)
            variant = dataclasses.replace(g, matmul_flops_per_s=flops, h2d_bytes_per_s=g.h2d_bytes_per_s * h2d)
            for tc in templates:
                n = tc.costs.num_blocks
                fixed = (plans["context_and_desktop_bytes"] + plans["comfy_reserve_bytes"] + tc.non_block_bytes
                         + tc.activation_bytes)
                for r in range(n + 1):
                    device = footprint(tc.costs.block_bytes, choose_resident_blocks(n, r, "leading"), 1).total
                    if device + fixed > g.vram_bytes:
                        continue
                    ratio = predict(tc.costs, variant, r, *BEFORE).ratio
                    if ratio > WITHIN:
                        over.append((tc.key, g.name.rsplit(" ", 1)[0]))
                    worst = max(worst, (ratio, f"{tc.key}, {g.name}, r {r}"))
        by = ", ".join(f"{k} {gpu}: {n}" for (k, gpu), n in sorted(Counter(over).items()))
        lines.append(f"| {label} | {len(over)}{' (' + by + ')' if by else ''} | {worst[0]:.3f} ({worst[1]}) |")
    return lines


def headlines(rows: List[dict], templates: List[TemplateCosts], best: Dict[tuple, dict]) -> List[str]:
    """The findings, in numbers read from the rows."""
    plain = [r for r in rows if not r["lora"]]
    now = [r for r in plain if is_default(r)]
    now_over = [r for r in now if r["ratio"] > WITHIN]
    worst_now = max(now, key=lambda r: r["ratio"])
    out = [f"- At the defaults (residency_policy auto: the setting the model predicts fastest among those that fit), "
           f"{len(now_over)} of {len(now)} plans (template x GPU x resident count) predict more than {WITHIN}x the "
           f"bound; the worst is {worst_now['ratio']:.3f}x ({worst_now['template']}, {worst_now['GPU']}, r "
           f"{worst_now['resident_count']}, {worst_now['chosen']} {worst_now['prefetch']})."]
    shallow = shallow_auto(plain)
    shallow_over = [r for r in shallow if r["ratio"] > WITHIN]
    if shallow_over:
        worst = max(shallow_over, key=lambda r: r["ratio"])
        pairs = sorted({(r["template"], r["GPU"]) for r in shallow_over})
        where = "; ".join(f"{t} on the {g}: r " + _ranges([r["resident_count"] for r in shallow_over
                                                            if (r["template"], r["GPU"]) == (t, g)]) for t, g in pairs)
        out.append(f"- With auto choosing among prefetch 1-4 only (before the deeper leading rings), "
                   f"{len(shallow_over)} were over {WITHIN}x ({where}; worst {worst['ratio']:.3f}x at r {worst['resident_count']}, "
                   f"{worst['policy']} {worst['prefetch']}): leading keeps the biggest blocks, which come first, and a "
                   "ring of at most 5 slots leaves the copy engine idle while they compute; strided reaches its own "
                   "bound but keeps smaller blocks and streams more bytes, so its step is slower still. A leading "
                   "ring deep enough to take the copies of the residents' stretch reaches the bound.")
    default = [r for r in plain if is_before(r)]
    over = [r for r in default if r["ratio"] > WITHIN]
    out += [f"- Before it (leading, prefetch 1), {len(over)} of {len(default)} plans predicted more than {WITHIN}x "
            f"the bound, {sum(r['fits'] for r in over)} of them plans that fit their card:"]
    for (template, gpu), n in sorted(Counter((r["template"], r["GPU"]) for r in over).items()):
        mine = [r for r in over if (r["template"], r["GPU"]) == (template, gpu)]
        worst = max(mine, key=lambda r: r["ratio"])
        out.append(f"  - {template} on the {gpu}: r {_ranges([r['resident_count'] for r in mine])}, worst "
                   f"{worst['ratio']:.3f}x at r {worst['resident_count']}.")
    calm = [tc.key for tc in templates if not any(r["template"] == tc.key for r in over)]
    if calm:
        worst = max((r for r in default if r["template"] in calm), key=lambda r: r["ratio"])
        out.append(f"- {', '.join(calm)}: within {worst['ratio']:.3f}x everywhere (compute-bound on every card at "
                   "their template's shape).")
    auto = [r for r in default if r["auto"]]
    if auto:
        worst = max(auto, key=lambda r: r["ratio"])
        out.append(f"- At the resident count auto picks on each card (leading, prefetch 1), the worst ratio is "
                   f"{worst['ratio']:.3f}x ({worst['template']}, {worst['GPU']}, r {worst['resident_count']}): the "
                   "misses are at smaller resident counts (less free memory, other models loaded, a count set by hand).")
    fixed = [best[_key(r)] for r in over if _key(r) in best]
    if over:
        extra = max(b["device_gib"] - r["device_gib"] for r in over for b in [best.get(_key(r))] if b)
        out.append(f"- {len(fixed)} of the {len(over)} have a setting of the grid within "
                   f"{WITHIN}x; the one holding the fewest device bytes costs at most {extra:+.2f} GiB over the "
                   "default plan. No single setting serves every plan:")
        counts = []
        for setting in SETTINGS:
            n = sum(1 for r in plain if (r["policy"], r["prefetch"]) == setting and r["ratio"] > WITHIN)
            counts.append(f"{setting[0]} {setting[1]}: {n}")
        out.append("  - plans over " + f"{WITHIN}x per fixed setting: " + ", ".join(counts) + ".")
    gains = [g for per in same_budget(rows).values() for g in per]
    if gains:
        gain, r, b, d = max(gains, key=lambda g: g[0])
        out.append(f"- At the same device memory, the fastest plan of the grid beats the default by up to {gain:.0%} "
                   f"({d['template']}, {d['GPU']}: r {r} leading 1 {d['ratio']:.3f}x -> r {b['resident_count']} "
                   f"{b['policy']} {b['prefetch']} {b['ratio']:.3f}x).")
    lora = [r for r in rows if r["lora"] and r["fits"]]
    if lora:
        worst = max(lora, key=lambda r: r["ratio"])
        out.append(f"- With a LoRA (on its own stream): up to {worst['ratio']:.3f}x the bound ({worst['template']}, "
                   f"{worst['GPU']}, r {worst['resident_count']}, {worst['policy']} 1); the next copy no longer waits "
                   "for it, only the block's own compute does.")
    return out


def shallow_auto(plain: List[dict]) -> List[dict]:
    """Per (GPU, template, r): the row auto would have run choosing among prefetch 1-4 only (choose_plan's rule: the
    fastest step among the settings that fit, or among all where none fits; of those within CLOSE_STEP of it, the
    fewest device bytes)."""
    groups: Dict[tuple, List[dict]] = {}
    for row in plain:
        if not is_default(row) and row["prefetch"] <= 4:
            groups.setdefault(_key(row), []).append(row)
    out = []
    for mine in groups.values():
        pool = [r for r in mine if r["fits"]] or mine
        fastest = min(r["predicted_step_ms"] for r in pool)
        close = [r for r in pool if r["predicted_step_ms"] <= fastest * CLOSE_STEP]
        out.append(min(close, key=lambda r: r["device_gib"]))
    return out


def same_budget(rows: List[dict]) -> Dict[tuple, List[tuple]]:
    """Per (template, GPU): for each default plan, (gain, r, the fastest row holding no more device memory, the
    default row)."""
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        if not row["lora"]:
            groups.setdefault((row["template"], row["GPU"]), []).append(row)
    out = {}
    for key, mine in groups.items():
        gains = []
        for d in (r for r in mine if is_before(r)):
            best = min((r for r in mine if r["device_gib"] <= d["device_gib"]),
                       key=lambda r: (r["predicted_step_ms"], r["device_gib"]))
            gains.append((1 - best["predicted_step_ms"] / d["predicted_step_ms"], d["resident_count"], best, d))
        out[key] = gains
    return out


def _ranges(values: List[int]) -> str:
    out, start, prev = [], None, None
    for v in sorted(values):
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def write_markdown(rows: List[dict], templates: List[TemplateCosts], gpus, path: Path, check=None) -> None:
    best = fixes(rows)
    default = [r for r in rows if is_before(r) and not r["lora"]]
    by = {(_key(r), r["policy"], r["prefetch"], r["lora"]): r for r in rows}
    over = [r for r in default if r["ratio"] > WITHIN]
    lines = [
        "# Timing model: predicted step time vs the bound",
        "",
        "Made by `.venv/bin/python -P bench/timing_table.py --replay` (3 minutes on the project's shared 2-core "
        "machine); every row is in "
        "`timing_model.csv`, the curves in `timing_model.png`. **A model, not a measurement**: the first GPU run "
        "checks it.",
        "",
        "## Headlines",
        "",
        *headlines(rows, templates, best),
        "",
        "## How",
        "",
        "`offload/timing/step.py` computes the manager's schedule from the plan: the compute stream runs the blocks "
        "in order, each streamed block waits for its bytes, the copy of the streamed block `prefetch` places on is "
        "queued before it into the slot the previous streamed block left (wrapping into the next step), one copy "
        "engine, the LoRA on a stream of its own. The step is the steady state (between the ends of forwards 2 and "
        "3). `bench/timing_replay.py` checks that schedule against the real `LayerwiseOffloadManager` (below). The "
        "bound is `max(compute, streamed bytes / H2D)`.",
        "",
        "Assumptions:",
        "",
        "- One copy engine (the copy stream), a constant pinned H2D rate; every streamed block page-locked.",
        f"- Block compute = counted FLOPs / (achievable dense bf16 matmul rate x {tm.DIT_EFFICIENCY}) + weight casts "
        "(fp8, GGUF) at HBM bandwidth. Element-wise kernels are inside the 0.7; attention is counted as flash "
        "attention computes it. One forward per step (cond + uncond batched where CFG > 1).",
        f"- Host: {tm.LAUNCH_S_PER_BLOCK * 1e3:.2f} ms to launch each block, "
        f"{tm.HOST_S_PER_STREAMED_BLOCK * 1e3:.3f} ms of bookkeeping per streamed block in bf16 "
        f"({tm.HOST_S_PER_STREAMED_BLOCK_FP8 * 1e3:.3f} ms plain fp8: Qwen-Image; "
        f"{tm.HOST_S_PER_STREAMED_BLOCK_QUANTIZED * 1e3:.3f} ms fp8 scaled `QuantizedTensor`: Wan 2.2 fp8; "
        f"{tm.HOST_S_PER_STREAMED_BLOCK_GGUF * 1e3:.3f} ms GGUF; the worst medians of the `after` rows of "
        "`host_time.csv`, measured on the project's 2-core CPU), issued ahead of the GPU without limit; the sampler "
        "reads each step's result back (a host sync at the end of every step).",
        f"- LoRA rows: every linear weight patched on the device with ComfyUI's float32 math, "
        f"{LORA_BYTES_PER_WEIGHT} bytes of device-memory traffic per weight, on a stream of its own after the copy (as "
        "offload/device/backend.py queues it); it takes no SM time from the compute stream (optimistic).",
        "- Not modelled: arming (the residents' first copies), PCIe contention with other traffic, clocks, the "
        "launch queue's depth, kernels' warm-up.",
        "",
        "## GPUs",
        "",
        "| GPU | pinned H2D GB/s | achievable bf16 matmul TFLOP/s | x DiT efficiency | HBM GB/s | source |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for g in gpus:
        lines.append(f"| {g.name} | {g.h2d_bytes_per_s / GB:.0f} | {g.matmul_flops_per_s / 1e12:.0f} | "
                     f"{g.dit_flops_per_s / 1e12:.0f} | {g.hbm_bytes_per_s / GB:.0f} | {g.source} |")
    lines += ["", "## Templates", "",
              "FLOPs per block counted on ComfyUI's model classes (meta device, `FlopCounterMode` + flash attention "
              "count); `estimate` is the rule of thumb 2 x linear weights x tokens + 4 x tokens^2 x width ("
              "text tokens included for joint attention).", "",
              "| template | blocks | tokens x batch | block GB | counted TFLOP/block | estimate | outside TFLOP | "
              + " | ".join(f"{g.name}: compute / copy ms per block" for g in gpus) + " |",
              "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in gpus) + " |"]
    for tc in templates:
        sizes = sorted(set(tc.costs.block_bytes), reverse=True)
        per_gpu = []
        for g in gpus:
            secs = tc.costs.block_seconds(g)
            parts = []
            for k, n in enumerate(tc.lists):
                i = sum(tc.lists[:k])
                parts.append(f"{secs[i] * 1e3:.1f} / {tc.costs.block_bytes[i] / g.h2d_bytes_per_s * 1e3:.1f}")
            per_gpu.append("; ".join(parts))
        lines.append(
            f"| {tc.name} | {' + '.join(map(str, tc.lists))} | {tc.tokens} x {tc.batch} | "
            f"{' / '.join(f'{s / GB:.2f}' for s in sizes)} | {' / '.join(f'{f / 1e12:.2f}' for f in tc.list_flops)} | "
            f"{' / '.join(f'{f / 1e12:.2f}' for f in tc.list_estimate)} | {tc.costs.outside_flops / 1e12:.2f} | "
            + " | ".join(per_gpu) + " |")
    lines += ["", "## Before residency_policy auto: leading, prefetch 1", "",
              f"Per template and GPU: the worst ratio over every resident count, the counts above {WITHIN}x, those "
              "of them whose plan fits the card, the ratio at the count auto picks on that card, and the settings "
              f"that bring those counts to <= {WITHIN}x in the model (for each count, the one holding the fewest "
              "device bytes; the next table names it count by count).", "",
              "| template | GPU | worst ratio (r) | r over 1.05x | of which fit the card | auto r: ratio | fixed by |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for tc in templates:
        for g in gpus:
            mine = [r for r in default if r["template"] == tc.key and r["GPU"] == g.name]
            worst = max(mine, key=lambda r: r["ratio"])
            bad = [r["resident_count"] for r in mine if r["ratio"] > WITHIN]
            bad_fit = [r["resident_count"] for r in mine if r["ratio"] > WITHIN and r["fits"]]
            auto = [r for r in mine if r["auto"]]
            auto_text = f"{auto[0]['resident_count']}: {auto[0]['ratio']:.3f}" if auto else "none fits"
            settings = sorted({(best[_key(r)]["policy"], best[_key(r)]["prefetch"]) for r in mine
                               if r["ratio"] > WITHIN and _key(r) in best})
            unfixed = [r["resident_count"] for r in mine if r["ratio"] > WITHIN and _key(r) not in best]
            fixed = ", ".join(f"{p} {q}" for p, q in settings) or "-"
            if unfixed:
                fixed += f"; none for r {_ranges(unfixed)}"
            lines.append(f"| {tc.name} | {g.name} | {worst['ratio']:.3f} ({worst['resident_count']}) | "
                         f"{_ranges(bad) or '-'} | {_ranges(bad_fit) or '-'} | {auto_text} | {fixed} |")
    lines += ["", f"## Every row over {WITHIN}x at leading, prefetch 1, and its fix", "",
              "`fix`: the setting within 1.05x that holds the fewest device bytes (`+GiB`: its extra device memory "
              "over "
              "the default plan; negative when it holds less); `strided 1` is `strided` at prefetch 1.", "",
              "| GPU | template | r | fits | step ms | bound ms | ratio | copy idle ms | compute stall ms | fix | "
              "fix ratio | +GiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in over:
        b = best.get(_key(r))
        fix = (f"{b['policy']} {b['prefetch']} | {b['ratio']:.3f} | {b['device_gib'] - r['device_gib']:+.2f}"
               if b else "none in the grid | | ")
        lines.append(f"| {r['GPU']} | {r['template']} | {r['resident_count']} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['predicted_step_ms']:.1f} | {r['bound_ms']:.1f} | {r['ratio']:.3f} | "
                     f"{r['copy_idle_ms']:.1f} | "
                     f"{r['compute_stall_ms']:.1f} | {fix} |")
    if not over:
        lines.append("| (none) | | | | | | | | | | | |")
    lines += ["", "## Sensitivity", "",
              "The two figures the model leans on most, varied for the default setting (rows whose plan fits the "
              "card; the main tables use DiT efficiency 0.7 and the H2D rates above):", "",
              *sensitivity(templates, gpus, template_memory.load_plans())]
    lines += ["", "## One setting for every plan?", "",
              f"Rows (template x GPU x r, all fitting their card) above {WITHIN}x for each fixed setting of the "
              "grid:", "",
              "| setting | rows over | worst (GPU, template, r) |", "| --- | --- | --- |"]
    for policy, prefetch in SETTINGS:
        mine = [r for r in rows if not r["lora"] and (r["policy"], r["prefetch"]) == (policy, prefetch)]
        bad = [r for r in mine if r["ratio"] > WITHIN]
        worst = max(mine, key=lambda r: r["ratio"])
        where = ", ".join(f"{g} {n}" for (g, n), _ in
                          sorted(Counter((r["GPU"].split()[1], r["template"]) for r in bad).items()))
        lines.append(f"| {policy} {prefetch} | {len(bad)}{' (' + where + ')' if where else ''} | "
                     f"{worst['ratio']:.3f} ({worst['GPU']}, {worst['template']}, {worst['resident_count']}) |")
    lines += ["", "## The same device memory, the best plan", "",
              "For each default plan (leading 1, r residents), the fastest plan of the grid (any r, policy, prefetch) "
              "that holds no more device memory: what a choice of plan by the model would gain at that budget. Listed: "
              "template x GPU pairs where it gains more than 2 % somewhere.", "",
              "| template | GPU | budgets (default r) where the best plan gains > 2 % | largest gain: default r -> best plan "
              "(ratios) |", "| --- | --- | --- | --- |"]
    for (key, gpu_name), gains in same_budget(rows).items():
        better = [g for g in gains if g[0] > 0.02]
        if not better:
            continue
        gain, r, best_row, default_row = max(better, key=lambda g: g[0])
        lines.append(f"| {key} | {gpu_name} | {_ranges([g[1] for g in better])} | {gain:.1%}: r {r} -> r "
                     f"{best_row['resident_count']} {best_row['policy']} {best_row['prefetch']} "
                     f"({default_row['ratio']:.3f} -> {best_row['ratio']:.3f}) |")
    lines += ["", "## LoRA on the device (prefetch 1)", "",
              "The LoRA math runs on a stream of its own between a block's copy and its done event: the block's "
              "compute waits for it, the next block's copy does not (on the copy stream, as before this change, "
              "Flux at r = 0 on the RTX 4090 was 1.348x with a LoRA). Ratios against the same bound (which has no LoRA term): at r = 0, and the worst "
              "over every r whose plan fits the card; `+ms` is what the LoRA adds to the step at r = 0 (leading).", "",
              "| template | GPU | LoRA ms per block (largest) | r=0 leading: no LoRA / LoRA | +ms | "
              "worst leading + LoRA (r) | worst strided + LoRA (r) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for tc in templates:
        for g in gpus:
            k = (g.name, tc.key, 0)
            plain, lead = by[(k, "leading", 1, 0)], by[(k, "leading", 1, 1)]
            fit = [r for r in rows if r["template"] == tc.key and r["GPU"] == g.name and r["lora"] and r["fits"]]
            worst = {p: max((r for r in fit if r["policy"] == p), key=lambda r: r["ratio"], default=None)
                     for p in ("leading", "strided")}
            text = {p: (f"{w['ratio']:.3f} ({w['resident_count']})" if w else "-") for p, w in worst.items()}
            lora_ms = max(tc.lora_costs.lora_bytes) / g.hbm_bytes_per_s * 1e3
            lines.append(f"| {tc.name} | {g.name} | {lora_ms:.1f} | {plain['ratio']:.3f} / {lead['ratio']:.3f} | "
                         f"{lead['predicted_step_ms'] - plain['predicted_step_ms']:+.0f} | "
                         f"{text['leading']} | {text['strided']} |")
    if check is not None:
        lines += check.lines()
    path.write_text("\n".join(lines) + "\n")


def plot(rows: List[dict], templates: List[TemplateCosts], gpus, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(templates), len(gpus), figsize=(4.2 * len(gpus), 2.6 * len(templates)),
                             sharey=True, squeeze=False)
    series = [(("auto", None), "k", "auto (the default)"), (("leading", 1), "C3", "leading, prefetch 1 (before)"),
              (("leading", 2), "C1", "leading, prefetch 2"),
              (("strided", 1), "C0", "strided, prefetch 1"), (("strided", 2), "C2", "strided, prefetch 2")]
    for i, tc in enumerate(templates):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            mine = [r for r in rows if r["template"] == tc.key and r["GPU"] == g.name and not r["lora"]]
            for (setting, color, label) in series:
                pts = sorted((r["resident_count"], r["ratio"]) for r in mine if r["policy"] == setting[0]
                             and (setting[1] is None or r["prefetch"] == setting[1]))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.2, label=label)
            lora = sorted((r["resident_count"], r["ratio"]) for r in rows if r["template"] == tc.key
                          and r["GPU"] == g.name and r["lora"] and r["policy"] == "leading")
            ax.plot([p[0] for p in lora], [p[1] for p in lora], color="C4", lw=0.8, ls=":",
                    label="leading 1 + LoRA")
            misfit = [r["resident_count"] for r in mine if is_before(r) and not r["fits"]]
            if misfit:
                ax.axvspan(min(misfit) - 0.5, max(misfit) + 0.5, color="0.9", zorder=0)
            auto = [r["resident_count"] for r in mine if r["auto"]]
            if auto:
                ax.axvline(auto[0], color="k", lw=0.6, ls="--")
            ax.axhline(WITHIN, color="0.5", lw=0.6, ls=":")
            ax.set_ylim(0.95, 1.7)
            if i == 0:
                ax.set_title(g.name, fontsize=9)
            if j == 0:
                ax.set_ylabel(tc.key + "\nstep / bound", fontsize=8)
            if i == len(templates) - 1:
                ax.set_xlabel("resident blocks", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle("Timing model: predicted step / max(compute, streamed bytes / H2D); grey: plan does not fit the "
                 "card; dashed: auto's pick", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=80)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS), help="folder for timing_model.csv / .md / .png")
    parser.add_argument("--templates", default="", help="comma-separated template keys (default: all)")
    parser.add_argument("--gpus", default="", help="comma-separated GPU names from offload.timing.costs.GPUS")
    parser.add_argument("--replay", action="store_true",
                        help="also choose auto's setting by replaying the real manager, and report the agreement")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    templates = template_costs([k for k in args.templates.split(",") if k] or None)
    names = [g for g in args.gpus.split(",") if g] or list(tm.GPUS)
    gpus = [tm.GPUS[g] for g in names]
    plans = template_memory.load_plans()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: List[dict] = []
    check = ReplayCheck(gpus[0].name) if args.replay else None
    for tc in templates:
        for g in gpus:
            rows += rows_for(tc, g, plans, check)
        print(f"[timing_table] {tc.key}: {len(rows)} rows, {time.perf_counter() - started:.0f} s", flush=True)
    with open(out / "timing_model.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, templates, gpus, out / "timing_model.md", check)
    plot(rows, templates, gpus, out / "timing_model.png")
    print(f"[timing_table] {len(rows)} rows in {time.perf_counter() - started:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
