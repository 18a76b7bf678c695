"""Check UI-format workflows against a live ``/object_info`` and turn them into the API prompts the frontend would
POST, for the plain graphs in ``workflows/`` (no subgraphs, no primitive nodes): tests run a shipped workflow
without a browser and check that it would load without warnings. Pure Python: ``object_info`` is the JSON of
``GET /api/object_info``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

#: Node types that exist only in the frontend (never in /object_info, never sent to the server).
FRONTEND_ONLY = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
#: Scalar input types the frontend shows as widgets (COMBO and list-typed inputs are widgets too).
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})

#: What a widget value of each scalar type must be (a bool is an int to Python: not accepted for INT or FLOAT).
_SCALARS = {"INT": (int, "an int"), "FLOAT": ((int, float), "a number"), "BOOLEAN": (bool, "a boolean"),
            "STRING": (str, "a string")}
_BYPASS, _MUTE = 4, 2


def input_specs(info: Dict[str, Any]) -> List[Tuple[str, Any, Dict[str, Any], bool]]:
    """``[(name, type_or_options, options_dict, required)]`` of a node's inputs, in the order the frontend lays
    them out (``input_order`` when given, required first)."""
    out = []
    inputs = info.get("input", {})
    order = info.get("input_order") or {sec: list(inputs.get(sec, {})) for sec in ("required", "optional")}
    for sec in ("required", "optional"):
        for name in order.get(sec, []):
            spec = inputs.get(sec, {}).get(name)
            if spec is None:
                continue
            typ = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out.append((name, typ, opts, sec == "required"))
    return out


def _is_widget(typ: Any, opts: Dict[str, Any]) -> bool:
    if opts.get("forceInput"):
        return False
    return isinstance(typ, list) or typ in WIDGET_TYPES


def combo_options(typ: Any, opts: Dict[str, Any]) -> Optional[List[Any]]:
    """The options of a COMBO input (old style: the list itself), or None for any other input."""
    if isinstance(typ, (list, tuple)):
        return list(typ)
    if typ == "COMBO":
        return list(opts.get("options", []))
    return None


def widget_inputs(info: Dict[str, Any]) -> List[Tuple[str, Any, Dict[str, Any]]]:
    """The widget inputs of a node, in widget order; a seed-like INT with ``control_after_generate`` is followed by
    the pseudo input ``("control_after_generate", None, {})`` that the frontend stores in ``widgets_values``."""
    out = []
    for name, typ, opts, _ in input_specs(info):
        if _is_widget(typ, opts):
            out.append((name, typ, opts))
            if opts.get("control_after_generate"):
                out.append(("control_after_generate", None, {}))
    return out


def _socket_type(typ: Any) -> str:
    return "COMBO" if isinstance(typ, list) else str(typ)


def _types_match(a: str, b: str) -> bool:
    # LiteGraph accepts "*" and comma-separated unions.
    if a == "*" or b == "*":
        return True
    return bool(set(a.split(",")) & set(b.split(",")))


def validate_workflow(wf: Dict[str, Any], object_info: Dict[str, Any], check_files: bool = False) -> List[str]:
    """Problems that would make the frontend warn or the server reject the graph; ``[]`` when clean.

    Checks: format keys and version; every node type registered (or frontend-only); unique ids and
    ``last_node_id``/``last_link_id``; every link consistent on both ends (ids, slots, types, also against the
    server's declared input/output types); every required socket linked; ``widgets_values`` the right length with
    values the server accepts (combo options, min/max, types). Combos listing model files are only checked when
    ``check_files`` is true (the files of a real-model workflow are not on a test machine)."""
    problems: List[str] = []
    for key in ("nodes", "links", "version", "last_node_id", "last_link_id"):
        if key not in wf:
            problems.append(f"missing top-level key {key!r}")
    if problems:
        return problems
    if wf["version"] != 0.4:
        problems.append(f"version is {wf['version']!r}, expected 0.4")
    nodes = {}
    for n in wf["nodes"]:
        if n["id"] in nodes:
            problems.append(f"duplicate node id {n['id']}")
        nodes[n["id"]] = n
        if n["type"] not in object_info and n["type"] not in FRONTEND_ONLY:
            problems.append(f"node {n['id']}: type {n['type']!r} is not registered (missing node)")
    if nodes and wf["last_node_id"] < max(nodes):
        problems.append(f"last_node_id {wf['last_node_id']} < max node id {max(nodes)}")
    links = {}
    for link in wf["links"]:
        if len(link) != 6:
            problems.append(f"link {link!r}: expected [id, from, from_slot, to, to_slot, type]")
            continue
        lid, src, sslot, dst, dslot, ltype = link
        if lid in links:
            problems.append(f"duplicate link id {lid}")
        links[lid] = link
        if src not in nodes or dst not in nodes:
            problems.append(f"link {lid}: node {src if src not in nodes else dst} does not exist")
            continue
        outs, ins = nodes[src].get("outputs", []), nodes[dst].get("inputs", [])
        if not 0 <= sslot < len(outs):
            problems.append(f"link {lid}: node {src} has no output slot {sslot}")
            continue
        if not 0 <= dslot < len(ins):
            problems.append(f"link {lid}: node {dst} has no input slot {dslot}")
            continue
        out, inp = outs[sslot], ins[dslot]
        if lid not in (out.get("links") or []):
            problems.append(f"link {lid}: not listed in node {src} output {out['name']!r} links")
        if inp.get("link") != lid:
            problems.append(f"link {lid}: node {dst} input {inp['name']!r} points at link {inp.get('link')}")
        if not (_types_match(ltype, out["type"]) and _types_match(ltype, inp["type"])):
            problems.append(f"link {lid}: type {ltype} vs output {out['type']} / input {inp['type']}")
        sinfo, dinfo = object_info.get(nodes[src]["type"]), object_info.get(nodes[dst]["type"])
        if sinfo is not None:
            declared = sinfo.get("output", [])
            if sslot >= len(declared) or not _types_match(ltype, _socket_type(declared[sslot])):
                problems.append(f"link {lid}: {nodes[src]['type']} output {sslot} is "
                                f"{declared[sslot] if sslot < len(declared) else 'missing'} on the server, link says {ltype}")
        if dinfo is not None:
            spec = {name: typ for name, typ, _, _ in input_specs(dinfo)}
            if inp["name"] not in spec:
                problems.append(f"link {lid}: {nodes[dst]['type']} has no input {inp['name']!r} on the server")
            elif not _types_match(ltype, _socket_type(spec[inp["name"]])):
                problems.append(f"link {lid}: {nodes[dst]['type']}.{inp['name']} is {spec[inp['name']]} on the server, "
                                f"link says {ltype}")
    if links and wf["last_link_id"] < max(links):
        problems.append(f"last_link_id {wf['last_link_id']} < max link id {max(links)}")
    for n in nodes.values():
        for slot, inp in enumerate(n.get("inputs", [])):
            if inp.get("link") is not None and inp["link"] not in links:
                problems.append(f"node {n['id']} input {inp['name']!r}: link {inp['link']} does not exist")
        for out in n.get("outputs", []):
            for lid in out.get("links") or []:
                if lid not in links:
                    problems.append(f"node {n['id']} output {out['name']!r}: link {lid} does not exist")
        info = object_info.get(n["type"])
        if info is None:
            continue
        linked = {inp["name"] for inp in n.get("inputs", []) if inp.get("link") is not None}
        for name, typ, opts, required in input_specs(info):
            if required and not _is_widget(typ, opts) and name not in linked:
                problems.append(f"node {n['id']} ({n['type']}): required input {name!r} is not connected")
        problems += _check_widgets(n, info, linked, check_files)
    return problems


def _check_widgets(n: Dict[str, Any], info: Dict[str, Any], linked, check_files: bool) -> List[str]:
    problems = []
    widgets = widget_inputs(info)
    values = n.get("widgets_values", [])
    if isinstance(values, dict):
        return [f"node {n['id']} ({n['type']}): dict widgets_values are not supported here"]
    if len(values) != len(widgets):
        return [f"node {n['id']} ({n['type']}): {len(values)} widget values for {[w[0] for w in widgets]}"]
    for (name, typ, opts), value in zip(widgets, values):
        where = f"node {n['id']} ({n['type']}).{name}={value!r}"
        if name in linked:
            continue
        if typ is None:  # control_after_generate
            if value not in ("fixed", "increment", "decrement", "randomize"):
                problems.append(f"{where}: not a control_after_generate mode")
            continue
        options = combo_options(typ, opts)
        if options is not None:
            file_list = name.endswith("_name") or name.startswith("clip_name") or name in ("ckpt_name", "unet_name")
            if (not file_list or check_files) and value not in options:
                problems.append(f"{where}: not one of {options[:12]}")
            continue
        if typ in _SCALARS:
            kinds, what = _SCALARS[typ]
            if not isinstance(value, kinds) or (isinstance(value, bool) and typ != "BOOLEAN"):
                problems.append(f"{where}: not {what}")
                continue
            if typ in ("BOOLEAN", "STRING"):
                continue
        if "min" in opts and value < opts["min"]:
            problems.append(f"{where}: below min {opts['min']}")
        if "max" in opts and value > opts["max"]:
            problems.append(f"{where}: above max {opts['max']}")
    return problems


def workflow_to_prompt(wf: Dict[str, Any], object_info: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The API-format prompt the frontend would POST for ``wf`` (frontend-only and muted nodes dropped; bypassed
    nodes are not supported and raise). Raises ``ValueError`` on an inconsistent graph."""
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = {link[0]: link for link in wf["links"]}
    prompt: Dict[str, Dict[str, Any]] = {}
    for n in wf["nodes"]:
        if n["type"] in FRONTEND_ONLY or n.get("mode", 0) == _MUTE:
            continue
        if n.get("mode", 0) == _BYPASS:
            raise ValueError(f"node {n['id']} ({n['type']}) is bypassed; workflow_to_prompt does not support that")
        info = object_info.get(n["type"])
        if info is None:
            raise ValueError(f"node {n['id']}: type {n['type']!r} is not registered")
        inputs: Dict[str, Any] = {}
        values = list(n.get("widgets_values", []))
        for (name, typ, _), value in zip(widget_inputs(info), values):
            if typ is not None:
                inputs[name] = value
        for inp in n.get("inputs", []):
            lid = inp.get("link")
            if lid is None:
                continue
            _, src, sslot, _, _, _ = links[lid]
            if nodes[src]["type"] in FRONTEND_ONLY:
                raise ValueError(f"node {n['id']} input {inp['name']!r} comes from a frontend-only node")
            inputs[inp["name"]] = [str(src), sslot]
        entry: Dict[str, Any] = {"class_type": n["type"], "inputs": inputs}
        if n.get("title"):
            entry["_meta"] = {"title": n["title"]}
        prompt[str(n["id"])] = entry
    return prompt
