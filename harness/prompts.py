"""API-format prompts the demo and the server tests queue."""

from __future__ import annotations

# The node's default (300, OneDiff's GPU-derived value) keeps every layer with 320 channels in float; on a
# CPU the INT8 kernels win far below it (bench/results/kernels.md), so the demo lets every layer compete on
# error alone.
DEMO_DENSITY_THRESHOLD = 0
PROMPT_TEXT = "a lighthouse on a cliff at sunset, detailed oil painting"
NEGATIVE_TEXT = "blurry, low quality"


def txt2img_prompt(ckpt: str, size: int, steps: int, seed: int, prefix: str,
                   nodes: list[str | tuple[str, dict]]) -> dict:
    """API-format prompt: checkpoint -> [model nodes] -> KSampler -> VAE decode -> SaveImage.

    A model node is a pack node's short name (int8, deepcache, compile) or any (class_type, inputs) pair
    that takes and returns a MODEL (e.g. LoraLoaderModelOnly)."""
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT_TEXT, "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE_TEXT, "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
    }
    model = ["1", 0]
    node_inputs = {
        "int8": ("Int8AccelQuantize", {"bits": 8, "quantize_conv": "enable", "quantize_linear": "enable",
                                       "conv_mse_threshold": 0.1, "linear_mse_threshold": 0.1,
                                       "compute_density_threshold": DEMO_DENSITY_THRESHOLD}),
        "deepcache": ("Int8AccelDeepCache", {"cache_interval": 3, "cache_depth": 1, "start_percent": 0.0,
                                             "end_percent": 1.0}),
        "compile": ("Int8AccelCompile", {"backend": "inductor", "mode": "default", "dynamic": "auto",
                                         "fullgraph": False}),
    }
    for index, node in enumerate(nodes):
        class_type, inputs = node_inputs[node] if isinstance(node, str) else node
        node_id = str(10 + index)
        prompt[node_id] = {"class_type": class_type, "inputs": {"model": model, **inputs}}
        model = [node_id, 0]
    prompt["5"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    prompt["6"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}}
    prompt["7"] = {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": prefix}}
    prompt["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"latents/{prefix}"}}
    return prompt
