"""Host (Python) time the manager spends per streamed block, per weight format, on the CPU loopback (issue 28 item 3).

    COMFYUI_PATH=$PWD/.comfyui/ComfyUI .venv/bin/python -P bench/studies/host_time.py --phase before [--append]

A toy model of ``--blocks`` blocks (40), each of ~30 small parameters (ten linears' weight and bias, ten norm
weights; 32 wide), so a copy moves a few KiB and its time is noise next to the host's bookkeeping. The blocks'
forward is the identity: what a forward costs beyond the same model without the manager is the manager's hooks,
copies and re-pointing. Every block is streamed (resident 0, prefetch 1). Per format:

- ``bf16``: plain bf16 parameters;
- ``fp8``: the linears' weights as plain ``float8_e4m3fn`` tensors (the rest bf16);
- ``quantized``: the linears' weights as ComfyUI's ``QuantizedTensor`` (``TensorCoreFP8Layout``: fp8 data and a
  scale, a wrapper subclass, swapped in and out whole), built by ComfyUI's own ``comfy.quant_ops`` (ComfyUI is
  imported, on the CPU; skipped with a line where it is not found);
- ``gguf``: the linears' weights as ComfyUI-GGUF's ``GGMLTensor`` (Q8_0 bytes; a storage subclass), from the
  unmodified pack in shared/peers (skipped with a line where it is missing), the rest float32.

ms_per_block = (median forward with the manager - median forward without, the two taken in turns with the garbage
collector off) / streamed blocks, timed by this thread's
CPU time (``--clock thread``, the default: what the host spends, little moved by other processes on a busy machine)
or elapsed time (``--clock wall``); ``--repeats`` rounds of ``--forwards`` forwards each give the min and median of
that figure over rounds. Appends (or writes) rows to
bench/results/host_time.csv: format, phase, ms_per_block (the median), ms_per_block_min, and the set-up.
"""

from __future__ import annotations

import argparse
import csv
import functools
import gc
import importlib
import importlib.util
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "bench" / "results" / "host_time.csv"
COLUMNS = ["format", "phase", "ms_per_block", "ms_per_block_min", "blocks", "params_per_block", "repeats",
           "forwards", "clock", "torch", "comfyui", "machine"]


def _comfy_env():
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
    comfy_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comfy_env)
    return comfy_env


comfy_env = _comfy_env()
offload, = comfy_env.import_pack_modules("offload", root=REPO_ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

WIDTH = 32
LINEARS = 10


class IdentityLinear(nn.Module):
    """A linear's weight and bias, read by nothing: called, it runs the hooks a weight unit streams under."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class IdentityBlock(nn.Module):
    """Ten linears' parameters and ten norm weights; the forward reads none of them (compute is not measured).
    With ``call_linears`` it calls each linear (``--units``: the manager's hooks are on them), else none."""

    def __init__(self, make_weight: Callable[[torch.Tensor], torch.Tensor], other_dtype: torch.dtype, seed: int,
                 call_linears: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.call_linears = call_linears
        self.linears = nn.ModuleList(IdentityLinear() for _ in range(LINEARS))
        for linear in self.linears:
            weight = torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH ** 0.5
            linear.weight = nn.Parameter(make_weight(weight), requires_grad=False)
            linear.bias = nn.Parameter(torch.randn(WIDTH, generator=generator).to(other_dtype), requires_grad=False)
        self.norms = nn.ParameterList(nn.Parameter(torch.ones(WIDTH, dtype=other_dtype), requires_grad=False)
                                      for _ in range(LINEARS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.call_linears:
            for linear in self.linears:
                x = linear(x)
        return x


class Toy(nn.Module):
    def __init__(self, blocks: List[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@functools.lru_cache(maxsize=None)
def quantized_tensor_maker() -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """ComfyUI's QuantizedTensor over fp8 e4m3 data and a per-tensor scale, or None (with a line) without ComfyUI."""
    try:
        comfy_env.import_comfyui(import_nodes=False)
        from comfy.quant_ops import QuantizedTensor  # noqa: WPS433
    except Exception as error:  # noqa: BLE001 - any failure means "no ComfyUI here"
        print(f"quantized: skipped, ComfyUI's QuantizedTensor not importable ({error})")
        return None

    def make(weight: torch.Tensor) -> torch.Tensor:
        scale = (weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).float()
        return QuantizedTensor.from_float(weight, "TensorCoreFP8Layout", scale=scale)
    try:
        probe = make(torch.randn(WIDTH, WIDTH))
    except Exception as error:  # noqa: BLE001
        print(f"quantized: skipped, QuantizedTensor.from_float failed on this ComfyUI ({error})")
        return None
    print(f"quantized: {type(probe).__module__}.{type(probe).__qualname__}")
    return make


@functools.lru_cache(maxsize=None)
def gguf_tensor_maker(folder: str) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """ComfyUI-GGUF's GGMLTensor holding Q8_0 bytes (34 bytes per 32 values), or None (with a line)."""
    try:
        comfy_env.import_comfyui(import_nodes=False)
        peers, = comfy_env.import_pack_modules("devtools.peers", root=REPO_ROOT)
        gguf_pack = peers.import_comfyui_gguf(folder)
        ops = sys.modules.get(f"{gguf_pack.__name__}.ops")
        if ops is None:
            ops = importlib.import_module(f"{gguf_pack.__name__}.ops")
        GGMLTensor = ops.GGMLTensor
        import gguf  # noqa: F401  (ComfyUI-GGUF's tensor types)
    except Exception as error:  # noqa: BLE001
        print(f"gguf: skipped, ComfyUI-GGUF not available ({error})")
        return None
    import gguf as gguf_module

    def make(weight: torch.Tensor) -> torch.Tensor:
        blocks = weight.numel() // 32
        data = torch.randint(0, 256, (weight.shape[0], blocks // weight.shape[0] * 34), dtype=torch.uint8)
        return GGMLTensor(data, tensor_type=gguf_module.GGMLQuantizationType.Q8_0, tensor_shape=weight.shape)
    return make


def build(fmt: str, blocks: int, folder: str, call_linears: bool = False) -> Optional[Toy]:
    if fmt == "bf16":
        make, other = (lambda w: w.to(torch.bfloat16)), torch.bfloat16
    elif fmt == "fp8":
        make, other = (lambda w: w.to(torch.float8_e4m3fn)), torch.bfloat16
    elif fmt == "quantized":
        make, other = quantized_tensor_maker(), torch.bfloat16
    elif fmt == "gguf":
        make, other = gguf_tensor_maker(folder), torch.float32
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if make is None:
        return None
    return Toy([IdentityBlock(make, other, seed, call_linears) for seed in range(blocks)])


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def _median_forwards(models, x: torch.Tensor, forwards: int, clock) -> List[float]:
    """The median time of a forward of each model, their forwards taken in turns (a slow spell of the machine
    falls on both), the garbage collector held off meanwhile (it runs between rounds)."""
    times = [[] for _ in models]
    gc.disable()
    try:
        for _ in range(forwards):
            for model, spent in zip(models, times):
                start = clock()
                model(x)
                spent.append(clock() - start)
    finally:
        gc.enable()
    return [statistics.median(spent) for spent in times]


def measure(fmt: str, blocks: int, repeats: int, forwards: int, folder: str,
            clock=time.thread_time, tail_fraction: float = 0.0, units: bool = False) -> Optional[Dict[str, float]]:
    """``units``: the manager streams each linear on its own (residency_policy weights), the norms stay put; the
    figure is then per streamed unit."""
    bare, offloaded = build(fmt, blocks, folder, units), build(fmt, blocks, folder, units)
    if bare is None:
        return None
    pieces = list(offloaded.blocks)
    if units:
        found = offload.weight_units(pieces)
        found.place_rest("cpu")
        pieces = list(found.units)
    params = sum(1 for _ in pieces[0].parameters())
    tails = 0
    if tail_fraction:  # every block streams the tail its layout allows within this fraction of it
        packing = importlib.import_module(offload.__name__ + ".host.packing")
        layout = packing.plan_layout(offload.block_parameters(pieces[0]))
        tails = max(1, int(layout.nbytes * tail_fraction))
    manager = offload.apply_layerwise_offload(pieces, "cpu", root=offloaded, resident_layers=0,
                                              prefetch_size=1, streamed_tail_bytes=tails)
    x = torch.zeros(1, WIDTH)
    per_block = []
    with torch.inference_mode(False), torch.no_grad():
        for _ in range(3):  # arm, pack, learn the call order
            offloaded(x)
            bare(x)
        streamed = manager.stats().streamed_blocks
        for _ in range(repeats):
            gc.collect()
            with_manager, without = _median_forwards((offloaded, bare), x, forwards, clock)
            per_block.append((with_manager - without) / streamed * 1e3)
        stats = manager.stats()
    assert stats.streamed_blocks == len(pieces) and stats.copies_last_forward >= len(pieces), stats
    manager.detach()
    return {"ms_per_block": statistics.median(per_block), "ms_per_block_min": min(per_block),
            "params_per_block": params}


def comfyui_version() -> str:
    module = sys.modules.get("comfyui_version")
    if module is None:
        try:
            import comfyui_version as module  # noqa: WPS433 (ComfyUI's folder is on sys.path once imported)
        except ImportError:
            return ""
    return getattr(module, "__version__", "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", required=True, help="before / after (the CSV's phase column)")
    parser.add_argument("--formats", default="bf16,fp8,quantized,gguf")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--forwards", type=int, default=30)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="thread: this thread's CPU time (what the host spends, robust to other processes on a "
                             "busy machine); wall: elapsed time")
    parser.add_argument("--tail-fraction", type=float, default=0.0,
                        help="stream tails of at most this fraction of each block (streamed_tail_bytes); 0: whole")
    parser.add_argument("--units", action="store_true",
                        help="stream weight units (each linear on its own, residency_policy weights) instead of "
                             "blocks: the figure is per streamed unit (the blocks column counts units)")
    parser.add_argument("--append", action="store_true", help="append to the CSV instead of rewriting it")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for fmt in args.formats.split(","):
            result = measure(fmt, args.blocks, args.repeats, args.forwards, folder, CLOCKS[args.clock],
                             args.tail_fraction, args.units)
            if result is None:
                continue
            row = {"format": fmt, "phase": args.phase, "ms_per_block": f"{result['ms_per_block']:.4f}",
                   "ms_per_block_min": f"{result['ms_per_block_min']:.4f}",
                   "blocks": args.blocks * LINEARS if args.units else args.blocks,
                   "params_per_block": result["params_per_block"], "repeats": args.repeats,
                   "forwards": args.forwards, "clock": args.clock, "torch": torch.__version__,
                   "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
            rows.append(row)
            print(f"{fmt:10s} {args.phase:7s} median {row['ms_per_block']} ms/block, min {row['ms_per_block_min']}"
                  f" ({row['params_per_block']} parameters per block)")
    version = comfyui_version()  # imported by the quantized or gguf rows, if at all: the same for every row
    for row in rows:
        row["comfyui"] = version
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    exists = out.is_file() and args.append
    with out.open("a" if exists else "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if not exists:
            writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
