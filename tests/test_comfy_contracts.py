"""The ComfyUI weight-management contracts (`nodes/comfy_contracts.py`) and the INT8 layers on each of them.

ComfyUI 0.3.75 runs its own contracts; ComfyUI 0.38.1's are swapped in one at a time from
`tests/support/comfy038.py`, each a copy of the 0.38.1 function it names, with 0.3.75's behaviour as the control.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from comfyui_int8_accel.kernels import record_calls
from comfyui_int8_accel.nodes import comfy_contracts
from comfyui_int8_accel.nodes.int8 import apply_int8, settings_from_widgets
from comfyui_int8_accel.nodes.int8.modules import Int8Linear
from comfyui_int8_accel.nodes.int8_files.checkpoint import int8_state_dict, layer_tensors
from comfyui_int8_accel.nodes.int8_files.loader import int8_resident_layers, load_int8_state_dict
from harness.tiny_models import build_tiny_model, detect_tiny, latent_channels, make_conditioning, sample
from tests.support import comfy038
from tests.support.int8_checks import ALL_INT8, WEIGHT_ERROR_SCALE, all_int8_layers, rel
from tests.support.lora import apply_lora, lora_for_shapes, make_lora

pytestmark = pytest.mark.usefixtures("calibration_cache")

# How ComfyUI hands LoRA to a layer: merged into the weight at load; per forward through 0.3.75's LowVramPatch
# (calls convert_func) or 0.38.1's (never does), both in `weight_function`; or through 0.38.1's dynamic VRAM
# (`weight_lowvram_function`).
CONTRACTS = ("merged", "lowvram_0.3.75", "lowvram_0.38", "dynamic_vram_0.38")


def test_contracts_are_detected_by_feature(comfy_root, monkeypatch):
    """0.3.75 offers the LowVramPatch that converts, no dynamic VRAM, no cached_patcher_init, no
    lora_compute_dtype; swapping in 0.38.1's LowVramPatch.__call__ flips exactly that detection."""
    found = comfy_contracts.detect()
    assert found.lowvram_patch_calls_convert and not found.dynamic_vram
    assert not found.cached_patcher_init and not found.lora_compute_dtype
    assert comfy_contracts.lora_compute_dtype(torch.device("cpu")) == torch.float32
    with comfy038.lowvram_patch_without_convert(monkeypatch):
        assert not comfy_contracts.detect().lowvram_patch_calls_convert


def _model_call(patcher, contract: str, monkeypatch, calls: int = 1) -> tuple[torch.Tensor, int]:
    """The output of the `calls`-th model call of `patcher` under `contract` (on-the-fly INT8 calibrates on its
    first call), and how many INT8 kernel calls ran the W8A8 arithmetic in the last one."""
    if contract == "dynamic_vram_0.38":
        return comfy038.model_call(patcher, monkeypatch, dynamic=True, calls=calls)
    converting = comfy038.lowvram_patch_without_convert(monkeypatch) if contract == "lowvram_0.38" else (
        contextlib.nullcontext())
    with converting:
        return comfy038.model_call(patcher, monkeypatch, dynamic=False, lowvram=contract != "merged", calls=calls)


def _assert_lora_honoured(results: dict, float_lora: torch.Tensor, plain: torch.Tensor, int8_error: float) -> None:
    for contract, (out, int8_calls) in results.items():
        assert int8_calls > 0, contract  # it really ran in INT8
        # the LoRA adds no error beyond one more rounding on top of INT8's own at this weight width
        assert rel(out, float_lora) < 1.5 * int8_error + 1e-3, (contract, rel(out, float_lora), int8_error)
        assert rel(out, plain) > 0.01, contract  # and it took effect


def test_lora_on_the_fly_int8_on_every_contract(comfy_root, monkeypatch, weight_width):
    """Quantize Model (INT8) with a LoRA before it: the INT8 layers are built from the float layers' weights with
    the LoRA in whatever form ComfyUI left it (merged, weight_function, weight_lowvram_function)."""
    base = build_tiny_model("sd15")
    lora = make_lora(base, layers=8, scale=2.0)
    settings = settings_from_widgets(**ALL_INT8)
    float_lora, _ = _model_call(apply_lora(base, lora), "merged", monkeypatch)
    plain, _ = _model_call(apply_int8(base, settings)[0], "merged", monkeypatch, calls=2)
    results = {contract: _model_call(apply_int8(apply_lora(base, lora), settings)[0], contract, monkeypatch, calls=2)
               for contract in CONTRACTS}
    int8_error = rel(results["merged"][0], float_lora)
    _assert_lora_honoured(results, float_lora, plain, int8_error)
    # the same int8 weights whichever way the LoRA came in
    for contract in CONTRACTS:
        assert torch.allclose(results[contract][0], results["merged"][0], rtol=1e-4, atol=1e-4), contract


def test_lora_on_loaded_int8_on_every_contract(comfy_root, monkeypatch, weight_width):
    """Load Diffusion Model (INT8), then a LoRA: every contract computes float + LoRA up to INT8's error. Before,
    0.38.1's LowVramPatch added the LoRA to unscaled int8 values and dynamic VRAM dropped it."""
    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)))
    lora = make_lora(base, layers=8, scale=2.0)
    float_lora, _ = _model_call(apply_lora(base, lora), "merged", monkeypatch)
    on_the_fly = apply_int8(apply_lora(base, lora), settings_from_widgets(**ALL_INT8))[0]
    int8_error = rel(_model_call(on_the_fly, "merged", monkeypatch, calls=2)[0], float_lora)
    plain, _ = _model_call(loaded, "merged", monkeypatch)
    results = {contract: _model_call(apply_lora(loaded, lora), contract, monkeypatch) for contract in CONTRACTS}
    _assert_lora_honoured(results, float_lora, plain, int8_error)
    assert torch.equal(_model_call(loaded, "merged", monkeypatch)[0], plain)  # nothing left behind


def test_save_bakes_lora_without_asking_comfyui_to_patch(comfy_root, monkeypatch, tmp_path):
    """Save INT8 Model computes the merged weights itself: with `load_models_gpu` asserting against
    `force_patch_weights` as 0.38.1's ModelPatcherDynamic.load does, `bake_lora` writes float + LoRA quantized and
    the plain save writes the original weights quantized, although the last sampling left the LoRA merged into the
    live weights."""
    import comfy.model_management
    import comfy.utils

    from comfyui_int8_accel.nodes.int8_files.save import save_int8_model

    load_models_gpu = comfy.model_management.load_models_gpu

    def asserting_load(models, *args, force_patch_weights: bool = False, **kwargs):
        comfy038.dynamic_load_asserts(models, force_patch_weights=force_patch_weights)
        return load_models_gpu(models, *args, **kwargs)

    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    original = all_int8_layers(dm)
    lora = make_lora(base, layers=6, scale=1.0)
    merged = apply_lora(base, lora)
    merged.patch_model(device_to=torch.device("cpu"))
    try:
        expected_baked = all_int8_layers(dm)
    finally:
        merged.unpatch_model(device_to=torch.device("cpu"))
    lora_layers = {key.removeprefix("diffusion_model.").removesuffix(".lora_up.weight") for key in lora
                   if key.endswith(".lora_up.weight")}

    monkeypatch.setattr(comfy.model_management, "load_models_gpu", asserting_load)
    quantized = apply_lora(apply_int8(base, settings_from_widgets(**ALL_INT8))[0], lora)
    sample(quantized, "sd15", steps=1)  # calibrates; ComfyUI leaves the LoRA merged into the live weights
    # the LoRA is merged into the live weights; their originals are in ComfyUI's backup
    assert all(f"diffusion_model.{name}.weight" in base.backup for name in lora_layers)
    assert not any(torch.equal(dm.get_submodule(name).weight, base.backup[f"diffusion_model.{name}.weight"].weight)
                   for name in lora_layers)
    for bake, expected in ((True, expected_baked), (False, original)):
        path = save_int8_model(quantized, f"int8/bake_{bake}", bake_lora=bake, output_dir=str(tmp_path))
        sd = comfy.utils.load_torch_file(path)
        assert sorted(name for name in expected if f"{name}.weight_scale" in sd) == sorted(expected)
        for name, layer in expected.items():
            for suffix, value in layer_tensors(layer).items():
                assert torch.equal(sd[f"{name}.{suffix}"], value), (bake, name, suffix)
        assert all(not torch.equal(expected_baked[name].weight, original[name].weight) for name in lora_layers)
    comfy.model_management.unload_all_models()


def test_loaded_model_can_be_rebuilt_by_comfyui(pack, request, monkeypatch):
    """Load Diffusion Model (INT8) sets `cached_patcher_init` as core's loaders do in 0.38.1 (comfy/sd.py,
    `load_diffusion_model`: `(load_diffusion_model, (unet_path, model_options))`), which
    `ModelPatcher.clone(disable_dynamic=True)` calls with `disable_dynamic=True` and `deepclone_multigpu` without:
    both rebuild an equivalent INT8 model of their own."""
    import comfy.utils

    models_dir = request.getfixturevalue("models_dir")  # the loader node's diffusion_models folder
    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    comfy.utils.save_torch_file(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)),
                                str(models_dir / "tiny.safetensors"))
    loaded = pack.NODE_CLASS_MAPPINGS["Int8AccelLoadModel"].execute(unet_name="tiny.safetensors").result[0]
    factory, args = loaded.cached_patcher_init
    expected, int8_calls = _model_call(loaded, "merged", monkeypatch)
    assert int8_calls > 0
    for rebuilt in (factory(*args, disable_dynamic=True), factory(*args)):
        assert rebuilt.model is not loaded.model
        assert rebuilt.cached_patcher_init == loaded.cached_patcher_init
        layers, originals = int8_resident_layers(rebuilt.model.diffusion_model), int8_resident_layers(
            loaded.model.diffusion_model)
        assert sorted(layers) == sorted(originals)
        assert all(torch.equal(layers[name].weight, originals[name].weight) for name in layers)
        out, int8_calls = _model_call(rebuilt, "merged", monkeypatch)
        assert int8_calls > 0 and torch.equal(out, expected)


def test_small_loaded_int8_layers_survive_the_force_cast_load(comfy_root, monkeypatch):
    """0.38.1's ModelPatcherDynamic.load force-loads layers of 16 KiB or less through
    `patch_weight_to_device(key, force_cast=True)` (comfy/model_patcher.py, swapped in from comfy038), which hands
    `convert_weight` the stored int8 weight with `inplace=True`: the layer takes it and stays the same INT8 layer."""
    import comfy.model_management

    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)))
    before, _ = _model_call(loaded, "merged", monkeypatch)
    resident = int8_resident_layers(loaded.model.diffusion_model)
    small = {name: layer for name, layer in resident.items()
             if comfy.model_management.module_size(layer) <= comfy038.SMALL_LAYER_BYTES}
    assert small
    dequantized = {name: layer.weight.float() * layer.weight_scale.view(-1, *[1] * (layer.weight.ndim - 1))
                   for name, layer in small.items()}
    for name in small:
        comfy038.patch_weight_to_device(loaded, f"diffusion_model.{name}.weight", device_to=torch.device("cpu"),
                                        force_cast=True)
    for name, layer in small.items():
        assert layer.weight.dtype == torch.int8
        now = layer.weight.float() * layer.weight_scale.view(-1, *[1] * (layer.weight.ndim - 1))
        assert torch.allclose(now, dequantized[name], rtol=1e-5, atol=1e-7), name
    out, int8_calls = _model_call(loaded, "merged", monkeypatch)  # its unpatch restores ComfyUI's backups
    assert int8_calls > 0 and rel(out, before) < 1e-4
    assert torch.equal(_model_call(loaded, "merged", monkeypatch)[0], before)


def test_compiled_blocks_run_eagerly_where_comfyui_manages_weights_per_forward(pack, monkeypatch):
    """Compile Model's blocks strategy (forced, on the tiny SD1.5): under 0.38.1's dynamic VRAM (comfy038's
    emulation of ModelPatcherDynamic.load: VBAR slots, LoRA in `weight_lowvram_function`, 0.38.1's streamed cast)
    the blocks run eagerly, with the LoRA, instead of compiling ComfyUI's streaming into their graphs; loaded the
    ordinary way the same compiled model runs its blocks compiled."""
    import importlib

    from tests.support.counting_backend import COUNTING, UNET_WIDTH, graph_runs, register_counting_backend

    register_counting_backend()
    cm = importlib.import_module("comfyui_int8_accel.nodes.compile")
    monkeypatch.setenv(cm.STRATEGY_ENV, "blocks")
    with torch.inference_mode():
        base = build_tiny_model("sd15", unet_config=UNET_WIDTH)
    compiled = cm.compile_model(base, cm.CompileSettings(backend=COUNTING), strategy="blocks")
    lora = make_lora(base, layers=8, scale=2.0)

    runs = sum(graph_runs.values())
    merged, _ = _model_call(apply_lora(compiled, lora), "merged", monkeypatch)
    assert sum(graph_runs.values()) > runs  # the control: blocks compiled
    eager, _ = _model_call(apply_lora(base, lora), "dynamic_vram_0.38", monkeypatch)
    assert rel(eager, merged) < 1e-4  # the emulation computes float + LoRA
    runs = sum(graph_runs.values())
    streamed, _ = _model_call(apply_lora(compiled, lora), "dynamic_vram_0.38", monkeypatch)
    assert sum(graph_runs.values()) == runs  # not one block ran compiled
    assert rel(streamed, eager) < 1e-5


def test_fused_input_activation_with_fp16_accumulation_runs_the_int8_layer(comfy_root, weight_width):
    """ComfyUI 0.38.1's `linear_input_act` (Qwen-Image 2.1's feed-forward) with fp16 accumulation on took an
    Int8Linear's weight through `cast_bias_weight`, int8 values without their scale; the layer now asks for
    full-precision matmul there, so the function calls it and it runs in INT8 (comfy038.linear_input_act)."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(256, 256, generator=gen) * 0.05, torch.randn(256, generator=gen)
    layer = Int8Linear(weight, bias)
    x = torch.randn(64, 512, generator=gen)
    gate, up = x.chunk(2, dim=-1)
    reference = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weight, bias)
    for fp16_accumulation in (False, True):
        with torch.inference_mode(), record_calls() as counted:
            out = comfy038.linear_input_act(layer, x, "swiglu", fp16_accumulation=fp16_accumulation)
        assert sum(n for (op, backend, path), n in counted.items() if path == "int8") > 0, fp16_accumulation
        assert rel(out, reference) < 0.02 * WEIGHT_ERROR_SCALE[weight_width], fp16_accumulation


def test_core_save_nodes_write_a_loaded_int8_model_in_the_int8_format(comfy_root, monkeypatch, tmp_path):
    """Issue 28 item 1. ComfyUI 0.38.1's Save Checkpoint / ModelSave (comfy/sd.py `save_checkpoint`, stored copy of
    commit 033046cc4fac82d954c6daedccf1c8128433c4f1: `load_models_gpu(load_models)` then the patcher's
    `state_dict_for_saving`) call `ModelPatcher.model_state_dict_for_saving` (comfy/model_patcher.py, stored copy of
    commit 08d0e510f4e539a1db39072589817136ac6cfa7d, swapped in from comfy038 with its `LazyCastingParam` and
    `patch_weight_to_device`), which wraps each weight of a layer the load did not patch (every layer under dynamic
    VRAM; here a model not loaded) in a `LazyCastingParam`: for an int8 weight that raised "Only Tensors of
    floating point ... can require gradients". With what importing the pack does on such a ComfyUI, the dict it
    returns holds every INT8 layer in ComfyUI's INT8 format, its LoRA merged and requantized: the file loads back
    to the same INT8 layers (bit for bit without LoRA), computes what the model computed, and core 0.38 reads its
    Linear layers with their scale and refuses its Conv2d layers."""
    import importlib

    import comfy.utils

    from tests.support.comfy038_quant import core_038_reading

    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    file_sd = int8_state_dict(dm.state_dict().items(), all_int8_layers(dm))
    loaded = load_int8_state_dict(dict(file_sd))
    names = set(int8_resident_layers(loaded.model.diffusion_model))
    lora = make_lora(base, layers=8, scale=2.0)
    expected = {"plain": _model_call(loaded, "merged", monkeypatch)[0],
                "lora": _model_call(apply_lora(loaded, lora), "merged", monkeypatch)[0]}
    pack_nodes = importlib.import_module("comfyui_int8_accel.nodes")
    saved = {}
    with comfy038.core_save_038(monkeypatch):
        for hook in pack_nodes.COMFY_IMPORT_HOOKS:  # what importing the pack does on a 0.38
            hook()
        for label, patcher in (("plain", loaded), ("lora", apply_lora(loaded, lora))):
            sd = patcher.model_state_dict_for_saving(patcher.model.diffusion_model, "diffusion_model.")
            comfy.utils.save_torch_file(sd, str(tmp_path / f"{label}.safetensors"))  # safetensors runs the casts
            saved[label] = comfy.utils.load_torch_file(str(tmp_path / f"{label}.safetensors"))
    plain = saved["plain"]
    assert {key.removesuffix(".comfy_quant") for key in plain if key.endswith(".comfy_quant")} == names
    assert sorted(plain) == sorted(file_sd)
    assert all(torch.equal(plain[key], value) for key, value in file_sd.items())  # the loaded file, bit for bit
    verdicts = core_038_reading(plain, dm)
    assert all(verdicts[name] == "read with its scale" for name in names if dm.get_submodule(name).weight.ndim == 2)
    assert all(verdicts[name].startswith("refused") for name in names if dm.get_submodule(name).weight.ndim == 4)
    for label, sd in saved.items():
        again = load_int8_state_dict(dict(sd))
        assert set(int8_resident_layers(again.model.diffusion_model)) == names
        out, int8_calls = _model_call(again, "merged", monkeypatch)
        assert int8_calls > 0
        assert rel(out, expected[label]) < 1e-3, (label, rel(out, expected[label]))
    assert rel(expected["lora"], expected["plain"]) > 0.01  # the LoRA took effect, and is in the file


def _dm(patcher) -> torch.nn.Module:
    return patcher.model.diffusion_model


def _dynamic_prompt(patcher, monkeypatch) -> tuple[torch.Tensor, int]:
    """One prompt under 0.38.1's dynamic VRAM: `partially_load` (which starts `load` with
    `restore_loaded_backups`), then a model call; the model stays loaded, as between prompts there."""
    gen = torch.Generator().manual_seed(3)
    positive, _ = make_conditioning("sd15", batch=2)
    x, t = torch.randn(2, latent_channels("sd15"), 16, 16, generator=gen), torch.tensor([700.0, 700.0])
    with comfy038.dynamic_vram_casts(monkeypatch), torch.inference_mode():
        comfy038.partially_load(patcher)
        cond = patcher.model.extra_conds(noise=x, cross_attn=positive[0][0], **positive[0][1])
        cond = {key: value.cond if hasattr(value, "cond") else value for key, value in cond.items()}
        with record_calls() as counted:
            out = patcher.model.apply_model(x, t, transformer_options={"wrappers": patcher.wrappers}, **cond)
    return out, sum(n for (op, backend, path), n in counted.items() if path == "int8")


def test_small_loaded_int8_layers_with_lora_compute_the_same_on_the_second_dynamic_vram_prompt(comfy_root,
                                                                                                monkeypatch):
    """ComfyUI 0.38.1's `ModelPatcherDynamic.load` (comfy/model_patcher.py, stored copy of commit
    08d0e510f4e539a1db39072589817136ac6cfa7d; `comfy038.dynamic_load`) force-loads layers of 16 KiB or less
    through `patch_weight_to_device(force_cast=True)`: the LoRA'd INT8 layer's `set_weight` installs a requantized
    weight and a fresh `weight_scale` buffer; only then does its `named_buffers` loop record `backup_buffers`,
    so the fresh scale is what it backs up. The next `load` (the next prompt) and an unload start with
    `restore_loaded_backups`: the original int8 weight by `set_attr_param`, then that fresh scale by
    `set_attr_buffer` (register_buffer). Before, the layer then held the original weight with the requantized
    weight's scale: the second prompt dequantized it wrongly and added the LoRA on top of that, and after an
    unload the LoRA-free model computed with it too. The layer now refuses a scale restore that does not belong
    to its weight."""
    import comfy.model_management

    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)))
    small = {name: tuple(layer.weight.shape) for name, layer in int8_resident_layers(_dm(loaded)).items()
             if comfy.model_management.module_size(layer) <= comfy038.SMALL_LAYER_BYTES}
    assert len(small) >= 3
    lora = lora_for_shapes(dict(list(small.items())[:6]), scale=2.0)
    float_lora, _ = _model_call(apply_lora(base, lora), "merged", monkeypatch)
    plain, _ = _model_call(loaded, "merged", monkeypatch)
    merged, _ = _model_call(apply_lora(loaded, lora), "merged", monkeypatch)  # 0.3.75 merges LoRA at load
    int8_error = rel(merged, float_lora)

    patched = apply_lora(loaded, lora)
    first, first_int8 = _dynamic_prompt(patched, monkeypatch)
    second, second_int8 = _dynamic_prompt(patched, monkeypatch)
    assert first_int8 > 0 and second_int8 > 0  # the INT8 kernels really ran
    assert rel(first, merged) < 1e-4  # the first prompt is right: LoRA on the original weight, requantized
    assert rel(first, plain) > 0.01  # the LoRA took effect
    assert rel(second, first) < 1e-5, rel(second, first)  # and the second computes the same
    assert rel(second, float_lora) < 1.5 * int8_error + 1e-3

    comfy038.dynamic_unpatch_model(patched)  # an unload: restore_loaded_backups once more
    for name, layer in int8_resident_layers(_dm(loaded)).items():
        assert torch.equal(layer.weight_scale, layer.base_weight_scale), name
    assert torch.equal(_model_call(loaded, "merged", monkeypatch)[0], plain)  # nothing left behind
