"""A run's plan from the request and that run's facts: one function, :func:`plan_run`.

Auto's resident count is as many blocks as fit in what is free next to the latent's activations and the reserve;
with policy auto, the policy and prefetch depth (and, where they stream fewer bytes, streamed tails) are what the
timing model predicts fastest on the card; with granularity weights, the plan over weight units that streams the
fewest bytes. Auto keeps the plan the manager holds when the new one would barely differ (its hysteresis).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from torch import nn

from .config import OffloadConfig
from .planner import ResidencyPlan, plan_residency, plan_streamed_tails, plan_weight_units, streamed_tails_plan
from .request import WEIGHTS, OffloadRequest
from .schedule import choose_resident_blocks, footprint
from .timing.choice import CardTiming, PlanChoice

# Auto keeps the resident count it holds when a new run's plan would add this many blocks or fewer (and the held
# count still fits); shrinking to fit always happens.
AUTO_GROW_HYSTERESIS = 1


@dataclass(frozen=True)
class RunFacts:
    """What a run's first step knows. ``sizes``: each block's device bytes; ``tail_options``: the tails each can
    stream; ``free_bytes``: device memory free for the blocks, what the manager holds included; ``reserve_bytes``:
    what the host application keeps free; ``activation_bytes``: the latent's activations and any scratch beside the
    blocks; ``resident_cap``: the most residents the application's budget allows (None: no limit); ``timing``: the
    card's timing model (None: no card known), with what it weighs: the ``blocks``, ``tokens`` x ``batch``,
    ``dtype_bytes`` and ``lora_weights`` (per block, the weights a LoRA patches after each copy); ``held``: the
    plan the manager holds device memory for (None: none), and ``held_tails`` what its streamed blocks stream."""

    sizes: Sequence[int]
    tail_options: Sequence[tuple]
    free_bytes: int
    reserve_bytes: int
    activation_bytes: int
    resident_cap: Optional[int] = None
    timing: Optional[CardTiming] = None
    blocks: Sequence[nn.Module] = ()
    tokens: int = 1
    batch: int = 1
    dtype_bytes: int = 4
    lora_weights: Optional[Sequence[int]] = None
    held: Optional[OffloadConfig] = None
    held_tails: Optional[Sequence[int]] = None


def facts_of(manager, free_bytes: int, **facts) -> RunFacts:
    """A run's facts where ``manager`` (a :class:`~.manager.LayerwiseOffloadManager`) knows them: its blocks' sizes
    and tails, and the plan it holds device memory for, whose bytes count as free (``free_bytes``: what is free
    beside them); ``facts``: the rest of :class:`RunFacts`."""
    held = manager.device_bytes()
    return RunFacts(sizes=manager.block_nbytes(), tail_options=manager.tail_options(), free_bytes=free_bytes + held,
                    held=manager.config if held else None, held_tails=manager.block_tails() if held else None,
                    **facts)


@dataclass(frozen=True)
class RunPlan:
    """``config``: the plan to apply; ``residency``: auto's (or weights') plan of what fits, with its figures (None
    where the count was asked for); ``choice``: (policy, prefetch, resident count, tails); ``prediction``: the timing
    model's choice where it weighed several; ``declined``: the new plan auto did not move to (hysteresis), or None."""

    config: OffloadConfig
    residency: Optional[ResidencyPlan]
    choice: Tuple
    prediction: Optional[PlanChoice] = None
    declined: Optional[ResidencyPlan] = None


def plan_run(request: OffloadRequest, facts: RunFacts) -> RunPlan:
    """The plan of one run under ``request`` with ``facts`` (see the module's docstring)."""
    asked = request.plan()
    sizes = list(facts.sizes)
    timing = facts.timing if request.auto_policy else None
    settings = ([(policy, prefetch) for policy, prefetch in timing.settings if prefetch >= request.prefetch_size]
                if timing is not None else [(asked.policy, asked.prefetch_size)])

    def plan_for(policy: str, prefetch: int, max_resident: Optional[int] = None) -> ResidencyPlan:
        return plan_residency(sizes, facts.free_bytes, reserve_bytes=facts.reserve_bytes,
                              activation_bytes=facts.activation_bytes, prefetch_size=prefetch, policy=policy,
                              max_resident=max_resident)
    plans = {setting: plan_for(*setting) for setting in settings}
    if request.granularity == WEIGHTS:
        # Where no plan over weight units fits, every unit streamed: that plan says by how much it is short.
        units = plan_weight_units(sizes, facts.tail_options, facts.free_bytes, reserve_bytes=facts.reserve_bytes,
                                  activation_bytes=facts.activation_bytes, prefetch_size=asked.prefetch_size)
        plan = units if units is not None else plans[settings[0]]
        config = dataclasses.replace(asked, resident_layers=plan.resident_count, streamed_tail_bytes=plan.tails or 0)
        return RunPlan(config, plan, ("leading", asked.prefetch_size, plan.resident_count, plan.tails))
    if request.auto_residents:
        candidates = [(policy, prefetch, plan.resident_count) for (policy, prefetch), plan in plans.items()
                      if plan.fits]
        if timing is not None and not all(plan.resident_count == len(sizes) for plan in plans.values()):
            # Streamed tails, where the timing model can weigh them against whole blocks: every block keeps its
            # head and streams a tail, the fewest bytes per step this budget allows.
            for prefetch in sorted({prefetch for _, prefetch in settings}):
                plan = plan_streamed_tails(sizes, facts.tail_options, facts.free_bytes,
                                           reserve_bytes=facts.reserve_bytes, activation_bytes=facts.activation_bytes,
                                           prefetch_size=prefetch)
                if plan is not None:
                    plans[("tails", prefetch)] = plan
                    candidates.append(("leading", prefetch, 0, plan.tails))
    else:
        count = asked.capped(facts.resident_cap, len(sizes)).resident_count(len(sizes))
        budget = facts.free_bytes - facts.reserve_bytes - facts.activation_bytes
        candidates = [(policy, prefetch, count) for policy, prefetch in settings
                      if footprint(sizes, choose_resident_blocks(len(sizes), count, policy), prefetch).total <= budget]
    first = settings[0]
    chosen = (first[0], first[1], plans[first].resident_count if request.auto_residents else None)
    prediction = None
    if timing is not None and len(candidates) > 1:
        prediction = timing.choose(candidates, facts.blocks, sizes, facts.tokens, facts.batch, facts.dtype_bytes,
                                   facts.lora_weights)
        chosen = (prediction.policy, prediction.prefetch, prediction.resident_count, prediction.tails)
    elif len(candidates) == 1:
        chosen = candidates[0]
    policy, prefetch, count, *tails = chosen
    config = dataclasses.replace(asked, policy=policy, prefetch_size=prefetch)
    if not request.auto_residents:
        return RunPlan(config, None, chosen, prediction)
    new = plans[("tails", prefetch)] if tails and tails[0] else plans[(policy, prefetch)]
    plan = _held_if_close(new, plan_for, facts)
    config = dataclasses.replace(config, resident_layers=plan.resident_count, streamed_tail_bytes=plan.tails or 0)
    return RunPlan(config, plan, chosen, prediction, declined=new if plan is not new else None)


def _held_if_close(plan: ResidencyPlan, plan_for, facts: RunFacts) -> ResidencyPlan:
    """The plan the manager holds when ``plan`` would only add :data:`AUTO_GROW_HYSTERESIS` blocks (or fewer) and the
    held one still fits; else ``plan``.

    What free memory the application reports wobbles between runs by about a block, and each run's first step
    replans: without this a count moving by one would copy (or free and copy back) a block at every run's first
    step. A plan that grows by more moves, and one that no longer fits always shrinks (the new count is the largest
    that fits, so a smaller one means the held count does not)."""
    held = facts.held
    if held is None:
        return plan
    if plan.tails:
        return _held_tails_if_close(plan, facts)
    count = held.resident_count(len(facts.sizes))
    if ((held.policy, held.prefetch_size) != (plan.policy, plan.prefetch_size)
            or not count < plan.resident_count <= count + AUTO_GROW_HYSTERESIS):
        return plan
    kept = plan_for(plan.policy, plan.prefetch_size, max_resident=count)
    return kept if kept.resident_count == count and kept.fits else plan


def _held_tails_if_close(plan: ResidencyPlan, facts: RunFacts) -> ResidencyPlan:
    """For streamed tails: the tails held when they still fit and stream at most one block's bytes more than
    ``plan``'s (the heads that would move are worth more than that)."""
    held = facts.held
    if (not isinstance(held.streamed_tail_bytes, tuple) or held.resident_layers != 0
            or held.prefetch_size != plan.prefetch_size or facts.held_tails is None):
        return plan
    kept = streamed_tails_plan(list(facts.sizes), list(facts.held_tails), plan.free_bytes,
                               reserve_bytes=plan.reserve_bytes, activation_bytes=plan.activation_bytes,
                               non_block_bytes=plan.non_block_bytes, prefetch_size=plan.prefetch_size)
    if not kept.fits or kept.streamed_bytes - plan.streamed_bytes > max(facts.sizes):
        return plan
    return kept


__all__ = ["AUTO_GROW_HYSTERESIS", "RunFacts", "RunPlan", "facts_of", "plan_run"]
