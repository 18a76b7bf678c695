"""What ComfyUI's own load does to each weight of a model, so the offload does exactly the same.

ComfyUI's load (``ModelPatcher.load`` in 0.3.75 and 0.14.1, and the dynamic loader of 0.14.1) walks the modules its
``_load_list`` returns. A module that holds parameters of its own AND has child modules is not in that list, so
ComfyUI never patches its parameters: Wan's ``blocks.N.modulation`` and ``head.modulation``, ``scale_shift_table``
tensors of PixArt-style blocks. A model merge or a ``.diff`` LoRA therefore leaves them as loaded, and an offload
that patched every key in ``patcher.patches`` would give another image than ComfyUI alone.

The same walk decides the casting: with ``force_cast_weights`` (ModelComputeDtype sets it) every cast module of the
list computes through ``comfy.ops``' cast path (``comfy_cast_weights = True``), and weight wrappers
(``add_weight_wrapper``) become the module's ``weight_function`` / ``bias_function``.

The decisions are read from ComfyUI's own ``_load_list`` where the patcher has one, never from the patch
dictionary; the fallback applies the rule that list implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Tuple

from torch import nn

import comfy.model_patcher


@dataclass(frozen=True)
class LoadDecisions:
    """``patched_keys``: the keys ComfyUI's full load would patch (every own parameter of a listed module);
    ``modules``: the listed modules, ``(name, module)`` in ComfyUI's order; ``force_cast``: the patcher's
    ``force_cast_weights``."""
    patched_keys: FrozenSet[str]
    modules: Tuple[Tuple[str, nn.Module], ...]
    force_cast: bool

    def patches(self, patcher, key: str) -> bool:
        """Whether ComfyUI's load would apply ``patcher``'s patches to ``key``."""
        return key in self.patched_keys and key in patcher.patches


def _key(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def _listed_modules(patcher) -> List[Tuple[str, nn.Module, List[str]]]:
    load_list = getattr(patcher, "_load_list", None)
    if callable(load_list):
        # 0.3.75: (offload_mem, mem, name, module, [param names]); 0.14.1: the same with a dict of params.
        return [(entry[-3], entry[-2], list(entry[-1])) for entry in load_list()]
    listed = []
    for name, module in patcher.model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if len(own) != sum(1 for _ in module.parameters()):
            continue  # holds parameters beside child modules: ComfyUI leaves them as they are
        if own or hasattr(module, "comfy_cast_weights"):
            listed.append((name, module, own))
    return listed


def comfyui_load_decisions(patcher) -> LoadDecisions:
    listed = _listed_modules(patcher)
    return LoadDecisions(
        patched_keys=frozenset(_key(name, p) for name, _, params in listed for p in params),
        modules=tuple((name, module) for name, module, _ in listed),
        force_cast=bool(getattr(patcher, "force_cast_weights", False)))


def apply_cast_decisions(patcher, decisions: LoadDecisions, device_to) -> None:
    """Set each listed cast module's casting as ComfyUI's load of a fully loaded model does.

    The previous setting is kept in ``prev_comfy_cast_weights``, as ComfyUI keeps it, so ComfyUI's own unpatching
    (``wipe_lowvram_weight``, run for a model it sees as lowvram, which an offloaded model is) restores it.
    Idempotent: a second placement with the same patcher changes nothing.
    """
    wrappers = getattr(patcher, "weight_wrapper_patches", {})
    move_functions = getattr(comfy.model_patcher, "move_weight_functions", None)
    for name, module in decisions.modules:
        if not hasattr(module, "comfy_cast_weights"):
            continue
        module.comfy_force_cast_weights = decisions.force_cast
        if decisions.force_cast:
            if not hasattr(module, "prev_comfy_cast_weights"):
                module.prev_comfy_cast_weights = module.comfy_cast_weights
            module.comfy_cast_weights = True
        elif hasattr(module, "prev_comfy_cast_weights"):
            module.comfy_cast_weights = module.prev_comfy_cast_weights
            del module.prev_comfy_cast_weights
        module.weight_function = list(wrappers.get(_key(name, "weight"), ()))
        module.bias_function = list(wrappers.get(_key(name, "bias"), ()))
        if move_functions is not None and (module.weight_function or module.bias_function):
            move_functions(module, device_to)
