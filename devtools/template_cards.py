"""The template browser's card picture for each shipped workflow (``<name>.jpg`` beside it, 480x360): the model,
its block map on each card size as auto mode plans it (resident blocks / streamed blocks, from the same planner
run as the README table and the notes), and the system RAM it needs (from the disk-tier figure up, where the
template loads through Load Diffusion Model (Layerwise)). Cards that look alike as graph screenshots
differ here at a glance.

Each picture carries what it shows as JSON in its JPEG comment, so a test can tell a stale picture from a
current one without comparing pixels (JPEG bytes differ between Pillow builds). Needs Pillow (ComfyUI has it);
devtools/make_workflows.py calls :func:`write_card`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

SIZE = (480, 360)
GB = 10**9
BG, FG, DIM = (30, 32, 36), (236, 238, 240), (150, 156, 164)
RESIDENT, STREAMED, NOFIT = (84, 178, 96), (86, 110, 170), (170, 80, 70)
ACCENT = (120, 200, 130)
_DEJAVU = Path("/usr/share/fonts/truetype/dejavu")


def _font(size: int, bold: bool = False):
    from PIL import ImageFont

    path = _DEJAVU / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")
    if path.is_file():
        return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size=size)


def model_spec(title: str, subtitle: str, plans: Dict[str, Any], t: Dict[str, Any],
               min_ram_bytes: Optional[int] = None) -> Dict[str, Any]:
    """What a real model's card shows: block map per card size and RAM; ``min_ram_bytes``: the least it runs in
    with the streamed blocks read from the checkpoint (None: it needs the full figure)."""
    n = len(t["block_bytes"])
    spec = {"title": title, "subtitle": subtitle, "blocks": n,
            "rows": [[c, r] for c, r in zip(plans["cards_gib"], t["resident"])],
            "ram_gb": round(t["ram_bytes"] / GB), "dit_gb": round(t["dit_bytes"] / GB, 1),
            "experts": t["experts"]}
    if min_ram_bytes is not None:
        spec["min_ram_gb"] = round(min_ram_bytes / GB)
    return spec


def demo_spec(title: str, subtitle: str, blocks: int, step: str) -> Dict[str, Any]:
    return {"title": title, "subtitle": subtitle, "blocks": blocks, "step": step}


def _block_row(d, x: int, y: int, width: int, height: int, blocks: int, resident: Optional[int]) -> None:
    gap = 1 if blocks > 24 else 3
    cell = (width - gap * (blocks - 1)) / blocks
    for i in range(blocks):
        colour = NOFIT if resident is None else (RESIDENT if i < resident else STREAMED)
        x0 = x + i * (cell + gap)
        d.rectangle([round(x0), y, round(x0 + cell) - 1, y + height - 1], fill=colour)


def draw(spec: Dict[str, Any]):
    from PIL import Image, ImageDraw

    im = Image.new("RGB", SIZE, BG)
    d = ImageDraw.Draw(im)
    d.text((20, 14), spec["title"], font=_font(30, bold=True), fill=FG)
    d.text((20, 54), spec["subtitle"], font=_font(16), fill=DIM)
    if "step" in spec:  # the tiny demo: what to do first, and what it shows
        d.text((20, 100), "first, once, from the pack folder:", font=_font(16), fill=DIM)
        d.rounded_rectangle([16, 126, 464, 166], radius=6, fill=(20, 22, 26))
        d.text((28, 136), spec["step"], font=_font(17, bold=True), fill=ACCENT)
        d.text((20, 196), "then Run; with resident_layers = 2:", font=_font(16), fill=DIM)
        _block_row(d, 20, 226, 440, 44, spec["blocks"], spec["blocks"] // 2)
        d.text((20, 300), "any GPU or CPU  ·  no downloads  ·  seconds", font=_font(18, bold=True), fill=FG)
        return im
    per = " per expert" if spec["experts"] > 1 else ""
    d.text((20, 88), f"blocks in VRAM with auto (-1){per}", font=_font(15), fill=DIM)
    y = 114
    for card, resident in spec["rows"]:
        d.text((20, y + 2), f"{card} GB", font=_font(17, bold=True), fill=FG)
        _block_row(d, 92, y, 300, 26, spec["blocks"], resident)
        label = "too small" if resident is None else f"{resident}/{spec['blocks']}"
        d.text((402, y + 3), label, font=_font(15), fill=FG if resident is not None else NOFIT)
        y += 40
    d.rectangle([92, 282, 104, 294], fill=RESIDENT)
    d.text((110, 280), "in VRAM", font=_font(14), fill=DIM)
    d.rectangle([190, 282, 202, 294], fill=STREAMED)
    model = (f"{spec['experts']} models, {spec['dit_gb']} GB, {spec['blocks']} blocks each" if spec["experts"] > 1
             else f"model {spec['dit_gb']} GB, {spec['blocks']} blocks")
    if "min_ram_gb" not in spec:
        d.text((208, 280), "streamed from RAM", font=_font(14), fill=DIM)
        d.text((20, 312), f"RAM {spec['ram_gb']} GB", font=_font(24, bold=True), fill=FG)
        d.text((190, 318), model, font=_font(15), fill=DIM)
        return im
    # The least RAM it runs in (blocks that do not fit read from the model file), then what full speed takes.
    d.text((208, 280), "streamed from RAM or disk", font=_font(14), fill=DIM)
    d.text((20, 312), f"RAM {spec['min_ram_gb']}+ GB", font=_font(24, bold=True), fill=FG)
    d.text((206, 308), f"{spec['ram_gb']} GB for full speed", font=_font(15, bold=True), fill=FG)
    d.text((206, 328), model, font=_font(15), fill=DIM)
    return im


def _comment(spec: Dict[str, Any]) -> bytes:
    # The drawing code's hash too: a changed layout makes every picture stale.
    drawer = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return json.dumps({**spec, "drawer": drawer}, sort_keys=True).encode("utf-8")


def write_card(path: Path, spec: Dict[str, Any]) -> None:
    im = draw(spec)
    im.save(path, quality=85, optimize=True, comment=_comment(spec))


def card_is_current(path: Path, spec: Dict[str, Any]) -> bool:
    """The picture at ``path`` shows ``spec`` (read from its JPEG comment) and has the size the frontend expects."""
    from PIL import Image

    if not path.is_file():
        return False
    try:
        with Image.open(path) as im:
            return im.format == "JPEG" and im.size == SIZE and im.info.get("comment") == _comment(spec)
    except OSError:
        return False


def shown(path: Path) -> List[Any]:
    """The spec a picture was drawn from (for error messages)."""
    from PIL import Image

    with Image.open(path) as im:
        return json.loads(im.info.get("comment") or b"null")
