"""The node for ComfyUI's V3 schema (comfy_api.latest)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .offload_node import (CATEGORY, DEFAULTS, DESCRIPTION, DISPLAY_NAME, MAX_PREFETCH, MAX_RESIDENT_LAYERS, NODE_ID,
                           POLICIES, TOOLTIPS, offload_model)


class LayerwiseOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=CATEGORY,
            description=DESCRIPTION,
            inputs=[
                io.Model.Input("model", tooltip=TOOLTIPS["model"]),
                io.Int.Input("resident_layers", default=DEFAULTS["resident_layers"], min=0, max=MAX_RESIDENT_LAYERS,
                             tooltip=TOOLTIPS["resident_layers"]),
                io.Int.Input("prefetch_size", default=DEFAULTS["prefetch_size"], min=1, max=MAX_PREFETCH,
                             tooltip=TOOLTIPS["prefetch_size"]),
                io.Combo.Input("residency_policy", options=list(POLICIES), default=DEFAULTS["residency_policy"],
                               tooltip=TOOLTIPS["residency_policy"]),
                io.Boolean.Input("pin_memory", default=DEFAULTS["pin_memory"], tooltip=TOOLTIPS["pin_memory"]),
            ],
            outputs=[io.Model.Output(tooltip="The same model with its transformer blocks offloaded.")],
        )

    @classmethod
    def execute(cls, model, resident_layers, prefetch_size, residency_policy, pin_memory) -> io.NodeOutput:
        return io.NodeOutput(offload_model(model, resident_layers, prefetch_size, residency_policy, pin_memory))


class LayerwiseOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [LayerwiseOffload]


async def comfy_entrypoint() -> LayerwiseOffloadExtension:
    return LayerwiseOffloadExtension()
