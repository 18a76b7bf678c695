"""Weight formats side by side (``comfy_bench.py --formats bf16,fp8_mixed,gguf_q4_0``): the same preset's blocks
in bf16, in ComfyUI's fp8 mixed precision and in GGUF Q4_0, each loaded the way a user loads it, each sampled
fully loaded (that format's own reference) and through this pack's node at the ``--residents`` counts.

- ``bf16``: the preset built with random weights (``dit_presets.build``), as ``comfy.sd.load_diffusion_model``
  builds a bf16 file.
- ``fp8_mixed``: the same weights written as ComfyUI's mixed-precision safetensors (fp8 e4m3 block linears with a
  per-tensor scale, devtools/quantized_models.py) and loaded by ``comfy.sd.load_diffusion_model`` (UNETLoader):
  ``QuantizedTensor`` weights.
- ``gguf_q4_0``: the same weights as a GGUF file with Q4_0 block matrices, loaded by ComfyUI-GGUF's
  ``UnetLoaderGGUF`` (unmodified, from shared/peers): ``GGMLTensor`` weights. Skipped, with a line saying why,
  where that pack's source or the ``gguf`` package is missing.

Wan presets only (``wan21_14b``, ``tiny_wan``): the files must be read back by ComfyUI's model detection.
Per run: the weight type ComfyUI's loader produced, the streamed blocks' stored bytes (their parts' bytes, from the
loaded weights), the bytes the node's layout streams per forward and the bytes its counters saw moved per forward
(equal to the layout's), their ratio to bf16 at the same resident count, the step time and whether the output is
bitwise the same format's full-load output. Writes ``format_bench_<preset>_<device>.csv`` and ``.md``.
"""

from __future__ import annotations

import csv
import gc
import importlib.util
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

from .bench_config import BenchConfig
from .bench_modes import Harness
from ..devtools import peers
from ..devtools.quantized_models import save_fp8_mixed, save_gguf
from ..offload import choose_resident_blocks
from ..offload import weight_nbytes

FORMATS = ("bf16", "fp8_mixed", "gguf_q4_0")
FORMAT_COLUMNS = [
    "preset", "device", "format", "loader", "weight_type", "mode", "num_blocks", "resident", "streamed_blocks",
    "stored_bytes_per_block", "streamed_stored_bytes", "streamed_bytes_per_forward", "h2d_bytes_per_forward",
    "vs_bf16", "step_ms", "forwards_per_step", "stall_ms_per_step", "bitwise_equal", "error",
]
LOADERS = {"bf16": "random weights, as UNETLoader builds bf16", "fp8_mixed": "UNETLoader (fp8 mixed safetensors)",
           "gguf_q4_0": "UnetLoaderGGUF (ComfyUI-GGUF)"}


class FormatHarness(Harness):
    """The side-by-side harness over a model a loader returns, instead of the preset built in bf16."""

    def __init__(self, config: BenchConfig, load: Callable[[], object]):
        super().__init__(config)
        self._load = load

    def build_patcher(self):
        return self._load()


def parse_formats(text: str) -> Tuple[str, ...]:
    chosen = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown:
        raise ValueError(f"--formats {text!r}: unknown {unknown}; known: {', '.join(FORMATS)}")
    return chosen


def check_preset(preset: str) -> None:
    """The quantized files are read back by ComfyUI's model detection and written with Wan's key layout."""
    from .dit_presets import PRESETS

    if PRESETS[preset].comfy_config != "WAN21_T2V":
        wan = ", ".join(name for name, p in PRESETS.items() if p.comfy_config == "WAN21_T2V")
        raise ValueError(f"--formats needs a Wan preset ({wan}), not {preset!r}")


def gguf_missing() -> str:
    """Why the GGUF format cannot run here ('' when it can)."""
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
    if "gguf_q4_0" in formats:
        why = gguf_missing()
        if why:
            skipped.append(f"gguf_q4_0: skipped, {why}")
            log(skipped[-1])
        else:
            import comfy.cli_args
            from ..devtools import comfy_env

            comfy_env.import_comfyui(cpu=bool(comfy.cli_args.args.cpu))  # ComfyUI's nodes: ComfyUI-GGUF imports them
            gguf_pack = peers.import_comfyui_gguf(workdir / "custom_nodes")
            save_gguf(state_dict, workdir / "models" / "bench_q4_0.gguf", "Q4_0")
            folder_paths.add_model_folder_path("diffusion_models", str(workdir / "models"))
            loaders["gguf_q4_0"] = lambda: gguf_pack.nodes.UnetLoaderGGUF().load_unet("bench_q4_0.gguf")[0]
    return loaders, skipped


def _stored_bytes(harness) -> Tuple[List[int], str]:
    """Each block's stored bytes (the parts of its weights, as loaded) and the type of its largest weight."""
    sizes, kind = [], ""
    for block in harness.discovered.blocks:
        params = list(block.parameters())
        sizes.append(sum(weight_nbytes(p) for p in params))
        kind = kind or type(max(params, key=weight_nbytes)).__name__
    return sizes, kind


def _rows(fmt: str, harness, result, stored: List[int], kind: str) -> List[Dict[str, object]]:
    rows = []
    n = len(stored)
    for r in result.rows:
        if r["mode"] not in ("full", "layerwise"):
            continue
        keep = choose_resident_blocks(n, r["resident"], r["policy"] or "leading") if r["mode"] == "layerwise" \
            else [True] * n
        forwards = r["forwards_per_step"] or 1
        moved = "" if r["h2d_bytes_per_step"] == "" else r["h2d_bytes_per_step"] / forwards
        moved = int(moved) if moved != "" and float(moved).is_integer() else moved  # whole bytes stay exact in the CSV
        row = {c: "" for c in FORMAT_COLUMNS}
        row.update(preset=r["preset"], device=r["device"], format=fmt, loader=LOADERS[fmt], weight_type=kind,
                   mode=r["mode"], num_blocks=n, resident=r["resident"], streamed_blocks=keep.count(False),
                   stored_bytes_per_block=max(stored),
                   streamed_stored_bytes=sum(s for s, k in zip(stored, keep) if not k),
                   streamed_bytes_per_forward=r["streamed_bytes_per_forward"],
                   h2d_bytes_per_forward=moved,
                   step_ms=r["step_ms"], forwards_per_step=r["forwards_per_step"],
                   stall_ms_per_step=r["stall_ms_per_step"], bitwise_equal=r["bitwise_equal"], error=r["error"])
        rows.append(row)
    return rows


def _failed_row(config: BenchConfig, fmt: str, error: Exception) -> Dict[str, object]:
    row = {c: "" for c in FORMAT_COLUMNS}
    row.update(preset=config.preset, format=fmt, loader=LOADERS[fmt], mode="full", bitwise_equal=False,
               error=f"{type(error).__name__}: {error}"[:300])
    return row


def run_formats(config: BenchConfig, log) -> Tuple[List[Dict[str, object]], List[str]]:
    """Every format of ``config.formats`` in turn (one process, one ComfyUI); returns (rows, skipped lines).
    The caller sets the CPU loopback and threads (comfy_bench.run_formats_bench)."""
    check_preset(config.preset)
    bf16 = Harness(config)
    bf16.setup()  # imports ComfyUI for the device and builds the preset: the weights every format starts from
    state_dict = {k: v.detach().to("cpu", copy=True) for k, v in bf16.diffusion_model.state_dict().items()}
    rows: List[Dict[str, object]] = []
    skipped: List[str] = []
    with tempfile.TemporaryDirectory(prefix="lwo_formats_") as tmp:
        loaders, skipped = _loaders(config.formats, state_dict, Path(tmp), log)
        del state_dict
        if "bf16" not in config.formats:
            bf16.teardown()
        for fmt in (f for f in FORMATS if f in config.formats):  # bf16 first: its harness holds the weights
            if fmt != "bf16" and fmt not in loaders:
                continue
            harness = bf16 if fmt == "bf16" else FormatHarness(config, loaders[fmt])
            try:
                if harness is not bf16:
                    harness.setup()
                stored, kind = _stored_bytes(harness)
                log(f"{fmt}: {kind} weights, {max(stored) / 2**20:.1f} MiB stored per block")
                rows += _rows(fmt, harness, harness.run(), stored, kind)
            except Exception as error:  # noqa: BLE001 - one format failing is a result; the others still run
                import traceback
                traceback.print_exc()
                rows.append(_failed_row(config, fmt, error))
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
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FORMAT_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]) for c in FORMAT_COLUMNS})
    Path(f"{stem}.md").write_text(markdown(rows, skipped))
    return {"csv": f"{stem}.csv", "md": f"{stem}.md"}
