"""The GPU suite (`make test-gpu`): the INT8 CUDA path on a real NVIDIA GPU.

Kernel results against their definition and the reference at fp16/bf16, the Triton conv-input quantizer against
the torch formula, Triton offsets past 2**31 elements, weight-cache hits, no host sync in an
INT8 layer's forward (`torch.cuda.set_sync_debug_mode("error")`), CUDA-graph capture and replay of a quantized
block (also after an in-place LoRA), and the Compile Model node's recompile counts across a LoRA strength
change and two resolutions. It needs INT8_ACCEL_TESTS_ON_GPU=1 (set by `make test-gpu`) so that ComfyUI runs on the
GPU and Triton runs compiled, not interpreted; without it the module skips with one line, and with it a machine
that cannot compute on CUDA stops the run with the reason (conftest.py).
"""

from __future__ import annotations

import importlib
import os
from collections import Counter

import pytest
import torch

if os.environ.get("INT8_ACCEL_TESTS_ON_GPU") != "1":
    pytest.skip("the GPU suite runs through `make test-gpu` (an NVIDIA GPU, ComfyUI on it, Triton compiled)",
                allow_module_level=True)

from comfyui_int8_accel.kernels import cuda as cuda_backend  # noqa: E402
from comfyui_int8_accel.kernels import (  # noqa: E402
    force_kernel_backend,
    int8_conv2d,
    int8_linear,
    ops,
    quantize_weight_per_channel,
    record_calls,
    triton_backend,
    weight_changed,
)
from comfyui_int8_accel.kernels.weight_cache import CACHE  # noqa: E402
from tests.support.int8_exact import run_on_backend  # noqa: E402
from tests.support.triton_offsets import OFFSET_CHECKS  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
TRITON = ops.kernel_backend_unavailable_reason("triton")
KERNEL_BACKENDS = ["cuda", pytest.param("triton", marks=pytest.mark.skipif(TRITON is not None, reason=f"triton: {TRITON}"))]
HALF = [torch.float16, torch.bfloat16]
QMAX = {8: 127, 7: 63}


def weights(shape, bits: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / (torch.Size(shape[1:]).numel() ** 0.5)
    q, s = quantize_weight_per_channel(w, QMAX[bits])
    return q.to(DEVICE), s.to(DEVICE), torch.randn(shape[0], generator=g).to(DEVICE)


@pytest.fixture(scope="module")
def int8_modules(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.int8.modules")


def test_triton_runs_compiled():
    """Where Triton is installed, the INT8 ops on CUDA tensors run its kernels, compiled (not interpreted)."""
    import importlib.util

    from comfyui_int8_accel.kernels import triton_kernels

    assert not triton_kernels.INTERPRETED, "TRITON_INTERPRET=1 is set: unset it (make test-gpu does)"
    q, s, b = weights((32, 64))
    with record_calls() as calls:
        int8_linear(torch.randn(4, 64, device=DEVICE, dtype=torch.float16), q, s, b.half())
    expected = "triton" if importlib.util.find_spec("triton") is not None else "cuda"
    assert calls == {("linear", expected, "int8"): 1}


@pytest.mark.skipif(TRITON is not None, reason=f"triton: {TRITON}")
@pytest.mark.parametrize("check", OFFSET_CHECKS, ids=lambda check: check.__name__)
def test_triton_offsets_past_2_31_elements_are_not_wrapped(check):
    """Compiled, the kernels' int64 offsets reach elements past 2**31 (8 GiB of GPU memory per check)."""
    from comfyui_int8_accel.kernels import triton_kernels

    check(triton_kernels, DEVICE)
    torch.cuda.empty_cache()


# ---- kernels against their definition --------------------------------------------------------------------------
# Exact: activations a symmetric per-row (Linear) or affine per-tensor (conv) 8-bit quantizer holds without loss
# (integers times a power of two, spanning the full range), so the W8A8 result is defined exactly: the integer
# product (float64 holds these sums exactly), scaled, plus bias, in float32, then in the output dtype.
# Within a bound: ordinary activations against the float layer with the dequantized weight.

LINEAR_STEP, CONV_STEP, CONV_ZERO = 2.0**-6, 2.0**-5, 64


def lossless_rows(shape, dtype, seed: int = 0) -> torch.Tensor:
    """k * 2^-6 with integers k in [-127, 127], every row reaching +-127."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-127, 128, shape, generator=g).reshape(-1, shape[-1])
    k[:, 0] = torch.where(torch.arange(k.shape[0]) % 2 == 0, 127, -127)
    return (k.reshape(shape).double() * LINEAR_STEP).to(DEVICE, dtype)


def lossless_image(shape, dtype, seed: int = 0) -> torch.Tensor:
    """(u - 64) * 2^-5 with integers u in [0, 255], both ends present."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 256, shape, generator=g)
    u.view(-1)[0], u.view(-1)[1] = 0, 255
    return ((u - CONV_ZERO).double() * CONV_STEP).to(DEVICE, dtype)


def linear_by_definition(x, q, s, b):
    acc = (x.double() / LINEAR_STEP) @ q.double().t()
    return (acc.float() * (LINEAR_STEP * s) + b.float()).to(x.dtype)


def conv_by_definition(x, q, s, b, stride, padding, groups):
    acc = torch.nn.functional.conv2d(x.double() / CONV_STEP, q.double(), None, stride, padding, 1, groups)
    return (acc.float() * (CONV_STEP * s)[None, :, None, None] + b.float()[None, :, None, None]).to(x.dtype)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference.double()).norm() / reference.double().norm())


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("x_shape,n", [((2, 77, 768), 320), ((2, 4096, 320), 1280), ((1, 4096, 3072), 3072),
                                       ((16, 100), 36), ((1, 5, 64), 64)])  # fmt: skip
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_linear_matches_its_definition(backend, x_shape, n, dtype, bits):
    q, s, b = weights((n, x_shape[-1]), bits)
    x = lossless_rows(x_shape, dtype)
    y = run_on_backend(backend, int8_linear, x, q, s, b.to(dtype))
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], n)
    assert torch.equal(y, linear_by_definition(x, q, s, b.to(dtype)))
    x = (torch.randn(*x_shape, device=DEVICE) * 2).to(dtype)
    y = run_on_backend(backend, int8_linear, x, q, s, b.to(dtype))
    reference = torch.nn.functional.linear(x.float(), q.float() * s[:, None], b.to(dtype).float())
    assert relative_error(y, reference) < 0.02  # 8-bit per-row activations: about 1%


@pytest.mark.skipif(TRITON is not None, reason=f"triton: {TRITON}")
@pytest.mark.parametrize("gemm", ["fused", "fused-tma"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("x_shape,n", [((2, 4096, 320), 1280), ((1, 4608, 3072), 12288), ((16, 100), 36),
                                       ((1, 5, 64), 64), ((3, 1000, 5120), 1280)])  # fmt: skip
def test_fused_linear_gemm_matches_its_definition_and_the_int_mm_path(monkeypatch, x_shape, n, dtype, gemm):
    """INT8_ACCEL_TRITON_LINEAR=fused, compiled for this GPU (int8 tensor-core dot, rescale in the epilogue), and
    fused-tma (the persistent kernel reading its tiles through TMA; K=100 is no multiple of 16 and takes the fused
    GEMM): exact against the definition and bit-equal to torch._int_mm + the rescale kernel."""
    q, s, b = weights((n, x_shape[-1]))
    x = lossless_rows(x_shape, dtype)
    monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", "int-mm")
    int_mm = run_on_backend("triton", int8_linear, x, q, s, b.to(dtype))
    monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", gemm)
    fused = run_on_backend("triton", int8_linear, x, q, s, b.to(dtype))
    assert torch.equal(fused, linear_by_definition(x, q, s, b.to(dtype)))
    assert torch.equal(fused, int_mm)


# (input shape, output channels, kernel, stride, padding, groups): SDXL's widths, its 4-channel input conv, a strided
# conv, a 1x1 and a grouped one
CONV_CASES = [((2, 320, 32, 32), 320, 3, 1, 1, 1), ((2, 4, 32, 32), 320, 3, 1, 1, 1), ((1, 640, 16, 16), 640, 3, 2, 1, 1),
              ((2, 1280, 8, 8), 1280, 1, 1, 0, 1), ((1, 64, 20, 20), 64, 3, 1, 1, 4)]


@pytest.mark.skipif(TRITON is not None, reason=f"triton: {TRITON}")
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("x_shape,cout,kernel,stride,padding,groups", CONV_CASES)
def test_channels_last_conv_matches_its_definition_and_the_nchw_kernel(monkeypatch, x_shape, cout, kernel, stride,
                                                                       padding, groups, dtype):  # fmt: skip
    """INT8_ACCEL_TRITON_CONV=nhwc, compiled for this GPU: exact against the definition and bit-equal to the NCHW
    kernel."""
    q, s, b = weights((cout, x_shape[1] // groups, kernel, kernel), 8)
    x = lossless_image(x_shape, dtype)
    args = (q, s, b.to(dtype), [stride] * 2, [padding] * 2, [1, 1], groups)
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", "nchw")
    nchw = run_on_backend("triton", int8_conv2d, x, *args)
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", "nhwc")
    nhwc = run_on_backend("triton", int8_conv2d, x, *args)
    assert nhwc.dtype == dtype and nhwc.is_contiguous()
    assert torch.equal(nhwc, conv_by_definition(x, q, s, b.to(dtype), stride, padding, groups))
    assert torch.equal(nhwc, nchw)


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("x_shape,cout,kernel,stride,padding,groups", CONV_CASES)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_conv_matches_its_definition(backend, x_shape, cout, kernel, stride, padding, groups, dtype, bits):
    q, s, b = weights((cout, x_shape[1] // groups, kernel, kernel), bits)
    x = lossless_image(x_shape, dtype)
    y = run_on_backend(backend, int8_conv2d, x, q, s, b.to(dtype), [stride] * 2, [padding] * 2, [1, 1], groups)
    assert y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y, conv_by_definition(x, q, s, b.to(dtype), stride, padding, groups))
    x = (torch.randn(*x_shape, device=DEVICE).relu() - 0.25).to(dtype)
    y = run_on_backend(backend, int8_conv2d, x, q, s, b.to(dtype), [stride] * 2, [padding] * 2, [1, 1], groups)
    reference = torch.nn.functional.conv2d(x.float(), q.float() * s[:, None, None, None], b.to(dtype).float(),
                                           stride, padding, 1, groups)
    assert relative_error(y, reference) < 0.03  # 8-bit per-tensor activations: about 1%


def gpu_conv_input(case: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if case == "several-strides":  # more than AFFINE_GRAIN x AFFINE_PROGRAMS elements, not a multiple of a block
        x = torch.randn(2, 641, 127, 129, generator=g).relu() - 0.2
        x.view(-1)[-1], x.view(-1)[1234567] = 7.5, -3.25
    elif case == "ties":  # scale 1, zero point 10.5 -> 10, every value halfway: torch.round's ties to even
        x = torch.arange(-10.5, 244.6, 0.5).reshape(1, 1, 7, 73)
    elif case == "all-negative":
        x = -torch.rand(2, 3, 33, 35, generator=g) - 0.1
    else:  # constant
        x = torch.full((2, 5, 31, 3), 0.375)
    return x.to(DEVICE, dtype)


@pytest.mark.skipif(TRITON is not None, reason=f"triton: {TRITON}")
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("case", ["several-strides", "ties", "all-negative", "constant"])
def test_triton_conv_input_quantizer_equals_the_torch_formula(case, dtype):
    """The Triton conv-input quantizer, compiled, against the torch formula it replaces on the same GPU."""
    from comfyui_int8_accel.kernels import triton_kernels

    x = gpu_conv_input(case, dtype)
    q, zero_point, scale = triton_kernels.quantize_affine(x)
    q_ref, zero_point_ref, scale_ref = cuda_backend.quantize_conv_input(x)
    assert torch.equal(scale, scale_ref) and torch.equal(zero_point, zero_point_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.skipif(TRITON is not None, reason=f"triton: {TRITON}")
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("k", [40, 640, 1280, 3072, 5120, 8192, 12288])
def test_triton_row_quantizer_equals_the_torch_formula_in_one_pass_and_two(k, dtype):
    """The Linear's activation quantizer, compiled: the one-pass kernel (rows up to 8192 wide, each read once) and
    the two-loop one (wider rows) against the torch formula on the same GPU, bit for bit."""
    from comfyui_int8_accel.kernels import quant, triton_kernels

    g = torch.Generator().manual_seed(k)
    x = (torch.randn(300, k, generator=g) * torch.logspace(-2, 2, 300)[:, None]).to(DEVICE, dtype)
    x[5] = 0.0
    q, scale = triton_kernels.quantize_rows(x)
    q_ref, scale_ref = quant.quantize_rows_symmetric(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)


# ---- weight cache ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_weights_are_prepared_once_per_version(backend):
    q, s, b = weights((36, 100), seed=1)  # not multiples of 8: padded rows
    cq, cs, cb = weights((320, 4, 3, 3), seed=2)  # the 4-channel input conv: K = 36
    aq, as_, ab = weights((320, 768), seed=3)  # aligned: used as it is
    x, cx, ax = (torch.randn(40, 100, device=DEVICE, dtype=torch.float16), lossless_image((2, 4, 32, 32), torch.float32),
                 torch.randn(2, 77, 768, device=DEVICE, dtype=torch.bfloat16))  # fmt: skip
    before = CACHE.builds.copy()
    for _ in range(3):
        run_on_backend(backend, int8_linear, x, q, s, b.half())
        cy = run_on_backend(backend, int8_conv2d, cx, cq, cs, cb, 1, 1)
        run_on_backend(backend, int8_linear, ax, aq, as_, ab.bfloat16())
    expected = Counter({"int-mm-linear": 1, "column-sums": 1})
    if backend == "triton" and triton_backend.linear_gemm(torch.device(DEVICE)) == "fused":
        del expected["int-mm-linear"]  # the fused GEMM reads the weight as it is, padded or not
    if backend == "cuda":
        expected["int-mm-conv-g1"] = 1
    assert CACHE.builds - before == expected
    assert cuda_backend.prepared_linear_weight(aq) is aq

    sums = cuda_backend.weight_column_sums(cq)
    cq.data.copy_(-cq)  # what ComfyUI's restores do; the writer announces it
    weight_changed(cq)
    assert cuda_backend.weight_column_sums(cq) is sums  # rebuilt in place: captured graphs stay valid
    assert torch.equal(run_on_backend(backend, int8_conv2d, cx, cq, cs, cb, 1, 1), conv_by_definition(cx, cq, cs, cb, 1, 1, 1))
    assert not torch.equal(run_on_backend(backend, int8_conv2d, cx, cq, cs, cb, 1, 1), cy)


# ---- no host sync, CUDA graphs --------------------------------------------------------------------------------


def _block(int8_modules, dtype, seed: int = 0):
    """Int8Conv2d (4 -> 40 channels: padded rows and column sums) -> SiLU -> tokens -> Int8Linear (40 -> 100)."""
    torch.manual_seed(seed)
    conv = int8_modules.Int8Conv2d.from_float(torch.nn.Conv2d(4, 40, 3, padding=1).to(DEVICE, dtype))
    linear = int8_modules.Int8Linear.from_float(torch.nn.Linear(40, 100).to(DEVICE, dtype))

    def forward(x):
        return linear(torch.nn.functional.silu(conv(x)).flatten(2).transpose(1, 2))

    return conv, linear, forward


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_int8_layers_never_sync_with_the_host(backend, dtype, int8_modules):
    _, _, forward = _block(int8_modules, dtype)
    x = torch.randn(2, 4, 24, 24, device=DEVICE, dtype=dtype)
    with force_kernel_backend(backend), record_calls() as calls:
        forward(x)  # warm-up: Triton compiles, the weight cache builds
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = forward(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert y.shape == (2, 24 * 24, 100)
    assert calls == {("conv2d", backend, "int8"): 2, ("linear", backend, "int8"): 2}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_quantized_block_is_captured_in_a_cuda_graph(backend, int8_modules):
    conv, _, forward = _block(int8_modules, torch.float16, seed=1)
    static_x = torch.randn(2, 4, 24, 24, device=DEVICE, dtype=torch.float16)
    with force_kernel_backend(backend):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside the capture, as PyTorch's CUDA-graph notes ask
                forward(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = forward(static_x)
        for seed in range(3):
            static_x.copy_(torch.randn(2, 4, 24, 24, generator=torch.Generator().manual_seed(seed)).to(DEVICE))
            graph.replay()
            assert torch.equal(static_y, forward(static_x))
        # An in-place LoRA (ComfyUI's hook patching): the layer rewrites its weight and its derived forms in the
        # memory the graph captured, so the replay computes with the new weight.
        patched = conv.weight.float() * conv.weight_scale[:, None, None, None] * 1.5
        conv.set_weight(patched, inplace_update=True)
        graph.replay()
        eager = forward(static_x)
    assert torch.equal(static_y, eager)


# ---- Compile Model: recompiles ---------------------------------------------------------------------------------


def test_compile_model_recompiles_once_per_shape_family_and_never_for_a_lora(pack):
    import comfy.model_management
    from torch._dynamo.utils import counters

    from harness.tiny_models import build_tiny_model, sample
    from tests.support.lora import apply_lora, make_lora

    assert comfy.model_management.get_torch_device().type == "cuda", "ComfyUI runs on the CPU in this process"
    compile_core = importlib.import_module("comfyui_int8_accel.nodes.compile")
    model = build_tiny_model("sd15", seed=5)
    compiled = compile_core.compile_model(model, compile_core.CompileSettings())
    lora = make_lora(model, layers=6)

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    torch._dynamo.reset()
    counters.clear()
    first = sample(compiled, "sd15", steps=2, height=64, width=64)
    assert torch.isfinite(first).all()
    first_family = graphs()
    for strength in (1.0, 0.5):
        sample(apply_lora(compiled, lora, strength), "sd15", steps=2, height=64, width=64)
    assert graphs() == first_family, f"a LoRA or its strength recompiled: {dict(counters['stats'])}"
    sample(compiled, "sd15", steps=2, height=96, width=64)
    second_family = graphs() - first_family
    assert second_family <= max(first_family, 1), f"a new resolution compiled more than once per region: {dict(counters['stats'])}"
    known = graphs()
    for height in (64, 96):
        sample(apply_lora(compiled, lora, 0.5), "sd15", steps=2, height=height, width=64)
    assert graphs() == known, f"a known resolution or LoRA recompiled: {dict(counters['stats'])}"


# ---- Compile Model in a CUDA-graph mode ------------------------------------------------------------------------


@pytest.mark.parametrize("kind,sizes", [("sd15", ((64, 64), (96, 64))), ("flux", ((128, 128), (160, 128)))])
def test_reduce_overhead_matches_eager_over_two_prompts_at_two_resolutions(pack, kind, sizes):
    """CUDA graphs replayed per block region: a UNet reads its input blocks' outputs many regions later (skip
    connections), which a later replay must not overwrite; a region that fails falls back to eager for good,
    so the regions must still be compiled at the end."""
    from comfyui_int8_accel.nodes import compile as compile_core
    from comfyui_int8_accel.nodes.compile import blocks
    from harness.tiny_models import build_tiny_model, sample
    from tests.support.int8_checks import rel

    model = build_tiny_model(kind, seed=5)
    settings = compile_core.CompileSettings(mode="reduce-overhead")
    compiled = compile_core.compile_model(model, settings)
    for height, width in sizes:
        for seed in (0, 1):  # two prompts after another: the second replays the graphs the first recorded
            eager = sample(model, kind, steps=3, seed=seed, height=height, width=width)
            out = sample(compiled, kind, steps=3, seed=seed, height=height, width=width)
            assert torch.isfinite(out).all()
            assert rel(out, eager) < 1e-3, (height, width, seed)
    for cls in {type(block) for block in blocks.repeated_blocks(model.model.diffusion_model)}:
        region = blocks.block_region(cls, settings)
        assert region.compiled is not None and region.disabled_reason is None, (cls, region.disabled_reason)


# ---- the speed gate's clock ------------------------------------------------------------------------------------


def test_speed_gate_times_device_work_per_call_with_events(pack):
    """Work of known GPU length (torch.cuda._sleep spins the GPU for a number of cycles): the gate's CUDA timing
    gives per-call seconds in proportion to it, after its warm-up, over back-to-back calls."""
    speed = importlib.import_module("comfyui_int8_accel.nodes.int8.speed")
    plan = speed.timing_plan(DEVICE)
    calls = Counter()

    def spin(name: str, cycles: int):
        def call():
            calls[name] += 1
            torch.cuda._sleep(cycles)

        return call

    timing = speed.time_float_and_int8(spin("float", 2_000_000), spin("int8", 4_000_000), DEVICE, repetitions=3)
    assert calls == {name: plan.warmup_calls + 3 * plan.calls_per_sample for name in ("float", "int8")}
    assert plan.calls_per_sample > 1
    assert 1.6 < timing.int8_seconds / timing.float_seconds < 2.4
    assert not timing.int8_faster


def test_speed_gate_replaying_cuda_graphs_times_an_int8_linear_without_its_host_launches(int8_modules):
    """SDXL's attention projection at 1024x1024 (8192 tokens, 640 -> 640): launched, its INT8 call spends more
    host time than its kernels take; replayed from a CUDA graph (Compile Model's reduce-overhead), only the kernels
    count, so the replaying plan times it faster than the launching one does."""
    speed = importlib.import_module("comfyui_int8_accel.nodes.int8.speed")
    torch.manual_seed(0)
    layer = torch.nn.Linear(640, 640, dtype=torch.bfloat16, device=DEVICE)
    int8_layer = int8_modules.Int8Linear.from_float(layer)
    x = torch.randn(2, 4096, 640, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad(), record_calls() as counted:
        int8_layer(x), layer(x)
        launched = speed.time_float_and_int8(lambda: layer(x), lambda: int8_layer(x), DEVICE)
        replayed = speed.time_float_and_int8(lambda: layer(x), lambda: int8_layer(x), DEVICE,
                                             plan=speed.timing_plan(DEVICE, cuda_graphs=True))
    assert counted[("linear", ops.kernel_backend_for(DEVICE), "int8")] > 0
    assert replayed.replayed and not launched.replayed
    assert replayed.int8_seconds < launched.int8_seconds, (replayed, launched)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_compiled_linear_traces_its_quantizer_for_inductor_and_matches_eager(int8_modules, dtype):
    """On CUDA, without forcing a backend, torch.compile traces an INT8 Linear's activation quantizer as torch ops
    (inductor fuses it into the LayerNorm before it) and keeps only the GEMM as an INT8 op; the output stays
    within rounding of eager's (inductor's LayerNorm rounds a little differently)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1280, 1280, dtype=dtype, device=DEVICE)
    int8_layer = int8_modules.Int8Linear.from_float(layer)
    norm = torch.nn.LayerNorm(1280, dtype=dtype, device=DEVICE)
    x = torch.randn(2, 1024, 1280, dtype=dtype, device=DEVICE)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad(), record_calls() as calls:
        eager = int8_layer(norm(x))
        compiled = torch.compile(lambda x: int8_layer(norm(x)), backend=keep_graph)(x)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if "int8_accel" in str(node.target)]
    assert targets and all("linear_quantized" in target for target in targets), targets
    assert calls[("linear", "triton" if TRITON is None else "cuda", "int8")] == 2
    error = ((compiled.float() - eager.float()).pow(2).mean() / eager.float().pow(2).mean()).item()
    assert error < 1e-4, error


def test_speed_gate_times_a_call_that_cannot_be_captured_as_launched():
    """A call that reads a value on the host (a sync: not allowed while capturing) is timed as launched."""
    speed = importlib.import_module("comfyui_int8_accel.nodes.int8.speed")
    x = torch.randn(1024, 1024, device=DEVICE)
    timing = speed.time_float_and_int8(lambda: x @ x, lambda: float((x @ x).sum()), DEVICE,
                                       plan=speed.timing_plan(DEVICE, cuda_graphs=True))
    assert not timing.replayed and timing.float_seconds > 0 and timing.int8_seconds > 0
    assert float((x @ x).sum()) == pytest.approx(float((x @ x).sum()))  # the device still works after the refusal


# ---- ComfyUI models on the GPU: storage dtypes, INT8 + Compile Model, low-VRAM loading -----------------------

STORAGE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn}
SIZE = {"sd15": (64, 64), "flux": (128, 128)}


def _stored_as(kind: str, storage: str, monkeypatch):
    """The tiny `kind` model's state dict loaded by ComfyUI's diffusion-model loader with `model_options["dtype"]`,
    what UNETLoader's weight_dtype fp8_e4m3fn sets (comfy/sd.py load_diffusion_model_state_dict), so ComfyUI picks
    the compute dtype for this GPU and casts per layer where it must; and the fp32 model it came from."""
    import comfy.sd

    from harness.tiny_models import build_tiny_model, detect_tiny

    detect_tiny(monkeypatch, kind)
    source = build_tiny_model(kind, seed=5)
    state = {key: value.detach().cpu().clone() for key, value in source.model.diffusion_model.state_dict().items()}
    loaded = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": STORAGE[storage]})
    assert loaded.model.get_dtype() == STORAGE[storage]
    return loaded, source


def _int8_layers(model) -> dict:
    from comfyui_int8_accel.nodes.int8 import int8_plan

    plan = int8_plan(model)
    assert plan is not None and plan._modules, "no layer was quantized"
    return plan._modules


@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_int8_then_compile_model_on_a_model_stored_in(pack, kind, storage, monkeypatch):
    """Quantize Model (INT8) then Compile Model on a model ComfyUI keeps in fp16, bf16 or fp8 (the usual way to fit
    Flux on a 12-24 GB card): the INT8 layers really run on a GPU backend, keep bias and scales in a dtype the
    kernels take (never fp8), and the image is the float model's within INT8 error."""
    from comfyui_int8_accel.nodes import compile as compile_core
    from comfyui_int8_accel.nodes import int8 as quant
    from harness.tiny_models import sample
    from tests.support.int8_checks import ALL_INT8, rel

    height, width = SIZE[kind]
    model, source = _stored_as(kind, storage, monkeypatch)
    reference = sample(source, kind, steps=3, height=height, width=width)
    quantized, _ = quant.apply_int8(model, quant.settings_from_widgets(**ALL_INT8))
    sample(quantized, kind, steps=1, height=height, width=width)  # calibration
    compiled = compile_core.compile_model(quantized, compile_core.CompileSettings())
    with record_calls() as calls:
        out = sample(compiled, kind, steps=3, height=height, width=width)
    gpu_int8 = sum(n for (_, backend, path), n in calls.items() if backend in ("triton", "cuda") and path == "int8")
    assert gpu_int8 > 0, dict(calls)
    for name, layer in _int8_layers(quantized).items():
        assert layer.weight.dtype == torch.int8 and layer.weight.device.type == "cuda", name
        kept = [t for t in (layer.weight_scale, layer.bias) if t is not None]
        assert all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in kept), (name, [t.dtype for t in kept])
    assert torch.isfinite(out).all()
    assert rel(out, reference) < 0.2, "INT8 + compile on the stored model strays from the fp32 model"


def test_low_vram_loading_runs_int8_and_matches_the_full_load(pack):
    """ComfyUI's partial load (lowvram_model_memory: layers that do not fit stay in RAM and are cast per forward):
    the INT8 model built from those layers runs its INT8 kernels on the GPU and equals the fully loaded one."""
    from comfyui_int8_accel.nodes import int8 as quant
    from harness.tiny_models import build_tiny_model
    from tests.support.int8_checks import ALL_INT8

    gen = torch.Generator().manual_seed(3)
    x, t, context = (torch.randn(2, 4, 8, 8, generator=gen).to(DEVICE), torch.tensor([700.0, 700.0], device=DEVICE),
                     torch.randn(2, 8, 768, generator=gen).to(DEVICE))  # fmt: skip
    base = build_tiny_model("sd15", seed=5)

    def run(patcher, lowvram: bool):
        patcher.patch_model(device_to=DEVICE, lowvram_model_memory=1 if lowvram else 0)
        offloaded = [m for m in patcher.model.diffusion_model.modules()
                     if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and m.weight.device.type == "cpu"]
        try:
            with torch.inference_mode(), record_calls() as calls:
                outs = [patcher.model.apply_model(x, t, c_crossattn=context,
                                                  transformer_options={"wrappers": patcher.wrappers})
                        for _ in range(2)]  # the first call calibrates
            return outs[-1], calls, offloaded
        finally:
            patcher.unpatch_model(device_to=torch.device("cpu"))

    partial, partial_calls, offloaded = run(quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))[0],
                                            lowvram=True)
    full, full_calls, resident_offloaded = run(quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))[0],
                                               lowvram=False)
    assert offloaded and not resident_offloaded, "ComfyUI did not load the model partially"
    for calls in (partial_calls, full_calls):
        assert sum(n for (_, backend, path), n in calls.items() if backend in ("triton", "cuda") and path == "int8") > 0
    assert partial.device.type == "cuda" and torch.isfinite(partial).all()
    assert torch.allclose(partial, full, rtol=1e-4, atol=1e-4)


def test_reduce_overhead_keeps_deepcache_features_across_model_calls(pack):
    """DeepCache reuses a block's output from an earlier model call: the CUDA-graph step begun by the next call
    must not have overwritten it."""
    from comfyui_int8_accel.nodes import compile as compile_core
    from comfyui_int8_accel.nodes import deepcache
    from harness.tiny_models import build_tiny_model, sample
    from tests.support.int8_checks import rel

    model = build_tiny_model("sd15", seed=6)
    cached = deepcache.apply_deepcache(model, cache_interval=2, cache_depth=1)
    eager = sample(cached, "sd15", steps=4, height=64, width=64)
    for first in ("deepcache", "compile"):
        if first == "deepcache":
            stacked = compile_core.compile_model(cached, compile_core.CompileSettings(mode="reduce-overhead"))
        else:
            compiled = compile_core.compile_model(model, compile_core.CompileSettings(mode="reduce-overhead"))
            stacked = deepcache.apply_deepcache(compiled, cache_interval=2, cache_depth=1)
        for _ in range(2):
            assert rel(sample(stacked, "sd15", steps=4, height=64, width=64), eager) < 1e-3, first
