"""Issue 20: every core MODEL-patching node of this ComfyUI, before and after the offload node, bitwise; issue 42:
the same under the plans chosen at the run's first step at a tight budget (streamed tails, weight units), in the
release set.

The rows come from walking ComfyUI's node classes (devtools/core_model_nodes.py), so a later ComfyUI's new nodes
join by themselves. Families: Wan 2.1 (``modulation`` parameters on blocks and head) and LTXV
(``scale_shift_table`` on blocks and on the model), both held by modules that also have children, which ComfyUI's
own load never patches. ``python -P devtools/core_model_nodes.py --family wan21`` prints the same matrix.
"""

import pytest

from layerwise_offload.devtools import core_model_nodes

pytestmark = pytest.mark.usefixtures("comfy_loopback")

NODES = core_model_nodes.core_model_nodes()
RUNNABLE = [(node, variant) for node in NODES if node.reason is None for variant in node.variants]
# The suite's share of the matrix (the CLI runs all of it): every node's defaults on Wan 2.1 at both placements and
# both resident counts, and on LTXV streamed before the node and all resident after it; each other choice of a node
# (a COMBO option, a flipped BOOLEAN) on Wan 2.1 the same way; every compute dtype on LTXV with every run.
OTHER_CHOICE_RUNS = (("before", core_model_nodes.RESIDENT_COUNTS[0]), ("after", core_model_nodes.RESIDENT_COUNTS[-1]))
ROWS = [(node, variant, "wan21", core_model_nodes.ALL_RUNS) for node, variant in RUNNABLE if variant.label == "defaults"]
ROWS += [(node, variant, "ltxv", OTHER_CHOICE_RUNS) for node, variant in RUNNABLE if variant.label == "defaults"]
ROWS += [(node, variant, "wan21", OTHER_CHOICE_RUNS) for node, variant in RUNNABLE if variant.label != "defaults"]
# A compute dtype changes how every weight is cast: each choice of it on LTXV too, with every run.
ROWS += [(node, variant, "ltxv", core_model_nodes.ALL_RUNS) for node, variant in RUNNABLE
         if variant.label.startswith("dtype=")]
# Nodes whose inputs cannot be made here are rows too, skipped with the reason.
ROWS += [(node, None, "wan21", ()) for node in NODES if node.reason is not None]
IDS = [f"{n.name}[{v.label if v else 'not run'}]-{f}" for n, v, f, _ in ROWS]
# The release set (-m release, docs/testing.md): the same rows under the plans chosen at the first step from a budget
# of 0.8 of the blocks' bytes, streamed tails (auto on a card the timing model knows) and weight units
# (residency_policy weights), before and after the node: every node's defaults on both families, the other choices
# on Wan 2.1, every compute dtype on LTXV.
PLANNED = core_model_nodes.PLANNED_RUNS
RELEASE_ROWS = [(node, variant, family, PLANNED) for node, variant in RUNNABLE for family in ("wan21", "ltxv")
                if variant.label == "defaults" or (family == "wan21") != variant.label.startswith("dtype=")]
ROWS += [pytest.param(*row, marks=pytest.mark.release) for row in RELEASE_ROWS]
IDS += [f"{n.name}[{v.label}]-{f}-planned" for n, v, f, _ in RELEASE_ROWS]


def test_the_matrix_is_found_by_discovery():
    names = {node.name for node in NODES}
    # The nodes issue 20 found differing or crashing must be among the rows, and run.
    for name in ("ModelMergeSimple", "ModelMergeSubtract", "ModelMergeAdd", "ModelMergeWAN2_1", "ModelComputeDtype"):
        assert name in names and next(n for n in NODES if n.name == name).reason is None
    dtypes = {v.values["dtype"] for n, v in RUNNABLE if n.name == "ModelComputeDtype"}
    assert {"fp16", "bf16", "fp32"} <= dtypes
    merge = next(v for n, v in RUNNABLE if n.name == "ModelMergeSimple")
    assert 0 < merge.values["ratio"] < 1, "a ratio at an end of its range would make the merge an identity"
    assert len(RUNNABLE) >= 40


@pytest.mark.parametrize("node,variant,family,runs", ROWS, ids=IDS)
def test_core_node_is_bitwise_with_and_without_offload(node, variant, family, runs):
    if variant is None:
        pytest.skip(f"{node.name}: {node.reason}")
    rows = list(core_model_nodes.compare(node, variant, family, runs))
    if rows[0][0] == "reference":
        pytest.skip(f"{node.name} does not apply to {family}: {rows[0][2]}")
    bad = [f"{placement} the offload node, {core_model_nodes.plan_label(plan)}: {result}"
           for placement, plan, result in rows if result != "bitwise"]
    assert not bad, f"{node.name} [{variant.label}] on {family}: " + "; ".join(bad)

