"""Command line over devtools/server.py, for scripts/run.sh: make a ComfyUI base folder with this pack linked
(``prepare``), or run the tiny demo workflow once through a real server (``smoke``, ``bash scripts/run.sh --smoke``).

    .venv/bin/python -P devtools/server_cli.py prepare --base DIR
    .venv/bin/python -P devtools/server_cli.py smoke [--comfyui DIR] [--base DIR] [--gpu]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).with_name("comfy_env.py")))["enter_pack"](globals())

from .server import ComfyServer, PathLike, ServerError, prepare_base_dir, repo_root  # noqa: E402


def smoke(base_dir: Optional[PathLike] = None, workflow: Optional[PathLike] = None, cpu: bool = True,
          comfyui_path: Optional[PathLike] = None, timeout: float = 240.0) -> Dict[str, Any]:
    """Start a server on a free port, run the tiny demo workflow through the API as the frontend would send it,
    stop the server, and return ``{"url", "outputs", "seconds"}``. Raises on any failure (with the log tail)."""
    from .workflow_api import validate_workflow, workflow_to_prompt  # relative: run as a module or by path

    workflow = Path(workflow) if workflow else next((repo_root() / "workflows").glob("A tiny demo*.json"))
    wf = json.loads(Path(workflow).read_text(encoding="utf-8"))
    srv = ComfyServer(base_dir, cpu=cpu, env={"LAYERWISE_OFFLOAD_CPU_LOOPBACK": "1"}, comfyui_path=comfyui_path)
    t0 = time.monotonic()
    with srv:
        info = srv.object_info()
        problems = validate_workflow(wf, info, check_files=True)
        if problems:
            raise ServerError(f"{workflow} does not fit this server:\n" + "\n".join(problems))
        entry = srv.run_prompt(workflow_to_prompt(wf, info), timeout=timeout)
        files = [str(p) for p in srv.output_files(entry)]
    return {"url": srv.url, "outputs": files, "seconds": round(time.monotonic() - t0, 1)}


def _main(argv: Optional[Iterable[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Make a base folder with this pack (prepare), or run the tiny demo once "
                                             "(smoke).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="ComfyUI's folders under --base, custom_nodes/layerwise-offload linked to this "
                                   "repository").add_argument("--base", required=True)
    sm = sub.add_parser("smoke", help="start a server, run the tiny demo workflow, stop")
    sm.add_argument("--base", default=None, help="base directory (default: ComfyUI's own folders)")
    sm.add_argument("--comfyui", default=None, help="ComfyUI folder (default: $COMFYUI_PATH or .comfyui/ComfyUI)")
    sm.add_argument("--gpu", action="store_true", help="do not pass --cpu")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare_base_dir(a.base)
    else:
        print(json.dumps(smoke(a.base, cpu=not a.gpu, comfyui_path=a.comfyui), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
