#!/usr/bin/env bash
# The whole GPU measurement in ONE device call of at most LIMIT_S (420) seconds, set-up included; no network
# (docs/gpu_run.md: the plan, the caps, how to read the tables).
#
#   bash bench/gpu_prep.sh             # here, once: fills .gpu/ (two ComfyUI trees, five wheels; < 60 MiB)
#   bash bench/gpu_run.sh              # on the device: carry [".gpu"], timeout_s 480
#   bash bench/gpu_run.sh --dry-run    # on the CPU: the time plan, then every step at the tiny presets
#
# Every step (bench/gpu_steps.py) is its own process under its own cap (min(cap, time left)); a step that fails or
# is cut is logged and the next one runs. Rows are appended to $OUT/{preflight,blocks,steps}.csv as each is
# measured, so a cut run keeps what it measured. Needs on the device: python3 (3.12) with torch (CUDA; 2.11 in the
# image) and ComfyUI's import-time packages (the image lacks torchsde, trampoline, comfy-aimdo, comfy-kitchen, maybe
# torchaudio: wheels in .gpu, torchaudio installed only where the image has none). The native to beat is ComfyUI
# 0.33.0, whose dynamic VRAM (comfy-aimdo) is its default on NVIDIA.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
START=$(date +%s)
LIMIT_S="${LIMIT_S:-420}"    # the device call's whole run (of 15 device minutes: room to run it twice)
SETUP_S="${SETUP_S:-40}"     # the plan's allowance for unpacking the trees and installing the wheels
RESERVE_S="${RESERVE_S:-10}" # kept back at the end (the last step's kill-after and the copy out)
WORK="${WORK:-/tmp/lwo_gpu}"

# name cap_s comfyui step-arguments...  (the order is the priority: a run that runs short loses the last ones)
# smoke runs under TORCH_CUDA_SANITIZER=1 (torch's stream-race checker): the tiny preset, a few settings.
# --sweep: every resident count 0..N in steps (gpu_steps.sweep_counts), at the node's defaults, each beside the
# timing model's prediction for the same setting, per-block CUDA-event timelines in timeline.csv.
# The side-by-side rows (this pack against ComfyUI at equal VRAM) come first in each step, the sweep after them.
# --takeover: the node on 0.33.0's dynamic patcher with comfy-aimdo started.
PLAN=(
    "smoke       40 075 smoke --preset tiny"
    "preflight   25 075 preflight"
    "s075_flux   85 075 sidebyside --preset flux --lowvram --weights --sweep"
    "s075_wan    70 075 sidebyside --preset wan21_14b --lowvram --sweep"
    "s033_flux   40 033 sidebyside --preset flux"
    "dyn033_flux 60 033 dynamic --preset flux --takeover"
    "lora_075    40 075 lora --preset wan21_14b"
)
# Not in the default plan (it must fit 420 s); ONLY names steps of either list to run just those, in that order:
#   ONLY="s033_flux dyn033_flux fp8_033" bash bench/gpu_run.sh
EXTRA=(
    "fp8_033     50 033 fp8 --preset wan21_14b"
    "s033_wan    45 033 sidebyside --preset wan21_14b"
    "dyn033_wan  45 033 dynamic --preset wan21_14b --takeover"
)
if [[ -n "${ONLY:-}" ]]; then
    chosen=()
    for want in $ONLY; do
        found=""
        for entry in "${PLAN[@]}" "${EXTRA[@]}"; do
            read -r name _ <<<"$entry"
            [[ "$name" == "$want" ]] && found="$entry"
        done
        [[ -n "$found" ]] || { echo "[gpu_run] ONLY names $want, which no step is"; exit 4; }
        chosen+=("$found")
    done
    PLAN=("${chosen[@]}")
fi
planned=$(( SETUP_S + RESERVE_S ))
for entry in "${PLAN[@]}"; do read -r _ cap _ <<<"$entry"; planned=$(( planned + cap )); done

if (( DRY )); then
    OUTDIR="${RESULTS:-$WORK/dry_out}"
    PY="${PYTHON:-$ROOT/.venv/bin/python}"           # this machine's environments stand in for the device's
    PY33="${PYTHON_033:-$ROOT/.venv-0.33.0/bin/python}"
else
    OUTDIR="${OUT:-$ROOT/bench/results/gpu}"
    PY="${PYTHON:-python3}"
    PY33="$PY"
fi
rm -rf "$WORK/state"
mkdir -p "$OUTDIR" "$WORK"
LOG="$OUTDIR/log.txt"
: > "$LOG"
export PYTHONUNBUFFERED=1
STATUS=0
say() { echo "[gpu_run] $*" | tee -a "$LOG"; }
left() { echo $(( LIMIT_S - RESERVE_S - ($(date +%s) - START) )); }

say "plan: ${#PLAN[@]} steps, ${planned} s with set-up ${SETUP_S} s and reserve ${RESERVE_S} s, of LIMIT_S ${LIMIT_S} s"
if (( planned > LIMIT_S )); then say "the plan's caps add up to ${planned} s > LIMIT_S ${LIMIT_S} s: shorten them"; exit 4; fi

# --------------------------------------------------------------------------- set-up: trees and wheels
comfy_tree() {  # comfy_tree VERSION LOCAL_FALLBACK -> prints the folder to use
    local version="$1" fallback="$2" dest="$WORK/ComfyUI-$1"
    if (( DRY )); then
        if [[ -f ".gpu/comfyui-$version.tar.gz" ]] && ! tar -tzf ".gpu/comfyui-$version.tar.gz" ./main.py >/dev/null 2>&1; then
            say ".gpu/comfyui-$version.tar.gz has no ./main.py: run bash bench/gpu_prep.sh again"; return 1
        fi
        [[ -f "$fallback/main.py" ]] && echo "$fallback"
    elif [[ -f ".gpu/comfyui-$version.tar.gz" ]]; then
        rm -rf "$dest" && mkdir -p "$dest" && tar -xzf ".gpu/comfyui-$version.tar.gz" -C "$dest" && mkdir -p "$dest/models" \
            && echo "$dest"
    fi
}
C075="$(comfy_tree 0.3.75 "$ROOT/.comfyui/ComfyUI")"
C033="$(comfy_tree 0.33.0 "$ROOT/.comfyui/ComfyUI-0.33.0")"
say "ComfyUI 0.3.75 at ${C075:-<missing: run bash bench/gpu_prep.sh, carry .gpu>}; 0.33.0 at ${C033:-<missing>}"

DEVICE_PYTHON="${DEVICE_PYTHON:-3.12}"
SITE="$WORK/site"; SITE33="$WORK/site-0.33.0"
install_wheels() {  # install_wheels DIR TARGET: a dry run checks the wheels are there and fit the device's Python
    local dir="$1" target="$2" whl name unpacked="$WORK/wheels/$(basename "$1")"
    compgen -G "$dir/*.whl*" >/dev/null || { say "no wheels in $dir (run bash bench/gpu_prep.sh)"; return 1; }
    for whl in "$dir"/*.whl*; do
        name="$(basename "$whl" .xz)"
        case "$name" in
            *-py3-none-*|*-cp${DEVICE_PYTHON/./}-*|*-abi3-*) ;;
            *) say "$name does not fit Python $DEVICE_PYTHON"; return 1 ;;
        esac
    done
    if (( DRY )); then
        say "dry run: $(ls "$dir" | tr '\n' ' ')fit Python $DEVICE_PYTHON (not installed: this machine's venvs stand in)"
        return 0
    fi
    # A wheel too big for the carry comes as <wheel>.xz (gpu_prep.sh): unpacked with the standard library's lzma.
    rm -rf "$unpacked" && mkdir -p "$unpacked" || return 1
    for whl in "$dir"/*.whl*; do
        if [[ "$whl" == *.xz ]]; then
            "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
                "$whl" "$unpacked/$(basename "$whl" .xz)" || return 1
        else
            cp "$whl" "$unpacked/" || return 1
        fi
    done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$unpacked"/*.whl
}
if [[ -d .gpu/wheels ]]; then install_wheels .gpu/wheels "$SITE" || STATUS=1
elif (( ! DRY )); then say "no .gpu/wheels: ComfyUI cannot import torchsde"; STATUS=1; fi
if [[ -d .gpu/wheels-0.33.0 ]]; then install_wheels .gpu/wheels-0.33.0 "$SITE33" || STATUS=1
elif (( ! DRY )); then say "no .gpu/wheels-0.33.0: the 0.33.0 steps fail at import"; STATUS=1; fi
# 0.33's comfy.sd imports torchaudio; the image's own, where it has one, is the one built for its torch.
if "$PY33" -c 'import torchaudio' >/dev/null 2>&1; then
    say "torchaudio: $("$PY33" -c 'import torchaudio; print(torchaudio.__version__)' 2>/dev/null) (this Python's own)"
elif [[ -d .gpu/wheels-torchaudio ]]; then install_wheels .gpu/wheels-torchaudio "$SITE33" || STATUS=1
else say "no torchaudio and no .gpu/wheels-torchaudio: the 0.33.0 steps fail at import"; STATUS=1; fi
{
    date -u
    (( DRY )) || nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt" >> "$LOG"
say "set-up done in $(( $(date +%s) - START )) s (allowed ${SETUP_S} s)"

# --------------------------------------------------------------------------- the steps
DRY_ARG=(); (( DRY )) && DRY_ARG=(--dry-run)
ran=()
for entry in "${PLAN[@]}"; do
    read -r name cap version args <<<"$entry"
    if [[ "$version" == 075 ]]; then tree="$C075"; py="$PY"; path="$SITE"
    else tree="$C033"; py="$PY33"; path="$SITE33:$SITE"; fi
    if (( DRY )); then cap=600; else budget=$(left); (( budget < cap )) && cap=$budget; fi
    if [[ -z "$tree" ]]; then say "$name: skipped, no ComfyUI tree for $version"; STATUS=1; continue; fi
    if (( cap < 15 )); then say "$name: skipped, $(left) s left of LIMIT_S"; STATUS=1; continue; fi
    say "$name (cap ${cap} s, $(( $(date +%s) - START )) s in)"
    sanitize=(); [[ "$name" == smoke ]] && (( ! DRY )) && sanitize=(TORCH_CUDA_SANITIZER=1)  # it needs a GPU
    # shellcheck disable=SC2086  # the step's arguments are words
    timeout --signal=INT --kill-after=8 "$cap" env "${sanitize[@]}" COMFYUI_PATH="$tree" PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" \
        "$py" -P bench/gpu_steps.py $args --name "$name" --out "$OUTDIR" --work "$WORK" "${DRY_ARG[@]}" 2>&1 \
        | grep --line-buffered -v "^WARNING:root:torchaudio missing" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if (( rc != 0 )); then say "$name: exit status $rc"; STATUS=1; else ran+=("$name"); fi
done

say "done in $(( $(date +%s) - START )) s, status $STATUS; steps that ended well: ${ran[*]:-none}"
if (( DRY )); then  # the plan is whole when every step ended and every table has its header and the steps' rows
    for table in preflight blocks steps timeline; do
        head -1 "$OUTDIR/$table.csv" 2>/dev/null | grep -q , || { say "dry run: $table.csv has no header"; STATUS=1; }
    done
    for entry in "${PLAN[@]}"; do
        read -r name _ <<<"$entry"
        grep -q "step $name (" "$LOG" || { say "dry run: step $name never ended"; STATUS=1; }
        [[ "$name" == preflight ]] || grep -q ",$name," "$OUTDIR/steps.csv" || { say "dry run: no row of $name"; STATUS=1; }
    done
    (( STATUS )) || say "dry run: the plan holds (${planned} s of ${LIMIT_S} s; every step ran; every table written)"
fi
exit "$STATUS"
