// Draws the Layerwise Offload Stats node's last run as a picture on the node: the block map in call order (each
// block in VRAM, streamed from RAM, or streamed from disk), VRAM against the card, RAM held, and copy time against
// compute time per step, above a few short lines.
//
// The node sends the run as data (UI output "layerwise_offload", nodes/stats_view.py) next to its text. Only the
// frontend's public API is used: `app` from app.js and node.addDOMWidget, on frontends 1.32 (ComfyUI 0.3.75) to
// 1.58. The widget stays drawn when zoomed out (hideOnZoom: false), where the canvas itself drops node text, so its
// colours and large figures are what a fitted template shows. Styles are inline: nothing leaks into the page.
import { app } from "../../../scripts/app.js";

const STATS_NODE = "LayerwiseOffloadStats";
const WIDGET = "layerwiseoffload_picture";
const UI_KEY = "layerwise_offload";
const WIDTH = 400; // graph units: the node is made at least this wide, so blocks and figures stay large

const COLOURS = {
  R: "#2ea043", // in VRAM
  P: "#a3b139", // partly in VRAM: a block whose layers are part resident, part streamed (residency_policy weights)
  S: "#f0883e", // streamed from RAM
  D: "#8957e5", // streamed from disk
  other: "#1f6feb", // the model's other weights on the device
  pinned: "#d29922", // page-locked RAM
  ram: "#39c5cf", // the rest of the RAM this model holds
  compute: "#1f6feb",
  copy: "#f0883e",
  wait: "#da3633",
  track: "#30363d",
  text: "#e6edf3",
  dim: "#9da7b3",
};
const TIER_NAMES = { R: "in VRAM", P: "partly in VRAM", S: "streamed from RAM", D: "streamed from disk" };

function el(tag, style, text) {
  const node = document.createElement(tag);
  Object.assign(node.style, style || {});
  if (text != null) node.textContent = text;
  return node;
}

function cellSize(count) {
  return Math.max(12, Math.min(48, Math.floor((WIDTH - 8) / Math.max(1, count)) - 2));
}

function blockMap(blocks) {
  const size = cellSize(blocks.length);
  const map = el("div", { display: "flex", flexWrap: "wrap", gap: "2px", margin: "4px 0" });
  map.dataset.layerwiseoffloadBlocks = blocks;
  for (const tier of blocks) {
    map.append(el("div", { width: `${size}px`, height: `${Math.max(size, 24)}px`, borderRadius: "2px",
                           background: COLOURS[tier] || COLOURS.track }));
  }
  return map;
}

function legend(blocks) {
  const row = el("div", { display: "flex", flexWrap: "wrap", gap: "4px 14px", fontSize: "16px", margin: "2px 0 6px" });
  for (const tier of ["R", "P", "S", "D"]) {
    const count = [...blocks].filter((t) => t === tier).length;
    if (!count) continue;
    const item = el("span", { display: "inline-flex", alignItems: "center", gap: "5px" });
    item.append(el("span", { width: "14px", height: "14px", background: COLOURS[tier], display: "inline-block" }));
    item.append(el("span", { fontWeight: "bold" }, `${count} ${TIER_NAMES[tier]}`));
    row.append(item);
  }
  return row;
}

// One labelled bar: segments [{value, colour}] against `total` (a non-zero segment is never drawn thinner than 3px).
function bar(label, text, segments, total) {
  const wrap = el("div", { margin: "3px 0" });
  const head = el("div", { display: "flex", justifyContent: "space-between", fontSize: "16px" });
  head.append(el("span", { fontWeight: "bold" }, label), el("span", {}, text));
  const track = el("div", { display: "flex", height: "18px", background: COLOURS.track, borderRadius: "3px",
                            overflow: "hidden" });
  for (const { value, colour } of segments) {
    if (!(value > 0)) continue;
    const share = total > 0 ? Math.min(100, (100 * value) / total) : 0;
    track.append(el("div", { width: `${share}%`, minWidth: "3px", background: colour }));
  }
  wrap.append(head, track);
  return wrap;
}

function secs(value) {
  if (value >= 0.1) return `${value.toFixed(2)} s`;
  return `${(value * 1e3).toFixed(value >= 0.001 ? 0 : 1)} ms`;
}

function timeBars(time) {
  const { compute, copy, wait, overlap, unit } = time;
  const wrap = el("div", { margin: "3px 0" });
  const head = el("div", { display: "flex", justifyContent: "space-between", fontSize: "16px" });
  head.append(el("span", { fontWeight: "bold" }, `per ${unit}`),
               el("span", {}, `compute ${secs(compute)} · copies ${copy > 0 ? secs(copy) : "none"}`));
  wrap.append(head);
  // Overlapping copies run beside compute (two lanes); on a device without a copy stream they add to it (one lane).
  const span = overlap ? Math.max(compute + wait, copy) : compute + copy;
  const lanes = overlap
    ? [[{ value: compute, colour: COLOURS.compute }, { value: wait, colour: COLOURS.wait }],
       [{ value: copy, colour: COLOURS.copy }]]
    : [[{ value: compute, colour: COLOURS.compute }, { value: copy, colour: COLOURS.copy }]];
  for (const lane of lanes) {
    const track = el("div", { display: "flex", height: "12px", background: COLOURS.track, borderRadius: "3px",
                              overflow: "hidden", marginTop: "2px" });
    for (const { value, colour } of lane) {
      if (!(value > 0)) continue;
      track.append(el("div", { width: `${span > 0 ? (100 * value) / span : 0}%`, minWidth: "3px", background: colour }));
    }
    wrap.append(track);
  }
  return wrap;
}

function afterConnected(node) {
  const input = node.inputs?.find((i) => i.name === "after");
  return input ? input.link != null : true;
}

function hintData(node) {
  const lines = afterConnected(node)
    ? ["Run the workflow: the picture of the run appears here."]
    : ["Connect the sampler's LATENT output to `after`, then run the workflow."];
  return { state: "waiting", title: "no run yet", lines };
}

function render(node, box, data) {
  box.replaceChildren();
  box.dataset.layerwiseoffloadState = data.state;
  const big = data.state === "run" ? "22px" : "28px";
  const titleColour = { passed_through: COLOURS.dim, not_offloaded: COLOURS.wait }[data.state] || COLOURS.text;
  box.append(el("div", { fontSize: big, fontWeight: "bold", color: titleColour, lineHeight: "1.15" }, data.title));
  // The title is said once: a first line that starts with it ("passed through: ...") goes on without it.
  const said = `${data.title}: `.toLowerCase();
  let lines = (data.caption || data.lines || []).map((line) =>
    line.toLowerCase().startsWith(said) ? line.slice(said.length) : line).filter((line) => line !== data.title);
  if (data.state === "run") {
    box.append(blockMap(data.blocks), legend(data.blocks));
    const v = data.vram;
    box.append(bar(v.label, v.text, [{ value: v.blocks, colour: COLOURS.R }, { value: v.other, colour: COLOURS.other }],
                   v.total || v.blocks + v.other));
    const r = data.ram;
    box.append(bar("RAM", r.text, [{ value: r.pinned, colour: COLOURS.pinned },
                                   { value: r.held - r.pinned, colour: COLOURS.ram }], r.total || r.held));
    box.append(timeBars(data.time));
  }
  const small = data.state === "run" ? "14px" : "18px";
  for (const line of lines) {
    box.append(el("div", { fontSize: small, color: data.state === "run" ? COLOURS.dim : COLOURS.text,
                           marginTop: "3px", lineHeight: "1.25" }, line));
  }
  fitNode(node, box);
}

function fitNode(node, box) {
  // The widget's height follows its content; the node grows to hold it and never shrinks below what the user set.
  const needed = Math.ceil(box.scrollHeight) + 12;
  node.layerwiseoffloadHeight = Math.max(120, needed);
  const size = node.computeSize?.() || node.size;
  const width = Math.max(node.size[0], WIDTH + 20);
  const height = Math.max(node.size[1], size[1]);
  if (width !== node.size[0] || height !== node.size[1]) node.setSize?.([width, height]);
  node.setDirtyCanvas?.(true, true);
}

function show(node, data) {
  const widget = node.widgets?.find((w) => w.name === WIDGET);
  if (!widget) return;
  node.layerwiseoffloadData = data;
  render(node, widget.element, data);
  requestAnimationFrame(() => fitNode(node, widget.element)); // laid out now: its true height is known
}

app.registerExtension({
  name: "layerwiseoffload.Stats",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== STATS_NODE) return;

    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const box = el("div", { boxSizing: "border-box", padding: "6px 8px", color: COLOURS.text,
                              fontFamily: "Inter, Arial, sans-serif", background: "#161b22", borderRadius: "6px",
                              overflow: "hidden", pointerEvents: "none" });
      box.className = "layerwiseoffload-stats";
      const widget = this.addDOMWidget(WIDGET, "layerwiseoffload_picture", box, {
        hideOnZoom: false,
        serialize: false,
        getValue: () => this.layerwiseoffloadData ?? null,
        setValue: () => {},
        getMinHeight: () => this.layerwiseoffloadHeight ?? 120,
      });
      widget.serialize = false; // a display, not an input: never saved into the workflow or the prompt
      this.layerwiseoffloadHeight = 120;
      requestAnimationFrame(() => { if (!this.layerwiseoffloadData) show(this, hintData(this)); });
      return result;
    };

    const onConnectionsChange = nodeType.prototype.onConnectionsChange;
    nodeType.prototype.onConnectionsChange = function () {
      const result = onConnectionsChange?.apply(this, arguments);
      if (!this.layerwiseoffloadData || this.layerwiseoffloadData.state === "waiting") show(this, hintData(this));
      return result;
    };

    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const result = onConfigure?.apply(this, arguments);
      requestAnimationFrame(() => { if (!this.layerwiseoffloadData || this.layerwiseoffloadData.state === "waiting") show(this, hintData(this)); });
      return result;
    };

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const data = message?.[UI_KEY];
      if (data == null) return;
      show(this, Array.isArray(data) ? data[data.length - 1] : data);
    };
  },
});
