"""ComfyUI 0.38's quantized checkpoints and this pack: files we write that core must refuse or read correctly, and
layers core loaded quantized given to Quantize Model (INT8). 0.38's loading rules are run in the real ComfyUI
0.3.75 through `tests/support/comfy038_quant.py` (0.38's own function text swapped in, cited there)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from comfyui_int8_accel.nodes.int8.checkpoint import CONV_LAYOUT_KEY, int8_state_dict, parse_comfy_quant
from comfyui_int8_accel.nodes.int8.loader import int8_resident_layers, load_int8_state_dict
from comfyui_int8_accel.nodes.int8.plan import Int8Plan, find_candidates
from tests.support.comfy038_quant import core_038_reading, load_as_core_038
from tests.support.tiny_models import build_tiny_model, tiny_model_config

LEGACY_CONV_LAYOUT = "conv2d_oihw"  # what the pack wrote for Conv2d before: 4-D weight, [out, 1, 1, 1] scale


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path / "calibration"))


def detect_tiny(monkeypatch, kind: str) -> None:
    """ComfyUI's model detection does not recognise the tiny sizes: hand it the tiny model's config."""
    import comfy.model_detection

    monkeypatch.setattr(comfy.model_detection, "model_config_from_unet",
                        lambda sd, prefix, use_base_if_no_match=False, metadata=None: tiny_model_config(kind))


def saved_tiny_sd15() -> tuple[torch.nn.Module, dict[str, torch.nn.Module], dict[str, torch.Tensor]]:
    """(diffusion model, its INT8 layers, the state dict Save INT8 Model writes with every layer in INT8)."""
    dm = build_tiny_model("sd15").model.diffusion_model
    layers = {name: Int8Plan._quantize_layer(dm.get_submodule(path), kind)
              for name, (path, kind) in find_candidates(dm).items()}
    return dm, layers, int8_state_dict(dm.state_dict().items(), layers)


def legacy_layout(sd: dict[str, torch.Tensor], layers: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The same file in the conv layout earlier versions of the pack wrote."""
    out = dict(sd)
    for name, layer in layers.items():
        if layer.weight.ndim == 4:
            out[f"{name}.weight"] = layer.weight.detach().clone()
            out[f"{name}.weight_scale"] = layer.weight_scale.detach().reshape(-1, 1, 1, 1).clone()
            out[f"{name}.comfy_quant"] = torch.tensor(list(json.dumps(
                {"format": "int8_tensorwise", CONV_LAYOUT_KEY: LEGACY_CONV_LAYOUT}).encode()), dtype=torch.uint8)
    return out


# --- item 1: our files under core 0.38's loading rules ---------------------------------------------------------------

def test_core_038_refuses_our_int8_convs_and_reads_our_linears_with_their_scale(comfy_root, monkeypatch):
    """By 0.38's rules (comfy/utils.py `detect_layer_quantization`, comfy/ops.py `mixed_precision_ops` and
    `_load_quantized_module`, comfy/quant_ops.py `QUANT_ALGOS`, comfy/model_base.py `load_model_weights`): every
    Linear entry of a saved tiny SD1.5 loads as comfy-kitchen's int8 QuantizedTensor equal to weight * weight_scale,
    and every Conv2d entry is refused with an error; the whole file is refused by core's loader. The control: the
    conv layout of earlier versions, by the same rules, loads into a plain conv without its scale (no error)."""
    detect_tiny(monkeypatch, "sd15")
    dm, layers, sd = saved_tiny_sd15()
    convs = {name for name, layer in layers.items() if layer.weight.ndim == 4}
    assert len(convs) == 39 and len(layers) - len(convs) == 80

    verdicts = core_038_reading(sd, dm)
    assert sorted(verdicts) == sorted(layers)
    misread = {name: verdict for name, verdict in verdicts.items()
               if not (verdict == "read with its scale" or (name in convs and verdict.startswith("refused")))}
    assert not misread, f"{len(misread)} entries core 0.38 would misread, e.g. {list(misread.items())[:3]}"
    assert all(verdicts[name] == "read with its scale" for name in layers if name not in convs)
    assert all("size mismatch" in verdicts[name] for name in convs)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_as_core_038(sd)

    legacy = core_038_reading(legacy_layout(sd, layers), dm)
    assert all(legacy[name].startswith("misread") for name in convs)  # the rules do find the old layout's misread
    assert load_as_core_038(legacy_layout(sd, layers)) is not None  # ... and core loads it without a word


def test_our_loader_reads_the_new_and_the_legacy_conv_layout(comfy_root, monkeypatch, caplog):
    """The conv entries on disk are 2-D rows with their 4-D shape in comfy_quant; our loader gives the layers their
    shape back, and still loads files of earlier versions (with a log line saying to save them again)."""
    detect_tiny(monkeypatch, "sd15")
    dm, layers, sd = saved_tiny_sd15()
    conv = next(name for name, layer in layers.items() if layer.weight.ndim == 4)
    assert sd[f"{conv}.weight"].shape == (layers[conv].weight.shape[0], layers[conv].weight[0].numel())
    assert parse_comfy_quant(sd[f"{conv}.comfy_quant"])[CONV_LAYOUT_KEY] == "conv2d_rows"

    for variant in (sd, legacy_layout(sd, layers)):
        with caplog.at_level(logging.WARNING, logger="int8_accel.int8"):
            caplog.clear()
            resident = int8_resident_layers(load_int8_state_dict(dict(variant)).model.diffusion_model)
        assert sorted(resident) == sorted(layers)
        assert all(torch.equal(resident[name].weight, layers[name].weight) for name in layers)
        assert all(torch.equal(resident[name].weight_scale, layers[name].weight_scale) for name in layers)
        assert ("earlier versions" in caplog.text) == (variant is not sd)
