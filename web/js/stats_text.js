// Served at /extensions/layerwise-offload/js/stats_text.js, hence ../../../scripts.
// Draws the Layerwise Offload Stats node's report on the node itself.
//
// The node returns its report as `text` UI output (the same as core's Preview Any), and the frontend draws UI
// output only where an extension gives it a widget. This adds one read-only multiline text widget when the node is
// created and fills it after each run. A plain STRING widget renders in both the classic canvas (a DOM textarea)
// and Nodes 2.0 (its Vue textarea), on frontends 1.32 (ComfyUI 0.3.75) through 1.39 (ComfyUI 0.14.1).
import { app } from "../../../scripts/app.js";
import { ComfyWidgets } from "../../../scripts/widgets.js";

const STATS_NODE = "LayerwiseOffloadStats";
const WIDGET = "stats";
const PLACEHOLDER = "Run the workflow: the offload report appears here.";

function statsWidget(node) {
  return node.widgets?.find((w) => w.name === WIDGET);
}

function showText(node, text) {
  const widget = statsWidget(node);
  if (!widget) return;
  widget.value = text;
  // Nodes 2.0 draws from the widget's value; the classic canvas needs a redraw for the DOM widget's size.
  widget.callback?.(text);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "layerwise_offload.StatsText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== STATS_NODE) return;

    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const { widget } = ComfyWidgets.STRING(this, WIDGET, ["STRING", { multiline: true }], app);
      widget.options = { ...(widget.options ?? {}), read_only: true };
      if (widget.inputEl) {
        widget.inputEl.readOnly = true;
        widget.inputEl.placeholder = PLACEHOLDER;
      }
      widget.serialize = false; // a display, not an input: never saved into the workflow or the prompt
      widget.value = "";
      return result;
    };

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text;
      if (text == null) return;
      showText(this, Array.isArray(text) ? text.join("\n") : String(text));
    };
  },
});
