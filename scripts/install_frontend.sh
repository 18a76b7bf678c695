#!/usr/bin/env bash
# The newest ComfyUI frontend the pack is tested with, for the browser tests served with ComfyUI's --front-end-root.
#   .comfyui/frontend-1.58.1/comfyui_frontend_package/static   from PyPI's comfyui-frontend-package==1.58.1
# (the wheel's static/ folder, unpacked: it is never installed into a venv, so ComfyUI's own pinned frontend stays).
# Idempotent; prints the static folder's path on its last line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${FRONTEND_VERSION:-1.58.1}"
DEST="$ROOT/.comfyui/frontend-$VERSION"
STATIC="$DEST/comfyui_frontend_package/static"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [[ ! -f "$STATIC/index.html" ]]; then
    echo "[layerwise-offload] pip download comfyui-frontend-package==$VERSION (served with --front-end-root)" >&2
    tmp="$(mktemp -d)"
    "$PY" -m pip --disable-pip-version-check download -q --no-deps -d "$tmp" "comfyui-frontend-package==$VERSION" >&2
    rm -rf "$DEST.partial" && mkdir -p "$DEST.partial"
    "$PY" -m zipfile -e "$tmp"/comfyui_frontend_package-*.whl "$DEST.partial"
    rm -rf "$tmp" "$DEST" && mv "$DEST.partial" "$DEST"
fi
[[ -f "$STATIC/index.html" ]] || { echo "[layerwise-offload] ERROR: no index.html under $STATIC" >&2; exit 1; }
echo "$STATIC"
