#!/usr/bin/env bash
# The whole GPU measurement in ONE device call of at most LIMIT_S (570) seconds, set-up included; no network
# (docs/gpu_run.md: the plan, the caps, how to read the tables).
#
#   bash bench/gpu_prep.sh             # here, once: fills .gpu/ (two ComfyUI trees, four wheels; < 60 MiB)
#   bash bench/gpu_run.sh              # on the device: carry [".gpu"], timeout_s 600
#   bash bench/gpu_run.sh --dry-run    # on the CPU: the time plan, then every step at the tiny presets
#
# Every step (bench/gpu_steps.py) is its own process under its own cap (min(cap, time left)); a step that fails or
# is cut is logged and the next one runs. Rows are appended to $OUT/{preflight,blocks,steps}.csv as each is
# measured, so a cut run keeps what it measured. Needs on the device: python3 with torch (CUDA) and ComfyUI's
# import-time packages (the image lacks torchsde, trampoline, comfy-aimdo, comfy-kitchen: wheels in .gpu).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
START=$(date +%s)
LIMIT_S="${LIMIT_S:-570}"    # the device call's whole run
SETUP_S="${SETUP_S:-40}"     # the plan's allowance for unpacking the trees and installing the wheels
RESERVE_S="${RESERVE_S:-10}" # kept back at the end (the last step's kill-after and the copy out)
WORK="${WORK:-/tmp/lwo_gpu}"

# name cap_s comfyui step-arguments...  (the order is the priority: a run that runs short loses the last ones)
PLAN=(
    "preflight   35 075 preflight"
    "s075_flux   80 075 sidebyside --preset flux --lowvram --sweep"
    "s075_wan    95 075 sidebyside --preset wan21_14b --lowvram --sweep"
    "s014_flux   45 014 sidebyside --preset flux"
    "dyn014_flux 45 014 dynamic --preset flux"
    "lora_075    50 075 lora --preset wan21_14b"
    "fp8_014     55 014 fp8 --preset wan21_14b"
    "s014_wan    45 014 sidebyside --preset wan21_14b"
    "dyn014_wan  45 014 dynamic --preset wan21_14b"
)
planned=$(( SETUP_S + RESERVE_S ))
for entry in "${PLAN[@]}"; do read -r _ cap _ <<<"$entry"; planned=$(( planned + cap )); done

if (( DRY )); then
    OUTDIR="${RESULTS:-$WORK/dry_out}"
    PY="${PYTHON:-$ROOT/.venv/bin/python}"           # this machine's environments stand in for the device's
    PY14="${PYTHON_014:-$ROOT/.venv-0.14.1/bin/python}"
else
    OUTDIR="${OUT:-$ROOT/bench/results/gpu}"
    PY="${PYTHON:-python3}"
    PY14="$PY"
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
C014="$(comfy_tree 0.14.1 "$ROOT/.comfyui/ComfyUI-0.14.1")"
say "ComfyUI 0.3.75 at ${C075:-<missing: run bash bench/gpu_prep.sh, carry .gpu>}; 0.14.1 at ${C014:-<missing>}"

DEVICE_PYTHON="${DEVICE_PYTHON:-3.12}"
SITE="$WORK/site"; SITE14="$WORK/site-0.14.1"
install_wheels() {  # install_wheels DIR TARGET: a dry run checks the wheels are there and fit the device's Python
    local dir="$1" target="$2" whl
    compgen -G "$dir/*.whl" >/dev/null || { say "no wheels in $dir (run bash bench/gpu_prep.sh)"; return 1; }
    if (( DRY )); then
        for whl in "$dir"/*.whl; do
            case "$(basename "$whl")" in
                *-py3-none-*|*-cp${DEVICE_PYTHON/./}-*|*-abi3-*) ;;
                *) say "$(basename "$whl") does not fit Python $DEVICE_PYTHON"; return 1 ;;
            esac
        done
        say "dry run: $(ls "$dir" | tr '\n' ' ')fit Python $DEVICE_PYTHON (not installed: this machine's venvs stand in)"
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$dir"/*.whl
}
if [[ -d .gpu/wheels ]]; then install_wheels .gpu/wheels "$SITE" || STATUS=1
elif (( ! DRY )); then say "no .gpu/wheels: ComfyUI cannot import torchsde"; STATUS=1; fi
if [[ -d .gpu/wheels-0.14.1 ]]; then install_wheels .gpu/wheels-0.14.1 "$SITE14" || STATUS=1
elif (( ! DRY )); then say "no .gpu/wheels-0.14.1: the 0.14.1 steps fail at import"; STATUS=1; fi
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
    else tree="$C014"; py="$PY14"; path="$SITE14:$SITE"; fi
    if (( DRY )); then cap=600; else budget=$(left); (( budget < cap )) && cap=$budget; fi
    if [[ -z "$tree" ]]; then say "$name: skipped, no ComfyUI tree for $version"; STATUS=1; continue; fi
    if (( cap < 15 )); then say "$name: skipped, $(left) s left of LIMIT_S"; STATUS=1; continue; fi
    say "$name (cap ${cap} s, $(( $(date +%s) - START )) s in)"
    # shellcheck disable=SC2086  # the step's arguments are words
    timeout --signal=INT --kill-after=8 "$cap" env COMFYUI_PATH="$tree" PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" \
        "$py" -P bench/gpu_steps.py $args --name "$name" --out "$OUTDIR" --work "$WORK" "${DRY_ARG[@]}" 2>&1 \
        | grep --line-buffered -v "^WARNING:root:torchaudio missing" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if (( rc != 0 )); then say "$name: exit status $rc"; STATUS=1; else ran+=("$name"); fi
done

say "done in $(( $(date +%s) - START )) s, status $STATUS; steps that ended well: ${ran[*]:-none}"
if (( DRY )); then  # the plan is whole when every step ended and every table has its header and the steps' rows
    for table in preflight blocks steps; do
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
