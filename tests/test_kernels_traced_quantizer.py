"""Under torch.compile a GPU Linear's per-token activation quantizer is traced as torch ops and only its GEMM stays
an INT8 op (`int8_accel::linear_quantized`), so inductor can fuse the quantizer into the ops before it (a
LayerNorm, a GELU) and share it between projections of the same input. Run here with the `cuda` kernel backend
forced on CPU tensors (`torch._int_mm` is exact on the CPU; its quantizer is the reference formula the triton
backend's kernel reproduces bit for bit); the cpu backend, which quantizes otherwise, keeps the whole op."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from comfyui_int8_accel.kernels import (
    force_kernel_backend,
    forced_kernel_backend,
    int8_linear,
    normalized_mse,
    quantize_weight_per_channel,
    record_calls,
)
from comfyui_int8_accel.kernels.ops import traces_linear_quantizer


def _layer(k: int = 64, n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_weight_per_channel(torch.randn(n, k, generator=g) / k**0.5, 127)
    return q, s, torch.randn(n, generator=g)


def _normed_projection(q, s, b):
    def forward(x):
        return int8_linear(F.layer_norm(x, x.shape[-1:]), q, s, b)

    return forward


class RecordingBackend:
    """A torch.compile backend that keeps the FX graphs dynamo hands it and runs them as they are."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def int8_ops(self) -> list[str]:
        return [str(node.target).removesuffix(".default") for gm in self.graphs for node in gm.graph.nodes
                if node.op == "call_function" and "int8_accel" in str(node.target)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _dynamo_reads_the_forced_backend() -> bool:
    """Whether dynamo, tracing, sees the kernel backend this thread forced (a thread-local), as the tests here
    force the cuda backend on CPU tensors; where it does not, the Linear stays one op, as it did before."""

    def probe(x):
        return x + (1 if forced_kernel_backend() == "cuda" else 2)  # what the traced graph adds says what it saw

    with force_kernel_backend("cuda"):
        out = torch.compile(probe, backend="eager")(torch.zeros(2))
    torch._dynamo.reset()
    return bool((out == 1).all())


def test_dynamo_sees_the_forced_backend_on_the_pytorch_versions_that_split_the_linear():
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 11):
        assert _dynamo_reads_the_forced_backend()


def test_a_compiled_gpu_linear_traces_its_quantizer_and_keeps_only_the_gemm_as_an_int8_op():
    q, s, b = _layer()
    forward = _normed_projection(q, s, b)
    x = torch.randn(2, 40, 64)
    backend = RecordingBackend()
    splits = _dynamo_reads_the_forced_backend()
    with force_kernel_backend("cuda"), torch.no_grad():
        assert traces_linear_quantizer(x.device)
        eager = forward(x)
        with record_calls() as calls:
            compiled = torch.compile(forward, backend=backend)(x)
    if splits:
        assert backend.int8_ops() == ["int8_accel.linear_quantized"]
        assert any("amax" in str(node.target) for node in backend.graphs[0].graph.nodes)  # the quantizer, traced
    else:
        assert backend.int8_ops() == ["int8_accel.linear"]
    assert torch.equal(compiled, eager)
    assert calls == {("linear", "cuda", "int8"): 1}


def test_a_cuda_tensor_is_split_unless_switched_off_and_a_cpu_tensor_is_not(monkeypatch):
    """Without a forced backend the device decides: CUDA's backends (triton, cuda) quantize rows with the
    reference formula, the CPU's does not (only evaluated here: no CUDA tensor is made)."""
    assert traces_linear_quantizer(torch.device("cuda", 0))
    assert not traces_linear_quantizer(torch.device("cpu"))
    monkeypatch.setenv("INT8_ACCEL_TRACED_QUANTIZER", "0")
    assert not traces_linear_quantizer(torch.device("cuda", 0))
    monkeypatch.setenv("INT8_ACCEL_TRACED_QUANTIZER", "off")  # a typo is refused, not read as on
    with pytest.raises(ValueError, match="INT8_ACCEL_TRACED_QUANTIZER='off': expected one of 1, 0"):
        traces_linear_quantizer(torch.device("cuda", 0))


def test_inductor_runs_the_traced_quantizer_with_the_same_result_on_the_cpu():
    """The quantizer alone compiled by inductor quantizes as the eager kernel does (the same output bit for bit);
    fused into a LayerNorm it sees inductor's LayerNorm, which rounds a little differently from eager's."""
    q, s, b = _layer(seed=1)
    x = torch.randn(3, 24, 64)
    with force_kernel_backend("cuda"), torch.no_grad():
        eager = int8_linear(x, q, s, b)
        with record_calls() as calls:
            compiled = torch.compile(lambda x: int8_linear(x, q, s, b), backend="inductor")(x)
        assert calls == {("linear", "cuda", "int8"): 1}
        assert torch.equal(compiled, eager)
        normed = torch.compile(_normed_projection(q, s, b), backend="inductor")(x)
        eager_normed = _normed_projection(q, s, b)(x)
    assert normalized_mse(normed, eager_normed) < 1e-6


@pytest.mark.parametrize("why", ["switched off", "cpu backend"])
def test_the_whole_op_stays_where_the_quantizer_is_not_traced(monkeypatch, why):
    """INT8_ACCEL_TRACED_QUANTIZER=0, or a backend that quantizes another way (the cpu backend): the graph holds
    the whole INT8 Linear op, as before."""
    q, s, b = _layer(seed=2)
    backend = RecordingBackend()
    forced = "cuda"
    if why == "switched off":
        monkeypatch.setenv("INT8_ACCEL_TRACED_QUANTIZER", "0")
    else:
        forced = "cpu"
    x = torch.randn(2, 40, 64)
    with force_kernel_backend(forced), torch.no_grad():
        assert not traces_linear_quantizer(x.device)
        eager = _normed_projection(q, s, b)(x)
        compiled = torch.compile(_normed_projection(q, s, b), backend=backend)(x)
    assert backend.int8_ops() == ["int8_accel.linear"]
    assert torch.equal(compiled, eager)


def test_an_empty_input_gives_an_empty_output_through_the_split_op():
    q, s, b = _layer(seed=3)
    with force_kernel_backend("cuda"), torch.no_grad():
        y = torch.compile(lambda x: int8_linear(x, q, s, b), backend="aot_eager")(torch.randn(0, 64))
    assert y.shape == (0, 48)


@pytest.mark.parametrize(("backend", "traced"), [("inductor", True), ("aot_eager", False), ("eager", False)])
def test_only_inductor_regions_trace_the_quantizer(monkeypatch, backend, traced):
    """Compile Model's regions (CompiledOrEager) with another compile backend keep the Linear whole: only inductor
    fuses a traced quantizer; the others would run it as separate ops instead of its one kernel. Told apart by
    which backend function the compiled call ends in: the whole op's `linear`, or `linear_quantized` alone."""
    from comfyui_int8_accel.kernels import CompiledOrEager
    from comfyui_int8_accel.kernels import cuda as cuda_backend

    if not _dynamo_reads_the_forced_backend():
        pytest.skip("this PyTorch's dynamo keeps the Linear whole under a forced backend in any case")
    whole_calls = []
    whole = cuda_backend.linear
    monkeypatch.setattr(cuda_backend, "linear", lambda *args: whole_calls.append(1) or whole(*args))
    q, s, b = _layer(seed=4)
    x = torch.randn(2, 24, 64)
    region = CompiledOrEager(_normed_projection(q, s, b), name="test region",
                             compile_kwargs={"backend": backend, "dynamic": True})
    with force_kernel_backend("cuda"), torch.no_grad(), record_calls() as calls:
        out = region(x)
        eager = _normed_projection(q, s, b)(x)
    assert region.disabled_reason is None
    assert calls == {("linear", "cuda", "int8"): 2}
    assert len(whole_calls) == (1 if traced else 2)  # eager's call, and the region's unless traced
    assert normalized_mse(out, eager) < 1e-6
    with force_kernel_backend("cuda"):
        assert traces_linear_quantizer(x.device)  # outside the region, as before


def _generated_kernels(fn, x) -> list[str]:
    """The names of the kernels inductor generates for `fn` (compiled with the cuda backend forced, CPU tensors:
    C++ kernels named after the ops they fuse), in order of first appearance."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with force_kernel_backend("cuda"), torch.no_grad():
        _, sources = run_and_get_code(torch.compile(fn, backend="inductor"), x)
    names = re.findall(r"\b(cpp_fused_\w+|triton_\w+_fused_\w+)", "\n".join(sources))
    return list(dict.fromkeys(names))


def test_inductor_fuses_the_traced_quantizer_into_the_layer_norm_before_it():
    """LayerNorm -> INT8 Linear compiled by inductor: one generated kernel normalizes each row, takes its amax,
    scale and int8 values (the rows are read once and the float LayerNorm output never written), and the GEMM is
    the one INT8 op; with a graph break between the two, the LayerNorm and the quantizer are two kernels (the
    LayerNorm's, then the quantizer's: amax, scale, round, clamp and cast in one). Its output is bit-equal to the
    eager INT8 Linear's on inductor's LayerNorm output."""
    if not _dynamo_reads_the_forced_backend():
        pytest.skip("this PyTorch's dynamo keeps the Linear whole under a forced backend")
    q, s, b = _layer(seed=5)
    g = torch.Generator().manual_seed(6)
    norm_weight, norm_bias = torch.randn(64, generator=g), torch.randn(64, generator=g)

    def normed(x):
        return F.layer_norm(x, x.shape[-1:], norm_weight, norm_bias)

    def together(x):
        return int8_linear(normed(x), q, s, b)

    def apart(x):
        h = normed(x)
        torch._dynamo.graph_break()
        return int8_linear(h, q, s, b)

    x = torch.randn(2, 40, 64)
    fused = _generated_kernels(together, x)
    assert len(fused) == 1, fused
    assert all(op in fused[0] for op in ("native_layer_norm", "amax", "floor", "linear_quantized")), fused
    separate = _generated_kernels(apart, x)
    assert len(separate) == 2 and "amax" not in separate[0] and "amax" in separate[1], separate
    torch._dynamo.reset()
    with force_kernel_backend("cuda"), torch.no_grad(), record_calls() as calls:
        compiled = torch.compile(together, backend="inductor")(x)
        eager = together(x)
        # the eager INT8 Linear on inductor's own LayerNorm output: the fused quantizer computes exactly that
        on_inductors_norm = int8_linear(torch.compile(normed, backend="inductor")(x), q, s, b)
    assert calls == {("linear", "cuda", "int8"): 3}
    assert torch.equal(compiled, on_inductors_norm)
    # against eager's LayerNorm: inductor's rounds a little differently from ATen's (as in the test above), which
    # moves a row's amax and scale, or rarely one value to the neighbouring integer: close, not bit-equal
    assert normalized_mse(compiled, eager) < 1e-6
