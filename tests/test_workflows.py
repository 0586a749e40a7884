"""The shipped workflows: both forms agree, the documented curl command runs the txt2img prompt on the real
server with layers really in INT8 (its report, shown by Preview as Text, says how many) and an image that differs
from the float run's (the page tests run every other prompt so), the INT8 file the save workflow writes loads in
the load workflow and gives the save run's image, the Wan workflow's DeepCache caches steps of the Wan model and
changes its video only a little, and the page lists them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from PIL import Image

from tests.support.workflows_common import (  # noqa: F401  (the int8_* and workflow_checkpoints fixtures)
    ARTIFACTS,
    INT8_LOAD,
    INT8_SAVE,
    REPO_ROOT,
    VIRTUAL_NODE_TYPES,
    WORKFLOWS,
    assert_images_changed_by_int8,
    float_images,
    frames,
    int8_file,
    int8_file_name,
    int8_report,
    int8_save_session,
    load_api,
    load_ui,
    node_of,
    release_models_unless_sd15,
    report_preview,
    resident_int8_logged,
    save_nodes,
    strip_meta,
    ui_graph_to_api,
    widget_problems,
    without_quantize,
    workflow_checkpoints,
    workflow_names,
)

NAMES = workflow_names()
WAN = "wan21_deepcache_t2v"
TXT2IMG = "sd15_int8_txt2img"  # the workflow docs/workflows.md queues with curl
# Workflows that quantize on the fly and nothing else (the save/load pair runs as a pair below) go through the page
# (tests/test_browser.py); queued with curl: the documented one, or all of them when the browser tests are opted out.
ON_THE_FLY = [name for name in NAMES if name not in (INT8_SAVE, INT8_LOAD)]
CURL_RUNS = ON_THE_FLY if os.environ.get("INT8_ACCEL_SKIP_BROWSER") == "1" else [TXT2IMG]
PACK_NODES = {"Int8AccelQuantize", "Int8AccelDeepCache", "Int8AccelCompile", "Int8AccelSaveModel",
              "Int8AccelLoadModel"}


def test_each_ui_workflow_has_an_api_twin_a_note_and_the_page_format():
    assert len(NAMES) == 8 and {INT8_SAVE, INT8_LOAD, WAN} < set(NAMES), NAMES
    assert sorted(p.stem for p in (WORKFLOWS / "api").glob("*.json")) == NAMES
    used = set()
    for name in NAMES:
        ui = load_ui(name)
        assert ui["version"] == 0.4
        assert {"last_node_id", "last_link_id", "nodes", "links", "groups", "config", "extra"} <= set(ui)
        assert ui["last_node_id"] == max(n["id"] for n in ui["nodes"])
        assert ui["last_link_id"] == max(link[0] for link in ui["links"])
        notes = [n for n in ui["nodes"] if n["type"] == "MarkdownNote"]
        assert len(notes) == 1 and len(notes[0]["widgets_values"][0]) > 200, f"{name}: needs one explaining Note"
        used |= {n["type"] for n in ui["nodes"]}
        # links: [id, from_node, from_slot, to_node, to_slot, type], mirrored on both ends
        by_id = {n["id"]: n for n in ui["nodes"]}
        for link_id, src, src_slot, dst, dst_slot, _ in ui["links"]:
            assert link_id in by_id[src]["outputs"][src_slot]["links"]
            assert by_id[dst]["inputs"][dst_slot]["link"] == link_id
    assert PACK_NODES <= used, "every pack node appears in some shipped workflow"


def test_every_quantize_node_shows_its_report_and_quantizes_at_the_workflow_size():
    """A person sees the report in the page (Preview as Text on the report output, in both forms), and the
    settings are ones under which layers reach INT8 at the workflow's size: the node's default density
    threshold (300) admits almost no layer at CPU-sized images, so no shipped workflow may use it. The load
    workflow is the one without: its INT8 layers come from the file."""
    for name in NAMES:
        api, ui = load_api(name), load_ui(name)
        quants = [k for k, v in api.items() if v["class_type"] == "Int8AccelQuantize"]
        if name == INT8_LOAD:
            assert quants == [] and node_of(api, "Int8AccelLoadModel"), name
            continue
        assert len(quants) == 1, name
        preview = report_preview(api)
        ui_links = {link[0]: link for link in ui["links"]}
        ui_preview = next(n for n in ui["nodes"] if str(n["id"]) == preview)
        assert ui_preview["type"] == "PreviewAny"
        _, src, src_slot, _, _, link_type = ui_links[ui_preview["inputs"][0]["link"]]
        assert (str(src), src_slot, link_type) == (quants[0], 1, "STRING"), name
        pictures = [k for k, v in api.items() if v["class_type"] == "PreviewImage"
                    and v["inputs"]["images"] == [quants[0], 2]]
        assert len(pictures) == 1, f"{name}: the decision picture (Quantize output 2) is not previewed"
        ui_picture = next(n for n in ui["nodes"] if str(n["id"]) == pictures[0])
        assert ui_links[ui_picture["inputs"][0]["link"]][1:3] + [ui_links[ui_picture["inputs"][0]["link"]][5]] == [
            int(quants[0]), 2, "IMAGE"], name
        settings = api[quants[0]]["inputs"]
        assert settings["compute_density_threshold"] < 100, f"{name}: density threshold too high for a CPU size"
        assert settings["conv_mse_threshold"] > 0 and settings["linear_mse_threshold"] > 0, name
        note = next(n for n in ui["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
        assert f"compute_density_threshold {settings['compute_density_threshold']}" in note, (
            f"{name}: the Note must say why these settings")
        assert "layers in INT8" in note and "Preview as Text" in note, name


def test_save_workflow_writes_the_file_the_load_workflow_reads_with_the_same_sampling():
    save, load = load_api(INT8_SAVE), load_api(INT8_LOAD)
    saver = save[node_of(save, "Int8AccelSaveModel")]["inputs"]
    sampler = node_of(save, "KSampler")
    assert saver["model"] == [node_of(save, "Int8AccelQuantize"), 0]
    assert saver["after_sampling"] == [sampler, 0]  # saved after the sampler that calibrates
    assert int8_file_name() == f"{saver['filename_prefix']}_00001_.safetensors"  # a fresh ComfyUI's first file
    assert load[node_of(load, "KSampler")]["inputs"]["model"] == [node_of(load, "Int8AccelLoadModel"), 0]

    def sampling(prompt: dict) -> list:
        """What the picture depends on besides the model: sampler settings, prompts, latent, checkpoint."""
        inputs = prompt[node_of(prompt, "KSampler")]["inputs"]
        settings = {k: v for k, v in inputs.items() if not isinstance(v, list)}
        texts = sorted(v["inputs"]["text"] for v in prompt.values() if v["class_type"] == "CLIPTextEncode")
        latent = prompt[node_of(prompt, "EmptyLatentImage")]["inputs"]
        return [settings, texts, latent, prompt[node_of(prompt, "CheckpointLoaderSimple")]["inputs"]]

    assert sampling(load) == sampling(save)
    note = next(n for n in load_ui(INT8_LOAD)["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
    assert INT8_SAVE in note and int8_file_name() in note, "the load workflow's Note says where its file comes from"


def test_comfyui_runs_the_save_after_the_sampler_only_when_after_sampling_is_linked(pack, monkeypatch):
    """ComfyUI 0.3.75 runs a ready output node first: without the link Save INT8 Model would run before the
    KSampler, which is what calibrates. ComfyUI's own scheduler (ExecutionList) over the shipped prompt."""
    from comfy_execution.graph import DynamicPrompt, ExecutionList
    from comfy_extras.nodes_preview_any import PreviewAny

    import nodes

    monkeypatch.setattr(nodes, "NODE_CLASS_MAPPINGS",
                        {**nodes.NODE_CLASS_MAPPINGS, **pack.NODE_CLASS_MAPPINGS, "PreviewAny": PreviewAny})

    class NothingCached:
        def get(self, node_id):
            return None

    async def execution_order(prompt: dict) -> list[str]:
        execution = ExecutionList(DynamicPrompt(prompt), NothingCached())
        for node_id, node in prompt.items():
            if getattr(nodes.NODE_CLASS_MAPPINGS[node["class_type"]], "OUTPUT_NODE", False):
                execution.add_node(node_id)
        order = []
        while not execution.is_empty():
            node_id, error, _ = await execution.stage_node_execution()
            assert error is None, error
            order.append(prompt[node_id]["class_type"])
            execution.complete_node_execution()
        return order

    def run(prompt: dict) -> list[str]:
        # a thread of its own: the browser tests' Playwright may leave an event loop running on this one
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, execution_order(prompt)).result()

    shipped = strip_meta(load_api(INT8_SAVE))
    order = run(shipped)
    assert order.index("KSampler") < order.index("Int8AccelSaveModel"), order
    unlinked = strip_meta(load_api(INT8_SAVE))
    del unlinked[node_of(unlinked, "Int8AccelSaveModel")]["inputs"]["after_sampling"]
    order = run(unlinked)
    assert order.index("Int8AccelSaveModel") < order.index("KSampler"), order


@pytest.mark.server
def test_server_runs_the_pack_of_this_checkout(server):
    """The server loads this repository's code (its own custom_nodes/ links here), not whichever checkout
    the shared ComfyUI install's custom_nodes/ link points at."""
    assert server.pack_link is not None and server.pack_link.resolve() == REPO_ROOT.resolve()
    assert str(server.pack_link) in server.log_path.read_text(errors="replace")  # "Import times for custom nodes"


def test_api_workflows_name_checkpoints_the_model_factories_make():
    from harness.make_checkpoint import DEFAULT_NAME
    from harness.make_more_checkpoints import CLIP_L_NAME, SD3_NAME, SDXL_VEGA_NAME, WAN21_NAME, WAN21_VAE_NAME

    def named(class_type: str, input_name: str) -> set[str]:
        return {node["inputs"][input_name] for name in NAMES for node in load_api(name).values()
                if node["class_type"] == class_type}

    assert named("CheckpointLoaderSimple", "ckpt_name") == {DEFAULT_NAME, SDXL_VEGA_NAME, SD3_NAME}
    # Wan's three files; the CLIP-L file as SD3's text encoder (it pads CLIP-L to the 4096 Wan's text input takes)
    assert named("UNETLoader", "unet_name") == {WAN21_NAME}
    assert named("VAELoader", "vae_name") == {WAN21_VAE_NAME}
    assert named("CLIPLoader", "clip_name") == {CLIP_L_NAME}
    assert {node["inputs"]["type"] for node in load_api(WAN).values() if node["class_type"] == "CLIPLoader"} == {"sd3"}


@pytest.mark.server
@pytest.mark.usefixtures("workflow_checkpoints", "int8_file")  # the load workflow's file is one of its combo's options
def test_ui_and_api_forms_agree(server):
    info = server.object_info()
    for name in NAMES:
        ui, api = load_ui(name), load_api(name)
        from_ui = ui_graph_to_api(ui, info)
        assert strip_meta(api) == from_ui, f"{name}: UI graph and API prompt differ"
        assert len(from_ui) == sum(n["type"] not in VIRTUAL_NODE_TYPES for n in ui["nodes"])
        assert widget_problems(api, info) == [], name


def _queue_with_curl_as_the_readme_does(server, name: str) -> str:
    command = (f"curl -s -X POST {server.url}/prompt -H 'Content-Type: application/json' "
               f"-d \"{{\\\"prompt\\\": $(cat workflows/api/{name}.json)}}\"")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    # Earlier tests (the page's, other API runs) may have run this very graph on this server: a prompt queued
    # without a client_id then gets no history outputs for the nodes ComfyUI serves from its cache.
    server.drop_cached_outputs()
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    answer = json.loads(done.stdout)
    assert done.returncode == 0 and answer.get("node_errors") == {}, done.stdout[:2000]
    return answer["prompt_id"]


@pytest.mark.server
@pytest.mark.parametrize("name", CURL_RUNS)
@pytest.mark.usefixtures("workflow_checkpoints")
def test_the_documented_curl_command_runs_the_workflow_to_an_image(server, name):
    """docs/workflows.md's curl command, as it stands, queues the shipped API prompt headless (no client id), and
    the run ends with its picture, layers in INT8 and a picture the float run does not give. The page tests
    (tests/test_browser.py) queue every other shipped API prompt, the same JSON, and check their pictures alike;
    with the browser tests opted out, this test queues them all."""
    prompt = load_api(name)
    start = time.time()
    log_from = server.log_path.stat().st_size
    result = server.wait(_queue_with_curl_as_the_readme_does(server, name), timeout=600)
    seconds = time.time() - start
    history = result["history"]
    status = history.get("status", {})
    messages = [m[0] for m in status.get("messages", [])]
    assert status.get("status_str") == "success" and "execution_success" in messages, (
        f"{name}: {json.dumps(status)[:3000]}\n{server.log_tail()}")
    # INT8 really ran: the report counts layers in INT8 at this size (as Preview as Text shows it, or, when
    # this run calibrated and the node said 'pending', as the calibration logged it), and the picture differs
    # from the one of the same prompt without the node.
    summary = int8_report(server, prompt, history, log_from=log_from)
    print(f"{name}: {seconds:.1f} s; {summary}")
    assert summary.int8 > 0, f"{name}: no layer in INT8 at this size:\n{summary.text[-3000:]}"
    assert_images_changed_by_int8(server, name, prompt, history, "api")
    release_models_unless_sd15(server, name)


def _bypassed(prompt: dict, class_type: str) -> dict:
    """`prompt` with its one `class_type` node taken out and its consumers fed that node's model input."""
    prompt = copy.deepcopy(prompt)
    node_id = node_of(prompt, class_type)
    source = prompt.pop(node_id)["inputs"]["model"]
    for node in prompt.values():
        for input_name, value in node["inputs"].items():
            if value == [node_id, 0]:
                node["inputs"][input_name] = list(source)
    return prompt


def _video(server, prompt: dict, prefix: str, seed: int | None = None) -> tuple[list, str]:
    """Frames of `prompt`'s WebP, saved under `prefix`, and the server log its run wrote."""
    prompt = copy.deepcopy(prompt)
    prompt[save_nodes(prompt)[0]]["inputs"]["filename_prefix"] = prefix
    if seed is not None:
        prompt[node_of(prompt, "KSampler")]["inputs"]["seed"] = seed
    log_from = server.log_path.stat().st_size
    history = server.run(prompt, timeout=600)["history"]
    assert history["status"]["status_str"] == "success", f"{json.dumps(history['status'])[:3000]}\n{server.log_tail()}"
    with open(server.log_path, "rb") as log:
        log.seek(log_from)
        logged = log.read().decode(errors="replace")
    (path,) = server.output_images(history)
    return frames(path), logged


@pytest.mark.server
@pytest.mark.usefixtures("workflow_checkpoints")
def test_wan_workflow_caches_steps_of_the_wan_model_and_stays_close_to_the_uncached_video(server):
    """The Wan workflow gives its frames (5 at 64x64), its DeepCache node caches 4 of the 6 steps on the Wan
    model (the summary it logs after sampling), and caching changes the video, but far less than another seed
    does. The comparisons run in float (the Quantize node taken out) so that only DeepCache differs."""
    prompt = load_api(WAN)
    latent = prompt[node_of(prompt, "EmptyHunyuanLatentVideo")]["inputs"]
    steps = prompt[node_of(prompt, "KSampler")]["inputs"]["steps"]
    cache = prompt[node_of(prompt, "Int8AccelDeepCache")]["inputs"]
    full = len(range(0, steps, cache["cache_interval"]))
    summary = (f"DeepCache: {steps} steps, {full} full, {steps - full} cached "
               f"(interval {cache['cache_interval']}, depth {cache['cache_depth']})")
    server.drop_cached_outputs()  # every node runs, so DeepCache logs this run's summary

    shipped, logged = _video(server, prompt, "int8accel/wan21_test_shipped")
    assert len(shipped) == latent["length"] == 5
    assert all(frame.shape == (latent["height"], latent["width"], 3) for frame in shipped)
    assert summary in logged and "6 steps, 2 full, 4 cached" in summary, logged[-3000:]
    assert "Requested to load WAN21" in logged, "the model sampled is not ComfyUI's Wan 2.1 model"

    float_prompt = without_quantize(prompt)
    cached, logged = _video(server, float_prompt, "int8accel/wan21_test_cached")
    assert summary in logged, logged[-3000:]
    uncached, logged = _video(server, _bypassed(float_prompt, "Int8AccelDeepCache"), "int8accel/wan21_test_uncached")
    assert "DeepCache:" not in logged
    other_seed, _ = _video(server, _bypassed(float_prompt, "Int8AccelDeepCache"), "int8accel/wan21_test_seed",
                           seed=prompt[node_of(prompt, "KSampler")]["inputs"]["seed"] + 1)
    by_cache = float(np.mean([np.abs(a - b).mean() for a, b in zip(cached, uncached, strict=True)]))
    by_seed = float(np.mean([np.abs(a - b).mean() for a, b in zip(other_seed, uncached, strict=True)]))
    print(f"{WAN}: mean |cached - uncached| {by_cache:.3f}, |other seed - uncached| {by_seed:.3f} (of 255)")
    assert by_cache > 0, "DeepCache left the video unchanged: nothing was cached"
    assert by_cache < 0.25 * by_seed, "DeepCache changed the video as much as another seed does"
    release_models_unless_sd15(server, WAN)


def _pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


@pytest.mark.server
def test_int8_file_workflows_save_then_load_the_same_image(server, int8_file):  # noqa: F811 (a fixture)
    """The save workflow (its run of this session: `int8_file`) wrote the INT8 file with the layers its report
    chose; the load workflow, queued as the README does, loads them as resident INT8 and, with the same seed and
    the same kernels, gives the save run's picture, unlike the float model's."""
    from safetensors import safe_open

    save = load_api(INT8_SAVE)
    summary = int8_report(server, save, int8_file.history, log_from=int8_file.log_from)
    assert summary.int8 > 0, summary.text[-3000:]
    with safe_open(str(int8_file.path), "pt") as stored:
        int8_layers = [key for key in stored.keys() if key.endswith(".comfy_quant")]
    # every layer within the thresholds (the save's default): with the test server's speed gate off, the chosen ones
    assert len(int8_layers) == summary.int8, "the file holds the layers the calibration chose, in INT8"
    (saved_image,) = server.output_images(int8_file.history)

    start = time.time()
    log_from = server.log_path.stat().st_size
    loaded = server.wait(_queue_with_curl_as_the_readme_does(server, INT8_LOAD), timeout=600)["history"]
    seconds = time.time() - start
    assert loaded["status"]["status_str"] == "success", f"{json.dumps(loaded['status'])[:3000]}\n{server.log_tail()}"
    assert resident_int8_logged(server, log_from) == [(summary.linear[0], summary.conv[0])], server.log_tail()
    (loaded_image,) = server.output_images(loaded)

    (float_image,) = float_images(server, save)
    ARTIFACTS.mkdir(exist_ok=True)
    for name, path in ((INT8_SAVE, saved_image), (INT8_LOAD, loaded_image)):
        shutil.copyfile(path, ARTIFACTS / f"api_{name}.png")
    a, b, f = _pixels(loaded_image), _pixels(saved_image), _pixels(float_image)
    assert a.shape == b.shape == f.shape == (128, 128, 3)
    to_saved, to_float = np.abs(a - b).mean(), np.abs(a - f).mean()
    print(f"{INT8_LOAD}: {seconds:.1f} s; {summary}; mean |loaded - saved run| {to_saved:.3f}, "
          f"|loaded - float| {to_float:.3f} (of 255)")
    assert to_float > 0.5, "the loaded model gives the float model's picture: its INT8 layers changed nothing"
    assert to_saved <= 0.01 * to_float, "the loaded INT8 model does not give the picture of the run that saved it"


@pytest.mark.server
def test_workflows_are_listed_and_served_as_templates(server):
    from harness.pack_link import LINK_NAME

    listed = server.get("/workflow_templates").json()
    assert sorted(listed.get(LINK_NAME, [])) == NAMES  # api/ prompts are not offered as templates
    for name in NAMES:
        served = server.get(f"/api/workflow_templates/{LINK_NAME}/{name}.json")
        assert served.status_code == 200
        assert served.json() == load_ui(name)
        thumbnail = server.get(f"/api/workflow_templates/{LINK_NAME}/{name}.jpg")  # the templates card's image
        assert thumbnail.status_code == 200 and thumbnail.content == (WORKFLOWS / f"{name}.jpg").read_bytes()
