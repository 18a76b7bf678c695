"""`bench/bench_engine.py disk`: the disk tier (``host_store="disk"``) over ``--steps`` forwards: bytes read per step
against the disk blocks' stored bytes (target: equal); its read rate against a plain sequential O_DIRECT read of the
same file with the same request size, right after (target >= 0.8); the stall the reads caused; anonymous RSS growth
against the staging ring + on the CPU loopback the "device" slots (target <= that + 5 %). ``--source checkpoint``:
the blocks saved once as .safetensors (then dropped from the page cache), mapped as Load Diffusion Model (Layerwise)
maps them, and read from there. ``--tight-ring``: through the ring RAM-short plans take (2 x 4 MiB, 1 MiB requests),
the plain read keeping the usual request size. Written to
bench/results/disk_tier_<device>[_checkpoint][_tight].json.
"""

from __future__ import annotations

import json
import mmap
import os
import time

import torch
from torch import nn

from .measure import RESULTS
from .. import offload

MiB = 2**20


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.a, self.b = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def anon_rss() -> int:
    with open("/proc/self/status") as status:
        return next((int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:")), 0)


def plain_direct_read(path: str, chunk: int, repeats: int = 2) -> float:
    """GB/s of a sequential O_DIRECT read loop over ``path`` into one page-aligned buffer."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    view = memoryview(mmap.mmap(-1, chunk))
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


def disk(args, device: torch.device) -> dict:
    usual_chunk = offload.disk.tier.CHUNK_BYTES
    if args.tight_ring:  # the ring a RAM-short plan reads through: its chunks, and so its requests, smaller
        offload.disk.tier.CHUNK_BYTES = offload.disk.tier.TIGHT_CHUNK_BYTES
    try:
        return _disk(args, device, usual_chunk)
    finally:
        offload.disk.tier.CHUNK_BYTES = usual_chunk


def _disk(args, device: torch.device, usual_chunk: int) -> dict:
    torch.manual_seed(0)
    before = anon_rss()
    blocks = nn.ModuleList(Block(args.dim) for _ in range(args.blocks))
    checkpoint = None
    if args.source == "checkpoint":
        checkpoint, blocks = checkpoint_blocks(blocks, args.folder or offload.default_disk_folder())
        before = anon_rss()
    x = torch.randn(1, 4, args.dim, device=device)
    manager = offload.LayerwiseOffloadManager(list(blocks), device, resident_layers=0, host_store="disk",
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
    # Looks inside: the cache file's path and the tier's request size, to time a plain read of the same file.
    cache = manager.engine.host.disk
    source_path = checkpoint.path if checkpoint is not None else cache.file.path
    plain = plain_direct_read(source_path, usual_chunk)
    tier_gbps = stats.disk_bytes_read / stats.disk_read_seconds / 1e9 if stats.disk_read_seconds else 0.0
    slots = manager.device_bytes(manager.config) if device.type == "cpu" else 0  # nothing resident: only the slots
    result = {
        "device": str(device), "blocks": args.blocks, "block_bytes": max(manager.block_nbytes()),
        "source": args.source, "disk_blocks": stats.disk_blocks, "checkpoint_blocks": stats.disk_checkpoint_blocks,
        "disk_stored_bytes": stats.disk_bytes, "o_direct": checkpoint is None and cache.file.direct,
        "disk_bytes_read_per_step": per_step, "steady_read_equals_stored": per_step[-1] == stats.disk_bytes,
        "tier_read_gbps": round(tier_gbps, 3), "plain_o_direct_read_gbps": round(plain, 3),
        "ratio": round(tier_gbps / plain, 3) if plain else None,
        "stall_seconds_per_step": [round(s, 4) for s in stalls], "rss_growth_bytes": grown,
        "staging_bytes": stats.staging_bytes, "loopback_slot_bytes": slots,
        "rss_growth_within_target": grown <= 1.05 * (stats.staging_bytes + slots), "folder": cache.folder,
        "read_file": source_path, "tight_ring": bool(args.tight_ring),
    }
    manager.detach()
    if checkpoint is not None:
        os.unlink(checkpoint.path)
    print(json.dumps(result, indent=2))
    args.json = args.json or str(RESULTS / (f"disk_tier_{device.type}{'_checkpoint' if checkpoint else ''}"
                                            f"{'_tight' if args.tight_ring else ''}.json"))
    return result
