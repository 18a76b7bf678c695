"""Interim main job: offload a 12-block toy transformer and prove the output does not change.

    python scripts/demo_engine.py [--device cpu|cuda] [--resident 4] [--prefetch 2] [--forwards 3]

Builds the toy transformer from devtools/ (mixed dtypes, a transposed weight, buffers, two block
lists), keeps ``--resident`` blocks on the device and streams the rest with a prefetch window (the
CPU loopback when there is no GPU), runs a few forwards, and checks each output is bitwise equal to
the same model without offload. Prints what stayed resident, what streamed, bytes and copies per
forward, peak materialized blocks, and OK or FAIL (exit status 0 or 1).

The pack is imported as the package ``layerwise_offload`` without putting the repository root on
sys.path (its nodes/ folder would shadow ComfyUI's ``nodes``), as ComfyUI and tests/conftest.py do.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFIX = "[layerwise-offload]"


def import_pack():
    """The pack's modules, imported the way tests do it (devtools/comfy_env.py, loaded by path)."""
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
    comfy_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comfy_env)
    return comfy_env.import_pack_modules("offload", "devtools.toy_transformer", root=REPO_ROOT)


offload, toy = import_pack()

import torch  # noqa: E402

MiB = 2**20


def build(args):
    return toy.ToyTransformer(dim=args.dim, hidden=args.hidden, double=args.double, single=args.single, seed=0)


def fmt_blocks(indices) -> str:
    """``0-3, 6, 9-11`` from a sorted list of block indices."""
    runs, start, prev = [], None, None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            runs.append((start, prev))
            start = prev = i
    if start is not None:
        runs.append((start, prev))
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs) or "none"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--resident", type=float, default=4, help="resident_layers: a count, or a fraction < 1")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--policy", default="leading", choices=offload.POLICIES)
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--double", type=int, default=4)
    parser.add_argument("--single", type=int, default=8)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    resident_layers = int(args.resident) if args.resident >= 1 else args.resident

    x = torch.randn(2, 16, args.dim, generator=torch.Generator().manual_seed(1)).to(device)
    reference_model = build(args).to(device)
    model = build(args)  # stays on the host: the manager moves only what the plan keeps
    model.embed.to(device)
    model.head.to(device)
    blocks = model.blocks_in_call_order()
    manager = offload.apply_layerwise_offload(blocks, device, root=model, resident_layers=resident_layers,
                                              prefetch_size=args.prefetch, policy=args.policy)
    print(f"{PREFIX} demo: torch {torch.__version__}, device {device}"
          f"{' (CPU loopback)' if device.type == 'cpu' else ''}, toy transformer with {len(blocks)} blocks "
          f"({args.double} double + {args.single} single, dim {args.dim}, hidden {args.hidden})")
    print(f"{PREFIX} config: resident_layers={resident_layers}, prefetch_size={args.prefetch}, "
          f"policy={args.policy}")

    ok = True
    per_forward = []
    with torch.inference_mode():
        for step in range(args.forwards):
            expected = reference_model(x)
            before = manager.stats()
            got = model(x)
            after = manager.stats()
            same = torch.equal(got, expected)
            ok &= same
            per_forward.append((after.bytes_copied - before.bytes_copied, after.copies_issued - before.copies_issued,
                                after.demand_copies - before.demand_copies))
            print(f"{PREFIX} forward {step}: {per_forward[-1][0] / MiB:.2f} MiB in {per_forward[-1][1]} copies "
                  f"({per_forward[-1][2]} on demand), output {'bitwise equal' if same else 'DIFFERS'} "
                  f"(max abs diff {(got.float() - expected.float()).abs().max().item():.3g})")

    stats = manager.stats()
    sizes = manager.block_nbytes()
    resident = list(manager.schedule.resident_blocks)
    streamed = list(manager.schedule.streamed_blocks)
    print(f"{PREFIX} resident: {len(resident)} blocks [{fmt_blocks(resident)}], "
          f"{sum(sizes[i] for i in resident) / MiB:.2f} MiB on {device}")
    print(f"{PREFIX} streamed: {len(streamed)} blocks [{fmt_blocks(streamed)}], "
          f"{sum(sizes[i] for i in streamed) / MiB:.2f} MiB in the host store "
          f"({stats.host_bytes / MiB:.2f} MiB total, {stats.pinned_host_bytes / MiB:.2f} MiB pinned)")
    print(f"{PREFIX} device bytes held: {stats.device_bytes / MiB:.2f} MiB "
          f"(planned {stats.planned_device_bytes / MiB:.2f} MiB, peak {stats.peak_device_bytes / MiB:.2f} MiB, "
          f"{min(args.prefetch + 1, len(streamed))} slots of {max((sizes[i] for i in streamed), default=0) / MiB:.2f} MiB)")
    print(f"{PREFIX} per forward (steady state): {stats.bytes_copied_last_forward / MiB:.2f} MiB moved in "
          f"{stats.copies_last_forward} copies; total {stats.bytes_copied / MiB:.2f} MiB in {stats.copies_issued} "
          f"copies over {stats.forwards} forwards, {stats.demand_copies} on demand")
    print(f"{PREFIX} peak materialized blocks: {stats.peak_materialized_blocks} "
          f"(bound: {len(resident)} resident + {min(args.prefetch + 1, len(streamed))} slots)")
    if stats.copy_seconds > 0:
        print(f"{PREFIX} copy time {stats.copy_seconds * 1e3:.2f} ms ({stats.achieved_gbps:.2f} GB/s), "
              f"stall {stats.stall_seconds * 1e3:.2f} ms")

    # Checks beyond the output: the plan's bounds and the streamed bytes per forward.
    expected_bytes = sum(sizes[i] for i in streamed)
    bound = len(resident) + min(args.prefetch + 1, len(streamed))
    checks = {
        "output bitwise equal on every forward": ok,
        "steady-state bytes per forward == streamed bytes": stats.bytes_copied_last_forward == expected_bytes,
        "peak materialized <= residents + slots": stats.peak_materialized_blocks <= bound,
        "device bytes == planned": stats.device_bytes == stats.planned_device_bytes,
    }
    for name, passed in checks.items():
        if not passed:
            print(f"{PREFIX} check failed: {name}")
    manager.detach()
    with torch.inference_mode():
        restored = model.to(device)(x)
        checks["output equal after detach"] = torch.equal(restored, reference_model(x))
    if not checks["output equal after detach"]:
        print(f"{PREFIX} check failed: output equal after detach")
    passed = all(checks.values())
    print(f"{PREFIX} {'OK' if passed else 'FAIL'}: {sum(checks.values())}/{len(checks)} checks passed")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
