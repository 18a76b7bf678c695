"""What a run tells the timing model about its model (offload/timing/costs.py ``model_costs``): the weight format sets
the host time per streamed block, narrow weights the per-forward casts, a LoRA on the device its math."""

import torch
from torch import nn

from layerwise_offload.offload.timing import costs as gpu_costs
from layerwise_offload.offload.weights import cast_nbytes, register_storage_subclass, weight_format


class PackedInt8(torch.Tensor):
    """A flatten-protocol weight (ComfyUI's QuantizedTensor's kind): int8 data and a scale, float32 outside."""

    @staticmethod
    def __new__(cls, qdata, scale):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata, scale):
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return PackedInt8(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter detaches what it wraps
            return PackedInt8(args[0].qdata, args[0].scale)
        raise NotImplementedError(func)


class GGMLLike(torch.Tensor):
    """A storage subclass (ComfyUI-GGUF's GGMLTensor's kind): quantized bytes, the logical shape an attribute."""


register_storage_subclass(GGMLLike)


def block(weight: torch.Tensor, bias_dtype=torch.bfloat16) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.bias = nn.Parameter(torch.zeros(8, dtype=bias_dtype), requires_grad=False)
    return module


def test_plain_16_bit_blocks_are_bf16_and_cast_nothing():
    blocks = [block(torch.zeros(8, 16, dtype=torch.bfloat16)) for _ in range(3)]
    assert weight_format(blocks) == "bf16"
    assert cast_nbytes(blocks[0], 2) == 0
    costs = gpu_costs.model_costs(blocks, [272] * 3, [1.0] * 3, compute_itemsize=2)
    assert costs.cast_bytes is None and costs.lora_bytes is None
    assert costs.host_s_per_streamed_block == gpu_costs.HOST_S_PER_STREAMED_BLOCK


def test_fp8_weights_cast_to_the_compute_dtype_every_forward():
    fp8 = block(torch.zeros(8, 16, dtype=torch.float8_e4m3fn))
    assert weight_format([fp8]) == "fp8"
    # read 128 fp8 bytes, write 128 elements at 2 bytes; the bf16 bias is not cast
    assert cast_nbytes(fp8, 2) == 128 + 128 * 2
    costs = gpu_costs.model_costs([fp8], [144], [1.0], compute_itemsize=2)
    assert costs.cast_bytes == (384,)
    assert costs.host_s_per_streamed_block == gpu_costs.HOST_S_PER_STREAMED_BLOCK_FP8


def test_a_flatten_protocol_weight_is_quantized_and_casts_its_logical_elements():
    weight = PackedInt8(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 1))
    quantized = block(weight)
    assert weight_format([quantized]) == "quantized"
    assert cast_nbytes(quantized, 2) == (128 + 8 * 4) + 128 * 2  # its parts read, 128 elements written
    costs = gpu_costs.model_costs([quantized], [176], [1.0], compute_itemsize=2)
    assert costs.host_s_per_streamed_block == gpu_costs.HOST_S_PER_STREAMED_BLOCK_QUANTIZED


def test_a_gguf_weight_casts_the_elements_of_its_logical_shape():
    data = torch.zeros(36, dtype=torch.uint8).as_subclass(GGMLLike)  # Q4_0-ish: 64 weights in 36 bytes
    data.tensor_shape = torch.Size((4, 16))
    gguf = block(data)
    gguf.weight.tensor_shape = data.tensor_shape  # nn.Parameter keeps the subclass and its attributes
    assert weight_format([gguf, block(torch.zeros(8, 16, dtype=torch.bfloat16))]) == "gguf"
    assert cast_nbytes(gguf, 2) == 36 + 64 * 2
    costs = gpu_costs.model_costs([gguf], [52], [1.0], compute_itemsize=2)
    assert costs.host_s_per_streamed_block == gpu_costs.HOST_S_PER_STREAMED_BLOCK_GGUF


def test_a_lora_on_the_device_costs_its_weights_math_per_block():
    blocks = [block(torch.zeros(8, 16, dtype=torch.bfloat16)) for _ in range(2)]
    costs = gpu_costs.model_costs(blocks, [272] * 2, [1.0] * 2, compute_itemsize=2, lora_weights=[128, 0])
    assert costs.lora_bytes == (128 * gpu_costs.LORA_BYTES_PER_WEIGHT, 0)
