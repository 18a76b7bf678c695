"""The node's work (:func:`offload_model`), and one offload per node output (:class:`OffloadController`): its
request, the plan resolved from it each run, applied at ComfyUI's load, unload and every forward to the diffusion
model's manager, which every output of that model shares (shared_managers.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

import comfy.model_management
import comfy.patcher_extension

from ..offload import (OffloadConfig, OffloadRequest, cuda_graph_refusal, largest_fitting, normalize_device,
                       point_param_at, return_freed_host_memory, weight_nbytes)
from ..offload.request import AUTO, BLOCKS, WEIGHTS
from .advice import recommend
from .device_support import device_support
from .discovery import DiscoveredBlocks, as_weight_units, discover_blocks, streaming_refusal
from .dynamic_vram import non_dynamic_patcher, watch_clones
from .host_ram import packing_progress_bar
from .device_lora import DeviceLora, bake_block_patches, device_patch_plan, point_backups_at_store, scratch_bytes
from .load_decisions import apply_cast_decisions, comfyui_load_decisions
from .offload_node import (AUTO_POLICY, AUTO_RESIDENT, DISPLAY_NAME, WEIGHTS_POLICY, host_store_problem,
                           residency_policy_problem)
from .patcher import make_offloaded_clone
from .run_planning import RunPlanner
from .run_report import run_report
from .shared_managers import _LORA_SCRATCH, _MANAGERS, shared_manager
from .stats_view import PASSTHROUGH_ATTACHMENT

log = logging.getLogger("layerwise_offload")

DIFFUSION_MODEL_PREFIX = "diffusion_model."


def offload_model(model, resident_layers=AUTO_RESIDENT, prefetch_size=1, residency_policy=AUTO_POLICY, pin_memory=True,
                  host_store="auto"):
    """The node's work: a clone of ``model`` whose transformer blocks are managed by the offload."""
    # Page-locking only speeds up copies to an accelerator; on the CPU loopback it would only warn.
    request = node_request(resident_layers, prefetch_size, residency_policy, pin_memory, host_store).with_pinning(
        not comfy.model_management.is_device_cpu(model.load_device))
    discover_blocks(model.get_model_object("diffusion_model"))  # a non-DiT fails here, before anything else
    support = device_support(model.load_device)
    if not support.offloads:
        return passed_through(model, support)
    refusal = streaming_refusal(model.get_model_object("diffusion_model"))
    if refusal is not None:
        return passed_through(model, dataclasses.replace(
            support, offloads=False, reason=refusal, hint="ComfyUI loads and runs it as it would without the node"))
    model = non_dynamic_patcher(model)
    diffusion_model = model.get_model_object("diffusion_model")
    discovered = discover_blocks(diffusion_model)
    if request.granularity == WEIGHTS:
        discovered = as_weight_units(discovered)
    controller = OffloadController(model.model, discovered, model.load_device, request)
    # Planned under this output's request: the shared manager may still hold another output's plan.
    refusal = controller.manager.shortfall(request.plan(), (
        f"{DISPLAY_NAME}: resident_layers={resident_layers}, prefetch_size={prefetch_size}, "
        f"residency_policy={residency_policy}, pin_memory={pin_memory}, host_store={host_store}"))
    if refusal is not None:  # here, so ComfyUI reports it against this node and its settings, not the sampler
        raise MemoryError(refusal)
    log.info("[layerwise-offload] %s (%s): %d %s in %s; plan: %s resident, prefetch %d, %s, %s, host_store=%s",
             type(diffusion_model).__name__, discovered.family, len(discovered),
             f"weight units of {len(discovered.whole_blocks)} blocks" if request.granularity == WEIGHTS else "blocks",
             "+".join(discovered.attributes),
             "auto" if request.auto_residents else request.plan().resident_count(len(discovered)), prefetch_size,
             residency_policy, "pinned RAM" if request.pin_memory else "CPU loopback: nothing to pin"
             if support.device_type == "cpu" else "pin_memory off", host_store)
    offloaded = make_offloaded_clone(model, controller)
    watch_clones(offloaded)
    return offloaded


def node_request(resident_layers=AUTO_RESIDENT, prefetch_size=1, residency_policy=AUTO_POLICY, pin_memory=True,
                 host_store="auto") -> OffloadRequest:
    """The node's inputs as one request, checked: -1 is auto; residency_policy names a policy, or weights (the
    granularity)."""
    problem = residency_policy_problem(residency_policy) or host_store_problem(host_store)
    if problem is not None:
        raise ValueError(f"[layerwise-offload] {problem}")
    auto = resident_layers == AUTO_RESIDENT
    weights = residency_policy == WEIGHTS_POLICY
    if weights and not auto:
        raise ValueError(f"[layerwise-offload] residency_policy = weights plans what stays in VRAM itself, at each "
                         f"run's first step: set resident_layers to -1 (auto), not {resident_layers}")
    return OffloadRequest(resident_layers=AUTO if auto else resident_layers, prefetch_size=prefetch_size,
                          policy=AUTO if residency_policy in (AUTO_POLICY, WEIGHTS_POLICY) else residency_policy,
                          granularity=WEIGHTS if weights else BLOCKS, pin_memory=bool(pin_memory),
                          host_store=host_store)


def passed_through(model, support):
    """``model`` unchanged, marked so the Stats node and the run line say why nothing was offloaded."""
    log.info("[layerwise-offload] %s%s", support.reason, f" ({support.hint})" if support.hint else "")
    clone = model.clone()
    clone.attachments[PASSTHROUGH_ATTACHMENT] = support
    key = PASSTHROUGH_ATTACHMENT
    clone.remove_callbacks_with_key(comfy.patcher_extension.CallbacksMP.ON_CLEANUP, key)
    clone.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_CLEANUP, key,
                                lambda patcher: log.info("[layerwise-offload] run: %s", support.reason))
    return clone


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class OffloadController:
    """One node output's offload of a loaded model: its request, the plan resolved from it for each run (capped by
    ComfyUI's VRAM budget), applied to the model's shared manager at ComfyUI's load, unload and every forward."""

    def __init__(self, base_model: nn.Module, discovered: DiscoveredBlocks, device: torch.device,
                 request: OffloadRequest):
        self.base_model = base_model  # ComfyUI's BaseModel: holds ``diffusion_model``
        self.diffusion_model = base_model.diffusion_model
        self.discovered = discovered
        self.device = torch.device(device)
        self.request = request
        self.planner = RunPlanner(base_model, discovered, request)
        self.run_plan: Optional[OffloadConfig] = None  # the plan the planner resolved at this run's first step
        self._auto_planned_this_run = False
        self.last_report = None  # the last run's RunReport (run_report.py)
        self.last_recommendation: Optional[str] = None
        # Highest resident count ComfyUI's VRAM budget allows now (None: no limit), set when ComfyUI
        # loads the model with a budget or asks for memory back.
        self.resident_cap: Optional[int] = None
        self.loaded_by: Optional[int] = None  # id() of the patcher ComfyUI loaded this model through
        self._use_manager_on(self.device)
        self.block_keys = tuple(DIFFUSION_MODEL_PREFIX + p for p in discovered.prefixes)
        self._block_module_ids = {id(m) for block in discovered.blocks for m in block.modules()}
        self._run_start = None
        self.run_steps = 0  # the sampler's step count, from the first forward's schedule (note_steps)
        self._device_plan = {}  # block index -> the weights LoRA'd on the device (device_lora.py)
        self.device_lora_scratch = 0  # device bytes its math takes at most, beside the blocks (in model_size())

    # ----------------------------------------------------------------- plan
    # The Stats node (stats_view.py) reads the run's plan from the controller's planner.
    @property
    def auto(self) -> bool:
        return self.request.auto_residents

    @property
    def num_blocks(self) -> int:
        return len(self.discovered.blocks)

    def _uncapped_plan(self) -> OffloadConfig:
        return self.run_plan or self.request.plan()

    def plan(self) -> OffloadConfig:
        """This output's plan now: this run's (the request's before the first step), within ComfyUI's budget."""
        return self._uncapped_plan().capped(self.resident_cap, self.num_blocks)

    def non_block_bytes(self) -> int:
        return sum(weight_nbytes(t) for t in self._non_block_tensors())

    def _planned_block_bytes(self, resident_count: int) -> int:
        """Device bytes of this output's plan with ``resident_count`` residents (the manager untouched)."""
        plan = dataclasses.replace(self._uncapped_plan(), resident_layers=resident_count)
        return self.manager.device_bytes(plan)

    def planned_footprint(self) -> int:
        """What ComfyUI is told this model needs on the device (``model_size()``)."""
        return self.non_block_bytes() + self.manager.device_bytes(self.plan()) + self.device_lora_scratch

    def host_ram_bytes(self) -> int:
        """Host RAM the model holds: every block once (packed or not yet) and the non-block weights on the host."""
        host = sum(t.nelement() * t.element_size() for t in self._non_block_tensors() if t.device.type == "cpu")
        return host + self.manager.stats(synchronize=False).host_ram_bytes

    def loaded_bytes(self) -> int:
        """What this model holds on the device: its non-block weights there, and the manager's buffers. ComfyUI is
        told it after every forward: the non-block part (a walk over every module) is counted once and kept until
        the non-block weights move (:meth:`put_non_block_weights`, at ComfyUI's load and unload) or a run starts."""
        if self._non_block_device_bytes is None:
            self._non_block_device_bytes = sum(weight_nbytes(t) for t in self._non_block_tensors()
                                               if t.device == self.device)
        return self._non_block_device_bytes + self.manager.device_bytes()

    def _non_block_modules(self):
        for module in self.base_model.modules():
            if id(module) not in self._block_module_ids:
                yield module

    def _non_block_tensors(self):
        for module in self._non_block_modules():
            for tensor in list(module._parameters.values()) + list(module._buffers.values()):
                if tensor is not None:
                    yield tensor

    # ----------------------------------------------------------------- load / unload
    def place(self, patcher, device_to, extra_memory=None, loaded_before: int = 0, bake_all: bool = False) -> None:
        """ComfyUI's load: non-block weights to the device (LoRA baked), blocks into the host store.

        Block LoRA is applied on the device after each copy (device_lora.py), except for the weights
        that must be baked into the store, or all of them with ``bake_all`` (ComfyUI's force_patch_weights).
        Only the weights ComfyUI's own load would patch are patched, and modules cast as it would cast them
        (load_decisions.py). ``extra_memory`` is ComfyUI's budget for more weights on the device (what its
        partial loading would use); the resident count is capped so the plan stays inside it.
        """
        self.follow_device(device_to)
        self._hold_the_parameters()
        decisions = comfyui_load_decisions(patcher)
        apply_cast_decisions(patcher, decisions, device_to)
        self.put_non_block_weights(patcher, device_to, decisions)
        plan = {} if bake_all else device_patch_plan(patcher, self.discovered.blocks, self.block_keys, decisions)
        self.device_lora_scratch = _LORA_SCRATCH[self.manager] = scratch_bytes(self.discovered.blocks, plan)
        self._fit_budget(extra_memory, loaded_before)
        self.manager.apply(self.plan())
        bake_block_patches(patcher, device_to, decisions, self.block_keys, self.manager,
                           skip={key for p in plan.values() for _, key, _ in p})
        changed = self.manager.prepare(progress=packing_progress_bar())
        if changed:
            stats = self.manager.stats(synchronize=False)
            log.info("[layerwise-offload] host store: %d blocks packed (%s in RAM, %s pinned)", len(changed),
                     _gib(stats.host_bytes), _gib(stats.pinned_host_bytes))
        self._patch_on_device(patcher, device_to, plan)

    def _patch_on_device(self, patcher, device_to, plan) -> None:
        # The manager is shared by every output of this model: another output may have set its own LoRA.
        keys = tuple((index, tuple(key for _, key, _ in patches)) for index, patches in plan.items())
        signature = (patcher.patches_uuid, str(device_to), keys)
        if plan and getattr(self.manager.after_copy, "signature", None) != signature:
            self.manager.after_copy = DeviceLora(plan, device_to, signature)
            log.info("[layerwise-offload] LoRA over %d block weights applied on the device as blocks are copied in",
                     sum(len(p) for p in plan.values()))
        elif not plan:
            self.manager.after_copy = None
        self._device_plan = plan
        point_backups_at_store(patcher, plan, self.manager)

    def put_non_block_weights(self, patcher, device_to, decisions=None) -> None:
        """The non-block weights to ``device_to``; on the compute device with the patches ComfyUI's load applies."""
        self._non_block_device_bytes = None  # counted again by the next loaded_bytes()
        device_to = normalize_device(torch.device(device_to))
        prefix_of = {id(m): name for name, m in self.base_model.named_modules()}
        for module in self._non_block_modules():
            name = prefix_of.get(id(module), "")
            if device_to == self.device:
                decisions = decisions or comfyui_load_decisions(patcher)
                for param_name in list(module._parameters):
                    key = f"{name}.{param_name}" if name else param_name
                    if decisions.patches(patcher, key) and key not in patcher.backup:
                        patcher.patch_weight_to_device(key, device_to)
            for param in module._parameters.values():
                if param is not None and param.device != device_to:
                    point_param_at(param, param.data.to(device_to))  # keeps a quantized subclass whole
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device_to:
                    module._buffers[key] = buffer.to(device_to)

    def _fit_budget(self, extra_memory, loaded_before: int = 0) -> None:
        if extra_memory is None or extra_memory >= 1e30:  # ComfyUI's "no limit" (CPU, high VRAM)
            self.resident_cap = None
            return
        # ComfyUI allows this model what it had loaded plus extra_memory; the non-block weights just
        # placed take their share first.
        budget = int(loaded_before) + int(extra_memory) - self.non_block_bytes() - self.device_lora_scratch
        wanted = self.num_blocks  # auto plans at the first forward; the budget still caps it
        if not self.auto:
            wanted = self.request.plan().resident_count(self.num_blocks)
        count = largest_fitting(lambda c: self._planned_block_bytes(c) <= budget, wanted)
        if count < wanted and not self.auto:
            log.info("[layerwise-offload] ComfyUI's VRAM budget (%s) fits %d of the %d resident blocks asked for",
                     _gib(budget), count, wanted)
        self.resident_cap = count if count < wanted else None

    def release_device_memory(self) -> None:
        self.manager.release_all(remove_hooks=True)  # the hooks are installed again by the next load's first forward

    def free_device_memory(self, nbytes: int) -> int:
        """ComfyUI asks for ``nbytes`` back: demote residents until the plan is that much smaller and free their
        memory now. The residents that stay keep their buffers (the smaller plan arms over them at the next forward,
        copying nothing again); the slot ring goes only where its geometry changes (manager.apply)."""
        held = self.manager.device_bytes()
        count = largest_fitting(lambda c: held - self._planned_block_bytes(c) >= nbytes,
                                self.plan().resident_count(self.num_blocks))
        self.resident_cap = count
        self.manager.apply(self.plan())
        if held - self.manager.device_bytes() < nbytes:  # the manager held another output's plan: what was asked
            self.manager.release_all()  # for comes back now all the same
        freed = held - self.manager.device_bytes()
        if freed:
            log.info("[layerwise-offload] ComfyUI asked for %s of VRAM: released %s; %d blocks stay resident "
                     "from the next step on", _gib(nbytes), _gib(freed), count)
        return freed

    # ----------------------------------------------------------------- sampling
    @contextmanager
    def forward(self, patcher, x: Optional[torch.Tensor] = None):
        self._hold_the_parameters()
        if self.request.plans_each_run and not self._auto_planned_this_run and isinstance(x, torch.Tensor):
            # The LoRA this output applies on the device, if the shared manager applies it now.
            device_plan = self._device_plan if self.manager.after_copy is not None else {}
            self.run_plan = self.planner.plan_run(x, patcher, self.manager, self.device, self.resident_cap,
                                                  self.device_lora_scratch, device_plan)
            self._auto_planned_this_run = True
        self.manager.apply(self.plan())
        refusal = cuda_graph_refusal(patcher.model_options.get("torch_compile_kwargs") if patcher else None)
        if refusal is not None and self.plan().resident_count(self.num_blocks) < self.num_blocks:
            raise RuntimeError(refusal)
        # Allocate before ComfyUI runs the model: newer ComfyUI may record a forward's allocations (its
        # model compiler, malloc_graph), and our buffers outlive every forward.
        try:
            with self.manager.running():
                yield
        finally:
            self.base_model.model_loaded_weight_memory = self.loaded_bytes()

    def rebound(self, patcher) -> "OffloadController":
        """This output's offload for a clone that holds another model object (newer ComfyUI's
        ``clone(model_override=...)``, its multi-GPU copies): the same settings over that model's blocks."""
        diffusion_model = patcher.model.diffusion_model
        discovered = discover_blocks(diffusion_model)
        if self.discovered.streams_weights:
            discovered = as_weight_units(discovered)
        controller = OffloadController(patcher.model, discovered, patcher.load_device, self.request)
        log.info("[layerwise-offload] ComfyUI cloned the offloaded model with another model object; that clone "
                 "gets an offload of its own (%d blocks)", controller.num_blocks)
        return controller

    def follow_device(self, device) -> None:
        """ComfyUI loads this model onto another device than planned (a multi-GPU copy): manage it there."""
        device = normalize_device(torch.device(device))
        if device != self.device and device.type != "cpu":
            self._use_manager_on(device)

    def _hold_the_parameters(self) -> None:
        """Another output of this model streams it at the other granularity (weight units against blocks) and its
        manager holds the parameters now: that one is detached and this output gets a manager of its own again (one
        manager at a time may point the parameters anywhere; the new one packs its host store at its first run)."""
        if _MANAGERS.get(self.diffusion_model) is not self.manager:
            log.info("[layerwise-offload] this model was streamed by %s by another output: streaming it by %s again",
                     "blocks" if self.discovered.streams_weights else "weight units",
                     "weight units" if self.discovered.streams_weights else "blocks")
            self._use_manager_on(self.device)

    def _use_manager_on(self, device) -> None:
        """This model's manager for ``device`` (shared by every output of the model), with ComfyUI's pinning."""
        self.manager = shared_manager(self.diffusion_model, self.discovered, device, self._uncapped_plan())
        self.device = normalize_device(torch.device(device))  # with its index: tensors report cuda:0, never cuda
        self._non_block_device_bytes = None

    def begin_run(self, patcher) -> None:
        self._non_block_device_bytes = None  # once per run, whoever moved what since
        if self.manager.prepare():
            log.warning("[layerwise-offload] block weights were moved outside the manager; re-packed them")
            point_backups_at_store(patcher, self._device_plan, self.manager)
        self._auto_planned_this_run = False
        self.run_steps = 0
        self._run_start = (time.perf_counter(), self.manager.stats(synchronize=False, reset_peaks=True))

    def note_steps(self, transformer_options) -> None:
        """The run's step count for the stats' "per step", from the sigmas ComfyUI's sampler hands the model."""
        sigmas = (transformer_options or {}).get("sample_sigmas")
        if sigmas is not None and not self.run_steps:
            self.run_steps = max(0, len(sigmas) - 1)

    def end_run(self, patcher) -> Optional[str]:
        if self._run_start is None:
            return None
        started, before = self._run_start
        self._run_start = None
        if self.manager.after_copy is not None and self.device.type == "cpu":
            # CPU loopback: the device-side LoRA's scratch tensors were host memory; glibc keeps them otherwise.
            return_freed_host_memory()
        after = self.manager.stats()
        forwards = after.forwards - before.forwards
        if forwards == 0:
            return None
        report = run_report(self, before, after, forwards, time.perf_counter() - started)
        self.last_report = report
        self.last_recommendation = recommend(report, [n for n, tier in zip(after.block_nbytes, after.block_tiers)
                                                      if tier == "resident"])
        line = f"[layerwise-offload] run: {report.figures()}; {self.last_recommendation}"
        log.info(line)
        return line
