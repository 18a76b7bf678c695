"""Two questions the first GPU runs left open, answered in one short device call (bench/results/gpu/README.md).

    python -P bench/studies/gpu_diagnose.py pinning --out DIR --work W   # ComfyUI 0.3.75
    python -P bench/studies/gpu_diagnose.py bitwise --out DIR --work W   # ComfyUI 0.33.0
    ... --dry-run: the same on the CPU at the tiny presets

``pinning``: ComfyUI 0.3.75's lowvram run after this pack's failed with cudaErrorHostMemoryAlreadyRegistered. The
pack runs at budget 0.6, then ComfyUI's lowvram at 0.3 with every ``cudaHostRegister`` logged: for each refusal, the
parameter whose bytes it was asked for, its offset in its page, and whether it views this pack's host store.

``bitwise``: on ComfyUI 0.33.0 this pack's runs, and ComfyUI's own dynamic VRAM at a budget, were not bitwise with
the full load, though every leaf module's first call was. Each run records every forward of the diffusion model
(input and output fingerprints, exact); the table says, per run, the first forward that differs from the full load's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402

from ..gpu_harness import AUTO_POLICY, make_harness  # noqa: E402
from ..gpu_tables import TABLES, Ballast, State, Table  # noqa: E402
from ..measure import CPU_LOOPBACK_ENV  # noqa: E402


def log(*parts) -> None:
    print("[gpu_diagnose]", *parts, flush=True)


def fingerprint(tensor: torch.Tensor) -> tuple:
    """An exact fingerprint of the bytes (two position-weighted integer sums), cheap to keep for every forward."""
    data = tensor.detach().contiguous().view(torch.uint8).flatten().to(torch.int64)
    weights = torch.arange(data.numel(), device=data.device, dtype=torch.int64) % 1_000_003 + 1
    return (tuple(tensor.shape), str(tensor.dtype), int(data.sum()), int((data * weights).sum()))


class ForwardLog:
    """Every forward of the diffusion model: fingerprints of its input and its output."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_hook(self._record)

    def _record(self, module, args, output):
        if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            self.calls.append((fingerprint(args[0]), fingerprint(output)))

    def close(self):
        self.handle.remove()
        return self.calls


def first_difference(reference, calls) -> str:
    if len(reference) != len(calls):
        head = f"{len(calls)} forwards against {len(reference)}; "
    else:
        head = ""
    for k, ((ri, ro), (ci, co)) in enumerate(zip(reference, calls)):
        if ri != ci:
            return head + f"forward {k}: input differs (output of forward {k - 1} or the sampler)"
        if ro != co:
            return head + f"forward {k}: same input, output differs"
    return head + ("all forwards bitwise the same" if not head else "the common forwards are the same")


def bitwise(args, tables) -> None:
    h = make_harness(args, State(Path(args.work)), tables, blocks=None if args.dry_run else (4,))
    runs = {}
    try:
        def sample(patcher, name):
            h._fresh()
            record = ForwardLog(h.diffusion_model)
            try:
                with torch.inference_mode():
                    out = h.presets.sample(patcher, h.preset, seed=h.config.seed, steps=args.steps)
            finally:
                runs[name] = record.close()
            return out

        full = sample(h.patcher, "full")
        again = sample(h.patcher, "full again")

        def node(name, resident, synchronize=False):
            patcher = h._offload(resident, 1, "leading")
            handles = []
            if synchronize:  # the host waits for the device after every block: no copy can overlap anything
                for block in patcher.attachments["layerwise_offload"].discovered.blocks:
                    handles.append(block.register_forward_hook(
                        lambda *a: torch.cuda.synchronize() if h.cuda else None))
            try:
                return sample(patcher, name)
            finally:
                for handle in handles:
                    handle.remove()
                h._unload(patcher)

        outs = {"full again": again, "node r0": node("node r0", 0), "node r0 again": node("node r0 again", 0),
                "node all resident": node("node all resident", len(h.block_nbytes)),
                "node r0, synchronised per block": node("node r0, synchronised per block", 0, synchronize=True)}
        budget = h.budgets_for("0.3")[0][1] if h.cuda else None
        with Ballast(h.device, budget):  # ComfyUI's own partial load (classic lowvram) at the same budget
            h._fresh()
            record = ForwardLog(h.diffusion_model)
            from ..measure import comfy_weight_budget
            patcher = h.patcher.clone()
            try:
                with comfy_weight_budget(patcher, budget or h.model_bytes // 3), torch.inference_mode():
                    outs["comfy lowvram 0.3"] = h.presets.sample(patcher, h.preset, seed=h.config.seed,
                                                                 steps=args.steps)
            finally:
                runs["comfy lowvram 0.3"] = record.close()
                h._unload(patcher)
        for name, out in outs.items():
            same = torch.equal(out.cpu().view(torch.uint8) if out.dtype != torch.uint8 else out.cpu(),
                               full.cpu().view(torch.uint8) if full.dtype != torch.uint8 else full.cpu())
            note = first_difference(runs["full"], runs[name])
            log(f"{name}: output bitwise {'the same' if same else 'DIFFERENT'}; {note}")
            tables["preflight"].add(comfyui=h.comfyui, name=f"bitwise_{name.replace(' ', '_').replace(',', '')}",
                                    value=same, unit="", note=note)
    finally:
        h.teardown()


def pinning(args, tables) -> None:
    h = make_harness(args, State(Path(args.work)), tables)
    refusals = []
    try:
        h.full()
        budgets = dict(h.budgets_for("0.6,0.3"))
        h.layerwise(-1, 1, AUTO_POLICY, "0.6", budgets["0.6"], mode="layerwise_auto")
        if h.cuda:
            from ...nodes.shared_managers import _MANAGERS  # looks inside: which host memory is the pack's store
            manager = _MANAGERS.get(h.diffusion_model)
            store = manager.store.buffers if manager is not None and manager.store is not None else []
            spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in store if b is not None]
            names = {p.data_ptr(): n for n, p in h.diffusion_model.named_parameters()}
            runtime = torch.cuda.cudart()

            class Logged:
                def __getattr__(self, name):
                    return getattr(runtime, name)

                def cudaHostRegister(self, ptr, size, flags):
                    result = runtime.cudaHostRegister(ptr, size, flags)
                    if int(result) != 0:
                        store_hit = next((k for k, (a, b) in enumerate(spans) if a <= ptr < b), None)
                        refusals.append(f"{names.get(ptr, hex(ptr))}: {size} B at {ptr % 4096} in its page, "
                                        f"{'store buffer %d' % store_hit if store_hit is not None else 'not the store'}"
                                        f", error {int(result)}")
                    return result
            logged = Logged()
            original = torch.cuda.cudart
            torch.cuda.cudart = lambda: logged
            try:
                h.comfy_lowvram("0.3", budgets["0.3"])
            finally:
                torch.cuda.cudart = original
        else:
            h.comfy_lowvram("0.3", budgets["0.3"])
    finally:
        h.teardown()
    log(f"{len(refusals)} refused registrations" + "".join(f"\n  {r}" for r in refusals[:12]))
    tables["preflight"].add(comfyui=h.comfyui, name="pinning_refusals", value=len(refusals), unit="",
                            note=" | ".join(refusals[:6])[:900])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["pinning", "bitwise"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    import os
    from ...devtools import comfy_env
    comfy_env.import_comfyui(cpu=args.dry_run, import_nodes=False)
    if args.dry_run:
        os.environ[CPU_LOOPBACK_ENV] = "1"
    args.preset = ("tiny" if args.what == "pinning" else "tiny_wan") if args.dry_run else (
        "flux" if args.what == "pinning" else "wan21_14b")
    args.steps, args.step_name = 3, f"diagnose_{args.what}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tables = {name: Table(Path(args.out), name) for name in TABLES}
    {"pinning": pinning, "bitwise": bitwise}[args.what](args, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
