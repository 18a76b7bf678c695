"""ComfyUI's own MODEL-patching nodes, found by walking its node classes, each run with and without the offload.

Every ``comfy_extras`` node class that takes a MODEL and returns one is a row, its inputs filled from its own
declaration (defaults; a second tiny model for a second MODEL input; a ratio at an end of its range moved inside
it, so a merge really merges), each small choice (a COMBO option, a flipped BOOLEAN) a variant of its own. A node
whose inputs cannot be made here (a file, a CLIP, a LATENT) or that fails without the offload node is listed with
the reason. Each variant is sampled from fresh tiny models: the node alone (the reference), the node before the
offload node and after it, streamed and all resident; the outputs must be bitwise equal.

    python -P devtools/core_model_nodes.py --family wan21     # prints the matrix (with ComfyUI's Python)
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

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


def compare(node: CoreNode, variant: Variant, family: str, runs=ALL_RUNS) -> Iterator[Tuple[str, Optional[int], str]]:
    """``(placement, resident count, result)`` for one variant, for each ``(placement, resident count)`` of
    ``runs``; result "bitwise", what differed, or (placement "reference") why the variant does not apply to
    ``family``: it fails without the offload node too."""
    import torch
    from ..nodes.controller import offload_model
    from . import tiny_dits
    mm = import_comfyui().model_management
    shape = tiny_dits.TINY_FAMILIES[family].latent_shape
    latent = shape[:2] + MATRIX_LATENT[-(len(shape) - 2):]

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
    for placement, resident in runs:
        try:
            inputs = models()
            if placement == "before":
                patched = offload_model(_apply(variant, node.cls, node.model_inputs, inputs), resident)
            else:
                offloaded = [offload_model(inputs[0], resident)] + inputs[1:]
                patched = _apply(variant, node.cls, node.model_inputs, offloaded)
            out = sample(patched)
        except Exception as error:
            yield placement, resident, f"FAILED: {type(error).__name__}: {error}"
            continue
        same = out.shape == reference.shape and torch.equal(out, reference)
        if same or out.shape != reference.shape:
            yield placement, resident, "bitwise" if same else f"DIFFERS (shape {tuple(out.shape)})"
        else:
            yield placement, resident, f"DIFFERS (max abs {(out - reference).abs().max().item():.3g})"


def main(argv=None) -> int:
    import argparse
    import os
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="wan21")
    parser.add_argument("--only", nargs="*", help="node names to run (default: all)")
    args = parser.parse_args(argv)
    os.environ.setdefault("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    failures = 0
    for node in core_model_nodes():
        if args.only and node.name not in args.only:
            continue
        if node.reason:
            print(f"{node.name:32s} not run: {node.reason}")
            continue
        for variant in node.variants:
            for placement, resident, result in compare(node, variant, args.family):
                if placement == "reference":
                    print(f"{node.name:32s} {variant.label:24s} {result}")
                    continue
                failures += result != "bitwise"
                print(f"{node.name:32s} {variant.label:24s} {placement:6s} resident={resident:<5d} {result}")
    print(f"[layerwise-offload] {args.family}: {failures} rows not bitwise")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
