"""The `triton` backend forced on CPU tensors under the Triton interpreter, against the `cuda` backend
(same int32 accumulation, so bit-exact) and the reference.

TRITON_INTERPRET=1 must be in the environment before triton is first imported (triton.language's own helpers
are built then) and while kernels run. conftest sets it at collection time; if something imported triton
earlier in this process, the module re-runs itself in a fresh subprocess and reports that result.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from comfyui_int8_accel.kernels import (  # noqa: E402
    KernelBackendUnavailableError,
    force_kernel_backend,
    int8_conv2d,
    int8_linear,
    kernel_backend_fallback,
    kernel_backend_for,
    normalized_mse,
    quant,
    quantize_weight_per_channel,
    record_calls,
)
from comfyui_int8_accel.kernels import cuda as cuda_backend  # noqa: E402
from comfyui_int8_accel.kernels import triton_kernels as _triton_kernels  # noqa: E402
from comfyui_int8_accel.kernels.triton_interpreter import interpreter_problem  # noqa: E402
from tests.support.triton_launches import record_launches  # noqa: E402
from tests.support.triton_offsets import OFFSET_CHECKS  # noqa: E402
from tests.support.triton_toolchain import compiled_triton_on_cuda  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
QMAX = {8: 127, 7: 63}


def _interpreter_ready() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.standard.max, InterpretedFunction)


@pytest.fixture(scope="module")
def tk():
    if not _interpreter_ready():
        if os.environ.get("INT8_ACCEL_TRITON_SUBPROCESS"):
            pytest.fail("the Triton interpreter is not active even in a fresh process")
        env = dict(os.environ, TRITON_INTERPRET="1", INT8_ACCEL_TRITON_SUBPROCESS="1")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        pytest.skip("triton was imported before TRITON_INTERPRET was set: these tests passed in a subprocess")
    module = _triton_kernels if _triton_kernels.INTERPRETED else importlib.reload(_triton_kernels)
    assert module.AVAILABLE and module.INTERPRETED
    problem = interpreter_problem()
    if problem is not None:
        pytest.skip(f"triton: {problem}")
    return module


@pytest.fixture
def launches(tk, monkeypatch) -> list[str]:
    """The names of the autotuned Triton kernels launched while the test runs, in order."""
    return record_launches(monkeypatch, tk)


def weights(shape, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    fan_in = w[0].numel()
    q, s = quantize_weight_per_channel(w / fan_in**0.5, QMAX[bits])
    return q, s, torch.randn(shape[0], generator=g)


def by_backend(fn, *args) -> dict:
    """fn(*args) through the triton, cuda and reference backends, each checked to have run it in INT8."""
    op = "linear" if fn is int8_linear else "conv2d"
    outs = {}
    for backend in ("triton", "cuda", "reference"):
        with force_kernel_backend(backend), record_calls() as calls:
            outs[backend] = fn(*args)
        assert calls == {(op, backend, "int8"): 1}
    return outs


def test_row_quantizer_is_bit_exact(tk):
    x = torch.randn(150, 333) * torch.logspace(-3, 3, 150)[:, None]
    x[3] = 0.0
    x[9, 5] = 1e4
    q, s = tk.quantize_rows(x)
    q_ref, s_ref = quant.quantize_rows_symmetric(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    half = x.to(torch.float16)
    q, s = tk.quantize_rows(half)
    q_ref, s_ref = quant.quantize_rows_symmetric(half)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("k", [1, 40, 333, 1024, 1280, 5120, 8192, 8193, 12288])
def test_row_quantizer_reads_rows_up_to_the_one_pass_width_once_and_wider_rows_twice(tk, launches, k):
    """Rows up to ONE_PASS_MAX_K wide go through the one-pass kernel (one load of each row), wider ones through the
    two-loop kernel; both give the reference's values and scales bit for bit, also on all-zero rows, rows with one
    huge value and a row count that leaves a partial block."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(19, k, generator=g) * torch.logspace(-2, 2, 19)[:, None]).to(torch.bfloat16)
    x[4] = 0.0
    x[7, k // 2] = 3e4
    q, s = tk.quantize_rows(x)
    q_ref, s_ref = quant.quantize_rows_symmetric(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    one_pass = k <= tk.ONE_PASS_MAX_K
    assert launches == ["_quantize_rows_one_pass_kernel" if one_pass else "_quantize_rows_kernel"]


def test_the_one_pass_row_quantizer_loads_each_row_once(tk):
    """What the one-pass kernel's name promises: its source loads x in one place and holds no loop over K, where
    the two-loop kernel loads x in each of its two loops."""
    import inspect as source_inspect

    one_pass = source_inspect.getsource(tk._quantize_rows_one_pass_kernel.fn.fn)
    two_pass = source_inspect.getsource(tk._quantize_rows_kernel.fn.fn)
    assert one_pass.count("tl.load(x_ptr") == 1 and "for k0 in range" not in one_pass
    assert two_pass.count("tl.load(x_ptr") == 2


def test_the_one_pass_quantizer_times_only_row_blocks_that_fit_its_registers(tk):
    """The GPU candidates (rows per program x warps) a row width keeps: every one where a thread holds at most
    VALUES_PER_THREAD of the block's values, so the widest one-pass rows (5120 and 8192 wide, a 8192-value block)
    drop 8 rows on 8 warps (256 values a thread: spilled registers), while narrower rows keep all; the single
    interpreter candidate stays whatever the width. The Triton releases' autotuners pass K by name here."""
    import triton

    gpu_candidates = [triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in ((1, 4), (2, 4), (4, 8), (8, 8))]

    def kept(k: int, configs=gpu_candidates) -> list[tuple[int, int]]:
        chosen = tk._row_blocks_in_registers(configs, {"K": k}, BLOCK_K=tk.next_power_of_2(k))
        return [(c.kwargs["BLOCK_M"], c.num_warps) for c in chosen]

    for k in (320, 640, 1280, 2048, 2560):
        assert kept(k) == [(1, 4), (2, 4), (4, 8), (8, 8)]
    assert kept(5120) == kept(tk.ONE_PASS_MAX_K) == [(1, 4), (2, 4), (4, 8)]
    assert all(m * tk.ONE_PASS_MAX_K / (32 * w) <= tk.VALUES_PER_THREAD for m, w in kept(tk.ONE_PASS_MAX_K))
    interpreted = [triton.Config({"BLOCK_M": 16}, num_warps=4)]
    assert kept(tk.ONE_PASS_MAX_K, interpreted) == [(16, 4)]
    assert tk._quantize_rows_one_pass_kernel.early_config_prune is tk._row_blocks_in_registers


def _conv_input(case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    if case == "several-strides":  # more than AFFINE_GRAIN x AFFINE_PROGRAMS elements, not a multiple of a block
        x = torch.randn(2, 33, 67, 61, generator=g).relu() - 0.2
        x.view(-1)[-1] = 7.5  # the extremes in the last partial block and in a middle one
        x.view(-1)[123457] = -3.25
        return x
    if case == "ties":
        # scale exactly 1 and zero point 10.5 -> 10: every value and the zero point lie halfway between integers,
        # where torch.round goes to even and floor(v + 0.5) does not
        return torch.arange(-10.5, 244.6, 0.5).reshape(1, 1, 7, 73)
    return {
        "all-negative": lambda: -torch.rand(1, 3, 5, 7, generator=g) - 0.1,
        "all-zero": lambda: torch.zeros(1, 4, 9, 9),
        "constant": lambda: torch.full((2, 4, 9, 9), 0.37),
        "constant-negative": lambda: torch.full((2, 5, 3, 3), -2.5),
        "tiny": lambda: torch.randn(1, 16, 9, 11, generator=g) * 1e-20 + 3e-21,
        "fp16": lambda: (torch.randn(2, 64, 17, 19, generator=g) * 3).half(),
        "bf16": lambda: (torch.randn(2, 64, 17, 19, generator=g) * 3 + 1).bfloat16(),
        "transposed": lambda: torch.randn(2, 8, 16, 12, generator=g).permute(0, 1, 3, 2),
        "channels-last": lambda: torch.randn(2, 24, 7, 5, generator=g).contiguous(memory_format=torch.channels_last),
    }[case]()


@pytest.mark.parametrize("case", ["several-strides", "ties", "all-negative", "all-zero", "constant",
                                  "constant-negative", "tiny", "fp16", "bf16", "transposed", "channels-last"])  # fmt: skip
def test_conv_input_quantizer_is_bit_exact(tk, case):
    """The Triton affine quantizer against the torch formula it replaces (the `cuda` backend's)."""
    x = _conv_input(case)
    q, zero_point, scale = tk.quantize_affine(x)
    q_ref, zero_point_ref, scale_ref = cuda_backend.quantize_conv_input(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and q.is_contiguous()
    assert zero_point.dtype == torch.int32 and zero_point.shape == () and scale.dtype == torch.float32 and scale.shape == ()
    assert torch.equal(zero_point, zero_point_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    if case == "ties":
        assert float(scale) == 1.0 and int(zero_point) == 10 - 128


class _Ops(TorchDispatchMode):
    """Records every aten op run inside, with the dtypes and shapes of the tensors it allocates (`empty`; the
    interpreter's empty placeholders for argument storage are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.allocated: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.add(func.overloadpacket.__name__)
        if func.overloadpacket is torch.ops.aten.empty and out.numel() > 0:
            self.allocated.append((out.dtype, tuple(out.shape)))
        return out


# Under the interpreter, its own transfers of kernel arguments (no arithmetic): views of argument storage and
# copies back into it.
_INTERPRETER_TRANSFERS = {"detach", "new_empty", "set_", "copy_"}


def test_conv_activation_quantization_is_two_launches_reading_x_once_each(tk, monkeypatch, launches):
    """The triton conv quantizes its input with two Triton launches that allocate only their outputs (int8 x,
    0-d scale and zero point) and a small partial buffer: none of the torch formula's passes and float32
    copies (`quant.affine_qparams`, `quant.round_affine`)."""
    q, s, b = weights((16, 24, 3, 3), 8)
    x = (torch.randn(2, 24, 13, 11).relu() - 0.3).half()
    expected = by_backend(int8_conv2d, x, q, s, b, 1, 1)["cuda"]
    launches.clear()

    def forbidden(*args, **kwargs):
        raise AssertionError("the triton backend ran the torch formula")

    for module in (quant, cuda_backend):
        monkeypatch.setattr(module, "affine_qparams", forbidden)
        monkeypatch.setattr(module, "round_affine", forbidden)
    with force_kernel_backend("triton"), record_calls() as calls:
        y = int8_conv2d(x, q, s, b, 1, 1)
    assert calls == {("conv2d", "triton", "int8"): 1}
    assert launches == ["_affine_range_kernel", "_quantize_affine_kernel", "_conv2d_int8_kernel"]
    assert torch.equal(y, expected)

    launches.clear()
    with _Ops() as ops:
        tk.quantize_affine(x)
    assert launches == ["_affine_range_kernel", "_quantize_affine_kernel"]
    assert ops.names <= {"empty"} | _INTERPRETER_TRANSFERS, ops.names
    assert sorted(ops.allocated, key=str) == sorted(
        [(torch.int8, tuple(x.shape)), (torch.float32, (2, tk.AFFINE_PROGRAMS)), (torch.float32, ()),
         (torch.int32, ())], key=str)  # fmt: skip


@pytest.mark.parametrize("gemm", ["fused", "fused-tma"])
@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize(
    "x_shape,n,bias,dtype",
    [((256, 320), 320, True, torch.float32), ((2, 77, 64), 128, False, torch.float32), ((5, 64), 64, True, torch.float32),
     ((40, 100), 36, True, torch.float16), ((3, 70), 130, False, torch.float16), ((70, 48), 80, True, torch.bfloat16)],
)  # fmt: skip
def test_fused_linear_gemm_equals_int_mm_and_rescale(tk, monkeypatch, launches, x_shape, n, bias, dtype, bits, gemm):
    """INT8_ACCEL_TRITON_LINEAR=fused: one Triton GEMM with the rescale in its epilogue, no torch._int_mm, no
    padding (M under 17, K and N not multiples of 8 included), and the same result bit for bit. fused-tma: the
    persistent GEMM reading its tiles through tensor descriptors (several tiles per program here, K past the last
    full block zero-filled), the same result bit for bit; where K is no multiple of 16 (TMA's row alignment) the
    layer takes the fused GEMM."""
    from comfyui_int8_accel.kernels import triton_backend, triton_gemm_tma

    if gemm == "fused-tma" and triton_gemm_tma.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side TensorDescriptor (3.4+)")
    q, s, b = weights((n, x_shape[-1]), bits)
    b = b.to(dtype) if bias else None
    x = torch.randn(*x_shape).to(dtype)
    int_mm_path = by_backend(int8_linear, x, q, s, b)["triton"]

    def no_int_mm(*args):
        raise AssertionError("the fused path called torch._int_mm")

    monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", gemm)
    monkeypatch.setattr(triton_backend, "int_mm_padded", no_int_mm)
    launches.clear()
    outs = by_backend(int8_linear, x, q, s, b)
    assert outs["triton"].dtype == dtype and outs["triton"].shape == (*x_shape[:-1], n)
    assert torch.equal(outs["triton"], int_mm_path)
    # Triton's interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest, as torch does): the
    # bfloat16 case compares the Triton GEMMs with each other only
    if dtype != torch.bfloat16:
        assert torch.equal(outs["triton"], outs["cuda"])
    takes_tma = gemm == "fused-tma" and x_shape[-1] % triton_gemm_tma.TMA_ALIGNMENT == 0
    assert launches[1:] == ["_gemm_rescale_tma_kernel" if takes_tma else "_gemm_rescale_kernel"]


def test_a_weight_starting_off_a_16_byte_boundary_takes_the_fused_gemm_not_tma(tk, monkeypatch, launches):
    """TMA reads rows whose first byte is 16-byte aligned: a contiguous weight view that starts 8 bytes into its
    storage (as a weight read at an odd offset of a file can) is refused by the TMA path with the reason, and the
    layer runs the fused GEMM, bit for bit the same; the aligned copy takes TMA. Both rows' K is a multiple of 16."""
    from comfyui_int8_accel.kernels import triton_gemm_tma

    if triton_gemm_tma.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side TensorDescriptor (3.4+)")
    q, s, b = weights((48, 64), 8)
    storage = torch.zeros(q.numel() + 8, dtype=torch.int8)
    shifted = storage[8:].view(q.shape)
    shifted.copy_(q)
    assert shifted.is_contiguous() and shifted.data_ptr() % triton_gemm_tma.TMA_ALIGNMENT == 8
    x = torch.randn(32, 64)
    reason = triton_gemm_tma.unsupported_reason(torch.zeros(32, 64, dtype=torch.int8), shifted)
    assert reason is not None and "16-byte" in reason and "weight" in reason, reason
    assert triton_gemm_tma.unsupported_reason(torch.zeros(32, 64, dtype=torch.int8), q) is None
    monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", "fused-tma")
    outs = {}
    for name, weight in (("aligned", q), ("shifted", shifted)):
        launches.clear()
        outs[name] = by_backend(int8_linear, x, weight, s, b)["triton"]
        assert launches[1:] == ["_gemm_rescale_tma_kernel" if name == "aligned" else "_gemm_rescale_kernel"], name
    assert torch.equal(outs["aligned"], outs["shifted"])


@pytest.mark.parametrize("capability,expected", [((9, 0), "fused"), ((10, 0), "fused"), ((8, 9), "int-mm"),
                                                 ((8, 0), "int-mm")])
def test_the_linear_gemm_is_chosen_per_gpu_unless_forced(monkeypatch, capability, expected):
    """Unset (or "auto"), INT8_ACCEL_TRITON_LINEAR leaves the choice to the GPU: the fused Triton GEMM from compute
    capability 9.0 (Hopper, where torch._int_mm runs an Ampere kernel), torch._int_mm below and on CPU tensors;
    set, it wins everywhere."""
    from comfyui_int8_accel.kernels import triton_backend

    monkeypatch.setattr(triton_backend, "_capability", lambda index: capability)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for unset in ("", "auto"):
        monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", unset)
        assert (triton_backend.linear_gemm(gpu), triton_backend.linear_gemm(cpu)) == (expected, "int-mm")
    for forced in ("int-mm", "fused", "fused-tma"):
        monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", forced)
        assert (triton_backend.linear_gemm(gpu), triton_backend.linear_gemm(cpu)) == (forced, forced)


def test_a_tuned_kernel_launches_past_the_autotuner_once_its_key_is_tuned(tk, monkeypatch):
    """The autotuner's own launch path rebuilds dictionaries of every argument per launch (about 8 us of host time,
    twice per eager INT8 Linear): once a tuning key (the key sizes and the tensors' dtypes) has its config, a launch
    goes straight to the JIT function with that config, and gives the same result; a new key is tuned first."""
    from triton.runtime.autotuner import Autotuner

    kernel = tk._quantize_rows_one_pass_kernel
    monkeypatch.setattr(kernel, "chosen_configs", {})
    tuned: list[str] = []
    autotuner_run = Autotuner.run

    def counting_run(self, *args, **kwargs):
        tuned.append(self.base_fn.__name__)
        return autotuner_run(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", counting_run)
    direct: list[dict] = []
    jit_run = kernel.fn.run

    def watched_jit_run(*args, **kwargs):
        direct.append(kwargs)
        return jit_run(*args, **kwargs)

    x = torch.randn(5, 40).half()
    first = tk.quantize_rows(x)
    assert tuned == ["_quantize_rows_one_pass_kernel"]
    monkeypatch.setattr(kernel.fn, "run", watched_jit_run)
    second = tk.quantize_rows(x)
    tk.quantize_rows(torch.randn(9, 40).half())  # another token count: the same key
    assert tuned == ["_quantize_rows_one_pass_kernel"] and len(direct) == 2
    chosen = kernel.best_config.all_kwargs()
    assert all(launch[name] == value for launch in direct for name, value in chosen.items())
    expected = quant.quantize_rows_symmetric(x)
    for q, scale in (first, second):
        assert torch.equal(q, expected[0]) and torch.equal(scale, expected[1])

    tk.quantize_rows(torch.randn(5, 48).half())  # another reduction width
    tk.quantize_rows(x.float())  # another dtype
    assert tuned == ["_quantize_rows_one_pass_kernel"] * 3
    assert len(kernel.chosen_configs) == 3


def test_every_autotuned_kernel_times_its_candidates_briefly(tk, monkeypatch):
    """Triton's default autotuning benchmark (25 ms warm-up + 100 ms per candidate) made most of a 25 s SDXL
    calibration on the H200: every autotuned kernel times its candidates for a few milliseconds instead, through
    whichever knob this Triton has."""
    from triton.runtime.autotuner import Autotuner

    kernels = [k for k in vars(tk).values() if isinstance(k, Autotuner)]
    assert len(kernels) == 9
    for kernel in kernels:
        bench = getattr(kernel, "_do_bench", None)
        if bench is None:  # Triton 3.0: warmup / rep
            assert (kernel.num_warmups, kernel.num_reps) == (tk.AUTOTUNE_WARMUP_MS, tk.AUTOTUNE_REP_MS)
            continue
        seen: dict = {}

        def recorded(fn, seen=seen, **options):
            seen.update(options)
            return 1.0

        monkeypatch.setattr("triton.testing.do_bench", recorded)
        assert bench(lambda: None, quantiles=(0.5,)) == 1.0
        assert (seen["warmup"], seen["rep"]) == (tk.AUTOTUNE_WARMUP_MS, tk.AUTOTUNE_REP_MS)


def test_an_unknown_triton_linear_choice_is_refused(tk, monkeypatch):
    q, s, _ = weights((32, 64), 8)
    monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", "cutlass")
    with force_kernel_backend("triton"), pytest.raises(ValueError, match="auto, int-mm, fused"):
        int8_linear(torch.randn(4, 64), q, s, None)


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize(
    "x_shape,n,bias,dtype",
    [((256, 320), 320, True, torch.float32), ((2, 77, 64), 128, False, torch.float32), ((5, 64), 64, True, torch.float32),
     ((40, 100), 36, True, torch.float16)],
)  # fmt: skip
def test_linear_triton_equals_cuda_backend(tk, x_shape, n, bias, dtype, bits):
    q, s, b = weights((n, x_shape[-1]), bits)
    b = b.to(dtype) if bias else None
    x = torch.randn(*x_shape).to(dtype)
    outs = by_backend(int8_linear, x, q, s, b)
    y = outs["triton"]
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], n)
    assert torch.equal(y, outs["cuda"])  # same int32 accumulation, same epilogue
    assert normalized_mse(y, outs["reference"]) < (1e-12 if dtype == torch.float32 else 1e-6)


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize(
    "x_shape,cout,kernel,stride,padding,dilation,groups,bias",
    [((1, 64, 16, 16), 64, 3, 1, 1, 1, 1, True), ((2, 32, 15, 13), 48, 3, 2, 1, 1, 1, False),
     ((1, 64, 12, 12), 128, 1, 1, 0, 1, 1, True), ((1, 32, 10, 10), 32, 3, 1, 2, 2, 2, True)],
)  # fmt: skip
def test_conv_triton_equals_cuda_backend(tk, monkeypatch, x_shape, cout, kernel, stride, padding, dilation, groups,
                                        bias, bits):  # fmt: skip
    """Both conv kernels (INT8_ACCEL_TRITON_CONV): the implicit GEMM on NCHW int8 activations and the one on
    channels-last activations, each equal to the cuda backend bit for bit."""
    q, s, b = weights((cout, x_shape[1] // groups, kernel, kernel), bits)
    b = b if bias else None
    x = torch.randn(*x_shape).relu() - 0.2  # asymmetric range: a non-trivial zero point
    for layout in ("nchw", "nhwc"):
        monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", layout)
        outs = by_backend(int8_conv2d, x, q, s, b, stride, padding, dilation, groups)
        y = outs["triton"]
        assert y.shape == outs["reference"].shape and y.is_contiguous()
        assert torch.equal(y, outs["cuda"]), layout  # exact int32 accumulation incl. zero-point correction at borders
        assert normalized_mse(y, outs["reference"]) < 1e-12


@pytest.mark.parametrize("x_shape,cout,kernel,padding,groups", [
    ((2, 4, 9, 7), 20, 3, 1, 1),  # 4 input channels: one partial channel block per tap
    ((1, 160, 6, 5), 24, 3, 1, 2),  # 80 channels per group: a full block and a partial one
    ((1, 12, 8, 8), 12, 1, 0, 3)])  # fmt: skip
def test_channels_last_conv_handles_partial_channel_blocks(tk, monkeypatch, x_shape, cout, kernel, padding, groups):
    """The channels-last kernel reduces along the channels of each tap in blocks: a group's channels that do not
    fill the last block meet zero weights, whatever the activations hold there."""
    q, s, b = weights((cout, x_shape[1] // groups, kernel, kernel), 8)
    x = (torch.randn(*x_shape).relu() - 0.4).half()
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", "nhwc")
    outs = by_backend(int8_conv2d, x, q, s, b, 1, padding, 1, groups)
    assert outs["triton"].dtype == torch.float16 and torch.equal(outs["triton"], outs["cuda"])


def test_channels_last_quantizer_writes_the_nchw_quantizer_s_values_transposed(tk):
    x = (torch.randn(2, 24, 13, 11).relu() - 0.3).half()
    q, zero_point, scale = tk.quantize_affine(x)
    q_last, zero_point_last, scale_last = tk.quantize_affine(x, channels_last=True)
    assert q_last.shape == (2, 13, 11, 24) and q_last.is_contiguous()
    assert torch.equal(q_last, q.permute(0, 2, 3, 1))
    assert torch.equal(zero_point_last, zero_point) and torch.equal(scale_last, scale)


def test_the_conv_kernel_is_channels_last_on_gpus_unless_forced_and_an_unknown_choice_is_refused(tk, monkeypatch,
                                                                                                  launches):
    """The channels-last kernel ran 4x faster than the NCHW one on the H200: a CUDA GPU gets it by default; CPU
    tensors under the interpreter keep the NCHW one; INT8_ACCEL_TRITON_CONV forces either."""
    from comfyui_int8_accel.kernels import triton_backend

    for unset in ("", "auto"):
        monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", unset)
        assert triton_backend.conv_layout(torch.device("cuda", 0)) == "nhwc"
        assert triton_backend.conv_layout(torch.device("cpu")) == "nchw"
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", "nchw")
    assert triton_backend.conv_layout(torch.device("cuda", 0)) == "nchw"
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", "nhwc")
    assert triton_backend.conv_layout(torch.device("cpu")) == "nhwc"
    q, s, b = weights((16, 24, 3, 3), 8)
    with force_kernel_backend("triton"):
        int8_conv2d(torch.randn(1, 24, 6, 6), q, s, b, 1, 1)
    assert launches == ["_affine_range_kernel", "_quantize_affine_nhwc_kernel", "_conv2d_int8_nhwc_kernel"]
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", "cudnn")
    with force_kernel_backend("triton"), pytest.raises(ValueError, match="auto, nchw, nhwc"):
        int8_conv2d(torch.randn(1, 24, 6, 6), q, s, b, 1, 1)


@pytest.mark.parametrize("check", OFFSET_CHECKS, ids=lambda check: check.__name__)
def test_offsets_past_2_31_elements_are_not_wrapped(tk, check):
    check(tk, torch.device("cpu"))


def test_cuda_tensors_go_to_triton_or_to_cuda_without_it(tk, monkeypatch):
    assert kernel_backend_for("cuda") == "triton"
    monkeypatch.setattr(tk, "AVAILABLE", False)
    assert kernel_backend_for("cuda") == "cuda"
    with pytest.raises(KernelBackendUnavailableError, match="triton is not importable"):
        with force_kernel_backend("triton"):
            pass


NO_COMPILER = "no C compiler (CC is unset and neither gcc nor clang is on PATH)"


@pytest.mark.parametrize(
    "gcc_on_path,cc,header,missing",
    [(True, None, True, None), (False, "own", True, None), (False, None, True, NO_COMPILER),
     (True, "/nonexistent/cc", True, "the C compiler CC='/nonexistent/cc' was not found"),
     (True, None, False, "no Python.h in {include}"), (False, None, False, NO_COMPILER + " and no Python.h in {include}")],
    ids=["present", "cc-set", "no-compiler", "cc-missing", "no-header", "neither"],
)  # fmt: skip
def test_compiled_triton_without_a_compiler_or_python_h_leaves_cuda_to_the_cuda_backend(
        monkeypatch, tmp_path, gcc_on_path, cc, header, missing):  # fmt: skip
    """Compiled Triton builds its launchers with a C compiler against Python.h: without them every Triton call
    raises, so the choice falls back to `cuda`, naming what is missing."""
    include = compiled_triton_on_cuda(monkeypatch, tmp_path, compiler=gcc_on_path, header=header)
    if cc == "own":  # $CC names a compiler that is not on PATH
        cc = tmp_path / "my-cc"
        cc.write_text("#!/bin/sh\nexit 0\n")
        cc.chmod(0o755)
    if cc is not None:
        monkeypatch.setenv("CC", str(cc))
    if missing is None:
        assert kernel_backend_for("cuda") == "triton"
        assert kernel_backend_fallback("cuda") == {}
        return
    missing = missing.format(include=include)
    assert kernel_backend_for("cuda") == "cuda"
    reason = kernel_backend_fallback("cuda")["triton"]
    assert reason.startswith("compiled Triton cannot build its kernel launchers: " + missing + ";"), reason
    with pytest.raises(KernelBackendUnavailableError, match=re.escape(missing)):
        with force_kernel_backend("triton"):
            pass


def test_the_interpreter_needs_no_compiler(tk, monkeypatch, tmp_path):
    compiled_triton_on_cuda(monkeypatch, tmp_path, compiler=False, header=False)
    monkeypatch.setattr(tk, "INTERPRETED", True)
    assert kernel_backend_for("cuda") == "triton" and kernel_backend_fallback("cuda") == {}


def test_package_imports_and_runs_without_triton():
    """Loaded the way ComfyUI loads the pack, with triton unimportable and no ComfyUI on the path."""
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        from pathlib import Path
        sys.modules["triton"] = None  # "import triton" now raises ImportError
        root = Path({str(REPO_ROOT)!r})
        spec = importlib.util.spec_from_file_location(
            "int8_pack_without_triton", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        pack = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pack
        spec.loader.exec_module(pack)
        import torch
        from int8_pack_without_triton.kernels import (
            KernelBackendUnavailableError, kernel_backend_for, force_kernel_backend, int8_linear, quantize_weight_per_channel,
            record_calls,
        )
        from int8_pack_without_triton.kernels import triton_kernels
        assert not triton_kernels.AVAILABLE
        assert "comfy" not in sys.modules  # the kernels do not import ComfyUI
        assert kernel_backend_for("cuda") == "cuda", kernel_backend_for("cuda")
        try:
            with force_kernel_backend("triton"):
                raise SystemExit("forced an unavailable backend")
        except KernelBackendUnavailableError as exc:
            assert "triton is not importable" in str(exc), exc
        q, s = quantize_weight_per_channel(torch.randn(32, 64), 127)
        with force_kernel_backend("cuda"), record_calls() as calls:
            y = int8_linear(torch.randn(20, 64), q, s, None)
        assert dict(calls) == {{("linear", "cuda", "int8"): 1}}, calls
        print("ok", tuple(y.shape))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok (20, 32)" in result.stdout
