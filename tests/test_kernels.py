"""INT8 kernel units on the CPU: accuracy against float64, agreement between backends, saturation, compile."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from kernels import (
    compute_density,
    cpu_native,
    cuda_path,
    dequantize_weight,
    force_backend,
    int8_conv2d,
    int8_linear,
    linear_activation_granularity,
    normalized_mse,
    quant,
    quantize_weight_per_channel,
    set_linear_activation_granularity,
    weight_qmax,
)
from kernels.weight_cache import CACHE

CPU = torch.device("cpu")
QMAX = weight_qmax(CPU)
# Relative L2 error bounds (sqrt of normalized_mse) vs float64, ~1.4x what this code measures. A wrong scale
# gives errors near 1, saturation several percent; 7-bit weights on a VNNI CPU already break the gaussian bound.
GAUSS_BOUND = {127: 0.0125, 63: 0.018}[QMAX]
CONV_GAUSS_BOUND = {127: 0.016, 63: 0.02}[QMAX]  # one scale per tensor: more spread with the draw
LINEAR_OUTLIER_BOUND = 0.07
CONV_OUTLIER_BOUND = 0.09


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


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


def make_linear(n: int, k: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    q, s = quantize_weight_per_channel(w.float(), QMAX)
    return w, b, q, s


def make_conv(cout: int, cin_g: int, kh: int, kw: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(cout, cin_g, kh, kw, generator=g, dtype=torch.float64) / (cin_g * kh * kw) ** 0.5
    b = torch.randn(cout, generator=g, dtype=torch.float64) if bias else None
    q, s = quantize_weight_per_channel(w.float(), QMAX)
    return w, b, q, s


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


# ---- primitives -------------------------------------------------------------------------------------


def test_weight_qmax_follows_the_int8_dot_product_instructions():
    assert weight_qmax("cuda") == 127
    assert QMAX == (127 if quant.cpu_has_int8_dot_product() else 63)


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


# ---- Linear -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x_shape,n,bias",
    [((512, 320), 640, True), ((2, 77, 768), 320, False), ((256, 1280), 320, True), ((64, 320), 320, True)],
)
def test_linear_accuracy_gaussian(x_shape, n, bias):
    w, b, q, s = make_linear(n, x_shape[-1], bias=bias)
    x = torch.randn(*x_shape, dtype=torch.float64)
    ref = F.linear(x, w, b)
    with force_backend("reference"):
        y_ref = int8_linear(x.float(), q, s, f32(b))
    y = int8_linear(x.float(), q, s, f32(b))
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert relative_l2(y, ref) < GAUSS_BOUND
    # The native path computes what the reference defines (float rounding apart).
    assert normalized_mse(y, y_ref) < 1e-7


@pytest.mark.parametrize("m,k,n", [(512, 320, 640), (256, 1280, 320)])
def test_linear_accuracy_outlier_channels(m, k, n):
    w, b, q, s = make_linear(n, k, seed=3)
    x = with_outlier_channels(torch.randn(m, k, dtype=torch.float64), dim=1)
    ref = F.linear(x, w, b)
    y = int8_linear(x.float(), q, s, f32(b))
    err = relative_l2(y, ref)
    assert GAUSS_BOUND / 3 < err < LINEAR_OUTLIER_BOUND  # outliers do cost accuracy, within the bound


def test_linear_per_token_scales_isolate_loud_tokens():
    w, b, q, s = make_linear(64, 256, seed=4)
    x = torch.randn(128, 256, dtype=torch.float64)
    x[7] *= 1000.0  # one loud token must not wreck the resolution of the others
    ref = F.linear(x, w, b)
    y = int8_linear(x.float(), q, s, f32(b))
    quiet = torch.ones(128, dtype=torch.bool)
    quiet[7] = False
    assert relative_l2(y[quiet], ref[quiet]) < GAUSS_BOUND
    assert relative_l2(y[7], ref[7]) < GAUSS_BOUND


@pytest.mark.parametrize("fbgemm", [True, False])
def test_linear_per_tensor_granularity(monkeypatch, fbgemm):
    if not fbgemm:
        monkeypatch.setattr(cpu_native, "fbgemm_available", lambda: False)
    w, b, q, s = make_linear(256, 320, seed=7)
    x = torch.randn(3, 100, 320, dtype=torch.float64)
    x[0, 0] *= 20.0  # a loud token costs the others resolution only per tensor
    ref = F.linear(x, w, b)
    per_token = int8_linear(x.float(), q, s, f32(b))
    assert linear_activation_granularity() == "token"
    set_linear_activation_granularity("tensor")
    try:
        per_tensor = int8_linear(x.float(), q, s, f32(b))
        with force_backend("reference"):
            per_tensor_ref = int8_linear(x.float(), q, s, f32(b))
    finally:
        set_linear_activation_granularity("token")
    assert normalized_mse(per_tensor, per_tensor_ref) < 1e-6
    token_err, tensor_err = relative_l2(per_token, ref), relative_l2(per_tensor, ref)
    assert token_err < GAUSS_BOUND and 3 * token_err < tensor_err < 0.15  # measured 0.087
    with pytest.raises(ValueError):
        set_linear_activation_granularity("channel")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_half_inputs(dtype):
    w, b, q, s = make_linear(320, 640)
    x = torch.randn(2, 300, 640).to(dtype)
    y = int8_linear(x, q, s, b.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 300, 320)
    ref = F.linear(x.double(), w, b)
    tolerance = GAUSS_BOUND + (0.004 if dtype == torch.bfloat16 else 0.001)
    assert relative_l2(y, ref) < tolerance


# ---- Conv2d -----------------------------------------------------------------------------------------

CONV_CASES = [
    # (x shape, cout, kernel, stride, padding, dilation, groups, bias)
    ((2, 64, 32, 32), 128, 3, 1, 1, 1, 1, True),
    ((1, 64, 33, 31), 64, 3, 2, 1, 1, 1, False),
    ((2, 128, 16, 16), 64, 1, 1, 0, 1, 1, True),
    ((1, 64, 20, 20), 64, 3, 1, 1, 1, 2, True),
    ((1, 32, 24, 24), 64, 3, (1, 2), (2, 0), 2, 1, True),
]


@pytest.mark.parametrize("x_shape,cout,kernel,stride,padding,dilation,groups,bias", CONV_CASES)
def test_conv_accuracy_gaussian(x_shape, cout, kernel, stride, padding, dilation, groups, bias):
    w, b, q, s = make_conv(cout, x_shape[1] // groups, kernel, kernel, bias=bias)
    x = torch.randn(*x_shape, dtype=torch.float64)
    ref = F.conv2d(x, w, b, stride, padding, dilation, groups)
    with force_backend("reference"):
        y_ref = int8_conv2d(x.float(), q, s, f32(b), stride, padding, dilation, groups)
    y = int8_conv2d(x.float(), q, s, f32(b), stride, padding, dilation, groups)
    assert y.shape == ref.shape and y.is_contiguous()
    assert relative_l2(y, ref) < CONV_GAUSS_BOUND
    assert normalized_mse(y, y_ref) < 1e-7


def test_conv_accuracy_outlier_channels_and_relu_inputs():
    w, b, q, s = make_conv(128, 64, 3, 3, seed=5)
    x = torch.randn(2, 64, 32, 32, dtype=torch.float64)
    ref = F.conv2d(x.relu(), w, b, 1, 1)
    y = int8_conv2d(x.relu().float(), q, s, f32(b), 1, 1)
    relu_err = relative_l2(y, ref)
    assert relu_err < GAUSS_BOUND * 0.8  # affine activations use all 8 bits on non-negative inputs
    xo = with_outlier_channels(x, dim=1)
    ref = F.conv2d(xo, w, b, 1, 1)
    y = int8_conv2d(xo.float(), q, s, f32(b), 1, 1)
    assert GAUSS_BOUND / 3 < relative_l2(y, ref) < CONV_OUTLIER_BOUND


@pytest.mark.parametrize("x_shape,stride,dilation", [((2, 128, 8, 8), 1, 1), ((1, 128, 15, 15), 2, 1), ((1, 64, 10, 10), 1, 2)])
def test_conv_small_feature_maps_per_patch_gemm(x_shape, stride, dilation):
    """Few output pixels: the CPU path runs a per-row INT8 GEMM over im2col patches instead of oneDNN's conv."""
    w, b, q, s = make_conv(96, x_shape[1], 3, 3, seed=6)
    x = torch.randn(*x_shape, dtype=torch.float64)
    ref = F.conv2d(x, w, b, stride, dilation, dilation)
    y = int8_conv2d(x.float(), q, s, f32(b), stride, dilation, dilation)
    assert y.shape == ref.shape and y.is_contiguous()
    assert relative_l2(y, ref) < CONV_GAUSS_BOUND
    xo = with_outlier_channels(x, dim=1)
    y = int8_conv2d(xo.float(), q, s, f32(b), stride, dilation, dilation)
    assert relative_l2(y, F.conv2d(xo, w, b, stride, dilation, dilation)) < CONV_OUTLIER_BOUND


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_half_inputs(dtype):
    w, b, q, s = make_conv(64, 64, 3, 3)
    x = torch.randn(1, 64, 24, 24).to(dtype)
    y = int8_conv2d(x, q, s, b.to(dtype), 1, 1)
    assert y.dtype == dtype and y.shape == (1, 64, 24, 24)
    tolerance = CONV_GAUSS_BOUND + (0.004 if dtype == torch.bfloat16 else 0.001)
    assert relative_l2(y, F.conv2d(x.double(), w, b, 1, 1)) < tolerance


# ---- saturation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_no_silent_saturation_linear(sign):
    """All activations at +max (uint8 255) and all weights at +-qmax: every u8 x s8 pair is as large as it
    gets. Without VNNI, 8-bit weights would clip the pairwise sums at +-32767 and halve this output."""
    k, n = 1024, 64
    q, s = quantize_weight_per_channel(torch.full((n, k), sign), QMAX)
    assert int(q.abs().min()) == QMAX
    x = torch.ones(32, k)
    y = int8_linear(x, q, s, None)
    assert torch.allclose(y, torch.full_like(y, sign * k), rtol=1e-5, atol=0)


def test_no_silent_saturation_conv():
    cin, cout = 256, 32
    q, s = quantize_weight_per_channel(torch.ones(cout, cin, 3, 3), QMAX)
    x = torch.ones(1, cin, 12, 12)  # affine: zero point 0, every value 255
    y = int8_conv2d(x, q, s, None, 1, 0)
    assert torch.allclose(y, torch.full_like(y, cin * 9.0), rtol=1e-5, atol=0)


@pytest.mark.skipif(quant.cpu_has_int8_dot_product(), reason="this CPU has VNNI/AMX: 8-bit weights cannot clip")
def test_full_8bit_weights_would_saturate_without_vnni():
    k, n = 1024, 64
    q, s = quantize_weight_per_channel(torch.ones(n, k), 127)
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    xq = torch.full((32, k), 255, dtype=torch.uint8)
    y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, s, torch.zeros(n, dtype=torch.long), None, 1.0, 0, torch.float32, "none", [], "")
    assert float(y.max()) < 0.9 * 255 * k  # clipped: this is why weight_qmax is 63 here


# ---- backends -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", [(5, 13, 7), (40, 64, 24), (17, 8, 8)])
def test_int_mm_padding_is_exact(m, k, n):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    acc = cuda_path.int_mm_padded(a, cuda_path._prepared_linear_weight(w), n)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ w.long().t())


def test_backends_agree_on_cpu_tensors():
    w, b, q, s = make_linear(128, 256)
    x = torch.randn(3, 50, 256)
    outs = {}
    for backend in ("cpu", "cuda-torch", "reference"):
        with force_backend(backend):
            outs[backend] = int8_linear(x, q, s, f32(b))
    assert normalized_mse(outs["cuda-torch"], outs["reference"]) < 1e-12
    assert normalized_mse(outs["cpu"], outs["reference"]) < 1e-7
    w, b, q, s = make_conv(32, 16, 3, 3)
    x = torch.randn(2, 32, 24, 24)
    conv_outs = {}
    for backend in ("cpu", "cuda-torch", "reference"):
        with force_backend(backend):
            conv_outs[backend] = int8_conv2d(x, q, s, f32(b), 1, 1, 1, 2)
    assert normalized_mse(conv_outs["cuda-torch"], conv_outs["reference"]) < 1e-12
    assert normalized_mse(conv_outs["cpu"], conv_outs["reference"]) < 1e-7
    with pytest.raises(ValueError):
        with force_backend("tpu"):
            pass


def test_tiny_shapes_take_the_float_path_consistently():
    w, b, q, s = make_linear(8, 16)
    x = torch.randn(2, 16)
    y = int8_linear(x, q, s, f32(b))  # 256 MACs: float with the dequantized weight
    assert torch.allclose(y, F.linear(x, dequantize_weight(q, s), f32(b)), atol=1e-6)
    assert relative_l2(y, F.linear(x.double(), w, b)) < GAUSS_BOUND


def test_prepacked_weights_are_cached_once_and_released():
    _, b, q, s = make_linear(256, 512, seed=9)
    x = torch.randn(64, 512)
    before = len(CACHE)
    y1 = int8_linear(x, q, s, f32(b))
    after_first = len(CACHE)
    y2 = int8_linear(x, q, s, f32(b))
    assert after_first == before + 1 and len(CACHE) == after_first
    assert torch.equal(y1, y2)
    q.copy_(-q)  # an in-place change is seen (version counter): repacked, not stale
    assert torch.allclose(int8_linear(x, q, s, None), -(y1 - f32(b)), atol=1e-4)
    q.data.copy_(-q)  # ComfyUI's copy_to_param: no version bump, caught by the content checksum
    assert torch.allclose(int8_linear(x, q, s, f32(b)), y1, atol=1e-4)
    with torch.inference_mode():  # inference tensors have no version counter at all
        qi = q.clone()
        yi = int8_linear(x, qi, s, None)
        qi[:, :10] = 0
        assert not torch.allclose(int8_linear(x, qi, s, None), yi, atol=1e-3)
        assert torch.allclose(int8_linear(x, qi, s, None), F.linear(x, dequantize_weight(qi, s)), atol=0.05 * float(yi.abs().max()))
    del qi
    del q
    gc.collect()
    assert len(CACHE) == before


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
    with force_backend("reference"):
        assert normalized_mse(eager, net(x)) < 1e-7
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x), eager, atol=1e-5)
    compiled_inductor = torch.compile(net, fullgraph=True)
    assert torch.allclose(compiled_inductor(x), eager, atol=1e-5)


def test_second_copy_of_the_package_shares_ops_and_backend_state():
    """ComfyUI loads the pack as `<pack>.kernels` while tools import `kernels`: one op, one backend switch."""
    import importlib.util
    import sys
    from pathlib import Path

    import kernels

    root = Path(kernels.__file__).parent
    spec = importlib.util.spec_from_file_location("int8_accel_kernels_copy", root / "__init__.py", submodule_search_locations=[str(root)])
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy
    try:
        spec.loader.exec_module(copy)
        assert copy.ops._linear_op is torch.ops.int8_accel.linear  # reused, not registered twice
        w, b, q, s = make_linear(128, 256)
        x = torch.randn(64, 256)
        with kernels.force_backend("reference"):
            y_ref = copy.int8_linear(x, q, s, f32(b))
        with copy.force_backend("cuda-torch"):
            assert kernels.ops.current_backend() == "cuda-torch"
            y_cuda = kernels.int8_linear(x, q, s, f32(b))
        assert normalized_mse(y_cuda, y_ref) < 1e-12
    finally:
        for name in [n for n in sys.modules if n == spec.name or n.startswith(spec.name + ".")]:
            del sys.modules[name]


def test_compiled_quantizers_on_large_inputs_match_reference():
    """Inputs above half a million elements go through the torch.compile'd quantizers."""
    w, b, q, s = make_linear(128, 320, seed=11)
    x = torch.randn(2048, 320)
    y = int8_linear(x, q, s, f32(b))
    with force_backend("reference"):
        y_ref = int8_linear(x, q, s, f32(b))
    assert normalized_mse(y, y_ref) < 1e-7
    w, b, q, s = make_conv(64, 256, 3, 3, seed=12)
    x = torch.randn(1, 256, 48, 48)
    y = int8_conv2d(x, q, s, f32(b), 1, 1)
    with force_backend("reference"):
        y_ref = int8_conv2d(x, q, s, f32(b), 1, 1)
    assert normalized_mse(y, y_ref) < 1e-7
    for quantizer in (cpu_native.quantize_rows_u8, cpu_native.quantize_tensor_u8):
        assert quantizer._compiled is not None and not quantizer._broken
