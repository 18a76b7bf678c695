#!/usr/bin/env bash
# Main job: set up everything, install this pack into ComfyUI, write a tiny demo model, start ComfyUI.
#
#   bash scripts/run.sh            # serve on http://127.0.0.1:${PORT:-8188} until Ctrl+C
#   bash scripts/run.sh --smoke    # start on a free port, run the tiny demo workflow once through the API, stop
#
# Steps (each one idempotent, fast when already done):
#   1. scripts/setup_env.sh: .venv (torch 2.14.1) + ComfyUI 0.3.75 in .comfyui/ComfyUI (or $COMFYUI_PATH)
#   2. install the pack as ComfyUI Manager would: <ComfyUI>/custom_nodes/layerwise-offload (a symlink to this
#      repository; an existing real folder, e.g. a Manager clone, is left alone) + pip install -r requirements.txt
#   3. tiny demo assets (devtools/e2e_assets.py): a 4-block random Wan 2.1 DiT in models/diffusion_models, a tiny
#      random Wan 2.1 VAE in models/vae, and a saved T5-shaped conditioning in output/ (there is no tiny UMT5-XXL)
#   4. python main.py --listen ${LISTEN:-127.0.0.1} --port ${PORT:-8188}, with --cpu and
#      LAYERWISE_OFFLOAD_CPU_LOOPBACK=1 unless a CUDA GPU is usable (then the real GPU offload runs)
#
# Environment: PORT, LISTEN, COMFYUI_PATH (use your ComfyUI), FORCE_CPU=1 (--cpu even with a GPU),
# extra arguments after `--` go to main.py (e.g. bash scripts/run.sh -- --verbose DEBUG).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { echo "[layerwise-offload] $*"; }
die() { echo "[layerwise-offload] ERROR: $*" >&2; exit 1; }

SMOKE=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --smoke) SMOKE=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

# ---------------------------------------------------------------- 1. environment
bash scripts/setup_env.sh
PY="$ROOT/.venv/bin/python"
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    COMFY_DIR="$(cd "$COMFYUI_PATH" && pwd)"
else
    COMFY_DIR="$ROOT/.comfyui/ComfyUI"
fi
[[ -f "$COMFY_DIR/main.py" ]] || die "no ComfyUI at $COMFY_DIR"

pip_q() {
    "$PY" -m pip --disable-pip-version-check install -q "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}
# ComfyUI 0.3.75's server imports `requests` (app/frontend_management.py) without listing it: older transformers
# pulled it in, transformers 5 does not.
if ! "$PY" -c "import requests" 2>/dev/null; then
    log "pip install requests (ComfyUI's server needs it; its requirements.txt does not list it)"
    pip_q requests
fi

# ---------------------------------------------------------------- 2. install the pack
NODES_DIR="$COMFY_DIR/custom_nodes"
DEST="$NODES_DIR/layerwise-offload"
mkdir -p "$NODES_DIR"
if [[ -L "$DEST" ]]; then
    if [[ "$(readlink -f "$DEST")" != "$ROOT" ]]; then
        log "replacing $DEST -> $(readlink "$DEST") with a link to $ROOT"
        rm "$DEST"
        ln -s "$ROOT" "$DEST"
    fi
elif [[ -e "$DEST" ]]; then
    log "warning: $DEST is a real folder (a Manager install?); using it as it is, not this checkout"
else
    ln -s "$ROOT" "$DEST"
    log "installed the pack: $DEST -> $ROOT"
fi
# What ComfyUI Manager runs after cloning. The torch pin keeps any requirement from swapping ComfyUI's torch.
torch_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
pip_q -r "$DEST/requirements.txt" "torch==$torch_version"

# ---------------------------------------------------------------- 3. tiny demo assets
log "writing the tiny demo model, VAE and conditioning into $COMFY_DIR/{models,output}"
"$PY" -P devtools/e2e_assets.py --base "$COMFY_DIR" --no-sd15 >/dev/null

# ---------------------------------------------------------------- 4. start ComfyUI
DEVICE_ARGS=(--cpu)
DEVICE_WORDS="CPU (--cpu; LAYERWISE_OFFLOAD_CPU_LOOPBACK=1 runs the real offload manager on the CPU)"
if [[ "${FORCE_CPU:-0}" != 1 ]] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DEVICE_ARGS=()
    DEVICE_WORDS="GPU $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
fi
export LAYERWISE_OFFLOAD_CPU_LOOPBACK=1

if [[ $SMOKE == 1 ]]; then
    gpu_flag=()
    [[ ${#DEVICE_ARGS[@]} -eq 0 ]] && gpu_flag=(--gpu)
    log "smoke run on $DEVICE_WORDS: start ComfyUI, run the tiny demo workflow, stop"
    exec "$PY" -P devtools/server.py smoke --comfyui "$COMFY_DIR" "${gpu_flag[@]}"
fi

PORT="${PORT:-8188}"
LISTEN="${LISTEN:-127.0.0.1}"
if "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(0 if s.connect_ex(('$LISTEN', $PORT)) == 0 else 1)" 2>/dev/null; then
    die "port $PORT on $LISTEN is already in use (another ComfyUI?). Stop it or run: PORT=8189 bash scripts/run.sh"
fi
URL_HOST="$LISTEN"
[[ "$LISTEN" == "0.0.0.0" ]] && URL_HOST=127.0.0.1
cat <<EOF
[layerwise-offload] ------------------------------------------------------------------------------------------
[layerwise-offload] ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$COMFY_DIR/comfyui_version.py") with layerwise-offload on $DEVICE_WORDS
[layerwise-offload] Open  http://$URL_HOST:$PORT  (ready when the log below says "To see the GUI go to")
[layerwise-offload] Then: click "Templates" in the left sidebar (same as the menu's "Browse Templates"), pick
[layerwise-offload]       EXTENSIONS > layerwise-offload > layerwise_offload_tiny_wan21_demo, and press Run.
[layerwise-offload]       The graph runs a 4-block random Wan 2.1 through Layerwise Offload (DiT) (2 blocks resident,
[layerwise-offload]       2 streamed); the Stats node shows the run, and the latent and 5 noise frames land in
[layerwise-offload]       $COMFY_DIR/output/layerwise_offload/
[layerwise-offload] The other templates (Flux.1-dev, Wan 2.1 14B, Wan 2.2 A14B, Qwen-Image, HunyuanVideo) need the
[layerwise-offload] real model files; each has a note on choosing resident_layers. Ctrl+C stops ComfyUI.
[layerwise-offload] ------------------------------------------------------------------------------------------
EOF
cd "$COMFY_DIR"
exec "$PY" main.py --listen "$LISTEN" --port "$PORT" "${DEVICE_ARGS[@]}" "${EXTRA[@]}"
