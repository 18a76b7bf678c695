"""Every host-store entry starts 256 bytes aligned, in the buffer and on the device: cuBLASLt picks its kernel from
the pointers' alignment (up to 256), and a full load gives 512-aligned weights, so an entry pushed off 256 by a
small or odd-sized neighbour (fp32 scales of fp8 weights, biases, mixed dtypes) could change the output's bits."""

import torch
from torch import nn

from layerwise_offload.offload.host.packing import HostStore, block_parameters, plan_layout


class MixedBlock(nn.Module):
    """Odd sizes and mixed dtypes: every offset after the first would be off 256 at a smaller alignment."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)  # weight 140 B, bias 20 B (fp32)
        self.b = nn.Linear(3, 3).to(torch.bfloat16)  # 18 B, 6 B
        self.scale = nn.Parameter(torch.ones(1))  # 4 B, an fp8 weight's scale
        self.c = nn.Parameter(torch.zeros(13, dtype=torch.float16))
        self.t = nn.Parameter(torch.randn(6, 4).t())  # a transposed weight keeps its strides


def test_every_entry_and_every_view_is_256_aligned():
    blocks = [MixedBlock() for _ in range(3)]
    layouts = [plan_layout(block_parameters(b)) for b in blocks]
    store = HostStore(layouts)
    for i in range(len(blocks)):
        store.pack_block(i, pin=False)
        layout = layouts[i]
        assert len(layout.entries) == 7
        assert all(entry.offset % 256 == 0 for entry in layout.entries), [e.offset for e in layout.entries]
        assert layout.nbytes % 256 == 0
        assert store.buffers[i].data_ptr() % 4096 == 0
        assert all(view.data_ptr() % 256 == 0 for view in store.views(i))
        raw = torch.empty(layout.nbytes + 512, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 512
        device_slot = raw[start:start + layout.nbytes]  # a slot as the caching allocator gives one: 512-aligned
        device_slot.copy_(store.buffers[i])
        assert all(view.data_ptr() % 256 == 0 for view in layout.views(device_slot))
        for view, (name, param) in zip(store.weight_views(i), block_parameters(blocks[i])):
            assert torch.equal(view, param.data) and view.stride() == param.stride(), name
