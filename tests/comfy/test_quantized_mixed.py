"""ComfyUI's own quantized weights (mixed precision fp8 -> QuantizedTensor) through the node, bitwise.

The checkpoint is a tiny Wan 2.1 in ComfyUI's mixed-precision format, loaded by ``comfy.sd.load_diffusion_model``
(the UNETLoader node's path) on whichever ComfyUI the tests run (0.3.75: ``comfy.quant_ops.QuantizedTensor``;
0.14.1: comfy-kitchen's). Before the host store knew tensor subclasses, packing such a block recursed forever in
``QuantizedTensor.__torch_dispatch__``.
"""

import pytest
import torch

import comfy.utils
import comfy.model_management as mm
import comfy.sd

from layerwise_offload.offload.host.packing import ENTRY_ALIGNMENT_BYTES
from layerwise_offload.devtools import tiny_dits
from layerwise_offload.devtools.quantized_models import save_tiny_wan21_fp8_mixed
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin

pytestmark = pytest.mark.usefixtures("comfy_loopback")

NUM_BLOCKS = 4


@pytest.fixture(scope="module")
def fp8_mixed_file(tmp_path_factory):
    return save_tiny_wan21_fp8_mixed(tmp_path_factory.mktemp("fp8") / "tiny_wan21_fp8_mixed.safetensors", seed=0)


def load(path):
    return comfy.sd.load_diffusion_model(path)


def quantized_weights(patcher):
    blocks = patcher.model.diffusion_model.blocks
    return [type(block.self_attn.q.weight).__name__ for block in blocks]


def lora_file(patcher, seed=5):
    """A rank-2 LoRA (generic ``lora_up``/``lora_down`` format) on two quantized linears of every block."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for index in range(NUM_BLOCKS):
        for name in ("self_attn.o", "ffn.0"):
            stem = f"diffusion_model.blocks.{index}.{name}"
            out_features, in_features = comfy.utils.get_attr(patcher.model, stem + ".weight").shape
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(out_features, 2, generator=gen)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(2, in_features, generator=gen)
    return lora


def with_lora(patcher):
    """What LoraLoaderModelOnly does."""
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora_file(patcher), 1.0, 0)
    assert len(patched.patches) == 2 * NUM_BLOCKS
    return patched


def test_loader_gives_quantized_tensor_weights(fp8_mixed_file):
    patcher = load(fp8_mixed_file)
    assert quantized_weights(patcher) == ["QuantizedTensor"] * NUM_BLOCKS
    assert patcher.model.diffusion_model.blocks[0].self_attn.q.weight._qdata.dtype == torch.float8_e4m3fn
    assert type(patcher.model.diffusion_model.text_embedding[0].weight).__name__ == "QuantizedTensor"


def real_bytes(tensor):
    """fp8 data plus scales for a QuantizedTensor (0.3.75 keeps scales in _layout_params, 0.14.1 in _params)."""
    if not hasattr(tensor, "_qdata"):
        return tensor.numel() * tensor.element_size()
    params = getattr(tensor, "_layout_params", None) or vars(tensor._params)
    scales = [v for v in params.values() if isinstance(v, torch.Tensor)]
    return tensor._qdata.nbytes + sum(s.nbytes for s in scales)


def test_non_block_quantized_weights_are_counted_at_their_stored_size(fp8_mixed_file):
    model = load(fp8_mixed_file)
    offloaded = offload_model(model, 1, 1, "leading", True)
    tiny_dits.sample(offloaded, seed=3, family="wan21", steps=1)
    controller = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]
    diffusion = model.model.diffusion_model
    tensors = list(model.model.named_parameters()) + list(model.model.named_buffers())
    non_block = [t for n, t in tensors if not n.startswith("diffusion_model.blocks.")]
    assert controller.non_block_bytes() == sum(real_bytes(t) for t in non_block)
    assert type(diffusion.text_embedding[0].weight).__name__ == "QuantizedTensor"  # placed whole
    mm.unload_all_models()


@pytest.mark.parametrize("host_store", ["ram", "disk"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_fp8_mixed_offloaded_equals_comfyui(fp8_mixed_file, lora, host_store, monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(tmp_path))
    base = load(fp8_mixed_file)
    want = tiny_dits.sample(with_lora(base) if lora else base, seed=3, family="wan21")
    mm.unload_all_models()
    if lora:
        assert not torch.equal(want, tiny_dits.sample(base, seed=3, family="wan21"))  # the LoRA matters
        mm.unload_all_models()
    model = load(fp8_mixed_file)
    for resident, prefetch, policy in [(0, 1, "leading"), (2, 1, "strided"), (99, 1, "leading")]:
        offloaded = offload_model(with_lora(model) if lora else model, resident, prefetch, policy, True, host_store)
        assert torch.equal(tiny_dits.sample(offloaded, seed=3, family="wan21"), want), (resident, policy)
        manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
        assert manager.engine.host.tiers() == [host_store] * NUM_BLOCKS
        stats = manager.stats()
        streamed = [i for i in range(NUM_BLOCKS) if not manager.schedule.resident[i]]
        assert stats.copies_last_forward == len(streamed)
        # bytes on the wire: the streamed blocks' packed (fp8 + scales) bytes, well under their bf16/fp32 size
        sizes = manager.block_nbytes()
        assert stats.bytes_copied_last_forward == sum(sizes[i] for i in streamed)
        assert quantized_weights(offloaded) == ["QuantizedTensor"] * NUM_BLOCKS
        mm.unload_all_models()
    assert quantized_weights(model) == ["QuantizedTensor"] * NUM_BLOCKS


def test_packed_block_is_the_quantized_size(fp8_mixed_file):
    model = load(fp8_mixed_file)
    offloaded = offload_model(model, 0, 1, "leading", True)
    tiny_dits.sample(offloaded, seed=3, family="wan21", steps=1)
    manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
    block = model.model.diffusion_model.blocks[1]
    stored = 0
    for param in block.parameters():
        inner = [param._qdata] if hasattr(param, "_qdata") else [param]
        stored += sum(t.numel() * t.element_size() for t in inner)
    padding = len(manager.store.layouts[1].entries) * ENTRY_ALIGNMENT_BYTES  # each entry on a page of its own
    assert stored <= manager.block_nbytes()[1] <= stored + padding  # data + scales + alignment
    mm.unload_all_models()


def test_lora_after_an_offloaded_prompt_keeps_compact_quantized_backups(fp8_mixed_file):
    """The state a user makes: prompt without LoRA through the node, then with one. ComfyUI backs up the quantized
    weights the LoRA replaces; each backup must be a QuantizedTensor of its own (not views into the host store,
    which would keep the whole old block buffers alive) and must restore the exact output without the LoRA."""
    model = load(fp8_mixed_file)
    offloaded = offload_model(model, 1, 1, "leading", True)
    plain = tiny_dits.sample(offloaded, seed=3, family="wan21")
    patched = with_lora(offloaded)
    assert not torch.equal(tiny_dits.sample(patched, seed=3, family="wan21"), plain)
    store = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager.store
    buffers = {b.untyped_storage().data_ptr() for b in store.buffers if b is not None}
    assert patched.backup, "ComfyUI keeps backups of the weights the LoRA patched"
    for key, backup in patched.backup.items():
        assert type(backup.weight).__name__ == "QuantizedTensor", key
        inner = [getattr(backup.weight, name) for name in backup.weight.__tensor_flatten__()[0]]
        assert all(t.untyped_storage().data_ptr() not in buffers for t in inner), f"{key} views the host store"
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(offloaded, seed=3, family="wan21"), plain)  # the backups restore it
    mm.unload_all_models()


def test_fp8_mixed_streamed_weight_by_weight_equals_comfyui(fp8_mixed_file, weights_replan):
    """residency_policy weights over ComfyUI's QuantizedTensor (fp8 with scales) weights: bitwise ComfyUI's own
    output with 60% of the blocks' bytes free, every unit's weights still QuantizedTensor."""
    from layerwise_offload.nodes import controller as controller_module
    want = tiny_dits.sample(load(fp8_mixed_file), seed=3, family="wan21")
    mm.unload_all_models()
    offloaded = offload_model(load(fp8_mixed_file), -1, 1, "weights", True)
    controller, plan = weights_replan(offloaded, want, lambda m: tiny_dits.sample(m, seed=3, family="wan21"))
    manager = controller.manager
    assert quantized_weights(offloaded) == ["QuantizedTensor"] * NUM_BLOCKS
    mm.unload_all_models()
