"""G5 (issue 28): bytes each step moves to the device at equal VRAM for weights, this pack against ComfyUI 0.3.75's own
partial loading, for every template's model, computed on the meta device (nothing is allocated or copied).

ComfyUI's figure is its own code's: the template's DiT is built on the meta device by ComfyUI's model class, wrapped
in ComfyUI's ``ModelPatcher`` and loaded with ``load(lowvram_model_memory=B)`` as its partial loading does, with
``NUM_STREAMS`` = 2 (its default on NVIDIA: each cast module's weights are budgeted three times over, for the
async offload streams); what it leaves unloaded is cast to the device every forward. This pack's figure is the
plan the node arms under the same B: the non-block weights first (the node places them before any block), then
the plan that streams the fewest bytes in what is left, at the smallest ring (prefetch 1), among the whole-block
plans (the most resident blocks whose footprint, residents + 2 slots of the largest streamed block, fits; leading
or strided) and the streamed-tails plan (every block keeps its head resident and streams a tail, 2 slots of the
largest tail: ``plan_streamed_tails``); every streamed block (or tail) moves every forward. The whole-block
figure is kept beside it (``ours_whole_*``), the plan before streamed tails. One forward per step (cond and uncond batched). fp8 and GGUF templates scale every module by their bytes
per weight (uniform: the ratios are the bf16 ones).

``ours_weight_units_*`` is the engine's plan over weight units (``offload/units.py``: each module that owns weights
streams on its own, a ring of two pieces of at most one weight): what streaming weight by weight moves.
``--dynamic`` (on ComfyUI 0.33+) sets the same plans against 0.33's dynamic VRAM: its own dynamic load on the meta
device, and comfy-aimdo's page rule for what stays resident (:func:`dynamic_streamed_bytes`).

    COMFYUI_PATH=$PWD/.comfyui/ComfyUI .venv/bin/python -P bench/studies/g5_bytes.py --out bench/results
    COMFYUI_PATH=$PWD/.comfyui/ComfyUI-0.33.0 .venv-0.33.0/bin/python -P bench/studies/g5_bytes.py --dynamic --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys
from pathlib import Path

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

from ...devtools import comfy_env, dit_presets, template_memory  # noqa: E402

FRACTIONS = (0.3, 0.5, 0.7, 0.9)
FIELDS = ("template", "budget_fraction", "budget_bytes", "weights_bytes", "comfy_lowvram_bytes_per_step",
          "ours_bytes_per_step", "ours_resident", "ours_policy", "ours_over_comfy", "ours_largest_tail_bytes",
          "ours_whole_bytes_per_step", "ours_whole_over_comfy", "ours_weight_units_bytes_per_step",
          "ours_weight_units_over_comfy", "ours_weight_units_largest_tail_bytes")


def meta_patcher(template):
    import comfy.model_patcher
    import comfy.supported_models
    import torch

    cfg_cls = getattr(comfy.supported_models, template.comfy_config)
    unet_config = comfy_env.with_fields_this_comfyui_needs({**cfg_cls.unet_config, **template.unet_config})
    model_config = cfg_cls(unet_config)
    model_config.set_inference_dtype(torch.bfloat16, None)
    meta = torch.device("meta")
    with meta:
        model = model_config.get_model({}, "")
    return comfy.model_patcher.ModelPatcher(model, load_device=meta, offload_device=meta)


@contextlib.contextmanager
def weights_stay_on_meta():
    """Newer ComfyUI (0.33) fills a meta weight it loads with real zeros (on the CPU: 16 GB at once for Flux): only
    its accounting is wanted here, so the weights stay on the meta device while ComfyUI loads."""
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    zero_init = ops.__dict__.get("_zero_init_parameter")
    if zero_init is not None:
        ops._zero_init_parameter = staticmethod(lambda module, name: None)
    try:
        yield
    finally:
        if zero_init is not None:
            ops._zero_init_parameter = zero_init


def comfyui_streamed_bytes(template, budget_bf16: int) -> int:
    """Bytes ComfyUI's partial load under ``budget_bf16`` leaves to be cast every forward (bf16 figures)."""
    import comfy.model_management
    import torch

    patcher = meta_patcher(template)
    total = sum(module_mem for module_mem, *_ in patcher._load_list())
    streams = comfy.model_management.NUM_STREAMS
    comfy.model_management.NUM_STREAMS = 2
    try:
        with weights_stay_on_meta():
            patcher.load(torch.device("meta"), lowvram_model_memory=budget_bf16)
    finally:
        comfy.model_management.NUM_STREAMS = streams
    return total - patcher.model.model_loaded_weight_memory


VBAR_PAGE = 32 * 2**20  # comfy-aimdo's VBAR page (src/model-vbar.c: VBAR_PAGE_SIZE)
CAST_BUFFER_CHUNK = 16 * 2**20  # an aimdo VRAMBuffer grows in 16 MiB chunks on NVIDIA (comfy_aimdo/vram_buffer.py)
OFFLOAD_STREAMS = 2  # ComfyUI 0.33's NUM_STREAMS on NVIDIA


class RecordingVBAR:
    """comfy-aimdo's ``ModelVBAR`` as far as ComfyUI's load sees it, without a device: its address arithmetic (a bump
    allocator at 512-byte alignment, from offset 0) and a record of every allocation in the order ComfyUI made it."""

    def __init__(self, size, device):
        self.offset = 0
        self.allocations = []

    def prioritize(self, malloc_async_clamp=None):
        pass

    def alloc(self, num_bytes):
        self.offset = (self.offset + 511) & ~511
        allocation = (self, self.offset, num_bytes)
        self.offset += num_bytes
        self.allocations.append(allocation)
        return allocation

    def loaded_size(self):
        return 0


def dynamic_load_layout(template):
    """ComfyUI 0.33's own dynamic-VRAM load of the template's DiT on the meta device: (the bytes it places on the
    device outright, the VBAR allocations ``[(offset, bytes)]`` in its order), bf16 figures. The load is
    ``ModelPatcherDynamic.load`` as written (its ``_load_list(for_dynamic=True)`` order, largest weights first; the
    small ones force-loaded); only the VBAR is the recording stand-in above."""
    import comfy.model_patcher
    import comfy_aimdo.model_vbar
    import torch

    from ...devtools import dynamic_vram_standin

    if not dynamic_vram_standin.available():
        raise RuntimeError("[layerwise-offload] the dynamic-VRAM figure needs ComfyUI 0.33+ (ModelPatcherDynamic)")
    dynamic_vram_standin.init_library()
    classic = meta_patcher(template)
    meta = torch.device("meta")
    patcher = comfy.model_patcher.ModelPatcherDynamic(classic.model, load_device=meta, offload_device=meta)
    vbar_class = comfy_aimdo.model_vbar.ModelVBAR
    comfy_aimdo.model_vbar.ModelVBAR = RecordingVBAR
    try:
        with weights_stay_on_meta():
            patcher.load(meta)
    finally:
        comfy_aimdo.model_vbar.ModelVBAR = vbar_class
    vbar = patcher.model.dynamic_vbars[meta]
    in_vbar = {id(m) for m in patcher.model.modules() if hasattr(m, "_v")}
    outright = sum(t.numel() * t.element_size() for m in patcher.model.modules() if id(m) not in in_vbar
                   for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
    return outright, [(offset, size) for _, offset, size in vbar.allocations]


def dynamic_streamed_bytes(outright: int, allocations, budget: int) -> int:
    """What ComfyUI 0.33's dynamic VRAM casts every forward under ``budget`` bytes of VRAM for weights.

    comfy-aimdo's residency rule (``src/model-vbar.c``): a VBAR's pages below its watermark may be resident, a fault
    that would reach past the watermark fails, and when VRAM runs out the watermark comes down from the top. In a
    steady state the first W pages stay resident; a weight whose last page is past W is cast every forward, through
    one cast buffer per offload stream, each as large as the largest weight cast (in 16 MiB chunks). W is the most
    pages for which the weights placed outright, the W pages and the buffers fit."""
    ends = [-(-(offset + size) // VBAR_PAGE) for offset, size in allocations]
    for pages in range(max(ends, default=0), -1, -1):
        cast = [size for (_, size), end in zip(allocations, ends) if end > pages]
        buffers = OFFLOAD_STREAMS * -(-max(cast) // CAST_BUFFER_CHUNK) * CAST_BUFFER_CHUNK if cast else 0
        if outright + pages * VBAR_PAGE + buffers <= budget:
            return sum(cast)
    return sum(size for _, size in allocations)


def scaled_allocations(allocations, scale: float):
    """The same allocations for weights stored at ``scale`` times bf16's bytes (fp8, GGUF): each size scaled and
    rounded to 1024 bytes as ComfyUI's ``vram_aligned_size``, re-placed by the VBAR's 512-byte bump allocation."""
    placed, offset = [], 0
    for _, size in allocations:
        size = -(-int(size * scale) // 1024) * 1024
        offset = (offset + 511) & ~511
        placed.append((offset, size))
        offset += size
    return placed


def block_geometry(template):
    """(the blocks' bytes, each block's tail options (``BlockLayout.tail_sizes``), the non-block bytes) of the
    template's DiT, as the node's discovery and the packing see it (bf16, on the meta device)."""
    from ...nodes import discovery
    from ...offload.host.packing import block_parameters, plan_layout

    dit = meta_patcher(template).model.diffusion_model
    blocks = discovery.discover_blocks(dit).blocks
    sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    options = [plan_layout(block_parameters(block)).tail_sizes for block in blocks]
    non_block = sum(p.numel() * p.element_size() for p in dit.parameters()) - sum(sizes)
    return sizes, options, non_block


def our_plan(template, budget_bf16: int, tails: bool = True):
    """(streamed bytes, resident count, policy, largest tail) of the node's plan under ``budget_bf16`` (``tails``:
    streamed tails among the candidates); None where none fits."""
    from ...offload import choose_resident_blocks, footprint, largest_fitting, plan_streamed_tails

    sizes, options, non_block = block_geometry(template)
    room = budget_bf16 - non_block
    best = None
    for policy in ("leading", "strided"):
        def fits(count, policy=policy):
            return footprint(sizes, choose_resident_blocks(len(sizes), count, policy), 1).total <= room
        if not fits(0):
            continue
        count = largest_fitting(fits, len(sizes))
        streamed = footprint(sizes, choose_resident_blocks(len(sizes), count, policy), 1).streamed_bytes
        if best is None or streamed < best[0]:
            best = (streamed, count, policy, 0)
    if tails:
        plan = plan_streamed_tails(sizes, options, room, prefetch_size=1)
        if plan is not None and (best is None or plan.streamed_bytes < best[0]):
            best = (plan.streamed_bytes, 0, "tails", max(plan.tails))
    return best


def unit_geometry(template):
    """(each weight unit's bytes, its tail options, the non-unit bytes) of the template's DiT: the units of the
    blocks the node discovers (``offload/units.py``), residents first, bf16 on the meta device. What no unit
    streams (non-block weights, parameters of modules with weighted children) is counted as placed first."""
    from ...nodes import discovery
    from ...offload.units import weight_units

    dit = meta_patcher(template).model.diffusion_model
    units = weight_units(discovery.discover_blocks(dit).blocks).residents_first()
    sizes, options = units.geometry()
    return sizes, options, sum(p.numel() * p.element_size() for p in dit.parameters()) - sum(sizes)


def our_unit_plan(template, budget_bf16: int):
    """(streamed bytes, resident units, units, largest tail) of the engine's plan over weight units under
    ``budget_bf16`` (``plan_weight_units``, prefetch 1: each unit streams while the one before it computes); None
    where none fits. The manager arms this plan as it is (tests/comfy/test_weight_units.py runs it on every tiny
    family); the node does not offer it yet."""
    from ...offload import plan_weight_units

    sizes, options, rest = unit_geometry(template)
    plan = plan_weight_units(sizes, options, budget_bf16 - rest, prefetch_size=1)
    if plan is None:
        return None
    return plan.streamed_bytes, plan.resident_count, len(sizes), plan.footprint.slot_size


def templates(keys=None):
    """(template, its weights' bf16 bytes as ComfyUI counts them, its stored bytes over bf16's) for every template
    (``keys``: those only), with ComfyUI imported."""
    comfy_env.import_comfyui(cpu=True, import_nodes=False)
    for template in template_memory._templates(dit_presets):
        if keys and template.key not in keys:
            continue
        patcher = meta_patcher(template)
        weights_bf16 = sum(module_mem for module_mem, *_ in patcher._load_list())
        del patcher
        yield template, weights_bf16, template.stored_bytes / 2


def unit_columns(template, budget_bf16: int, scale: float, comfy_bf16: float, against: str) -> dict:
    """The ``ours_weight_units_*`` columns of a row; ``comfy_bf16``: ComfyUI's bytes at bf16."""
    plan = our_unit_plan(template, budget_bf16)
    if plan is None:
        return {"ours_weight_units_bytes_per_step": "", f"ours_weight_units_over_{against}": "",
                "ours_weight_units_largest_tail_bytes": ""}
    return {"ours_weight_units_bytes_per_step": int(plan[0] * scale),
            f"ours_weight_units_over_{against}": round(plan[0] / comfy_bf16, 4) if comfy_bf16 else "",
            "ours_weight_units_largest_tail_bytes": int(plan[3] * scale)}


def rows(keys=None, fractions=FRACTIONS):
    out = []
    for template, weights_bf16, scale in templates(keys):
        for fraction in fractions:
            budget = int(weights_bf16 * fraction)
            comfy = comfyui_streamed_bytes(template, budget)
            ours = our_plan(template, budget)
            whole = our_plan(template, budget, tails=False)
            out.append(dict(
                template=template.key, budget_fraction=fraction, budget_bytes=int(budget * scale),
                weights_bytes=int(weights_bf16 * scale), comfy_lowvram_bytes_per_step=int(comfy * scale),
                ours_bytes_per_step="" if ours is None else int(ours[0] * scale),
                ours_resident="" if ours is None else ours[1], ours_policy="" if ours is None else ours[2],
                ours_over_comfy="" if ours is None or comfy == 0 else round(ours[0] / comfy, 3),
                ours_largest_tail_bytes="" if ours is None else int(ours[3] * scale),
                ours_whole_bytes_per_step="" if whole is None else int(whole[0] * scale),
                ours_whole_over_comfy="" if whole is None or comfy == 0 else round(whole[0] / comfy, 3),
                **unit_columns(template, budget, scale, comfy, "comfy")))
    return out


DYNAMIC_FIELDS = ("template", "budget_fraction", "budget_bytes", "weights_bytes", "comfy_dynamic_bytes_per_step",
                  "ours_bytes_per_step", "ours_policy", "ours_over_dynamic", "ours_largest_tail_bytes",
                  "ours_weight_units_bytes_per_step", "ours_weight_units_over_dynamic",
                  "ours_weight_units_largest_tail_bytes")


def dynamic_rows(keys=None, fractions=FRACTIONS):
    """The same budgets against ComfyUI 0.33's dynamic VRAM (run on 0.33: ``COMFYUI_PATH`` at its tree)."""
    out = []
    for template, weights_bf16, scale in templates(keys):
        outright, allocations = dynamic_load_layout(template)
        # what ComfyUI places outright (small weights, norms, non-leaf parameters) stays in its file's dtype
        placed = scaled_allocations(allocations, scale) if scale != 1 else allocations
        for fraction in fractions:
            budget = int(weights_bf16 * fraction)
            dynamic = dynamic_streamed_bytes(outright, placed, int(budget * scale))
            ours = our_plan(template, budget)
            ours_bytes = None if ours is None else int(ours[0] * scale)
            out.append(dict(
                template=template.key, budget_fraction=fraction, budget_bytes=int(budget * scale),
                weights_bytes=int(weights_bf16 * scale), comfy_dynamic_bytes_per_step=dynamic,
                ours_bytes_per_step="" if ours is None else ours_bytes, ours_policy="" if ours is None else ours[2],
                ours_over_dynamic="" if ours is None or dynamic == 0 else round(ours_bytes / dynamic, 3),
                ours_largest_tail_bytes="" if ours is None else int(ours[3] * scale),
                **unit_columns(template, budget, scale, dynamic / scale, "dynamic")))
    return out


def write_csv(path: Path, fields, table) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write g5_bytes_per_step.csv into this folder")
    ap.add_argument("--dynamic", action="store_true",
                    help="against ComfyUI 0.33's dynamic VRAM (COMFYUI_PATH at ComfyUI 0.33+): g5_bytes_dynamic.csv")
    args = ap.parse_args(argv)
    gib = 2 ** 30
    if args.dynamic:
        table = dynamic_rows()
        print(f"{'template':22} {'B':>5} {'ComfyUI dynamic':>16} {'ours':>9} {'ratio':>6}  plan")
        for r in table:
            ours = "no fit" if r["ours_bytes_per_step"] == "" else f"{r['ours_bytes_per_step'] / gib:.2f} GiB"
            print(f"{r['template']:22} {r['budget_fraction']:>5} {r['comfy_dynamic_bytes_per_step'] / gib:>12.2f} GiB "
                  f"{ours:>9} {str(r['ours_over_dynamic']):>6}  {r['ours_policy']}")
        if args.out:
            write_csv(Path(args.out) / "g5_bytes_dynamic.csv", DYNAMIC_FIELDS, table)
        return 0
    table = rows()
    print(f"{'template':22} {'B':>5} {'ComfyUI lowvram':>16} {'ours':>9} {'ratio':>6} {'whole':>6}  plan")
    for r in table:
        ours = "no fit" if r["ours_bytes_per_step"] == "" else f"{r['ours_bytes_per_step'] / gib:.2f} GiB"
        print(f"{r['template']:22} {r['budget_fraction']:>5} {r['comfy_lowvram_bytes_per_step'] / gib:>12.2f} GiB "
              f"{ours:>9} {str(r['ours_over_comfy']):>6} {str(r['ours_whole_over_comfy']):>6}  "
              f"{r['ours_resident']} resident, {r['ours_policy']}")
    if args.out:
        write_csv(Path(args.out) / "g5_bytes_per_step.csv", FIELDS, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
