"""INT8 checkpoints in ComfyUI's INT8 format: the format functions, comfy-kitchen's reading of our files and ours of
its files, and Load Diffusion Model (INT8) on tiny SD1.5 and Flux models in the real ComfyUI, in-process.

Bounds never depend on the weight width: where INT8 rounding matters, results are compared with the on-the-fly
INT8 run of the same model on this machine (same weight width), or between two INT8 computations that share
their int8 weights."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from comfyui_int8_accel.kernels import int8_linear, weight_qmax
from comfyui_int8_accel.nodes.int8 import apply_int8, settings_from_widgets
from comfyui_int8_accel.nodes.int8.modules import Int8Conv2d, Int8Linear
from comfyui_int8_accel.nodes.int8.plan import find_candidates
from comfyui_int8_accel.nodes.int8_files.checkpoint import (
    CONV_LAYOUT,
    CONV_LAYOUT_KEY,
    CONV_SHAPE_KEY,
    comfy_quant_tensor,
    int8_metadata,
    int8_state_dict,
    parse_comfy_quant,
    read_int8_layer,
)
from comfyui_int8_accel.nodes.int8_files.loader import (
    int8_resident_layers,
    load_int8_diffusion_model,
    load_int8_state_dict,
    resident_memory_line,
)
from harness.memory import model_bytes
from harness.tiny_models import (
    build_tiny_model,
    detect_tiny,
    latent_channels,
    make_conditioning,
    sample,
    tiny_model_config,
)
from tests.support.int8_checks import ALL_INT8, all_int8_layers, rel
from tests.support.lora import apply_lora, make_lora

pytestmark = pytest.mark.usefixtures("calibration_cache")


# --- the format ---------------------------------------------------------------------------------------------------

def test_format_round_trip_linear_and_conv(comfy_root):
    gen = torch.Generator().manual_seed(0)
    linear = Int8Linear(torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen))
    conv = Int8Conv2d(torch.randn(8, 4, 3, 3, generator=gen), None, 1, 1, 1, 1)
    float_sd = {"lin.weight": torch.randn(24, 40), "lin.bias": torch.randn(24), "conv.weight": torch.randn(8, 4, 3, 3),
                "norm.weight": torch.randn(5)}
    sd = int8_state_dict(float_sd.items(), {"lin": linear, "conv": conv})

    assert set(sd) == {"lin.weight", "lin.weight_scale", "lin.comfy_quant", "lin.bias", "conv.weight",
                       "conv.weight_scale", "conv.comfy_quant", "norm.weight"}
    assert torch.equal(sd["norm.weight"], float_sd["norm.weight"])
    assert sd["lin.weight"].dtype == torch.int8 and sd["lin.weight_scale"].dtype == torch.float32
    assert sd["lin.weight_scale"].shape == (24, 1) and sd["conv.weight_scale"].shape == (8, 1)
    assert sd["conv.weight"].shape == (8, 36)  # rows of the OIHW weight: core 0.38's conv loader refuses it
    assert sd["lin.comfy_quant"].dtype == torch.uint8
    assert json.loads(bytes(sd["lin.comfy_quant"].tolist())) == {"format": "int8_tensorwise"}
    assert parse_comfy_quant(sd["conv.comfy_quant"]) == {"format": "int8_tensorwise", CONV_LAYOUT_KEY: CONV_LAYOUT,
                                                         CONV_SHAPE_KEY: [8, 4, 3, 3]}
    assert torch.equal(sd["lin.bias"], linear.bias)

    for name, layer in (("lin", linear), ("conv", conv)):
        q_weight, scale, meta = read_int8_layer(sd, name)
        assert torch.equal(q_weight, layer.weight) and torch.equal(scale, layer.weight_scale)
        assert scale.shape == (layer.weight.shape[0],) and meta["format"] == "int8_tensorwise"
        # what a reader of the core layout computes (weight * weight_scale) is our dequantized weight
        assert torch.equal((sd[f"{name}.weight"].float() * sd[f"{name}.weight_scale"]).reshape(layer.weight.shape),
                           layer.weight.float() * layer._scale_view(layer.weight))
    assert read_int8_layer(sd, "norm") is None and read_int8_layer(float_sd, "lin") is None

    meta = int8_metadata({"linear_mse_threshold": 0.1}, "summary: 2 layers", weight_bits=7)
    assert all(isinstance(v, str) for v in meta.values())
    assert json.loads(meta["int8_accel.settings"]) == {"linear_mse_threshold": 0.1}


def test_per_tensor_scales_and_too_wide_weights_are_accepted(comfy_root):
    gen = torch.Generator().manual_seed(1)
    q_weight = torch.randint(-127, 128, (16, 32), generator=gen, dtype=torch.int8)
    q_weight[0, 0] = 127
    for shape in ((), (1,)):
        sd = {"l.weight": q_weight, "l.weight_scale": torch.full(shape, 0.01)}
        q, scale, _ = read_int8_layer(sd, "l")
        assert torch.equal(q, q_weight) and scale.shape == (16,) and torch.all(scale == 0.01)
    # 8-bit values for kernels that take fewer bits: requantized per channel, the real weight kept within rounding
    q, scale, meta = read_int8_layer(sd, "l", qmax=63)
    assert int(q.abs().max()) <= 63 and "requantized" in meta
    real = q_weight.float() * 0.01
    assert rel(q.float() * scale[:, None], real) < 0.02
    assert torch.equal(read_int8_layer(sd, "l", qmax=127)[0], q_weight)
    # -128 is beyond +-127 as well (its int8 abs() wraps to -128)
    edge = {"l.weight": torch.tensor([[-128, 1]], dtype=torch.int8), "l.weight_scale": torch.ones(1)}
    assert "requantized" in read_int8_layer(edge, "l", qmax=127)[2]


def test_malformed_entries_raise_clear_errors(comfy_root, monkeypatch):
    q_weight = torch.ones(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight_scale is missing"):
        read_int8_layer({"l.weight": q_weight}, "l")
    with pytest.raises(ValueError, match="expected one value or one per output channel"):
        read_int8_layer({"l.weight": q_weight, "l.weight_scale": torch.ones(3)}, "l")
    with pytest.raises(ValueError, match="'float8_e4m3fn' format; this loader reads only 'int8_tensorwise'"):
        read_int8_layer({"l.weight": q_weight, "l.weight_scale": torch.ones(4),
                         "l.comfy_quant": comfy_quant_tensor({"format": "float8_e4m3fn"})}, "l")
    convrot = {"l.weight": q_weight, "l.weight_scale": torch.ones(4, 1),
               "l.comfy_quant": comfy_quant_tensor({"format": "int8_tensorwise", "convrot": True,
                                                   "convrot_groupsize": 8})}
    monkeypatch.setitem(__import__("sys").modules, "comfy_kitchen", None)  # as if it were not installed
    with pytest.raises(ValueError, match="ConvRot.*needs comfy-kitchen"):
        read_int8_layer(convrot, "l")


# --- comfy-kitchen ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ck(comfy_root):
    return pytest.importorskip("comfy_kitchen")


def test_comfy_kitchen_reads_our_linear_and_computes_the_same(ck):
    from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout

    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 128, generator=gen) * 0.05, torch.randn(96, generator=gen)
    layer = Int8Linear(weight, bias)
    sd = int8_state_dict({"l.weight": weight, "l.bias": bias}.items(), {"l": layer})
    params = TensorWiseINT8Layout.Params(scale=sd["l.weight_scale"], orig_dtype=torch.float32,
                                         orig_shape=tuple(weight.shape))
    qt = QuantizedTensor(sd["l.weight"], "TensorWiseINT8Layout", params)
    assert torch.equal(qt.dequantize(), layer.weight.float() * layer.weight_scale[:, None])

    x = torch.randn(4, 10, 128, generator=gen)
    ours = int8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    theirs = torch.nn.functional.linear(x, qt, sd["l.bias"])
    reference = torch.nn.functional.linear(x, qt.dequantize(), bias)  # the same int8 weights, float activations
    # both quantize activations per row to 8 bits: they differ only by that rounding, far below the output's size
    assert rel(theirs, ours) < 0.02 and rel(ours, reference) < 0.02 and rel(theirs, reference) < 0.02


def test_convrot_weights_are_unrotated_through_comfy_kitchen(ck):
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 64, generator=gen)
    qdata, params = TensorWiseINT8Layout.quantize(weight, per_channel=True, convrot=True, convrot_groupsize=16)
    sd = {"l.weight": qdata, "l.weight_scale": params.scale,
          "l.comfy_quant": comfy_quant_tensor({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16})}
    rotated = qdata.float() * params.scale
    assert rel(rotated, weight) > 0.5  # stored rotated: reading it as a plain layer would be wrong
    q, scale, meta = read_int8_layer(sd, "l", qmax=weight_qmax("cpu"))
    assert meta["requantized"] == "convrot undone" and q.dtype == torch.int8 and scale.shape == (32,)
    assert rel(q.float() * scale[:, None], weight) < 0.05


def test_a_file_quantized_by_comfy_kitchen_loads_and_samples(ck, tmp_path, monkeypatch):
    import comfy.utils
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    detect_tiny(monkeypatch, "flux")
    model = build_tiny_model("flux")
    dm = model.model.diffusion_model
    linears = [name for name, (_, kind) in find_candidates(dm).items() if kind == "linear"]
    sd = {key: value.clone() for key, value in dm.state_dict().items()}
    for i, name in enumerate(linears):
        per_channel = i % 2 == 0  # both of core's scale shapes: [out, 1] and one per tensor
        qdata, params = TensorWiseINT8Layout.quantize(sd[f"{name}.weight"], per_channel=per_channel)
        sd[f"{name}.weight"], sd[f"{name}.weight_scale"] = qdata, params.scale
        sd[f"{name}.comfy_quant"] = comfy_quant_tensor({"format": "int8_tensorwise"})
    path = tmp_path / "ck_flux.safetensors"
    comfy.utils.save_torch_file(sd, str(path))

    loaded, _ = load_int8_diffusion_model(str(path))
    resident = int8_resident_layers(loaded.model.diffusion_model)
    assert sorted(resident) == sorted(linears)
    assert all(m.weight.dtype == torch.int8 and int(m.weight.abs().max()) <= weight_qmax("cpu")
               for m in resident.values())
    out = sample(loaded, "flux", steps=2)
    reference = sample(model, "flux", steps=2)
    on_the_fly = sample(apply_int8(model, settings_from_widgets(quantize_conv="disable", **ALL_INT8))[0],
                        "flux", steps=2)
    assert torch.isfinite(out).all()
    # comfy-kitchen's 8-bit weights (requantized where the kernels take 7 bits) against the same layers quantized
    # by this pack on this machine: a second rounding at most, on top of the same error
    assert rel(out, reference) < 2 * rel(on_the_fly, reference) + 1e-3


# --- Load Diffusion Model (INT8) ------------------------------------------------------------------------------------

def test_load_node_declares_its_file_combo(pack, models_dir):
    (models_dir / "a.safetensors").write_bytes(b"")
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelLoadModel"]
    assert pack.NODE_DISPLAY_NAME_MAPPINGS["Int8AccelLoadModel"] == "Load Diffusion Model (INT8)"
    spec = node.INPUT_TYPES()["required"]
    assert list(spec) == ["unet_name"] and "a.safetensors" in spec["unet_name"][1]["options"]
    assert node.GET_NODE_INFO_V1()["output"] == ["MODEL"]
    assert node.validate_inputs(unet_name="a.safetensors") is True
    assert "is not one of" in node.validate_inputs(unet_name="missing.safetensors")


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "flux", "sd3"])
def test_loader_gives_a_resident_int8_model(pack, kind, models_dir, monkeypatch):
    import comfy.utils

    detect_tiny(monkeypatch, kind)
    model = build_tiny_model(kind)
    dm = model.model.diffusion_model
    base_state = {key: value.clone() for key, value in dm.state_dict().items()}
    float_out = sample(model, kind, steps=2)

    layers = all_int8_layers(dm)
    metadata = int8_metadata(dataclasses.asdict(settings_from_widgets(**ALL_INT8)), "summary: test")
    comfy.utils.save_torch_file(int8_state_dict(dm.state_dict().items(), layers),
                                str(models_dir / f"{kind}.safetensors"), metadata=metadata)
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelLoadModel"]
    loaded = node.execute(unet_name=f"{kind}.safetensors").result[0]
    ldm = loaded.model.diffusion_model

    resident = int8_resident_layers(ldm)
    kinds = {name: type(m) for name, m in resident.items()}
    assert sorted(resident) == sorted(layers)
    assert all(kinds[name] is type(layer) for name, layer in layers.items())
    assert all(m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32 for m in resident.values())
    assert not find_candidates(ldm)  # no float Linear/Conv2d left that could have been INT8
    assert model_bytes(ldm) < 0.4 * model_bytes(dm)
    assert loaded.model_size() < 0.4 * model.model_size()  # what ComfyUI's memory management budgets for
    memory = resident_memory_line(loaded)  # shown on the node in the page
    int8_mib, float_mib = (float(v) for v in re.search(r"take ([\d.]+) MiB instead of ([\d.]+) MiB", memory).groups())
    linear = sum(isinstance(m, Int8Linear) for m in resident.values())
    assert 0 < int8_mib < 0.3 * float_mib and f"{linear} Linear and {len(resident) - linear} Conv2d" in memory
    _, file_meta = load_int8_diffusion_model(str(models_dir / f"{kind}.safetensors"))
    assert file_meta["int8_accel.report"] == "summary: test"

    out = sample(loaded, kind, steps=2)
    on_the_fly = sample(apply_int8(model, settings_from_widgets(**ALL_INT8))[0], kind, steps=2)
    assert torch.isfinite(out).all()
    assert rel(out, on_the_fly) < 1e-3  # the same int8 weights, the same kernels
    assert rel(out, float_out) > 1e-5  # and it really ran in INT8

    lora = make_lora(model, layers=6, scale=1.0)
    with_lora = sample(apply_lora(loaded, lora), kind, steps=2)
    float_lora = sample(apply_lora(model, lora), kind, steps=2)
    assert torch.isfinite(with_lora).all()
    assert rel(with_lora, out) > 1e-3
    assert rel(with_lora, float_lora) < rel(out, float_lora)  # it moved towards what the LoRA does in float
    assert torch.equal(sample(loaded, kind, steps=2), out)  # LoRA patches were undone on the INT8 layers

    assert torch.equal(sample(model, kind, steps=2), float_out)
    assert all(torch.equal(value, base_state[key]) for key, value in dm.state_dict().items())
    # a plain float file loads through the same ops as the float model it came from
    plain = load_int8_state_dict(dict(base_state))
    assert not int8_resident_layers(plain.model.diffusion_model)
    # the same float ops on the same values; not bit-identical on every CPU (on an Intel Xeon with AVX-512 the SD3
    # model built from the state dict differed by 7.5e-8 relative, float rounding in the GEMMs)
    assert rel(sample(plain, kind, steps=2), float_out) < 1e-6


def _run_patched(patcher, kind: str, lowvram: bool) -> torch.Tensor:
    """One model call of `patcher` loaded normally or in ComfyUI's low-VRAM mode (every layer offloaded, LoRA
    applied per forward through `weight_function`)."""
    gen = torch.Generator().manual_seed(3)
    positive, _ = make_conditioning(kind, batch=2)
    x, t = torch.randn(2, latent_channels(kind), 16, 16, generator=gen), torch.tensor([700.0, 700.0])
    patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0)
    offloaded_with_lora = [m for m in patcher.model.modules() if getattr(m, "weight_function", None)]
    assert bool(offloaded_with_lora) == (lowvram and bool(patcher.patches))
    try:
        with torch.inference_mode():
            cond = patcher.model.extra_conds(noise=x, cross_attn=positive[0][0], **positive[0][1])
            cond = {key: value.cond if hasattr(value, "cond") else value for key, value in cond.items()}
            return patcher.model.apply_model(x, t, transformer_options={"wrappers": patcher.wrappers}, **cond)
    finally:
        patcher.unpatch_model(device_to=torch.device("cpu"))


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_lora_after_the_loader_matches_float_lora_within_int8_error(pack, kind, models_dir, monkeypatch,
                                                                     weight_width):
    """LoraLoaderModelOnly after Load Diffusion Model (INT8), at two strengths and in low-VRAM mode, does what the
    LoRA does on the float model, up to INT8's own error at this weight width."""
    import comfy.model_management

    from comfyui_int8_accel.kernels import cpu

    # the convs in float, as at the cpu backend's default floor (the suite's floors are 0): their per-tensor
    # activation rounding is not what this compares
    monkeypatch.setattr(cpu, "CONV_MIN_MACS", cpu.DEFAULT_CONV_MIN_MACS)
    detect_tiny(monkeypatch, kind)
    model = build_tiny_model(kind)
    dm = model.model.diffusion_model
    base_state = {key: value.clone() for key, value in dm.state_dict().items()}
    loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)))
    assert rel(sample(loaded, kind, steps=2), sample(model, kind, steps=2)) > 1e-5  # it really runs INT8
    lora = make_lora(model, layers=8, scale=2.0)
    on_the_fly = apply_int8(model, settings_from_widgets(**ALL_INT8))[0]
    for strength in (1.0, 0.5):
        float_lora = sample(apply_lora(model, lora, strength), kind, steps=2)
        # INT8's own error with this LoRA at this width: INT8 built from the merged float weights
        int8_error = rel(sample(apply_lora(on_the_fly, lora, strength), kind, steps=2), float_lora)
        with_lora = sample(apply_lora(loaded, lora, strength), kind, steps=2)
        # dequantize, add the LoRA, requantize: one rounding more than INT8 from the merged weights
        assert rel(with_lora, float_lora) < 1.5 * int8_error + 1e-3, (strength, int8_error)
        assert rel(with_lora, sample(loaded, kind, steps=2)) > 0.01  # the LoRA took effect at this strength

    comfy.model_management.unload_all_models()  # sampling leaves the last run's patches applied until then
    float_lora = _run_patched(apply_lora(model, lora), kind, lowvram=False)
    int8_error = rel(_run_patched(apply_lora(on_the_fly, lora), kind, lowvram=False), float_lora)
    loaded_plain_call = _run_patched(loaded, kind, lowvram=False)
    full = _run_patched(apply_lora(loaded, lora), kind, lowvram=False)
    low_vram = _run_patched(apply_lora(loaded, lora), kind, lowvram=True)  # LoRA on the dequantized weight
    for result in (full, low_vram):
        assert rel(result, float_lora) < 1.5 * int8_error + 1e-3, int8_error
        assert rel(result, loaded_plain_call) > 0.01
    assert torch.equal(_run_patched(loaded, kind, lowvram=False), loaded_plain_call)  # nothing left behind
    assert all(torch.equal(value, base_state[key]) for key, value in dm.state_dict().items())


def test_weights_stored_in_a_dtype_the_device_does_not_compute_in_are_cast(pack, monkeypatch):
    """fp16 storage on a CPU: ComfyUI computes in fp32 (manual cast); the loaded INT8 model does the same."""
    detect_tiny(monkeypatch, "sd15")
    model = build_tiny_model("sd15")
    dm = model.model.diffusion_model
    sd = int8_state_dict(dm.state_dict().items(), all_int8_layers(dm))
    as_fp32 = load_int8_state_dict(dict(sd))
    as_fp16 = load_int8_state_dict(dict(sd), model_options={"dtype": torch.float16})
    assert as_fp16.model.get_dtype() == torch.float16 and as_fp16.model.manual_cast_dtype == torch.float32
    float_layers = [m for m in as_fp16.model.diffusion_model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert float_layers and all(m.weight.dtype == torch.float16 and m.comfy_cast_weights for m in float_layers)
    out = sample(as_fp16, "sd15", steps=2)
    assert out.dtype == torch.float32 and rel(out, sample(as_fp32, "sd15", steps=2)) < 1e-2


# --- Save INT8 Model ------------------------------------------------------------------------------------------------

def test_save_node_declares_its_inputs(pack):
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelSaveModel"]
    assert pack.NODE_DISPLAY_NAME_MAPPINGS["Int8AccelSaveModel"] == "Save INT8 Model"
    spec = node.INPUT_TYPES()
    required, optional = spec["required"], spec["optional"]
    assert list(required) == ["model", "filename_prefix", "bake_lora", "int8_layers"]
    assert required["filename_prefix"][1]["default"] == "int8/diffusion_model"
    assert required["int8_layers"][1]["options"] == ["every accurate layer (smallest file)", "only layers faster in INT8"]
    assert required["int8_layers"][1]["default"] == "every accurate layer (smallest file)"  # a file for memory
    assert "int8_layers='all' is not one of" in node.validate_inputs(int8_layers="all")
    assert required["bake_lora"][0] == "BOOLEAN" and required["bake_lora"][1]["default"] is False
    # a sampler's LATENT output, only to make ComfyUI run the save after that sampler (it runs output nodes first)
    assert list(optional) == ["after_sampling"] and optional["after_sampling"][0] == "LATENT"
    assert "after that sampler" in optional["after_sampling"][1]["tooltip"]
    assert node.GET_SCHEMA().is_output_node is True


def test_save_needs_a_quantized_calibrated_model(pack, models_dir):
    from comfyui_int8_accel.nodes.int8_files.save import save_int8_model

    model = build_tiny_model("sd15")
    with pytest.raises(ValueError, match="did not go through Quantize Model"):
        save_int8_model(model)
    quantized, _ = apply_int8(model, settings_from_widgets(**ALL_INT8))
    with pytest.raises(ValueError, match=r"run a sampler with this model first \(calibration happens on the first "
                                         r"sampling step\)\. In the same workflow, connect that sampler's LATENT "
                                         r"output to after_sampling"):
        save_int8_model(quantized)
    # wired after a sampler that sampled another model: the message says which link is wrong
    save_node = pack.NODE_CLASS_MAPPINGS["Int8AccelSaveModel"]
    with pytest.raises(ValueError, match="the sampler connected to after_sampling did not sample with this model"):
        save_node.execute(model=quantized, filename_prefix="int8/tiny", bake_lora=False,
                          after_sampling={"samples": torch.zeros(1, 4, 8, 8)})
    assert not list(models_dir.rglob("*.safetensors"))


def test_save_writes_every_accurate_layer_by_default_and_only_the_faster_ones_on_request(pack, models_dir,
                                                                                       monkeypatch):
    """With the speed gate on and layers that run faster in float, the default file still holds every layer within
    the error thresholds in INT8 (a file for memory); the other choice holds only the layers the gate kept."""
    import os

    from safetensors import safe_open

    from comfyui_int8_accel.nodes.int8 import int8_plan
    from comfyui_int8_accel.nodes.int8 import plan as plan_module
    from comfyui_int8_accel.nodes.int8.speed import Timing
    from comfyui_int8_accel.nodes.int8_files.save import FASTER_ONLY, SMALLEST_FILE, save_int8_model

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "1")
    first = iter([Timing(float_seconds=2.0, int8_seconds=1.0)])  # one call signature faster in INT8, others not
    monkeypatch.setattr(plan_module, "time_float_and_int8",
                        lambda *args, **kwargs: next(first, Timing(float_seconds=1.0, int8_seconds=2.0)))
    quantized = apply_int8(build_tiny_model("sd15"), settings_from_widgets(**ALL_INT8))[0]
    sample(quantized, "sd15", steps=2)
    result = int8_plan(quantized).last_result
    kept, accurate = set(result.chosen), set(result.within_thresholds)
    assert kept and kept < accurate
    assert all(layer.decision == "float: slower in INT8" for layer in result.layers if layer.name in accurate - kept)

    def int8_layers_of(path) -> tuple[set[str], dict]:
        with safe_open(str(path), "pt") as file:
            return {key.rsplit(".", 1)[0] for key in file.keys() if key.endswith(".comfy_quant")}, file.metadata()

    smallest_path = save_int8_model(quantized, "int8/smallest")
    faster_path = save_int8_model(quantized, "int8/faster", int8_layers=FASTER_ONLY)
    smallest, smallest_meta = int8_layers_of(smallest_path)
    faster, faster_meta = int8_layers_of(faster_path)
    assert smallest == accurate and faster == kept
    assert smallest_meta["int8_accel.int8_layers"] == SMALLEST_FILE and faster_meta["int8_accel.int8_layers"] == FASTER_ONLY
    counts = [int(smallest_meta[f"int8_accel.int8_{kind}"]) for kind in ("linear", "conv")]
    assert sum(counts) == len(accurate)
    assert os.path.getsize(smallest_path) < os.path.getsize(faster_path)
    with pytest.raises(ValueError, match="int8_layers='some' is not one of"):
        save_int8_model(quantized, "int8/bad", int8_layers="some")


def test_save_then_load_round_trip_with_and_without_lora(pack, models_dir, monkeypatch):
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8 import int8_plan
    from comfyui_int8_accel.nodes.int8_files.save import save_int8_model

    detect_tiny(monkeypatch, "sd15")
    model = build_tiny_model("sd15")
    dm = model.model.diffusion_model
    base_state = {key: value.clone() for key, value in dm.state_dict().items()}
    expected = all_int8_layers(dm)  # the original weights, quantized as the plan does
    settings = settings_from_widgets(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    lora = make_lora(model, layers=6, scale=1.0)
    quantized = apply_lora(apply_int8(model, settings)[0], lora)
    on_the_fly = sample(quantized, "sd15", steps=2)  # calibrates on its first step
    plan = int8_plan(quantized)
    chosen = plan.last_result.chosen

    pack.NODE_CLASS_MAPPINGS["Int8AccelSaveModel"].execute(model=quantized, filename_prefix="int8/tiny",
                                                          bake_lora=False, after_sampling={"samples": on_the_fly})
    (plain_path,) = models_dir.glob("int8/tiny_*.safetensors")
    baked_path = save_int8_model(quantized, "int8/tiny_baked", bake_lora=True)

    plain, meta = load_int8_diffusion_model(str(plain_path))
    resident = int8_resident_layers(plain.model.diffusion_model)
    assert sorted(resident) == sorted(chosen) and len(chosen) == len(expected)
    assert all(torch.equal(resident[name].weight, expected[name].weight) for name in chosen)
    assert meta["int8_accel.report"] == plan.last_report and meta["int8_accel.bake_lora"] == "false"
    assert json.loads(meta["int8_accel.settings"])["compute_density_threshold"] == 0

    baked, meta = load_int8_diffusion_model(baked_path)
    assert meta["int8_accel.bake_lora"] == "true"
    lora_layers = {key.removeprefix("diffusion_model.").removesuffix(".lora_up.weight") for key in lora
                   if key.endswith(".lora_up.weight")}
    baked_layers = int8_resident_layers(baked.model.diffusion_model)
    assert all(not torch.equal(baked_layers[name].weight, expected[name].weight) for name in lora_layers)
    # the baked file computes what the quantized model with its LoRA computes; the plain one plus the LoRA is close
    assert rel(sample(baked, "sd15", steps=2), on_the_fly) < 1e-3
    plain_with_lora = sample(apply_lora(plain, lora), "sd15", steps=2)
    plain_out = sample(plain, "sd15", steps=2)
    assert rel(plain_with_lora, on_the_fly) < rel(plain_out, on_the_fly)

    comfy.model_management.unload_all_models()  # ComfyUI leaves the last run's patches applied until then
    assert all(torch.equal(value, base_state[key]) for key, value in dm.state_dict().items())


def test_layers_built_without_comfy_ops_load_as_int8_too(comfy_root, monkeypatch):
    """A model may build a layer with plain torch.nn.Linear (ComfyUI's ops never see it): its INT8 entries still
    load as an INT8 layer, and entries of no layer at all are an error."""
    import comfy.model_detection

    def config_with_a_plain_layer(sd, prefix, use_base_if_no_match=False, metadata=None):
        cfg = tiny_model_config("flux")
        get_model = cfg.get_model

        def build(*args, **kwargs):
            base = get_model(*args, **kwargs)
            old = base.diffusion_model.final_layer.linear
            base.diffusion_model.final_layer.linear = torch.nn.Linear(old.in_features, old.out_features)
            return base
        cfg.get_model = build
        return cfg

    monkeypatch.setattr(comfy.model_detection, "model_config_from_unet", config_with_a_plain_layer)
    model = build_tiny_model("flux")
    dm = model.model.diffusion_model
    layers = all_int8_layers(dm)
    loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), layers))
    resident = int8_resident_layers(loaded.model.diffusion_model)
    assert sorted(resident) == sorted(layers) and isinstance(resident["final_layer.linear"], Int8Linear)
    on_the_fly = sample(apply_int8(model, settings_from_widgets(**ALL_INT8))[0], "flux", steps=2)
    assert rel(sample(loaded, "flux", steps=2), on_the_fly) < 1e-3

    sd = int8_state_dict(dm.state_dict().items(), layers)
    sd["not_a_layer.weight"], sd["not_a_layer.weight_scale"] = torch.ones(2, 2, dtype=torch.int8), torch.ones(2)
    with pytest.raises(ValueError, match="not Linear/Conv2d layers of this model.*not_a_layer"):
        load_int8_state_dict(sd)


def test_the_smallest_file_holds_the_layers_the_kernel_size_floor_kept_float(pack, models_dir, monkeypatch):
    """Issue 28, 'the smallest INT8 file is no longer the smallest'. With the cpu backend's own Linear floors every
    Linear of the tiny SD1.5 computes in float here, and calibration keeps it float ('kernel size floor'); that is a
    fact about this device, not about the file: the default save (`every accurate layer (smallest file)`) writes
    every layer that passes kind, density and error in INT8, the floored Linears included (their error is that of
    the INT8 arithmetic, measured with the reference kernels), and the faster-only file leaves them float."""
    from safetensors import safe_open

    from comfyui_int8_accel.kernels import cpu
    from comfyui_int8_accel.nodes.int8 import int8_plan
    from comfyui_int8_accel.nodes.int8_files.save import FASTER_ONLY, save_int8_model

    monkeypatch.setattr(cpu, "LINEAR_MIN_MACS", cpu.DEFAULT_LINEAR_MIN_MACS)
    monkeypatch.setattr(cpu, "MIN_REDUCTION", cpu.DEFAULT_MIN_REDUCTION)
    quantized = apply_int8(build_tiny_model("sd15"), settings_from_widgets(**ALL_INT8))[0]
    sample(quantized, "sd15", steps=1)
    result = int8_plan(quantized).last_result
    floored = {layer.name for layer in result.layers if layer.below_kernel_floor}
    linears = {layer.name for layer in result.layers if layer.kind == "linear"}
    assert linears and linears <= floored and not floored & set(result.chosen)
    assert all(layer.error is not None and layer.error < 0.05 for layer in result.layers if layer.name in floored)

    def int8_layers_of(path) -> set[str]:
        with safe_open(str(path), "pt") as file:
            return {key.rsplit(".", 1)[0] for key in file.keys() if key.endswith(".comfy_quant")}

    smallest = int8_layers_of(save_int8_model(quantized, "int8/smallest_floor"))
    faster = int8_layers_of(save_int8_model(quantized, "int8/faster_floor", int8_layers=FASTER_ONLY))
    assert smallest == {layer.name for layer in result.layers} and floored <= smallest
    assert faster == set(result.chosen) and not floored & faster
