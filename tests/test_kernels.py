"""INT8 kernel units on the CPU: accuracy against float64 for both weight widths on every backend that runs on
CPU tensors, backend dispatch and call recording, saturation, the shared helpers, torch.library and compile."""

from __future__ import annotations

import gc
import logging
import platform
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from comfyui_int8_accel.kernels import (
    KERNEL_BACKENDS,
    CompiledOrEager,
    KernelBackendUnavailableError,
    compute_density,
    content_checksum,
    conv_output_shape,
    cpu,
    cuda,
    dequantize_weight,
    force_kernel_backend,
    int8_conv2d,
    int8_linear,
    kernel_backend_for,
    linear_activation_granularity,
    normalized_mse,
    policy,
    quantize_weight_per_channel,
    record_calls,
    reference,
    release_packed_weight,
    runs_in_float,
    set_linear_activation_granularity,
    triton_backend,
    weight_bits,
    weight_qmax,
    weight_stamp,
)
from comfyui_int8_accel.kernels.quant import cpu_has_int8_dot_product
from comfyui_int8_accel.kernels.weight_cache import CACHE

VNNI = cpu_has_int8_dot_product()
CPU_BITS = weight_bits("cpu")  # what the cpu backend uses here (7 without VNNI or with INT8_ACCEL_WEIGHT_BITS=7)
QMAX = {8: 127, 7: 63}
# Relative L2 error bounds (sqrt of normalized_mse) vs float64 per weight width, ~1.4x what this code measures.
# A wrong scale gives errors near 1, saturation several percent; 7-bit weights break the 8-bit gaussian bound.
GAUSS_BOUND = {8: 0.0125, 7: 0.018}
CONV_GAUSS_BOUND = {8: 0.016, 7: 0.02}  # one activation scale per tensor: more spread with the draw
LINEAR_OUTLIER_BOUND = 0.07
CONV_OUTLIER_BOUND = 0.09
# normalized_mse against the reference backend with the same weights: the cuda backend accumulates exactly in
# int32 (float rounding of the epilogue only); oneDNN rounds its fp32 rescale differently.
AGREEMENT = {"reference": 0.0, "cuda": 1e-12, "cpu": 1e-7}
NO_VNNI = (
    "8-bit weights on the cpu backend need VNNI/AMX: without them u8 x s8 pair sums clip at 16 bits "
    "(test_8bit_weights_clip_on_the_cpu_backend_exactly_when_it_lacks_vnni)"
)


def widths(*backends: str) -> list:
    """(backend, weight bits) cases: 7 bits on every backend, 8 where the backend accumulates exactly."""
    cases = []
    for backend in backends:
        unavailable = policy.kernel_backend_unavailable_reason(backend)
        for bits in (7, 8):
            marks = []
            if unavailable:
                marks.append(pytest.mark.skip(reason=f"backend {backend} unavailable: {unavailable}"))
            elif backend == "cpu" and bits == 8 and not VNNI:
                marks.append(pytest.mark.skip(reason=NO_VNNI))
            cases.append(pytest.param(backend, bits, marks=marks, id=f"{backend}-{bits}bit"))
    return cases


CPU_TENSOR_BACKENDS = widths("cpu", "cuda", "reference")
CPU_BACKEND = widths("cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture
def default_cpu_floors(monkeypatch):
    """The cpu backend's size floors at their defaults (the suite sets them to 0 for its tiny models)."""
    monkeypatch.setattr(cpu, "LINEAR_MIN_MACS", cpu.DEFAULT_LINEAR_MIN_MACS)
    monkeypatch.setattr(cpu, "CONV_MIN_MACS", cpu.DEFAULT_CONV_MIN_MACS)
    monkeypatch.setattr(cpu, "MIN_REDUCTION", cpu.DEFAULT_MIN_REDUCTION)


def relative_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    return normalized_mse(y, ref) ** 0.5


def with_outlier_channels(x: torch.Tensor, dim: int, seed: int = 1) -> torch.Tensor:
    """1% of the channels along `dim` (at least one) multiplied by 50, as trained transformers show."""
    g = torch.Generator().manual_seed(seed)
    channels = x.shape[dim]
    idx = torch.randperm(channels, generator=g)[: max(1, channels // 100)]
    out = x.clone()
    out.index_copy_(dim, idx, out.index_select(dim, idx) * 50)
    return out


def make_weight(shape: tuple[int, ...], seed: int = 0, bias: bool = True, bits: int = CPU_BITS):
    """float64 weight N(0, 1/fan_in) and bias, and the weight quantized to `bits`: (w, b, q, s)."""
    g = torch.Generator().manual_seed(seed)
    fan_in = torch.Size(shape[1:]).numel()
    w = torch.randn(*shape, generator=g, dtype=torch.float64) / fan_in**0.5
    b = torch.randn(shape[0], generator=g, dtype=torch.float64) if bias else None
    q, s = quantize_weight_per_channel(w.float(), QMAX[bits])
    return w, b, q, s


def make_linear(n: int, k: int, **kwargs):
    return make_weight((n, k), **kwargs)


def make_conv(cout: int, cin_g: int, kh: int, kw: int, **kwargs):
    return make_weight((cout, cin_g, kh, kw), **kwargs)


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def run(backend: str, fn, *args):
    """fn(*args) forced through `backend`, asserting that backend ran it with INT8 arithmetic."""
    with force_kernel_backend(backend), record_calls() as calls:
        y = fn(*args)
    op = "linear" if fn is int8_linear else "conv2d"
    assert calls == {(op, backend, "int8"): 1}
    return y


def check_accuracy(backend: str, fn, args: tuple, ref: torch.Tensor, bound: float) -> torch.Tensor:
    """fn(*args) through `backend`: within `bound` of the float64 `ref`, and what the reference backend computes."""
    y = run(backend, fn, *args)
    assert y.shape == ref.shape and y.is_contiguous()
    assert relative_l2(y, ref) < bound
    assert normalized_mse(y, run("reference", fn, *args)) <= AGREEMENT[backend]
    return y


# ---- primitives -------------------------------------------------------------------------------------


def test_weight_width_follows_the_int8_dot_product_instructions(monkeypatch):
    monkeypatch.delenv("INT8_ACCEL_WEIGHT_BITS", raising=False)
    assert weight_bits("cuda") == 8 and weight_qmax("cuda") == 127
    assert weight_bits("cpu") == (8 if VNNI else 7)
    assert weight_qmax(torch.device("cpu")) == (127 if VNNI else 63)
    # the width belongs to the kernels that will run: the exact backends take 8-bit weights on any CPU
    for exact in ("reference", "cuda"):
        with force_kernel_backend(exact):
            assert weight_bits("cpu") == 8


def test_weight_bits_switch_forces_7_bits_everywhere(monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_WEIGHT_BITS", "7")
    for device in ("cpu", "cuda", torch.device("meta")):
        assert weight_bits(device) == 7 and weight_qmax(device) == 63
    monkeypatch.setenv("INT8_ACCEL_WEIGHT_BITS", "8")  # 8 bits cannot be forced: it saturates without VNNI
    with pytest.raises(ValueError, match="INT8_ACCEL_WEIGHT_BITS"):
        weight_qmax("cuda")
    monkeypatch.delenv("INT8_ACCEL_WEIGHT_BITS")
    monkeypatch.setenv("INT8_ACCEL_WEIGHT_QMAX", "5")  # the old undocumented override is gone
    assert weight_qmax("cuda") == 127


def test_per_channel_weight_quantization():
    w = torch.randn(6, 4, 3, 3)
    w[2] = 0.0
    w[4, 0, 0, 0] = -9.0
    q, s = quantize_weight_per_channel(w, 63)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (6,)
    assert int(q.abs().max()) == 63 and int(q[4, 0, 0, 0]) == -63
    assert float(s[4]) == pytest.approx(9.0 / 63)
    assert float(s[2]) == 1.0 and int(q[2].abs().max()) == 0
    err = (dequantize_weight(q, s) - w).abs().amax(dim=(1, 2, 3))
    assert torch.all(err <= s / 2 + 1e-6)
    assert dequantize_weight(q, s, torch.float16).dtype == torch.float16
    with pytest.raises(ValueError):
        quantize_weight_per_channel(w, 200)


def test_metrics():
    assert compute_density(4096, 320, 320) == pytest.approx(4096 * 320 * 320 / (4096 * 320 + 320 * 320 + 4096 * 320))
    assert compute_density(1, 1, 1) == pytest.approx(1 / 3)
    assert normalized_mse(torch.zeros(3), torch.zeros(3)) == 0.0
    assert normalized_mse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])) == pytest.approx(0.5)
    assert normalized_mse(torch.ones(2), torch.zeros(2)) == float("inf")


@pytest.mark.parametrize(
    "x_shape,w_shape,stride,padding,dilation",
    [((2, 3, 17, 9), (5, 3, 3, 3), 1, 1, 1), ((1, 4, 33, 31), (8, 4, 3, 5), (2, 3), (1, 2), (1, 2)),
     ((3, 2, 7, 7), (4, 2, 1, 1), 2, 0, 1), ((1, 1, 5, 6), (1, 1, 5, 6), 1, 0, 1)],
)  # fmt: skip
def test_conv_output_shape_agrees_with_conv2d(x_shape, w_shape, stride, padding, dilation):
    expected = F.conv2d(torch.zeros(x_shape), torch.zeros(w_shape), None, stride, padding, dilation).shape
    shape = conv_output_shape(x_shape, w_shape, stride, padding, dilation)
    assert shape == tuple(expected) and all(type(v) is int for v in shape)


def test_weight_stamp_sees_in_place_copies_under_inference_mode():
    with torch.inference_mode():
        w = torch.randn(64, 48)
        stamp = weight_stamp(w)
        assert stamp == weight_stamp(w) and hash(stamp) == hash(weight_stamp(w))
        assert stamp[0] == -1  # inference tensors have no version counter
        w.data.copy_(w * 0.5)  # same storage, same version: only the content tells
        assert weight_stamp(w)[1] == stamp[1] and weight_stamp(w) != stamp
    v = torch.zeros(8)
    before = weight_stamp(v)
    v.add_(1)
    assert weight_stamp(v)[0] == before[0] + 1 and weight_stamp(v) != before


def test_content_checksum_covers_every_byte():
    base = torch.arange(37, dtype=torch.int8)
    for t in (base, base[3:], base[5:34], base[::2], base[:5]):  # unaligned, odd-sized, strided, under a word
        total = content_checksum(t)
        assert total == content_checksum(t.clone())  # the content counts, not the layout
        changed = t.clone()
        changed[-1] += 1
        assert content_checksum(changed) != total
    assert content_checksum(base[:5]) == sum(range(5))
    assert content_checksum(torch.empty(0)) == 0


# ---- Linear -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
@pytest.mark.parametrize(
    "x_shape,n,bias",
    [((512, 320), 640, True), ((2, 77, 768), 320, False), ((256, 1280), 320, True), ((64, 320), 320, True)],
)
def test_linear_accuracy_gaussian(x_shape, n, bias, backend, bits):
    w, b, q, s = make_linear(n, x_shape[-1], bias=bias, bits=bits)
    x = torch.randn(*x_shape, dtype=torch.float64)
    y = check_accuracy(backend, int8_linear, (x.float(), q, s, f32(b)), F.linear(x, w, b), GAUSS_BOUND[bits])
    assert y.dtype == torch.float32


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
@pytest.mark.parametrize("m,k,n", [(512, 320, 640), (256, 1280, 320)])
def test_linear_accuracy_outlier_channels(m, k, n, backend, bits):
    w, b, q, s = make_linear(n, k, seed=3, bits=bits)
    x = with_outlier_channels(torch.randn(m, k, dtype=torch.float64), dim=1)
    ref = F.linear(x, w, b)
    err = relative_l2(run(backend, int8_linear, x.float(), q, s, f32(b)), ref)
    assert GAUSS_BOUND[bits] / 3 < err < LINEAR_OUTLIER_BOUND  # outliers do cost accuracy, within the bound


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
def test_linear_per_token_scales_isolate_loud_tokens(backend, bits):
    w, b, q, s = make_linear(64, 256, seed=4, bits=bits)
    x = torch.randn(128, 256, dtype=torch.float64)
    x[7] *= 1000.0  # one loud token must not wreck the resolution of the others
    ref = F.linear(x, w, b)
    y = run(backend, int8_linear, x.float(), q, s, f32(b))
    quiet = torch.ones(128, dtype=torch.bool)
    quiet[7] = False
    assert relative_l2(y[quiet], ref[quiet]) < GAUSS_BOUND[bits]
    assert relative_l2(y[7], ref[7]) < GAUSS_BOUND[bits]


@pytest.mark.parametrize("backend,bits", CPU_BACKEND)
@pytest.mark.parametrize("fbgemm", [True, False])
def test_linear_per_tensor_granularity(monkeypatch, fbgemm, backend, bits):
    if not fbgemm:
        monkeypatch.setattr(cpu, "fbgemm_available", lambda: False)
    w, b, q, s = make_linear(256, 320, seed=7, bits=bits)
    x = torch.randn(3, 100, 320, dtype=torch.float64)
    x[0, 0] *= 20.0  # a loud token costs the others resolution only per tensor
    ref = F.linear(x, w, b)
    per_token = run(backend, int8_linear, x.float(), q, s, f32(b))
    assert linear_activation_granularity() == "token"
    set_linear_activation_granularity("tensor")
    try:
        per_tensor = run(backend, int8_linear, x.float(), q, s, f32(b))
        per_tensor_ref = run("reference", int8_linear, x.float(), q, s, f32(b))
    finally:
        set_linear_activation_granularity("token")
    assert normalized_mse(per_tensor, per_tensor_ref) < 1e-6
    token_err, tensor_err = relative_l2(per_token, ref), relative_l2(per_tensor, ref)
    assert token_err < GAUSS_BOUND[bits] and 3 * token_err < tensor_err < 0.15
    with pytest.raises(ValueError):
        set_linear_activation_granularity("channel")


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_half_inputs(dtype, backend, bits):
    w, b, q, s = make_linear(320, 640, bits=bits)
    x = torch.randn(2, 300, 640).to(dtype)
    y = run(backend, int8_linear, x, q, s, b.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 300, 320)
    tolerance = GAUSS_BOUND[bits] + (0.004 if dtype == torch.bfloat16 else 0.001)
    assert relative_l2(y, F.linear(x.double(), w, b)) < tolerance


# ---- Conv2d -----------------------------------------------------------------------------------------

CONV_CASES = [
    # (x shape, cout, kernel, stride, padding, dilation, groups, bias)
    ((2, 64, 32, 32), 128, 3, 1, 1, 1, 1, True),
    ((1, 64, 33, 31), 64, 3, 2, 1, 1, 1, False),
    ((2, 128, 16, 16), 64, 1, 1, 0, 1, 1, True),
    ((1, 64, 20, 20), 64, 3, 1, 1, 1, 2, True),
    ((1, 32, 24, 24), 64, 3, (1, 2), (2, 0), 2, 1, True),
]


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
@pytest.mark.parametrize("x_shape,cout,kernel,stride,padding,dilation,groups,bias", CONV_CASES)
def test_conv_accuracy_gaussian(x_shape, cout, kernel, stride, padding, dilation, groups, bias, backend, bits):
    w, b, q, s = make_conv(cout, x_shape[1] // groups, kernel, kernel, bias=bias, bits=bits)
    x = torch.randn(*x_shape, dtype=torch.float64)
    args = (x.float(), q, s, f32(b), stride, padding, dilation, groups)
    check_accuracy(backend, int8_conv2d, args, F.conv2d(x, w, b, stride, padding, dilation, groups), CONV_GAUSS_BOUND[bits])


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
def test_conv_accuracy_outlier_channels_and_relu_inputs(backend, bits):
    w, b, q, s = make_conv(128, 64, 3, 3, seed=5, bits=bits)
    x = torch.randn(2, 64, 32, 32, dtype=torch.float64)
    ref = F.conv2d(x.relu(), w, b, 1, 1)
    relu_err = relative_l2(run(backend, int8_conv2d, x.relu().float(), q, s, f32(b), 1, 1), ref)
    assert relu_err < GAUSS_BOUND[bits] * 0.8  # affine activations use all 8 bits on non-negative inputs
    xo = with_outlier_channels(x, dim=1)
    ref = F.conv2d(xo, w, b, 1, 1)
    err = relative_l2(run(backend, int8_conv2d, xo.float(), q, s, f32(b), 1, 1), ref)
    assert GAUSS_BOUND[bits] / 3 < err < CONV_OUTLIER_BOUND


@pytest.mark.parametrize("backend,bits", CPU_BACKEND)
@pytest.mark.parametrize("x_shape,stride,dilation", [((2, 128, 8, 8), 1, 1), ((1, 128, 15, 15), 2, 1), ((1, 64, 10, 10), 1, 2)])
def test_conv_small_feature_maps_per_patch_gemm(monkeypatch, x_shape, stride, dilation, backend, bits):
    """Few output pixels: the cpu backend runs a per-row INT8 GEMM over im2col patches instead of oneDNN's conv."""
    im2col_calls = []
    original = cpu._conv2d_im2col
    monkeypatch.setattr(cpu, "_conv2d_im2col", lambda *a: im2col_calls.append(1) or original(*a))
    w, b, q, s = make_conv(96, x_shape[1], 3, 3, seed=6, bits=bits)
    x = torch.randn(*x_shape, dtype=torch.float64)
    # One scale per patch rather than the reference's one per tensor: compared with float64 only.
    for inputs, bound in ((x, CONV_GAUSS_BOUND[bits]), (with_outlier_channels(x, dim=1), CONV_OUTLIER_BOUND)):
        ref = F.conv2d(inputs, w, b, stride, dilation, dilation)
        y = run(backend, int8_conv2d, inputs.float(), q, s, f32(b), stride, dilation, dilation)
        assert y.shape == ref.shape and y.is_contiguous()
        assert relative_l2(y, ref) < bound
    assert im2col_calls == [1, 1]


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_half_inputs(dtype, backend, bits):
    w, b, q, s = make_conv(64, 64, 3, 3, bits=bits)
    x = torch.randn(1, 64, 24, 24).to(dtype)
    y = run(backend, int8_conv2d, x, q, s, b.to(dtype), 1, 1)
    assert y.dtype == dtype and y.shape == (1, 64, 24, 24)
    tolerance = CONV_GAUSS_BOUND[bits] + (0.004 if dtype == torch.bfloat16 else 0.001)
    assert relative_l2(y, F.conv2d(x.double(), w, b, 1, 1)) < tolerance


# ---- saturation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_no_silent_saturation_linear(sign, backend, bits):
    """All activations at +max (uint8 255 on the cpu backend) and all weights at +-qmax: every u8 x s8 pair is
    as large as it gets, and the width each backend is given must still not clip."""
    k, n = 1024, 64
    q, s = quantize_weight_per_channel(torch.full((n, k), sign), QMAX[bits])
    assert int(q.abs().min()) == QMAX[bits]
    y = run(backend, int8_linear, torch.ones(32, k), q, s, None)
    assert torch.allclose(y, torch.full_like(y, sign * k), rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend,bits", CPU_TENSOR_BACKENDS)
def test_no_silent_saturation_conv(backend, bits):
    cin, cout = 256, 32
    q, s = quantize_weight_per_channel(torch.ones(cout, cin, 3, 3), QMAX[bits])
    x = torch.ones(1, cin, 12, 12)  # affine: zero point 0, every value 255
    y = run(backend, int8_conv2d, x, q, s, None, 1, 0)
    assert torch.allclose(y, torch.full_like(y, cin * 9.0), rtol=1e-5, atol=0)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the 16-bit pair sums are x86's")
@pytest.mark.skipif(policy.kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_8bit_weights_clip_on_the_cpu_backend_exactly_when_it_lacks_vnni():
    """Why 7-bit weights exist: without VNNI/AMX, oneDNN multiplies u8 x s8 with `vpmaddubsw`, whose pairwise
    sums saturate at +-32767, so 255 * 127 * 2 clips; 255 * 63 * 2 does not."""
    k, n = 1024, 64
    x = torch.ones(32, k)
    outputs = {}
    for bits in (7, 8):
        q, s = quantize_weight_per_channel(torch.ones(n, k), QMAX[bits])
        outputs[bits] = run("cpu", int8_linear, x, q, s, None)
    assert torch.allclose(outputs[7], torch.full_like(outputs[7], k), rtol=1e-5, atol=0)
    exact_8bit = torch.allclose(outputs[8], torch.full_like(outputs[8], k), rtol=1e-5, atol=0)
    assert exact_8bit == VNNI
    if not VNNI:
        assert float(outputs[8].max()) < 0.9 * k  # clipped, not merely rounded


# ---- backends, dispatch and recording -------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", [(5, 13, 7), (40, 64, 24), (17, 8, 8)])
def test_int_mm_padding_is_exact(m, k, n):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    acc = cuda.int_mm_padded(a, cuda.prepared_linear_weight(w), n)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ w.long().t())


def test_dispatch_table_and_automatic_choice(monkeypatch):
    assert KERNEL_BACKENDS == ("reference", "cpu", "cuda", "triton")
    assert tuple(policy.KERNEL_BACKEND_MODULES) == KERNEL_BACKENDS
    q, s = quantize_weight_per_channel(torch.randn(64, 128), 63)
    for name in ("reference", "cpu", "cuda"):  # the backends that run on CPU tensors without an interpreter
        y = policy.KERNEL_BACKEND_MODULES[name].linear(torch.randn(40, 128), q, s, None)
        assert isinstance(y, torch.Tensor) and y.shape == (40, 64), name  # every backend returns the output
    for module in policy.KERNEL_BACKEND_MODULES.values():
        assert callable(module.available) and callable(module.linear) and callable(module.conv2d)
    assert reference.available() is None and cuda.available() is None
    assert kernel_backend_for("cpu") == ("cpu" if cpu.available() is None else "reference")
    assert kernel_backend_for(torch.device("cuda", 0)) == ("triton" if triton_backend.available() is None else "cuda")
    assert kernel_backend_for("meta") == "reference"

    monkeypatch.setattr(triton_backend, "available", lambda: "no Triton in this test")
    assert kernel_backend_for("cuda") == "cuda"
    monkeypatch.setattr(cpu, "available", lambda: "no oneDNN in this test")
    assert kernel_backend_for("cpu") == "reference"
    _, b, q, s = make_linear(64, 128)
    with record_calls() as calls:
        int8_linear(torch.randn(32, 128), q, s, f32(b))
    assert calls == {("linear", "reference", "int8"): 1}


def test_forcing_an_unavailable_backend_names_the_reason(monkeypatch):
    monkeypatch.setattr(triton_backend, "available", lambda: "triton is not importable")
    with pytest.raises(KernelBackendUnavailableError, match="'triton'.*triton is not importable"):
        with force_kernel_backend("triton"):
            pytest.fail("entered a forced backend that cannot run")
    assert kernel_backend_for("cpu") == ("cpu" if cpu.available() is None else "reference")  # nothing left forced
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with force_kernel_backend("tpu"):
            pass
    with force_kernel_backend("reference"), force_kernel_backend("auto"):
        assert kernel_backend_for("meta") == "reference" and kernel_backend_for("cuda") == "cuda"


def test_force_backend_and_record_calls_are_thread_local():
    _, b, q, s = make_linear(64, 128)
    x = torch.randn(32, 128)
    forced_in_thread = threading.Event()
    main_checked = threading.Event()
    seen: dict = {}

    def worker():
        seen["inherited"] = kernel_backend_for("meta")  # main's forced "cuda" must not leak in here
        with force_kernel_backend("reference"), record_calls() as calls:
            forced_in_thread.set()
            main_checked.wait(10)
            int8_linear(x, q, s, f32(b))
        seen["calls"] = calls

    with force_kernel_backend("cuda"), record_calls() as main_calls:
        thread = threading.Thread(target=worker)
        thread.start()
        assert forced_in_thread.wait(10)
        assert kernel_backend_for("cpu") == "cuda"  # the worker's "reference" is not seen here
        int8_linear(x, q, s, f32(b))
        main_checked.set()
        thread.join(10)
    assert seen["inherited"] == "reference"  # auto's choice for a meta device, not "cuda"
    assert seen["calls"] == {("linear", "reference", "int8"): 1}
    assert main_calls == {("linear", "cuda", "int8"): 1}


@pytest.mark.skipif(policy.kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_record_calls_tells_int8_from_float_paths(default_cpu_floors):
    _, b, q, s = make_linear(8, 16)
    _, b_big, q_big, s_big = make_linear(256, 512)
    _, cb, cq, cs = make_conv(32, 4, 3, 3)  # a 4x3x3 reduction: too short for INT8 at any size
    _, cb_big, cq_big, cs_big = make_conv(64, 64, 3, 3)
    with force_kernel_backend("cpu"), record_calls() as outer:
        int8_linear(torch.randn(2, 16), q, s, f32(b))  # 256 MACs
        with record_calls() as inner:
            int8_linear(torch.randn(64, 512), q_big, s_big, f32(b_big))
            int8_conv2d(torch.randn(1, 4, 32, 32), cq, cs, f32(cb), 1, 1)
            int8_conv2d(torch.randn(1, 64, 32, 32), cq_big, cs_big, f32(cb_big), 1, 1)
            int8_linear(torch.randn(0, 512), q_big, s_big, None)  # nothing to compute
    assert inner == {
        ("linear", "cpu", "int8"): 1,
        ("linear", "cpu", "float"): 1,
        ("conv2d", "cpu", "float"): 1,
        ("conv2d", "cpu", "int8"): 1,
    }
    assert outer == inner + Counter({("linear", "cpu", "float"): 1})
    int8_linear(torch.randn(2, 16), q, s, f32(b))
    assert sum(outer.values()) == 5  # calls after the block are not counted


@pytest.mark.skipif(policy.kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_tiny_shapes_take_the_float_path_consistently(default_cpu_floors):
    w, b, q, s = make_linear(8, 16)
    x = torch.randn(2, 16)
    with force_kernel_backend("cpu"), record_calls() as calls:
        y = int8_linear(x, q, s, f32(b))  # 256 MACs: float with the dequantized weight
    assert calls == {("linear", "cpu", "float"): 1}
    assert torch.allclose(y, F.linear(x, dequantize_weight(q, s), f32(b)), atol=1e-6)
    assert relative_l2(y, F.linear(x.double(), w, b)) < GAUSS_BOUND[CPU_BITS]


@pytest.mark.skipif(policy.kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_runs_in_float_answers_for_the_backend_serving_the_device(default_cpu_floors):
    """The size-floor query says beforehand the path a call takes: the one `record_calls` then sees."""
    _, _, q, s = make_linear(8, 16)
    _, _, q_big, s_big = make_linear(256, 512)
    _, _, cq, cs = make_conv(32, 4, 3, 3)
    _, _, cq_big, cs_big = make_conv(64, 64, 3, 3)
    calls = [("linear", torch.randn(2, 16), q, s, {}), ("linear", torch.randn(64, 512), q_big, s_big, {}),
             ("conv2d", torch.randn(1, 4, 32, 32), cq, cs, {"padding": 1}),
             ("conv2d", torch.randn(1, 64, 32, 32), cq_big, cs_big, {"padding": 1}),
             ("conv2d", torch.randn(1, 64, 32, 32), cq_big, cs_big, {"stride": 4})]  # 64 output pixels: too few
    answers = []
    for op, x, qw, sw, conv_args in calls:
        with force_kernel_backend("cpu"), record_calls() as seen:
            (int8_linear(x, qw, sw, None) if op == "linear" else int8_conv2d(x, qw, sw, None, **conv_args))
        (path,) = {path for (_, _, path) in seen}
        answer = runs_in_float(op, x.shape, qw.shape, "cpu", **conv_args)
        assert answer == (path == "float"), (op, x.shape, conv_args)
        answers.append(answer)
    assert answers == [True, False, True, False, True]
    for name in ("reference", "cuda"):  # no size floor: every call runs the INT8 arithmetic
        with force_kernel_backend(name):
            assert not any(runs_in_float(op, x.shape, qw.shape, "cpu", **args) for op, x, qw, _, args in calls)
    with pytest.raises(ValueError, match="'linear' or 'conv2d'"):
        runs_in_float("conv", (1, 4, 8, 8), (8, 4, 3, 3), "cpu")


@pytest.mark.skipif(policy.kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_prepacked_weights_are_cached_once_and_released():
    _, b, q, s = make_linear(256, 512, seed=9)
    x = torch.randn(64, 512)
    gc.collect()  # entries of earlier tests' dead weights would otherwise go during this one
    before = len(CACHE)
    with force_kernel_backend("cpu"):
        y1 = int8_linear(x, q, s, f32(b))
        after_first = len(CACHE)
        y2 = int8_linear(x, q, s, f32(b))
        assert after_first == before + 1 and len(CACHE) == after_first
        assert torch.equal(y1, y2)
        q.copy_(-q)  # an in-place change is seen (version counter): repacked, not stale
        assert torch.allclose(int8_linear(x, q, s, None), -(y1 - f32(b)), atol=1e-4)
        q.data.copy_(-q)  # ComfyUI's copy_to_param: no version bump, caught by the content checksum
        assert torch.allclose(int8_linear(x, q, s, f32(b)), y1, atol=1e-4)
        release_packed_weight(q)
        assert len(CACHE) == before
        int8_linear(x, q, s, f32(b))
        assert len(CACHE) == before + 1
        with torch.inference_mode():  # inference tensors have no version counter at all
            qi = q.clone()
            yi = int8_linear(x, qi, s, None)
            qi[:, :10] = 0
            assert not torch.allclose(int8_linear(x, qi, s, None), yi, atol=1e-3)
            tolerance = 0.05 * float(yi.abs().max())
            assert torch.allclose(int8_linear(x, qi, s, None), F.linear(x, dequantize_weight(qi, s)), atol=tolerance)
    del qi
    del q
    gc.collect()
    assert len(CACHE) == before


# ---- CompiledOrEager ------------------------------------------------------------------------------------


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler in this test")


def _counting_backend(counter: list):
    def backend(gm, example_inputs):
        counter.append(1)
        return gm.forward

    return backend


def test_compiled_or_eager_falls_back_and_warns_once(caplog):
    wrapped = CompiledOrEager(lambda x: x * 2 + 1, name="doubler", compile_kwargs={"backend": _failing_backend})
    x = torch.randn(10)
    with caplog.at_level(logging.WARNING, logger="int8_accel.kernels"):
        for _ in range(3):
            assert torch.equal(wrapped(x), x * 2 + 1)
    warnings = [r for r in caplog.records if r.name == "int8_accel.kernels"]
    assert len(warnings) == 1 and "doubler" in warnings[0].getMessage() and "no compiler" in warnings[0].getMessage()
    assert wrapped.compiled is None and "no compiler in this test" in wrapped.disabled_reason


def test_compiled_or_eager_honours_min_numel_and_disabled_reason():
    compiles: list = []
    wrapped = CompiledOrEager(lambda x, y: x - y, name="sub", compile_kwargs={"backend": _counting_backend(compiles)},
                              min_numel=100)  # fmt: skip
    small = torch.randn(10)
    assert torch.equal(wrapped(small, 1.0), small - 1.0)
    assert wrapped.compiled is None and compiles == []  # below min_numel: eager, not even compiled
    large = torch.randn(1000)
    assert torch.equal(wrapped(large, 1.0), large - 1.0)
    assert wrapped.compiled is not None and compiles == [1] and wrapped.disabled_reason is None

    never: list = []
    off = CompiledOrEager(lambda x: x + 1, name="off", compile_kwargs={"backend": _counting_backend(never)},
                          disabled_reason="switched off")  # fmt: skip
    assert torch.equal(off(large), large + 1)
    assert off.compiled is None and never == [] and off.disabled_reason == "switched off"


def test_compiled_or_eager_compiles_ahead_on_a_stand_in():
    """With compile_ahead, the first call below min_numel compiles (on a stand-in, its own result stays eager), so
    no later size compiles, non-square and other batches included; after torch._dynamo.reset() the next small
    call compiles again."""
    from comfyui_int8_accel.kernels.compiled import distinct_sizes

    if not distinct_sizes():  # PyTorch before 2.5 has no use_duck_shape switch: equal sizes share a symbol there
        pytest.skip(f"torch {torch.__version__} has no torch.fx.experimental._config.use_duck_shape")

    def scale_rows(x):
        return x * x.abs().amax(dim=(-2, -1), keepdim=True).reciprocal()

    compiles: list = []
    wrapped = CompiledOrEager(scale_rows, name="scale", compile_kwargs={"backend": _counting_backend(compiles),
                                                                        "dynamic": True},
                              min_numel=4096, compile_ahead=True, config_patches=distinct_sizes())
    torch._dynamo.reset()
    with torch.inference_mode():
        small = torch.randn(1, 3, 4, 4)
        assert torch.equal(wrapped(small), scale_rows(small)) and compiles == [1]
        assert torch.equal(wrapped(small), scale_rows(small)) and compiles == [1]
        for shape in ((2, 8, 16, 16), (3, 8, 24, 16), (4, 16, 16, 24)):  # square, then not
            x = torch.randn(shape)
            assert torch.equal(wrapped(x), scale_rows(x))
        assert compiles == [1], "a new size compiled"
        torch._dynamo.reset()
        wrapped(small)
    assert compiles == [1, 1] and wrapped.disabled_reason is None


def test_stand_in_tensor_is_large_and_laid_out_like_the_input():
    from comfyui_int8_accel.kernels.compiled import stand_in_tensor

    x = torch.randn(1, 8, 3, 1).contiguous(memory_format=torch.channels_last)
    stand_in = stand_in_tensor(x, 1000)
    assert stand_in.shape[1:] == (8, 3, 2) and stand_in.numel() >= 1000 and stand_in.shape[0] > 1
    assert stand_in.is_contiguous(memory_format=torch.channels_last) and not stand_in.is_inference()
    with torch.inference_mode():
        inference = torch.randn(5, 7)
    stand_in = stand_in_tensor(inference, 100)
    assert stand_in.shape == (15, 7) and stand_in.is_contiguous() and stand_in.is_inference()


def test_compiled_or_eager_float32_no_grad_and_genuine_errors():
    seen = []

    def probe(x):
        seen.append((x.dtype, torch.is_grad_enabled()))
        return x.sum()

    wrapped = CompiledOrEager(probe, name="probe", float32_no_grad=True, disabled_reason="eager for this test")
    wrapped(torch.randn(4, dtype=torch.float16, requires_grad=True))
    assert seen == [(torch.float32, False)]

    def broken(x):
        return x @ torch.ones(3, 3)  # wrong shapes: a real error, not a compiler failure

    wrapped = CompiledOrEager(broken, name="broken", compile_kwargs={"backend": "eager"})
    with pytest.raises(RuntimeError):
        wrapped(torch.randn(2, 5))
    assert wrapped.disabled_reason is None  # a genuine error does not switch compiling off


# ---- torch.library / compile ----------------------------------------------------------------------------


class _TinyInt8Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _, b, q, s = make_conv(64, 32, 3, 3)
        self.register_buffer("conv_q", q)
        self.register_buffer("conv_s", s)
        self.register_buffer("conv_b", f32(b))
        _, b, q, s = make_linear(64, 64)
        self.register_buffer("lin_q", q)
        self.register_buffer("lin_s", s)
        self.register_buffer("lin_b", f32(b))

    def forward(self, x):
        h = int8_conv2d(x, self.conv_q, self.conv_s, self.conv_b, 1, 1)
        h = torch.nn.functional.silu(h).flatten(2).transpose(1, 2)
        return int8_linear(h, self.lin_q, self.lin_s, self.lin_b)


def test_ops_are_registered_with_fake_kernels():
    x = torch.randn(2, 16, 10, 10)
    _, b, q, s = make_conv(32, 16, 3, 3)
    torch.library.opcheck(torch.ops.int8_accel.conv2d.default, (x, q, s, f32(b), [2, 2], [1, 1], [1, 1], 1))
    _, b, q, s = make_linear(64, 96)
    torch.library.opcheck(torch.ops.int8_accel.linear.default, (torch.randn(3, 40, 96), q, s, None))


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    net = _TinyInt8Net()
    x = torch.randn(2, 32, 16, 16)  # large enough for the INT8 kernels, not the float fallback
    eager = net(x)
    with force_kernel_backend("reference"):
        assert normalized_mse(eager, net(x)) < 1e-7
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x), eager, atol=1e-5)
    compiled_inductor = torch.compile(net, fullgraph=True)
    with record_calls() as calls:
        assert torch.allclose(compiled_inductor(x), eager, atol=1e-5)
    auto = kernel_backend_for("cpu")
    assert calls == {("conv2d", auto, "int8"): 1, ("linear", auto, "int8"): 1}  # the ops ran, in INT8


@pytest.mark.skipif(policy.kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_compiled_quantizers_on_large_inputs_match_reference():
    """Inputs above half a million elements go through the torch.compile'd quantizers."""
    w, b, q, s = make_linear(128, 320, seed=11)
    x = torch.randn(2048, 320, dtype=torch.float64)
    check_accuracy("cpu", int8_linear, (x.float(), q, s, f32(b)), F.linear(x, w, b), GAUSS_BOUND[CPU_BITS])
    w, b, q, s = make_conv(64, 256, 3, 3, seed=12)
    x = torch.randn(1, 256, 48, 48, dtype=torch.float64)
    ref = F.conv2d(x, w, b, 1, 1)
    check_accuracy("cpu", int8_conv2d, (x.float(), q, s, f32(b), 1, 1), ref, CONV_GAUSS_BOUND[CPU_BITS])
    for quantizer in (cpu.quantize_rows_u8, cpu.quantize_tensor_u8):
        assert quantizer.compiled is not None and quantizer.disabled_reason is None


def test_eager_calls_skip_the_custom_op_dispatch_and_traced_calls_use_it(monkeypatch):
    """A plain eager call runs the INT8 op's body directly (the custom op's dispatch costs tens of microseconds of
    host time per call on a GPU); a call under a dispatch mode (FLOP counting, fake tensors) or torch.compile
    tracing goes through the registered op, which those see as one opaque op. Same result either way."""
    from torch.utils.flop_counter import FlopCounterMode

    from comfyui_int8_accel.kernels import ops

    calls: list[str] = []  # a list, not a Counter: dynamo traces a list's append on every supported PyTorch

    def counting(name, op):
        def call(*args):
            calls.append(name)
            return op(*args)

        return call

    monkeypatch.setattr(ops, "_linear_op", counting("linear", ops._linear_op))
    monkeypatch.setattr(ops, "_conv2d_op", counting("conv2d", ops._conv2d_op))
    gen = torch.Generator().manual_seed(0)
    x, cx = torch.randn(8, 64, generator=gen), torch.randn(1, 16, 10, 10, generator=gen)
    q, s = quantize_weight_per_channel(torch.randn(32, 64, generator=gen), 127)
    cq, cs = quantize_weight_per_channel(torch.randn(8, 16, 3, 3, generator=gen), 127)
    eager = int8_linear(x, q, s, None), int8_conv2d(cx, cq, cs, None, 1, 1)
    assert calls == []
    with FlopCounterMode(display=False):
        counted = int8_linear(x, q, s, None), int8_conv2d(cx, cq, cs, None, 1, 1)
    assert calls == ["linear", "conv2d"]
    assert all(torch.equal(a, b) for a, b in zip(eager, counted, strict=True))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: int8_linear(t, q, s, None), backend="eager")
    assert torch.equal(compiled(x), eager[0])
    assert calls.count("linear") == 2  # traced through the op
