"""Streaming weight by weight through ComfyUI's own model classes (issue 28, G5): the manager over the weight units
of every tiny family's blocks samples bitwise what ComfyUI alone samples, holds what the planner computed, moves
only the planned tails each step, and at the same room moves fewer bytes than the best whole-tail plan."""

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.offload import apply_layerwise_offload, plan_residency, plan_streamed_tails, plan_weight_units
from layerwise_offload.offload.host.packing import block_parameters, plan_layout
from layerwise_offload.offload.units import weight_units

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def geometry(modules):
    layouts = [plan_layout(block_parameters(module)) for module in modules]
    return [layout.nbytes for layout in layouts], [layout.tail_sizes for layout in layouts]


def blocks_of(patcher):
    return [block for blocks in tiny_dits.block_lists(patcher).values() for block in blocks]


@pytest.mark.parametrize("family", sorted(tiny_dits.TINY_FAMILIES))
def test_weight_units_sample_bitwise_and_move_fewer_bytes_than_whole_tails(family):
    want = tiny_dits.sample(tiny_dits.build_tiny(family), seed=5, steps=3)
    mm.unload_all_models()
    patcher = tiny_dits.build_tiny(family)
    blocks = blocks_of(patcher)
    units = weight_units(blocks).residents_first()
    unit_sizes, unit_options = units.geometry()
    block_sizes, block_options = geometry(blocks)
    def nbytes(modules):
        return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())
    assert nbytes(units.units) + units.left_out_nbytes() == nbytes(blocks)
    room = int(0.6 * sum(block_sizes)) - units.left_out_nbytes()
    plan = plan_weight_units(unit_sizes, unit_options, room)
    whole_tails = plan_streamed_tails(block_sizes, block_options, room + units.left_out_nbytes(), tries=64)
    assert plan is not None and plan.fits
    if whole_tails is not None:
        assert plan.streamed_bytes < whole_tails.streamed_bytes  # the point of streaming weight by weight
    manager = apply_layerwise_offload(list(units.units), "cpu", root=patcher.get_model_object("diffusion_model"),
                                      resident_layers=plan.resident_count, prefetch_size=1,
                                      streamed_tail_bytes=plan.tails)
    try:
        units.place_rest("cpu")
        # three forwards: the first learns the call order (the units' definition order is not it: Flux runs both
        # modulations first), the second ends by prefetching the first units of the third, as every later one does
        assert torch.equal(tiny_dits.sample(patcher, seed=5, steps=3), want)
        stats = manager.stats()
        streamed = [tail for tail, keep in zip(manager.block_tails(), plan.resident) if not keep]
        assert stats.bytes_copied_last_forward == plan.streamed_bytes == sum(streamed)
        assert manager.device_bytes() == manager.device_bytes(manager.config) <= room
    finally:
        manager.detach()


@pytest.mark.parametrize("prefetch", [1, 3])
@pytest.mark.parametrize("policy", ["leading", "strided"])
def test_weight_units_of_flux_bitwise_for_whole_units(policy, prefetch):
    """Whole units streamed (no tails), at several resident counts: the same output as ComfyUI alone."""
    want = tiny_dits.sample(tiny_dits.build_tiny("flux"), seed=2, steps=2)
    mm.unload_all_models()
    patcher = tiny_dits.build_tiny("flux")
    units = weight_units(blocks_of(patcher))
    manager = apply_layerwise_offload(list(units.units), "cpu", root=patcher.get_model_object("diffusion_model"),
                                      resident_layers=0, prefetch_size=prefetch, policy=policy)
    try:
        for resident in (0, len(units) // 3, len(units) - 1):
            manager.replan(resident_layers=resident)
            assert torch.equal(tiny_dits.sample(patcher, seed=2, steps=2), want), resident
            mm.unload_all_models()
    finally:
        manager.detach()


# ------------------------------------------------------------------------------ through the node
@pytest.fixture
def free_memory(monkeypatch):
    """ComfyUI's free-memory figure, set per run; the loopback plans from it, not from the host's RAM."""
    from layerwise_offload.nodes import run_planning
    free = [2 ** 40]
    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (free[0], free[0]) if torch_free_too else free[0])
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)
    yield free
    mm.unload_all_models()


def overhead(family):
    from layerwise_offload.offload.planner import forward_activation_bytes
    patcher = tiny_dits.build_tiny(family)
    from layerwise_offload.nodes.discovery import discover_blocks
    from layerwise_offload.offload import block_width
    width = block_width(discover_blocks(patcher.get_model_object("diffusion_model")).blocks[0])
    latent = tiny_dits.TINY_FAMILIES[family].latent_shape
    cls = type(patcher.get_model_object("diffusion_model")).__name__
    per_channel = 1
    for n in latent[2:]:
        per_channel *= n
    activations = forward_activation_bytes(cls, width, per_channel, batch=2 * latent[0], dtype_bytes=4,
                                           latent_channels=latent[1]).nbytes
    return int(mm.minimum_inference_memory()) + activations


@pytest.mark.parametrize("family, lora", [("flux", False), ("wan21", False), ("wan21", True), ("qwen_image", False),
                                          ("lumina2", False)])
def test_the_node_streams_weight_units_bitwise_within_the_free_vram(free_memory, family, lora):
    """residency_policy weights: the node plans the weight units at the run's first step from what ComfyUI says is
    free, holds no more than that beside the non-block weights, moves fewer bytes a step than any whole-block or
    whole-tail plan of the same room, and samples bitwise what ComfyUI alone samples (with a LoRA on the device
    too, its norms and modulations patched with the non-block weights)."""
    from layerwise_offload.tests.device_lora_setup import random_lora
    from layerwise_offload.nodes.controller import offload_model
    from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
    from layerwise_offload.nodes.stats_view import stats_view
    import comfy.sd

    def build():
        model = tiny_dits.build_tiny(family)
        if lora:
            patches = random_lora(tiny_dits.build_tiny(family), rank=2)
            model = comfy.sd.load_lora_for_models(model, None, patches, 0.8, 0)[0]
        return model
    want = tiny_dits.sample(build(), seed=3)
    mm.unload_all_models()
    model = offload_model(build(), -1, 1, "weights", True)
    controller = model.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]
    manager = controller.manager
    assert controller.discovered.streams_weights and manager.num_blocks == len(controller.discovered.blocks)
    sizes = manager.block_nbytes()
    free_memory[0] = overhead(family) + int(0.6 * sum(sizes))
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    plan = controller.planner.last_plan
    assert plan.fits and manager.config.streamed_tail_bytes == plan.tails
    assert manager.stats().bytes_copied_last_forward == plan.streamed_bytes
    # the room is what ComfyUI says is free, less its reserve and this latent's activations (the CPU loopback's
    # free figure does not drop as the non-block weights load: they are in it)
    room = plan.free_bytes - plan.reserve_bytes - plan.activation_bytes
    assert free_memory[0] - room - controller.device_lora_scratch <= overhead(family) * 2
    assert manager.device_bytes() == manager.device_bytes(manager.config) == plan.required_bytes - plan.activation_bytes \
        - plan.reserve_bytes <= room
    blocks = controller.discovered.whole_blocks
    block_sizes, block_options = geometry(blocks)
    whole = [plan_residency(block_sizes, room, policy=p) for p in ("leading", "strided")]
    tails = plan_streamed_tails(block_sizes, block_options, room, tries=64)
    assert all(plan.streamed_bytes < other.streamed_bytes for other in whole + [tails] if other is not None)
    if lora:
        assert manager.after_copy is not None  # the blocks' LoRA on the device, unit by unit
    text, picture = stats_view(model)  # what the Stats node shows: layers, not blocks, and the weights plan
    assert f"of {manager.num_blocks} layers in VRAM" in text and "weights: " in text, text
    # its map: one cell per transformer block, partly resident where some of its layers stream
    unit_tiers = manager.stats().block_tiers
    for index, letter in enumerate(picture["blocks"]):
        mine = {tier == "resident" for tier, block in zip(unit_tiers, controller.discovered.block_of) if block == index}
        assert letter == ("R" if mine <= {True} else "S" if mine == {False} else "P"), (index, picture["blocks"])
    assert len(picture["blocks"]) == len(controller.discovered.whole_blocks)
    assert controller.last_report.headline().endswith("in VRAM)") or "layers" in controller.last_report.headline()
    # ComfyUI alone again on the same loaded model: the same output, nothing of ours in the way
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(build(), seed=3), want)


def test_weights_with_a_resident_count_is_refused_with_the_fix():
    from layerwise_offload.nodes.controller import offload_model
    with pytest.raises(ValueError, match="residency_policy = weights .*set resident_layers to -1"):
        offload_model(tiny_dits.build_tiny("flux"), 3, 1, "weights", True)


def test_two_outputs_of_one_model_alternate_between_weight_units_and_blocks(free_memory):
    """One loaded model, two node outputs (weights, and 1 block resident): each run replaces the other's manager
    (one holds the parameters at a time), every output is bitwise ComfyUI alone's, and the plain model after them
    too."""
    from layerwise_offload.nodes.controller import offload_model
    from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
    want = tiny_dits.sample(tiny_dits.build_tiny("flux"), seed=4)
    mm.unload_all_models()
    base = tiny_dits.build_tiny("flux")
    units = offload_model(base, -1, 1, "weights", True)
    blocks = offload_model(base, 1, 1, "leading", True)
    sizes = units.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager.block_nbytes()
    free_memory[0] = overhead("flux") + int(0.5 * sum(sizes))
    from layerwise_offload.nodes.shared_managers import _MANAGERS
    dit = base.get_model_object("diffusion_model")
    for model in (units, blocks, units, blocks):
        assert torch.equal(tiny_dits.sample(model, seed=4), want)
        manager = model.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
        assert manager.stats().bytes_copied_last_forward > 0  # it streamed: some of it is not on the "device"
        assert _MANAGERS[dit] is manager  # the one manager that holds the parameters
        hooked = sum(len(m._forward_pre_hooks) for m in dit.modules())
        assert hooked == manager.num_blocks, hooked  # its hooks only
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(base, seed=4), want)
