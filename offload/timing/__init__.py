"""The timing model: which policy and prefetch depth residency_policy auto runs, from one step's timeline predicted
for each candidate plan on this card (:mod:`.step`, with the costs of :mod:`.costs`).

One entry point, :func:`timing_for`: the model for a device's card, or None where no card is known.
"""

from .choice import TIMING_GPU_ENV, CardTiming, PlanChoice, timing_for

__all__ = ["TIMING_GPU_ENV", "CardTiming", "PlanChoice", "timing_for"]
