"""Resident memory a fresh process gains while `load_int8_diffusion_model` loads one file.

    python -m tests.support.int8_load_rss FILE     (from the repository root, COMFYUI_PATH set)

Prints one JSON object: RSS after the imports, the peak RSS during the load, RSS after it, and the
diffusion model's parameter+buffer bytes and resident INT8 layer count."""

from __future__ import annotations

import json
import sys

from harness.comfy_host import import_comfy, load_pack
from harness.memory import model_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes


def measure(path: str) -> dict:
    import_comfy()
    load_pack()
    from comfyui_int8_accel.nodes.int8_files.loader import int8_resident_layers, load_int8_diffusion_model

    before = rss_bytes()
    reset_peak_rss()
    patcher, _ = load_int8_diffusion_model(path)
    peak = peak_rss_bytes()
    diffusion_model = patcher.model.diffusion_model
    return {"rss_before": before, "peak_rss": peak, "rss_after": rss_bytes(),
            "model_bytes": model_bytes(diffusion_model),
            "int8_layers": len(int8_resident_layers(diffusion_model))}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])))
