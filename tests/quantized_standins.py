"""Small stand-ins for quantized weights that are tensor subclasses, for the unit tests to share.

Two small subclasses stand in for the real ones (ComfyUI's QuantizedTensor, ComfyUI-GGUF's GGMLTensor; those run
in tests/comfy): a wrapper subclass with the flatten protocol whose scale is a separate inner tensor, and a
storage subclass whose metadata is a Python attribute. :func:`quantized_toy` is a :class:`ToyTransformer` whose
Linear weights are the one and whose gates the other.
"""

import torch
from torch import nn
from torch.utils._pytree import tree_map

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload.weights import register_storage_subclass

__all__ = ["ScaledInt8", "TaggedBytes", "quantized_toy"]


class ScaledInt8(torch.Tensor):
    """int8 data times a per-row float scale; any op other than detach sees the dequantized float tensor."""

    @staticmethod
    def __new__(cls, qdata, scale, note):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata, scale, note):
        self.qdata, self.scale, self.note = qdata, scale, note

    @classmethod
    def quantize(cls, weight):
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        return cls(torch.round(weight / scale).to(torch.int8), scale, "per-row")

    def dequantize(self):
        return self.qdata.float() * self.scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"note": self.note}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ScaledInt8(inner["qdata"], inner["scale"], ctx["note"])

    ops_seen = []  # every op dispatched on a ScaledInt8, to check what the manager does to the weights

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.ops_seen.append(func)
        if func is torch.ops.aten.detach.default:
            return ScaledInt8(args[0].qdata, args[0].scale, args[0].note)
        unwrap = lambda t: t.dequantize() if isinstance(t, ScaledInt8) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class TaggedBytes(torch.Tensor):
    """Bytes in its own storage plus a Python attribute, like GGMLTensor."""


register_storage_subclass(TaggedBytes)


def quantized_toy(seed=0):
    model = ToyTransformer(seed=seed)
    for block in model.blocks_in_call_order():
        for linear in (block.mix, block.up, block.down):
            linear.weight = nn.Parameter(ScaledInt8.quantize(linear.weight.detach()), requires_grad=False)
        block.gate = nn.Parameter(block.gate.detach().clone().as_subclass(TaggedBytes), requires_grad=False)
        block.gate.tag = "gate"
    return model
