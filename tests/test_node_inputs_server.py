"""Every bad value a person can type or queue into one of the pack's nodes comes back from a real server as
`node_errors` naming the input, before anything runs.

The bad values are derived from each node's own spec as the server publishes it (`/object_info`): below the
minimum, above the maximum, NaN and infinity for numbers, text for numbers, an unknown choice for combos, and the
values the nodes' settings reject although each widget alone allows them (start after end, a file name outside
the models folder, bits other than 8). ComfyUI 0.3.75 itself lets NaN through every range and does not check a
V3 node's combo values, so without the nodes' own checks several of these would run with a meaning nobody asked
for. Booleans are left out: ComfyUI turns any value into a boolean with `bool()` before a node sees it.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import requests

from tests.support.workflows_common import load_api, workflow_checkpoints  # noqa: F401  (fixture)

pytestmark = pytest.mark.server

# The shipped API workflows that hold every node of the pack between them.
WORKFLOWS = ("sd15_full_stack_int8_deepcache_compile", "sd15_int8_save", "sd15_int8_load")
PACK_NODES = ("Int8AccelQuantize", "Int8AccelDeepCache", "Int8AccelCompile", "Int8AccelSaveModel",
              "Int8AccelLoadModel")


def _node_prompts() -> dict[str, tuple[dict, str]]:
    """{class_type: (a shipped prompt holding it, its node id)} for every node of the pack."""
    found = {}
    for name in WORKFLOWS:
        prompt = load_api(name)
        for node_id, node in prompt.items():
            if node["class_type"] in PACK_NODES and node["class_type"] not in found:
                found[node["class_type"]] = (prompt, node_id)
    assert set(found) == set(PACK_NODES), sorted(found)
    return found


OUTPUT_NODES = {"SaveImage", "PreviewImage", "PreviewAny", "SaveAnimatedWEBP", "Int8AccelSaveModel"}


def _depends_on(prompt: dict, node_id: str, target: str) -> bool:
    if node_id == target:
        return True
    links = [v[0] for v in prompt[node_id]["inputs"].values() if isinstance(v, list) and len(v) == 2]
    return any(_depends_on(prompt, source, target) for source in links)


def _with_value(prompt: dict, node_id: str, changes: dict) -> dict:
    """A copy of `prompt` with `changes` in node `node_id`'s inputs, keeping only the outputs that depend on that
    node: ComfyUI runs the outputs a bad node does not reach (HTTP 200 with node_errors), and those would run."""
    changed = json.loads(json.dumps(prompt))
    changed[node_id]["inputs"].update(changes)
    for other in [k for k, v in changed.items() if v["class_type"] in OUTPUT_NODES]:
        if not _depends_on(changed, other, node_id):
            del changed[other]
    return changed


def _bad_values(spec: list) -> list:
    """Values the widget described by `spec` (object_info form: [type or options, {min, max, ...}]) must refuse."""
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if kind in ("INT", "FLOAT"):
        bad = ["abc"]
        if "min" in options:
            bad.append(options["min"] - (1 if kind == "INT" else 0.5))
        if "max" in options:
            bad.append(options["max"] + (1 if kind == "INT" else 0.5))
        if kind == "FLOAT":
            bad += [math.nan, math.inf, -math.inf]
        return bad
    if kind == "COMBO" or isinstance(kind, list):
        return ["no-such-choice", 7]
    return []


# Values each widget allows alone that the node's settings refuse (input, value, other inputs changed with it).
SETTINGS_CASES = [
    ("Int8AccelQuantize", "bits", 5, {}),
    ("Int8AccelDeepCache", "start_percent", 0.6, {"end_percent": 0.4}),
    ("Int8AccelDeepCache", "start_percent", 0.5, {"end_percent": 0.5}),
    ("Int8AccelSaveModel", "filename_prefix", "../../outside", {}),
    ("Int8AccelSaveModel", "filename_prefix", "/etc/int8", {}),
    ("Int8AccelSaveModel", "filename_prefix", "int8/", {}),
]


def _post(server, prompt: dict) -> requests.Response:
    # requests' json= refuses NaN; ComfyUI's server parses it (Python's json), as a page or script may send it
    body = json.dumps({"prompt": prompt, "client_id": server.client_id}, allow_nan=True)
    return requests.post(f"{server.url}/prompt", data=body, headers={"Content-Type": "application/json"},
                         timeout=60)


def _assert_refused(server, prompt: dict, node_id: str, input_name: str, value) -> str:
    response = _post(server, prompt)
    assert response.status_code == 400, f"{input_name}={value!r} was accepted: {response.text[:300]}"
    errors = response.json().get("node_errors", {}).get(node_id, {}).get("errors", [])
    assert errors, f"{input_name}={value!r}: no node_errors for node {node_id}: {response.text[:600]}"
    # the node's own check words its message "input=value ..." (ComfyUI repeats it under every input the check
    # took); ComfyUI's own checks (a value that is no number at all) name the input in extra_info
    texts = [f"{e['type']}: {e.get('details', '')}" for e in errors]
    named = [e for e in errors if (e["type"] == "custom_validation_failed" and f"{input_name}=" in e.get("details", ""))
             or (e["type"] != "custom_validation_failed" and e.get("extra_info", {}).get("input_name") == input_name)]
    assert named, f"{input_name}={value!r}: no error names it: {texts}"
    return " | ".join(texts)


def test_every_bad_widget_value_of_every_node_comes_back_as_node_errors(server):
    checked = []
    for class_type, (prompt, node_id) in _node_prompts().items():
        spec = server.get(f"/object_info/{class_type}").json()[class_type]["input"]
        widgets = {**spec.get("required", {}), **spec.get("optional", {})}
        for name, widget in widgets.items():
            if name not in prompt[node_id]["inputs"] or isinstance(prompt[node_id]["inputs"][name], list):
                continue  # a linked input (MODEL, LATENT): ComfyUI's own type check
            for value in _bad_values(widget):
                _assert_refused(server, _with_value(prompt, node_id, {name: value}), node_id, name, value)
                checked.append((class_type, name, value))
    for class_type, name, value, others in SETTINGS_CASES:
        prompt, node_id = _node_prompts()[class_type]
        text = _assert_refused(server, _with_value(prompt, node_id, {name: value, **others}), node_id, name, value)
        checked.append((class_type, name, value))
        if name == "bits":
            assert "only bits=8" in text, text
    # every node and each of its number and combo widgets was tried
    assert {c for c, _, _ in checked} == set(PACK_NODES)
    assert len(checked) >= 40, len(checked)
    queue = server.get("/queue").json()
    assert not queue["queue_running"] and not queue["queue_pending"], queue
    assert server.alive()


@pytest.mark.usefixtures("workflow_checkpoints")
def test_shipped_values_pass_the_same_checks(comfy_root, pack):
    """The control: the nodes' checks refuse nothing the shipped workflows queue (ComfyUI's own validation,
    in-process, with the pack's nodes registered as the server registers them)."""
    import execution
    import folder_paths

    import nodes

    nodes.NODE_CLASS_MAPPINGS.update(pack.NODE_CLASS_MAPPINGS)
    for class_type, (prompt, node_id) in _node_prompts().items():
        prompt = json.loads(json.dumps(prompt))
        if class_type == "Int8AccelLoadModel":  # the shipped name is the save workflow's output: use a present file
            prompt[node_id]["inputs"]["unet_name"] = folder_paths.get_filename_list("diffusion_models")[0]
        valid, errors, _ = asyncio.run(execution.validate_inputs("check", prompt, node_id, {}))
        assert valid, (class_type, errors)
