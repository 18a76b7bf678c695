"""Micro-benchmarks of the offload engine on toy models, without ComfyUI.

    python -P bench/bench_engine.py [engine] [--device cpu|cuda] [--json OUT] [--repeats N]   # (a) and (b)
    python -P bench/bench_engine.py host-ram [--device cpu|cuda] [--dim 1024] [--blocks 8] [--resident 3]
    python -P bench/bench_engine.py disk [--dim 2048] [--blocks 16] [--steps 4] [--folder DIR] [--source checkpoint]
                                         [--tight-ring]

(a) Hook overhead: tiny blocks run bare, with no-op forward hooks (PyTorch's own hook dispatch) and with the manager,
    every block resident (what remains is its per-block bookkeeping). (b) Copy throughput: large blocks, negligible
    compute, every block streamed: the manager's copy rate and end-to-end rate against ONE plain ``copy_`` of the
    same bytes (on the CPU loopback the manager can beat it: its small slots stay in the CPU cache, the plain copy
    writes a cold buffer as large as the model; the copy ratio speaks for the hardware only on CUDA). Variants are
    timed interleaved and summarised by medians, so drift hits them alike: the ratios are the result.
host-ram (bench/bench_host_ram.py) and disk (bench/bench_disk.py): what each measures is said there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402
from torch import nn  # noqa: E402

from .bench_disk import disk  # noqa: E402
from .bench_host_ram import host_ram  # noqa: E402
from .measure import seconds  # noqa: E402
from .. import offload  # noqa: E402
from ..devtools import toy_transformer as toy  # noqa: E402

MiB = 2**20


def interleaved(variants: dict, cuda: bool, repeats: int, inner: int = 1) -> dict:
    """Time each variant ``repeats`` times, rotating the order every round; lists of seconds."""
    names = list(variants)
    samples = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(seconds(variants[name], cuda, inner))
    return samples


# ----------------------------------------------------------------- (a) hook overhead
def bench_hooks(device: torch.device, num_blocks: int, repeats: int, inner: int) -> dict:
    def build():
        return toy.ToyTransformer(dim=8, hidden=8, double=0, single=num_blocks, seed=0).to(device)

    bare, noop, managed = build(), build(), build()
    for module in noop.blocks_in_call_order() + [noop]:
        module.register_forward_pre_hook(lambda m, a: None)
        module.register_forward_hook(lambda m, a, o: None, always_call=True)
    manager = offload.apply_layerwise_offload(managed.blocks_in_call_order(), device, root=managed,
                                              resident_layers=num_blocks, prefetch_size=1)
    x = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        reference = bare(x)
        for model in (noop, managed):
            for _ in range(3):  # warm up; the first managed forward arms the plan
                out = model(x)
            if not torch.equal(out, reference):
                raise SystemExit("[layerwise-offload] bench: hooked model output differs from the bare model")
        samples = interleaved({"bare": lambda: bare(x), "noop_hooks": lambda: noop(x), "manager": lambda: managed(x)},
                              device.type == "cuda", repeats, inner)
    stats = manager.stats()
    if stats.copies_issued != stats.resident_blocks or stats.streamed_blocks != 0:
        raise SystemExit(f"[layerwise-offload] bench: expected only the {num_blocks} resident copies, got {stats}")
    med = {name: statistics.median(values) for name, values in samples.items()}
    per_block_us = lambda a, b: (med[a] - med[b]) / num_blocks * 1e6  # noqa: E731
    iqr = lambda v: (lambda q: q[2] - q[0])(statistics.quantiles(v, n=4))  # noqa: E731
    return {
        "num_blocks": num_blocks, "repeats": repeats, "forwards_per_sample": inner,
        "median_forward_us": {name: value * 1e6 for name, value in med.items()},
        "iqr_forward_us": {name: iqr(values) * 1e6 for name, values in samples.items()},
        "ratio_manager_vs_bare": med["manager"] / med["bare"],
        "ratio_noop_hooks_vs_bare": med["noop_hooks"] / med["bare"],
        "manager_overhead_us_per_block": per_block_us("manager", "bare"),
        "noop_hook_overhead_us_per_block": per_block_us("noop_hooks", "bare"),
        "manager_logic_us_per_block": per_block_us("manager", "noop_hooks"),
        "bare_us_per_block": med["bare"] / num_blocks * 1e6,
    }


# ----------------------------------------------------------------- (b) copy throughput
class FatBlock(nn.Module):
    """Large weights, negligible compute: the forward reads one row, so the time is the copy."""

    def __init__(self, nbytes: int, dim: int = 64):
        super().__init__()
        self.weight = nn.Parameter(torch.full((max(1, nbytes // 4 // dim), dim), 1e-3))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x + self.weight[0] + self.bias


def bench_copies(device: torch.device, num_blocks: int, block_bytes: int, repeats: int, prefetch: int) -> dict:
    cuda = device.type == "cuda"
    blocks = nn.ModuleList(FatBlock(block_bytes) for _ in range(num_blocks))
    model = nn.Sequential(*blocks)
    manager = offload.apply_layerwise_offload(list(blocks), device, root=model, resident_layers=0,
                                              prefetch_size=prefetch)
    sizes = manager.block_nbytes()
    total = sum(sizes)
    x = torch.zeros(1, 64, device=device)
    src = torch.ones(total, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(total, dtype=torch.uint8, device=device)

    def plain_copy():  # on CUDA one async copy from pinned memory on the current stream, bracketed by the events
        dst.copy_(src, non_blocking=cuda)

    def forward_only():
        model(x)
        if cuda:  # count the copies this forward queued ahead (the wrap-around prefetch) in its time too
            # Looks inside: the manager's copy stream, which a forward leaves running by design.
            torch.cuda.current_stream(device).wait_stream(manager.engine.backend.copy_stream)

    per_forward = {"bytes": [], "copy_seconds": []}
    samples = {"plain_copy": [], "manager_forward": []}
    with torch.inference_mode():
        for _ in range(2):  # warm up: arm (build the host store) and touch every page of src/dst
            model(x)
            plain_copy()
        for round_index in range(repeats):
            order = [("plain_copy", plain_copy), ("manager_forward", forward_only)][::-1 if round_index % 2 else 1]
            for name, fn in order:
                if name == "plain_copy":
                    samples[name].append(seconds(fn, cuda))
                    continue
                before = manager.stats(synchronize=True)  # stats() synchronizes: read around the timed forward
                samples[name].append(seconds(fn, cuda))
                after = manager.stats(synchronize=True)
                per_forward["bytes"].append(after.bytes_copied - before.bytes_copied)
                per_forward["copy_seconds"].append(after.copy_seconds - before.copy_seconds)
    stats = manager.stats()
    moved = statistics.median(per_forward["bytes"])
    plain_s, forward_s = statistics.median(samples["plain_copy"]), statistics.median(samples["manager_forward"])
    copy_s = statistics.median(per_forward["copy_seconds"])
    plain_bps, forward_bps = total / plain_s, moved / forward_s
    copy_bps = moved / copy_s if copy_s > 0 else float("nan")
    return {
        "num_blocks": num_blocks, "block_bytes": sizes[0], "total_bytes": total, "prefetch_size": prefetch,
        "repeats": repeats, "pinned_host_bytes": stats.pinned_host_bytes, "bytes_per_forward": moved,
        "copies_per_forward": stats.copies_last_forward, "demand_copies_total": stats.demand_copies,
        "peak_materialized_blocks": stats.peak_materialized_blocks,
        "median_seconds": {"plain_copy": plain_s, "manager_forward": forward_s, "manager_copies": copy_s},
        "gb_per_s": {"plain_copy": plain_bps / 1e9, "manager_copies": copy_bps / 1e9,
                     "manager_forward": forward_bps / 1e9},
        "ratio_manager_copies_vs_plain": copy_bps / plain_bps,
        "ratio_manager_forward_vs_plain": forward_bps / plain_bps,
        "stall_seconds_total": stats.stall_seconds,
    }


def print_engine(result: dict) -> None:
    hooks, copies = result["hooks"], result["copies"]
    med, spread, n = hooks["median_forward_us"], hooks["iqr_forward_us"], hooks["num_blocks"]
    print(f"[layerwise-offload] bench: torch {result['torch']}, device {result['device']} ({result['device_name']}), "
          f"{result['threads']} CPU threads\n\n(a) hook overhead, {n} tiny blocks all resident, median of "
          f"{hooks['repeats']} interleaved samples x {hooks['forwards_per_sample']} forwards")
    for name in ("bare", "noop_hooks", "manager"):
        print(f"  {name:<12} {med[name]:>10.1f} us per forward (IQR {spread[name]:.1f}), {med[name] / n:.2f} us/block, "
              f"{med[name] / med['bare']:.3f}x bare")
    print(f"  manager overhead: {hooks['manager_overhead_us_per_block']:.2f} us/block over bare "
          f"({hooks['noop_hook_overhead_us_per_block']:.2f} us of it is PyTorch's hook dispatch, "
          f"{hooks['manager_logic_us_per_block']:.2f} us the manager's own work)")
    print(f"\n(b) host-store materialization, {copies['num_blocks']} streamed blocks x "
          f"{copies['block_bytes'] / MiB:.1f} MiB = {copies['total_bytes'] / MiB:.0f} MiB per forward, prefetch "
          f"{copies['prefetch_size']}, pinned {copies['pinned_host_bytes'] / MiB:.0f} MiB, median of "
          f"{copies['repeats']}")
    secs, gbps = copies["median_seconds"], copies["gb_per_s"]
    for label, key in (("one plain dst.copy_(src)", "plain_copy"), ("manager copies (stats.copy_seconds)",
                       "manager_copies"), ("manager forward (end to end)", "manager_forward")):
        print(f"  {label:<36} {secs[key] * 1e3:9.2f} ms {gbps[key]:8.2f} GB/s {gbps[key] / gbps['plain_copy']:.3f}x")
    print(f"  bytes/forward {copies['bytes_per_forward'] / MiB:.0f} MiB in {copies['copies_per_forward']} copies, "
          f"peak materialized blocks {copies['peak_materialized_blocks']}, "
          f"demand copies {copies['demand_copies_total']}")
    print(f"\n[layerwise-offload] bench ratios: hook manager/bare {hooks['ratio_manager_vs_bare']:.3f} "
          f"({hooks['manager_overhead_us_per_block']:.2f} us/block); copies vs one plain copy "
          f"{copies['ratio_manager_copies_vs_plain']:.3f}, forward vs one plain copy "
          f"{copies['ratio_manager_forward_vs_plain']:.3f}")


def engine(args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    repeats = args.repeats if args.repeats is not None else (30 if cuda else 15)
    block_mib = args.block_mib if args.block_mib is not None else (32.0 if cuda else 8.0)
    result = {
        "torch": torch.__version__, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "host (CPU loopback)",
        "threads": torch.get_num_threads(),
        "hooks": bench_hooks(device, args.hook_blocks, repeats=max(repeats, 41), inner=5),
        "copies": bench_copies(device, args.stream_blocks, int(block_mib * MiB), repeats, args.prefetch),
    }
    print_engine(result)
    return result


# ----------------------------------------------------------------- host RAM

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"engine": engine, "host-ram": host_ram, "disk": disk}  # each (args, device) -> a JSON-able dict
    if not argv or argv[0] not in (*commands, "-h", "--help"):
        argv.insert(0, "engine")  # `bench_engine.py [--device ...]`: the hook and copy benchmarks
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available; disk: cpu)")
    common.add_argument("--json", default=None, help="also write the results to this JSON file")
    p = sub.add_parser("engine", parents=[common], help="(a) hook overhead and (b) copy throughput")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default 1 on the CPU: on a busy 2-core host, tiny ops spread "
                        "over 2 threads run 50x slower and drown what is measured; CUDA: unchanged)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved samples per variant")
    p.add_argument("--hook-blocks", type=int, default=96, help="tiny blocks in the hook benchmark")
    p.add_argument("--stream-blocks", type=int, default=32, help="streamed blocks in the copy benchmark")
    p.add_argument("--block-mib", type=float, default=None, help="MiB per streamed block (default 8 CPU, 32 CUDA)")
    p.add_argument("--prefetch", type=int, default=1, help="prefetch_size for the copy benchmark")
    p = sub.add_parser("host-ram", parents=[common], help="pinned / streamed host-store bytes")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--resident", type=int, default=3)
    p = sub.add_parser("disk", parents=[common], help="the disk tier's reads against a plain O_DIRECT read")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--folder", default=None, help="the cache file's folder (default: the pack's default)")
    p.add_argument("--source", choices=("cache", "checkpoint"), default="cache")
    p.add_argument("--tight-ring", action="store_true",
                   help="read through the small ring RAM-short plans take (2 x 4 MiB) instead of 2 x 16 MiB")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and args.command != "disk" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("[layerwise-offload] bench: --device cuda, but torch.cuda.is_available() is False")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"[layerwise-offload] bench: --device must be cpu or cuda, got {args.device!r}")
    if args.command == "engine" and (args.threads or device.type == "cpu"):
        torch.set_num_threads(args.threads or 1)
    started = time.perf_counter()
    result = commands[args.command](args, device)
    if args.command == "engine":
        result["seconds"] = time.perf_counter() - started
    print(f"[layerwise-offload] bench took {time.perf_counter() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"[layerwise-offload] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
