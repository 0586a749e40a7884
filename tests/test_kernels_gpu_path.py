"""The CUDA INT8 path (`cuda` and `triton` backends) run on CPU tensors: exact against the reference's definitions,
each weight prepared once per version, and no host read anywhere in a call (the INT8 layers on that path:
test_int8_layers_gpu_path.py).

Off the CPU the weight cache trusts identity stamps and `weight_changed` instead of checksums; the tests that
need that behaviour switch the cache to it for CPU tensors (`off_cpu_cache`, in conftest). The Triton kernels run
under the interpreter (TRITON_INTERPRET=1, set by conftest before triton is imported).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comfyui_int8_accel.kernels import cuda as cuda_backend
from comfyui_int8_accel.kernels import (
    force_kernel_backend,
    int8_conv2d,
    int8_linear,
    normalized_mse,
    ops,
    quant,
    quantize_weight_per_channel,
    weight_changed,
)
from comfyui_int8_accel.kernels.weight_cache import CACHE
from tests.support.int8_exact import GPU_PATH, exact_conv, exact_linear, run_on_backend

QMAX = {8: 127, 7: 63}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def weights(shape, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / (torch.Size(shape[1:]).numel() ** 0.5)
    q, s = quantize_weight_per_channel(w, QMAX[bits])
    return q, s, torch.randn(shape[0], generator=g)


def assert_exact(y: torch.Tensor, exact_fn, *args) -> None:
    """y is exactly `exact_fn(*args)`. One allowance: Triton's interpreter rounds float32 to bfloat16 its own way
    (not to nearest even, as the GPU does), so there a triton result may sit one bfloat16 step off."""
    if y.dtype == torch.bfloat16 and ops.kernel_backend_for(y.device) == "triton":
        exact32 = exact_fn(*args, out_dtype=torch.float32)
        step = exact32.abs() * 2.0**-7 + 1e-30
        assert bool(((y.float() - exact32).abs() <= step).all())
    else:
        assert torch.equal(y, exact_fn(*args))


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_shape,n,bias", [((2, 77, 64), 128, True), ((5, 100), 36, False), ((40, 320), 320, True)])
@pytest.mark.parametrize("backend", GPU_PATH)
def test_linear_is_exactly_its_definition(backend, x_shape, n, bias, dtype, bits):
    q, s, b = weights((n, x_shape[-1]), bits)
    b = b.to(dtype) if bias else None
    x = (torch.randn(*x_shape) * 3).to(dtype)
    y = run_on_backend(backend, int8_linear, x, q, s, b)
    assert y.dtype == dtype
    with force_kernel_backend(backend):
        assert_exact(y, exact_linear, x, q, s, b)
    assert normalized_mse(y, run_on_backend("reference", int8_linear, x, q, s, b)) < (1e-12 if dtype == torch.float32 else 1e-4)


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "x_shape,cout,kernel,stride,padding,dilation,groups,bias",
    [((1, 32, 12, 12), 64, 3, 1, 1, 1, 1, True), ((2, 4, 11, 9), 24, 3, 2, 1, 1, 1, False),
     ((1, 32, 10, 10), 32, 3, 1, 2, 2, 2, True), ((1, 64, 6, 6), 40, 1, 1, 0, 1, 1, True)],
)  # fmt: skip
@pytest.mark.parametrize("backend", GPU_PATH)
def test_conv_is_exactly_its_definition(backend, x_shape, cout, kernel, stride, padding, dilation, groups, bias,
                                        dtype, bits):  # fmt: skip
    q, s, b = weights((cout, x_shape[1] // groups, kernel, kernel), bits)
    b = b.to(dtype) if bias else None
    x = (torch.randn(*x_shape).relu() - 0.3).to(dtype)  # asymmetric: a zero point that is not 128
    args = (x, q, s, b, [stride] * 2, [padding] * 2, [dilation] * 2, groups)
    y = run_on_backend(backend, int8_conv2d, *args)
    assert y.dtype == dtype and y.is_contiguous()
    with force_kernel_backend(backend):  # borders included: padding is the zero point, removed exactly
        assert_exact(y, exact_conv, *args)
    assert normalized_mse(y, run_on_backend("reference", int8_conv2d, *args)) < (1e-12 if dtype == torch.float32 else 1e-4)


def test_divisions_are_ieee_on_every_path():
    """`t / 127` is t * (1/127) on CUDA and `1 / t` is a reciprocal: the quantizers divide through one helper."""
    t = torch.tensor([3.0, 7.0, 1e-3, 123.456])
    assert torch.equal(quant.true_divide(t, 127.0), t / torch.full_like(t, 127.0))
    assert torch.equal(quant.true_divide(127.0, t), torch.full_like(t, 127.0) / t)


# ---- weights prepared once per version ----------------------------------------------------------------------


def test_aligned_linear_weights_are_used_as_they_are():
    q, s, b = weights((64, 128), 8)
    before = CACHE.builds.copy()
    assert cuda_backend.prepared_linear_weight(q) is q  # K, N multiples of 8: no copy, nothing to go stale
    run_on_backend("cuda", int8_linear, torch.randn(20, 128), q, s, b)
    assert CACHE.builds == before


@pytest.mark.parametrize("backend", GPU_PATH)
def test_a_weight_used_twice_is_prepared_once_and_again_when_it_changes(backend, off_cpu_cache):
    q, s, b = weights((36, 100), 8, seed=3)  # N, K not multiples of 8: padded rows
    cq, cs, cb = weights((24, 4, 3, 3), 8, seed=4)  # K = 36: padded rows (cuda), column sums (both)
    x, cx = torch.randn(33, 100), torch.randn(1, 4, 10, 10)
    before = CACHE.builds.copy()
    for _ in range(3):
        y = run_on_backend(backend, int8_linear, x, q, s, b)
        cy = run_on_backend(backend, int8_conv2d, cx, cq, cs, cb, 1, 1)
    built = CACHE.builds - before
    expected = Counter({"int-mm-linear": 1, "column-sums": 1})
    if backend == "cuda":
        expected["int-mm-conv-g1"] = 1
    assert built == expected

    # ComfyUI's in-place writes (`.data.copy_`) move no version counter; off the CPU nothing reads the content,
    # so the writer announces them, and the derived forms are rebuilt into the same memory.
    rows, sums = cuda_backend.prepared_linear_weight(q), cuda_backend.weight_column_sums(cq)
    q.data.copy_(-q)
    cq.data.copy_(-cq)
    assert torch.equal(run_on_backend(backend, int8_linear, x, q, s, b), y), "no stamp sees a .data write off the CPU"
    weight_changed(q)
    weight_changed(cq)
    assert CACHE.builds - before == expected + expected  # each rebuilt once
    assert cuda_backend.prepared_linear_weight(q) is rows and cuda_backend.weight_column_sums(cq) is sums
    assert torch.equal(run_on_backend(backend, int8_linear, x, q, s, b), exact_linear(x, q, s, b))
    assert torch.equal(run_on_backend(backend, int8_conv2d, cx, cq, cs, cb, 1, 1), exact_conv(cx, cq, cs, cb, 1, 1, 1, 1))
    assert not torch.equal(run_on_backend(backend, int8_conv2d, cx, cq, cs, cb, 1, 1), cy)

    # An ordinary in-place write bumps the version counter: seen without being announced.
    after_announce = CACHE.builds.copy()
    q.mul_(-1)
    assert torch.equal(run_on_backend(backend, int8_linear, x, q, s, b), y)
    assert CACHE.builds - after_announce == {"int-mm-linear": 1}


def test_on_the_cpu_the_checksum_sees_data_writes():
    q, s, b = weights((36, 100), 8, seed=5)
    x = torch.randn(20, 100)
    y = run_on_backend("cuda", int8_linear, x, q, s, b)
    before = CACHE.builds.copy()
    q.data.copy_(-q)
    assert torch.equal(run_on_backend("cuda", int8_linear, x, q, s, b), exact_linear(x, q, s, b))
    assert CACHE.builds - before == {"int-mm-linear": 1}
    assert not torch.equal(run_on_backend("cuda", int8_linear, x, q, s, b), y)


def test_cache_entries_die_with_their_weight(off_cpu_cache):
    import gc

    q, s, b = weights((36, 100), 8, seed=6)
    gc.collect()  # entries of weights earlier tests left in reference cycles go now, not during the count
    before = len(CACHE)
    run_on_backend("cuda", int8_linear, torch.randn(20, 100), q, s, b)
    assert len(CACHE) == before + 1
    del q
    gc.collect()
    assert len(CACHE) == before


# ---- no host read ---------------------------------------------------------------------------------------------

# Ops that read a device value on the host (or need one to size their output): each is a stream sync on CUDA.
_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}


class HostReads(TorchDispatchMode):
    """Records every aten op run inside that would read a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("backend", GPU_PATH)
def test_a_call_reads_nothing_on_the_host(backend, dtype, off_cpu_cache):
    q, s, b = weights((36, 100), 8, seed=7)
    cq, cs, cb = weights((24, 4, 3, 3), 8, seed=8)
    x, cx = torch.randn(2, 17, 100).to(dtype), (torch.randn(1, 4, 10, 10) + 0.5).to(dtype)
    with force_kernel_backend(backend):
        ops._linear_impl(x, q, s, b)  # warm the cache: its first build may do anything
        ops._conv2d_impl(cx, cq, cs, cb, [1, 1], [1, 1], [1, 1], 1)
        with HostReads() as mode:  # the op bodies: inside torch.ops.int8_accel.* a mode sees only the op itself
            ops._linear_impl(x, q, s, b)
            ops._conv2d_impl(cx, cq, cs, cb, [1, 1], [1, 1], [1, 1], 1)
            ops._conv2d_impl(cx, cq, cs, cb, [2, 2], [0, 0], [1, 1], 1)
    assert mode.reads == []


def test_the_host_read_detector_detects():
    with HostReads() as mode:
        float(torch.ones(()).sum())
        quant.normalized_mse(torch.ones(3), torch.ones(3))
    assert len(mode.reads) >= 2
