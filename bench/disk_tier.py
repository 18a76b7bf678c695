"""The disk tier's read rate per step against a plain O_DIRECT read of the same file, in the same run.

    python bench/disk_tier.py [--device cpu|cuda] [--dim 2048] [--blocks 16] [--steps 4] [--folder DIR]
                              [--source cache|checkpoint]

Packs a toy DiT (blocks of ``4 * dim**2`` fp32 parameters: 64 MiB at dim 2048) with ``host_store="disk"``, runs
``--steps`` forwards and reports, per step in the steady state. ``--source cache`` (default): every block's host
copy in the tier's cache file. ``--source checkpoint``: the blocks are saved once as a .safetensors checkpoint
in the folder (then dropped from the page cache), the model's weights become the file's mapped tensors (what
Load Diffusion Model (Layerwise) does), and the tier reads each block's extents straight from the checkpoint;
the plain read is then of the checkpoint. Reported:
- disk bytes read per step against the disk blocks' stored bytes (target: equal);
- the tier's read rate (bytes / wall time with a read in flight) against a plain sequential O_DIRECT read loop
  over the same cache file with the same request size, measured right after in the same process (target >= 0.8);
- the stall the reads caused (host time waiting for a read a copy needed);
- anonymous RSS growth while the model is offloaded, against non-block weights + staging ring (+ on the CPU
  loopback the "device" slots, host memory there) (target <= that + 5 %).
Results are written to bench/results/disk_tier_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]


def import_pack():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
    comfy_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comfy_env)
    return comfy_env.import_pack_modules("offload", root=REPO_ROOT)[0]


offload = import_pack() if __name__ == "__main__" else None
MiB = 2**20


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.a, self.b = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def anon_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def plain_direct_read(path: str, chunk: int, repeats: int = 2) -> float:
    """GB/s of a sequential O_DIRECT read loop over ``path`` into one page-aligned buffer."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags)
    area = mmap.mmap(-1, chunk)
    view = memoryview(area)
    size = os.fstat(fd).st_size
    best = 0.0
    try:
        for _ in range(repeats):
            start, offset = time.perf_counter(), 0
            while offset < size:
                # O_DIRECT lengths are whole pages: the last one reads short at the end of the file.
                got = os.preadv(fd, [view[:min(chunk, -(-(size - offset) // 4096) * 4096)]], offset)
                if got <= 0:
                    break
                offset += got
            best = max(best, size / (time.perf_counter() - start) / 1e9)
    finally:
        os.close(fd)
    return best


def checkpoint_blocks(blocks: nn.ModuleList, folder: str):
    """Save ``blocks`` as a safetensors checkpoint in ``folder``, out of the page cache, and give back the file and
    blocks whose weights are its mapped tensors (the RAM copies freed)."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"layerwise-offload-bench-{os.getpid()}.safetensors")
    save_file({k: v.contiguous() for k, v in blocks.state_dict().items()}, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    checkpoint = offload.CheckpointFile(path)
    blocks.load_state_dict(checkpoint.state_dict(), assign=True)
    return checkpoint, blocks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--folder", default=None, help="the cache file's folder (default: the pack's default)")
    parser.add_argument("--source", choices=("cache", "checkpoint"), default="cache")
    args = parser.parse_args()
    torch.manual_seed(0)
    before = anon_rss()
    blocks = nn.ModuleList(Block(args.dim) for _ in range(args.blocks))
    checkpoint = None
    if args.source == "checkpoint":
        checkpoint, blocks = checkpoint_blocks(blocks, args.folder or offload.default_disk_folder())
        before = anon_rss()
    x = torch.randn(1, 4, args.dim, device=args.device)
    manager = offload.LayerwiseOffloadManager(list(blocks), args.device, resident_layers=0, host_store="disk",
                                              environment=offload.HostEnvironment(disk_folder=args.folder))
    manager.attach()
    per_step, stalls = [], []
    with torch.no_grad():
        for _ in range(args.steps):
            read, stall = manager.stats().disk_bytes_read, manager.stats().disk_stall_seconds
            h = x
            for block in blocks:
                h = block(h)
            stats = manager.stats()
            per_step.append(stats.disk_bytes_read - read)
            stalls.append(stats.disk_stall_seconds - stall)
    grown = anon_rss() - before
    stats = manager.stats()
    disk = manager.host.disk  # looks inside: the cache file's path, to time a plain read of the same file
    chunk = offload.disk.tier.CHUNK_BYTES
    source_path = checkpoint.path if checkpoint is not None else disk.file.path
    plain = plain_direct_read(source_path, chunk)
    tier_gbps = stats.disk_bytes_read / stats.disk_read_seconds / 1e9 if stats.disk_read_seconds else 0.0
    slots = (manager.config.prefetch_size + 1) * max(manager.block_nbytes()) if args.device == "cpu" else 0
    allowed = 1.05 * (stats.staging_bytes + slots)
    result = {
        "device": args.device, "blocks": args.blocks, "block_bytes": max(manager.block_nbytes()),
        "source": args.source, "disk_blocks": stats.disk_blocks, "checkpoint_blocks": stats.disk_checkpoint_blocks,
        "disk_stored_bytes": stats.disk_bytes, "o_direct": checkpoint is None and disk.file.direct,
        "disk_bytes_read_per_step": per_step, "steady_read_equals_stored": per_step[-1] == stats.disk_bytes,
        "tier_read_gbps": round(tier_gbps, 3), "plain_o_direct_read_gbps": round(plain, 3),
        "ratio": round(tier_gbps / plain, 3) if plain else None, "stall_seconds_per_step": [round(s, 4) for s in stalls],
        "rss_growth_bytes": grown, "staging_bytes": stats.staging_bytes, "loopback_slot_bytes": slots,
        "rss_growth_within_target": grown <= allowed, "folder": disk.folder, "read_file": source_path,
    }
    manager.detach()
    if checkpoint is not None:
        os.unlink(checkpoint.path)
    print(json.dumps(result, indent=2))
    suffix = "_checkpoint" if args.source == "checkpoint" else ""
    out = REPO_ROOT / "bench" / "results" / f"disk_tier_{args.device.split(':')[0]}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[layerwise-offload] wrote {out}")


if __name__ == "__main__":
    main()
