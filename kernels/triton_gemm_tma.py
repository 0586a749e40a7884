"""A persistent INT8 GEMM with the rescale in its epilogue that reads its operands through TMA descriptors: the
Hopper-style variant of `triton_kernels.gemm_rescale` (INT8_ACCEL_TRITON_LINEAR=fused-tma).

Each of a GPU's multiprocessors runs one program that walks output tiles in steps of the program count, so tiles
do not pay a launch each and the next tile's loads overlap the last one's epilogue; the tensor-memory accelerator
copies each int8 tile into shared memory with zero fill past the edges (no masks or address arithmetic per
element). The int32 accumulation and the epilogue's float32 operations are those of `gemm_rescale`, in the same
order, so the output equals it (and `torch._int_mm` + rescale) bit for bit.

Needs Triton's host-side `TensorDescriptor` (Triton 3.4 and newer) and operands whose rows start on 16-byte
boundaries (K a multiple of 16 and each operand's first byte 16-byte aligned); `unsupported_reason` says when a call
cannot take this path. `prepare_gemm_rescale_tma` builds the descriptors (host work) apart from the launch, so a
bench times the kernel alone. Block shapes are chosen
per layer on the host (the descriptors carry them), the pipeline depth, warps and tile order are autotuned.
"""

import functools
from collections.abc import Callable

import torch

from . import triton_kernels
from .triton_kernels import AVAILABLE, EXACT, INTERPRETED

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4, or no Triton
    TensorDescriptor = None

# TMA moves rows whose start is 16-byte aligned: int8 rows of K elements.
TMA_ALIGNMENT = 16
# Programs when the kernels are interpreted (one after another on the CPU): a few, to walk several tiles each.
INTERPRETED_PROGRAMS = 3


def unsupported_reason(a: torch.Tensor, q_weight: torch.Tensor) -> str | None:
    """Why `gemm_rescale_tma` cannot run int8 a [M, K] @ q_weight [N, K]^T, or None."""
    if not AVAILABLE:
        return "triton is not importable"
    if TensorDescriptor is None:
        return "this Triton has no host-side TensorDescriptor (Triton 3.4+)"
    k = a.shape[1]
    if k % TMA_ALIGNMENT:
        return f"K={k} is not a multiple of {TMA_ALIGNMENT} (TMA needs 16-byte aligned rows)"
    for name, operand in (("the activation", a), ("the weight", q_weight)):
        misaligned = _misaligned_start(operand)
        if misaligned:
            return f"{name}'s first byte is {misaligned} bytes past a 16-byte boundary (TMA needs aligned rows)"
    if not INTERPRETED and a.device.type == "cuda" and _capability(a.device) < (9, 0):
        return "TMA needs a GPU of compute capability 9.0 or newer"
    return None


def _misaligned_start(t: torch.Tensor) -> int:
    """How many bytes past a TMA_ALIGNMENT boundary the tensor the kernel reads starts (0: aligned). A tensor that is
    not contiguous is copied first (a fresh allocation, aligned), so only a contiguous view can start misaligned
    (a slice at an odd offset). Tensors without storage (fake tensors while tracing) count as aligned."""
    if not t.is_contiguous():
        return 0
    try:
        return t.data_ptr() % TMA_ALIGNMENT
    except (RuntimeError, NotImplementedError):
        return 0


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return max(1, min(INTERPRETED_PROGRAMS, tiles))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(_multiprocessors(index), tiles))


def block_shape(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a layer: 128-byte K steps, 256-wide tiles for wide layers (fewer tiles, each
    reading its A rows once for twice the columns), 128 otherwise; one small block under the interpreter."""
    if INTERPRETED:
        return 32, 32, 32
    return 128, 256 if n >= 4096 else 128, 128


if AVAILABLE and TensorDescriptor is not None:
    import triton
    import triton.language as tl

    from .triton_kernels import _gemm_rescale_epilogue

    # (tile order, warps, pipeline depth): 3 or 4 int8 tiles of A and W in flight fit Hopper's shared memory at
    # 128x256x128 (48 KiB a stage).
    _CANDIDATES = [({"GROUP_M": 8}, 8, 3), ({"GROUP_M": 8}, 8, 4), ({"GROUP_M": 16}, 8, 4)]
    _INTERPRETED_CANDIDATE = ({"GROUP_M": 4}, 4, 1)

    @triton_kernels._autotune(configs=[
        triton.Config(dict(order), num_warps=warps, num_stages=stages)
        for order, warps, stages in ([_INTERPRETED_CANDIDATE] if INTERPRETED else _CANDIDATES)],
        key=["N", "K", "BLOCK_N"])
    @triton.jit
    def _gemm_rescale_tma_kernel(a_desc, w_desc, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                                 programs, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * blocks_n
        for tile in range(tl.program_id(0), blocks_m * blocks_n, programs):
            # Tiles in groups of GROUP_M row blocks down one column block, as in gemm_rescale: shared L2 tiles.
            first_m = (tile // per_group) * GROUP_M
            group_m = tl.minimum(blocks_m - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % group_m
            pid_n = (tile % per_group) // group_m
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k0])
                w = w_desc.load([pid_n * BLOCK_N, k0])
                acc += tl.dot(a, w.T, out_dtype=tl.int32)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _gemm_rescale_epilogue(acc, rows, cols, M, N, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, stride_om,
                                   HAS_BIAS)  # fmt: skip


def prepare_gemm_rescale_tma(a: torch.Tensor, q_weight: torch.Tensor, row_scale: torch.Tensor,
                             col_scale: torch.Tensor, bias: torch.Tensor | None,
                             dtype: torch.dtype) -> Callable[[], torch.Tensor]:  # fmt: skip
    """The host work of `gemm_rescale_tma` (operands made contiguous, the output allocated, the TMA descriptors
    built) done now, and the launch returned: each call of it runs the kernel into the same output tensor."""
    a, q_weight = a.contiguous(), q_weight.contiguous()
    m, k = a.shape
    n = q_weight.shape[0]
    block_m, block_n, block_k = block_shape(m, n, k)
    out = torch.empty((m, n), dtype=dtype, device=a.device)
    col_scale = col_scale.to(torch.float32).contiguous()
    row_scale = row_scale.contiguous()
    bias_arg = col_scale if bias is None else bias.contiguous()
    programs = _programs(a.device, triton_kernels.cdiv(m, block_m) * triton_kernels.cdiv(n, block_n))
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(q_weight, [block_n, block_k])

    def launch() -> torch.Tensor:
        _gemm_rescale_tma_kernel[(programs,)](a_desc, w_desc, row_scale, col_scale, bias_arg, out, m, n, k,
                                              out.stride(0), programs, HAS_BIAS=bias is not None, BLOCK_M=block_m,
                                              BLOCK_N=block_n, BLOCK_K=block_k, **EXACT)  # fmt: skip
        return out

    return launch


def gemm_rescale_tma(a: torch.Tensor, q_weight: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`triton_kernels.gemm_rescale` through the persistent TMA kernel: the same output bit for bit. The caller
    checks `unsupported_reason` first."""
    return prepare_gemm_rescale_tma(a, q_weight, row_scale, col_scale, bias, dtype)()
