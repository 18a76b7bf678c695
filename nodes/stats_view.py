"""What the Stats node shows: a few short lines of text, and the same run as data the frontend draws as a picture
(web/js/stats.js): the block map in call order, VRAM against the card, RAM held, copy against compute per step.

The data is one JSON-able dict (``UI_KEY`` in the node's UI output). Its ``state`` says which of these it is:
``run`` (a finished sampling run), ``no_run`` (offloaded, nothing sampled yet), ``passed_through`` (the device has
nothing to offload), ``not_offloaded`` (the MODEL does not come from a Layerwise Offload node).
"""

from __future__ import annotations

from typing import Optional, Tuple

import comfy.model_management

from ..offload import format_bytes, format_seconds
from .advice import TIER_WORDS, activation_words, tiers_by_block

UI_KEY = "layerwise_offload"
PASSTHROUGH_ATTACHMENT = "layerwise_offload_passed_through"
ATTACHMENT = "layerwise_offload"  # LayerwiseOffloadPatcherMixin.ATTACHMENT, without importing the patcher here

CONNECT_AFTER = "connect the sampler's LATENT output to `after`, then queue the prompt"
NOT_OFFLOADED = "This MODEL does not come from a Layerwise Offload node: connect that node's MODEL output to `model`."


def _total_ram() -> int:
    import psutil
    return int(psutil.virtual_memory().total)


def _card_bytes(device) -> int:
    try:
        return int(comfy.model_management.get_total_memory(device))
    except Exception:  # noqa: BLE001 - a device ComfyUI cannot size: draw the bar without a total
        return 0


def auto_plan_line(controller) -> Optional[str]:
    planner = getattr(controller, "planner", None)
    plan = getattr(planner, "last_plan", None)
    if plan is None:
        return None
    activations = planner.last_activations
    act = (f" (with {format_bytes(activations.nbytes)} of {activation_words(activations.source)} activations)"
           if activations is not None else "")
    free = format_bytes(plan.free_bytes)
    discovered = getattr(controller, "discovered", None)
    if discovered is not None and discovered.streams_weights:
        if not plan.fits:
            return f"weights: VRAM is short by {format_bytes(-plan.headroom_bytes)} even with every layer streamed{act}"
        if plan.resident_count == plan.num_blocks:
            return f"weights: every layer fits in the {free} free{act}"
        return (f"weights: {plan.num_blocks} layers of {len(discovered.whole_blocks)} blocks, "
                f"{format_bytes(plan.streamed_bytes)} streamed a step (a layer's weights, or only its bias), the rest "
                f"in the {free} free{act}")
    if not plan.fits:
        return f"auto: VRAM is short by {format_bytes(-plan.headroom_bytes)} even with every block streamed{act}"
    if plan.resident_count == plan.num_blocks:
        return f"auto: every block fits in the {free} free{act}"
    if plan.tails:
        return (f"auto: every block's head stays in the {free} free ({format_bytes(plan.head_bytes)}); each streams "
                f"its tail, {format_bytes(plan.streamed_bytes)} a step{act}")
    return f"auto: {plan.resident_count} blocks fit in the {free} free{act}"


def host_store_line(controller) -> Optional[str]:
    """Where the blocks' host copies went and why (the packing's plan: RAM short, the disk fast enough or too slow,
    with its read rate), where that was a choice; None where every block simply fit in RAM."""
    manager = getattr(controller, "manager", None)
    stats = manager.stats(synchronize=False) if manager is not None else None
    if stats is None or not stats.host_tier_reason:
        return None
    return f"host store: {stats.disk_blocks} of {stats.num_blocks} blocks on disk ({stats.host_tier_reason})"


def _block_letters(report, controller) -> str:
    """The map's letters, one per transformer block (weight units folded into their blocks)."""
    letters = report.block_tiers or "R" * report.resident_blocks + "S" * report.streamed_blocks
    discovered = getattr(controller, "discovered", None)
    if discovered is not None and discovered.block_of and len(letters) == len(discovered.block_of):
        return tiers_by_block(letters, discovered.block_of, len(discovered.whole_blocks))
    return letters


def _picture(report, controller) -> dict:
    card = _card_bytes(controller.device)
    ram_total = _total_ram()
    loopback = report.device_type == "cpu"
    unit = report.step_word
    return {
        "blocks": _block_letters(report, controller),
        "tiers": TIER_WORDS,
        "vram": {"label": "VRAM (RAM here)" if loopback else "VRAM",
                 "blocks": report.peak_device_bytes, "other": report.other_device_bytes, "total": card,
                 "text": f"{format_bytes(report.device_memory_bytes)}"
                         + (f" of {format_bytes(card)}" if card else "")},
        "ram": {"held": report.host_ram_bytes or report.host_bytes, "pinned": report.pinned_host_bytes,
                "total": ram_total,
                "text": f"{format_bytes(report.host_ram_bytes or report.host_bytes)} of {format_bytes(ram_total)}"
                        + ("" if loopback else f", {format_bytes(report.pinned_host_bytes)} pinned")},
        "time": {"unit": unit, "compute": report.compute_per_step, "copy": report.copy_per_step,
                 "wait": report.wait_per_step, "overlap": report.asynchronous,
                 "text": f"per {unit}: compute {format_seconds(report.compute_per_step)}, copies "
                         + (f"{format_seconds(report.copy_per_step)}" if report.bytes_per_forward else "none")},
    }


def stats_view(model, after_connected: bool = True) -> Tuple[str, dict]:
    """The Stats node's text and picture data for ``model``."""
    attachments = getattr(model, "attachments", {}) or {}
    passed = attachments.get(PASSTHROUGH_ATTACHMENT)
    if passed is not None:
        lines = [passed.reason] + ([passed.hint] if passed.hint else [])
        return "\n".join(lines), {"state": "passed_through", "title": "passed through", "device": passed.device_type,
                                  "lines": lines}
    controller = attachments.get(ATTACHMENT)
    if controller is None:
        return NOT_OFFLOADED, {"state": "not_offloaded", "title": "not offloaded", "lines": [NOT_OFFLOADED]}
    report = controller.last_report
    if report is None:
        line = (f"No run yet: {CONNECT_AFTER}." if not after_connected else
                "No sampling run of this model finished before this node ran: feed the sampler from this "
                "Layerwise Offload node's MODEL.")
        return line, {"state": "no_run", "title": "no run yet", "after_connected": bool(after_connected),
                      "lines": [line]}
    plan = auto_plan_line(controller) if controller.auto else None
    # Under the picture: what its bars do not show (the memory line is the VRAM and RAM bars).
    tiers = host_store_line(controller)
    caption = [report.copy_line()] + ([plan] if plan else []) + ([tiers] if tiers else []) + report.notes()
    if controller.last_recommendation:
        caption.append(f"advice: {controller.last_recommendation}")
    if not after_connected:
        caption.append(f"(the previous run: {CONNECT_AFTER} to read this prompt's run)")
    memory = report.memory_line(_card_bytes(controller.device), _total_ram())
    lines = [report.headline(), caption[0], memory, *caption[1:]]
    data = {"state": "run", "title": report.headline(), "lines": lines, "caption": caption,
            **_picture(report, controller)}
    return "\n".join(lines), data
