"""The device-side LoRA's work is queued on a transform stream of its own, after the block's copy and before its
completion event, with no host-side synchronisation on that path, checked with the CUDA stand-in of
tests/cuda_standin.py (the real StreamBackend over it, every operation of the sampling watched for races) over
ComfyUI's real LoRA math (comfy.lora.calculate_weight).

On the CPU loopback the load device is the host, so "on the device" is decided by storage: the LoRA math may read
the block's device buffer, the factors DeviceLora keeps on the device (here cloned, as an upload would) and what
it computed itself. Reading any other tensor is an upload from pageable host memory; ``.item()`` and friends
(``aten._local_scalar_dense``, ``nonzero``), an event's or a stream's ``synchronize`` are host syncs."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.device_lora import DeviceLora, patches_on_device
from layerwise_offload.tests import cuda_standin
from layerwise_offload.tests.cuda_standin import happens_before
from layerwise_offload.tests.device_lora_setup import offloaded_with_lora, tensors_of
from layerwise_offload.tests.stream_checks import backend_over, new_cuda

HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}


def storage(tensor):
    return tensor.untyped_storage().data_ptr()


class DeviceOnly(TorchDispatchMode):
    """Records the ops that sync with the host or read a tensor that is not on the "device"."""

    def __init__(self, device_storages):
        super().__init__()
        self.device = set(device_storages)
        self.problems = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_SYNC_OPS:
            self.problems.append(f"host sync: aten.{name}")
        for value in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(value, torch.Tensor) and value.numel() > 1 and storage(value) not in self.device:
                self.problems.append(f"aten.{name} reads a host tensor {tuple(value.shape)}")
        out = func(*args, **(kwargs or {}))
        self.device.update(storage(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def test_the_lora_is_queued_on_its_own_stream_with_no_host_sync(monkeypatch):
    monkeypatch.setenv("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    patcher, transform, want = offloaded_with_lora(1)  # arms and installs the hooks
    controller = patcher.attachments["layerwise_offload"]
    manager = controller.manager
    assert isinstance(transform, DeviceLora)
    with monkeypatch.context() as upload:  # the factors in memory of their own, as on a GPU
        upload.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: self.clone())
        transform.device_plan, _ = patches_on_device(transform.plan, torch.device("cpu"))
    factors = {storage(t) for entries in transform.device_plan.values() for _, _, patches in entries
               for p in patches for t in tensors_of(p[1])}
    host_factors = {storage(t) for entries in transform.plan.values() for _, _, patches in entries
                    for p in patches for t in tensors_of(p[1])}
    assert factors and not factors & host_factors

    manager.release_all()  # every block is copied again, through the stand-in
    cuda = new_cuda()
    manager.engine.backend = backend_over(cuda)  # looks inside: the CUDA stand-in takes the node's device's place
    cuda.drive(manager)
    syncs = []
    for kind in (cuda_standin.Event, cuda_standin.Stream):
        def recorded(self, synchronize=kind.synchronize, kind=kind.__name__):
            syncs.append(f"{getattr(self, 'name', '')} {kind}".strip())
            synchronize(self)
        monkeypatch.setattr(kind, "synchronize", recorded)
    runs = []  # (block, stream it ran on, its clock at the end, problems)
    call = DeviceLora.__call__

    def traced(self, index, weights):
        seen = len(syncs)
        stream = cuda.current
        with DeviceOnly(factors | {storage(w) for w in weights}) as mode:
            call(self, index, weights)
        runs.append((index, stream.name, dict(stream.clock), mode.problems + syncs[seen:]))
    monkeypatch.setattr(DeviceLora, "__call__", traced)

    def waits_for_the_lora(index):
        def hook(module, args):
            done = [clock for block, _, clock, _ in runs if block == index]
            if done:  # the compute stream's clock once the manager queued its waits
                assert happens_before(done[-1], cuda.compute.clock), f"block {index} may run before its LoRA"
        return hook
    for index, block in enumerate(controller.discovered.blocks):
        block.register_forward_pre_hook(waits_for_the_lora(index))  # after the manager's: sees its waits
    with cuda.running():  # every kernel of the sampling checked: a read racing a copy or a LoRA raises there
        assert torch.equal(tiny_dits.sample(patcher), want)
    patched = set(transform.plan)
    assert {index for index, *_ in runs} == patched
    for index, stream, _, problems in runs:
        assert stream == "transform", f"block {index}'s LoRA ran on the {stream} stream"
        assert not problems, f"block {index}'s LoRA: {problems[:3]}"
    assert ("copy", "transform") not in cuda.waits, "the copy stream waits for the LoRA"
    assert cuda.uploads and not cuda.faults


def test_the_checker_sees_an_upload_and_an_item(monkeypatch):
    """The recorder is not blind: the host's factors and a scalar read back are caught."""
    factor, weight = torch.randn(4, 4), torch.randn(4, 4)
    with DeviceOnly({storage(weight)}) as mode:
        (weight + factor).sum().item()
    assert any("reads a host tensor" in p for p in mode.problems)
    assert any("_local_scalar_dense" in p for p in mode.problems)
