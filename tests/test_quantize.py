"""The INT8 quantization node on tiny SD1.5, SDXL, Flux and SD3 models, in the real ComfyUI, in-process."""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

from comfyui_int8_accel.kernels import record_calls
from harness.tiny_models import build_tiny_model, sample
from tests.support.int8_checks import WEIGHT_ERROR_SCALE
from tests.support.lora import apply_lora, make_lora
from tests.support.workflows_common import report_table_rows

pytestmark = pytest.mark.usefixtures("calibration_cache")

KINDS = ["sd15", "sdxl", "flux", "sd3"]


@pytest.fixture(scope="module")
def modules(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.int8.modules")


def quantize(quant, model, **overrides):
    """The INT8 core with the node's widget values (defaults as the node has them)."""
    return quant.apply_int8(model, quant.settings_from_widgets(**overrides))


def plan_of(model):
    from comfyui_int8_accel.nodes.int8 import int8_plan

    plan = int8_plan(model)
    assert plan is not None, "the model carries no INT8 plan"
    return plan


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_node_declares_the_six_documented_parameters(pack):
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelQuantize"]
    spec = node.INPUT_TYPES()["required"]
    assert list(spec) == ["model", "bits", "quantize_conv", "quantize_linear", "conv_mse_threshold",
                          "linear_mse_threshold", "compute_density_threshold"]
    assert spec["bits"][0] == "INT" and spec["bits"][1]["default"] == 8
    assert spec["quantize_conv"][0] == "COMBO" and spec["quantize_conv"][1]["options"] == ["enable", "disable"]
    assert spec["conv_mse_threshold"][1]["default"] == 0.1 and spec["linear_mse_threshold"][1]["max"] == 1.0
    assert spec["compute_density_threshold"][1]["default"] == 300
    assert all(options.get("tooltip") for _, options in spec.values())
    assert node.GET_NODE_INFO_V1()["output"] == ["MODEL", "STRING", "IMAGE"]
    assert spec["bits"][1]["min"] == spec["bits"][1]["max"] == 8  # the page offers only what is supported


def test_bits_other_than_8_get_a_clear_error(comfy_root, quant, pack):
    model = build_tiny_model("sd15")
    with pytest.raises(ValueError, match="bits=4 is not supported: only bits=8"):
        quantize(quant, model, bits=4)
    # at validation time, so an API prompt gets node_errors instead of an execution error
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelQuantize"]
    widgets = dict(quantize_conv="enable", quantize_linear="disable")
    assert node.validate_inputs(bits=8, **widgets) is True
    assert "bits=5 is not supported: only bits=8" in node.validate_inputs(bits=5, **widgets)
    assert "quantize_conv='sometimes' is not one of" in node.validate_inputs(bits=8, quantize_conv="sometimes",
                                                                          quantize_linear="enable")


def test_threshold_zero_quantizes_nothing_and_output_is_bit_identical(comfy_root, quant):
    model = build_tiny_model("sd15")
    before = sample(model, "sd15")
    out, report = quantize(quant, model, conv_mse_threshold=0.0, linear_mse_threshold=0.0)
    assert "Nothing to quantize" in report
    assert torch.equal(sample(out, "sd15"), before)


@pytest.mark.parametrize("kind", KINDS)
def test_threshold_one_density_zero_quantizes_every_eligible_layer(comfy_root, quant, modules, kind, monkeypatch,
                                                                   weight_width):
    # 128 px: large enough that the cpu backend runs its INT8 kernels on a good share of the tiny layers
    size = dict(height=128, width=128)
    model = build_tiny_model(kind)
    reference = sample(model, kind, steps=3, **size)
    out, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)

    called = set()
    for cls in (modules.Int8Linear, modules.Int8Conv2d):
        original = cls.forward

        def counting(self, x, _original=original):
            called.add(id(self))
            return _original(self, x)
        monkeypatch.setattr(cls, "forward", counting)

    with record_calls() as calls:
        result = sample(out, kind, steps=3, **size)
    plan = plan_of(out)
    layers = plan.last_result.layers
    assert layers and all(layer.decision == "int8" for layer in layers)
    assert {id(m) for m in plan._modules.values()} == called  # the report matches what actually ran
    assert len(called) == len(layers)
    assert f"{len(layers)}/{len(layers)} layers in INT8" in plan.last_report
    assert all(layer.qmax == {8: 127, 7: 63}[weight_width] for layer in plan._modules.values())
    int8_kernel_calls = sum(n for (_, _, path), n in calls.items() if path == "int8")
    assert int8_kernel_calls > 0, calls  # the INT8 arithmetic really ran, not only INT8-rounded weights
    assert f"{plan.last_result.kernel_calls['int8']} INT8 layer calls ran the INT8 kernels" in plan.last_report
    assert torch.isfinite(result).all()
    assert 0 < relative_error(result, reference) < 0.05 * WEIGHT_ERROR_SCALE[weight_width]
    assert not torch.equal(result, reference)


def test_disable_leaves_that_kind_untouched(comfy_root, quant):
    model = build_tiny_model("sd15")
    out, _ = quantize(quant, model, quantize_conv="disable", conv_mse_threshold=1.0, linear_mse_threshold=1.0,
                      compute_density_threshold=0)
    sample(out, "sd15", steps=2)
    layers = plan_of(out).last_result.layers
    convs = [layer for layer in layers if layer.kind == "conv"]
    linears = [layer for layer in layers if layer.kind == "linear"]
    assert convs and all(layer.decision == "float: kind disabled" for layer in convs)
    assert linears and all(layer.decision == "int8" for layer in linears)


def test_thresholds_bite_per_layer(comfy_root, quant):
    model = build_tiny_model("sd15")
    out, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    sample(out, "sd15", steps=2)
    errors = sorted(layer.error for layer in plan_of(out).last_result.layers)
    middle = (errors[len(errors) // 2 - 1] + errors[len(errors) // 2]) / 2
    out2, _ = quantize(quant, model, conv_mse_threshold=middle, linear_mse_threshold=middle,
                       compute_density_threshold=0)
    sample(out2, "sd15", steps=2)
    result = plan_of(out2).last_result
    layers = result.layers
    # Above the threshold: float by the error gate. At or below: INT8, unless the whole-model guard (which acts at
    # 5% of the threshold, so it bites here) returned the layer as one of the largest errors of a round.
    guard_floor = middle / 4 ** result.model_guard.get("rounds", 0)
    for layer in layers:
        if layer.error > middle:
            assert layer.decision == "float: error above threshold", layer
        else:
            assert layer.decision == "int8" or (layer.decision == "float: whole-model error guard"
                                                and layer.error > guard_floor), layer
    assert 0 < len([layer for layer in layers if layer.decision == "int8"]) < len(layers)
    # Calibration keeps only the INT8 copies of layers that pass, and says what they cost.
    plan = plan_of(out2)
    chosen = plan.last_result.chosen
    assert sorted(plan._modules) == sorted(chosen)
    from comfyui_int8_accel.nodes.int8.plan import int8_module_bytes

    sizes = {name: int8_module_bytes(plan._modules[name]) for name in chosen}
    memory = plan.last_result.memory
    assert memory["int8_bytes"] == sum(sizes.values()) > 0
    largest_layer = max(layer.k * layer.n + 8 * layer.n for layer in layers)  # int8 weight + scale + bias
    assert memory["int8_bytes"] <= memory["calibration_peak_int8_bytes"] <= memory["int8_bytes"] + largest_layer
    assert memory["model_float_bytes"] == sum(p.numel() * p.element_size()
                                              for p in model.model.diffusion_model.parameters())
    assert "memory: diffusion-model weights" in plan.last_report
    # Density gate: a threshold above every layer's density keeps all of them in float, unmeasured.
    out3, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0,
                       compute_density_threshold=1_000_000)
    sample(out3, "sd15", steps=2)
    assert all(layer.decision == "float: density below threshold" and layer.error is None
               for layer in plan_of(out3).last_result.layers)
    assert plan_of(out3)._modules == {}


def test_speed_gate_keeps_int8_only_where_it_is_faster(comfy_root, quant, monkeypatch):
    """A layer whose INT8 call is made slow stays float, one whose float call is made slow runs INT8, and the report
    shows the timings the decisions came from."""
    import time

    from comfyui_int8_accel.nodes.int8.plan import Int8Plan

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "1")
    model = build_tiny_model("sd15")
    dm = model.model.diffusion_model
    slow_int8, slow_float = dm.input_blocks[0][0], dm.out[2]  # layers with a call signature of their own
    quantize_layer = Int8Plan._quantize_layer

    def slowed(module, kind, qmax=None, device=None):
        layer = quantize_layer(module, kind, qmax, device)
        if module is slow_int8:
            forward = layer.forward
            layer.forward = lambda x: (time.sleep(0.1), forward(x))[1]
        return layer

    float_forward = slow_float.forward
    monkeypatch.setattr(slow_float, "forward", lambda x: (time.sleep(0.1), float_forward(x))[1])
    monkeypatch.setattr(Int8Plan, "_quantize_layer", staticmethod(slowed))
    out, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    sample(out, "sd15", steps=2)
    plan = plan_of(out)
    rows = {layer.name: layer for layer in plan.last_result.layers}
    assert rows["input_blocks.0.0"].decision == "float: slower in INT8"
    assert rows["input_blocks.0.0"].int8_ms >= 100 and rows["out.2"].float_ms >= 100
    assert rows["out.2"].decision == "int8"
    assert all(layer.float_ms is not None for layer in rows.values() if layer.error is not None)
    assert "input_blocks.0.0" not in plan._modules and "out.2" in plan._modules
    report_rows = report_table_rows(plan.last_report)
    assert report_rows["input_blocks.0.0"][-2:] == ["speed", "float: slower in INT8"]
    assert report_rows["out.2"][-2:] == ["all passed", "int8"] and report_rows["out.2"][5] != "-"
    assert "speed gate:" in plan.last_report and "stay float as slower in INT8" in plan.last_report

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")  # off: a decision of its own, no timings
    off, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    sample(off, "sd15", steps=2)
    assert all(layer.float_ms is None and layer.decision == "int8" for layer in plan_of(off).last_result.layers)


def test_a_decision_from_noisy_timings_is_not_reused_from_disk(comfy_root, quant, monkeypatch):
    """A calibration whose speed gate timings other work disturbed to the end of their bound holds for the session
    that made it; a new node instance (or a restart) calibrates again instead of reading it from disk (a settled
    one is read from disk: test_calibration_cache_skips_second_run_and_recalibrates_on_change)."""
    from comfyui_int8_accel.nodes.int8 import plan as plan_module
    from comfyui_int8_accel.nodes.int8.speed import NOISY, Timing

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "1")
    budgets = []  # the re-measuring budget each timing was given

    def noisy_timing(*args, budget, **kwargs) -> Timing:
        budgets.append(budget)
        return Timing(2.0, 1.0, pairs=30, conditions=NOISY)

    monkeypatch.setattr(plan_module, "time_float_and_int8", noisy_timing)
    model = build_tiny_model("sd15")
    settings = dict(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    out, _ = quantize(quant, model, **settings)
    sample(out, "sd15")
    sample(out, "sd15")
    assert plan_of(out).calibration_runs == 1 and plan_of(out).last_result.noisy_timings  # kept for the session
    first_calibration = len(budgets)
    fresh, _ = quantize(quant, model, **settings)
    sample(fresh, "sd15")
    assert (plan_of(fresh).calibration_runs, plan_of(fresh).disk_hits) == (1, 0)
    # one budget per calibration, shared by its timings
    assert len({id(budget) for budget in budgets[:first_calibration]}) == 1 and first_calibration > 1
    assert budgets[-1] is not budgets[0] and len({id(budget) for budget in budgets[first_calibration:]}) == 1


def _int8_in_tree(patcher) -> list:
    from comfyui_int8_accel.nodes.int8.modules import _Int8Layer

    return [m for m in patcher.model.diffusion_model.modules() if isinstance(m, _Int8Layer)]


def test_unloading_the_model_takes_its_int8_layers_out_and_the_next_run_puts_the_same_ones_back(comfy_root, quant):
    """From the run after calibration the MODEL owns its INT8 layers (object patches): ComfyUI's unload takes them out
    of the tree (the float layers are back) and the next load puts the same layers in again, not rebuilt."""
    model = build_tiny_model("sd15")
    out, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    first = sample(out, "sd15", steps=2)  # calibrates, then swaps the copies in for the rest of the run
    assert torch.equal(sample(out, "sd15", steps=2), first)  # owned INT8 layers: the same output
    owned = {id(layer) for layer in _int8_in_tree(out)}
    assert len(owned) == len(plan_of(out).last_result.chosen) > 0
    out.detach()  # what ComfyUI does when it unloads or frees the model
    assert not _int8_in_tree(out)
    with record_calls() as calls:
        assert torch.equal(sample(out, "sd15", steps=2), first)
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0
    assert {id(layer) for layer in _int8_in_tree(out)} == owned


def test_int8_layers_outlive_the_clones_comfyui_drops_between_prompts(comfy_root, quant):
    model = build_tiny_model("sd15")
    out, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    sample(out, "sd15", steps=2)
    second = sample(out, "sd15", steps=2)
    plan = plan_of(out)
    built = {name: id(module) for name, module in plan._modules.items()}
    assert built
    clone = out.clone()  # ComfyUI detaches a clone without unpatching when it is collected (ModelPatcher.__del__)
    del clone
    gc.collect()
    out.detach(unpatch_all=False)  # ... and when another clone of the same model replaces it in memory
    with record_calls() as calls:
        assert torch.equal(sample(out, "sd15", steps=2), second)
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0  # the kept modules ran in INT8
    assert {name: id(module) for name, module in plan._modules.items()} == built  # not rebuilt for the next prompt


def test_report_rows_and_summary(comfy_root, quant):
    model = build_tiny_model("sd15")
    out, pending = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0,
                            compute_density_threshold=0)
    assert "calibration pending" in pending
    sample(out, "sd15", steps=2)
    report = plan_of(out).last_report
    assert "norm. MSE" in report and "density" in report
    assert "% of the model's FLOPs in INT8" in report and "whole-model output norm. MSE" in report
    first = plan_of(out).last_result.layers[0]
    assert report_table_rows(report)[first.name][-1] == "int8"
    # The node's STRING output gives the cached report on the next run with the same settings.
    _, again = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    assert first.name in again and "summary:" in again


def test_original_model_is_untouched(comfy_root, quant):
    model = build_tiny_model("sd15")
    before = sample(model, "sd15")
    out, _ = quantize(quant, model, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized = sample(out, "sd15")
    assert not torch.equal(quantized, before)
    assert torch.equal(sample(model, "sd15"), before)
    assert all(not type(m).__name__.startswith("Int8") for m in model.model.modules())


def test_lora_and_int8_sequences_never_leak(comfy_root, quant):
    base = build_tiny_model("sd15")
    lora = make_lora(base, layers=8, scale=2.0)
    with_lora = apply_lora(base, lora)
    int8 = quantize(quant, base, conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)[0]
    int8_lora = apply_lora(int8, lora)

    def run(model):
        return sample(model, "sd15", steps=2)

    run(int8), run(int8_lora)  # each calibrates on its first run; from the next on the MODEL owns its INT8 layers
    first = {"base": run(base), "lora": run(with_lora), "int8": run(int8), "int8_lora": run(int8_lora)}
    assert not torch.equal(first["base"], first["lora"])
    for sequence in (["lora", "int8", "lora", "int8", "base"], ["int8", "base", "int8", "int8_lora", "base"]):
        for name in sequence:
            model = {"base": base, "lora": with_lora, "int8": int8, "int8_lora": int8_lora}[name]
            assert torch.equal(run(model), first[name]), f"{name} changed in sequence {sequence}"


def test_lora_before_or_after_the_node_matches_float_lora(comfy_root, quant, weight_width):
    base = build_tiny_model("sd15")
    lora = make_lora(base, layers=8, scale=2.0)
    float_lora = sample(apply_lora(base, lora), "sd15", steps=3)
    float_plain = sample(base, "sd15", steps=3)
    lora_shift = relative_error(float_lora, float_plain)
    settings = dict(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    int8_alone = quantize(quant, base, **settings)[0]
    int8_error = relative_error(sample(int8_alone, "sd15", steps=3), float_plain)  # INT8's own error, this width
    lora_first = quantize(quant, apply_lora(base, lora), **settings)[0]
    sample(lora_first, "sd15", steps=1)  # calibrates; the MODEL owns its INT8 layers from the next run on
    before = sample(lora_first, "sd15", steps=3)
    after = sample(apply_lora(int8_alone, lora), "sd15", steps=3)
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)  # where the LoRA comes in does not matter
    for result in (before, after):
        # the LoRA adds no error of its own on top of INT8's, whatever the weight width
        assert relative_error(result, float_lora) < 1.5 * int8_error + 0.01, (int8_error, lora_shift)
        assert relative_error(result, float_plain) > 0.5 * lora_shift  # the LoRA took effect


def test_calibration_cache_skips_second_run_and_recalibrates_on_change(comfy_root, quant):
    model = build_tiny_model("sd15")
    settings = dict(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    out, _ = quantize(quant, model, **settings)
    first = sample(out, "sd15")
    plan = plan_of(out)
    assert plan.calibration_runs == 1
    assert torch.equal(sample(out, "sd15"), first)
    assert plan.calibration_runs == 1  # in memory

    fresh, _ = quantize(quant, model, **settings)  # a new node instance: decision read from disk
    assert torch.equal(sample(fresh, "sd15"), first)
    assert plan_of(fresh).calibration_runs == 0 and plan_of(fresh).disk_hits == 1

    changed, _ = quantize(quant, model, **{**settings, "linear_mse_threshold": 0.5})
    sample(changed, "sd15")
    assert plan_of(changed).calibration_runs == 1

    lora_model = apply_lora(out, make_lora(model))
    sample(lora_model, "sd15")
    assert plan.calibration_runs == 2  # a LoRA changes the fingerprint

    sample(out, "sd15", height=96, width=64)
    assert plan.calibration_runs == 3  # a new latent size


def test_model_without_eligible_layers_is_returned_unchanged(comfy_root, quant):
    model = build_tiny_model("sd15")
    out, report = quantize(quant, model, quantize_conv="disable", quantize_linear="disable")
    assert out is model
    assert "Nothing to quantize" in report


def test_device_without_a_fast_int8_kernel_is_declined_in_the_report(comfy_root, quant, monkeypatch):
    model = build_tiny_model("sd15")
    monkeypatch.setattr(model, "load_device", torch.device("mps"))  # only the (slow) reference path serves it
    out, report = quantize(quant, model, compute_density_threshold=0)
    assert out is model and "INT8 declined: no fast INT8 kernel for mps" in report


def test_low_vram_partial_load_keeps_lora(comfy_root, quant, weight_width):
    """ComfyUI offloads layers that do not fit and keeps their LoRA in weight_function: INT8 must still see it."""
    base = build_tiny_model("sd15")
    lora = make_lora(base, layers=8, scale=2.0)
    gen = torch.Generator().manual_seed(3)
    x, t, context = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([700.0, 700.0]), torch.randn(2, 8, 768)

    def apply(patcher, lowvram: bool) -> torch.Tensor:
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0)
        offloaded_with_lora = [m for m in patcher.model.modules() if getattr(m, "weight_function", None)]
        assert bool(offloaded_with_lora) == (lowvram and bool(patcher.patches))
        try:
            with torch.inference_mode():
                options = {"wrappers": patcher.wrappers}
                return [patcher.model.apply_model(x, t, c_crossattn=context, transformer_options=options)
                        for _ in range(2)][-1]
        finally:
            patcher.unpatch_model(device_to=torch.device("cpu"))

    float_lora = apply(apply_lora(base, lora), lowvram=False)
    float_plain = apply(base, lowvram=False)
    settings = dict(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    low_vram_model = quantize(quant, apply_lora(base, lora), **settings)[0]
    partially_loaded = apply(low_vram_model, lowvram=True)  # calibrates with the LoRA in weight_function
    fully_loaded = apply(quantize(quant, apply_lora(base, lora), **settings)[0], lowvram=False)
    assert plan_of(low_vram_model).last_result.chosen
    # like with like: INT8 built from offloaded layers (LoRA applied per forward) equals INT8 from merged weights
    assert torch.allclose(partially_loaded, fully_loaded, rtol=1e-5, atol=1e-5)
    lora_shift = relative_error(float_lora, float_plain)
    assert lora_shift > 0.01
    assert relative_error(partially_loaded, float_lora) < 0.5 * relative_error(partially_loaded, float_plain)
    assert torch.equal(apply(base, lowvram=False), float_plain)
