"""Bigger than RAM with the node's defaults (issue 26): real ComfyUI servers (CPU loopback) in a memory cgroup with
no swap run a DiT bigger than the cgroup through Load Diffusion Model (Layerwise) and the offload node with every
input at the default the server's own /object_info reports; each run is compared bitwise with ComfyUI alone
(UNETLoader straight into the sampler, no node, no limit but ``--reference-cap-gib``).

Cases (``--case``, any of):
  flux         a Flux of real width (hidden 3072; 1 double + 38 single blocks by default, bf16: 10.8 GiB) in a
               5.2 GiB cgroup
  lora-before  the same with LoraLoaderModelOnly between the loader and the node
  lora-after   the same with LoraLoaderModelOnly after the node
  experts      two Wan 2.1 experts (fp32 blocks of 64 MiB; 22 blocks: 1.43 GiB each) taking turns as in Wan
               2.2's graph (KSamplerAdvanced high noise, then low noise) in a cgroup of 0.75 x one expert

The Flux cases start ComfyUI with ``--bf16-unet``: on the CPU ComfyUI would compute in float32 and convert every
bf16 weight into RAM (a GPU keeps bf16), so the weights could not stay in the file. The cgroup holds the whole
server: it starts without a limit, runs the tiny demo through the node (imports and
caches), unloads, drops the checkpoints from the page cache, then the limit is set and the case runs. Printed per
case: the limit, the cgroup's peak (memory.max_usage_in_bytes), failcnt and OOM kills, the wall time, the outcome,
bitwise or not, and the node's plan lines. Checkpoints (random weights, written tensor by tensor: never whole in
RAM) and ComfyUI alone's latents stay in ``--workdir`` for the next run; ``--clean`` removes them at the end.
The ComfyUI is the one of the interpreter's venv and ``COMFYUI_PATH``, as for the tests:

    COMFYUI_PATH=$PWD/.comfyui/ComfyUI .venv/bin/python -P devtools/bigger_than_ram.py --case flux experts
    COMFYUI_PATH=$PWD/.comfyui/ComfyUI-0.33.0 .venv-0.33.0/bin/python -P devtools/bigger_than_ram.py --case all

Needs root and a memory cgroup controller (the cgroup helpers of tests/e2e/cgroups.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).with_name("comfy_env.py")))["enter_pack"](globals())

from . import e2e_assets  # noqa: E402
from .comfy_env import comfyui_path  # noqa: E402
from .server import ServerError, prepare_base_dir  # noqa: E402

GiB, MiB = 2**30, 2**20
NODE = "LayerwiseOffload"
LOADER = "LayerwiseOffloadLoadDiffusionModel"
CASES = ("flux", "lora-before", "lora-after", "experts")
FLUX_COND_FOLDER = "layerwise_offload_btr_flux_cond"  # the tiny demo's T5-shaped context + a CLIP-L pooled vector
WAN_EXPERT_CONFIG = dict(dim=1024, num_heads=8, ffn_dim=4096)  # fp32: 64 MiB blocks
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


# ----------------------------------------------------------------------------------------------- checkpoints
def _meta_state(config_class: str, unet_config: Dict, dtype) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every diffusion-model tensor of ``comfy.supported_models.<config_class>`` built on meta."""
    import torch

    from .comfy_env import import_comfyui
    from .tiny_dits import model_config_for

    env = import_comfyui(cpu=True, import_nodes=False)
    model_config = model_config_for(env, config_class, unet_config, dtype)
    with torch.device("meta"):
        dit = model_config.get_model({}, "").diffusion_model
    return [(k, tuple(v.shape)) for k, v in dit.state_dict().items()]


def write_random_checkpoint(path: Path, specs: Sequence[Tuple[str, Tuple[int, ...]]], dtype, seed: int) -> Dict:
    """A safetensors file of ``specs`` filled by the tiny demo's weight rule (matrices ~ N(0, 1/fan_in), norms ~ 1),
    one tensor at a time (each from its own seed), so the model never sits whole in RAM. Written to a .partial file
    and renamed, so an interrupted write is not taken for a checkpoint. Returns its figures."""
    import torch

    from ..demo.install_tiny_demo import random_weights

    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {}, 0
    for name, shape in specs:
        size = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _SAFETENSORS_DTYPES[str(dtype).split(".")[-1]], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for index, (name, shape) in enumerate(specs):
            tensor = random_weights([(name, list(shape))], seed * 100003 + index)[name].to(dtype).contiguous()
            out.write(tensor.view(torch.uint8).numpy().tobytes())
    partial.replace(path)
    return checkpoint_figures(path)


def checkpoint_figures(path: Path) -> Dict:
    """Bytes of the whole file, of its blocks (``blocks.``, ``double_blocks.``, ``single_blocks.``) and the largest
    block, read from the header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    blocks: Dict[str, int] = {}
    for name, entry in header.items():
        parts = name.split(".")
        if parts[0] in ("blocks", "double_blocks", "single_blocks"):
            key = ".".join(parts[:2])
            blocks[key] = blocks.get(key, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
    return {"file": path.stat().st_size, "blocks": sum(blocks.values()), "block_count": len(blocks),
            "largest_block": max(blocks.values())}


def flux_checkpoint(workdir: Path, double: int, single: int) -> Tuple[Path, Dict]:
    import torch

    from .dit_presets import FLUX_DEV

    path = workdir / "models" / f"layerwise_offload_flux_{double}d{single}s_bf16.safetensors"
    if not path.is_file():
        print(f"[layerwise-offload] writing {path.name} ...", flush=True)
        specs = _meta_state("Flux", {**FLUX_DEV, "depth": double, "depth_single_blocks": single}, torch.bfloat16)
        # The released files' names: newer ComfyUIs call the q/k RMSNorm's weight "weight", older ones detect
        # Flux only by "scale" (and newer ones read either).
        specs = [(re.sub(r"\.(query_norm|key_norm)\.weight$", r".\1.scale", name), shape) for name, shape in specs]
        write_random_checkpoint(path, specs, torch.bfloat16, seed=1)
    return path, checkpoint_figures(path)


def expert_checkpoints(workdir: Path, blocks: int) -> Tuple[List[Path], Dict]:
    import torch

    from .tiny_dits import WAN21_TINY_CONFIG

    paths = [workdir / "models" / f"layerwise_offload_wan21_expert_{which}_{blocks}b_fp32.safetensors"
             for which in ("high", "low")]
    for seed, path in enumerate(paths, start=2):
        if not path.is_file():
            print(f"[layerwise-offload] writing {path.name} ...", flush=True)
            config = dict(WAN21_TINY_CONFIG, **WAN_EXPERT_CONFIG, num_layers=blocks)
            write_random_checkpoint(path, _meta_state("WAN21_T2V", config, torch.float32), torch.float32, seed)
    return paths, checkpoint_figures(paths[0])


def flux_lora(path: Path, checkpoint: Path, stride: int, rank: int = 4) -> Path:
    """A rank-``rank`` LoRA (ComfyUI's lora_up/lora_down keys) over every Linear of every ``stride``-th block
    (double and single counted together): ComfyUI alone, the reference, holds a patched copy of each weight it
    covers, so full coverage would need the model twice in RAM."""
    import safetensors.torch
    import torch

    with open(checkpoint, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    order = sorted({".".join(k.split(".")[:2]) for k in header if k.startswith(("double_blocks.", "single_blocks."))},
                   key=lambda b: (not b.startswith("double"), int(b.split(".")[1])))
    chosen = set(order[::stride])
    generator = torch.Generator().manual_seed(7)
    lora = {}
    for key, entry in sorted(header.items()):
        if ".".join(key.split(".")[:2]) in chosen and key.endswith(".weight") and len(entry["shape"]) == 2:
            stem, (rows, cols) = "diffusion_model." + key[:-len(".weight")], entry["shape"]
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(rows, rank, generator=generator)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, cols, generator=generator)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(lora, str(path))
    return path


def write_flux_cond(base: Path) -> None:
    """The tiny demo's saved conditioning with a ``pooled_output`` (768, CLIP-L's) added, which Flux reads as its
    vector input (ComfyUI 0.3.75 requires it), where every tested ComfyUI's Load Training Dataset reads it."""
    import torch

    from ..demo import install_tiny_demo as demo

    cond = demo.conditioning()
    generator = torch.Generator().manual_seed(5)
    cond["conditioning"][0][0][1]["pooled_output"] = torch.randn((1, 768), generator=generator)
    for parent in ("output", "datasets"):
        folder = base / parent / FLUX_COND_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(cond, str(folder / "shard_00000.pkl"))
        (folder / "metadata.json").write_text(json.dumps(demo.COND_METADATA, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------- prompts
def _sampler(model, positive, negative, latent, seed: int, steps: int, cfg: float) -> Dict:
    return {"class_type": "KSampler", "inputs": {
        "model": model, "positive": positive, "negative": negative, "latent_image": latent, "seed": seed,
        "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}


def flux_prompt(unet: str, node: Optional[Dict], steps: int, prefix: str, lora: Optional[str] = None,
                lora_after: bool = False) -> Dict:
    """Loader (the Layerwise loader with the node, UNETLoader alone) [-> LoRA] [-> node] [-> LoRA] -> KSampler
    (cfg 1: one forward per step) on a 64x64 image latent, the saved conditioning (write_flux_cond) -> SaveLatent."""
    loader = LOADER if node is not None else "UNETLoader"
    p = {"1": {"class_type": loader, "inputs": {"unet_name": unet, "weight_dtype": "default"}},
         "2": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": FLUX_COND_FOLDER}},
         "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 1]}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": prefix}}}
    model = ["1", 0]
    chain = ([("lora", lora)] if lora and not lora_after else []) + ([("node", node)] if node is not None else []) \
        + ([("lora", lora)] if lora and lora_after else [])
    for index, (kind, what) in enumerate(chain):
        key = str(10 + index)
        p[key] = ({"class_type": NODE, "inputs": {"model": model, **what}} if kind == "node" else
                  {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": what,
                                                                   "strength_model": 0.8}})
        model = [key, 0]
    p["6"] = _sampler(model, ["2", 1], ["3", 0], ["4", 0], seed=42, steps=steps, cfg=1.0)
    return p


def experts_prompt(unets: Sequence[str], node: Optional[Dict], steps: int, prefix: str) -> Dict:
    """Wan 2.2's graph: two loaders [-> a node each] -> KSamplerAdvanced high noise (steps 0..steps/2), then low
    noise (the rest), cfg 2 with the saved conditioning and its zeroed copy, on a 64x64x5 latent."""
    loader = LOADER if node is not None else "UNETLoader"
    steps = max(2, steps)  # one expert each
    half = steps // 2
    p = {"2": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": e2e_assets.TINY_COND_FOLDER}},
         "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 1]}},
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                   "batch_size": 1}},
         "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": prefix}}}
    for index, (unet, sampler, start, end, noise) in enumerate(((unets[0], "5", 0, half, "enable"),
                                                                 (unets[1], "6", half, 10000, "disable"))):
        loader_id, model = f"1{index}", [f"1{index}", 0]
        p[loader_id] = {"class_type": loader, "inputs": {"unet_name": unet, "weight_dtype": "default"}}
        if node is not None:
            p[f"2{index}"] = {"class_type": NODE, "inputs": {"model": model, **node}}
            model = [f"2{index}", 0]
        p[sampler] = {"class_type": "KSamplerAdvanced", "inputs": {
            "model": model, "add_noise": noise, "noise_seed": 42, "steps": steps, "cfg": 2.0,
            "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 1], "negative": ["3", 0],
            "latent_image": ["4", 0] if index == 0 else ["5", 0], "start_at_step": start, "end_at_step": end,
            "return_with_leftover_noise": "enable" if index == 0 else "disable"}}
    return p


# ------------------------------------------------------------------------------------------------------ runs
def _cgroup_file(cgroup, *names: str) -> Optional[str]:
    for name in names:
        if (cgroup.path / name).exists():
            return (cgroup.path / name).read_text()
    return None


def oom_kills(cgroup) -> int:
    """OOM kills in the cgroup so far (v1 memory.oom_control, v2 memory.events)."""
    text = _cgroup_file(cgroup, "memory.oom_control", "memory.events") or ""
    found = re.search(r"^oom_kill (\d+)", text, re.M)
    return int(found.group(1)) if found else 0


def drop_page_cache(paths: Sequence[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Servers:
    """A fresh server in a fresh cgroup per run (cgroup v2's peak cannot be reset everywhere), warmed up."""

    def __init__(self, base: Path):
        from ..tests.e2e.test_host_ram_cgroup import Cgroup, ServerInCgroup
        from ..tests.e2e.conftest import CPU_LOOPBACK_ENV, server_args

        self._cgroup_class, self._server_class = Cgroup, ServerInCgroup
        self.env, self.args, self.base = {CPU_LOOPBACK_ENV: "1"}, server_args(), base

    def start(self, extra_args: Sequence[str] = ()):
        cgroup = self._cgroup_class()
        server = self._server_class(cgroup, self.base, cpu=True, env=self.env, extra_args=self.args + list(extra_args))
        try:
            server.start(timeout=300)
            warm = e2e_assets.tiny_wan_prompt(
                {"class_type": "UNETLoader", "inputs": {"unet_name": e2e_assets.TINY_WAN21_NAME,
                                                        "weight_dtype": "default"}},
                {"class_type": NODE, "inputs": node_defaults(server)}, seed=0, steps=1, prefix="btr/warm")
            server.run_prompt(warm, timeout=300)
            unload(server)
        except BaseException:
            server.stop()
            cgroup.remove()
            raise
        return server, cgroup


def node_defaults(server) -> Dict:
    """The node's inputs at the defaults its own /object_info declares (what a user dropping it in gets)."""
    deadline = time.monotonic() + 120
    while not server.object_info(NODE).get("input"):  # the API can answer before the custom nodes are listed
        if time.monotonic() > deadline:
            raise ServerError(f"/object_info has no {NODE}: the pack did not load\n{server.log_tail()}")
        time.sleep(1)
    info = server.object_info(NODE)["input"]
    return {name: spec[1]["default"] for part in ("required", "optional") for name, spec in info.get(part, {}).items()
            if name != "model" and len(spec) > 1 and "default" in spec[1]}


def unload(server) -> None:
    server.free_memory()
    server.run_prompt({"1": {"class_type": "EmptyHunyuanLatentVideo",
                             "inputs": {"width": 16, "height": 16, "length": 1, "batch_size": 1}},
                       "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0],
                                                                    "filename_prefix": "btr/none"}}})


def run_limited(servers: Servers, make_prompt, limit: Optional[int], files: Sequence[Path], timeout: float,
                extra_args: Sequence[str] = ()) -> Dict:
    """One prompt in a fresh warmed server (``extra_args`` for main.py) whose cgroup is then limited to ``limit``
    bytes (None: no limit)."""
    import safetensors.torch

    server, cgroup = servers.start(extra_args)
    log_start = len(server.log_text())  # the log file also holds the servers before this one
    try:
        drop_page_cache(files)
        idle = cgroup.usage()
        cgroup.set_limit(limit)
        cgroup.reset_peak()
        kills = oom_kills(cgroup)
        prompt = make_prompt(node_defaults(server))
        started = time.perf_counter()
        result: Dict = {"limit": limit, "server_idle": idle}
        try:
            entry = server.run_prompt(prompt, timeout=timeout)
            result["outcome"] = "completed"
            latent = server.output_files(entry, "latents")[0]
            result["latent"] = safetensors.torch.load_file(str(latent))["latent_tensor"]
        except ServerError as error:
            result["outcome"] = ("OOM-killed" if oom_kills(cgroup) > kills else "failed") + f": {str(error)[:300]}"
        result["seconds"] = time.perf_counter() - started
        result["peak"] = cgroup.peak()
        result["failcnt"] = int(_cgroup_file(cgroup, "memory.failcnt") or 0)
        result["oom_kills"] = oom_kills(cgroup) - kills
        log = server.log_text()[log_start:]
        result["log"] = [line[line.index("[layerwise-offload]"):][:400] for line in log.splitlines()
                         if "[layerwise-offload]" in line]
        result["log_tail"] = "\n".join(log.splitlines()[-25:])
        return result
    finally:
        server.stop()
        cgroup.remove()


def plan_lines(log: Sequence[str]) -> List[str]:
    keys = ("plan", "host store", "on disk", "left in the file", "run:", "short", "refus")
    return [line for line in log if any(k in line for k in keys)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", nargs="+", default=["all"], choices=CASES + ("all",))
    ap.add_argument("--workdir", default="/tmp/layerwise-offload-bigger-than-ram",
                    help="checkpoints (kept for the next run) and the servers' base folder")
    ap.add_argument("--flux-double", type=int, default=1, help="Flux double blocks (648 MiB each in bf16)")
    ap.add_argument("--flux-single", type=int, default=38, help="Flux single blocks (270 MiB each in bf16)")
    ap.add_argument("--flux-limit-gib", type=float, default=5.2, help="the cgroup limit of the Flux cases")
    ap.add_argument("--lora-stride", type=int, default=8, help="the LoRA covers every N-th Flux block")
    ap.add_argument("--expert-blocks", type=int, default=22, help="blocks per Wan expert (64 MiB each)")
    ap.add_argument("--experts-limit", type=float, default=0.75, help="the experts' cgroup, times one expert's file")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reference-cap-gib", type=float, default=18.0,
                    help="the cgroup limit of ComfyUI alone's reference run (it needs the whole model in RAM)")
    ap.add_argument("--no-reference", action="store_true", help="skip ComfyUI alone (no bitwise check)")
    ap.add_argument("--reference-only", action="store_true",
                    help="only ComfyUI alone's run, kept in <workdir>/references for later runs")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per prompt")
    ap.add_argument("--json", help="append one JSON line per case to this file")
    ap.add_argument("--clean", action="store_true", help="remove the checkpoints at the end")
    a = ap.parse_args(argv)
    cases = CASES if "all" in a.case else tuple(a.case)
    workdir = Path(a.workdir)
    (workdir / "models").mkdir(parents=True, exist_ok=True)
    comfy = comfyui_path()
    version = next((line.split("=")[1].strip().strip("\"'") for line in
                    (comfy / "comfyui_version.py").read_text().splitlines() if line.startswith("__version__")), "?")
    base = prepare_base_dir(workdir / f"base-{comfy.name}")
    demo_files = e2e_assets.install_demo_assets(base / "models", base / "output", with_sd15=False,
                                                datasets_dir=base / "datasets")
    del demo_files
    write_flux_cond(base)
    flux_cases = [c for c in cases if c != "experts"]
    flux = experts = None
    if flux_cases:
        flux = flux_checkpoint(workdir, a.flux_double, a.flux_single)
    if "experts" in cases:
        experts = expert_checkpoints(workdir, a.expert_blocks)
    lora = None
    if "lora-before" in cases or "lora-after" in cases:
        lora = flux_lora(base / "models" / "loras" / f"layerwise_offload_flux_lora_every{a.lora_stride}.safetensors",
                         flux[0], a.lora_stride).name
    linked = ([flux[0]] if flux else []) + (list(experts[0]) if experts else [])
    for path in linked:
        target = base / "models" / "diffusion_models" / path.name
        if not target.exists():
            target.symlink_to(path)
    servers = Servers(base)
    status = 0
    for case in cases:
        extra_args = [] if case == "experts" else ["--bf16-unet"]
        if case == "experts":
            names = [p.name for p in experts[0]]
            files, figures = list(experts[0]), experts[1]
            limit = int(a.experts_limit * figures["file"])
            make = lambda node, pre: experts_prompt(names, node, a.steps, pre)  # noqa: E731
        else:
            files, figures = [flux[0]], flux[1]
            limit = int(a.flux_limit_gib * GiB)
            with_lora = lora if case.startswith("lora") else None
            make = (lambda node, pre, with_lora=with_lora: flux_prompt(  # noqa: E731
                flux[0].name, node, a.steps, pre, with_lora, lora_after=case == "lora-after"))
        print(f"[layerwise-offload] ComfyUI {version}, case {case}: DiT file {figures['file'] / GiB:.2f} GiB "
              f"({figures['block_count']} blocks, largest {figures['largest_block'] / MiB:.0f} MiB) in a "
              f"{limit / GiB:.2f} GiB cgroup", flush=True)
        got = ({"outcome": "not run (--reference-only)", "limit": limit, "server_idle": 0, "seconds": 0.0, "peak": 0,
                "failcnt": 0, "oom_kills": 0, "log": [], "log_tail": ""} if a.reference_only else
               run_limited(servers, lambda node: make(node, f"btr/{case}"), limit, files, a.timeout, extra_args))
        row = {"comfyui": version, "case": case, "server_args": extra_args, "file_bytes": figures["file"],
               "blocks": figures["block_count"],
               **{k: v for k, v in got.items() if k not in ("latent", "log", "log_tail")},
               "plan": plan_lines(got["log"])}
        if got["outcome"] != "completed" and not a.reference_only:
            print("\n".join(got["log"][-20:]) + "\n" + got["log_tail"])
        if not a.no_reference:
            import safetensors.torch
            import torch

            # ComfyUI alone's latent, kept per version, case, steps and model: computed once, reused by later runs.
            alone = f"lora{a.lora_stride}" if case.startswith("lora") else case  # a LoRA before or after: one
            kept = workdir / "references" / f"{version}-{alone}-{a.steps}steps-{figures['file']}-p2.safetensors"
            if kept.is_file():
                ref = {"outcome": f"completed (kept: {kept.name})", "peak": 0, "seconds": 0.0,
                       "latent": safetensors.torch.load_file(str(kept))["latent_tensor"]}
            else:
                ref = run_limited(servers, lambda node: make(None, f"btr/{case}_ref"),
                                  int(a.reference_cap_gib * GiB), files, a.timeout, extra_args)
                if "latent" in ref:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    safetensors.torch.save_file({"latent_tensor": ref["latent"]}, str(kept))
            row.update(reference_outcome=ref["outcome"], reference_peak=ref["peak"],
                       reference_seconds=ref["seconds"])
            if "latent" in got and "latent" in ref:
                row["bitwise"] = bool(torch.equal(got["latent"], ref["latent"]))
                row["finite"] = bool(torch.isfinite(ref["latent"]).all())
        ok = got["outcome"] == "completed" and row.get("bitwise", a.no_reference)
        status |= 0 if ok else 1
        print(f"[layerwise-offload] ComfyUI {version}, {case}: limit {limit / MiB:.0f} MiB, peak "
              f"{row['peak'] / MiB:.0f} MiB (server idle {row['server_idle'] / MiB:.0f} MiB), failcnt "
              f"{row['failcnt']}, OOM kills {row['oom_kills']}, {row['seconds']:.1f} s, {row['outcome'][:200]}, "
              f"bitwise {row.get('bitwise', '-')} (ComfyUI alone: {row.get('reference_outcome', '-')[:80]}, peak "
              f"{row.get('reference_peak', 0) / MiB:.0f} MiB, {row.get('reference_seconds', 0):.1f} s)", flush=True)
        for line in row["plan"]:
            print("    " + line)
        if a.json:
            with open(a.json, "a", encoding="utf-8") as out:
                out.write(json.dumps(row) + "\n")
    if a.clean:
        for path in linked:
            path.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
