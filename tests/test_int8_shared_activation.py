"""An attention's Q, K and V projections in INT8 share one quantized input in eager mode (`kernels.shared_rows`,
`nodes.int8.shared_inputs`): one activation quantizer for the three in self-attention, the same output bit for bit
as each quantizing its own, and nothing reused that is not the very same, unchanged tensor. Run on CPU tensors with
the `cuda` kernel backend (exact there) and, under Triton's interpreter, the `triton` backend."""

from __future__ import annotations

import pytest
import torch

from comfyui_int8_accel.kernels import (
    SharedInput,
    SharedRows,
    force_kernel_backend,
    int8_linear,
    quantize_weight_per_channel,
    record_calls,
)
from comfyui_int8_accel.kernels import cuda as cuda_backend
from tests.support.triton_launches import record_launches


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_weight_per_channel(torch.randn(n, k, generator=g) / k**0.5, 127)
    return q, s, torch.randn(n, generator=g)


@pytest.fixture
def quantizer_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes the cuda backend's Linear input quantizer was called on, through the shared path."""
    calls: list[tuple[int, ...]] = []
    quantize = cuda_backend.quantize_linear_rows

    def counting(x2d):
        calls.append(tuple(x2d.shape))
        return quantize(x2d)

    monkeypatch.setattr(cuda_backend, "quantize_linear_rows", counting)
    return calls


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """The names of the autotuned Triton kernels launched while the test runs (under Triton's interpreter)."""
    from comfyui_int8_accel.kernels import triton_kernels

    if not triton_kernels.AVAILABLE or not triton_kernels.INTERPRETED:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")
    return record_launches(monkeypatch, triton_kernels)


def _group(size: int) -> list[SharedInput]:
    rows = SharedRows()
    return [SharedInput(rows, first=i == 0, last=i == size - 1) for i in range(size)]


def test_three_projections_of_one_input_quantize_it_once_and_match_the_unshared_output(quantizer_calls):
    layers = [_weights(48, 64, seed) for seed in range(3)]
    x = torch.randn(2, 10, 64)
    with force_kernel_backend("cuda"), torch.inference_mode():
        alone = [int8_linear(x, *layer) for layer in layers]
        group = _group(3)
        with record_calls() as calls:
            shared = [int8_linear(x, *layer, shared=place) for layer, place in zip(layers, group, strict=True)]
    assert calls == {("linear", "cuda", "int8"): 3}
    assert quantizer_calls == [(20, 64)]
    assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True))
    assert group[0].group.source is None and group[0].group.rows is None  # the last let it go


def test_another_tensor_or_one_changed_in_place_is_quantized_again(quantizer_calls):
    """Cross-attention hands K and V the context, not x: K quantizes it and V reuses K's. A tensor changed in
    place between two siblings (where it counts versions) is quantized anew."""
    q_layer, k_layer, v_layer = (_weights(48, 64, seed) for seed in range(3))
    x, context = torch.randn(2, 10, 64), torch.randn(2, 7, 64)
    with force_kernel_backend("cuda"):
        group = _group(3)
        outs = [int8_linear(x, *q_layer, shared=group[0]), int8_linear(context, *k_layer, shared=group[1]),
                int8_linear(context, *v_layer, shared=group[2])]
        assert quantizer_calls == [(20, 64), (14, 64)]
        assert torch.equal(outs[1], int8_linear(context, *k_layer))
        assert torch.equal(outs[2], int8_linear(context, *v_layer))

        quantizer_calls.clear()
        int8_linear(x, *q_layer, shared=group[0])
        x.mul_(3.0)  # in place: the same object, another version
        changed = int8_linear(x, *k_layer, shared=group[1])
        assert quantizer_calls == [(20, 64), (20, 64)]
        assert torch.equal(changed, int8_linear(x, *k_layer))


def test_a_first_sibling_on_a_float_path_clears_what_the_group_held(quantizer_calls):
    q_layer, k_layer = _weights(48, 64, 0), _weights(48, 64, 1)
    x = torch.randn(3, 64)
    with force_kernel_backend("cuda"), torch.inference_mode():
        group = _group(3)
        int8_linear(x, *q_layer, shared=group[0])  # kept for K and V, then the call ends early (no V)
        group[0].passed()  # the next call's Q runs in float
        int8_linear(x, *k_layer, shared=group[1])
    assert quantizer_calls == [(3, 64), (3, 64)]


def test_cross_attention_projections_in_int8_share_their_input_inside_the_model(quant, quantizer_calls):
    """ComfyUI's CrossAttention with INT8 copies of its projections, as Quantize Model swaps them in: self-attention
    quantizes x once for Q, K and V (and once more for the output projection), cross-attention once for Q and once
    for the context K and V read; the output equals the same copies without sharing bit for bit."""
    from comfy.ldm.modules.attention import CrossAttention

    from comfyui_int8_accel.nodes.int8.layout import swapped_modules
    from comfyui_int8_accel.nodes.int8.modules import Int8Linear
    from comfyui_int8_accel.nodes.int8.shared_inputs import assign_shared_inputs

    torch.manual_seed(0)
    root = torch.nn.Module()
    root.attn1 = CrossAttention(64, heads=2, dim_head=32)
    root.attn2 = CrossAttention(64, context_dim=32, heads=2, dim_head=32)
    with torch.no_grad():
        for parameter in root.parameters():  # ComfyUI's layers leave their weights uninitialised
            parameter.normal_(0.0, 0.1)
    replacements = {f"{attn}.{leaf}": Int8Linear.from_float(getattr(getattr(root, attn), leaf))
                    for attn in ("attn1", "attn2") for leaf in ("to_q", "to_k", "to_v")}
    replacements["attn1.to_out.0"] = Int8Linear.from_float(root.attn1.to_out[0])
    x, context = torch.randn(2, 16, 64), torch.randn(2, 5, 32)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with swapped_modules(root, replacements), force_kernel_backend("cuda"), torch.inference_mode():
            return root.attn1(x), root.attn2(x, context=context)

    unshared = run()
    assert all(torch.isfinite(out).all() for out in unshared)
    assert quantizer_calls == []  # no group assigned: every layer quantizes inside its own op
    assign_shared_inputs(root, replacements)
    assert replacements["attn1.to_out.0"].shared_input is None
    assert [replacements[f"attn1.{leaf}"].shared_input.first for leaf in ("to_q", "to_k", "to_v")] == [True, False,
                                                                                                       False]
    with record_calls() as calls:
        shared = run()
    assert calls[("linear", "cuda", "int8")] == 7
    assert quantizer_calls == [(32, 64), (32, 64), (10, 32)]
    assert all(torch.equal(a, b) for a, b in zip(unshared, shared, strict=True))


def test_the_triton_backend_launches_one_quantizer_for_three_projections(launches):
    layers = [_weights(40, 64, seed) for seed in range(3)]
    x = torch.randn(24, 64)
    with force_kernel_backend("triton"), torch.inference_mode():
        alone = [int8_linear(x, *layer) for layer in layers]
        launches.clear()
        shared = [int8_linear(x, *layer, shared=place) for layer, place in zip(layers, _group(3), strict=True)]
    assert launches.count("_quantize_rows_one_pass_kernel") == 1 and len(launches) == 4
    assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True))


def test_quantize_model_shares_the_self_attention_input_and_samples_the_same_latent(comfy_root, pack, quant,
                                                                                       calibration_cache,
                                                                                       quantizer_calls,
                                                                                       monkeypatch):
    """Quantize Model on the tiny SD1.5, every eligible layer in INT8 on the `cuda` backend: each self-attention
    call quantizes its input once for Q, K and V, each cross-attention call twice (x for Q, the context for K and
    V), and the latent equals the one sampled with sharing turned off bit for bit."""
    from comfy.ldm.modules.attention import CrossAttention

    from comfyui_int8_accel.nodes.int8 import owned as owned_module
    from comfyui_int8_accel.nodes.int8 import plan as plan_module
    from harness.tiny_models import build_tiny_model, sample
    from tests.support.int8_checks import ALL_INT8

    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")

    def sampled(share: bool) -> tuple[torch.Tensor, int]:
        if not share:  # both the per-call copies and the INT8 layers the MODEL owns
            monkeypatch.setattr(plan_module, "assign_shared_inputs", lambda root, replacements: None)
            monkeypatch.setattr(owned_module, "assign_shared_inputs", lambda root, replacements: None)
        out, _ = quant.apply_int8(build_tiny_model("sd15"), quant.settings_from_widgets(**ALL_INT8))
        attention_calls: list[str] = []
        for name, module in out.model.diffusion_model.named_modules():
            if isinstance(module, CrossAttention):
                module.register_forward_hook(lambda m, i, o, name=name: attention_calls.append(name.rsplit(".")[-1]))
        with force_kernel_backend("cuda"):
            sample(out, "sd15", steps=1)  # calibration
            quantizer_calls.clear()
            attention_calls.clear()
            latent = sample(out, "sd15", steps=2)
        return latent, attention_calls

    shared_latent, attention_calls = sampled(share=True)
    assert attention_calls and set(attention_calls) == {"attn1", "attn2"}
    expected = attention_calls.count("attn1") + 2 * attention_calls.count("attn2")
    assert len(quantizer_calls) == expected  # against three per attention call without sharing
    unshared_latent, _ = sampled(share=False)
    assert quantizer_calls == []  # without groups every Linear quantizes inside its own op
    assert torch.equal(shared_latent, unshared_latent)


def _attention_with_int8_projections(query_dim: int, heads: int, dim_head: int, context_dim: int | None = None):
    """ComfyUI's CrossAttention with INT8 copies of its Q, K and V projections swapped in, grouped as Quantize Model
    groups them: (attention, replacements)."""
    from comfy.ldm.modules.attention import CrossAttention

    from comfyui_int8_accel.nodes.int8.modules import Int8Linear

    torch.manual_seed(0)
    root = torch.nn.Module()
    root.attn = CrossAttention(query_dim, context_dim=context_dim, heads=heads, dim_head=dim_head)
    with torch.no_grad():
        for parameter in root.parameters():  # ComfyUI's layers leave their weights uninitialised
            parameter.normal_(0.0, 0.05)
    replacements = {f"attn.{leaf}": Int8Linear.from_float(getattr(root.attn, leaf)) for leaf in ("to_q", "to_k", "to_v")}
    return root, replacements


def test_sdxl_self_attention_on_the_triton_backend_launches_one_quantizer_for_q_k_and_v(monkeypatch, quant,
                                                                                        launches):
    """An SDXL-width self-attention (640 = 10 heads of 64) through ComfyUI's CrossAttention on the triton backend
    under the interpreter, counting kernel launches: with its projections grouped, the three INT8 projections launch
    one row quantizer and three GEMMs, where ungrouped they launch three and three; the output is the same bit for
    bit."""
    from comfyui_int8_accel.nodes.int8.layout import swapped_modules
    from comfyui_int8_accel.nodes.int8.shared_inputs import assign_shared_inputs

    monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", "fused")  # the GEMM Hopper runs: one launch per projection
    root, replacements = _attention_with_int8_projections(640, heads=10, dim_head=64)
    x = torch.randn(1, 24, 640)

    def run() -> torch.Tensor:
        launches.clear()
        with swapped_modules(root, replacements), force_kernel_backend("triton"), torch.inference_mode(), \
                record_calls() as calls:
            out = root.attn(x)
        assert calls == {("linear", "triton", "int8"): 3}
        return out

    unshared = run()
    assert launches.count("_quantize_rows_one_pass_kernel") == 3 and launches.count("_gemm_rescale_kernel") == 3
    assign_shared_inputs(root, replacements)
    shared = run()
    assert launches.count("_quantize_rows_one_pass_kernel") == 1 and launches.count("_gemm_rescale_kernel") == 3
    assert len(launches) == 4
    assert torch.equal(shared, unshared)
    assert replacements["attn.to_q"].shared_input.group.source is None  # nothing kept past the call


def test_grouped_projections_compile_in_one_graph_without_reading_the_group(quant, quantizer_calls, monkeypatch):
    """Under torch.compile the layers do not read their group (inductor computes a repeated traced quantizer once):
    a self-attention with grouped INT8 projections compiles to one graph (fullgraph: no break), is not compiled
    again for a second input, leaves the group empty and gives the eager ungrouped output bit for bit (dynamo's
    eager backend runs the traced ops as ATen runs them)."""
    import comfy.ldm.modules.attention as comfy_attention

    from comfyui_int8_accel.nodes.int8.layout import swapped_modules
    from comfyui_int8_accel.nodes.int8.shared_inputs import assign_shared_inputs

    # ComfyUI's CPU attention asks psutil for free memory, which dynamo cannot trace; SDPA's is what GPUs run
    monkeypatch.setattr(comfy_attention, "optimized_attention", comfy_attention.attention_pytorch)
    root, replacements = _attention_with_int8_projections(64, heads=2, dim_head=32)
    inputs = [torch.randn(2, 12, 64), torch.randn(2, 12, 64)]
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with swapped_modules(root, replacements), force_kernel_backend("cuda"), torch.no_grad():
        unshared = [root.attn(x) for x in inputs]
        assign_shared_inputs(root, replacements)
        assert replacements["attn.to_k"].shared_input is not None
        torch._dynamo.reset()
        compiled = torch.compile(root.attn, backend=counting_backend, fullgraph=True)
        with record_calls() as calls:
            outs = [compiled(x) for x in inputs]
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert calls == {("linear", "cuda", "int8"): 6}
    assert quantizer_calls == []  # the group's eager quantizer was never called
    assert replacements["attn.to_q"].shared_input.group.source is None
    assert all(torch.equal(a, b) for a, b in zip(outs, unshared, strict=True))
