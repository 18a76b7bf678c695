"""Each run's plan, at its first forward where the latent is known: ComfyUI's facts of the run gathered, the plan
resolved from them and the request (``offload/planning.py``), what changed logged. The controller has the manager
apply the plan; the Stats node shows the last one.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
from torch import nn

import comfy.model_management

from ..offload import (LayerwiseOffloadManager, OffloadConfig, OffloadRequest, available_host_bytes, block_parameters,
                       block_width, describe, format_bytes, forward_activation_bytes, timing_for)
from ..offload.planning import RunFacts, facts_of, plan_run
from .advice import activation_words
from .discovery import DiscoveredBlocks

log = logging.getLogger("layerwise_offload")

class RunPlanner:
    """Gathers a run's facts from ComfyUI at its first forward and plans it (``offload.planning.plan_run``); keeps
    what carries over from run to run: the last choice and plan, logged only when they change."""

    def __init__(self, base_model: nn.Module, discovered: DiscoveredBlocks, request: OffloadRequest):
        self.base_model = base_model  # its dtype is read at each plan: ComfyUI may set a manual cast at load
        self.discovered = discovered
        self.request = request
        self.model_class = type(base_model.diffusion_model).__name__
        self.last_choice = None
        self.last_plan = None
        self.last_activations = None
        self._last_declined = None  # what auto last declined to move to (logged once)

    def plan_run(self, x: torch.Tensor, patcher, manager: LayerwiseOffloadManager, device: torch.device,
                 resident_cap: Optional[int], device_lora_scratch: int, device_plan) -> OffloadConfig:
        """This run's plan, at its first forward where the latent is known: what ComfyUI says is free on the device
        now (the CPU loopback's "VRAM" is RAM: also what this process may still use), ComfyUI's reserve, this
        latent's activations (offload/activation_model.py) and the card's timing model (offload/timing/; none on
        the plain CPU loopback). ``resident_cap``: what ComfyUI's budget allows (None: no limit);
        ``device_lora_scratch`` and ``device_plan``: the device LoRA's (device_lora.py)."""
        # Newer ComfyUI asks the patcher (it adds what dynamic-VRAM models could give back).
        ask = getattr(patcher, "get_free_memory", None)
        free = int(ask(device) if callable(ask) else comfy.model_management.get_free_memory(device))
        if device.type == "cpu":
            # Plan as a GPU with that much memory would, from what this process may still use (its memory cgroup
            # included), which ComfyUI's host-wide figure does not see. The host store replaces ComfyUI's copy
            # block by block, so what is free now is free after packing.
            host = available_host_bytes()
            free = free if host is None else min(free, host)
        dtype_bytes = self._compute_dtype_bytes(x)
        activations = forward_activation_bytes(
            self.model_class, self._hidden_size(), max(1, x[0, 0].numel()),
            batch=max(1, x.shape[0]), dtype_bytes=dtype_bytes, latent_channels=x.shape[1])
        facts = facts_of(
            manager, free, reserve_bytes=int(comfy.model_management.minimum_inference_memory()),
            activation_bytes=activations.nbytes + device_lora_scratch, resident_cap=resident_cap,
            timing=timing_for(device) if self.request.auto_policy else None, blocks=self.discovered.blocks,
            tokens=activations.tokens, batch=x.shape[0], dtype_bytes=dtype_bytes,
            lora_weights=self._device_lora_weights(device_plan))
        planned = plan_run(self.request, facts)
        self._log(planned, facts, activations, x.shape[0])
        self.last_choice = planned.choice
        if planned.residency is not None:
            self.last_plan = planned.residency
        self.last_activations = activations
        return planned.config

    def _log(self, planned, facts: RunFacts, activations, batch: int) -> None:
        """What changed since the last run's plan, in the log."""
        words = (f"activations {format_bytes(activations.nbytes)} ({activation_words(activations.source)}, "
                 f"{activations.tokens} tokens x {batch})")
        plan, choice = planned.residency, planned.prediction
        if choice is not None and planned.choice != self.last_choice:
            what = (f"tails streamed ({format_bytes(sum(choice.tails))} a step)" if choice.tails
                    else f"{choice.policy}, {choice.resident_count} resident")
            log.info("[layerwise-offload] %s: %s, prefetch %d predicted %.2fx the bound (max(compute, streamed bytes / "
                     "H2D)) on %s", "auto" if self.request.auto_residents else "residency_policy auto", what,
                     choice.prefetch, choice.prediction.ratio, facts.timing.name)
        declined = planned.declined
        if declined is not None and plan is not None:
            key = declined.tails or declined.resident_count
            if key != self._last_declined and (declined.tails != plan.tails or not declined.tails):
                if declined.tails:
                    log.info("[layerwise-offload] auto: keeping the streamed tails held (%s a step; %s would fit: not "
                             "worth moving heads)", format_bytes(plan.streamed_bytes),
                             format_bytes(declined.streamed_bytes))
                else:
                    grown = declined.resident_count - plan.resident_count
                    log.info("[layerwise-offload] auto: keeping %d resident blocks (%d would fit: a change of %d "
                             "block%s is not worth a replan)", plan.resident_count, declined.resident_count, grown,
                             "" if grown == 1 else "s")
            self._last_declined = key
        if plan is None or plan == self.last_plan:
            return
        if self.discovered.streams_weights:
            streamed = [tail for tail, keep in zip(plan.tails or facts.sizes, plan.resident) if not keep]
            log.info("[layerwise-offload] weights plan: %d of %d weight units stream (%s a step, at most %s a unit), "
                     "%s in VRAM, slots %s, %s; %s", sum(1 for t in streamed if t), len(facts.sizes),
                     format_bytes(plan.streamed_bytes), format_bytes(max(streamed, default=0)),
                     format_bytes(plan.resident_bytes + plan.head_bytes), format_bytes(plan.slot_bytes),
                     f"headroom {format_bytes(plan.headroom_bytes)}" if plan.fits
                     else f"does not fit: short by {format_bytes(-plan.headroom_bytes)}", words)
        else:
            log.info("%s; %s", describe(plan), words)

    def _device_lora_weights(self, device_plan) -> Optional[List[int]]:
        """Per block, the weights the LoRA patches on the device as each copy lands (None: no LoRA there)."""
        if not device_plan:
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
