"""The node in the states daily ComfyUI use leaves a model in (issue 13), in-process on the CPU loopback.

Every output is bitwise equal to ComfyUI's own output for the same graph without the node, computed on a
fresh model (no state shared with the graph under test).
"""

import pytest
import torch

import comfy.model_management as mm
import comfy.patcher_extension
import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.tests.comfy_support import lora

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def with_lora(patcher, strength):
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora(), strength, 0)
    return patched


@pytest.fixture(scope="module")
def reference():
    """ComfyUI's own output for ``loader -> LoRA(strength) -> sampler`` on a fresh model (strength 0: no LoRA).

    All computed before any graph under test runs: computing one unloads every model, which would hide the bug.
    """
    references = {}
    for strength in (0, 0.5, 0.8):
        model = tiny_dits.build_tiny("wan21")
        references[strength] = tiny_dits.sample(with_lora(model, strength) if strength else model, seed=3)
        mm.unload_all_models()
    return references


@pytest.mark.parametrize("resident", [0, 2])
def test_plain_use_after_offloaded_use_with_a_lora(resident, reference):
    """Issue 13 item 2: the LoRA'd MODEL without the node, right after the same MODEL ran through the node."""
    model = tiny_dits.build_tiny("wan21")
    lora_model = with_lora(model, 0.8)
    offloaded = offload_model(lora_model, resident, 1, "leading", True)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), reference[0.8])
    assert torch.equal(tiny_dits.sample(lora_model, seed=3), reference[0.8])
    assert torch.equal(tiny_dits.sample(model, seed=3), reference[0])
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), reference[0.8])
    assert torch.equal(tiny_dits.sample(lora_model, seed=3), reference[0.8])


def test_lora_strength_changed_between_an_offloaded_and_a_plain_prompt(reference):
    """The server keeps each loader's output: the same LoRA'd MODELs come back in later prompts."""
    model = tiny_dits.build_tiny("wan21")
    strong, weak = with_lora(model, 0.8), with_lora(model, 0.5)
    for offloaded, plain in [(strong, weak), (weak, strong), (strong, weak)]:
        assert torch.equal(tiny_dits.sample(offload_model(offloaded, 2, 1, "leading", True), seed=3),
                           reference[0.8 if offloaded is strong else 0.5])
        assert torch.equal(tiny_dits.sample(plain, seed=3), reference[0.8 if plain is strong else 0.5])


@pytest.fixture
def comfy_pinning(monkeypatch):
    """ComfyUI's pin/unpin of CPU weights, recorded instead of calling cudaHostRegister (the GPU is faked)."""
    registered = {}

    def pin(tensor):
        if tensor.device.type != "cpu" or tensor.data_ptr() in registered:
            return False
        registered[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return True

    def unpin(tensor):
        return registered.pop(tensor.data_ptr(), None) is not None

    monkeypatch.setattr(mm, "pin_memory", pin)
    monkeypatch.setattr(mm, "unpin_memory", unpin)
    return registered


def lowvram_functions(patcher):
    return [m for m in patcher.model.modules() if getattr(m, "weight_function", None) or getattr(m, "bias_function", None)]


def test_taking_over_a_model_comfyui_loaded_in_lowvram_mode(reference, comfy_pinning):
    """Issue 13 item 3: ComfyUI loaded the LoRA'd model partially (LowVramPatch on the modules, weights pinned),
    then the node is inserted after the LoRA loader."""
    model = tiny_dits.build_tiny("wan21")
    lora_model = with_lora(model, 0.8)
    lora_model.patch_model(lowvram_model_memory=1)  # ComfyUI's partial load with a tiny budget: every weight lowvram
    assert lowvram_functions(lora_model) and lora_model.pinned and comfy_pinning
    offloaded = offload_model(lora_model, 2, 1, "leading", True)
    for _ in range(2):
        assert torch.equal(tiny_dits.sample(offloaded, seed=3), reference[0.8])
    assert not lowvram_functions(offloaded)
    assert not lora_model.pinned and not comfy_pinning  # unpinned through ComfyUI, nothing stale
    assert torch.equal(tiny_dits.sample(lora_model, seed=3), reference[0.8])


def hooked_conditioning(strength=0.8):
    """The tiny Wan's conditioning with a hooked LoRA on the positive, as Create Hook LoRA (MO) + Set Hooks make it."""
    import comfy.hooks
    positive, negative = tiny_dits.TINY_FAMILIES["wan21"].conditioning(3)
    hooks = comfy.hooks.create_hook_lora(lora(), strength_model=strength, strength_clip=0.0)
    return comfy.hooks.set_hooks_for_conditioning(positive, hooks), negative


def test_weight_hooks_are_refused_before_the_run(reference):
    """Issue 13 item 4: ComfyUI's hooks write weights in place; the node refuses them with an error saying what to use."""
    model = tiny_dits.build_tiny("wan21")
    positive, negative = hooked_conditioning()
    hooked_plain = tiny_dits.sample(model, seed=3, positive=positive, negative=negative)  # ComfyUI without the node
    assert not torch.equal(hooked_plain, reference[0])  # the hook really changes the output
    offloaded = offload_model(model, 2, 1, "leading", True)
    manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
    with pytest.raises(RuntimeError, match=r"(?s)hooks.*LoraLoaderModelOnly"):
        tiny_dits.sample(offloaded, seed=3, positive=positive, negative=negative)
    assert manager.stats().forwards == 0 and manager.device_bytes() == 0  # refused before anything ran or was held
    # Nothing stays behind: the same model samples right afterwards, with the node and without it.
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), reference[0])
    assert torch.equal(tiny_dits.sample(model, seed=3, positive=positive, negative=negative), hooked_plain)


def test_the_node_twice_in_a_chain_runs_each_forward_once(reference):
    """Issue 13 item 6: a second LayerwiseOffload after the first replaces its wrapper and callbacks."""
    once = offload_model(tiny_dits.build_tiny("wan21"), 1, 1, "leading", True)
    twice = offload_model(once, 2, 1, "strided", True)
    key = LayerwiseOffloadPatcherMixin.ATTACHMENT
    assert len(twice.get_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL, key)) == 1
    controller = twice.attachments[key]
    assert torch.equal(tiny_dits.sample(twice, seed=3), reference[0])
    stats = controller.manager.stats()
    assert controller.last_report.forwards == stats.forwards == 4  # 4 steps, cond and uncond in one batch
    assert stats.copies_last_forward == 2  # the second node's plan: 2 of 4 resident


def test_taking_back_a_model_comfyui_loaded_partially_after_the_node(reference, comfy_pinning):
    """The node ran (residents held), then ComfyUI loaded the plain LoRA'd MODEL partially (pinning the weights the
    blocks had), then the node runs again: ComfyUI unpins what it pinned before the manager re-points anything."""
    lora_model = with_lora(tiny_dits.build_tiny("wan21"), 0.8)
    offloaded = offload_model(lora_model, 2, 1, "leading", True)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), reference[0.8])
    # ComfyUI's own partial load with a budget of 1 byte (it counts what the model holds now as its own).
    lora_model.partially_load(mm.get_torch_device(), extra_memory=1 - lora_model.model.model_loaded_weight_memory)
    assert lowvram_functions(lora_model) and comfy_pinning
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), reference[0.8])
    assert not lowvram_functions(offloaded) and not lora_model.pinned and not comfy_pinning
