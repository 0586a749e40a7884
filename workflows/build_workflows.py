"""Write the shipped example workflows: UI graphs (workflows/*.json) and their API prompts (workflows/api/).

Each workflow is described once below; this script lays it out as the ComfyUI page's graph format
(version 0.4, what "Save" writes and what a user drags in) and as the API prompt that POST /prompt takes.
tests/test_workflows.py checks the two forms against each other with the server's own /object_info, and
tests/test_browser.py checks that the page turns each graph into exactly the shipped API prompt (the page
also sends the text shown by Preview as Text as a `preview` input, which is no input of that node and is
left out here).

Run after editing: .venv/bin/python workflows/build_workflows.py
Thumbnails for the templates browser, from the browser test's screenshots:
    .venv/bin/python workflows/build_workflows.py --thumbnails test-artifacts
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SD15 = "int8accel_random_sd15.safetensors"
SDXL = "int8accel_random_sdxl_vega.safetensors"  # SDXL family, light enough for a CPU
SD3 = "int8accel_random_sd3.safetensors"
# Wan 2.1 loads as three files; these are the random, reduced-size test stand-ins (harness/make_more_checkpoints.py).
WAN21 = "int8accel_random_wan21_t2v.safetensors"
WAN21_VAE = "int8accel_random_wan21_vae.safetensors"
CLIP_L = "int8accel_random_clip_l.safetensors"

# Socket (linked) inputs and outputs of the node types used, in INPUT_TYPES / RETURN_TYPES order.
SOCKETS: dict[str, tuple[list[tuple[str, str]], list[tuple[str, str]]]] = {
    "CheckpointLoaderSimple": ([], [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")]),
    "CLIPTextEncode": ([("clip", "CLIP")], [("CONDITIONING", "CONDITIONING")]),
    "EmptyLatentImage": ([], [("LATENT", "LATENT")]),
    "EmptySD3LatentImage": ([], [("LATENT", "LATENT")]),
    "KSampler": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                  ("latent_image", "LATENT")], [("LATENT", "LATENT")]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [("IMAGE", "IMAGE")]),
    "SaveImage": ([("images", "IMAGE")], []),
    "ImageStitch": ([("image1", "IMAGE"), ("image2", "IMAGE")], [("IMAGE", "IMAGE")]),
    "Int8AccelQuantize": ([("model", "MODEL")], [("MODEL", "MODEL"), ("STRING", "STRING"), ("IMAGE", "IMAGE")]),
    "Int8AccelDeepCache": ([("model", "MODEL")], [("MODEL", "MODEL")]),
    "Int8AccelCompile": ([("model", "MODEL")], [("MODEL", "MODEL")]),
    "Int8AccelSaveModel": ([("model", "MODEL"), ("after_sampling", "LATENT")], []),
    "Int8AccelLoadModel": ([], [("MODEL", "MODEL")]),
    "PreviewAny": ([("source", "*")], []),  # ComfyUI's "Preview as Text": shows the INT8 report in the page
    "PreviewImage": ([("images", "IMAGE")], []),  # shows the INT8 decision picture
    "UNETLoader": ([], [("MODEL", "MODEL")]),
    "CLIPLoader": ([], [("CLIP", "CLIP")]),
    "VAELoader": ([], [("VAE", "VAE")]),
    "ModelSamplingSD3": ([("model", "MODEL")], [("MODEL", "MODEL")]),
    "EmptyHunyuanLatentVideo": ([], [("LATENT", "LATENT")]),
    "SaveAnimatedWEBP": ([("images", "IMAGE")], []),
    "MarkdownNote": ([], []),
}
# Widget names in INPUT_TYPES order (what widgets_values holds, positionally).
WIDGETS: dict[str, list[str]] = {
    "CheckpointLoaderSimple": ["ckpt_name"],
    "CLIPTextEncode": ["text"],
    "EmptyLatentImage": ["width", "height", "batch_size"],
    "EmptySD3LatentImage": ["width", "height", "batch_size"],
    "KSampler": ["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
    "VAEDecode": [],
    "SaveImage": ["filename_prefix"],
    "ImageStitch": ["direction", "match_image_size", "spacing_width", "spacing_color"],
    "Int8AccelQuantize": ["bits", "quantize_conv", "quantize_linear", "conv_mse_threshold", "linear_mse_threshold",
                          "compute_density_threshold"],
    "Int8AccelDeepCache": ["cache_interval", "cache_depth", "start_percent", "end_percent", "mode"],
    "Int8AccelCompile": ["backend", "mode", "dynamic", "fullgraph"],
    "Int8AccelSaveModel": ["filename_prefix", "bake_lora", "int8_layers"],
    "Int8AccelLoadModel": ["unet_name"],
    "PreviewAny": [],  # its text box is filled by the run and not saved
    "PreviewImage": [],
    "UNETLoader": ["unet_name", "weight_dtype"],
    "CLIPLoader": ["clip_name", "type", "device"],  # device: an optional (advanced) widget, saved all the same
    "VAELoader": ["vae_name"],
    "ModelSamplingSD3": ["shift"],
    "EmptyHunyuanLatentVideo": ["width", "height", "length", "batch_size"],
    "SaveAnimatedWEBP": ["filename_prefix", "fps", "lossless", "quality", "method"],
    "MarkdownNote": ["text"],
}
VIRTUAL = {"MarkdownNote"}  # frontend-only nodes: never part of the API prompt

POSITIVE = "a lighthouse on a cliff at sunset, oil painting"
NEGATIVE = "blurry, low quality"


@dataclass
class Node:
    id: int
    type: str
    widgets: dict
    pos: tuple[int, int]
    size: tuple[int, int]
    title: str | None = None
    links_in: dict = field(default_factory=dict)  # input name -> (source Node, output slot)


class Workflow:
    def __init__(self, name: str, title: str) -> None:
        self.name, self.title = name, title
        self.nodes: list[Node] = []
        self.groups: list[dict] = []

    def add(self, type_: str, pos: tuple[int, int], size: tuple[int, int] = (315, 100), title: str | None = None,
            **values) -> Node:
        inputs = {k: v for k, v in values.items() if isinstance(v, tuple)}
        widgets = {k: v for k, v in values.items() if not isinstance(v, tuple)}
        assert list(widgets) == [w for w in WIDGETS[type_] if w in widgets], (type_, list(widgets))
        assert set(widgets) == set(WIDGETS[type_]), (type_, set(WIDGETS[type_]) ^ set(widgets))
        node = Node(len(self.nodes) + 1, type_, widgets, pos, size, title, inputs)
        self.nodes.append(node)
        return node

    def group(self, title: str, bounding: tuple[int, int, int, int], color: str) -> None:
        self.groups.append({"id": len(self.groups) + 1, "title": title, "bounding": list(bounding), "color": color,
                            "font_size": 24, "flags": {}})

    # --- the two formats ------------------------------------------------------------------------
    def ui_graph(self) -> dict:
        links = []
        out_links: dict[tuple[int, int], list[int]] = {}
        in_link: dict[tuple[int, str], int] = {}
        for node in self.nodes:
            socket_names = [name for name, _ in SOCKETS[node.type][0]]
            for input_name, (src, slot) in node.links_in.items():
                link_id = len(links) + 1
                link_type = SOCKETS[src.type][1][slot][1]
                links.append([link_id, src.id, slot, node.id, socket_names.index(input_name), link_type])
                out_links.setdefault((src.id, slot), []).append(link_id)
                in_link[(node.id, input_name)] = link_id
        ui_nodes = []
        for order, node in enumerate(self.nodes):
            widget_values = []
            for widget in WIDGETS[node.type]:
                widget_values.append(node.widgets[widget])
                if node.type == "KSampler" and widget == "seed":
                    widget_values.append("fixed")  # control_after_generate: keep the seed reproducible
            entry = {
                "id": node.id, "type": node.type, "pos": list(node.pos), "size": list(node.size), "flags": {},
                "order": order, "mode": 0,
                "inputs": [{"name": name, "type": type_, "link": in_link.get((node.id, name))}
                           for name, type_ in SOCKETS[node.type][0]],
                "outputs": [{"name": name, "type": type_, "links": out_links.get((node.id, slot), []),
                             "slot_index": slot} for slot, (name, type_) in enumerate(SOCKETS[node.type][1])],
                "properties": {} if node.type in VIRTUAL else {"Node name for S&R": node.type},
                "widgets_values": widget_values,
            }
            if node.title:
                entry["title"] = node.title
            if node.type == "MarkdownNote":
                entry["color"], entry["bgcolor"] = "#432", "#653"
            ui_nodes.append(entry)
        return {
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"comfyui-int8-accel/{self.name}")),
            "revision": 0,
            "last_node_id": len(self.nodes),
            "last_link_id": len(links),
            "nodes": ui_nodes,
            "links": links,
            "groups": self.groups,
            "config": {},
            "extra": {"ds": {"scale": 0.75, "offset": [40, 40]}},
            "version": 0.4,
        }

    def api_prompt(self) -> dict:
        prompt = {}
        for node in self.nodes:
            if node.type in VIRTUAL:
                continue
            inputs = dict(node.widgets)
            for input_name, (src, slot) in node.links_in.items():
                inputs[input_name] = [str(src.id), slot]
            prompt[str(node.id)] = {"inputs": inputs, "class_type": node.type,
                                    "_meta": {"title": node.title or node.type}}
        return prompt


def _text_to_image(wf: Workflow, ckpt: str, model_chain, width: int, height: int, steps: int, cfg: float,
                   prefix: str, sd3: bool = False, seed: int = 42, sampler: str = "euler",
                   scheduler: str = "normal", x0: int = 0, loader_title: str | None = None) -> Node:
    """Loader -> (model_chain) -> KSampler -> VAEDecode -> SaveImage, with the two prompts and a latent.
    Returns the KSampler."""
    loader = wf.add("CheckpointLoaderSimple", (x0, 250), (315, 98), loader_title, ckpt_name=ckpt)
    model = model_chain(loader)
    pos = wf.add("CLIPTextEncode", (x0 + 380, 250), (400, 160), "Positive prompt", text=POSITIVE, clip=(loader, 1))
    neg = wf.add("CLIPTextEncode", (x0 + 380, 450), (400, 120), "Negative prompt", text=NEGATIVE, clip=(loader, 1))
    latent = wf.add("EmptySD3LatentImage" if sd3 else "EmptyLatentImage", (x0 + 380, 610), (315, 106),
                    width=width, height=height, batch_size=1)
    sampler_node = wf.add("KSampler", (x0 + 840, 250), (315, 262), seed=seed, steps=steps, cfg=cfg,
                          sampler_name=sampler, scheduler=scheduler, denoise=1.0, model=model, positive=(pos, 0),
                          negative=(neg, 0), latent_image=(latent, 0))
    decode = wf.add("VAEDecode", (x0 + 1200, 250), (210, 46), samples=(sampler_node, 0), vae=(loader, 2))
    wf.add("SaveImage", (x0 + 1200, 340), (300, 330), filename_prefix=prefix, images=(decode, 0))
    return sampler_node


# The Quantize node's settings in every shipped workflow. The MSE thresholds are the node's defaults. The
# node's default compute_density_threshold (300) comes from GPUs: at the small sizes these CPU examples use,
# no layer reaches it (none of SD1.5's 282 at 128x128, 2 at 256x256), so nothing would run in INT8.
# 16 keeps in float the layers that see one vector per image (timestep embedding, the res blocks' and
# adaLN's embedding projections: density ~2; SD1.5's 4-channel output conv: ~4), where quantizing the
# activations costs as much as the product, and at 128x128 SD1.5's deepest level (2x2 tokens, ~8); the
# layers working on image or text tokens compete on their error. SIZE is small because every test run of
# these prompts samples on a CPU. INT8_LAYERS is what the node reported with these settings at SIZE on this
# project's random checkpoints (AVX2 CPU, 7-bit weights; every error was near 1e-3, far under 0.1);
# tests/test_workflows.py checks on the server that the count is above zero.
DENSITY = 16
QUANTIZE_SETTINGS = dict(bits=8, quantize_conv="enable", quantize_linear="enable", conv_mse_threshold=0.1,
                         linear_mse_threshold=0.1, compute_density_threshold=DENSITY)
SIZE = 128
INT8_LAYERS = {"sd15": "229/282", "sdxl": "218/239", "sd3": "64/85",  # at SIZE x SIZE, density 16
               "wan21": "43/46"}  # at WAN_SIZE
AT_300 = {"sd15": "none of its 282 layers", "sdxl": "none of its 239 layers", "sd3": "none of its 85 layers",
          "wan21": "none of its 46 layers"}


REPORT_LINE = ("**Read it:** *INT8 report* (Preview as Text) gives the summary line, then one row per layer; "
               "*INT8 decision* (Preview Image) pictures it. A first queue with new settings calibrates (its summary "
               "shows on the Quantize node); queue again to see both.")


def _settings_line(family: str, size: int | str) -> str:
    size = f"{size}x{size}" if isinstance(size, int) else size
    return (f"**Settings:** compute_density_threshold {DENSITY} for this small CPU size ({INT8_LAYERS[family]} "
            f"layers in INT8 at {size}; the default 300 admits {AT_300[family]}). GPUs and VNNI CPUs: 0-100; "
            f"CPUs without VNNI at 512 px and up: 100. Why: {_docs('workflows.md')}.")


# The docs pages are linked by their GitHub address: the note is shown in the ComfyUI page, where a relative link
# would not resolve. tests/test_docs_links.py checks that each page and anchor exists.
DOCS = "https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/docs/"


def _docs(page: str, label: str | None = None) -> str:
    return f"[{label or 'docs/' + page}]({DOCS}{page})"


def _more(*pages: str) -> str:
    return "**More:** " + ", ".join(_docs(page) for page in pages)


def _note(wf: Workflow, heading: str, lines: list[str]) -> Node:
    """The workflow's note: a heading and a few short lines (the longer reasoning is on the docs page it links)."""
    return wf.add("MarkdownNote", (0, 0), (780, 220), "What this shows",
                  text=f"## {heading}\n\n" + "\n".join(f"- {line}" for line in lines))


def _report(wf: Workflow, quant: Node, pos: tuple[int, int], size: tuple[int, int] = (780, 520)) -> Node:
    """Preview as Text on the Quantize node's report output and Preview Image on its decision picture, side by
    side, so the page shows which layers run in INT8 and why."""
    report = wf.add("PreviewAny", pos, size, "INT8 report", source=(quant, 1))
    wf.add("PreviewImage", (pos[0] + size[0] + 40, pos[1]), (540, 420), "INT8 decision", images=(quant, 2))
    return report


def sd15_int8() -> Workflow:
    wf = Workflow("sd15_int8_txt2img", "SD1.5 txt2img with INT8")
    _note(wf, "SD1.5 text-to-image with INT8", [
        "**Graph:** Load Checkpoint -> Quantize Model (INT8) -> KSampler. LoRA before or after the Quantize node "
        "keeps working.",
        REPORT_LINE,
        f"**Real models:** pick your SD1.5 checkpoint ({SD15} is a random-weight test model), 512x512, 20+ steps.",
        _settings_line("sd15", SIZE), _more("int8.md")])
    made = {}

    def chain(loader: Node):
        made["quant"] = wf.add("Int8AccelQuantize", (0, 400), (315, 200), model=(loader, 0), **QUANTIZE_SETTINGS)
        return (made["quant"], 0)

    _text_to_image(wf, SD15, chain, SIZE, SIZE, 4, 7.0, "int8accel/sd15_int8")
    _report(wf, made["quant"], (380, 760))
    return wf


def sdxl_int8_deepcache() -> Workflow:
    wf = Workflow("sdxl_int8_deepcache", "SDXL with INT8 + DeepCache")
    _note(wf, "SDXL with INT8 + DeepCache", [
        "**Graph:** Quantize Model (INT8) -> DeepCache -> KSampler. DeepCache runs the full UNet every "
        "`cache_interval` steps and only the outer `cache_depth` blocks in between; its node says what it did.",
        REPORT_LINE,
        f"**Real models:** pick your SDXL checkpoint ({SDXL} is a random-weight SDXL-family test model), "
        "1024x1024, 20+ steps.",
        _settings_line("sdxl", SIZE), _more("deepcache.md", "int8.md")])
    made = {}

    def chain(loader: Node):
        made["quant"] = wf.add("Int8AccelQuantize", (0, 400), (315, 200), model=(loader, 0), **QUANTIZE_SETTINGS)
        cache = wf.add("Int8AccelDeepCache", (0, 640), (315, 130), model=(made["quant"], 0), cache_interval=3,
                       cache_depth=1, start_percent=0.0, end_percent=1.0, mode="forecast")
        return (cache, 0)

    _text_to_image(wf, SDXL, chain, SIZE, SIZE, 4, 7.0, "int8accel/sdxl_int8_deepcache", x0=0)
    _report(wf, made["quant"], (380, 760))
    return wf


def sd3_int8_blockcache() -> Workflow:
    wf = Workflow("sd3_int8_blockcache", "SD3 (DiT) with INT8 + block cache")
    _note(wf, "SD3 (a DiT) with INT8 + block cache", [
        "**Graph:** Quantize Model (INT8) -> DeepCache -> KSampler. On a DiT, DeepCache runs the first and last "
        "`cache_depth` transformer blocks on cached steps and reuses the others' residual.",
        REPORT_LINE,
        f"**Real models:** pick your SD3 checkpoint ({SD3} is a random-weight, reduced-depth test model with "
        "CLIP-L and CLIP-G, no T5), 1024x1024, 28 steps.",
        _settings_line("sd3", SIZE), _more("deepcache.md", "int8.md")])
    made = {}

    def chain(loader: Node):
        made["quant"] = wf.add("Int8AccelQuantize", (0, 400), (315, 200), model=(loader, 0), **QUANTIZE_SETTINGS)
        cache = wf.add("Int8AccelDeepCache", (0, 640), (315, 130), model=(made["quant"], 0), cache_interval=3,
                       cache_depth=1, start_percent=0.0, end_percent=1.0, mode="forecast")
        return (cache, 0)

    _text_to_image(wf, SD3, chain, SIZE, SIZE, 4, 4.5, "int8accel/sd3_int8_blockcache", sd3=True,
                   scheduler="simple")
    _report(wf, made["quant"], (380, 760))
    return wf


def sd15_full_stack_compile() -> Workflow:
    wf = Workflow("sd15_full_stack_int8_deepcache_compile", "SD1.5 full stack: INT8 + DeepCache + compile")
    _note(wf, "SD1.5 full stack: INT8 + DeepCache + Compile", [
        "**Graph:** Quantize Model (INT8) -> DeepCache -> Compile Model -> KSampler. Keep Compile last; its node "
        "says when it compiles and how long the first run took (later runs reuse the compile).",
        REPORT_LINE,
        f"**Real models:** pick your SD1.5 checkpoint ({SD15} is a random-weight test model), 512x512, 20+ steps.",
        _settings_line("sd15", SIZE), _more("compile.md", "deepcache.md", "int8.md")])
    made = {}

    def chain(loader: Node):
        made["quant"] = wf.add("Int8AccelQuantize", (0, 400), (315, 200), model=(loader, 0), **QUANTIZE_SETTINGS)
        cache = wf.add("Int8AccelDeepCache", (0, 640), (315, 130), model=(made["quant"], 0), cache_interval=3,
                       cache_depth=1, start_percent=0.0, end_percent=1.0, mode="forecast")
        compiled = wf.add("Int8AccelCompile", (0, 810), (315, 130), model=(cache, 0), backend="inductor",
                          mode="default", dynamic="auto", fullgraph=False)
        return (compiled, 0)

    _text_to_image(wf, SD15, chain, SIZE, SIZE, 4, 7.0, "int8accel/sd15_full_stack_compile")
    _report(wf, made["quant"], (380, 760))
    return wf


def sd15_compare() -> Workflow:
    wf = Workflow("sd15_compare_baseline_vs_accelerated",
                  "SD1.5 side by side: baseline vs INT8 + DeepCache, same seed")
    _note(wf, "SD1.5 side by side: baseline vs INT8 + DeepCache", [
        "**Graph:** the same prompt, seed and sampler twice: the upper KSampler on the model as it is, the lower "
        "one after Quantize Model (INT8) and DeepCache; Image Stitch shows baseline left, accelerated right.",
        REPORT_LINE,
        f"**Real models:** pick your SD1.5 checkpoint ({SD15} is a random-weight test model), 512x512, 20+ steps.",
        _settings_line("sd15", SIZE), _more("deepcache.md", "int8.md")])
    loader = wf.add("CheckpointLoaderSimple", (0, 260), (315, 98), ckpt_name=SD15)
    quant = wf.add("Int8AccelQuantize", (0, 420), (315, 200), model=(loader, 0), **QUANTIZE_SETTINGS)
    cache = wf.add("Int8AccelDeepCache", (0, 660), (315, 130), model=(quant, 0), cache_interval=3, cache_depth=1,
                   start_percent=0.0, end_percent=1.0, mode="forecast")
    pos = wf.add("CLIPTextEncode", (380, 260), (400, 160), "Positive prompt", text=POSITIVE, clip=(loader, 1))
    neg = wf.add("CLIPTextEncode", (380, 460), (400, 120), "Negative prompt", text=NEGATIVE, clip=(loader, 1))
    latent = wf.add("EmptyLatentImage", (380, 620), (315, 106), width=SIZE, height=SIZE, batch_size=1)
    common = dict(seed=42, steps=4, cfg=7.0, sampler_name="euler", scheduler="normal", denoise=1.0,
                  positive=(pos, 0), negative=(neg, 0), latent_image=(latent, 0))
    base = wf.add("KSampler", (860, 40), (315, 262), "KSampler (baseline)", model=(loader, 0), **common)
    fast = wf.add("KSampler", (860, 480), (315, 262), "KSampler (INT8 + DeepCache)", model=(cache, 0), **common)
    base_img = wf.add("VAEDecode", (1220, 40), (210, 46), "Decode (baseline)", samples=(base, 0), vae=(loader, 2))
    fast_img = wf.add("VAEDecode", (1220, 480), (210, 46), "Decode (accelerated)", samples=(fast, 0),
                      vae=(loader, 2))
    stitch = wf.add("ImageStitch", (1220, 600), (270, 150), "Side by side", direction="right",
                    match_image_size=True, spacing_width=8, spacing_color="white", image1=(base_img, 0),
                    image2=(fast_img, 0))
    wf.add("SaveImage", (1520, 40), (420, 400), "Baseline | accelerated", filename_prefix="int8accel/compare",
           images=(stitch, 0))
    wf.group("Baseline", (840, -40, 620, 380), "#3f789e")
    wf.group("Accelerated (INT8 + DeepCache)", (840, 400, 620, 380), "#8A8")
    _report(wf, quant, (380, 800))
    return wf


# The INT8 file sd15_int8_save writes (Save INT8 Model numbers its files from 00001 on, like Save Image) and
# sd15_int8_load reads.
INT8_FILE_PREFIX = "int8/sd15_int8"
INT8_FILE = f"{INT8_FILE_PREFIX}_00001_.safetensors"
WHEN_TO_SAVE = (
    "Quantize on the fly (the Quantize node) while you try settings, LoRAs or models: nothing is written and a "
    "change only costs one calibration step. Save once and load when you use the same model again: the loaded "
    "file needs no calibration and its INT8 layers replace the float weights in memory (about a quarter of the "
    "fp32 size), while the Quantize node keeps the float weights and adds its INT8 copies.")


def sd15_int8_save() -> Workflow:
    wf = Workflow("sd15_int8_save", "SD1.5 INT8: quantize, sample, save the INT8 model")
    _note(wf, "SD1.5 INT8: quantize, sample, save", [
        "**Graph:** Quantize Model (INT8) -> KSampler, then Save INT8 Model, linked after the KSampler through "
        "`after_sampling` (the layers are chosen while it samples).",
        f"**File:** {INT8_FILE} in models/unet/ on a fresh ComfyUI, the next number on every later run: bypass "
        "the save (Ctrl+B) once you have it. sd15_int8_load reads it.",
        "**int8_layers:** the default writes every accurate layer in INT8, also those the speed gate kept in "
        "float here (a file for memory); 'only layers faster in INT8' writes just the ones that ran faster.",
        REPORT_LINE,
        f"**Real models:** pick your SD1.5 checkpoint ({SD15} is a random-weight test model).",
        _settings_line("sd15", SIZE), _more("int8-files.md", "int8.md")])
    made = {}

    def chain(loader: Node):
        made["quant"] = wf.add("Int8AccelQuantize", (0, 400), (315, 200), model=(loader, 0), **QUANTIZE_SETTINGS)
        return (made["quant"], 0)

    sampler = _text_to_image(wf, SD15, chain, SIZE, SIZE, 4, 7.0, "int8accel/sd15_int8_save")
    wf.add("Int8AccelSaveModel", (840, 560), (315, 154), filename_prefix=INT8_FILE_PREFIX, bake_lora=False,
           int8_layers="every accurate layer (smallest file)", model=(made["quant"], 0), after_sampling=(sampler, 0))
    _report(wf, made["quant"], (380, 760))
    return wf


def sd15_int8_load() -> Workflow:
    wf = Workflow("sd15_int8_load", "SD1.5 INT8: load a saved INT8 model and sample")
    _note(wf, "SD1.5 INT8: load a saved INT8 model", [
        "**Graph:** Load Diffusion Model (INT8) -> KSampler: no Quantize node and no calibration; the same seed "
        "gives the picture of the save run.",
        f"**File:** run sd15_int8_save first (it writes {INT8_FILE}; press R if the list lacks it), or pick an "
        "INT8 file of your own (Save INT8 Model's, or ComfyUI core's int8_tensorwise).",
        f"**Real models:** Load Checkpoint ({SD15}) only supplies CLIP and VAE here; with your own files use Load "
        "CLIP and Load VAE.", _more("int8-files.md")])

    def chain(loader: Node):
        return (wf.add("Int8AccelLoadModel", (0, 400), (315, 82), unet_name=INT8_FILE), 0)

    _text_to_image(wf, SD15, chain, SIZE, SIZE, 4, 7.0, "int8accel/sd15_int8_load",
                   loader_title="Load Checkpoint (CLIP and VAE)")
    return wf


# Wan's size: 64x64 and 5 frames, a 16x2x8x8 latent (the VAE packs 4 frames into one latent frame after the
# first), 32 tokens per frame pair; 6 steps give DeepCache two full and four cached steps at interval 3.
WAN_WIDTH, WAN_HEIGHT, WAN_LENGTH = 64, 64, 5
WAN_SIZE = f"{WAN_WIDTH}x{WAN_HEIGHT}, {WAN_LENGTH} frames"
WAN_STEPS = 6


def wan21_deepcache_t2v() -> Workflow:
    wf = Workflow("wan21_deepcache_t2v", "Wan 2.1 text-to-video with INT8 + DeepCache")
    _note(wf, "Wan 2.1 text-to-video with INT8 + DeepCache", [
        "**Graph:** Load Diffusion Model -> Quantize Model (INT8) -> DeepCache -> Model Sampling SD3 (shift 8) -> "
        "KSampler (uni_pc, CFG 6), saved as an animated WebP; the DeepCache node says which steps it cached.",
        REPORT_LINE,
        "**Real models:** the Wan 2.1 T2V model, umt5_xxl with type `wan` in Load CLIP, wan_2.1_vae; 832x480, 33+ "
        "frames, 20-30 steps. The shipped files are random test stand-ins and give noise.",
        _settings_line("wan21", WAN_SIZE), _more("deepcache.md", "int8.md")])
    unet = wf.add("UNETLoader", (0, 250), (315, 82), unet_name=WAN21, weight_dtype="default")
    quant = wf.add("Int8AccelQuantize", (0, 380), (315, 200), model=(unet, 0), **QUANTIZE_SETTINGS)
    cache = wf.add("Int8AccelDeepCache", (0, 620), (315, 130), model=(quant, 0), cache_interval=3, cache_depth=1,
                   start_percent=0.0, end_percent=1.0, mode="forecast")
    shift = wf.add("ModelSamplingSD3", (0, 790), (315, 58), shift=8.0, model=(cache, 0))
    vae = wf.add("VAELoader", (0, 890), (315, 58), vae_name=WAN21_VAE)
    clip = wf.add("CLIPLoader", (380, 250), (400, 106), clip_name=CLIP_L, type="sd3", device="default")
    pos = wf.add("CLIPTextEncode", (380, 400), (400, 140), "Positive prompt",
                 text="a lighthouse on a cliff at sunset, waves rolling in, slow camera pan", clip=(clip, 0))
    neg = wf.add("CLIPTextEncode", (380, 580), (400, 100), "Negative prompt", text=NEGATIVE, clip=(clip, 0))
    latent = wf.add("EmptyHunyuanLatentVideo", (380, 720), (315, 130), width=WAN_WIDTH, height=WAN_HEIGHT,
                    length=WAN_LENGTH, batch_size=1)
    sampler = wf.add("KSampler", (840, 250), (315, 262), seed=42, steps=WAN_STEPS, cfg=6.0, sampler_name="uni_pc",
                     scheduler="simple", denoise=1.0, model=(shift, 0), positive=(pos, 0), negative=(neg, 0),
                     latent_image=(latent, 0))
    decode = wf.add("VAEDecode", (1200, 250), (210, 46), samples=(sampler, 0), vae=(vae, 0))
    wf.add("SaveAnimatedWEBP", (1200, 340), (315, 366), filename_prefix="int8accel/wan21_deepcache", fps=16.0,
           lossless=True, quality=90, method="default", images=(decode, 0))
    _report(wf, quant, (380, 890))
    return wf


WORKFLOWS = [sd15_int8, sdxl_int8_deepcache, sd3_int8_blockcache, sd15_full_stack_compile, sd15_compare,
             sd15_int8_save, sd15_int8_load, wan21_deepcache_t2v]


def build_all() -> dict[str, tuple[dict, dict]]:
    """name -> (UI graph, API prompt) for every shipped workflow."""
    out = {}
    for make in WORKFLOWS:
        wf = make()
        out[wf.name] = (wf.ui_graph(), wf.api_prompt())
    return out


def write_thumbnails(screenshots: Path) -> None:
    """<name>.jpg beside each graph (the templates browser shows it on the card), made from the browser
    test's screenshots of the graph after its run (test-artifacts/browser_<name>.png)."""
    from PIL import Image

    for name in build_all():
        shot = screenshots / f"browser_{name}.png"
        if shot.is_file():
            with Image.open(shot) as image:
                canvas = image.convert("RGB").crop((60, 40, image.width, image.height))  # no sidebar, tabs
                side = max(canvas.size)
                square = Image.new("RGB", (side, side), canvas.getpixel((canvas.width - 5, canvas.height // 2)))
                square.paste(canvas, (0, (side - canvas.height) // 2))
                square.resize((480, 480), Image.LANCZOS).save(HERE / f"{name}.jpg", quality=85)
            print(f"{name}.jpg")


def main() -> None:
    import sys

    if sys.argv[1:2] == ["--thumbnails"]:
        write_thumbnails(Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parent / "test-artifacts")
        return
    (HERE / "api").mkdir(exist_ok=True)
    for name, (ui, api) in build_all().items():
        (HERE / f"{name}.json").write_text(json.dumps(ui, indent=2) + "\n")
        (HERE / "api" / f"{name}.json").write_text(json.dumps(api, indent=2) + "\n")
        print(name)


if __name__ == "__main__":
    main()
