"""`bench/bench_engine.py host-ram`: pinned / streamed host-store bytes of a toy DiT (target <= 1.01). On CUDA the real
pinner runs, with ``torch.cuda.host_memory_stats()`` beside it (zero: the store bypasses PyTorch's caching host
allocator); without a GPU a recording pinner stands in. Also what ``pin_memory=True`` would page-lock (each block
rounded up to a power of two), here and for Flux.1-dev bf16, and the bytes the residents no longer page-lock.
"""

from __future__ import annotations

import torch

from .. import offload
from ..devtools import toy_transformer as toy

MiB = 2**20


class RecordingPinner:
    """Stands in for cudaHostRegister without a GPU: grants every request and remembers its size."""

    def __init__(self):
        self.live = {}

    def register(self, tensor):
        self.live[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return True

    def unregister(self, tensor):
        self.live.pop(tensor.data_ptr())


def power_of_two(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length()


def pinned_for(device: torch.device, dim: int, blocks: int, resident: int) -> dict:
    model = toy.ToyTransformer(dim=dim, hidden=2 * dim, double=blocks // 2, single=blocks - blocks // 2)
    environment = offload.HostEnvironment(**({} if device.type == "cuda" else {"pinner": RecordingPinner()}))
    manager = offload.LayerwiseOffloadManager(model.blocks_in_call_order(), device, pin_memory=True,
                                              resident_layers=resident, environment=environment)
    manager.prepare()
    sizes = manager.block_nbytes()
    stats = manager.stats(synchronize=False)
    result = dict(sizes=sizes, streamed=sum(sizes[resident:]), requested=stats.host_bytes_requested,
                  pinned=stats.host_bytes_pinned, store=stats.host_bytes)
    ledger = manager.store.ledger  # looks inside: the pin ledger outlives the store, and shows detach unpinned all
    manager.detach()
    result["pinned_after_detach"] = ledger.bytes_pinned
    return result


def host_ram(args, device: torch.device) -> dict:
    pinner = "cudaHostRegister" if device.type == "cuda" else "recording stand-in (no GPU)"
    print(f"[layerwise-offload] host RAM bench: {args.blocks} blocks of dim {args.dim}, device {device}, "
          f"pinner: {pinner}")
    out = {}
    for resident in (0, args.resident):
        r = out[resident] = pinned_for(device, args.dim, args.blocks, resident)
        pow2 = sum(power_of_two(s) for s in r["sizes"][resident:])
        print(f"  resident {resident}: store {r['store'] / MiB:.1f} MiB, streamed {r['streamed'] / MiB:.1f} MiB, "
              f"requested {r['requested'] / MiB:.1f} MiB, pinned {r['pinned'] / MiB:.1f} MiB -> pinned / streamed = "
              f"{r['pinned'] / max(1, r['streamed']):.4f} (caching allocator would pin {pow2 / MiB:.1f} MiB = "
              f"{pow2 / max(1, r['streamed']):.3f}x); after detach {r['pinned_after_detach']} B pinned")
        if resident:
            saved = r["store"] - r["streamed"]
            print(f"  residents keep a pageable host copy: {saved / MiB:.1f} MiB of RAM not page-locked "
                  f"({saved / r['store']:.0%} of the store)")
    flux = 19 * [648 * MiB] + 38 * [270 * MiB]
    print(f"  Flux.1-dev bf16 blocks: exact {sum(flux) / 2**30:.1f} GiB vs power-of-two rounding "
          f"{sum(map(power_of_two, flux)) / 2**30:.1f} GiB ({sum(map(power_of_two, flux)) / sum(flux):.2f}x)")
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        print(f"  torch.cuda.host_memory_stats(): {dict((k, v) for k, v in stats.items() if 'bytes' in k)}")
    return out


# ----------------------------------------------------------------- the disk tier
