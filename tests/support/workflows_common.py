"""Shared by the workflow, browser, API-error and server tests: the shipped workflow files, the extra
checkpoints they name, an independent reading of a UI graph into an API prompt using the server's
/object_info, the INT8 report as the page shows it (the Quantize node's report in Preview as Text), and the
INT8 file the save workflow writes for the load workflow."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO_ROOT / "workflows"
ARTIFACTS = REPO_ROOT / "test-artifacts"
# Frontend-only node types: the page never puts them in a prompt.
VIRTUAL_NODE_TYPES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# The output nodes whose files the workflows write: pictures, and the Wan workflow's animated WebP.
SAVE_NODE_TYPES = ("SaveImage", "SaveAnimatedWEBP")
LATENT_NODE_TYPES = ("EmptyLatentImage", "EmptySD3LatentImage", "EmptyHunyuanLatentVideo")


# The pair of workflows around an INT8 file: the first writes the file the second loads.
INT8_SAVE, INT8_LOAD = "sd15_int8_save", "sd15_int8_load"


def workflow_names() -> list[str]:
    return sorted(p.stem for p in WORKFLOWS.glob("*.json"))


def in_run_order(names: list[str]) -> list[str]:
    """`names` with the INT8 load workflow moved right after the save workflow that writes its file."""
    ordered = [name for name in names if name != INT8_LOAD]
    if INT8_LOAD in names:
        ordered.insert(ordered.index(INT8_SAVE) + 1 if INT8_SAVE in ordered else len(ordered), INT8_LOAD)
    return ordered


def load_ui(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def load_api(name: str) -> dict:
    return json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())


@pytest.fixture(scope="session")
def workflow_checkpoints(comfy_root, sd15_checkpoint) -> list[str]:
    """Every checkpoint the shipped workflows name, built once by the model factories (for Wan: its diffusion
    model, VAE and text encoder, as three files)."""
    from harness.make_more_checkpoints import ensure_sd3_checkpoint, ensure_sdxl_vega_checkpoint, ensure_wan21_files

    return [sd15_checkpoint, ensure_sdxl_vega_checkpoint(comfy_root).name, ensure_sd3_checkpoint(comfy_root).name,
            ensure_wan21_files(comfy_root).name]


# --- the INT8 file the save workflow writes and the load workflow reads ------------------------------------
RESIDENT_RE = re.compile(r"(\d+) Linear and (\d+) Conv2d layers resident in INT8")


def int8_file_name() -> str:
    """The file the load workflow's Load Diffusion Model (INT8) names (relative to the diffusion-model folders)."""
    prompt = load_api(INT8_LOAD)
    return prompt[node_of(prompt, "Int8AccelLoadModel")]["inputs"]["unet_name"]


def saved_int8_files() -> list[Path]:
    """Every file Save INT8 Model wrote with the save workflow's filename_prefix, in any diffusion-model folder."""
    import folder_paths

    prompt = load_api(INT8_SAVE)
    prefix = prompt[node_of(prompt, "Int8AccelSaveModel")]["inputs"]["filename_prefix"]
    folder, stem = prefix.rsplit("/", 1) if "/" in prefix else ("", prefix)
    numbered = re.compile(re.escape(stem) + r"_\d{5}_\.safetensors")
    return [path for root in folder_paths.get_folder_paths("diffusion_models") if (Path(root) / folder).is_dir()
            for path in sorted((Path(root) / folder).iterdir()) if numbered.fullmatch(path.name)]


def resident_int8_logged(server, log_from: int) -> list[tuple[int, int]]:
    """(Linear, Conv2d) counts of every model Load Diffusion Model (INT8) loaded since byte `log_from` of the log."""
    with open(server.log_path, "rb") as log:
        log.seek(log_from)
        return [(int(a), int(b)) for a, b in RESIDENT_RE.findall(log.read().decode(errors="replace"))]


class Int8SaveRun:
    """The run of the save workflow, in this test session, that wrote the file the load workflow reads.

    `prepare` removes the files of the save workflow's prefix left by earlier sessions, so that the next run
    writes the first numbered file, as on a fresh ComfyUI: the one the load workflow names. A test that queues
    the save workflow itself (the browser's) calls `prepare` and then `record`; `ensure` queues it over the API
    when no run of this session wrote the file yet."""

    def __init__(self, server) -> None:
        self.server = server
        self.history: dict | None = None
        self.log_from = 0

    @property
    def path(self) -> Path:
        import folder_paths

        found = folder_paths.get_full_path("diffusion_models", int8_file_name())
        return Path(found) if found else Path(folder_paths.get_folder_paths("diffusion_models")[0]) / int8_file_name()

    def prepare(self) -> None:
        for path in saved_int8_files():
            path.unlink()
        self.history = None

    def record(self, history: dict, log_from: int) -> None:
        status = history.get("status", {})
        assert status.get("status_str") == "success", f"{json.dumps(status)[:3000]}\n{self.server.log_tail()}"
        assert self.path.is_file(), (
            f"the save workflow ran but did not write {int8_file_name()} (the file the load workflow reads); "
            f"files of its prefix: {[p.name for p in saved_int8_files()]}")
        self.history, self.log_from = history, log_from

    def ensure(self) -> Int8SaveRun:
        if self.history is None or not self.path.is_file():
            self.prepare()
            log_from = self.server.log_path.stat().st_size
            self.record(self.server.run(load_api(INT8_SAVE), timeout=900)["history"], log_from)
        return self


@pytest.fixture(scope="session")
def int8_save_session(server, workflow_checkpoints) -> Int8SaveRun:
    """This session's record of the save workflow's run (none yet: see `int8_file`)."""
    return Int8SaveRun(server)


@pytest.fixture
def int8_file(int8_save_session) -> Int8SaveRun:
    """The INT8 file the load workflow reads, written by a run of the save workflow in this session on the same
    server (queued here when no test ran it yet)."""
    return int8_save_session.ensure()


def _is_widget(spec: list) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _input_specs(info: dict) -> list[tuple[str, list]]:
    """(name, spec) for every input of a node, in the order the page lays out its widgets."""
    inputs = info["input"]
    order = info.get("input_order") or {section: list(inputs.get(section, {})) for section in ("required", "optional")}
    specs = []
    for section in ("required", "optional"):
        for name in order.get(section, []):
            specs.append((name, inputs[section][name]))
    return specs


def ui_graph_to_api(ui: dict, object_info: dict) -> dict:
    """Read a saved UI graph into the API prompt it stands for, as the page would (no frontend code used).

    Widget values are positional in the node's input order; a widget with `control_after_generate`
    carries one extra value (the control mode) that is not an input. Raises AssertionError on anything
    the page would not accept: an unknown node type, a link into an input of another type, a wrong
    number of widget values.
    """
    links = {link[0]: link for link in ui["links"]}
    prompt: dict = {}
    for node in ui["nodes"]:
        if node["type"] in VIRTUAL_NODE_TYPES or node.get("mode", 0) in (2, 4):  # muted / bypassed
            continue
        assert node["type"] in object_info, f"node type {node['type']} is missing from /object_info"
        info = object_info[node["type"]]
        specs = _input_specs(info)
        linked = {}
        for socket in node.get("inputs", []):
            if socket.get("link") is None:
                continue
            _, src, src_slot, dst, _, link_type = links[socket["link"]]
            assert dst == node["id"], f"link {socket['link']} does not end at node {node['id']}"
            src_node = next(n for n in ui["nodes"] if n["id"] == src)
            src_type = object_info[src_node["type"]]["output"][src_slot]
            spec = dict(specs)[socket["name"]]
            wanted = "COMBO" if isinstance(spec[0], list) else spec[0]
            assert link_type == src_type, f"link {socket['link']} says {link_type}, source gives {src_type}"
            assert wanted in (src_type, "*") or src_type == "*", (
                f"{node['type']}.{socket['name']} takes {wanted}, linked to a {src_type} output")
            linked[socket["name"]] = [str(src), src_slot]
        values = list(node.get("widgets_values", []))
        inputs = {}
        for name, spec in specs:
            if not _is_widget(spec):
                continue
            assert values, f"{node['type']} (node {node['id']}): no widget value left for {name}"
            inputs[name] = values.pop(0)
            if len(spec) > 1 and spec[1].get("control_after_generate"):
                control = values.pop(0)
                assert control in ("fixed", "increment", "decrement", "randomize"), control
        assert not values, f"{node['type']} (node {node['id']}): {len(values)} widget values left over: {values}"
        for name, spec in specs:
            required = name in info["input"].get("required", {})
            if required and not _is_widget(spec):
                assert name in linked, f"{node['type']} (node {node['id']}): required input {name} is not linked"
        inputs.update(linked)
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def strip_meta(prompt: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def widget_problems(prompt: dict, object_info: dict) -> list[str]:
    """Values the server's validation would reject: combo values not offered, numbers out of range."""
    problems = []
    for node_id, node in prompt.items():
        info = object_info[node["class_type"]]
        specs = dict(_input_specs(info))
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                continue
            spec = specs[name]
            options = spec[1] if len(spec) > 1 else {}
            choices = spec[0] if isinstance(spec[0], list) else options.get("options") if spec[0] == "COMBO" else None
            if choices is not None and value not in choices:
                problems.append(f"node {node_id} {node['class_type']}.{name}={value!r} not in {choices[:8]}")
            if spec[0] in ("INT", "FLOAT"):
                if "min" in options and value < options["min"] or "max" in options and value > options["max"]:
                    problems.append(f"node {node_id} {node['class_type']}.{name}={value} outside "
                                    f"[{options.get('min')}, {options.get('max')}]")
    return problems


def release_models_unless_sd15(server, name: str) -> None:
    """Drop the SDXL / SD3 models and the execution cache after their workflow (POST /free), so one server
    session never holds three model families at once on a 24 GB machine. SD1.5 stays: most tests share it."""
    if not name.startswith("sd15"):
        response = requests.post(f"{server.url}/free", json={"unload_models": True, "free_memory": True}, timeout=30)
        assert response.status_code == 200


# --- the INT8 report, as Preview as Text shows it --------------------------------------------------------
SUMMARY_RE = re.compile(r"summary: (\d+)/(\d+) layers in INT8 \(linear (\d+)/(\d+), conv (\d+)/(\d+)\)")
LATENT_RE = re.compile(r"INT8 calibration on latent \[([\d, ]+)\]")
PENDING = "INT8 calibration pending"


@dataclass(frozen=True)
class Int8Summary:
    int8: int
    total: int
    linear: tuple[int, int]
    conv: tuple[int, int]
    latent: tuple[int, ...]
    text: str
    history: dict = field(default_factory=dict, compare=False, repr=False)  # the run that showed it

    def __str__(self) -> str:
        return (f"{self.int8}/{self.total} layers in INT8 (linear {self.linear[0]}/{self.linear[1]}, conv "
                f"{self.conv[0]}/{self.conv[1]}) on latent {list(self.latent)}")


def parse_int8_report(text: str) -> Int8Summary | None:
    """The summary of a calibration report (the node's report output), or None when it has none."""
    summary, latent = SUMMARY_RE.search(text), LATENT_RE.search(text)
    if summary is None or latent is None:
        return None
    n = [int(g) for g in summary.groups()]
    return Int8Summary(n[0], n[1], (n[2], n[3]), (n[4], n[5]),
                       tuple(int(d) for d in latent.group(1).split(",")), text)


def report_table_rows(text: str) -> dict[str, list[str]]:
    """{layer name: its cells} from the report's markdown table (header and rule rows left out)."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1 and cells[0] != "layer" and not set(cells[0]) <= set("-:"):
            rows[cells[0]] = cells
    return rows


def node_of(prompt: dict, class_type: str) -> str:
    ids = [k for k, v in prompt.items() if v["class_type"] == class_type]
    assert len(ids) == 1, f"expected one {class_type}, found {ids}"
    return ids[0]


def report_preview(prompt: dict) -> str:
    """Id of the Preview as Text node showing the Quantize node's report (its output slot 1)."""
    quant = node_of(prompt, "Int8AccelQuantize")
    ids = [k for k, v in prompt.items() if v["class_type"] == "PreviewAny" and v["inputs"].get("source") == [quant, 1]]
    assert len(ids) == 1, f"the Quantize node's report (node {quant}, slot 1) is not shown by one PreviewAny: {ids}"
    return ids[0]


def with_report_preview(prompt: dict, node_id: str = "90") -> dict:
    """`prompt` plus a Preview as Text on the Quantize node's report (what the shipped workflows have)."""
    prompt = copy.deepcopy(prompt)
    prompt[node_id] = {"class_type": "PreviewAny", "inputs": {"source": [node_of(prompt, "Int8AccelQuantize"), 1]}}
    return prompt


def latent_hw(prompt: dict) -> tuple[int, int]:
    """(height, width) of the latent the prompt samples (image size / 8)."""
    latent = next(v["inputs"] for v in prompt.values() if v["class_type"] in LATENT_NODE_TYPES)
    return latent["height"] // 8, latent["width"] // 8


def save_nodes(prompt: dict) -> list[str]:
    """Ids of the nodes that write the prompt's pictures or videos."""
    return [k for k, v in prompt.items() if v["class_type"] in SAVE_NODE_TYPES]


def frames(path: Path) -> list:
    """Every frame of a saved picture (one) or animated WebP, as RGB int16 arrays."""
    import numpy as np
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return [np.asarray(frame.convert("RGB"), dtype=np.int16) for frame in ImageSequence.Iterator(image)]


def int8_report(server, prompt: dict, history: dict | None = None, *, log_from: int | None = None,
                from_log: bool = True, timeout: float = 600) -> Int8Summary:
    """The INT8 summary for `prompt` (whose Quantize report feeds a Preview as Text, as in the workflows).

    `history` is a finished run of `prompt` whose server log began at byte `log_from`; without it, the
    prompt is queued here. The node writes its report before sampling: the first run of new settings shows
    'calibration pending', and calibration then runs on the first step and logs the full report. That log
    is read when `from_log` (it saves a run); otherwise, or when the log has no report, the same prompt is
    queued again, which re-runs the node (its IS_CHANGED moves once a new report exists) so that Preview as
    Text shows the table and the summary. Either way the report must be about the latent this prompt samples
    (the node keeps one report per model and settings, whatever the size)."""
    preview = report_preview(prompt)
    for attempt in range(3):
        if history is None:
            log_from = server.log_path.stat().st_size
            result = server.run(prompt, timeout=timeout)
            history = result["history"]
            assert history.get("status", {}).get("status_str") == "success", (
                f"{json.dumps(history.get('status'))[:3000]}\n{server.log_tail()}")
        if preview not in history["outputs"]:
            # A prompt queued without a client_id (as the README's curl does) gets no history output for a node
            # ComfyUI served from its cache; queueing it again with one (server.run) does.
            assert attempt < 2, f"Preview as Text {preview} has no output: {json.dumps(history)[:3000]}"
            history = None
            continue
        text = history["outputs"][preview]["text"][0]
        summary = parse_int8_report(text)
        if summary is None:
            assert text.startswith(PENDING), f"neither a report nor 'calibration pending': {text[:500]}"
            if from_log and log_from is not None:
                with open(server.log_path, "rb") as log:
                    log.seek(log_from)
                    summary = parse_int8_report(log.read().decode(errors="replace"))
        if summary is not None:
            assert summary.latent[-2:] == latent_hw(prompt), (
                f"the report is about latent {list(summary.latent)}, the prompt samples {latent_hw(prompt)}")
            return replace(summary, history=history)
        assert attempt < 2, f"still no INT8 summary after queueing the prompt again: {text[:500]}"
        history = None
    raise AssertionError("unreachable")


def without_quantize(prompt: dict) -> dict:
    """The float baseline of `prompt`: the Quantize node, its report preview and any Save INT8 Model (a float
    model has no INT8 layers to save) removed, its consumers fed the model it was given; saved images get a
    `_float` prefix. Same seed, sampler and everything else."""
    prompt = copy.deepcopy(prompt)
    quant = node_of(prompt, "Int8AccelQuantize")
    source = prompt.pop(quant)["inputs"]["model"]
    for node_id, node in list(prompt.items()):
        if node["class_type"] == "Int8AccelSaveModel" or any(value in ([quant, 1], [quant, 2])
                                                             for value in node["inputs"].values()):
            del prompt[node_id]
            continue
        for name, value in node["inputs"].items():
            if value == [quant, 0]:
                node["inputs"][name] = list(source)
        if node["class_type"] in SAVE_NODE_TYPES:
            node["inputs"]["filename_prefix"] += "_float"
    return prompt


FLOAT_IMAGES: dict[str, list] = {}  # this session's float runs, by prompt (the names images are saved under aside)


def float_images(server, prompt: dict) -> list:
    """Images of the float run of `prompt` (`without_quantize`), run once per session for prompts that sample
    alike (sd15_int8_txt2img and sd15_int8_save differ only in what they save)."""
    baseline = without_quantize(prompt)
    key = json.dumps({node_id: {**node, "inputs": {k: v for k, v in node["inputs"].items() if k != "filename_prefix"}}
                      for node_id, node in strip_meta(baseline).items()}, sort_keys=True)
    if key not in FLOAT_IMAGES or not all(path.is_file() for path in FLOAT_IMAGES[key]):
        history = server.run(baseline, timeout=600)["history"]
        assert history["status"]["status_str"] == "success", history["status"]
        FLOAT_IMAGES[key] = server.output_images(history)
    return FLOAT_IMAGES[key]


def assert_images_changed_by_int8(server, name: str, prompt: dict, history: dict, artifact: str) -> None:
    """The run `history` of shipped workflow `name` saved one file per save node at the latent's size (the
    comparison workflow: both halves side by side, which differ; the Wan workflow: an animated WebP), kept as
    test-artifacts/`artifact`_`name`.png, and each differs from the float run of the same prompt: its INT8
    layers changed the picture, so they ran."""
    from PIL import Image

    images = server.output_images(history)
    saving = save_nodes(prompt)
    assert set(history["outputs"]) >= set(saving)
    assert len(images) == len(saving) >= 1, (name, images)
    latent = next(v["inputs"] for v in prompt.values() if v["class_type"] in LATENT_NODE_TYPES)
    compare = name.startswith("sd15_compare")
    width = latent["width"] * 2 + 8 if compare else latent["width"]  # Image Stitch's spacing
    ARTIFACTS.mkdir(exist_ok=True)
    for path in images:
        with Image.open(path) as image:
            assert image.size == (width, latent["height"]), (name, image.size)
            image.save(ARTIFACTS / f"{artifact}_{name}.png")
            if compare:
                left = image.crop((0, 0, latent["width"], latent["height"])).tobytes()
                right = image.crop((width - latent["width"], 0, width, latent["height"])).tobytes()
                assert left != right, "the accelerated half equals the baseline: the pack nodes did nothing"
    baseline = float_images(server, prompt)
    assert len(baseline) == len(images)
    for int8_path, float_path in zip(sorted(images), sorted(baseline), strict=True):
        a, b = frames(int8_path), frames(float_path)
        assert [f.shape for f in a] == [f.shape for f in b]
        assert any((x != y).any() for x, y in zip(a, b, strict=True)), (
            f"{name}: the image equals the float run's: INT8 changed nothing")
