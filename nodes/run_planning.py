"""Each run's plan, chosen at its first forward where the latent is known: auto's resident count (or streamed tails),
residency_policy auto's policy and prefetch depth, residency_policy weights' weight units.

The planner keeps what carries over from run to run: the last choice and plan (logged only when they change; the
Stats node shows the plan) and auto's hysteresis, which keeps the plan the manager holds when a new run's would
barely differ. It resolves a plan from the request and the run's facts; the controller has the manager apply it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional

import torch
from torch import nn

import comfy.model_management

from ..offload import (LayerwiseOffloadManager, OffloadConfig, OffloadRequest, available_host_bytes, block_parameters,
                       block_width, describe, format_bytes, forward_activation_bytes, plan_residency,
                       plan_streamed_tails, plan_weight_units, streamed_tails_plan, timing_for)
from .advice import activation_words
from .discovery import DiscoveredBlocks

log = logging.getLogger("layerwise_offload")

# Auto keeps the resident count it holds when a new run's plan would add this many blocks or fewer (and the held
# count still fits); shrinking to fit always happens. See RunPlanner._held_if_close.
AUTO_GROW_HYSTERESIS = 1


class RunPlanner:
    def __init__(self, base_model: nn.Module, discovered: DiscoveredBlocks, request: OffloadRequest):
        self.base_model = base_model  # its dtype is read at each plan: ComfyUI may set a manual cast at load
        self.discovered = discovered
        self.request = request
        self.model_class = type(base_model.diffusion_model).__name__
        self.last_choice = None
        self.last_plan = None
        self.last_activations = None
        self._last_close_plan = None  # the count auto last declined to grow to (logged once)

    def plan_run(self, x: torch.Tensor, patcher, manager: LayerwiseOffloadManager, resident_cap: Optional[int],
                 device_lora_scratch: int, device_plan) -> OffloadConfig:
        """At a run's first forward, where the latent is known: auto's resident count (as many blocks as fit in what
        ComfyUI says is free on the device now, next to this latent's activations, offload/activation_model.py, and
        ComfyUI's reserve) and, with residency_policy auto, the policy and prefetch depth the timing model predicts
        fastest on this card (offload/timing/; leading with the node's prefetch_size where no card is
        known, as on the CPU loopback).

        ``resident_cap`` is what ComfyUI's budget allows (None: no limit), ``device_lora_scratch`` and
        ``device_plan`` the device LoRA's (device_lora.py). Returns this run's plan (the budget still caps it)."""
        request = self.request
        asked = request.plan()
        device = manager.device
        held = manager.device_bytes()  # ours already: a new plan may reuse it
        # Newer ComfyUI asks the patcher (it adds what dynamic-VRAM models could give back).
        ask = getattr(patcher, "get_free_memory", None)
        free = int(ask(device) if callable(ask) else comfy.model_management.get_free_memory(device))
        if device.type == "cpu":
            # The CPU loopback's "VRAM" is RAM: plan as a GPU with that much memory would, from what this
            # process may still use (its memory cgroup included), which ComfyUI's host-wide figure does not see.
            # The host store replaces ComfyUI's copy block by block, so what is free now is free after packing.
            host = available_host_bytes()
            free = free if host is None else min(free, host)
        free += held
        reserve = int(comfy.model_management.minimum_inference_memory())
        activations = forward_activation_bytes(
            self.model_class, self._hidden_size(), max(1, x[0, 0].numel()),
            batch=max(1, x.shape[0]), dtype_bytes=self._compute_dtype_bytes(x), latent_channels=x.shape[1])
        activation_bytes = activations.nbytes + device_lora_scratch
        sizes = manager.block_nbytes()
        timing = timing_for(device) if request.auto_policy else None
        settings = ([(policy, prefetch) for policy, prefetch in timing.settings if prefetch >= request.prefetch_size]
                    if timing is not None else [(asked.policy, asked.prefetch_size)])

        def plan_for(policy: str, prefetch: int, max_resident: Optional[int] = None):
            return plan_residency(sizes, free, reserve_bytes=reserve, activation_bytes=activation_bytes,
                                  prefetch_size=prefetch, policy=policy, max_resident=max_resident)
        plans = {setting: plan_for(*setting) for setting in settings}
        if self.discovered.streams_weights:
            units = plan_weight_units(sizes, manager.tail_options(), free, reserve_bytes=reserve,
                                      activation_bytes=activation_bytes, prefetch_size=asked.prefetch_size)
            return self._plan_weight_units(units, plans[settings[0]], sizes, activations, x)
        if request.auto_residents:
            candidates = [(policy, prefetch, plan.resident_count) for (policy, prefetch), plan in plans.items()
                          if plan.fits]
            if timing is not None and not all(plan.resident_count == len(sizes) for plan in plans.values()):
                # Streamed tails, where the timing model can weigh them against whole blocks: every block keeps its
                # head and streams a tail, the fewest bytes per step this budget allows.
                options = manager.tail_options()
                for prefetch in sorted({prefetch for _, prefetch in settings}):
                    plan = plan_streamed_tails(sizes, options, free, reserve_bytes=reserve,
                                               activation_bytes=activation_bytes, prefetch_size=prefetch)
                    if plan is not None:
                        plans[("tails", prefetch)] = plan
                        candidates.append(("leading", prefetch, 0, plan.tails))
        else:
            count = asked.capped(resident_cap, len(sizes)).resident_count(len(sizes))
            budget = free - reserve - activation_bytes
            candidates = [(policy, prefetch, count) for policy, prefetch in settings
                          if manager.planned_device_bytes(dataclasses.replace(
                              asked, resident_layers=count, policy=policy, prefetch_size=prefetch)) <= budget]
        first = settings[0]
        chosen = (first[0], first[1], plans[first].resident_count if request.auto_residents else None)
        if timing is not None and len(candidates) > 1:
            choice = timing.choose(candidates, self.discovered.blocks, sizes, activations.tokens, x.shape[0],
                                   self._compute_dtype_bytes(x), self._device_lora_weights(manager, device_plan))
            chosen = (choice.policy, choice.prefetch, choice.resident_count, choice.tails)
            if chosen != self.last_choice:
                what = (f"tails streamed ({format_bytes(sum(choice.tails))} a step)" if choice.tails
                        else f"{choice.policy}, {choice.resident_count} resident")
                log.info("[layerwise-offload] %s: %s, prefetch %d predicted %.2fx the bound "
                         "(max(compute, streamed bytes / H2D)) on %s", "auto" if request.auto_residents else "residency_policy auto",
                         what, choice.prefetch, choice.prediction.ratio, timing.name)
        elif len(candidates) == 1:
            chosen = candidates[0]
        self.last_choice = chosen
        policy, prefetch, count, *tails = chosen
        changes = dict(policy=policy, prefetch_size=prefetch)
        if request.auto_residents:
            plan = plans[("tails", prefetch)] if tails and tails[0] else plans[(policy, prefetch)]
            plan = self._held_if_close(manager, plan, plan_for)
            if plan != self.last_plan:
                log.info("%s; activations %s (%s, %d tokens x %d)", describe(plan), format_bytes(activations.nbytes),
                         activation_words(activations.source), activations.tokens, x.shape[0])
            self.last_plan = plan
            changes["resident_layers"] = plan.resident_count
            changes["streamed_tail_bytes"] = plan.tails or 0
        self.last_activations = activations
        return dataclasses.replace(asked, **changes)

    def _plan_weight_units(self, plan, whole_blocks, sizes, activations, x) -> OffloadConfig:
        """residency_policy weights: ``plan``, the plan over weight units that streams the fewest bytes in what is
        free (``plan_weight_units``) at the node's prefetch depth; where none fits (None), every unit streamed
        (``whole_blocks``, which then says by how much it is short, as auto's plan does)."""
        if plan is None:
            plan = whole_blocks
        if plan != self.last_plan:
            streamed = [tail for tail, keep in zip(plan.tails or sizes, plan.resident) if not keep]
            log.info("[layerwise-offload] weights plan: %d of %d weight units stream (%s a step, at most %s a unit), "
                     "%s in VRAM, slots %s, %s; activations %s (%s, %d tokens x %d)",
                     sum(1 for t in streamed if t), len(sizes), format_bytes(plan.streamed_bytes),
                     format_bytes(max(streamed, default=0)),
                     format_bytes(plan.resident_bytes + plan.head_bytes), format_bytes(plan.slot_bytes),
                     f"headroom {format_bytes(plan.headroom_bytes)}" if plan.fits
                     else f"does not fit: short by {format_bytes(-plan.headroom_bytes)}",
                     format_bytes(activations.nbytes), activation_words(activations.source), activations.tokens,
                     x.shape[0])
        self.last_plan = plan
        self.last_choice = ("leading", self.request.prefetch_size, plan.resident_count, plan.tails)
        self.last_activations = activations
        return dataclasses.replace(self.request.plan(), resident_layers=plan.resident_count,
                                   streamed_tail_bytes=plan.tails or 0)

    def _held_if_close(self, manager: LayerwiseOffloadManager, plan, plan_for):
        """Auto's hysteresis: the plan the manager holds now when the new one would only add
        :data:`AUTO_GROW_HYSTERESIS` blocks (or fewer) and the held one still fits; else the new plan.

        What free memory ComfyUI reports wobbles between runs by about a block, and each run's first forward
        replans: without this a count moving by one would copy (or free and copy back) a block at every run's first
        step, seconds on a GPU. A plan that grows by more moves, and one that no longer fits always shrinks (the new
        count is the largest that fits, so a smaller one means the held count does not)."""
        if plan.tails:
            return self._held_tails_if_close(manager, plan)
        held = manager.resident_count()
        if (manager.device_bytes() == 0 or (manager.config.policy, manager.config.prefetch_size)
                != (plan.policy, plan.prefetch_size) or not held < plan.resident_count <= held + AUTO_GROW_HYSTERESIS):
            return plan
        kept = plan_for(plan.policy, plan.prefetch_size, max_resident=held)
        if kept.resident_count != held or not kept.fits:
            return plan
        if plan.resident_count != self._last_close_plan:
            log.info("[layerwise-offload] auto: keeping %d resident blocks (%d would fit: a change of %d block%s is "
                     "not worth a replan)", held, plan.resident_count, plan.resident_count - held,
                     "" if plan.resident_count - held == 1 else "s")
        self._last_close_plan = plan.resident_count
        return kept

    def _held_tails_if_close(self, manager: LayerwiseOffloadManager, plan):
        """The hysteresis for streamed tails: the tails the manager holds when they still fit and stream at most one
        block's bytes more than the new plan's (the heads that would move are worth more than that)."""
        held = manager.config.streamed_tail_bytes
        if (manager.device_bytes() == 0 or not isinstance(held, tuple) or manager.config.resident_layers != 0
                or manager.config.prefetch_size != plan.prefetch_size):
            return plan
        sizes = manager.block_nbytes()
        kept = streamed_tails_plan(sizes, manager.block_tails(), plan.free_bytes, reserve_bytes=plan.reserve_bytes,
                                   activation_bytes=plan.activation_bytes, non_block_bytes=plan.non_block_bytes,
                                   prefetch_size=plan.prefetch_size)
        if not kept.fits or kept.streamed_bytes - plan.streamed_bytes > max(sizes):
            return plan
        if kept.tails != plan.tails and kept.tails != self._last_close_plan:
            log.info("[layerwise-offload] auto: keeping the streamed tails held (%s a step; %s would fit: not worth "
                     "moving heads)", format_bytes(kept.streamed_bytes), format_bytes(plan.streamed_bytes))
        self._last_close_plan = kept.tails
        return kept

    def _device_lora_weights(self, manager: LayerwiseOffloadManager, device_plan) -> Optional[List[int]]:
        """Per block, the weights the LoRA patches on the device as each copy lands (None: no LoRA there)."""
        if not device_plan or manager.after_copy is None:
            return None
        counts = []
        for index, block in enumerate(self.discovered.blocks):
            params = [param for _, param in block_parameters(block)] if index in device_plan else []
            counts.append(sum(params[position].numel() for position, _, _ in device_plan.get(index, ())))
        return counts

    def _compute_dtype_bytes(self, x: torch.Tensor) -> int:
        """The model computes in its own dtype (the latent arrives in float32 and is cast); fp8 weights
        compute in at least 16 bits."""
        get_dtype = getattr(self.base_model, "get_dtype", lambda: None)
        dtype = getattr(self.base_model, "manual_cast_dtype", None) or get_dtype()
        return max(2, dtype.itemsize) if isinstance(dtype, torch.dtype) else x.element_size()

    def _hidden_size(self) -> int:
        return block_width(self.discovered.whole_blocks[0])
