"""The node for ComfyUI's V3 schema (comfy_api.latest)."""

from __future__ import annotations

import functools

from comfy_api.latest import ComfyExtension, io

from .offload_node import (CATEGORY, DESCRIPTION, DISPLAY_NAME, INPUTS, NODE_ID, STATS_DESCRIPTION, STATS_DISPLAY_NAME,
                           STATS_NODE_ID, STATS_TOOLTIPS, NodeInput, host_store_problem, stats_ui)
from .controller import offload_model
from .loader import (LOADER_CATEGORY, LOADER_DESCRIPTION, LOADER_DISPLAY_NAME, LOADER_NODE_ID, LOADER_TOOLTIPS,
                     WEIGHT_DTYPES, diffusion_model_names, load_layerwise)


@functools.lru_cache(maxsize=None)
def core_checks_v3_combos() -> bool:
    """Whether this ComfyUI itself checks a V3 combo's value against its options when a prompt is queued
    ("Value not in list": 0.14.1 and 0.33.0 do; 0.3.75 checks only V1 combos, whose type is the options list)."""
    try:
        import inspect

        import execution  # ComfyUI's own module (main.py has imported it by the time nodes load)
        return "Combo.io_type" in inspect.getsource(execution.validate_inputs)
    except Exception:  # noqa: BLE001 - unknown: the V1 form below is checked by every ComfyUI
        return False


class _ListTypedCombo(io.Combo.Input):
    """A combo declared in the V1 form (its type is the list of options), which every ComfyUI checks itself when a
    prompt is queued; for a ComfyUI that does not check V3 combos (see :func:`core_checks_v3_combos`)."""

    def get_io_type(self):
        return list(self.options)


def _combo(*args, **kwargs) -> io.Combo.Input:
    return (io.Combo.Input if core_checks_v3_combos() else _ListTypedCombo)(*args, **kwargs)


def v3_input(spec: NodeInput):
    """``spec`` in the V3 form. ComfyUI checks residency_policy's value itself (on 0.3.75 only in the V1 form, see
    :func:`_combo`); host_store is checked by ``validate_inputs``, where the disk tier's availability is known."""
    common = dict(tooltip=spec.tooltip, optional=spec.optional)
    if spec.kind == "MODEL":
        return io.Model.Input(spec.name, **common)
    if spec.kind == "INT":
        return io.Int.Input(spec.name, default=spec.default, min=spec.minimum, max=spec.maximum, **common)
    if spec.kind == "BOOLEAN":
        return io.Boolean.Input(spec.name, default=spec.default, **common)
    combo = io.Combo.Input if spec.optional else _combo
    return combo(spec.name, options=list(spec.options), default=spec.default, **common)


class LayerwiseOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=CATEGORY,
            description=DESCRIPTION,
            inputs=[v3_input(spec) for spec in INPUTS],
            outputs=[io.Model.Output(tooltip="The same model with its transformer blocks offloaded.")],
        )

    @classmethod
    def validate_inputs(cls, host_store=None) -> bool | str:
        # host_store = disk is refused where the disk tier cannot run, so this input is checked here, and ComfyUI
        # then leaves it to us (a bad value too). Only host_store is named: ComfyUI reports a failure under every
        # input this function names (naming residency_policy too would report a bad host_store twice), and it
        # still checks the others' types, limits and (residency_policy) options itself.
        return host_store_problem(host_store) or True

    @classmethod
    def execute(cls, model, resident_layers, prefetch_size, residency_policy, pin_memory,
                host_store="auto") -> io.NodeOutput:
        return io.NodeOutput(offload_model(model, resident_layers, prefetch_size, residency_policy, pin_memory,
                                           host_store))


class LayerwiseOffloadStats(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=STATS_NODE_ID,
            display_name=STATS_DISPLAY_NAME,
            category=CATEGORY,
            description=STATS_DESCRIPTION,
            is_output_node=True,
            not_idempotent=True,
            inputs=[
                io.Model.Input("model", tooltip=STATS_TOOLTIPS["model"]),
                io.Latent.Input("after", optional=True, tooltip=STATS_TOOLTIPS["after"]),
            ],
            outputs=[io.String.Output(tooltip="The same text, for other nodes.")],
        )

    @classmethod
    def execute(cls, model, after=None) -> io.NodeOutput:
        shown, text = stats_ui(model, after_connected=after is not None)
        return io.NodeOutput(text, ui=shown)


class LayerwiseOffloadLoadDiffusionModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=LOADER_NODE_ID,
            display_name=LOADER_DISPLAY_NAME,
            category=LOADER_CATEGORY,
            description=LOADER_DESCRIPTION,
            inputs=[
                io.Combo.Input("unet_name", options=diffusion_model_names(), tooltip=LOADER_TOOLTIPS["unet_name"]),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                               tooltip=LOADER_TOOLTIPS["weight_dtype"]),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model, its unconverted weights left in the file.")],
        )

    @classmethod
    def validate_inputs(cls, weight_dtype=None) -> bool | str:
        if weight_dtype is not None and weight_dtype not in WEIGHT_DTYPES:
            return f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}"
        return True

    @classmethod
    def execute(cls, unet_name, weight_dtype="default") -> io.NodeOutput:
        return io.NodeOutput(load_layerwise(unet_name, weight_dtype))


class LayerwiseOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [LayerwiseOffload, LayerwiseOffloadStats, LayerwiseOffloadLoadDiffusionModel]


async def comfy_entrypoint() -> LayerwiseOffloadExtension:
    return LayerwiseOffloadExtension()
