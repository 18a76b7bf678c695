"""What a person reads on the pack's nodes, as the real server sends it to the frontend (/object_info): every input
and output tooltip fits in three short lines, says the default where there is one, and carries no measured figure
and no environment variable (those change, and a tooltip is no place for them: docs/ has them)."""

from __future__ import annotations

import re
import textwrap

import pytest

from layerwise_offload.devtools.server import PACK_FOLDER

NODES = ("LayerwiseOffload", "LayerwiseOffloadStats", "LayerwiseOffloadLoadDiffusionModel")
MAX_CHARS, MAX_LINES, LINE_WIDTH = 240, 3, 80  # three lines of a tooltip box about 80 characters wide
# A measured figure: a ratio ("1.4x"), a share, a size, a rate, a duration.
FIGURE = re.compile(r"\d\s*x\b|\d\s*%|\b\d+(\.\d+)?\s*(GB|GiB|MB|MiB|KB|ms|s)\b|/s\b", re.I)
ENV_VAR = re.compile(r"\$\w|\b[A-Z][A-Z0-9]*_[A-Z0-9_]{2,}\b")


def _inputs(info: dict):
    for group in ("required", "optional"):
        for name, spec in info["input"].get(group, {}).items():
            yield name, (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})


def _tooltips(object_info):
    for node in NODES:
        info = object_info[node]
        assert PACK_FOLDER in info["python_module"], node
        for name, opts in _inputs(info):
            yield f"{node}.{name}", opts.get("tooltip", ""), opts.get("default")
        for i, tip in enumerate(info.get("output_tooltips") or []):
            yield f"{node} output {i}", tip or "", None


@pytest.fixture(scope="module")
def tooltips(object_info):
    found = list(_tooltips(object_info))
    assert len(found) >= 12, found  # 6 + 2 + 2 inputs, 3 outputs
    return found


def test_every_tooltip_fits_in_three_short_lines(tooltips):
    too_long = {where: (len(tip), textwrap.wrap(tip, LINE_WIDTH)) for where, tip, _ in tooltips
                if len(tip) > MAX_CHARS or len(textwrap.wrap(tip, LINE_WIDTH)) > MAX_LINES}
    assert not too_long, f"over {MAX_CHARS} characters or {MAX_LINES} lines of {LINE_WIDTH}: {too_long}"
    empty = [where for where, tip, _ in tooltips if len(tip) < 20]
    assert not empty, f"no real tooltip: {empty}"


def test_tooltips_carry_no_measured_figures_and_no_environment_variables(tooltips):
    figures = {where: m.group(0) for where, tip, _ in tooltips for m in [FIGURE.search(tip)] if m}
    assert not figures, f"measured figures belong in docs/benchmarks.md, not in a tooltip: {figures}"
    env = {where: m.group(0) for where, tip, _ in tooltips for m in [ENV_VAR.search(tip)] if m}
    assert not env, f"environment variables belong in docs/, not in a tooltip: {env}"


def test_the_offload_nodes_tooltips_name_their_defaults(tooltips):
    """A number or choice with a default says which it is, in the words the widget shows."""
    for where, tip, default in tooltips:
        if not where.startswith("LayerwiseOffload.") or default is None:
            continue
        shown = {True: "on", False: "off"}.get(default, str(default))
        assert re.search(r"\bdefault\b", tip, re.I) and shown in tip, (where, default, tip)


def test_a_negative_control_fails_the_checks():
    """The patterns catch what the old tooltips carried."""
    assert FIGURE.search("up to 1.4x slower for Flux") and FIGURE.search("a 512 MiB margin")
    assert ENV_VAR.search("set by $LAYERWISE_OFFLOAD_DISK_READ_RATE") and ENV_VAR.search("LAYERWISE_OFFLOAD_CPU_LOOPBACK")
    assert not FIGURE.search("Default -1 = auto: as many as fit. 0 streams every block.")
    assert not ENV_VAR.search("Unet Loader (GGUF), before or after LoRA loaders")
