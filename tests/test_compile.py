"""Compile Model node on tiny models with ComfyUI's real sampler (CPU; Inductor where it matters)."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.int8_checks import rel

KIND = "sd15"
RTOL = 1e-4


def _tiny_model(seed: int = 0):
    """The tiny SD1.5 with norm scales that are not all zero (so GroupNorm+SiLU paths carry signal)."""
    model = build_tiny_model(KIND, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for module in model.model.diffusion_model.modules():
            if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and module.weight is not None:
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
    return model


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def cm(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.compile")


@pytest.fixture(scope="module")
def node(cm):
    """The compile core with the node's widget values."""
    return cm


@pytest.fixture(scope="module")
def base():
    return _tiny_model()


def _compile(cm, model, backend="inductor", mode="default", dynamic="auto", fullgraph=False):
    return cm.compile_model(model, cm.CompileSettings(backend=backend, mode=mode, dynamic=dynamic,
                                                      fullgraph=fullgraph))


def test_node_spec(pack):
    assert pack.NODE_DISPLAY_NAME_MAPPINGS["Int8AccelCompile"] == "Compile Model"
    cls = pack.NODE_CLASS_MAPPINGS["Int8AccelCompile"]
    info = cls.GET_NODE_INFO_V1()
    assert (info["category"], info["output"]) == ("int8-accel", ["MODEL"])
    required = cls.INPUT_TYPES()["required"]
    assert list(required) == ["model", "backend", "mode", "dynamic", "fullgraph"]
    options = {name: spec[1]["options"] for name, spec in required.items() if spec[0] == "COMBO"}
    assert options["backend"][0] == "inductor" and {"aot_eager", "eager"} <= set(options["backend"])
    assert options["mode"] == ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
    assert options["dynamic"] == ["auto", "true", "false"]
    assert required["fullgraph"][0] == "BOOLEAN" and required["fullgraph"][1]["default"] is False
    assert all(spec[1].get("tooltip") for spec in required.values())


def test_inductor_matches_eager_and_leaves_model_untouched(node, cm, base, caplog):
    eager = sample(base, KIND, steps=2, height=128, width=128)
    compiled = _compile(node, base)
    assert compiled is not base
    before = _graphs()
    with caplog.at_level(logging.INFO, logger="int8_accel.compile"):
        out = sample(compiled, KIND, steps=2, height=128, width=128)
    assert _graphs() > before, "nothing was compiled"
    assert rel(out, eager) < RTOL
    assert any("compiled geglu_gate (dynamic shapes) in" in r.getMessage() for r in caplog.records)
    # nothing stays swapped in after the run, and the original MODEL still samples as before
    assert not any("forward" in m.__dict__ for m in base.model.diffusion_model.modules())
    assert torch.equal(sample(base, KIND, steps=2, height=128, width=128), eager)


def _lora(model, strength: float):
    sd = model.model.state_dict()
    gen = torch.Generator().manual_seed(7)
    keys = [
        "diffusion_model.input_blocks.1.0.in_layers.2.weight",  # ResBlock conv (prepacked)
        "diffusion_model.input_blocks.1.1.proj_in.weight",  # 1x1 conv
        "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",  # Linear (prepacked)
        "diffusion_model.output_blocks.2.0.out_layers.0.weight",  # GroupNorm inside a compiled region
    ]
    patches = {k: (torch.randn(sd[k].shape, generator=gen) * 0.05,) for k in keys}
    clone = model.clone()
    clone.add_patches(patches, strength)
    return clone


def test_lora_after_compile_matches_eager_without_recompiling(cm, base):
    # with the GroupNorm+SiLU region too: its weights are region inputs that the LoRA patches
    compiled = cm.compile_model(base, cm.CompileSettings(), group_norm_silu=True)
    plain = sample(base, KIND, steps=2)
    sample(compiled, KIND, steps=2)  # compile first
    graphs = [_graphs()]
    for strength in (1.0, 0.5, 0.25):
        eager_lora = sample(_lora(base, strength), KIND, steps=2)
        compiled_lora = sample(_lora(compiled, strength), KIND, steps=2)
        assert rel(eager_lora, plain) > 1e-3, "the LoRA should change the output"
        assert rel(compiled_lora, eager_lora) < RTOL
        graphs.append(_graphs())
    assert graphs[-1] == graphs[0], f"a LoRA or strength change recompiled: {graphs}"
    # and the LoRA is gone again for the compiled model without it
    assert rel(sample(compiled, KIND, steps=2), plain) < RTOL
    assert _graphs() == graphs[-1]


def test_lora_before_compile(node, base):
    lora = _lora(base, 1.0)
    eager = sample(lora, KIND, steps=2)
    assert rel(sample(_compile(node, lora), KIND, steps=2), eager) < RTOL


def test_resolutions_compile_at_most_once_each(node, cm):
    model = _tiny_model(seed=3)
    compiled = _compile(node, model, dynamic="true")  # regions of its own (same graphs: cache hits)
    regions = 1  # geglu_gate
    sizes = [(64, 64), (96, 64), (128, 96)]
    first_pass = []
    for height, width in sizes:
        before = _graphs()
        sample(compiled, KIND, steps=1, height=height, width=width)
        first_pass.append(_graphs() - before)
    assert 1 <= first_pass[0] <= 2 * regions, first_pass  # dynamic shapes may specialise a size-1 dim
    assert all(n <= regions for n in first_pass[1:]), first_pass
    before = _graphs()
    for height, width in sizes:
        sample(compiled, KIND, steps=1, height=height, width=width)
    assert _graphs() == before, "a second pass over known resolutions recompiled"


def test_unknown_backend_falls_back_to_eager(node, base, caplog):
    eager = sample(base, KIND, steps=2)
    with caplog.at_level(logging.WARNING):
        compiled = _compile(node, base, backend="no_such_backend")
    assert any("running eagerly" in r.getMessage() for r in caplog.records)
    assert rel(sample(compiled, KIND, steps=2), eager) < RTOL


def test_missing_cpp_compiler_falls_back_to_eager(node, cm, base, caplog):
    import torch._inductor.config as inductor_config
    from torch._inductor import cpp_builder

    eager = sample(base, KIND, steps=2)
    configured = inductor_config.cpp.cxx
    inductor_config.cpp.cxx = ("/nonexistent/int8accel-no-such-c++",)
    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        assert "C++ compiler" in cm.compile_backend_problem("inductor", torch.device("cpu"))
        with caplog.at_level(logging.WARNING):
            compiled = _compile(node, base)
        assert any("C++ compiler" in r.getMessage() and "running eagerly" in r.getMessage() for r in caplog.records)
        assert rel(sample(compiled, KIND, steps=2), eager) < RTOL
    finally:
        inductor_config.cpp.cxx = configured
        cpp_builder.cpp_compiler_search.cache_clear()
    assert cm.compile_backend_problem("inductor", torch.device("cpu")) is None


def test_backend_failing_at_compile_time_falls_back(node, cm, base, caplog):
    from torch._dynamo import list_backends, register_backend

    name = "int8accel_test_broken"
    if name not in list_backends(exclude_tags=()):
        @register_backend(name=name)
        def broken(gm, example_inputs):
            raise RuntimeError("simulated missing compiler")

    eager = sample(base, KIND, steps=2)
    compiled = cm.compile_model(base, cm.CompileSettings(backend=name))
    with caplog.at_level(logging.WARNING):
        out = sample(compiled, KIND, steps=2)
    assert rel(out, eager) < RTOL
    assert any("running it eagerly" in r.getMessage() for r in caplog.records)


def _quantized(model):
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    # density threshold 0: the tiny UNet's layers are far below the full-size default
    settings = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized, report = int8.apply_int8(model, settings)
    return quantized, report


def test_int8_then_compile_matches_int8_eager(node, base):
    plain = sample(base, KIND, steps=3)
    quantized, report = _quantized(base)
    eager = sample(quantized, KIND, steps=3)
    assert rel(eager, plain) > 1e-5, f"INT8 changed nothing: {report}"
    compiled = sample(_compile(node, quantized), KIND, steps=3)
    assert rel(compiled, eager) < 1e-3


def test_compile_then_int8_matches_int8_eager(node, base):
    quantized, _ = _quantized(base)
    eager = sample(quantized, KIND, steps=3)
    compiled_first, _ = _quantized(_compile(node, base))
    assert rel(sample(compiled_first, KIND, steps=3), eager) < 1e-3


def test_deepcache_and_compile_match_deepcache_eager(node, base):
    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    plain = sample(base, KIND, steps=6)
    cached = deepcache.apply_deepcache(base, cache_interval=3, cache_depth=1)
    eager = sample(cached, KIND, steps=6)
    assert rel(eager, plain) > 1e-5, "DeepCache skipped nothing"
    assert rel(sample(_compile(node, cached), KIND, steps=6), eager) < RTOL
    compiled_first = deepcache.apply_deepcache(_compile(node, base), cache_interval=3, cache_depth=1)
    assert rel(sample(compiled_first, KIND, steps=6), eager) < RTOL


def _attention_ops(model, **size) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sample(model, KIND, steps=1, **size)
    return {event.key for event in prof.key_averages() if "attention" in event.key}


def test_fused_attention_replaces_sub_quadratic_on_large_inputs(cm, base):
    # 128x128 -> 256 tokens at the first level: above SDPA_MIN_SCORES, so PyTorch's fused kernel runs
    compiled = cm.compile_model(base, cm.CompileSettings(), regions=False, prepack=False)
    fused = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert fused not in _attention_ops(base, height=128, width=128)
    assert fused in _attention_ops(compiled, height=128, width=128)
    eager = sample(base, KIND, steps=2, height=128, width=128)
    assert rel(sample(compiled, KIND, steps=2, height=128, width=128), eager) < RTOL
    # small inputs keep ComfyUI's own attention (the fused kernel's setup costs more there)
    assert fused not in _attention_ops(compiled, height=32, width=32)


@pytest.mark.parametrize("kind", ["sdxl", "flux", "sd3"])
def test_other_architectures_match_eager_with_fused_attention(cm, kind):
    model = build_tiny_model(kind, seed=1)
    eager = sample(model, kind, steps=2, height=256, width=256)
    compiled = cm.compile_model(model, cm.CompileSettings())
    assert rel(sample(compiled, kind, steps=2, height=256, width=256), eager) < RTOL


def test_torch_compile_without_the_newer_keywords_still_compiles(cm, monkeypatch, caplog):
    """Older PyTorch: torch.compile has no isolate_recompiles / recompile_limit; the node compiles without them."""
    from comfyui_int8_accel.nodes.compile.regions import CompiledRegion

    real_compile = torch.compile
    calls = []

    def older_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                      disable=False):
        calls.append(backend)
        return real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                            options=options, disable=disable)

    monkeypatch.setattr(torch, "compile", older_compile)
    with caplog.at_level(logging.WARNING):
        kwargs = cm.CompileSettings(backend="aot_eager", dynamic="false").compile_kwargs()
    assert "isolate_recompiles" not in kwargs and "recompile_limit" not in kwargs
    assert kwargs["backend"] == "aot_eager" and kwargs["dynamic"] is False
    region = CompiledRegion(lambda x: torch.nn.functional.gelu(x) * 2, name="probe", compile_kwargs=kwargs)
    x = torch.randn(4, 8)
    assert torch.allclose(region(x), torch.nn.functional.gelu(x) * 2)
    assert calls == ["aot_eager"] and region.compiled is not None and region.disabled_reason is None


def test_one_registration_of_dynamo_compile_callbacks_serves_every_listener(pack, monkeypatch):
    """The regions' log and the page status listen to one pair of dynamo callbacks, which PyTorch before 2.5
    calls without arguments and later ones with the compile's id."""
    import types

    from torch._dynamo import callback

    events = importlib.import_module("comfyui_int8_accel.nodes.compile.compile_events")
    handler = callback.CompilationCallbackHandler()
    monkeypatch.setattr(callback, "callback_handler", handler)
    monkeypatch.setattr(events, "_listeners", [])
    heard: list[tuple] = []

    def on_start(compile_id):
        heard.append(("start", compile_id))

    def on_end(compile_id, seconds):
        heard.append(("end", compile_id, seconds))

    for _ in range(2):
        events.add_compile_listener(on_start, on_end)
        events.add_compile_listener(lambda compile_id: heard.append(("other", compile_id)), lambda *_: None)
    assert handler.start_callbacks == [events._on_compile_start] and handler.end_callbacks == [events._on_compile_end]
    handler.clear()  # what torch._dynamo.reset() does: the next listener registers them again
    events.add_compile_listener(on_start, on_end)
    assert handler.start_callbacks == [events._on_compile_start] and handler.end_callbacks == [events._on_compile_end]
    assert len(events._listeners) == 3  # the same listener twice is told once
    events._on_compile_start()  # PyTorch < 2.5: no arguments
    events._on_compile_end()
    events._on_compile_start(types.SimpleNamespace(compile_id="0/1"))
    events._on_compile_end(types.SimpleNamespace(compile_id="0/1"))
    events._on_compile_end(types.SimpleNamespace(compile_id="never started"))
    starts = [event for event in heard if event[0] == "start"]
    ends = [event for event in heard if event[0] == "end"]
    assert [event[1] for event in starts] == [starts[0][1], "0/1"] and [event[1] for event in ends] == [
        starts[0][1], "0/1"]
    assert all(event[2] >= 0.0 for event in ends) and sum(event[0] == "other" for event in heard) == 4
