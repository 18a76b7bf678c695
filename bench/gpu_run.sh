#!/usr/bin/env bash
# The whole GPU measurement in one device call (about 8 min, default cap TOTAL_S=480 s), no network:
#
#   bash bench/gpu_prep.sh               # here, once: fills .gpu/ (two ComfyUI trees, wheels)
#   bash bench/gpu_run.sh                # on the device: carry [".gpu"]
#   bash bench/gpu_run.sh --dry-run      # on the CPU: every step up to its first CUDA call
#
# Steps (each under its own time cap; a step that fails is logged and the next one runs):
#   1. unpack .gpu/comfyui-0.3.75.tar.gz and comfyui-0.14.1.tar.gz to $WORK, install .gpu/wheels (torchsde) and
#      .gpu/wheels-0.14.1 (comfy-aimdo, comfy-kitchen) into separate --target folders
#   2. ComfyUI 0.3.75: bench/activation_memory.py --device cuda: the activation table with its measured column
#      (torch.cuda.max_memory_allocated per row)                                         cap ACT_S (75 s)
#   3. ComfyUI 0.3.75: bench/comfy_bench.py on PRESETS (flux,wan21_14b): full load, ComfyUI lowvram at BUDGETS,
#      the layerwise sweep and auto, all compared bitwise with the full load               cap BENCH_S (150 s)
#   3b. ComfyUI 0.3.75: comfy_bench.py --formats: FMT_BLOCKS (4) Wan 14B blocks in bf16, fp8 mixed (QuantizedTensor)
#      and GGUF Q4_0 (ComfyUI-GGUF from .gpu/peers, gguf from .gpu/wheels), each fully loaded and with 0 and
#      FMT_BLOCKS/2 blocks resident: bytes per forward and bitwise checks per format             cap FMT_S (90 s)
#   4. ComfyUI 0.14.1: bench/dynamic_vram_bench.py on PRESETS14 (flux,wan21_14b): full load, ComfyUI's dynamic
#      VRAM (comfy-aimdo active) and this pack at its defaults (auto), each on the whole GPU and with ComfyUI told
#      that only LIMITS x the weights are free; one process per run, then the bitwise comparison      cap DYN_S (150 s)
# Needs on the device: python3 with torch (CUDA) and ComfyUI's import-time dependencies (numpy, scipy, einops,
# transformers, safetensors, psutil, pyyaml, pillow, tqdm, aiohttp). PYTHON overrides python3; DEVICE=cpu is not
# supported (use --dry-run). Writes bench/results/gpu/ and, when $OUT is set, $OUT/gpu_results.tar.gz + log + tables.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
START=$(date +%s)
WORK="${WORK:-/tmp/lwo_gpu}"
if (( DRY )); then
    RESULTS="${RESULTS:-$WORK/dry_results}"
    PY="${PYTHON:-$ROOT/.venv/bin/python}"           # this machine's environments stand in for the device's
    PY14="${PYTHON_014:-$ROOT/.venv-0.14.1/bin/python}"
else
    RESULTS="${RESULTS:-$ROOT/bench/results/gpu}"
    PY="${PYTHON:-python3}"
    PY14="$PY"
fi
mkdir -p "$RESULTS" "$WORK"
LOG="$RESULTS/log.txt"
: > "$LOG"
export PYTHONUNBUFFERED=1
STATUS=0

say() { echo "[gpu_run] $*" | tee -a "$LOG"; }
left() { echo $(( ${TOTAL_S:-480} - ($(date +%s) - START) )); }
step() {  # step NAME CAP_S command...: runs under min(CAP_S, time left), logs, records a failure, goes on
    local name="$1" cap="$2"; shift 2
    local budget; budget=$(left)
    (( budget < cap )) && cap=$budget
    if (( cap < 15 )); then say "$name: skipped, $(left) s left of TOTAL_S"; STATUS=1; return; fi
    say "$name (cap ${cap} s)"
    timeout --signal=INT --kill-after=15 "$cap" "$@" 2>&1 | grep --line-buffered -v "^WARNING:root:torchaudio missing" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if (( rc != 0 )); then say "$name: exit status $rc"; STATUS=1; fi
}

# --------------------------------------------------------------------------- 1. ComfyUI trees and wheels
comfy_tree() {  # comfy_tree VERSION LOCAL_FALLBACK -> prints the folder to use
    local version="$1" fallback="$2" dest="$WORK/ComfyUI-$1"
    if [[ -f ".gpu/comfyui-$version.tar.gz" ]]; then
        rm -rf "$dest" && mkdir -p "$dest" && tar -xzf ".gpu/comfyui-$version.tar.gz" -C "$dest" && mkdir -p "$dest/models"
        echo "$dest"
    elif (( DRY )) && [[ -f "$fallback/main.py" ]]; then
        echo "$fallback"
    fi
}
C075="$(comfy_tree 0.3.75 "$ROOT/.comfyui/ComfyUI")"
C014="$(comfy_tree 0.14.1 "$ROOT/.comfyui/ComfyUI-0.14.1")"
say "ComfyUI 0.3.75 at ${C075:-<missing: run bench/gpu_prep.sh>}; 0.14.1 at ${C014:-<missing: run bench/gpu_prep.sh>}"
[[ -n "$C075" ]] || { say "no ComfyUI 0.3.75: run bash bench/gpu_prep.sh here and carry .gpu"; exit 3; }

device_python="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
wheel_fits() {  # wheel_fits FILE: the wheel's tag accepts the device's Python (cpXY or abi3 from cpXY on)
    "$PY" - "$1" "$device_python" <<'EOF'
import sys, re
name, version = sys.argv[1].rsplit("/", 1)[-1], tuple(int(x) for x in sys.argv[2].split("."))
python_tag, abi_tag = name[:-4].split("-")[-3:-1]
if python_tag.startswith("py"):
    sys.exit(0)
tags = [tuple(int(x) for x in (t[2], t[3:])) for t in python_tag.split(".") if re.fullmatch(r"cp\d\d+", t)]
ok = any(t == version or (abi_tag == "abi3" and t <= version) for t in tags)
sys.exit(0 if ok else 1)
EOF
}
install_wheels() {  # install_wheels DIR TARGET: pip install --target the wheels that fit (a dry run only checks)
    local dir="$1" target="$2" whl fitting=()
    compgen -G "$dir/*.whl" >/dev/null || { say "no wheels in $dir (run bench/gpu_prep.sh)"; return 1; }
    for whl in "$dir"/*.whl; do
        if wheel_fits "$whl"; then
            fitting+=("$whl")
        else
            say "$(basename "$whl") does not fit Python $device_python: left out (prepare with DEVICE_PYTHON=$device_python)"
        fi
    done
    (( DRY )) && { say "dry run: $dir checked, not installed (this machine's venvs stand in)"; return 0; }
    (( ${#fitting[@]} )) || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "${fitting[@]}"
}
SITE="$WORK/site"; SITE14="$WORK/site-0.14.1"
if [[ -d .gpu/wheels ]]; then install_wheels .gpu/wheels "$SITE" || STATUS=1; fi
HAVE14=0  # 0.14.1 imports comfy_aimdo at start-up; without comfy_kitchen it only loses fp8/fp4 support
if [[ -n "$C014" ]]; then
    if [[ -d .gpu/wheels-0.14.1 ]]; then
        install_wheels .gpu/wheels-0.14.1 "$SITE14" || STATUS=1
        if (( DRY )) || [[ -d "$SITE14/comfy_aimdo" ]]; then HAVE14=1; fi
    elif (( DRY )); then
        say "dry run: no .gpu/wheels-0.14.1; $PY14 must have comfy-aimdo"; HAVE14=1
    fi
fi
{
    date -u
    (( DRY )) || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$RESULTS/env.txt" >> "$LOG"
with075=(env COMFYUI_PATH="$C075" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}")  # timeout runs programs, not functions
with014=(env COMFYUI_PATH="$C014" PYTHONPATH="$SITE14:$SITE${PYTHONPATH:+:$PYTHONPATH}")

# --------------------------------------------------------------------------- 2. activation table, measured
if (( DRY )); then
    step "activation table (dry run)" "${ACT_S:-75}" "${with075[@]}" "$PY" -P bench/activation_memory.py --dry-run
else
    step "activation table, measured column" "${ACT_S:-75}" \
        "${with075[@]}" "$PY" -P bench/activation_memory.py --device cuda --out "$RESULTS/activation"
fi

# --------------------------------------------------------------------------- 3. ComfyUI 0.3.75 side by side
BENCH_ARGS=(--preset "${PRESETS:-flux,wan21_14b}" --steps "${STEPS:-5}" --budgets "${BUDGETS:-0.3,0.6,0.9}"
            --deadline-s "${DEADLINE_S:-45}" --out "$RESULTS/comfy_0.3.75")
if (( DRY )); then
    step "ComfyUI 0.3.75 side by side (dry run)" "${BENCH_S:-150}" "${with075[@]}" "$PY" -P bench/comfy_bench.py --dry-run "${BENCH_ARGS[@]}"
else
    step "ComfyUI 0.3.75 side by side" "${BENCH_S:-150}" "${with075[@]}" "$PY" -P bench/comfy_bench.py --device cuda "${BENCH_ARGS[@]}"
fi

# --------------------------------------------------------------------------- 3b. weight formats (0.3.75)
# ComfyUI-GGUF's source travels in .gpu/peers (bench/gpu_prep.sh); devtools/peers.py looks for <shared>/peers.
[[ -d .gpu/peers ]] && export LAYERWISE_OFFLOAD_SHARED="$ROOT/.gpu"
FMT_BLOCKS="${FMT_BLOCKS:-4}"
FMT_ARGS=(--preset wan21_14b --blocks "$FMT_BLOCKS" --steps 3 --formats bf16,fp8_mixed,gguf_q4_0
          --residents "0,$(( FMT_BLOCKS / 2 ))" --prefetch 1 --policies leading --out "$RESULTS/formats_0.3.75")
if (( DRY )); then
    step "ComfyUI 0.3.75 weight formats (dry run)" "${FMT_S:-90}" "${with075[@]}" "$PY" -P bench/comfy_bench.py --dry-run "${FMT_ARGS[@]}"
else
    step "ComfyUI 0.3.75 weight formats" "${FMT_S:-90}" "${with075[@]}" "$PY" -P bench/comfy_bench.py --device cuda "${FMT_ARGS[@]}"
fi

# --------------------------------------------------------------------------- 4. ComfyUI 0.14.1 dynamic VRAM
PRESETS14="${PRESETS14:-flux,wan21_14b}"
if (( ! HAVE14 )); then
    say "ComfyUI 0.14.1 part skipped: no 0.14.1 tree or no comfy-aimdo wheel for Python $device_python"; STATUS=1
elif (( DRY )); then
    step "ComfyUI 0.14.1 dynamic VRAM (dry run)" "${DYN_S:-150}" \
        "${with014[@]}" "$PY14" -P bench/dynamic_vram_bench.py --dry-run --preset "$PRESETS14"
else
    DYN_OUT="$RESULTS/dynamic_vram_0.14.1"
    DYN_END=$(( $(date +%s) + ${DYN_S:-150} ))
    for preset in ${PRESETS14//,/ }; do
        for limit in 0 ${LIMITS:-0.5}; do
            for mode in full dynamic layerwise; do
                [[ "$mode" == full && "$limit" != 0 ]] && continue  # the reference runs on the whole GPU only
                cap=$(( DYN_END - $(date +%s) ))
                step "0.14.1 $preset $mode limit $limit" "$cap" "${with014[@]}" "$PY14" -P bench/dynamic_vram_bench.py \
                    --mode "$mode" --preset "$preset" --limit-fraction "$limit" --out "$DYN_OUT"
            done
        done
    done
    step "0.14.1 comparison" 30 "${with014[@]}" "$PY14" -P bench/dynamic_vram_bench.py --compare "$DYN_OUT"
fi

say "done in $(( $(date +%s) - START )) s, status $STATUS"
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    tar -czf "$OUT/gpu_results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
    cp "$LOG" "$OUT/"
    for f in "$RESULTS"/activation/activation_memory.md "$RESULTS"/dynamic_vram_0.14.1/dynamic_vram.md \
             "$RESULTS"/comfy_0.3.75/*_summary.csv "$RESULTS"/formats_0.3.75/*.md; do
        [[ -f "$f" ]] && cp "$f" "$OUT/"
    done
fi
exit "$STATUS"
