"""The shipped workflows in the real ComfyUI page, in headless Chromium driven by Playwright.

Debian's chromium is used (scripts/setup_browser.sh installs it and Playwright for Python; no browser is
ever downloaded). Screenshots go to test-artifacts/; UPDATE_DOCS_SCREENSHOT=1 also refreshes the README's
docs/workflow-screenshot.png. The page loads each UI graph, must know every node type and keep every widget value,
turns the graph into exactly the shipped API prompt (plus the display-only text box of Preview as Text, which
no node takes), queues it itself, and the run ends with an image (for the Wan workflow an animated WebP) that the
float run of the same prompt does not give, and the INT8 report shown in the page (for the INT8 load workflow,
which has no Quantize node: its layers loaded as resident INT8). These are the server runs of the shipped API
prompts; tests/test_workflows.py queues the txt2img one with the documented curl command. The save workflow runs
before the load workflow, which reads the file it wrote, as a user does (refreshing the page's file lists).

These tests never skip silently: when chromium or Playwright is missing and scripts/setup_browser.sh cannot
install them, or chromium does not start, they fail. INT8_ACCEL_SKIP_BROWSER=1 is the one explicit opt-out
(e.g. on a machine without apt): the tests are then skipped with that reason in pytest's -ra summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.support.workflows_common import (  # noqa: F401  (int8_save_session, workflow_checkpoints: fixtures)
    ARTIFACTS,
    INT8_LOAD,
    INT8_SAVE,
    PENDING,
    REPO_ROOT,
    VIRTUAL_NODE_TYPES,
    assert_images_changed_by_int8,
    in_run_order,
    int8_save_session,
    load_api,
    load_ui,
    node_of,
    parse_int8_report,
    release_models_unless_sd15,
    report_preview,
    report_table_rows,
    resident_int8_logged,
    save_nodes,
    strip_meta,
    workflow_checkpoints,
    workflow_names,
)

pytestmark = pytest.mark.browser
NAMES = workflow_names()
SKIP_ENV = "INT8_ACCEL_SKIP_BROWSER"
# Inputs the page sends that are no input of the node (not in /object_info; the server ignores them): the
# read-only text box the page adds to Preview as Text, sent with whatever it shows ('' on a fresh graph).
DISPLAY_ONLY_INPUTS = {"PreviewAny": {"preview"}}
PROGRESS_TEXT = 3  # ComfyUI's binary websocket event for a node's progress text (BinaryEventTypes.TEXT)
SCREENSHOT_WORKFLOW = "sd15_compare_baseline_vs_accelerated"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions"]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of Debian's chromium, installed with Playwright by scripts/setup_browser.sh when missing.

    Fails (never skips) when they cannot be installed, unless INT8_ACCEL_SKIP_BROWSER=1 asks to skip."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: browser tests skipped on request")

    def playwright_ok() -> bool:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            return False
        return True

    if shutil.which("chromium") is None or not playwright_ok():
        result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup_browser.sh")], capture_output=True,
                                text=True, timeout=900, env={**os.environ, "PY": sys.executable})
        if shutil.which("chromium") is None or not playwright_ok():
            pytest.fail(f"chromium or Playwright is missing and scripts/setup_browser.sh could not install them "
                        f"(exit {result.returncode}): {result.stderr.strip()[-1500:]}\n"
                        f"Install them, or set {SKIP_ENV}=1 to skip the browser tests explicitly.", pytrace=False)
    return shutil.which("chromium")


def _text_frames(frames: list[tuple[str, str]]):
    """A websocket frame handler keeping (node id, text) of every progress-text event the page receives."""
    def on_frame(payload) -> None:
        if isinstance(payload, (bytes, bytearray)) and len(payload) > 8:
            if int.from_bytes(payload[:4], "big") == PROGRESS_TEXT:
                length = int.from_bytes(payload[4:8], "big")
                frames.append((payload[8:8 + length].decode(), payload[8 + length:].decode(errors="replace")))
    return on_frame


@pytest.fixture(scope="module")
def page(chromium, server, request):
    from playwright.sync_api import sync_playwright

    request.getfixturevalue("workflow_checkpoints")

    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        try:
            context = playwright.chromium.launch_persistent_context(
                profile, executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1600, "height": 1000})
        except Exception as exc:  # noqa: BLE001 - any launch failure means the browser set-up is unusable
            pytest.fail(f"chromium ({chromium}) does not start under Playwright: {exc}\n"
                        f"Fix the browser set-up (scripts/setup_browser.sh), or set {SKIP_ENV}=1 to skip the "
                        "browser tests explicitly.", pytrace=False)
        try:
            page = context.pages[0] if context.pages else context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.progress_texts = []
            page.on("websocket", lambda ws: ws.on("framereceived", _text_frames(page.progress_texts)))
            _open_app(page, server.url)
            page.page_errors = errors
            yield page
        finally:
            context.close()


def _node_inputs_only(prompt: dict, object_info: dict) -> dict:
    """The page's prompt without display-only inputs; any other input the node does not take fails."""
    out = {}
    for node_id, node in strip_meta(prompt).items():
        spec = object_info[node["class_type"]]["input"]
        extra = set(node["inputs"]) - set(spec.get("required", {})) - set(spec.get("optional", {}))
        assert extra <= DISPLAY_ONLY_INPUTS.get(node["class_type"], set()), (
            f"node {node_id} ({node['class_type']}): the page sends inputs the node does not take: {extra}")
        out[node_id] = {"class_type": node["class_type"],
                        "inputs": {k: v for k, v in node["inputs"].items() if k not in extra}}
    return out


def _open_app(page, url: str) -> None:
    page.goto(url)
    page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph && window.app.extensionManager",
                           timeout=120_000)
    # A first visit opens the templates browser on top of the canvas, and a banner advertises the new node
    # renderer: mark the tour done and the banner dismissed, as a returning user has them, and start clean.
    page.evaluate("async () => { await window.app.extensionManager.setting.set('Comfy.TutorialCompleted', true);"
                  " localStorage.setItem('vueNodesBannerDismissed', 'true'); }")
    page.reload()
    page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph", timeout=120_000)
    page.wait_for_timeout(1000)


def test_page_offers_the_workflows_in_its_templates_browser(page, server):
    from harness.pack_link import LINK_NAME

    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    dialog = page.locator("[role=dialog]")
    dialog.get_by_text(LINK_NAME).first.click(timeout=30_000)
    for name in NAMES:
        assert dialog.get_by_text(name, exact=True).count() >= 1, f"{name} not in the templates browser"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser_templates.png"))
    # Open one the way a user does, by clicking its card: the page fetches and loads the file.
    dialog.get_by_text("sd15_int8_txt2img", exact=True).first.click()
    page.wait_for_function("() => window.app.graph.nodes.some(n => n.type === 'Int8AccelQuantize')", timeout=30_000)
    assert page.locator("[role=dialog]").count() == 0
    assert page.evaluate("() => window.app.graph.nodes.length") == len(load_ui("sd15_int8_txt2img")["nodes"])
    _open_app(page, server.url)


@pytest.mark.parametrize("name", in_run_order(NAMES))
def test_page_loads_converts_and_queues_the_shipped_workflow(page, server, int8_save_session, name):  # noqa: F811
    ui = load_ui(name)
    if name == INT8_LOAD:
        int8_save_session.ensure()  # the file it loads: written by the save workflow's run just before
    state = page.evaluate(
        """async ([graph, name, refresh]) => {
            // After a save, the page's file lists are refreshed (the R key) to offer the new file.
            if (refresh) await window.app.refreshComboInNodes();
            await window.app.loadGraphData(graph, true, true, name);
            await new Promise(r => setTimeout(r, 500));
            const nodes = window.app.graph.nodes.map(n => ({
                id: n.id, type: n.type, has_errors: !!n.has_errors,
                registered: !!window.LiteGraph.registered_node_types[n.type],
                widgets_values: n.serialize().widgets_values || [],
                widgets: (n.widgets || []).map(w => ({name: w.name, type: w.type, value: w.value,
                    values: Array.isArray(w.options?.values) ? w.options.values : null,
                    min: w.options?.min, max: w.options?.max})),
            }));
            const dialogs = [...document.querySelectorAll('[role=dialog]')].map(d => d.innerText);
            const prompt = await window.app.graphToPrompt();
            return {nodes, dialogs, prompt: prompt.output};
        }""", [ui, name, name == INT8_LOAD])

    missing = [n["type"] for n in state["nodes"] if not n["registered"] or n["has_errors"]]
    assert missing == [], f"{name}: node types the page does not know: {missing}"
    assert state["dialogs"] == [], f"{name}: the page opened a dialog on load: {state['dialogs']}"
    assert sorted(n["id"] for n in state["nodes"]) == sorted(n["id"] for n in ui["nodes"])
    by_id = {n["id"]: n for n in ui["nodes"]}
    for node in state["nodes"]:
        assert node["widgets_values"] == by_id[node["id"]]["widgets_values"], (
            f"{name}: the page changed the widget values of node {node['id']} ({node['type']})")
        for widget in node["widgets"]:
            if widget["values"] is not None:
                assert widget["value"] in widget["values"], f"{name}: {node['type']}.{widget['name']} rejected"
            if isinstance(widget["value"], (int, float)) and widget["min"] is not None:
                assert widget["min"] <= widget["value"] <= widget["max"], f"{name}: {node['type']}.{widget['name']}"
    assert _node_inputs_only(state["prompt"], server.object_info()) == strip_meta(load_api(name)), (
        f"{name}: the page's prompt differs from workflows/api/{name}.json")
    assert not any(n["class_type"] in VIRTUAL_NODE_TYPES for n in state["prompt"].values())

    # Queue it the way the Queue button does, and read the prompt id off the page's own POST /prompt.
    if name == INT8_SAVE:
        int8_save_session.prepare()  # so that it writes the file the load workflow names, as on a fresh ComfyUI
    log_from = server.log_path.stat().st_size
    page.progress_texts.clear()
    with page.expect_response(lambda r: r.url.endswith("/api/prompt") and r.request.method == "POST") as posted:
        page.evaluate("() => window.app.queuePrompt(0, 1)")
    response = posted.value
    body = response.json()
    assert response.status == 200 and not body.get("node_errors"), json.dumps(body)[:2000]
    start = time.time()
    result = server.wait(body["prompt_id"], timeout=600)
    status = result["history"].get("status", {})
    assert status.get("status_str") == "success", f"{name}: {json.dumps(status)[:3000]}\n{server.log_tail()}"
    images = server.output_images(result["history"])
    assert images and all(p.is_file() for p in images)
    save_ids = save_nodes(load_api(name))
    # The page received the result and shows it on the Save Image node.
    page.wait_for_function(
        "(ids) => ids.every(id => { const n = window.app.graph.getNodeById(Number(id));"
        " return n && n.imgs && n.imgs.length > 0 && n.imgs[0].complete; })", arg=save_ids, timeout=60_000)
    if name == INT8_SAVE:
        int8_save_session.record(result["history"], log_from)
    api = load_api(name)
    if name == INT8_LOAD:
        resident = resident_int8_logged(server, log_from)
        assert len(resident) == 1 and sum(resident[0]) > 0, f"{name}: no layer loaded as resident INT8: {resident}"
    else:
        history = _assert_report_shown(page, server, name, api, result["history"])
        _assert_report_readable_and_picture_shown(page, name, api, history)
        _screenshot_report(page, name, api)
        if name != INT8_SAVE:  # the save run's picture is compared with float beside the load workflow's
            assert_images_changed_by_int8(server, name, api, result["history"], "page")
    assert page.page_errors == [], page.page_errors
    print(f"{name}: ran from the page in {time.time() - start:.1f} s")
    release_models_unless_sd15(server, name)

    ARTIFACTS.mkdir(exist_ok=True)
    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.Canvas.FitView')")
    page.wait_for_timeout(800)
    shot = ARTIFACTS / f"browser_{name}.png"
    page.screenshot(path=str(shot))
    readme_shot = REPO_ROOT / "docs" / "workflow-screenshot.png"
    # The README's picture is refreshed on request only, so a test run does not dirty a tracked file.
    if name == SCREENSHOT_WORKFLOW and (os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1" or not readme_shot.exists()):
        readme_shot.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, readme_shot)


def _assert_report_shown(page, server, name: str, api: dict, history: dict) -> dict:
    """The INT8 report is shown in the page by Preview as Text, as the run left it in /history: a table with
    layers in INT8, or 'calibration pending' when this run calibrated, whose summary then reached the
    Quantize node as progress text; the prompt is then queued again, as a person does, for the full report.
    Returns the history of the run whose report the page shows."""
    preview_id, quant_id = report_preview(api), node_of(api, "Int8AccelQuantize")
    report = history["outputs"][preview_id]["text"][0]
    if report.startswith(PENDING):
        _assert_preview_text(page, name, preview_id, report)
        summaries = [text for node, text in page.progress_texts if node == quant_id and "layers in INT8" in text]
        assert summaries, f"{name}: calibration ran, but no summary reached the Quantize node: {page.progress_texts}"
        assert int(summaries[-1].split("summary: ")[1].split("/")[0]) > 0, summaries[-1]
        with page.expect_response(lambda r: r.url.endswith("/api/prompt") and r.request.method == "POST") as posted:
            page.evaluate("() => window.app.queuePrompt(0, 1)")
        result = server.wait(posted.value.json()["prompt_id"], timeout=600)
        assert result["history"].get("status", {}).get("status_str") == "success", name
        history = result["history"]
        report = history["outputs"][preview_id]["text"][0]
    assert not report.startswith(PENDING), f"{name}: still pending after a second run: {report[:300]}"
    _assert_preview_text(page, name, preview_id, report)
    summary = parse_int8_report(report)
    assert summary is not None and summary.int8 > 0, f"{name}: {report[-2000:]}"
    return history


def _assert_preview_text(page, name: str, preview_id: str, report: str) -> None:
    """Preview as Text shows `report`, the text the run returned."""
    current = ("(id) => { const n = window.app.graph.getNodeById(Number(id));"
               " const w = n && (n.widgets || []).find(w => w.name === 'preview'); return w ? w.value : null; }")
    try:
        page.wait_for_function(f"([id, report]) => ({current})(id) === report", arg=[preview_id, report],
                               timeout=60_000)
    except Exception:  # noqa: BLE001 - timed out: say what the page shows instead
        shown = page.evaluate(current, preview_id) or ""
        pytest.fail(f"{name}: the page shows {shown[:300]!r}, the run returned {report[:300]!r}")


def _assert_report_readable_and_picture_shown(page, name: str, api: dict, history: dict) -> None:
    """What a person sees: the report node's rendered text begins with the summary line and keeps the per-layer
    table as table rows (one per layer, not one run-on paragraph), and Preview Image displays the decision
    picture the run returned."""
    preview_id, quant_id = report_preview(api), node_of(api, "Int8AccelQuantize")
    report = history["outputs"][preview_id]["text"][0]
    dom = page.evaluate(
        """(id) => { const n = window.app.graph.getNodeById(Number(id));
            const el = n.widgets.find(w => w.name === 'preview').element.querySelector('.ProseMirror');
            const rows = [...el.querySelectorAll('table tr')];
            return {first: el.firstElementChild.innerText, paragraphs: el.querySelectorAll('p').length,
                    rows: rows.map(r => [...r.querySelectorAll('td, th')].map(c => c.innerText.trim()))}; }""",
        preview_id)
    assert dom["first"].startswith("summary: ") and dom["first"] == report.split("\n")[0], (name, dom["first"])
    layers = report_table_rows(report)
    assert dom["rows"][0][0] == "layer" and len(dom["rows"]) == len(layers) + 1, (name, len(dom["rows"]))
    assert {row[0]: row for row in dom["rows"][1:]} == layers, name
    assert dom["paragraphs"] >= 3, (name, dom["paragraphs"])  # summary and details stay separate paragraphs
    picture_id = next(k for k, v in api.items() if v["class_type"] == "PreviewImage"
                      and v["inputs"]["images"] == [quant_id, 2])
    assert history["outputs"][picture_id]["images"], f"{name}: the run returned no decision picture"
    size = page.wait_for_function(
        "(id) => { const n = window.app.graph.getNodeById(Number(id));"
        " return n && n.imgs && n.imgs.length && n.imgs[0].complete && n.imgs[0].naturalWidth"
        " ? [n.imgs[0].naturalWidth, n.imgs[0].naturalHeight] : null; }", arg=picture_id, timeout=60_000).json_value()
    assert size == [768, 512], (name, size)


def _screenshot_report(page, name: str, api: dict) -> None:
    """browser_<name>_report.png: the canvas at full scale on the report and the picture, as a person reads them;
    the README's docs/int8-report-screenshot.png comes from SCREENSHOT_WORKFLOW's (refreshed on request)."""
    preview_id = report_preview(api)
    page.evaluate(
        """(id) => { const n = window.app.graph.getNodeById(Number(id)); const ds = window.app.canvas.ds;
            ds.scale = 1; ds.offset = [80 - n.pos[0], 140 - n.pos[1]]; window.app.canvas.setDirty(true, true); }""",
        preview_id)
    page.wait_for_timeout(800)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"browser_{name}_report.png"
    page.screenshot(path=str(shot))
    readme_shot = REPO_ROOT / "docs" / "int8-report-screenshot.png"
    if name == SCREENSHOT_WORKFLOW and (os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1" or not readme_shot.exists()):
        shutil.copyfile(shot, readme_shot)
