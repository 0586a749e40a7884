"""Compile Model in a mode that replays CUDA graphs tells INT8 calibration so, through the model call's
`transformer_options`, and the speed gate then times its layers as graph replays (in the real ComfyUI,
in-process). Replays cannot run here: on this CPU the test has the calibration take its device for a CUDA one where
it asks, and records the timing plan it asks for; the replays themselves are tested in tests/gpu."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample

pytestmark = pytest.mark.usefixtures("calibration_cache")


@pytest.fixture(scope="module")
def cm(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.compile")


def _passing_through(executor, *args, **kwargs):
    return executor(*args, **kwargs)


def _on_a_cuda_device(cm, monkeypatch, model):
    """A clone of `model` that Compile Model takes for one on a working CUDA GPU (nothing runs on it here)."""
    monkeypatch.setattr(cm, "compile_backend_problem", lambda backend, device: None)
    monkeypatch.setattr(cm, "ensure_persistent_cache", lambda: None)
    monkeypatch.setattr(cm, "make_blocks_wrapper", lambda settings: _passing_through)
    clone = model.clone()
    clone.load_device = torch.device("cuda", 0)
    return clone


@pytest.mark.parametrize(("backend", "mode", "marked"), [
    ("inductor", "reduce-overhead", True), ("inductor", "max-autotune", True), ("cudagraphs", "default", True),
    ("inductor", "default", False), ("inductor", "max-autotune-no-cudagraphs", False)])
def test_compile_model_marks_the_models_it_replays_from_cuda_graphs(pack, cm, monkeypatch, backend, mode, marked):
    from comfyui_int8_accel.nodes.cuda_graph_replay import replays_cuda_graphs

    node = pack.NODE_CLASS_MAPPINGS["Int8AccelCompile"]
    base = build_tiny_model("sd15")
    out = node.execute(_on_a_cuda_device(cm, monkeypatch, base), backend, mode, "auto", False).result[0]
    assert replays_cuda_graphs(out.model_options.get("transformer_options")) is marked
    assert not replays_cuda_graphs(base.model_options.get("transformer_options"))  # the input MODEL is untouched
    on_cpu = node.execute(base, backend, mode, "auto", False).result[0]  # a CPU replays no CUDA graph
    assert not replays_cuda_graphs(on_cpu.model_options.get("transformer_options"))


@pytest.mark.parametrize("compile_first", [False, True], ids=["quantize then compile", "compile then quantize"])
def test_calibration_behind_a_graph_replaying_compile_times_replays(pack, quant, cm, monkeypatch, compile_first):
    """Either order of the two nodes: the calibration under the graph-replaying MODEL asks for the replaying plan
    for every layer it times, says so in its report and keys its decision apart from the one without (sampling
    the plain quantized MODEL afterwards calibrates again, timing as launched)."""
    from comfyui_int8_accel.nodes.int8 import plan as plan_module
    from comfyui_int8_accel.nodes.int8.report import format_report, summary_line

    asked: list[bool] = []
    real_plan = plan_module.timing_plan

    def recording_plan(device, cuda_graphs=False):
        asked.append(cuda_graphs)
        return real_plan(device)  # this CPU's plan: nothing here can replay a graph

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "1")
    monkeypatch.setattr(plan_module, "timing_plan", recording_plan)
    monkeypatch.setattr(plan_module, "cuda_graph_timing_for", lambda device, replays: replays)
    compile_node = pack.NODE_CLASS_MAPPINGS["Int8AccelCompile"]

    def compiled(model):
        out = compile_node.execute(_on_a_cuda_device(cm, monkeypatch, model), "inductor", "reduce-overhead", "auto",
                                   False).result[0]
        out.load_device = model.load_device  # it runs on this CPU; the mark stays
        return out

    base = build_tiny_model("sd15")
    settings = quant.settings_from_widgets(conv_mse_threshold=1.0, linear_mse_threshold=1.0,
                                           compute_density_threshold=0)
    quantized, _ = quant.apply_int8(base, settings)
    both = quant.apply_int8(compiled(base), settings)[0] if compile_first else compiled(quantized)
    plan = quant.int8_plan(both)
    sample(both, "sd15")
    result = plan.last_result
    assert asked and all(asked) and result.cuda_graph_timing
    assert "timed as CUDA graph replays" in summary_line(result, False)
    report = format_report(result, settings, {})
    assert "timed as replays of CUDA graphs of their calls" in report
    assert "as launched (their calls could not be captured)" in report  # this CPU's plan never replays

    asked.clear()
    plain = quantized if not compile_first else quant.apply_int8(base, settings)[0]
    sample(plain, "sd15")
    assert asked and not any(asked)  # calibrated again (not the replayed decision from disk), timing as launched
    assert not quant.int8_plan(plain).last_result.cuda_graph_timing


@pytest.mark.parametrize(("backend", "fuses"), [("inductor", True), ("cudagraphs", False)])
def test_compile_model_says_whether_its_graphs_fuse_the_linear_quantizer(pack, cm, monkeypatch, backend, fuses):
    from comfyui_int8_accel.nodes.cuda_graph_replay import fuses_linear_quantizer

    node = pack.NODE_CLASS_MAPPINGS["Int8AccelCompile"]
    out = node.execute(_on_a_cuda_device(cm, monkeypatch, build_tiny_model("sd15")), backend, "reduce-overhead",
                       "auto", False).result[0]
    assert fuses_linear_quantizer(out.model_options.get("transformer_options")) is fuses


@pytest.mark.parametrize("traced", [True, False], ids=["quantizer traced", "INT8_ACCEL_TRACED_QUANTIZER=0"])
def test_behind_inductor_graphs_the_gate_times_a_linear_as_its_gemm_on_quantized_rows(pack, quant, cm, monkeypatch,
                                                                                      traced):
    """Where inductor's graphs fuse a Linear's activation quantizer into the op before it, the speed gate times the
    Linear's INT8 side as what runs of it there, its GEMM on rows quantized ahead, not quantizer + GEMM; convs as
    before. Said in the report, and keyed apart. Run with the `cuda` kernel backend forced (it splits the Linear on
    CPU tensors as on a GPU); switched off by INT8_ACCEL_TRACED_QUANTIZER=0."""
    from comfyui_int8_accel.kernels import force_kernel_backend
    from comfyui_int8_accel.nodes.int8 import plan as plan_module
    from comfyui_int8_accel.nodes.int8.report import summary_line

    if not traced:
        monkeypatch.setenv("INT8_ACCEL_TRACED_QUANTIZER", "0")
    gemm_only: list[tuple[int, ...]] = []
    real_call = plan_module.fused_quantizer_linear_call

    def recording_call(layer, x):
        gemm_only.append(tuple(x.shape))
        return real_call(layer, x)

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "1")
    monkeypatch.setattr(plan_module, "fused_quantizer_linear_call", recording_call)
    monkeypatch.setattr(plan_module, "cuda_graph_timing_for", lambda device, replays: replays)
    compile_node = pack.NODE_CLASS_MAPPINGS["Int8AccelCompile"]
    base = build_tiny_model("sd15")
    compiled = compile_node.execute(_on_a_cuda_device(cm, monkeypatch, base), "inductor", "reduce-overhead", "auto",
                                    False).result[0]
    compiled.load_device = base.load_device
    settings = quant.settings_from_widgets(conv_mse_threshold=1.0, linear_mse_threshold=1.0,
                                           compute_density_threshold=0)
    both = quant.apply_int8(compiled, settings)[0]
    with force_kernel_backend("cuda"):
        sample(both, "sd15")
    result = quant.int8_plan(both).last_result
    assert result.cuda_graph_timing and result.fused_quantizer_timing is traced
    timed_linears = {layer.name for layer in result.layers if layer.kind == "linear" and layer.int8_ms is not None}
    assert timed_linears
    if traced:
        assert gemm_only, "no Linear was timed as its GEMM"
        assert "Linears as their GEMM" in summary_line(result, False)
    else:
        assert gemm_only == [] and "Linears as their GEMM" not in summary_line(result, False)
