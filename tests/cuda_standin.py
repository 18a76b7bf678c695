"""A stand-in for ``torch.cuda`` on the CPU that keeps CUDA's rules, so the pack's real GPU path runs here.

The offload engine's :class:`~layerwise_offload.offload.device.backend.StreamBackend` takes this object as its
device module. Tensors stay CPU tensors and every kernel and copy really runs (outputs are compared bit for bit),
but *when* each one runs on the "GPU" is simulated:

- **Streams** run asynchronously and in order, in simulated milliseconds: a copy costs its bytes over the link's
  rate, a kernel its FLOPs (matmuls) or bytes (the rest) over the device's rates. The host pays a small cost per
  call and never waits unless it synchronises, so it runs ahead of the GPU as a sampler's host does.
- **Events** complete when their stream passes them (``query``), ``synchronize`` moves the host to that moment,
  ``Stream.wait_event`` orders streams, not the host, and ``elapsed_time`` raises as torch's does unless both events
  were made with ``enable_timing=True``, both were recorded and both are complete.
- **Happens-before** is kept with vector clocks (one entry per stream, the host and any other actor), so a race
  is found even where the simulated times happen not to collide: every access to the manager's device memory is
  checked against the earlier ones it must follow (a read after the copy that wrote it, a copy after the reads of
  what it overwrites).
- **The caching allocator**: device memory freed while a stream other than the one that allocated it may still use
  it, with no event wait or host synchronisation ordering that use before the free, is a fault (the allocator hands
  the block to the allocating stream's next tensor at once).
- **Devices**: a kernel that reads the manager's host copy of a block (its packed store) is a host tensor in a
  device computation (on CUDA: a device mismatch or a silent copy per call); the host writing host memory that a
  queued copy may still read is a fault; a ``non_blocking`` copy from pageable memory is synchronous (as CUDA makes
  it) and listed in :attr:`CudaStandIn.pageable_async`. The host learns from such a copy only that its source was
  consumed, not that the copy finished (CUDA's documented guarantee: the driver stages the bytes and returns, the
  DMA to the device may still run); ``pageable_done_at_return=True`` is the lenient model where it finished.
- **What happened**, for tests to assert on: every ``wait_event`` as (waiting stream, event's stream) in
  :attr:`CudaStandIn.waits`, every copy to the device in :attr:`CudaStandIn.uploads` (:class:`Upload`).

Faults raise :class:`CudaRuleBroken` where they happen (``strict``) and are kept in :attr:`CudaStandIn.faults`.
What is device memory and what is host memory is told by :meth:`CudaStandIn.drive` from the manager's own parts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CudaRuleBroken", "CudaStandIn", "Upload", "byte_span", "happens_before", "overlaps", "standin_backend"]

aten = torch.ops.aten
_storage_expired = torch.UntypedStorage._expired
Clock = Dict[str, int]


class CudaRuleBroken(AssertionError):
    """Code did what CUDA forbids or leaves undefined."""


def merged(a: Clock, b: Clock) -> Clock:
    out = dict(a)
    for actor, count in b.items():
        if count > out.get(actor, 0):
            out[actor] = count
    return out


def happens_before(a: Clock, b: Clock) -> bool:
    get = b.get
    for actor, count in a.items():
        if count > get(actor, 0):
            return False
    return True


def _tensors_in(values, out: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors among an operator's arguments (tensors, lists and tuples of them, a dict of keyword arguments):
    what ``tree_flatten`` would find there, without its cost at every operator."""
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            _tensors_in(value, out)
        elif isinstance(value, dict):
            _tensors_in(value.values(), out)
    return out


def byte_span(tensor: torch.Tensor) -> Tuple[int, int]:
    """The bytes a tensor covers: [first, last + 1)."""
    numel, first = tensor.numel(), tensor.data_ptr()
    if numel == 0:
        return first, first
    if tensor.is_contiguous():
        extent = numel
    else:
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return first, first + extent * tensor.element_size()


def overlaps(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class Host:
    """The host thread: its simulated time and what it knows has finished."""

    def __init__(self, call_ms: float):
        self.now = 0.0
        self.clock: Clock = {"host": 0}
        self.call_ms = call_ms

    def step(self, ms: Optional[float] = None) -> None:
        self.now += self.call_ms if ms is None else ms
        self.clock["host"] += 1

    def learn(self, time: float, clock: Clock) -> None:
        self.now = max(self.now, time)
        self.clock = merged(self.clock, clock)


class Stream:
    """A stream: work queued on it runs in order, after what the host had queued or learnt when it was queued."""

    def __init__(self, cuda: "CudaStandIn", name: str):
        self.cuda = cuda
        self.name = name
        self.tail = 0.0  # when the work queued so far ends
        self.clock: Clock = {name: 0}

    def queue(self, cost_ms: float) -> Tuple[float, float, Clock]:
        """Queue ``cost_ms`` of work: (its start, its end, its clock)."""
        host = self.cuda.host
        start = max(self.tail, host.now)
        self.tail = start + cost_ms
        self.clock = merged(self.clock, host.clock)
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return start, self.tail, dict(self.clock)

    def wait_event(self, event: "Event") -> None:
        self.cuda.host_call()
        self.cuda.waits.append((self.name, event.stream))
        if event.clock is not None:  # CUDA: waiting on an event never recorded returns at once
            self.tail = max(self.tail, event.time)
            self.clock = merged(self.clock, event.clock)

    def wait_stream(self, other: "Stream") -> None:
        self.wait_event(other.record_event())

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = event or Event(self.cuda)
        event.record(self)
        return event

    def query(self) -> bool:
        self.cuda.host_call()
        if self.cuda.host.now >= self.tail:
            self.cuda.host.learn(self.tail, self.clock)
            return True
        return False

    def synchronize(self) -> None:
        self.cuda.host_call()
        self.cuda.host.learn(self.tail, self.clock)

    def __repr__(self) -> str:
        return f"<stand-in stream {self.name}>"


class Event:
    """A CUDA event: complete once its stream has passed the point where it was recorded."""

    def __init__(self, cuda: "CudaStandIn", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.cuda = cuda
        self.enable_timing = enable_timing
        self.time: Optional[float] = None
        self.clock: Optional[Clock] = None
        self.stream: Optional[str] = None

    def record(self, stream: Optional[Stream] = None) -> None:
        self.cuda.host_call()
        stream = stream or self.cuda.current
        _, self.time, self.clock = stream.queue(0.0)
        self.stream = stream.name

    def query(self) -> bool:
        self.cuda.host_call()
        if self.clock is None:
            return True
        if self.cuda.host.now >= self.time:
            self.cuda.host.learn(self.time, self.clock)
            return True
        return False

    def synchronize(self) -> None:
        self.cuda.host_call()
        if self.clock is not None:
            self.cuda.host.learn(self.time, self.clock)

    def wait(self, stream: Optional[Stream] = None) -> None:
        (stream or self.cuda.current).wait_event(self)

    def elapsed_time(self, end: "Event") -> float:
        # The order and words of c10/cuda/CUDAEvent.h's checks; an event without timing fails in cudaEventElapsedTime.
        if self.clock is None or end.clock is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("CUDA error: invalid resource handle (an event was created without enable_timing)")
        return end.time - self.time


@dataclass
class Access:
    span: Tuple[int, int]
    write: bool
    clock: Clock
    stream: str
    what: str


@dataclass
class DeviceBuffer:
    """One allocation of device memory, the stream it belongs to, and the accesses not yet known to be over."""

    ref: StorageWeakRef
    stream: Stream
    what: str
    accesses: List[Access] = field(default_factory=list)


@dataclass
class HostRead:
    """A queued copy that reads host memory: the host may not change those bytes until it knows the copy is done."""

    span: Tuple[int, int]
    clock: Clock
    stream: str


@dataclass
class Upload:
    """One copy to the device: its source's and destination's bytes, its clock, its stream, whether its source was
    page-locked and whether it was asked for ``non_blocking``."""

    src: Tuple[int, int]
    dst: Tuple[int, int]
    clock: Clock
    stream: str
    pinned: bool
    non_blocking: bool


@dataclass
class AsyncWrite:
    """Host memory being written by another actor (a disk read): a copy from it must come after the write ends."""

    span: Tuple[int, int]
    clock: Clock
    actor: str


_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2)}
_FREE_OPS = {aten.empty.memory_format, aten.empty_strided.default, aten.detach.default, aten.alias.default,
             aten.lift_fresh.default, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
             aten._local_scalar_dense.default}


_WRITTEN: Dict[object, Tuple[int, ...]] = {}


def _written_arguments(func) -> Tuple[int, ...]:
    """The positions of the arguments ``func`` writes (its schema's alias annotations), once per operator."""
    positions = _WRITTEN.get(func)
    if positions is None:
        schema = getattr(func, "_schema", None)
        positions = _WRITTEN[func] = tuple(
            k for k, argument in enumerate(schema.arguments if schema is not None else ())
            if argument.alias_info is not None and argument.alias_info.is_write)
    return positions


@dataclass
class _Properties:
    name: str
    total_memory: int


class _Dispatch(TorchDispatchMode):
    def __init__(self, cuda: "CudaStandIn"):
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cuda = self.cuda
        cuda.host_call()
        if func is aten.copy_.default:
            cuda.on_copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking")))
        elif not (getattr(func, "is_view", False) or func in _FREE_OPS):
            cuda.on_kernel(func, args, kwargs)
        return func(*args, **kwargs)


class CudaStandIn:
    """What the engine asks of ``torch.cuda`` (``Stream``, ``Event``, ``stream()``, ``current_stream()``,
    ``synchronize()``), over simulated time and vector clocks; see the module's docstring.

    Rates: ``h2d_bytes_per_ms`` (host to device), ``d2d_bytes_per_ms``, ``flops_per_ms`` (matmuls),
    ``bytes_per_ms`` (other kernels: the bytes they touch); ``host_call_ms`` what each host call costs.
    """

    def __init__(self, h2d_bytes_per_ms: float = 25e6, flops_per_ms: float = 4e11, bytes_per_ms: float = 4e9,
                 d2d_bytes_per_ms: float = 2e9, host_call_ms: float = 0.001, strict: bool = True,
                 stream_names: Iterable[str] = ("copy", "transform"), pageable_done_at_return: bool = False):
        self.host = Host(host_call_ms)
        self.h2d_bytes_per_ms = h2d_bytes_per_ms
        self.flops_per_ms = flops_per_ms
        self.bytes_per_ms = bytes_per_ms
        self.d2d_bytes_per_ms = d2d_bytes_per_ms
        self.strict = strict
        self.pageable_done_at_return = pageable_done_at_return
        self.compute = Stream(self, "compute")
        self.current = self.compute
        self.streams: List[Stream] = [self.compute]
        self._names = list(stream_names)
        self.faults: List[str] = []
        self.pageable_async: List[int] = []  # bytes of each non_blocking copy from pageable memory (synchronous)
        self.copies: List[Tuple[Tuple[int, int], Tuple[int, int], Clock, Clock, str]] = []  # (src, dst, start, end)
        self.uploads: List[Upload] = []  # every copy to the device, in the order the host queued them
        self.waits: List[Tuple[str, Optional[str]]] = []  # every wait_event: (waiting stream, the event's stream)
        self._device: Dict[int, DeviceBuffer] = {}
        self._pinned: Dict[int, Tuple[int, int]] = {}
        self._host_reads: List[HostRead] = []
        self._async_writes: Dict[int, AsyncWrite] = {}
        self._host_memory: List[Callable[[], Iterable[torch.Tensor]]] = []
        self._tokens = 0
        # Model forwards in progress: every kernel in one is device work (the host's own work in one, packing and
        # staging, is copies between host buffers).
        self.forwards = 0
        self._checking = False

    # ------------------------------------------------------------------ torch.cuda's surface
    def Stream(self, device=None, priority: int = 0) -> Stream:
        name = self._names.pop(0) if self._names else f"side{len(self.streams)}"
        stream = Stream(self, name)
        self.streams.append(stream)
        return stream

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Event:
        return Event(self, enable_timing, blocking, interprocess)

    @contextlib.contextmanager
    def stream(self, stream: Optional[Stream]):
        previous = self.current
        if stream is not None:
            self.current = stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self, device=None) -> Stream:
        return self.current

    def default_stream(self, device=None) -> Stream:
        return self.compute

    def synchronize(self, device=None) -> None:
        for stream in self.streams:
            stream.synchronize()

    def is_available(self) -> bool:
        return True

    def get_device_properties(self, device=None):
        return _Properties("CUDA stand-in", 80 * 2**30)

    # ------------------------------------------------------------------ what memory is what
    @contextlib.contextmanager
    def running(self):
        """Watch every tensor operation (the dispatch mode) while the block runs."""
        with _Dispatch(self):
            yield self

    def track_device(self, tensor: torch.Tensor, what: str = "device memory") -> torch.Tensor:
        """``tensor`` (a fresh allocation) is device memory belonging to the current stream."""
        self._device[tensor.untyped_storage().data_ptr()] = DeviceBuffer(
            StorageWeakRef(tensor.untyped_storage()), self.current, what)
        return tensor

    def watch_host_memory(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """``tensors()`` lists host memory no kernel may read (a manager's packed host copies)."""
        self._host_memory.append(tensors)

    @contextlib.contextmanager
    def forward(self):
        """Device work outside a driven manager's forwards (a test's own kernels)."""
        self.forwards += 1
        try:
            yield
        finally:
            self.forwards -= 1

    def drive(self, manager) -> "CudaStandIn":
        """Tell device from host memory for ``manager``: its device buffers are tracked as they are allocated, its
        host store's buffers are host memory, and its forwards are device work."""
        memory = manager.engine.device_memory
        allocate = memory.allocate

        def tracked(nbytes: int) -> torch.Tensor:
            return self.track_device(allocate(nbytes), "the manager's device memory")
        memory.allocate = tracked
        begin, end = manager.engine.begin_forward, manager.engine.end_forward

        def begin_forward():
            self.forwards += 1
            begin()

        def end_forward(completed: bool = True):
            self.forwards -= 1
            end(completed)
        manager.engine.begin_forward, manager.engine.end_forward = begin_forward, end_forward
        self.watch_host_memory(lambda: [b for b in (manager.store.buffers if manager.store is not None else ())
                                        if b is not None])
        return self

    class Pinner:
        """Page-locks host memory as ``cudaHostRegister`` would; the stand-in then knows those bytes are pinned."""

        def __init__(self, cuda: "CudaStandIn", refuse_after: Optional[int] = None):
            self.cuda, self.refuse_after, self.count = cuda, refuse_after, 0

        def register(self, tensor: torch.Tensor) -> bool:
            self.count += 1
            if self.refuse_after is not None and self.count > self.refuse_after:
                return False
            self.cuda._pinned[tensor.data_ptr()] = byte_span(tensor)
            return True

        def unregister(self, tensor: torch.Tensor) -> None:
            span = self.cuda._pinned.pop(tensor.data_ptr(), None)
            if span is not None:
                self.cuda._host_writes(span, "unpinned")

    def pinner(self, refuse_after: Optional[int] = None) -> "CudaStandIn.Pinner":
        return CudaStandIn.Pinner(self, refuse_after)

    def begin_async_write(self, tensor: torch.Tensor, actor: str) -> int:
        """Another actor (a disk read) starts writing ``tensor``'s bytes, after what the host knows now."""
        span = byte_span(tensor)
        self._host_writes(span, f"a {actor} write")
        clock = merged(self.host.clock, {actor: max([w.clock.get(actor, 0) for w in self._async_writes.values()]
                                                    + [self.host.clock.get(actor, 0)]) + 1})
        self._tokens += 1
        self._async_writes[self._tokens] = AsyncWrite(span, clock, actor)
        return self._tokens

    def end_async_write(self, token: int) -> None:
        """The host waited for that write: it has finished."""
        write = self._async_writes.pop(token, None)
        if write is not None:
            self.host.clock = merged(self.host.clock, write.clock)

    # ------------------------------------------------------------------ the rules
    def fault(self, message: str) -> None:
        self.faults.append(message)
        if self.strict:
            raise CudaRuleBroken(message)

    def host_call(self) -> None:
        """Every call the host makes costs it a little, and lets the allocator notice what was freed since."""
        self.host.step()
        if self._checking:
            return
        self._checking = True
        try:
            self._check_frees()
        finally:
            self._checking = False

    def _check_frees(self) -> None:
        expired = _storage_expired  # StorageWeakRef.expired without its two Python calls: this runs at every call
        freed = [key for key, buffer in self._device.items() if expired(buffer.ref.cdata)]
        for key in freed:
            buffer = self._device.pop(key)
            # Reusable at once by the next allocation of its stream: what that stream and the host know is over.
            known = merged(buffer.stream.clock, self.host.clock)
            for access in buffer.accesses:
                if access.stream != buffer.stream.name and not happens_before(access.clock, known):
                    self.fault(f"{buffer.what} was freed while the {access.stream} stream may still "
                               f"{'write' if access.write else 'read'} it ({access.what}): nothing orders that "
                               f"use before the memory's reuse by the {buffer.stream.name} stream (wait for its "
                               "event on that stream, synchronise the host, or record_stream)")

    def _buffer_of(self, tensor: torch.Tensor, storage: Optional[int] = None) -> Optional[DeviceBuffer]:
        """The device buffer ``tensor`` views (``storage``: its storage's address, where known), or None."""
        buffer = self._device.get(tensor.untyped_storage().data_ptr() if storage is None else storage)
        if buffer is None or _storage_expired(buffer.ref.cdata):
            return None
        return buffer

    def _host_storage_pointers(self) -> set:
        pointers = set()
        for tensors in self._host_memory:
            pointers.update(t.untyped_storage().data_ptr() for t in tensors())
        return pointers

    def _is_pinned(self, tensor: torch.Tensor) -> bool:
        span = byte_span(tensor)
        return any(lo <= span[0] and span[1] <= hi for lo, hi in self._pinned.values())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether all of ``tensor``'s bytes are page-locked now (by :meth:`pinner`)."""
        return self._is_pinned(tensor)

    def pinned_spans(self) -> List[Tuple[int, int]]:
        """The host byte ranges page-locked now, sorted."""
        return sorted(self._pinned.values())

    def _access(self, buffer: DeviceBuffer, tensor: torch.Tensor, write: bool, clock: Clock, stream: str,
                what: str) -> None:
        span = byte_span(tensor)
        for earlier in buffer.accesses:
            if (write or earlier.write) and overlaps(span, earlier.span) and not happens_before(earlier.clock, clock):
                self.fault(f"{what} on the {stream} stream may {'write' if write else 'read'} {buffer.what} that "
                           f"{earlier.what} on the {earlier.stream} stream may still "
                           f"{'write' if earlier.write else 'read'}: no event orders them")
        known = self.host.clock
        buffer.accesses = [a for a in buffer.accesses if not happens_before(a.clock, known)
                           and not (write and a.span[0] >= span[0] and a.span[1] <= span[1]
                                    and happens_before(a.clock, clock))]
        buffer.accesses.append(Access(span, write, clock, stream, what))

    def _host_writes(self, span: Tuple[int, int], what: str) -> None:
        known = self.host.clock
        still = []
        for read in self._host_reads:
            if happens_before(read.clock, known):
                continue
            if overlaps(span, read.span):
                self.fault(f"the host changes host memory ({what}) that a copy on the {read.stream} stream may still "
                           "read: wait for the copy's event first")
            still.append(read)
        self._host_reads = still

    def on_copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        dst_buffer, src_buffer = self._buffer_of(dst), self._buffer_of(src)
        nbytes = dst.numel() * dst.element_size()
        if dst_buffer is None and src_buffer is None:  # host to host (packing, a staging ring)
            self._host_writes(byte_span(dst), "a host copy")
            return
        stream = self.current
        if dst_buffer is None:  # device to host: synchronous unless non_blocking into pinned memory
            _, end, clock = stream.queue(nbytes / self.d2d_bytes_per_ms)
            self._access(src_buffer, src, False, clock, stream.name, "a copy to the host")
            if not (non_blocking and self._is_pinned(dst)):
                self.host.learn(end, clock)
            return
        if src_buffer is not None:
            _, end, clock = stream.queue(nbytes / self.d2d_bytes_per_ms)
            self._access(src_buffer, src, False, clock, stream.name, "a device copy")
            self._access(dst_buffer, dst, True, clock, stream.name, "a device copy")
            return
        span = byte_span(src)
        start, end, clock = stream.queue(nbytes / self.h2d_bytes_per_ms)
        for write in self._async_writes.values():
            if overlaps(span, write.span) and not happens_before(write.clock, clock):
                self.fault(f"a copy on the {stream.name} stream reads host memory that a {write.actor} write may "
                           "not have finished")
        self._access(dst_buffer, dst, True, clock, stream.name, "a copy to the device")
        self.copies.append((span, byte_span(dst), clock, clock, stream.name))
        pinned = self._is_pinned(src)
        self.uploads.append(Upload(span, byte_span(dst), clock, stream.name, pinned, non_blocking))
        if non_blocking and pinned:
            self._host_reads.append(HostRead(span, clock, stream.name))
        else:  # CUDA stages a pageable source through its own buffer: the host waits for the copy
            if non_blocking:
                self.pageable_async.append(nbytes)
                if not self.pageable_done_at_return:  # the source is consumed; the copy may still run
                    return
            self.host.learn(end, clock)

    def on_kernel(self, func, args, kwargs) -> None:
        tensors = _tensors_in((args, kwargs), [])
        storages = [tensor.untyped_storage().data_ptr() for tensor in tensors]
        if self.forwards and self._host_memory and tensors:
            host = self._host_storage_pointers()
            for tensor, storage in zip(tensors, storages):
                if storage in host:
                    self.fault(f"a host tensor in a device computation: {func} reads a block's host copy "
                               f"({tuple(tensor.shape)}, {tensor.dtype}) on the {self.current.name} stream; its "
                               "weights were not on the device when it ran")
        stream = self.current
        _, _, clock = stream.queue(self._kernel_ms(func, args, tensors))
        buffers = [(tensor, buffer) for tensor, storage in zip(tensors, storages)
                   if (buffer := self._buffer_of(tensor, storage)) is not None]
        if not buffers:
            return
        written = set()
        for position in _written_arguments(func):
            if position < len(args) and isinstance(args[position], torch.Tensor):
                written.add(id(args[position]))
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            written.add(id(out))
        what = str(func)
        for tensor, buffer in buffers:
            self._access(buffer, tensor, id(tensor) in written, clock, stream.name, what)

    def _kernel_ms(self, func, args, tensors) -> float:
        operands = _MATMULS.get(func)
        if operands is not None:
            a, b = args[operands[0]], args[operands[1]]
            flops = 2.0 * a.numel() * b.shape[-1]
            return flops / self.flops_per_ms
        touched = sum(t.numel() * t.element_size() for t in tensors)
        return touched / self.bytes_per_ms


def standin_backend(cuda: CudaStandIn, measure_time: bool = True):
    """The engine's real :class:`StreamBackend` over the stand-in."""
    from layerwise_offload.offload.device.backend import StreamBackend
    return StreamBackend(torch.device("cpu"), measure_time, module=cuda)
