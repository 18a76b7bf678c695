"""Auto-sizing: the largest resident count whose device footprint fits a memory budget.

Pure arithmetic over byte counts; it touches no device. The caller measures what is free (e.g.
ComfyUI's ``get_free_memory``), passes the reserve it wants kept (ComfyUI's minimum inference
memory / ``--reserve-vram``), an activation estimate and whatever non-block weights still have to be
placed (embedders, final layer), and gets back a :class:`ResidencyPlan`.

What a plan holds on the device is its :func:`~.schedule.footprint`, the figure the manager reports once armed
(:meth:`LayerwiseOffloadManager.planned_device_bytes`): every resident block's own buffer, plus a ring of slots
sized to the largest streamed block. Both depend on which blocks are resident, and so on the
policy (``strided`` picks a different set than ``leading``), so the footprint is not monotonic in the
resident count: keeping one more block can shrink the slots (it was the largest streamed one, or the
slot count drops once fewer blocks stream than the window holds), and keeping every block removes
the slots altogether. The planner therefore evaluates every count and takes the largest that fits,
which also makes the chosen count monotonic in the free memory.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from .activation_model import find_line, line_bytes, tokens_for
from .config import POLICIES
from .formatting import format_bytes
from .schedule import Footprint, choose_resident_blocks, footprint, largest_fitting, tail_within

__all__ = ["ResidencyPlan", "plan_residency", "plan_streamed_tails", "streamed_tails_plan", "plan_weight_units",
           "ActivationEstimate", "forward_activation_bytes", "estimate_activation_bytes", "describe"]


@dataclass(frozen=True)
class ResidencyPlan:
    """One auto-sized residency plan; all sizes are device bytes.

    resident_count: blocks kept on the device (pass it as ``resident_layers``; 0 streams all).
    resident: per block (call order), whether it stays resident under ``policy``.
    footprint: what the plan holds on the device once armed (:func:`~.schedule.footprint`): residents, the streamed
        blocks' heads, the streaming slots; its parts read as the plan's own (``resident_bytes``, ``slot_bytes``...).
    required_bytes: the footprint + activations + reserve + non-block bytes.
    headroom_bytes: ``free - required`` (negative when the plan does not fit).
    fits: whether ``required <= free``; when False even streaming every block does not fit, and
        the plan is the resident_count=0 plan, reported so the caller can say by how much.
    tails: per block, the bytes it streams (its tail); (): whole blocks.
    """

    num_blocks: int
    resident_count: int
    resident: Tuple[bool, ...]
    footprint: Footprint
    activation_bytes: int
    reserve_bytes: int
    non_block_bytes: int
    free_bytes: int
    policy: str
    prefetch_size: int
    tails: Tuple[int, ...] = ()

    @property
    def streamed_count(self) -> int:
        return self.num_blocks - self.resident_count

    @property
    def resident_bytes(self) -> int:
        return self.footprint.resident_bytes

    @property
    def streamed_bytes(self) -> int:
        return self.footprint.streamed_bytes

    @property
    def head_bytes(self) -> int:
        return self.footprint.head_bytes

    @property
    def slot_count(self) -> int:
        return self.footprint.slot_count

    @property
    def slot_bytes(self) -> int:
        return self.footprint.slot_bytes

    @property
    def device_bytes(self) -> int:
        """What the manager itself will hold once armed (residents, heads and slots)."""
        return self.footprint.total

    @property
    def required_bytes(self) -> int:
        return self.footprint.total + self.activation_bytes + self.reserve_bytes + self.non_block_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.free_bytes - self.required_bytes

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.free_bytes


def _check_bytes(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer byte count, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    return int(value)


def plan_residency(block_bytes: Sequence[int], free_bytes: int, *, reserve_bytes: int = 0,
                   activation_bytes: int = 0, non_block_bytes: int = 0, prefetch_size: int = 1,
                   policy: str = "leading", max_resident: Optional[int] = None) -> ResidencyPlan:
    """Choose the largest resident count whose footprint fits in ``free_bytes`` (at most ``max_resident``).

    Args:
        block_bytes: device bytes of each block once materialized, in call order
            (``manager.block_nbytes()`` gives exactly the sizes the manager allocates).
        free_bytes: device memory free for this model now.
        reserve_bytes: memory to leave untouched (ComfyUI's reserve / minimum inference memory).
        activation_bytes: peak activation memory of one forward (see :func:`estimate_activation_bytes`).
        non_block_bytes: weights outside the blocks that still have to go on the device.
        prefetch_size: the manager's prefetch window (its slot ring holds ``prefetch_size + 1``).
        policy: ``leading`` or ``strided``, as in :class:`OffloadConfig`.
        max_resident: the most blocks to keep (None: all of them); a caller holding a plan asks whether it still
            fits this way (the footprint is not monotonic in the count).

    The fit condition is ``resident + slots + activations + reserve + non_block <= free``. When
    nothing fits, not even with every block streamed, the result has ``fits=False`` and
    ``resident_count=0``.
    """
    sizes = [_check_bytes(f"block_bytes[{i}]", s) for i, s in enumerate(block_bytes)]
    free_bytes = _check_bytes("free_bytes", free_bytes)
    reserve_bytes = _check_bytes("reserve_bytes", reserve_bytes)
    activation_bytes = _check_bytes("activation_bytes", activation_bytes)
    non_block_bytes = _check_bytes("non_block_bytes", non_block_bytes)
    if isinstance(prefetch_size, bool) or not isinstance(prefetch_size, numbers.Integral) or prefetch_size < 1:
        raise ValueError(f"prefetch_size must be an integer >= 1, got {prefetch_size!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")

    n = len(sizes)

    def plan_for(count: int) -> ResidencyPlan:
        resident = choose_resident_blocks(n, count, policy)
        return ResidencyPlan(
            num_blocks=n, resident_count=count, resident=resident, footprint=footprint(sizes, resident, prefetch_size),
            activation_bytes=activation_bytes, reserve_bytes=reserve_bytes, non_block_bytes=non_block_bytes,
            free_bytes=free_bytes, policy=policy, prefetch_size=int(prefetch_size))
    start = n if max_resident is None else max(0, min(n, int(max_resident)))
    return plan_for(largest_fitting(lambda count: plan_for(count).fits, start))


def plan_streamed_tails(block_bytes: Sequence[int], tail_options: Sequence[Sequence[int]], free_bytes: int, *,
                        reserve_bytes: int = 0, activation_bytes: int = 0, non_block_bytes: int = 0,
                        prefetch_size: int = 1, tries: int = 8) -> Optional[ResidencyPlan]:
    """A plan that streams every block's tail and as few bytes per step as fit ``free_bytes``; None when none of
    its kind fits, or none streams less than a whole block somewhere. ``tail_options``: per block, the sizes its
    tail can have (``manager.tail_options()``, ascending, the whole block last). Its ``tails`` go to the manager as
    ``streamed_tail_bytes``.

    The device holds every block's head, plus ``prefetch_size + 1`` slots of the largest tail ``M``. For each ``M``
    (from the smallest that can fit, ``tries`` of them), every block starts at its largest tail within ``M``; then,
    the blocks that could give the most first, each tail is lowered to its smallest option the room left beside
    that footprint still covers (what a tail gives up stays in its head). The plan that streams the fewest bytes
    wins. Spreading the streamed bytes over every block keeps the slots (paid ``prefetch_size + 1`` times) as small
    as the budget allows."""
    sizes = [_check_bytes(f"block_bytes[{i}]", s) for i, s in enumerate(block_bytes)]
    if len(tail_options) != len(sizes):
        raise ValueError(f"tail_options has {len(tail_options)} blocks, block_bytes {len(sizes)}")
    overhead = activation_bytes + reserve_bytes + non_block_bytes
    room = free_bytes - overhead
    n = len(sizes)
    streams_all = (False,) * n
    best = None
    left = tries
    for largest in sorted({t for options in tail_options for t in options}):
        tails = [tail_within(options, largest) for options in tail_options]
        excess = room - footprint(sizes, streams_all, prefetch_size, tails).total
        if excess < 0:
            continue
        for i in sorted(range(n), key=lambda i: tails[i] - tail_options[i][0], reverse=True):
            lower = next(t for t in tail_options[i] if tails[i] - t <= excess)
            excess -= tails[i] - lower
            tails[i] = lower
        plan = footprint(sizes, streams_all, prefetch_size, tails)
        if plan.total <= room and (best is None or plan.streamed_bytes < best[0].streamed_bytes):
            best = (plan, tails)
        left -= 1
        if left == 0:
            break
    if best is None or best[1] == sizes:
        return None
    return streamed_tails_plan(sizes, best[1], free_bytes, reserve_bytes=reserve_bytes,
                               activation_bytes=activation_bytes, non_block_bytes=non_block_bytes,
                               prefetch_size=prefetch_size)


def streamed_tails_plan(block_bytes: Sequence[int], tails: Sequence[int], free_bytes: int, *, reserve_bytes: int = 0,
                        activation_bytes: int = 0, non_block_bytes: int = 0, prefetch_size: int = 1,
                        resident_count: int = 0) -> ResidencyPlan:
    """The plan that keeps the first ``resident_count`` blocks resident and streams ``tails`` (per block, its tail's
    bytes) of every other block, and whether it fits."""
    n = len(block_bytes)
    resident = choose_resident_blocks(n, resident_count, "leading")
    return ResidencyPlan(
        num_blocks=n, resident_count=resident_count, resident=resident,
        footprint=footprint(block_bytes, resident, prefetch_size, tails), activation_bytes=activation_bytes,
        reserve_bytes=reserve_bytes, non_block_bytes=non_block_bytes, free_bytes=free_bytes, policy="leading",
        prefetch_size=int(prefetch_size), tails=tuple(tails))


def _trade_tails(tails: List[int], tail_options: Sequence[Sequence[int]], streamed: Iterable[int], bound: int,
                 excess: int) -> int:
    """Stream less where the tails cover the deficit by ``excess`` more than needed: lower ``a`` tails that step
    down by the same bytes ``d`` and raise ``b`` tails that step up by ``e``, for the largest gain
    ``a*d - b*e <= excess`` (a weight streams whole or not at all, so a single tail rarely fits the excess, while
    lowering one large weight and raising two smaller ones can). Repeats while something is gained; returns the
    excess left. ``tails`` changes in place."""
    streamed = list(streamed)
    while excess > 0:
        down: dict = {}
        up: dict = {}
        for i in streamed:
            options = tail_options[i]
            if tails[i] > options[0]:
                down.setdefault(tails[i] - options[0], []).append(i)
            high = tail_within(options, bound)
            if tails[i] < high:
                up.setdefault(high - tails[i], []).append(i)
        best = (0, None)
        for d, lowered in down.items():
            for e, raised in up.items():
                for a in range(1, min(len(lowered), 64) + 1):
                    b = max(0, -(-(a * d - excess) // e))
                    gain = a * d - b * e
                    if b <= len(raised) and 0 < gain <= excess and gain > best[0] and \
                            not set(lowered[:a]) & set(raised[:b]):
                        best = (gain, (lowered[:a], raised[:b]))
        if best[1] is None:
            return excess
        lowered, raised = best[1]
        for i in lowered:
            tails[i] = tail_options[i][0]
        for i in raised:
            tails[i] = tail_within(tail_options[i], bound)
        excess -= best[0]
    return excess


def plan_weight_units(unit_bytes: Sequence[int], tail_options: Sequence[Sequence[int]], free_bytes: int, *,
                      reserve_bytes: int = 0, activation_bytes: int = 0, non_block_bytes: int = 0,
                      prefetch_size: int = 1, tries: int = 64) -> Optional[ResidencyPlan]:
    """The plan that streams the fewest bytes per step over weight units (``offload/units.py``), where a streamed
    piece is one module's weights, not a block's: None when none fits.

    For a bound ``P`` on the largest streamed tail, a unit whose smallest tail is over ``P`` (a bias-free Linear
    larger than ``P``) cannot stream and stays resident: the units are expected with those first
    (:meth:`WeightUnits.residents_first`), so they are the leading ``resident_count``. Every other unit streams a
    tail of at most ``P`` (a Linear streams its bias, or its bias and weight); then, while the others still cover
    what the room lacks, the next units stay resident too, and the tails are lowered as in
    :func:`plan_streamed_tails` until they just cover it. Over the ``tries`` smallest bounds
    that fit, the plan that streams the fewest bytes wins. The slots cost two pieces of at most ``P``, not two
    blocks: with many units this streams little more than the deficit itself."""
    sizes = [_check_bytes(f"unit_bytes[{i}]", s) for i, s in enumerate(unit_bytes)]
    if len(tail_options) != len(sizes):
        raise ValueError(f"tail_options has {len(tail_options)} units, unit_bytes {len(sizes)}")
    room = free_bytes - activation_bytes - reserve_bytes - non_block_bytes
    n = len(sizes)
    if sum(sizes) <= room:  # everything resident: nothing streams
        return streamed_tails_plan(sizes, sizes, free_bytes, reserve_bytes=reserve_bytes,
                                   activation_bytes=activation_bytes, non_block_bytes=non_block_bytes,
                                   prefetch_size=prefetch_size, resident_count=n)
    best = None
    left = tries
    for bound in sorted({t for options in tail_options for t in options}):
        count = max((i + 1 for i, options in enumerate(tail_options) if options[0] > bound), default=0)
        if count == n:
            continue
        tails = list(sizes[:count]) + [tail_within(options, bound) for options in tail_options[count:]]
        start = footprint(sizes, choose_resident_blocks(n, count, "leading"), prefetch_size, tails)
        excess = room - start.total
        if excess < 0:
            continue
        # More of the leading units resident while the rest still covers the deficit: a unit that can stream only
        # whole (a bias-free Linear) would otherwise move every byte of it for nothing. The others are lowered to
        # their smallest tail instead (a bias), where a trade below can still raise them. The slot count stays
        # while more units stream than it.
        while n - count > start.slot_count and len(tail_options[count]) == 1 and tails[count] <= excess:
            excess -= tails[count]
            tails[count] = sizes[count]
            count += 1
        for i in sorted(range(count, n), key=lambda i: tails[i] - tail_options[i][0], reverse=True):
            lower = next(t for t in tail_options[i] if tails[i] - t <= excess)
            excess -= tails[i] - lower
            tails[i] = lower
        _trade_tails(tails, tail_options, range(count, n), bound, excess)
        plan = footprint(sizes, choose_resident_blocks(n, count, "leading"), prefetch_size, tails)
        if plan.total <= room and (best is None or plan.streamed_bytes < best[0].streamed_bytes):
            best = (plan, tails, count)
        left -= 1
        if left == 0:
            break
    if best is None:
        return None
    return streamed_tails_plan(sizes, best[1], free_bytes, reserve_bytes=reserve_bytes,
                               activation_bytes=activation_bytes, non_block_bytes=non_block_bytes,
                               prefetch_size=prefetch_size, resident_count=best[2])


@dataclass(frozen=True)
class ActivationEstimate:
    nbytes: int
    tokens: int
    source: str  # "measured <family>", "<family> scaled to width W", or "heuristic"


def forward_activation_bytes(model_class: str, block_width: int, latent_elements_per_channel: int,
                             batch: int = 1, dtype_bytes: int = 2,
                             latent_channels: Optional[int] = None) -> ActivationEstimate:
    """Peak activation bytes of one forward, from the measured table (``offload/activation_model.py``).

    ``latent_elements_per_channel`` is the latent's size per batch item and channel (``x[0, 0].numel()``),
    ``dtype_bytes`` the compute dtype's size, ``latent_channels`` ``x.shape[1]``. A class the table lacks
    gets :func:`estimate_activation_bytes` (a heuristic with a 2x2 patch), said so in ``source``.
    """
    for name, value in (("block_width", block_width), ("latent_elements_per_channel", latent_elements_per_channel),
                        ("batch", batch), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    found = find_line(model_class, block_width, latent_channels)
    if found is None:
        tokens = max(1, latent_elements_per_channel // 4)
        return ActivationEstimate(estimate_activation_bytes(tokens, block_width, dtype_bytes, batch), tokens,
                                  "heuristic")
    line, scale = found
    tokens = tokens_for(line, latent_elements_per_channel)
    source = f"measured {line.family}" if scale == 1.0 else f"{line.family} scaled to width {block_width}"
    return ActivationEstimate(line_bytes(line, tokens, batch, dtype_bytes, scale), tokens, source)


def estimate_activation_bytes(tokens: int, hidden: int, dtype_bytes: int = 2, batch: int = 1, *,
                              live_hidden_tensors: int = 6, mlp_ratio: float = 4.0,
                              attention_heads: int = 0, score_bytes: int = 4) -> int:
    """A rough peak-activation estimate for one DiT block forward. A heuristic, not a measurement: the
    fallback of :func:`forward_activation_bytes` for models the measured table does not cover.

    Per token and batch item it counts ``live_hidden_tensors`` hidden-sized tensors alive at once
    (residual stream, normed input, q, k, v, attention output) plus the MLP's intermediate
    (``mlp_ratio * hidden``). Fused attention (SDPA / flash / xformers) needs no score matrix, which
    is the default (``attention_heads=0``); pass the head count to also count a materialized
    ``heads x tokens x tokens`` score matrix and its softmax (``2 * score_bytes`` per entry), as in
    plain ``softmax(q @ k.T)`` attention. ``batch`` includes cond/uncond when they run batched.
    Leave margin on top: allocator fragmentation and framework workspaces are not counted.
    """
    for name, value in (("tokens", tokens), ("hidden", hidden), ("dtype_bytes", dtype_bytes), ("batch", batch),
                        ("live_hidden_tensors", live_hidden_tensors), ("attention_heads", attention_heads),
                        ("score_bytes", score_bytes)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not isinstance(mlp_ratio, numbers.Real) or mlp_ratio < 0:
        raise ValueError(f"mlp_ratio must be a number >= 0, got {mlp_ratio!r}")
    per_token = (live_hidden_tensors + mlp_ratio) * hidden * dtype_bytes
    total = batch * tokens * per_token
    if attention_heads:
        total += batch * attention_heads * tokens * tokens * 2 * score_bytes
    return int(total)


def describe(plan: ResidencyPlan) -> str:
    """One log line for a plan."""
    if plan.tails:
        line = (f"[layerwise-offload] auto plan: every block streams its tail ({format_bytes(plan.streamed_bytes)} a "
                f"step, at most {format_bytes(max(plan.tails))} a block), heads resident ({format_bytes(plan.head_bytes)}), "
                f"slots {format_bytes(plan.slot_bytes)}, ")
    else:
        line = (f"[layerwise-offload] auto plan: {plan.resident_count}/{plan.num_blocks} blocks resident "
                f"({format_bytes(plan.resident_bytes)}), {plan.streamed_count} streamed "
                f"({format_bytes(plan.streamed_bytes)}), slots {format_bytes(plan.slot_bytes)}, ")
    if plan.fits:
        return line + f"headroom {format_bytes(plan.headroom_bytes)}"
    return line + (f"does not fit: short by {format_bytes(-plan.headroom_bytes)} even with every block streamed "
                   f"(free {format_bytes(plan.free_bytes)}, reserve {format_bytes(plan.reserve_bytes)}, "
                   f"activations {format_bytes(plan.activation_bytes)}, "
                   f"non-block {format_bytes(plan.non_block_bytes)})")
