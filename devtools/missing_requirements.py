"""Print the lines of a requirements.txt that this Python does not satisfy; exit 1 if there are any.

scripts/run.sh uses it before running a user's ComfyUI (COMFYUI_PATH) in this pack's .venv: that ComfyUI's
requirements are installed into the .venv only when the user asks (--install-comfyui-requirements).
torch, torchvision and torchaudio are skipped: the .venv pins its own torch.

    python -P devtools/missing_requirements.py /path/to/ComfyUI/requirements.txt
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import List

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio"}


def missing(lines: List[str]) -> List[str]:
    out = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            out.append(f"{line}  (not understood)")
            continue
        if req.name.lower() in TORCH_FAMILY or (req.marker and not req.marker.evaluate()):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{line}  (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{line}  (installed: {have})")
    return out


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        gaps = missing(f.read().splitlines())
    for g in gaps:
        print(f"  {g}")
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
