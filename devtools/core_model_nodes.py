"""ComfyUI's own MODEL-patching nodes, found by walking its node classes, each run with and without the offload.

Every ``comfy_extras`` node class that takes a MODEL and returns one is a row, its inputs filled from its own
declaration (defaults; a second tiny model for a second MODEL input; a ratio at an end of its range moved inside
it, so a merge really merges), each small choice (a COMBO option, a flipped BOOLEAN) a variant of its own. A node
whose inputs cannot be made here (a file, a CLIP, a LATENT) or that fails without the offload node is listed with
the reason. Each variant is sampled from fresh tiny models: the node alone (the reference), the node before the
offload node and after it, streamed and all resident, and (``--plans``; the test suite's release set) under the plans
chosen at the run's first step from a budget smaller than the blocks: streamed tails and weight units; the outputs
must be bitwise equal.

    python -P devtools/core_model_nodes.py --family wan21 [--plans]    # prints the matrix (with ComfyUI's Python)
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).with_name("comfy_env.py")))["enter_pack"](globals())

from .comfy_env import import_comfyui  # noqa: E402
from .workflow_api import combo_options  # noqa: E402

#: Nodes the matrix cannot run here, with the reason (everything else is decided from the node's declaration).
NOT_RUN_HERE = {
    "TorchCompileModel": "compiles with inductor, minutes per graph on a 2-core CPU; the offload under "
                         "torch.compile is covered by tests/comfy/test_node.py",
}
RESIDENT_COUNTS = (1, 4096)  # 1: every other block streams; 4096: all resident
# Plans chosen at the run's first step from a budget smaller than the blocks (tight_budget): auto on a card the timing
# model knows, which streams every block's tail, and residency_policy weights, which streams weight units.
TAILS, WEIGHTS = "tails", "weights"
PLANNED = (TAILS, WEIGHTS)
TIGHT_FRACTION = 0.8  # of the blocks' bytes, beside ComfyUI's reserve and the latent's activations
# An RTX 4090 behind a link slow enough that the tiny blocks' copies outweigh their host time, as a real model's do
# on the real link (tests/comfy/test_streamed_tails.py): the timing model then prefers tails to whole blocks.
SLOW_LINK_CARD = "RTX 4090 behind a 0.2 GB/s link"
STEPS = 2
MATRIX_LATENT = (1, 4, 4)  # frames, height, width of the latent (spatial dims only for image families)
MAX_COMBO_VARIANTS = 8  # a COMBO with more options than this runs its default only


@dataclass
class Variant:
    node: str
    values: Dict[str, Any]
    label: str = "defaults"


@dataclass
class CoreNode:
    name: str
    cls: type
    model_inputs: List[str] = field(default_factory=list)
    variants: List[Variant] = field(default_factory=list)
    reason: Optional[str] = None  # why it is not run, if it is not


def _load_extra_nodes():
    env = import_comfyui()
    comfy_nodes = env.nodes
    if not getattr(comfy_nodes, "_layerwise_offload_extras_loaded", False):
        asyncio.run(comfy_nodes.init_builtin_extra_nodes())
        comfy_nodes._layerwise_offload_extras_loaded = True
    return comfy_nodes.NODE_CLASS_MAPPINGS


def _scalar(kind, options):
    default = options.get("default")
    if kind == "FLOAT" and default is not None:
        low, high = options.get("min"), options.get("max")
        if low is not None and high is not None and low < high and default in (low, high):
            # A ratio at an end of its range makes a merge the identity: take a point inside it.
            return round(low + 0.3 * (high - low), 6) if default == high else round(high - 0.3 * (high - low), 6)
        return default
    if kind in ("INT", "FLOAT", "BOOLEAN", "STRING"):
        return default if default is not None else {"INT": 0, "FLOAT": 0.0, "BOOLEAN": False, "STRING": ""}[kind]
    raise KeyError(kind)


def describe_node(name: str, cls: type) -> CoreNode:
    node = CoreNode(name, cls)
    required = cls.INPUT_TYPES().get("required", {})
    base: Dict[str, Any] = {}
    choices: List[Tuple[str, list]] = []
    for input_name, spec in required.items():
        kind = spec[0]
        options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
        if kind == "MODEL":
            node.model_inputs.append(input_name)
            continue
        combo = combo_options(kind, options)
        if combo is not None:
            if not combo:
                node.reason = f"input {input_name!r} lists files this ComfyUI does not have"
                return node
            default = options.get("default", combo[0])
            base[input_name] = default
            if len(combo) <= MAX_COMBO_VARIANTS:
                choices.append((input_name, [c for c in combo if c != default]))
            continue
        try:
            base[input_name] = _scalar(kind, options)
        except KeyError:
            node.reason = f"needs a {kind} input ({input_name!r})"
            return node
        if kind == "BOOLEAN":
            choices.append((input_name, [not base[input_name]]))
    node.variants.append(Variant(name, dict(base)))
    for input_name, others in choices:
        for value in others:
            node.variants.append(Variant(name, {**base, input_name: value}, f"{input_name}={value}"))
    if name in NOT_RUN_HERE:
        node.reason = NOT_RUN_HERE[name]
    return node


def core_model_nodes() -> List[CoreNode]:
    """Every comfy_extras node class that takes a MODEL and returns a MODEL, in name order."""
    found = []
    for name, cls in sorted(_load_extra_nodes().items()):
        module = (getattr(cls, "__module__", "") or "").replace("\\", "/")  # ComfyUI names them by file path
        if not (module.startswith("comfy_extras.") or "/comfy_extras/" in module):
            continue
        try:
            required = cls.INPUT_TYPES().get("required", {})
        except Exception as error:  # a node whose declaration needs something absent here
            found.append(CoreNode(name, cls, reason=f"INPUT_TYPES failed: {error}"))
            continue
        takes_model = any(spec and spec[0] == "MODEL" for spec in required.values())
        if takes_model and "MODEL" in tuple(getattr(cls, "RETURN_TYPES", ())):
            found.append(describe_node(name, cls))
    return found


def run_node(cls, values: Dict[str, Any]):
    """Execute a node class the way ComfyUI's executor does (V1 classes and V3 ComfyNode classes); its MODEL output."""
    if hasattr(cls, "PREPARE_CLASS_CLONE"):
        target = cls.PREPARE_CLASS_CLONE(None)
    else:
        target = cls()
    out = getattr(target, target.FUNCTION)(**values)
    if inspect.isawaitable(out):
        out = asyncio.run(out)
    if isinstance(out, dict):
        out = out["result"]
    out = getattr(out, "args", out)
    return out[list(cls.RETURN_TYPES).index("MODEL")]


def _apply(variant: Variant, cls, model_inputs: List[str], models) -> Any:
    values = dict(variant.values)
    for input_name, model in zip(model_inputs, models):
        values[input_name] = model
    return run_node(cls, values)


_PRISTINE: Dict[Tuple[str, int], Any] = {}


def fresh_model(family: str, seed: int):
    """A tiny model that shares nothing with any other: ComfyUI's model class built anew from the config of one
    built once per (family, seed), its weights copied from that one (a deep copy of the module is 3x slower)."""
    from . import tiny_dits
    env = import_comfyui()
    pristine = _PRISTINE.get((family, seed))
    if pristine is None:
        pristine = _PRISTINE[(family, seed)] = tiny_dits.build_tiny(family, seed=seed)
    model = pristine.model.model_config.get_model({}, "").to(pristine.offload_device)
    model.load_state_dict(pristine.model.state_dict(), strict=True)
    model.eval()
    return env.model_patcher.ModelPatcher(model, load_device=pristine.load_device,
                                          offload_device=pristine.offload_device)


ALL_RUNS = tuple((placement, resident) for resident in RESIDENT_COUNTS for placement in ("before", "after"))
PLANNED_RUNS = tuple((placement, plan) for plan in PLANNED for placement in ("before", "after"))
EVERY_RUN = ALL_RUNS + PLANNED_RUNS


def matrix_latent(family: str) -> Tuple[int, ...]:
    from . import tiny_dits
    shape = tiny_dits.TINY_FAMILIES[family].latent_shape
    return shape[:2] + MATRIX_LATENT[-(len(shape) - 2):]


def offload(model, plan):
    """The offload node's output for ``plan``: a resident count (leading), :data:`TAILS` or :data:`WEIGHTS`."""
    from ..nodes.controller import offload_model
    if plan == TAILS:
        return offload_model(model, -1, 1, "auto")
    if plan == WEIGHTS:
        return offload_model(model, -1, 1, "weights")
    return offload_model(model, plan)


@contextmanager
def tight_budget(patcher, latent: Sequence[int], fraction: float = TIGHT_FRACTION):
    """While sampling ``patcher`` (an offloaded output, or a clone of one): ComfyUI says free what the plan of its
    first step leaves for the blocks, :data:`TIGHT_FRACTION` of their bytes, and the loopback plans as
    :data:`SLOW_LINK_CARD`. The figure is worked out when asked, so the device LoRA's scratch (known once ComfyUI has
    loaded the model) is in it; the activations are counted at 4 bytes, so a 16-bit compute dtype only adds room."""
    import dataclasses
    import torch
    from unittest import mock
    from ..nodes import run_planning
    from ..nodes.patcher import LayerwiseOffloadPatcherMixin
    from ..offload import TIMING_GPU_ENV, block_width, forward_activation_bytes
    from ..offload.timing import costs as gpu_costs
    mm = import_comfyui().model_management
    controller = patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]
    per_channel = int(torch.Size(latent[2:]).numel())
    activations = forward_activation_bytes(type(controller.diffusion_model).__name__,
                                           block_width(controller.discovered.whole_blocks[0]), per_channel,
                                           batch=2 * latent[0], dtype_bytes=4, latent_channels=latent[1]).nbytes

    def free_bytes() -> int:
        blocks = sum(controller.manager.block_nbytes())
        return (int(mm.minimum_inference_memory()) + activations + controller.device_lora_scratch
                + int(fraction * blocks))

    def get_free_memory(dev=None, torch_free_too=False):
        free = free_bytes()
        return (free, free) if torch_free_too else free
    card = dataclasses.replace(gpu_costs.GPUS["RTX 4090 24GB"], name=SLOW_LINK_CARD, h2d_bytes_per_s=0.2e9)
    with mock.patch.object(mm, "get_free_memory", get_free_memory), \
            mock.patch.object(run_planning, "available_host_bytes", lambda: None), \
            mock.patch.dict(gpu_costs.GPUS, {SLOW_LINK_CARD: card}), \
            mock.patch.dict("os.environ", {TIMING_GPU_ENV: SLOW_LINK_CARD}):
        yield


def planned_as_asked(patcher, plan) -> Optional[str]:
    """Why the last run of an offloaded ``patcher`` did not stream as ``plan`` asks (None: it did): part of the
    model streamed and part stayed on the device; with :data:`TAILS`, every block streamed a tail."""
    from ..nodes.patcher import LayerwiseOffloadPatcherMixin
    controller = patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]
    manager = controller.manager
    if plan not in PLANNED:
        return None
    stats = manager.stats()
    if not (0 < stats.bytes_copied_last_forward < sum(manager.block_nbytes())) or manager.device_bytes() == 0:
        return (f"not partly resident: {stats.bytes_copied_last_forward} of {sum(manager.block_nbytes())} bytes "
                f"streamed, {manager.device_bytes()} held")
    if plan == TAILS and not isinstance(manager.config.streamed_tail_bytes, tuple):
        return f"auto chose {controller.planner.last_choice[:3]}, not streamed tails"
    if plan == WEIGHTS and not controller.discovered.streams_weights:
        return "not streamed by weight units"
    return None


def sample_with_plan(patcher, plan, family: str, unload: bool = True):
    """``tiny_dits.sample`` of the matrix, under :func:`tight_budget` where ``plan`` is planned at the first step."""
    from . import tiny_dits
    mm = import_comfyui().model_management
    latent = matrix_latent(family)
    try:
        with tight_budget(patcher, latent) if plan in PLANNED else nullcontext():
            return tiny_dits.sample(patcher, latent=latent, seed=3, steps=STEPS, family=family)
    finally:
        if unload:
            mm.unload_all_models()


def compare(node: CoreNode, variant: Variant, family: str, runs=ALL_RUNS) -> Iterator[Tuple[str, Any, str]]:
    """``(placement, plan, result)`` for one variant, for each ``(placement, plan)`` of ``runs`` (a plan: a resident
    count, :data:`TAILS` or :data:`WEIGHTS`); result "bitwise", what differed, or (placement "reference") why the
    variant does not apply to ``family``: it fails without the offload node too."""
    import torch
    from . import tiny_dits
    mm = import_comfyui().model_management
    latent = matrix_latent(family)

    def models():
        return [fresh_model(family, k) for k in range(len(node.model_inputs))]

    def sample(patcher):
        try:
            return tiny_dits.sample(patcher, latent=latent, seed=3, steps=STEPS, family=family)
        finally:
            mm.unload_all_models()

    try:
        reference = sample(_apply(variant, node.cls, node.model_inputs, models()))
    except Exception as error:
        yield "reference", None, f"not applicable: fails without the offload node too: {type(error).__name__}: " \
                                 f"{str(error)[:120]}"
        return
    for placement, plan in runs:
        try:
            inputs = models()
            if placement == "before":
                patched = offload(_apply(variant, node.cls, node.model_inputs, inputs), plan)
            else:
                offloaded = [offload(inputs[0], plan)] + inputs[1:]
                patched = _apply(variant, node.cls, node.model_inputs, offloaded)
            out = sample_with_plan(patched, plan, family, unload=False)
            not_as_asked = planned_as_asked(patched, plan)
            mm.unload_all_models()
        except Exception as error:
            mm.unload_all_models()
            yield placement, plan, f"FAILED: {type(error).__name__}: {error}"
            continue
        same = out.shape == reference.shape and torch.equal(out, reference)
        if not_as_asked is not None:
            yield placement, plan, f"PLAN NOT AS ASKED ({not_as_asked}; {'bitwise' if same else 'differs'})"
        elif same or out.shape != reference.shape:
            yield placement, plan, "bitwise" if same else f"DIFFERS (shape {tuple(out.shape)})"
        else:
            yield placement, plan, f"DIFFERS (max abs {(out - reference).abs().max().item():.3g})"


def plan_label(plan) -> str:
    return plan if plan in PLANNED else f"resident={plan}"


def main(argv=None) -> int:
    import argparse
    import os
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="wan21")
    parser.add_argument("--only", nargs="*", help="node names to run (default: all)")
    parser.add_argument("--plans", action="store_true",
                        help=f"also the plans chosen at the first step under a tight budget ({', '.join(PLANNED)})")
    args = parser.parse_args(argv)
    runs = EVERY_RUN if args.plans else ALL_RUNS
    os.environ.setdefault("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    failures = 0
    for node in core_model_nodes():
        if args.only and node.name not in args.only:
            continue
        if node.reason:
            print(f"{node.name:32s} not run: {node.reason}")
            continue
        for variant in node.variants:
            for placement, plan, result in compare(node, variant, args.family, runs):
                if placement == "reference":
                    print(f"{node.name:32s} {variant.label:24s} {result}")
                    continue
                failures += result != "bitwise"
                print(f"{node.name:32s} {variant.label:24s} {placement:6s} {plan_label(plan):14s} {result}")
    print(f"[layerwise-offload] {args.family}: {failures} rows not bitwise")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
