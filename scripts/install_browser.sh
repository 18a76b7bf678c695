#!/usr/bin/env bash
# Install what the end-to-end tests need beyond scripts/setup_env.sh. Idempotent; well under a second when done.
#
#   - Debian's Chromium (/usr/bin/chromium) for tests/e2e/test_browser.py. Playwright drives it through
#     executable_path; never `playwright install` (it downloads its own browser, which this network refuses).
#   - Playwright's Python package (its wheel carries the driver; no browser download) into the venv
#     (.venv, or the one named by VENV, e.g. VENV=.venv-0.14.1).
#
# Environment: SKIP_BROWSER_INSTALL=1 skips Chromium (test_browser.py then skips itself).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
PY="$VENV/bin/python"
log() { echo "[layerwise-offload] $*"; }

[[ -x "$PY" ]] || { echo "[layerwise-offload] ERROR: $PY missing: run scripts/setup_env.sh first" >&2; exit 1; }

# ---------------------------------------------------------------- Python packages
if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
    log "install playwright into $(basename "$VENV")"
    torch_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
    if [[ -x "$VENV/bin/uv" ]]; then  # scripts/setup_env.sh puts uv there
        "$VENV/bin/uv" pip install --python "$PY" -q playwright "torch==$torch_version"
    else
        "$PY" -m pip --disable-pip-version-check install -q playwright "torch==$torch_version" \
            2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
    fi
fi

# ---------------------------------------------------------------- Chromium
if [[ "${SKIP_BROWSER_INSTALL:-0}" == 1 ]]; then
    log "SKIP_BROWSER_INSTALL=1: not installing Chromium"
    exit 0
fi
if [[ -x /usr/bin/chromium ]]; then
    exit 0
fi
SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then SUDO=(sudo -n); else
        log "warning: not root and no sudo: cannot apt-get install chromium (browser tests will skip)"
        exit 0
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    log "warning: no apt-get: install Chromium yourself at /usr/bin/chromium (browser tests will skip)"
    exit 0
fi
log "apt-get install chromium (Debian's build, for the headless browser tests)"
export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; then
    "${SUDO[@]}" apt-get update -q >/dev/null
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium >/dev/null
fi
log "$(/usr/bin/chromium --version 2>/dev/null || echo 'chromium installed')"
