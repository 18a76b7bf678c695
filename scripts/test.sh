#!/usr/bin/env bash
# Set up the environment (fast when nothing changed), then run pytest.
#   bash scripts/test.sh                      # all of tests/
#   bash scripts/test.sh tests/comfy -x -q    # extra arguments go to pytest; a path replaces the default tests/
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
# End-to-end extras: Debian Chromium + Playwright (Python) for tests/e2e/test_browser.py, requests for the server.
bash scripts/install_browser.sh

# Default to tests/ unless a path (or node id) was given.
has_path=0
for a in "$@"; do
    [[ "$a" != -* && -e "${a%%::*}" ]] && has_path=1
done
args=("$@")
if [[ $has_path == 0 ]]; then args=(tests "$@"); fi

# -P: do not put the current folder (the repo root) on sys.path; its nodes/ would shadow ComfyUI's `nodes`.
exec .venv/bin/python -P -m pytest "${args[@]}"
