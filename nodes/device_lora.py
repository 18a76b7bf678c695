"""LoRA applied to each block on the device as it is copied in, with ComfyUI's own full-load math.

ComfyUI's full load patches every weight once, on the load device (``ModelPatcher.patch_weight_to_device``):
the weight cast to the LoRA compute dtype (float32; 0.14.1 asks ``lora_compute_dtype``),
``comfy.lora.calculate_weight``, then ``comfy.float.stochastic_rounding`` back to the weight's dtype, seeded by
the key. The same steps on the block's device copy give the same bits, so the host store keeps only the
unpatched weights: no patched second copy in RAM.

ComfyUI still needs an unpatched weight to restore for every patched key (its ``backup``, shared by all
clones of the model): here that is a view of the original in the host store, which costs no memory. So
ComfyUI's own unpatching (a sibling clone loaded without the node, another LoRA) sets back exactly its
originals, whatever the device copies hold.

Weights this cannot reproduce exactly are baked into the host store as before (controller.py): an op with
its own ``set_``/``convert_`` functions (0.3.75's scaled fp8, QuantizedTensor layers), a tensor-subclass
weight, a patcher that patches weights its own way (ComfyUI-GGUF applies its LoRA at dequantization), and
ComfyUI asking for weights really patched (``force_patch_weights``: saving or merging a model reads them).
"""

from __future__ import annotations

import collections
import copy
import logging
from typing import Dict, List, Sequence, Tuple

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils

from ..offload import block_parameters
from .host_ram import compact_backups

log = logging.getLogger("layerwise_offload")

# (position of the weight in the block's layout, ComfyUI key, its patches)
DevicePatch = Tuple[int, str, list]

# ComfyUI's backup record (a namedtuple it builds with these fields in patch_weight_to_device).
Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])

_string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


def patches_own_weights(patcher) -> bool:
    """Whether ``patcher`` uses ComfyUI's own weight patching (ComfyUI-GGUF's patcher overrides it)."""
    own = comfy.model_patcher.ModelPatcher.patch_weight_to_device
    return getattr(type(patcher).patch_weight_to_device, "__func__", type(patcher).patch_weight_to_device) is own


def device_patch_plan(patcher, blocks: Sequence[torch.nn.Module], block_keys: Sequence[str], decisions
                      ) -> Dict[int, List[DevicePatch]]:
    """Per block, the patched weights that can be patched on the device bit for bit, among those ComfyUI's
    own load patches (``decisions``, load_decisions.py)."""
    if not patches_own_weights(patcher):
        return {}
    plan: Dict[int, List[DevicePatch]] = {}
    for index, (block, prefix) in enumerate(zip(blocks, block_keys)):
        for position, (name, param) in enumerate(block_parameters(block)):
            key = prefix + name
            patches = patcher.patches.get(key)
            if not patches or not decisions.patches(patcher, key) or type(param.data) is not torch.Tensor:  # a subclass (quantized) weight bakes
                continue
            _, set_func, convert_func = comfy.model_patcher.get_key_weight(patcher.model, key)
            if set_func is None and convert_func is None:
                plan.setdefault(index, []).append((position, key, list(patches)))
    return plan


def lora_compute_dtype(load_device) -> torch.dtype:
    """The dtype ComfyUI computes a LoRA'd weight in on ``load_device`` (0.14.1 asks; 0.3.75: float32)."""
    ask = getattr(comfy.model_management, "lora_compute_dtype", None)
    return ask(load_device) if ask is not None else torch.float32


def patched_weight(weight: torch.Tensor, patches: list, key: str, compute_dtype: torch.dtype,
                   seed: int) -> torch.Tensor:
    """ComfyUI's ``patch_weight_to_device`` math for ``weight`` (already on the device), not written back;
    ``seed`` is ComfyUI's ``string_to_seed(key)``."""
    temp = comfy.model_management.cast_to_device(weight, weight.device, compute_dtype, copy=True)
    out = comfy.lora.calculate_weight(patches, temp, key)
    return comfy.float.stochastic_rounding(out, weight.dtype, seed=seed)


def _on_device(value, device, uploaded: dict):
    """``value`` (a patch's payload: tensors, tuples of them, a LoRA adapter) with every tensor on ``device``;
    each tensor uploaded once (``uploaded`` by identity), ComfyUI's own patches left as they are."""
    if isinstance(value, torch.Tensor):
        moved = uploaded.get(id(value))
        if moved is None:
            moved = uploaded[id(value)] = (value, value.to(device))
        return moved[1]
    if isinstance(value, (tuple, list)):
        return type(value)(_on_device(v, device, uploaded) for v in value)
    if isinstance(getattr(value, "weights", None), (tuple, list)):  # comfy.weight_adapter's adapters
        adapter = copy.copy(value)
        adapter.weights = _on_device(value.weights, device, uploaded)
        return adapter
    return value


def patches_on_device(plan: Dict[int, List[DevicePatch]], device) -> Tuple[Dict[int, List[DevicePatch]], int]:
    """The plan with its LoRA factors on the load device, and the bytes that takes there. Uploaded once, here,
    on the compute stream: left on the host, ComfyUI's math would copy them from pageable memory at every block
    copy, where a pageable copy can stall the host before the next block's kernels queue."""
    uploaded: dict = {}
    out = {index: [(position, key, [(p[0], _on_device(p[1], device, uploaded)) + tuple(p[2:]) for p in patches])
                   for position, key, patches in entries] for index, entries in plan.items()}
    nbytes = sum(t.numel() * t.element_size() for src, t in uploaded.values() if t is not src)
    return out, nbytes


class DeviceLora:
    """The manager's after-copy transform: patches the planned weights of a block in its device buffer.
    Runs at every copy of a streamed block, so what does not change between copies is worked out once here:
    the compute dtype, ComfyUI's per-key seeds, and the LoRA factors, kept on the device for the model's run."""

    def __init__(self, plan: Dict[int, List[DevicePatch]], load_device, signature=None):
        self.plan = plan
        self.load_device = load_device
        self.signature = signature  # what it was built from (patches, device, weights), to tell it apart
        self._compute_dtype = lora_compute_dtype(load_device)
        self._seeds = {key: _string_to_seed(key) for patches in plan.values() for _, key, _ in patches}
        self.device_plan, self.factor_bytes = patches_on_device(plan, load_device)

    def __call__(self, index: int, weights: Sequence[torch.Tensor]) -> None:
        for position, key, patches in self.device_plan.get(index, ()):
            weight = weights[position]
            if weight is None:  # not in this copy: a streamed block's head, patched when it was copied
                continue
            weight.copy_(patched_weight(weight, patches, key, self._compute_dtype, self._seeds[key]))


def scratch_bytes(blocks: Sequence[torch.nn.Module], plan: Dict[int, List[DevicePatch]]) -> int:
    """Device memory the LoRA takes beside the blocks: the math of the largest patched weight (its float32
    copy, the LoRA difference and that difference scaled: what ComfyUI's full load also takes, once, at load
    time), plus the LoRA factors, which stay on the device (DeviceLora)."""
    largest = 0
    for index, patches in plan.items():
        params = [param for _, param in block_parameters(blocks[index])]
        largest = max([largest] + [params[position].numel() for position, _, _ in patches])
    return 3 * 4 * largest + patches_on_device(plan, torch.device("meta"))[1]


def point_backups_at_store(patcher, plan: Dict[int, List[DevicePatch]], manager) -> None:
    """ComfyUI's backup of each device-patched weight is its original in the host store (a view, no copy);
    re-pointed after a repack, so a backup never keeps an old host buffer alive."""
    for index, patches in plan.items():
        views = manager.host_weight_views(index)
        for position, key, _ in patches:
            patcher.backup[key] = Backup(views[position], False)


def bake_block_patches(patcher, device_to, decisions, block_keys: Sequence[str], manager,
                       skip=frozenset()) -> None:
    """Bake LoRA into ``manager``'s host store the way ComfyUI bakes a fully loaded model (the patches of block
``i`` are the keys under ``block_keys[i]``).

    ComfyUI's own ``patch_weight_to_device`` does the math (fp32 on the device, stochastic
    rounding back to the weight dtype) and keeps its backup of the unpatched weight. A key with
    a backup is baked already (ComfyUI clears the backups when it restores the originals).
    One block at a time, so the device holds at most one block's patched weights before they
    move to the host store.
    """
    pending: Dict[int, List[str]] = {}
    for key in patcher.patches:
        if key in patcher.backup or key in skip or not decisions.patches(patcher, key):
            continue
        for index, prefix in enumerate(block_keys):
            if key.startswith(prefix):
                pending.setdefault(index, []).append(key)
                break
    for index in sorted(pending):
        for key in pending[index]:
            patcher.patch_weight_to_device(key, device_to)
        compact_backups(patcher, pending[index], manager.host_buffers())
        manager.prepare(repack=[index])
    if pending:
        log.info("[layerwise-offload] baked LoRA patches into %d blocks", len(pending))
