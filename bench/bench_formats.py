"""Weight formats side by side (``comfy_bench.py --formats``): the same Wan preset's blocks in bf16 (as built), as
ComfyUI's fp8 mixed precision (devtools/quantized_models.py; loaded by UNETLoader's ``load_diffusion_model``:
``QuantizedTensor``) and as GGUF (block matrices in Q4_0, or F16 / Q8_0 / Q5_0; loaded by ComfyUI-GGUF's
``UnetLoaderGGUF``, unmodified, from shared/peers: ``GGMLTensor``; skipped, with the reason, without that source or
the ``gguf`` package). Each format runs fully loaded (its own reference) and through the node at ``--residents``.

Per run: the weight type the loader made, the streamed blocks' stored bytes, the bytes the node's layout streams
per forward and those its counters saw moved (equal), their ratio to bf16 at the same resident count, the step
time and whether the output is bitwise its format's full load: ``format_bench_<preset>_<device>.csv`` and ``.md``.
``wan14b_table``: what the host store packs for one Wan 2.1 14B block per format, from the stored parts' shapes.
"""

from __future__ import annotations

import gc
import importlib.util
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

from .harness import BenchConfig, Harness
from .measure import write_csv
from ..devtools import peers
from ..devtools.quantized_models import save_fp8_mixed, save_gguf
from ..offload import choose_resident_blocks, footprint, format_bytes, weight_nbytes

ALL_FORMATS = ("bf16", "fp8_mixed", "gguf_f16", "gguf_q8_0", "gguf_q5_0", "gguf_q4_0")
GGML_BYTES_PER_32 = {"F16": 64, "Q8_0": 34, "Q5_0": 22, "Q4_0": 18}
FORMAT_COLUMNS = [
    "preset", "device", "format", "loader", "weight_type", "mode", "num_blocks", "resident", "streamed_blocks",
    "stored_bytes_per_block", "streamed_stored_bytes", "streamed_bytes_per_forward", "h2d_bytes_per_forward",
    "vs_bf16", "step_ms", "forwards_per_step", "stall_ms_per_step", "bitwise_equal", "error",
]
LOADERS = {"bf16": "random weights, as UNETLoader builds bf16", "fp8_mixed": "UNETLoader (fp8 mixed safetensors)"}


def _qtype(fmt: str) -> str:
    return fmt[len("gguf_"):].upper()


def _loader(fmt: str) -> str:
    return LOADERS.get(fmt, "UnetLoaderGGUF (ComfyUI-GGUF)")


def parse_formats(text: str) -> Tuple[str, ...]:
    chosen = ALL_FORMATS if text.strip() == "all" else tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in chosen if f not in ALL_FORMATS]
    if unknown:
        raise ValueError(f"--formats {text!r}: unknown {unknown}; known: {', '.join(ALL_FORMATS)} or all")
    return chosen


def check_preset(preset: str) -> None:
    """The quantized files are read back by ComfyUI's model detection and written with Wan's key layout."""
    from ..devtools.dit_presets import PRESETS

    if PRESETS[preset].comfy_config != "WAN21_T2V":
        wan = ", ".join(name for name, p in PRESETS.items() if p.comfy_config == "WAN21_T2V")
        raise ValueError(f"--formats needs a Wan preset ({wan}), not {preset!r}")


def gguf_missing() -> str:
    """Why the GGUF formats cannot run here ('' when they can)."""
    if peers.peer_tarball() is None:
        return f"no shared/peers/{peers.GGUF_TARBALL} (set LAYERWISE_OFFLOAD_SHARED to the folder holding peers/)"
    if importlib.util.find_spec("gguf") is None:
        return "the 'gguf' package is not installed (pip install gguf)"
    return ""


def _loaders(formats, state_dict, workdir: Path, log) -> Tuple[Dict[str, Callable[[], object]], List[str]]:
    """Write each quantized file from the bf16 weights; returns {format: load()} and the skipped lines."""
    import comfy.sd
    import folder_paths

    loaders, skipped = {}, []
    if "fp8_mixed" in formats:
        path = save_fp8_mixed(dict(state_dict), workdir / "bench_fp8_mixed.safetensors", "format bench, fp8 mixed")
        loaders["fp8_mixed"] = lambda: comfy.sd.load_diffusion_model(path)
    gguf = [f for f in formats if f.startswith("gguf_")]
    why = gguf_missing() if gguf else ""
    for fmt in gguf if why else ():
        skipped.append(f"{fmt}: skipped, {why}")
        log(skipped[-1])
    if gguf and not why:
        import comfy.cli_args
        from ..devtools import comfy_env

        comfy_env.import_comfyui(cpu=bool(comfy.cli_args.args.cpu))  # ComfyUI's nodes: ComfyUI-GGUF imports them
        gguf_pack = peers.import_comfyui_gguf(workdir / "custom_nodes")
        folder_paths.add_model_folder_path("diffusion_models", str(workdir / "models"))
        for fmt in gguf:
            name = f"bench_{_qtype(fmt).lower()}.gguf"
            save_gguf(state_dict, workdir / "models" / name, _qtype(fmt))
            loaders[fmt] = lambda name=name: gguf_pack.nodes.UnetLoaderGGUF().load_unet(name)[0]
    return loaders, skipped


def _rows(fmt: str, harness, result) -> List[Dict[str, object]]:
    """The format's rows from the harness's full and layerwise rows, with each block's stored bytes (the parts of
    its weights, as loaded) and the type of its largest weight."""
    stored, kind = [], ""
    for block in harness.discovered.blocks:
        params = list(block.parameters())
        stored.append(sum(weight_nbytes(p) for p in params))
        kind = kind or type(max(params, key=weight_nbytes)).__name__
    harness.log(f"{fmt}: {kind} weights, {format_bytes(max(stored))} stored per block")
    rows, n = [], len(stored)
    for r in result.rows:
        if r["mode"] not in ("full", "layerwise"):
            continue
        keep = choose_resident_blocks(n, r["resident"], r["policy"] or "leading") if r["mode"] == "layerwise" \
            else [True] * n
        moved = "" if r["h2d_bytes_per_step"] == "" else r["h2d_bytes_per_step"] / (r["forwards_per_step"] or 1)
        moved = int(moved) if moved != "" and float(moved).is_integer() else moved  # whole bytes stay exact in the CSV
        row = {c: "" for c in FORMAT_COLUMNS}
        row.update(preset=r["preset"], device=r["device"], format=fmt, loader=_loader(fmt), weight_type=kind,
                   mode=r["mode"], num_blocks=n, resident=r["resident"], streamed_blocks=keep.count(False),
                   stored_bytes_per_block=max(stored),
                   streamed_stored_bytes=footprint(stored, keep, 1).streamed_bytes,
                   streamed_bytes_per_forward=r["streamed_bytes_per_forward"], h2d_bytes_per_forward=moved,
                   step_ms=r["step_ms"], forwards_per_step=r["forwards_per_step"],
                   stall_ms_per_step=r["stall_ms_per_step"], bitwise_equal=r["bitwise_equal"], error=r["error"])
        rows.append(row)
    return rows


def run_formats(config: BenchConfig, log) -> Tuple[List[Dict[str, object]], List[str]]:
    """Every format of ``config.formats`` in turn (one process, one ComfyUI); returns (rows, skipped lines).
    The caller sets the CPU loopback and threads (comfy_bench.run_formats_bench)."""
    check_preset(config.preset)
    bf16 = Harness(config)
    bf16.setup()  # imports ComfyUI for the device and builds the preset: the weights every format starts from
    state_dict = {k: v.detach().to("cpu", copy=True) for k, v in bf16.diffusion_model.state_dict().items()}
    rows: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="lwo_formats_") as tmp:
        loaders, skipped = _loaders(config.formats, state_dict, Path(tmp), log)
        del state_dict
        if "bf16" not in config.formats:
            bf16.teardown()
        for fmt in (f for f in ALL_FORMATS if f in config.formats):  # bf16 first: its harness holds the weights
            if fmt != "bf16" and fmt not in loaders:
                continue
            harness = bf16 if fmt == "bf16" else Harness(config, loaders[fmt])
            try:
                if harness is not bf16:
                    harness.setup()
                rows += _rows(fmt, harness, harness.run())
            except Exception as error:  # noqa: BLE001 - one format failing is a result; the others still run
                import traceback
                traceback.print_exc()
                row = {c: "" for c in FORMAT_COLUMNS}
                row.update(preset=config.preset, format=fmt, loader=_loader(fmt), mode="full", bitwise_equal=False,
                           error=f"{type(error).__name__}: {error}"[:300])
                rows.append(row)
            finally:
                harness.teardown()
            bf16 = harness = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    base = {r["resident"]: r["h2d_bytes_per_forward"] for r in rows
            if r["format"] == "bf16" and r["mode"] == "layerwise"}
    for r in rows:
        if r["mode"] == "layerwise" and base.get(r["resident"]) and r["h2d_bytes_per_forward"] != "":
            r["vs_bf16"] = r["h2d_bytes_per_forward"] / base[r["resident"]]
    return rows, skipped


def markdown(rows, skipped) -> str:
    lines = ["| format | weight type | mode | resident / streamed | stored bytes of the streamed blocks | "
             "bytes per forward (layout) | moved per forward (counted) | vs bf16 | ms/step | "
             "bitwise vs its full load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        moved = "" if r["h2d_bytes_per_forward"] == "" else f"{r['h2d_bytes_per_forward']:,.0f}"
        ratio = "" if r["vs_bf16"] == "" else f"{r['vs_bf16']:.2f}"
        check = "FAILED: " + r["error"] if r["error"] else ("equal" if r["bitwise_equal"] else "DIFFERENT")
        if r["error"] and r["step_ms"] == "":
            lines.append(f"| {r['format']} | | {r['mode']} | | | | | | | {check} |")
            continue
        lines.append(f"| {r['format']} | {r['weight_type']} | {r['mode']} | {r['resident']} / {r['streamed_blocks']} | "
                     f"{r['streamed_stored_bytes']:,} | {r['streamed_bytes_per_forward']:,} | {moved} | {ratio} | "
                     f"{r['step_ms']:.1f} | {check} |")
    return "\n".join(lines + [f"\n{line}" for line in skipped]) + "\n"


def write_format_outputs(rows, skipped, config: BenchConfig, device: str) -> Dict[str, str]:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"format_bench_{config.preset}_{device}"
    Path(f"{stem}.md").write_text(markdown(rows, skipped))
    return {"csv": write_csv(f"{stem}.csv", rows, FORMAT_COLUMNS), "md": f"{stem}.md"}


def wan14b_block_parts(fmt: str):
    """(name, shape, dtype) of what the host store packs for one Wan 2.1 14B block (dim 5120, ffn 13824) in ``fmt``."""
    dim, ffn = 5120, 13824
    linears = [(f"{a}.{p}", (dim, dim)) for a in ("self_attn", "cross_attn") for p in "qkvo"]
    linears += [("ffn.0", (ffn, dim)), ("ffn.2", (dim, ffn))]
    vectors = [(f"{n}.bias", (o,)) for n, (o, _) in linears]
    vectors += [(f"{a}.norm_{x}.weight", (dim,)) for a in ("self_attn", "cross_attn") for x in "qk"]
    vectors += [("norm3.weight", (dim,)), ("norm3.bias", (dim,)), ("modulation", (1, 6, dim))]
    parts = []
    for name, (out_f, in_f) in linears:
        if fmt == "bf16":
            parts.append((name, (out_f, in_f), torch.bfloat16))
        elif fmt == "fp8_mixed":
            parts += [(name + ":qdata", (out_f, in_f), torch.float8_e4m3fn), (name + ":scale", (), torch.float32)]
        else:
            parts.append((name, (out_f, in_f // 32 * GGML_BYTES_PER_32[_qtype(fmt)]), torch.uint8))
    # 1-D tensors: the compute dtype (bf16, fp8 mixed), float32 in GGUF files (as ComfyUI-GGUF's convert keeps them)
    vector_dtype = torch.bfloat16 if fmt in ("bf16", "fp8_mixed") else torch.float32
    return parts + [(name, shape, vector_dtype) for name, shape in vectors]


def wan14b_table(formats) -> str:
    """Bytes one streamed Wan 2.1 14B block puts on the wire per format: ``plan_layout`` of its stored parts
    (computed, not run: such a block does not fit the CPU benchmark's budget)."""
    from ..offload.host.packing import plan_layout  # looks inside: the host store's own layout of a block

    def nbytes(fmt):
        return plan_layout([(n, torch.nn.Parameter(torch.empty(s, dtype=d, device="meta"), requires_grad=False))
                            for n, s, d in wan14b_block_parts(fmt)]).nbytes
    base = nbytes("bf16")
    lines = ["Wan 2.1 14B block shape (dim 5120, ffn 13824), bytes one streamed block puts on the wire "
             "(plan_layout of the stored parts):", "", "| format | bytes per block | MiB | vs bf16 |",
             "| --- | --- | --- | --- |"]
    for fmt in dict.fromkeys(("bf16", *formats)):
        lines.append(f"| {fmt} | {nbytes(fmt):,} | {nbytes(fmt) / 2**20:.1f} | {nbytes(fmt) / base:.2f} |")
    return "\n".join(lines) + "\n"
