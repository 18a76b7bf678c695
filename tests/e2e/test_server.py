"""The pack inside a real ComfyUI 0.3.75 server (``main.py --cpu``, CPU loopback on), driven over its HTTP API.

- /object_info describes the node (inputs, defaults, limits, tooltips);
- a prompt with the node on the tiny Wan 2.1 completes, and its saved latent is bitwise equal to the same prompt
  without the node, for several plans, before and after (the offload must leave the shared model untouched);
- the shipped tiny workflow (workflows/) runs as the frontend would send it, with the same latent;
- a negative ``resident_layers`` is a validation error, and so is a bad ``host_store`` or ``residency_policy``,
  each reported once, under its own input; a UNet (not a DiT) is an execution error naming the class,
  and the server serves the next prompt;
- ComfyUI lists the workflows folder as templates and serves the files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from layerwise_offload.devtools import e2e_assets
from layerwise_offload.devtools.server import PACK_FOLDER, PromptRejected, execution_error
from layerwise_offload.devtools.workflow_api import workflow_to_prompt

from .server_support import NODE, SEED, saved_latent, tiny_prompt

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "workflows"
TINY_WORKFLOW = next(WORKFLOWS.glob("A tiny demo*.json"))


# ------------------------------------------------------------------------------------------------ node info

def test_object_info_describes_the_node(object_info):
    assert NODE in object_info, "LayerwiseOffload is not registered; see the server log"
    info = object_info[NODE]
    assert info["display_name"] == "Layerwise Offload (DiT)"
    assert info["category"].startswith("model_patches")
    assert info["output"] == ["MODEL"]
    assert PACK_FOLDER in info["python_module"]
    req = info["input"]["required"]
    assert list(info["input_order"]["required"]) == [
        "model", "resident_layers", "prefetch_size", "residency_policy", "pin_memory"]
    assert list(info["input_order"]["optional"]) == ["host_store"]  # old API prompts without it still validate
    assert req["model"][0] == "MODEL"
    typ, opts = req["resident_layers"]
    assert (typ, opts["default"]) == ("INT", -1)
    # -1 (auto, the default) keeps as many as fit; 0 streams everything; nothing below -1.
    assert opts["min"] == -1 and "auto" in opts["tooltip"].lower()
    assert "LayerwiseOffloadStats" in object_info
    typ, opts = req["prefetch_size"]
    assert (typ, opts["default"], opts["min"]) == ("INT", 1, 1)
    typ, opts = req["residency_policy"]
    options = typ if isinstance(typ, list) else opts["options"]
    assert list(options) == ["auto", "leading", "strided", "weights"] and opts.get("default") == "auto"
    typ, opts = req["pin_memory"]
    assert (typ, opts["default"]) == ("BOOLEAN", True)
    typ, opts = info["input"]["optional"]["host_store"]
    options = typ if isinstance(typ, list) else opts["options"]
    assert list(options) == ["auto", "ram", "disk"] and opts.get("default", "auto") == "auto"
    for name in ("model", "resident_layers", "prefetch_size", "residency_policy", "pin_memory", "host_store"):
        spec = req.get(name) or info["input"]["optional"][name]
        tooltip = spec[1].get("tooltip", "") if len(spec) > 1 else ""
        assert len(tooltip) > 20, f"input {name} has no real tooltip: {tooltip!r}"
    assert info.get("description"), "the node has no description"


def test_pack_imported_without_errors(comfy_server, object_info):
    log = comfy_server.log_text()
    # ComfyUI names a module it cannot import by its path; the repository's own folder may be named like the pack.
    ours = [line for line in log.splitlines() if "Cannot import" in line and f"custom_nodes/{PACK_FOLDER}" in line]
    assert not ours, log
    lines = [line for line in log.splitlines() if line.rstrip().endswith("custom_nodes/" + PACK_FOLDER)]
    assert lines, "the pack is not in ComfyUI's 'Import times for custom nodes' list"
    assert all("IMPORT FAILED" not in line for line in lines), lines


# ------------------------------------------------------------------------------------------------ running

PLANS = [
    dict(resident_layers=2, prefetch_size=1, residency_policy="leading"),
    dict(resident_layers=0, prefetch_size=1, residency_policy="leading"),
    dict(resident_layers=1, prefetch_size=2, residency_policy="strided", pin_memory=False),
    dict(resident_layers=99, prefetch_size=1, residency_policy="leading"),
    dict(resident_layers=-1, prefetch_size=1, residency_policy="weights"),
]


def test_offloaded_latent_is_bitwise_equal_to_no_offload(comfy_server):
    reference = saved_latent(comfy_server, comfy_server.run_prompt(tiny_prompt(None, prefix="e2e/ref_before")))
    assert reference.shape == (1, 16, 2, 8, 8) and torch.isfinite(reference).all()
    log_before = len(comfy_server.log_text())
    for i, plan in enumerate(PLANS):
        got = saved_latent(comfy_server, comfy_server.run_prompt(tiny_prompt(plan, prefix=f"e2e/plan{i}")))
        assert torch.equal(got, reference), f"plan {plan}: max |diff| {(got - reference).abs().max().item()}"
    # The CPU loopback really ran the manager (it logs its plan); it did not pass the model through.
    new_log = comfy_server.log_text()[log_before:]
    assert re.search(r"\[layerwise-offload\].*plan", new_log), new_log[-3000:]
    assert "passed through" not in new_log
    # ... and left the shared model as it found it: the plain graph still gives the same latent.
    after = saved_latent(comfy_server, comfy_server.run_prompt(tiny_prompt(None, seed=SEED, prefix="e2e/ref_after")))
    assert torch.equal(after, reference)


def test_offload_runs_with_vae_decode(comfy_server):
    entry = comfy_server.run_prompt(tiny_prompt(dict(resident_layers=2), prefix="e2e/decoded", decode=True))
    images = comfy_server.output_files(entry, "images")
    assert len(images) == 5 and all(p.is_file() and p.stat().st_size > 0 for p in images)


def test_shipped_tiny_workflow_runs_like_the_api_prompt(comfy_server, object_info):
    wf = json.loads(TINY_WORKFLOW.read_text())
    prompt = workflow_to_prompt(wf, object_info)
    assert any(n["class_type"] == NODE for n in prompt.values())
    entry = comfy_server.run_prompt(prompt)
    latent = saved_latent(comfy_server, entry)
    assert comfy_server.output_files(entry, "images"), entry["outputs"]
    stats = [nid for nid, n in prompt.items() if n["class_type"] == "LayerwiseOffloadStats"]
    assert stats, "the tiny workflow ends in a stats node"
    for nid in stats:  # the stats node reports the run it followed
        text = " ".join(entry["outputs"][nid]["text"])
        assert re.search(r"(all 4|\d of 4) blocks in VRAM", text) and "copied per step" in text, text
        assert entry["outputs"][nid]["layerwise_offload"][0]["state"] == "run"  # the picture's data
    ref = saved_latent(comfy_server, comfy_server.run_prompt(tiny_prompt(None, prefix="e2e/ref_workflow")))
    assert torch.equal(latent, ref)


# ------------------------------------------------------------------------------------------------ errors

def test_negative_resident_layers_is_a_validation_error(comfy_server, object_info):
    below_min = object_info[NODE]["input"]["required"]["resident_layers"][1]["min"] - 1
    assert below_min < 0
    with pytest.raises(PromptRejected) as exc:
        comfy_server.queue_prompt(tiny_prompt(dict(resident_layers=below_min)))
    body = exc.value.body
    errors = body["node_errors"]["10"]["errors"]
    assert any(e["type"] == "value_smaller_than_min" and e["extra_info"]["input_name"] == "resident_layers"
               for e in errors), body


@pytest.mark.parametrize("name, bad", [("host_store", "floppy"), ("residency_policy", "sideways")])
def test_a_bad_choice_is_one_validation_error_under_its_own_input(comfy_server, name, bad):
    """A value that is not one of a combo's options, as an API client may send it: ComfyUI refuses the prompt
    with exactly one error for the node, under that input (not repeated under the node's other combo)."""
    with pytest.raises(PromptRejected) as exc:
        comfy_server.queue_prompt(tiny_prompt({"host_store": "auto", name: bad}))
    body = exc.value.body
    errors = body["node_errors"]["10"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == [name], json.dumps(body)[:3000]
    assert bad in json.dumps(errors[0]), errors[0]  # it says which value was refused
    assert set(body["node_errors"]) == {"10"}, body


def test_non_dit_model_is_an_execution_error_and_the_server_recovers(comfy_server):
    prompt = tiny_prompt(dict(resident_layers=1), unet=e2e_assets.TINY_SD15_UNET_NAME, prefix="e2e/sd15")
    entry = comfy_server.run_prompt(prompt, check=False)
    assert entry["status"]["status_str"] == "error"
    err = execution_error(entry)
    assert err is not None and err["node_type"] == NODE, err
    assert "UNetModel" in err["exception_message"], err["exception_message"]
    assert "not a supported" in err["exception_message"]
    # The server is still healthy: a fresh prompt (new seed, so nothing is cached) runs.
    entry = comfy_server.run_prompt(tiny_prompt(dict(resident_layers=2), seed=SEED + 1, prefix="e2e/after_error"))
    assert saved_latent(comfy_server, entry).shape == (1, 16, 2, 8, 8)


# ------------------------------------------------------------------------------------------------ templates

def test_workflows_are_served_as_templates(comfy_server):
    listing = comfy_server.get_json("/api/workflow_templates")
    shipped = sorted(p.stem for p in WORKFLOWS.glob("*.json"))
    assert shipped, "workflows/ is empty"
    assert sorted(listing.get(PACK_FOLDER, [])) == shipped, listing
    for name in shipped:
        served = comfy_server.get_json(f"/api/workflow_templates/{PACK_FOLDER}/{name}.json")
        assert served == json.loads((WORKFLOWS / f"{name}.json").read_text()), name
