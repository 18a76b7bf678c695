"""The engine's copy ordering checked over the CUDA stand-in (tests/cuda_standin.py), for the unit tests to share.

:func:`run_checked` drives the real manager and the real :class:`StreamBackend` over the stand-in for a few forwards
of a :class:`ToyTransformer`, the host far ahead of the simulated GPU, everything under the stand-in's dispatch
mode: any read of a block's device memory before its copy (or its after-copy transform) is done, any copy into
memory a kernel may still read, any device memory freed under another stream and any host write under a copy in
flight raise :class:`CudaRuleBroken` where they happen. On top of CUDA's rules it checks what the engine promises
beyond them: the output is the model's own, bit for bit; no copy is issued into a block's memory while it runs; an
after-copy transform (a LoRA on the device) runs on the transform stream, and the copy stream never waits for it.

:func:`track_issuing_hook` records, for every copy, the hook that issued it (a block's pre- or post-hook) and
whether its source was page-locked; :func:`watch_disk_reads` makes the disk tier's reads into its staging ring
writes by a ``disk`` actor, so a copy from a chunk before its read finished, or a read over a copy in flight, is a
fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.device.backend import StreamBackend
from layerwise_offload.offload.units import weight_units
from layerwise_offload.tests.cuda_standin import CudaStandIn, byte_span, overlaps

__all__ = ["BLOCK_BYTES", "BLOCK_FLOPS", "Checked", "REGIMES", "backend_over", "halve_on_the_device", "new_cuda",
           "run_checked", "spans_of", "track_issuing_hook", "watch_disk_reads"]

BLOCK_BYTES = 21_600  # a ToyTransformer block (dim 32, hidden 64), about
BLOCK_FLOPS = 102_400  # its matmuls over 2 x 5 tokens
# Per block: copy 14 ms and compute 50 ms (compute-bound, a Wan-like block), or copy 13 and compute 4 (copy-bound).
# The host's calls cost 1 us each: a forward of the toy is queued long before the simulated GPU has run it, so the
# host learns that something finished only by waiting for it, never because it happened to be done.
# "host_bound": the device takes next to no time, so whatever the host asks about (an event's query) has finished:
# the paths taken when work is found done (a staging chunk free for a read ahead, a bounce ring retired).
REGIMES = {
    "compute_bound": dict(h2d_bytes_per_ms=BLOCK_BYTES / 14, flops_per_ms=BLOCK_FLOPS / 50),
    "copy_bound": dict(h2d_bytes_per_ms=BLOCK_BYTES / 13, flops_per_ms=BLOCK_FLOPS / 4),
    "host_bound": dict(h2d_bytes_per_ms=1e12, flops_per_ms=1e15, bytes_per_ms=1e15, d2d_bytes_per_ms=1e15),
}


def new_cuda(regime: str = "compute_bound", **overrides) -> CudaStandIn:
    """A stand-in in ``regime``, where a ``non_blocking`` copy from pageable memory tells the host only that its
    source was consumed (all CUDA promises), not that the copy is done: an ordering that leans on it is a race."""
    return CudaStandIn(**{**REGIMES[regime], "pageable_done_at_return": False, **overrides})


def backend_over(cuda: CudaStandIn, backend_class=StreamBackend, measure_time: bool = True):
    """``backend_class`` (the real StreamBackend, or a subclass a test broke on purpose) over the stand-in."""
    return backend_class(torch.device("cpu"), measure_time, module=cuda)


def spans_of(module) -> List[Tuple[int, int]]:
    """Each parameter's bytes (a block with a streamed tail reads two buffers: its head's and its slot's)."""
    return [byte_span(p) for p in module.parameters()]


def _overlaps_any(span, spans) -> bool:
    return any(overlaps(span, other) for other in spans)


@dataclass
class Checked:
    """What a checked run leaves: the manager and its backend, the stand-in (``cuda.uploads``: every copy to the
    device, ``cuda.waits``: every stream wait), the after-copy transforms (block, bytes written, stream) and, per
    copy, the hook that issued it (:func:`track_issuing_hook`)."""

    manager: LayerwiseOffloadManager
    cuda: CudaStandIn
    transforms: List[Tuple[int, Tuple[int, int], str]] = field(default_factory=list)
    issued: List[tuple] = field(default_factory=list)

    @property
    def backend(self):
        return self.manager.engine.backend


def halve_on_the_device(cuda: CudaStandIn, transforms: list):
    """An after-copy transform that halves a block's weights (exact in every dtype) in place on the device, as a
    LoRA applied on the device does, and logs (block, the bytes it wrote, its stream). Its kernels run first, so a
    transform queued where the stand-in sees a race fails as that race; then it must be on the transform stream."""
    def halve(index, weights):
        weights = [w for w in weights if w is not None]  # a head or a tail: the weights this copy wrote
        for weight in weights:
            weight.mul_(0.5)
        stream = cuda.current.name
        spans = [byte_span(w) for w in weights]
        transforms.append((index, (min(s[0] for s in spans), max(s[1] for s in spans)), stream))
        assert stream == "transform", f"block {index}'s after-copy transform ran on the {stream} stream"
    return halve


Before = Callable[[int, LayerwiseOffloadManager, Checked], None]  # before(forward number, manager, the record)


def _pinners(cuda: CudaStandIn):
    return {"pinned": cuda.pinner(), "pageable": None, "mixed": cuda.pinner(refuse_after=2)}


def run_checked(resident: int, prefetch: int, policy: str, order, pinning: str, backend_class=None,
                transform: bool = False, before: Optional[Before] = None,
                forwards: int = 3, tails: int = 0, units: bool = False, regime: str = "compute_bound") -> Checked:
    """``forwards`` forwards of a :class:`ToyTransformer` run in ``order`` (None: its own) under the stand-in, the
    manager streaming with these settings; ``pinning``: ``pinned``, ``pageable`` or ``mixed`` (the pinner refuses
    after two grants). ``backend_class``: a StreamBackend subclass. ``transform``: an after-copy transform halves
    every block's weights on the device as it is copied in (:func:`halve_on_the_device`). ``before(k, manager,
    checked)`` runs before forward ``k`` (a replan, say). ``units``: the manager streams the blocks' weight units
    (offload/units.py), not the blocks. Every check of the module's docstring is made; returns the run's record."""
    def streamed_modules(model):
        blocks = model.blocks_in_call_order()
        return list(weight_units(blocks).units) if units else blocks

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    reference = ToyTransformer()
    reference.order = order
    with torch.no_grad():
        if transform:
            for param in (p for block in streamed_modules(reference) for p in block.parameters()):
                param.mul_(0.5)
        want = reference(x)
    model = ToyTransformer()
    model.order = order
    cuda = new_cuda(regime)
    manager = LayerwiseOffloadManager(streamed_modules(model), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, policy=policy, pin_memory=pinning != "pageable",
                                      streamed_tail_bytes=tails,
                                      environment=HostEnvironment(pinner=_pinners(cuda)[pinning],
                                                                  available_host_bytes=lambda: 2**40),
                                      backend=backend_over(cuda, backend_class or StreamBackend))
    cuda.drive(manager)
    checked = Checked(manager, cuda)
    if transform:
        manager.after_copy = halve_on_the_device(cuda, checked.transforms)
    manager.attach(model)
    track_issuing_hook(checked)
    running = {}  # block -> (its parameters' bytes, copies queued when it started)

    def started(index):
        def hook(module, args):
            running[index] = (spans_of(module), len(cuda.uploads))
        return hook

    def ended(index):
        def hook(module, args, output):
            spans, uploads_at_start = running.pop(index)
            for upload in cuda.uploads[uploads_at_start:]:
                assert not _overlaps_any(upload.dst, spans), (
                    f"a copy was issued into block {index}'s memory while it ran")
        return hook

    for index, block in enumerate(streamed_modules(model)):
        block.register_forward_pre_hook(started(index))  # after the manager's: its parameters point at the device
        block.register_forward_hook(ended(index), prepend=True)  # before the manager's release
    outputs = []
    with cuda.running(), torch.no_grad():
        for k in range(forwards):
            if before is not None:
                before(k, manager, checked)
            outputs.append(model(x))
    assert all(torch.equal(out, want) for out in outputs)
    assert cuda.uploads and checked.issued
    # The next copy never queues behind a LoRA: the copy stream waits on the compute stream only.
    assert ("copy", "transform") not in cuda.waits, "the copy stream waits for an after-copy transform"
    assert not cuda.faults
    return checked


def track_issuing_hook(checked: Checked) -> None:
    """Record in ``checked.issued``, for every copy, (the block copied, ``pre`` | ``post``, the block whose hook
    issued it, whether its source was page-locked as the stand-in saw it). A copy's source is its block's host
    buffer (page-locked as the store says) or, for a resident, the page-locked bounce ring."""
    manager, cuda = checked.manager, checked.cuda
    backend = manager.engine.backend
    state = {"issuing": None, "copying": None}
    for name, phase in (("before_block", "pre"), ("after_block", "post")):
        def wrapped(index, original=getattr(manager.engine, name), phase=phase):
            state["issuing"] = (phase, index)
            try:
                return original(index)
            finally:
                state["issuing"] = None
        setattr(manager.engine, name, wrapped)
    original_copy, copy_in = backend.copy, manager.engine.copier.copy

    def copying(backend_, index, *args, **kwargs):
        state["copying"] = index
        return copy_in(backend_, index, *args, **kwargs)
    manager.engine.copier.copy = copying

    def copy(dst, src, after=None, then=None):
        pinned = cuda.is_pinned(src)
        block = next((i for i, b in enumerate(manager.store.buffers)
                      if b.data_ptr() <= src.data_ptr() < b.data_ptr() + b.numel()), None)
        if block is None:  # a resident's chunk, from the page-locked bounce ring (offload/device/resident_copy.py)
            bounce = [b.data_ptr() for b in manager.engine.copier.bounce.buffers]
            assert src.data_ptr() in bounce, "a copy from neither the store nor the bounce ring"
            assert pinned, "a copy from a bounce buffer that is not page-locked"
        else:
            assert block == state["copying"]
            assert pinned == manager.store.is_pinned(block), f"block {block}'s page-locking is not what the store says"
        checked.issued.append((state["copying"], *state["issuing"], pinned))
        return original_copy(dst, src, after, then)
    backend.copy = copy


def watch_disk_reads(cuda: CudaStandIn, tier, reads: Optional[list] = None) -> None:
    """Each read the disk tier starts into a staging chunk is a write of that chunk by the ``disk`` actor, over from
    the host's point of view once the host waited for it (the ring's ``_settle``). ``reads`` gets (block, chunk,
    the staging buffer's first byte) per read started."""
    start, settle = tier._start, tier._settle
    tokens = {}

    def _start(index, piece, staging):
        tokens[id(staging)] = cuda.begin_async_write(staging.buffer, "disk")
        if reads is not None:
            reads.append((index, piece, staging.buffer.data_ptr()))
        start(index, piece, staging)

    def _settle(staging):
        if staging.future is not None:
            cuda.end_async_write(tokens.pop(id(staging)))
        settle(staging)
    tier._start, tier._settle = _start, _settle
