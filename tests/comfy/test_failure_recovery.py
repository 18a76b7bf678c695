"""Issue 20 item 2: a failure in the middle of a forward leaves a state from which the next prompts are correct.

A failure is injected once at each stage of an offloaded forward (streaming, so every stage really runs), then the
same offloaded MODEL samples 20 prompts in a row, each bitwise equal to ComfyUI alone on a fresh model. One stage is
the cause of the intermittent ``IndexError`` the issue saw: a garbage-collected offloaded patcher of the same model
gives its device memory back at whatever allocation the collector happens to run, here in the middle of a copy.
"""

import gc

import pytest
import torch

import comfy.model_management as mm
import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.tests.comfy_support import lora

pytestmark = pytest.mark.usefixtures("comfy_loopback")

LATENT = (1, 16, 1, 4, 4)
PROMPTS_AFTER = 20


class Injected(RuntimeError):
    pass


def sample(patcher, **kwargs):
    return tiny_dits.sample(patcher, latent=LATENT, seed=3, steps=2, **kwargs)


def with_lora(patcher):
    return comfy.sd.load_lora_for_models(patcher, None, lora(), 0.8, 0)[0]


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, make in (("plain", tiny_dits.build_wan21), ("lora", lambda: with_lora(tiny_dits.build_wan21()))):
        out[name] = sample(make())
        mm.unload_all_models()
    return out


def manager_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager


def fail_once_at(count):
    """A callable that raises the ``count``-th time it is called, and never again."""
    calls = {"n": 0}

    def tick():
        calls["n"] += 1
        if calls["n"] == count:
            raise Injected(f"injected at call {count}")
    return tick, calls


def inject_before_block(offloaded, source):
    tick, _ = fail_once_at(2)  # the second forward: two steps, cond and uncond batched
    block = offloaded.model.diffusion_model.blocks[2]
    return block.register_forward_pre_hook(lambda module, args: tick())


def inject_inside_block(offloaded, source):
    tick, _ = fail_once_at(2)
    ffn = offloaded.model.diffusion_model.blocks[3].ffn
    return ffn.register_forward_hook(lambda module, args, output: tick())


def _wrap_copy(manager, before_copy):
    backend = manager.engine.backend
    original = backend.copy

    def copy(dst, src, after=None, then=None):
        before_copy()
        return original(dst, src, after=after, then=then)
    backend.copy = copy

    class Undo:
        def remove(self):
            del backend.copy
    return Undo()


def inject_during_copy(offloaded, source):
    tick, _ = fail_once_at(4)
    return _wrap_copy(manager_of(offloaded), tick)


def inject_during_device_lora(offloaded, source):
    manager = manager_of(offloaded)
    tick, calls = fail_once_at(3)
    transform = manager.engine.copier.transform
    assert transform is not None, "the device-side LoRA must be active for this stage"

    class Failing:
        signature = transform.signature

        def __call__(self, index, weights):
            tick()
            return transform(index, weights)
    # Looks inside: setting after_copy would release every block (a new transform), which moves the failure elsewhere.
    manager.engine.copier.transform = Failing()

    class Undo:
        def remove(self):
            manager.engine.copier.transform = transform
    return Undo()


def inject_interrupt_between_steps(offloaded, source):
    """ComfyUI's own interrupt (the Cancel button), raised from the sampler's callback after the first step."""
    def callback(step, x0, x, total):
        if step == 0:
            mm.interrupt_current_processing(True)
            mm.throw_exception_if_processing_interrupted()
    return callback


def inject_release_by_a_collected_patcher(offloaded, source):
    """Another offloaded clone of the same model, which ComfyUI loaded last, is garbage collected in the middle
    of a copy: its ``__del__`` gives the shared manager's device memory back (the cause of the issue's IndexError)."""
    stale = offload_model(source, 1, 1, "leading", True)
    sample(stale)
    done = {"n": 0}

    def collect():
        done["n"] += 1
        if done["n"] == 3:
            stale.__del__()
    return _wrap_copy(manager_of(offloaded), collect)


STAGES = {
    "before_block": (inject_before_block, "plain"),
    "inside_block": (inject_inside_block, "plain"),
    "during_copy": (inject_during_copy, "plain"),
    "during_device_lora": (inject_during_device_lora, "lora"),
    "interrupt_between_steps": (inject_interrupt_between_steps, "plain"),
    "release_by_collected_patcher": (inject_release_by_a_collected_patcher, "plain"),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_prompts_after_an_injected_failure_are_bitwise(stage, references):
    inject, kind = STAGES[stage]
    model = tiny_dits.build_wan21()
    source = with_lora(model) if kind == "lora" else model
    offloaded = offload_model(source, 1, 1, "leading", True)
    assert torch.equal(sample(offloaded), references[kind])  # warm: the plan is armed, blocks stream
    injected = inject(offloaded, source)
    if callable(injected):  # the interrupt comes through the sampler callback
        with pytest.raises(mm.InterruptProcessingException):
            sample(offloaded, callback=injected)
        mm.interrupt_current_processing(False)
    elif stage == "release_by_collected_patcher":
        assert torch.equal(sample(offloaded), references[kind]), "the forward the release landed in"
        injected.remove()
    else:
        with pytest.raises(Injected):
            sample(offloaded)
        injected.remove()
    gc.collect()
    for prompt in range(PROMPTS_AFTER):
        out = sample(offloaded)
        assert torch.equal(out, references[kind]), f"prompt {prompt + 1} after the failure {stage} differs"
    manager = manager_of(offloaded)
    assert manager.armed and sum(manager.is_materialized(i) for i in range(manager.num_blocks)) <= 1 + 2
