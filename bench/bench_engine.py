"""Micro-benchmark of the offload engine: hook overhead and host-store copy throughput.

    python bench/bench_engine.py [--device cpu|cuda] [--json OUT] [--repeats N]

(a) Hook overhead. A model of many tiny blocks (so the per-block hook cost dominates) runs bare, with
    no-op forward hooks (PyTorch's own hook dispatch), and with the manager attached and every block
    resident (nothing is copied, so what remains is the manager's per-block bookkeeping). Reported as
    the ratio of forward times and as microseconds per block.
(b) Materialization throughput. A model whose blocks are large but whose compute is negligible runs
    with every block streamed (resident_layers=0). The manager's copy throughput (bytes_copied over
    copy_seconds from ``manager.stats()``) and its end-to-end throughput (bytes moved per forward over
    the forward's time) are compared with ONE plain ``dst.copy_(src)`` of the same number of bytes.

All variants are timed interleaved in one run and summarised by medians, so drift (clock boosts,
other processes) hits them alike. On CUDA the host side is pinned and timing uses CUDA events; on
the CPU the manager loops back onto the host (copies are host-to-host) and timing uses the clock.
Absolute times mean little on the CPU loopback; the ratios are the result. On the CPU loopback the
manager's copies can beat one plain copy (ratio > 1): its destination is a ring of prefetch+1 small
slots that stays in the CPU cache, while the plain copy writes a cold buffer as large as the model.
The copy ratio only speaks for the hardware on CUDA, where the destination is device memory.

The pack is imported as the package ``layerwise_offload`` without putting the repository root on
sys.path (its nodes/ folder would shadow ComfyUI's ``nodes``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def import_pack():
    """The pack's modules, imported the way tests do it (devtools/comfy_env.py, loaded by path)."""
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
    comfy_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comfy_env)
    return comfy_env.import_pack_modules("offload", "devtools.toy_transformer", root=REPO_ROOT)


offload, toy = import_pack()

import torch  # noqa: E402
from torch import nn  # noqa: E402


# ----------------------------------------------------------------- timing
class Timer:
    """Seconds of a callable: CUDA events on a GPU (after a sync), the clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, inner: int = 1) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0 / inner
        begin = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - begin) / inner


def interleaved(variants: dict, timer: Timer, repeats: int, inner: int = 1) -> dict:
    """Time each variant ``repeats`` times, rotating the order every round; lists of seconds."""
    names = list(variants)
    samples = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timer(variants[name], inner))
    return samples


def iqr(values) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


# ----------------------------------------------------------------- (a) hook overhead
def add_noop_hooks(model, blocks):
    def pre(module, args):
        return None

    def post(module, args, output):
        return None
    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post, always_call=True))
    handles.append(model.register_forward_pre_hook(pre))
    handles.append(model.register_forward_hook(post, always_call=True))
    return handles


def bench_hooks(device: torch.device, num_blocks: int, repeats: int, inner: int) -> dict:
    def build():
        return toy.ToyTransformer(dim=8, hidden=8, double=0, single=num_blocks, seed=0).to(device)

    bare, noop, managed = build(), build(), build()
    add_noop_hooks(noop, noop.blocks_in_call_order())
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
        samples = interleaved({"bare": lambda: bare(x), "noop_hooks": lambda: noop(x),
                               "manager": lambda: managed(x)}, Timer(device), repeats, inner)
    stats = manager.stats()
    if stats.copies_issued != stats.resident_blocks or stats.streamed_blocks != 0:
        raise SystemExit(f"[layerwise-offload] bench: expected only the {num_blocks} resident copies, got {stats}")
    med = {name: statistics.median(values) for name, values in samples.items()}
    per_block_us = lambda a, b: (med[a] - med[b]) / num_blocks * 1e6  # noqa: E731
    return {
        "num_blocks": num_blocks,
        "repeats": repeats,
        "forwards_per_sample": inner,
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

    def __init__(self, nbytes: int, dim: int):
        super().__init__()
        rows = max(1, nbytes // 4 // dim)
        self.weight = nn.Parameter(torch.full((rows, dim), 1e-3))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x + self.weight[0] + self.bias


class FatModel(nn.Module):
    def __init__(self, num_blocks: int, block_bytes: int, dim: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(FatBlock(block_bytes, dim) for _ in range(num_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def bench_copies(device: torch.device, num_blocks: int, block_bytes: int, repeats: int, prefetch: int) -> dict:
    cuda = device.type == "cuda"
    model = FatModel(num_blocks, block_bytes)
    manager = offload.apply_layerwise_offload(list(model.blocks), device, root=model, resident_layers=0,
                                              prefetch_size=prefetch)
    sizes = manager.block_nbytes()
    total = sum(sizes)
    x = torch.zeros(1, 64, device=device)
    src = torch.ones(total, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(total, dtype=torch.uint8, device=device)

    def plain_copy():
        # On CUDA: one async copy from pinned memory on the current stream, which the timing events bracket.
        dst.copy_(src, non_blocking=cuda)

    per_forward = {"bytes": [], "copy_seconds": []}
    timer = Timer(device)
    with torch.inference_mode():
        for _ in range(2):  # warm up: arm (build the host store) and touch every page of src/dst
            model(x)
            plain_copy()
        if cuda:
            torch.cuda.synchronize()

        # stats() synchronizes on CUDA, so it is read around the timed forward, not inside it.
        def forward_only():
            model(x)
            if cuda:
                # Count the copies this forward queued ahead (the wrap-around prefetch) in its time too.
                # Looks inside: the manager's copy stream, which a forward leaves running by design.
                torch.cuda.current_stream(device).wait_stream(manager.backend.copy_stream)

        samples = {"plain_copy": [], "manager_forward": []}
        for round_index in range(repeats):
            order = [("plain_copy", plain_copy), ("manager_forward", forward_only)]
            if round_index % 2:
                order.reverse()
            for name, fn in order:
                if name == "manager_forward":
                    before = manager.stats(synchronize=True)
                    samples[name].append(timer(fn))
                    after = manager.stats(synchronize=True)
                    per_forward["bytes"].append(after.bytes_copied - before.bytes_copied)
                    per_forward["copy_seconds"].append(after.copy_seconds - before.copy_seconds)
                else:
                    samples[name].append(timer(fn))
    stats = manager.stats()
    moved = statistics.median(per_forward["bytes"])
    plain_s = statistics.median(samples["plain_copy"])
    forward_s = statistics.median(samples["manager_forward"])
    copy_s = statistics.median(per_forward["copy_seconds"])
    plain_bps = total / plain_s
    copy_bps = moved / copy_s if copy_s > 0 else float("nan")
    forward_bps = moved / forward_s
    return {
        "num_blocks": num_blocks,
        "block_bytes": sizes[0],
        "total_bytes": total,
        "prefetch_size": prefetch,
        "repeats": repeats,
        "pinned_host_bytes": stats.pinned_host_bytes,
        "bytes_per_forward": moved,
        "copies_per_forward": stats.copies_last_forward,
        "demand_copies_total": stats.demand_copies,
        "peak_materialized_blocks": stats.peak_materialized_blocks,
        "median_seconds": {"plain_copy": plain_s, "manager_forward": forward_s, "manager_copies": copy_s},
        "gb_per_s": {"plain_copy": plain_bps / 1e9, "manager_copies": copy_bps / 1e9,
                     "manager_forward": forward_bps / 1e9},
        "ratio_manager_copies_vs_plain": copy_bps / plain_bps,
        "ratio_manager_forward_vs_plain": forward_bps / plain_bps,
        "stall_seconds_total": stats.stall_seconds,
    }


# ----------------------------------------------------------------- report
def print_report(result: dict) -> None:
    hooks, copies = result["hooks"], result["copies"]
    print(f"[layerwise-offload] bench: torch {result['torch']}, device {result['device']}"
          f" ({result['device_name']}), {result['threads']} CPU threads")
    print(f"\n(a) hook overhead, {hooks['num_blocks']} tiny blocks all resident, "
          f"median of {hooks['repeats']} interleaved samples x {hooks['forwards_per_sample']} forwards")
    print(f"  {'variant':<12} {'forward us':>12} {'(IQR)':>9} {'us/block':>10} {'vs bare':>9}")
    med, spread = hooks["median_forward_us"], hooks["iqr_forward_us"]
    for name in ("bare", "noop_hooks", "manager"):
        print(f"  {name:<12} {med[name]:>12.1f} {spread[name]:>9.1f} {med[name] / hooks['num_blocks']:>10.2f} "
              f"{med[name] / med['bare']:>8.3f}x")
    print(f"  manager overhead: {hooks['manager_overhead_us_per_block']:.2f} us/block over bare "
          f"({hooks['noop_hook_overhead_us_per_block']:.2f} us of it is PyTorch's hook dispatch, "
          f"{hooks['manager_logic_us_per_block']:.2f} us the manager's own work); "
          f"ratio manager/bare = {hooks['ratio_manager_vs_bare']:.3f}")
    print(f"\n(b) host-store materialization, {copies['num_blocks']} streamed blocks x "
          f"{copies['block_bytes'] / 2**20:.1f} MiB = {copies['total_bytes'] / 2**20:.0f} MiB per forward, "
          f"prefetch {copies['prefetch_size']}, pinned {copies['pinned_host_bytes'] / 2**20:.0f} MiB, "
          f"median of {copies['repeats']}")
    print(f"  {'what':<34} {'ms':>9} {'GB/s':>8} {'vs plain':>9}")
    secs, gbps = copies["median_seconds"], copies["gb_per_s"]
    rows = (("one plain dst.copy_(src)", "plain_copy", "plain_copy"),
            ("manager copies (stats.copy_seconds)", "manager_copies", "manager_copies"),
            ("manager forward (end to end)", "manager_forward", "manager_forward"))
    for label, sec_key, rate_key in rows:
        print(f"  {label:<34} {secs[sec_key] * 1e3:>9.2f} {gbps[rate_key]:>8.2f} "
              f"{gbps[rate_key] / gbps['plain_copy']:>8.3f}x")
    print(f"  bytes/forward {copies['bytes_per_forward'] / 2**20:.0f} MiB in {copies['copies_per_forward']} copies, "
          f"peak materialized blocks {copies['peak_materialized_blocks']}, "
          f"demand copies {copies['demand_copies_total']}")
    print(f"\n[layerwise-offload] bench ratios: hook manager/bare {hooks['ratio_manager_vs_bare']:.3f} "
          f"({hooks['manager_overhead_us_per_block']:.2f} us/block); "
          f"copies vs one plain copy {copies['ratio_manager_copies_vs_plain']:.3f}, "
          f"forward vs one plain copy {copies['ratio_manager_forward_vs_plain']:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved samples per variant")
    parser.add_argument("--hook-blocks", type=int, default=96, help="tiny blocks in the hook benchmark")
    parser.add_argument("--stream-blocks", type=int, default=32, help="streamed blocks in the copy benchmark")
    parser.add_argument("--block-mib", type=float, default=None,
                        help="MiB per streamed block (default 8 on the CPU, 32 on CUDA)")
    parser.add_argument("--prefetch", type=int, default=1, help="prefetch_size for the copy benchmark")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default 1 on the CPU: on a busy 2-core host, tiny ops "
                             "spread over 2 threads run 50x slower and drown what is measured; CUDA: unchanged)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("[layerwise-offload] bench: --device cuda, but torch.cuda.is_available() is False")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"[layerwise-offload] bench: --device must be cpu or cuda, got {args.device!r}")
    cuda = device.type == "cuda"
    block_mib = args.block_mib if args.block_mib is not None else (32.0 if cuda else 8.0)
    repeats = args.repeats if args.repeats is not None else (30 if cuda else 15)

    threads = args.threads if args.threads is not None else (None if cuda else 1)
    if threads is not None:
        torch.set_num_threads(threads)

    started = time.perf_counter()
    result = {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "host (CPU loopback)",
        "threads": torch.get_num_threads(),
        "hooks": bench_hooks(device, args.hook_blocks, repeats=max(repeats, 41), inner=5),
        "copies": bench_copies(device, args.stream_blocks, int(block_mib * 2**20), repeats, args.prefetch),
    }
    result["seconds"] = time.perf_counter() - started
    print_report(result)
    print(f"[layerwise-offload] bench took {result['seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"[layerwise-offload] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
