"""Model merges under every plan, as a server runs them (issue 42): one merged MODEL offloaded by several node
outputs in turn, each with another plan, with nothing unloaded in between, bitwise ComfyUI alone every time.

A server keeps the loaders' and the merge's outputs between prompts (their inputs did not change), so the node's
outputs of one merge share its model, its patches and ComfyUI's backups, and ComfyUI keeps the model loaded from
one prompt to the next. Streaming by weight units (residency_policy weights) leaves the model in another state than
streaming whole blocks or their tails: a block's norm scales, which no unit streams, are patched in the module by
ComfyUI's own ``patch_weight_to_device`` (its backup holds the original), where whole blocks patch them on each
device copy (the backup a view of the unpatched host copy, the module unpatched). A merge patches every key, norms
included, so each granularity read the other's state as its own: weights after leading left the norms unmerged,
leading after weights merged them twice. Switching granularity now restores ComfyUI's backups first
(``nodes/patcher.py`` ``offload_weights_uuid``).

The default suite runs two of the four merges the issue found on Wan 2.1 (whose blocks hold norm scales; LTXV's do
not), through the shortest sequence that failed both ways; ``-m release`` (docs/testing.md) runs every
``ModelMerge*`` node of this ComfyUI on Wan 2.1 and LTXV through the whole sequence.
"""

import gc

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.devtools import core_model_nodes

pytestmark = pytest.mark.usefixtures("comfy_loopback")

MERGES = [node for node in core_model_nodes.core_model_nodes()
          if node.name.startswith("ModelMerge") and node.reason is None]
ISSUE_MERGES = ("ModelMergeSimple", "ModelMergeWAN2_1", "ModelMergeSubtract", "ModelMergeAdd")
IN_THE_SUITE = ("ModelMergeSimple", "ModelMergeAdd")
WEIGHTS, TAILS = core_model_nodes.WEIGHTS, core_model_nodes.TAILS
# Each granularity after the other (whole blocks, weight units, tails of blocks), each twice, all resident between.
SEQUENCE = (1, WEIGHTS, TAILS, WEIGHTS, 4096, 1)
SHORT = (1, WEIGHTS, TAILS)  # weights after blocks, and blocks after weights: each failed before the fix
ROWS = [pytest.param(node, "wan21", SHORT, id=f"{node.name}-wan21") for node in MERGES if node.name in IN_THE_SUITE]
ROWS += [pytest.param(node, family, SEQUENCE, id=f"{node.name}-{family}-every-step", marks=pytest.mark.release)
         for node in MERGES for family in ("wan21", "ltxv")]


def test_every_merge_node_of_the_issue_is_found():
    assert set(ISSUE_MERGES) <= {node.name for node in MERGES}
    assert len(MERGES) >= 19


def merged(node, models):
    return core_model_nodes._apply(node.variants[0], node.cls, node.model_inputs, models)


def models_for(node, family):
    return [core_model_nodes.fresh_model(family, k) for k in range(len(node.model_inputs))]


def plain_sample(patcher, family):
    return core_model_nodes.sample_with_plan(patcher, None, family, unload=False)


@pytest.mark.parametrize("node,family,sequence", ROWS)
def test_one_merge_offloaded_in_turn_by_every_plan_stays_bitwise(node, family, sequence):
    reference = core_model_nodes.sample_with_plan(merged(node, models_for(node, family)), None, family)
    bad = []

    def check(what, out, patcher=None, plan=None):
        if not torch.equal(out, reference):
            bad.append(f"{what}: max abs {(out - reference).abs().max().item():.3g}")
        not_as_asked = patcher is not None and core_model_nodes.planned_as_asked(patcher, plan)
        if not_as_asked:
            bad.append(f"{what}: {not_as_asked}")

    # Before the node: the merge's output, kept as a server keeps it, offloaded by one output after another.
    merge_output = merged(node, models_for(node, family))
    for step, plan in enumerate(sequence):
        offloaded = core_model_nodes.offload(merge_output, plan)
        out = core_model_nodes.sample_with_plan(offloaded, plan, family, unload=False)
        check(f"before the node, step {step} ({core_model_nodes.plan_label(plan)})", out, offloaded, plan)
    check("ComfyUI alone after them, the model still loaded", plain_sample(merge_output, family))
    # An output unloaded and collected after ComfyUI unloaded it leaves nothing that makes ComfyUI's next load of a
    # plain clone return early (on the loopback its non-block weights stay on the "device").
    offloaded = core_model_nodes.offload(merge_output, WEIGHTS)
    check("weights, unloaded", core_model_nodes.sample_with_plan(offloaded, WEIGHTS, family))
    del offloaded
    gc.collect()
    check("ComfyUI alone after an unloaded and collected output", plain_sample(merge_output, family))
    mm.unload_all_models()

    # After the node: each output of one loaded model merged with the same second model.
    inputs = models_for(node, family)
    for step, plan in enumerate(sequence[1:]):
        offloaded = core_model_nodes.offload(inputs[0], plan)
        patched = merged(node, [offloaded] + inputs[1:])
        out = core_model_nodes.sample_with_plan(patched, plan, family, unload=False)
        check(f"after the node, step {step} ({core_model_nodes.plan_label(plan)})", out, patched, plan)
    check("ComfyUI alone after them", plain_sample(merged(node, inputs), family))
    mm.unload_all_models()
    assert not bad, f"{node.name} on {family}: " + "; ".join(bad)
