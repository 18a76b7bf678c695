"""ComfyUI's side of pinning: the cap is what ComfyUI's MAX_PINNED_MEMORY has LEFT once other models' pins are
counted, and a refusal through ComfyUI's own pin_memory (0.3.75 does not clear it) leaves no CUDA error behind."""

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.nodes.host_ram import ComfyUIPinner, comfyui_pinned_memory_cap
from layerwise_offload.offload.memory import pinning

GiB = 2**30


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(mm, "is_device_cpu", lambda device: False)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 10 * GiB)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)


def test_the_cap_is_what_other_models_left(on_a_gpu, monkeypatch):
    assert comfyui_pinned_memory_cap() == 10 * GiB
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 7 * GiB)  # another model pinned 6 GiB, we hold 1 GiB
    assert comfyui_pinned_memory_cap(own_pinned_bytes=1 * GiB) == 4 * GiB
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 12 * GiB)
    assert comfyui_pinned_memory_cap(own_pinned_bytes=0) == 0
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1)  # --disable-pinned-memory
    assert comfyui_pinned_memory_cap() == 0


def test_dynamic_models_pins_that_comfyui_evicts_for_a_new_pin_leave_the_cap(on_a_gpu, monkeypatch):
    """0.33+: ComfyUI's pin_memory evicts dynamic models' registrations first (ensure_pin_registerable), so 6 GiB
    pinned by a dynamic model do not shrink the store's share; 1 GiB of an ordinary model's pins do."""
    class Dynamic:
        def is_dynamic(self):
            return True

        def pinned_memory_size(self):
            return 6 * GiB

    class Loaded:
        model = Dynamic()
    monkeypatch.setattr(mm, "ensure_pin_registerable", lambda size, evict_active=True: True, raising=False)
    monkeypatch.setattr(mm, "current_loaded_models", [Loaded()])
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 7 * GiB)
    assert comfyui_pinned_memory_cap(own_pinned_bytes=0) == 9 * GiB


def test_the_cap_is_none_on_the_cpu(monkeypatch):
    monkeypatch.setattr(mm, "is_device_cpu", lambda device: True)
    assert comfyui_pinned_memory_cap(5) is None


class StickyError:
    def __init__(self):
        self.last_error = 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.last_error = 712  # cudaErrorHostMemoryAlreadyRegistered
        return 712

    def cudaGetLastError(self):
        code, self.last_error = self.last_error, 0
        return code


def test_a_refusal_through_comfyuis_pin_memory_leaves_no_cuda_error(on_a_gpu, monkeypatch):
    runtime = StickyError()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(pinning, "_LAST_ERROR", [runtime.cudaGetLastError])
    buffer = torch.empty(4096, dtype=torch.uint8)
    assert ComfyUIPinner().register(buffer) is False  # ComfyUI's own pin_memory asked CUDA and was refused
    assert runtime.last_error == 0
