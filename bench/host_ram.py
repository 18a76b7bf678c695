"""Host RAM figures of the offload's host store: page-locked bytes against streamed bytes, and what residents save.

    python bench/host_ram.py [--device cpu|cuda] [--dim 1024] [--blocks 8] [--resident 3]

Packs a toy DiT (blocks of ``8 * dim**2`` fp32 parameters: 32 MiB at dim 1024) and prints:
- pinned / streamed store bytes (target <= 1.01). On CUDA the real pinner (cudaHostRegister) runs and
  ``torch.cuda.host_memory_stats()`` is printed beside it: the store no longer goes through PyTorch's
  caching host allocator, so its figures stay at zero. Without a GPU a recording pinner stands in for the
  CUDA calls and the ledger of requested sizes is what is measured;
- what ``torch.empty(pin_memory=True)`` would have page-locked for the same blocks (each rounded up to a power
  of two by the caching host allocator), here and for Flux.1-dev bf16 (19 x 648 + 38 x 270 MiB);
- the page-locked bytes the residents no longer take (their host copy stays pageable).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def import_pack():
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
    comfy_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comfy_env)
    return comfy_env.import_pack_modules("offload", "devtools.toy_transformer", root=REPO_ROOT)


offload, toy = import_pack()

import torch  # noqa: E402

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


def pinned_for(device: torch.device, dim: int, blocks: int, resident: int):
    model = toy.ToyTransformer(dim=dim, hidden=2 * dim, double=blocks // 2, single=blocks - blocks // 2)
    environment = offload.HostEnvironment(**({} if device.type == "cuda" else {"pinner": RecordingPinner()}))
    manager = offload.LayerwiseOffloadManager(model.blocks_in_call_order(), device, pin_memory=True,
                                              resident_layers=resident, environment=environment)
    manager.prepare()
    sizes = manager.block_nbytes()
    streamed = sum(sizes[resident:])
    stats = manager.stats(synchronize=False)
    result = dict(sizes=sizes, streamed=streamed, requested=stats.host_bytes_requested,
                  pinned=stats.host_bytes_pinned, store=stats.host_bytes)
    ledger = manager.store.ledger  # looks inside: the pin ledger outlives the store, and shows detach unpinned all
    manager.detach()
    result["pinned_after_detach"] = ledger.bytes_pinned
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--resident", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    pinner = "cudaHostRegister" if device.type == "cuda" else "recording stand-in (no GPU)"
    print(f"[layerwise-offload] host RAM bench: {args.blocks} blocks of dim {args.dim}, device {device}, "
          f"pinner: {pinner}")
    for resident in (0, args.resident):
        r = pinned_for(device, args.dim, args.blocks, resident)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
