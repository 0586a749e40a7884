"""Triton kernels of the `triton` backend: per-token activation quantizer, per-tensor affine (conv) activation
quantizer, rescale epilogue, INT8 GEMM with the rescale fused into its epilogue, INT8 implicit-GEMM conv that
writes the output dtype itself. Each is autotuned over a
few block shapes on the GPU (one large block under the interpreter).

The conv's activation quantizer is two kernels of its own, not folded into the conv's loads: the per-tensor
range must be known before any element is quantized (a pass over the whole tensor either way), and the conv
loads each activation element once per kernel tap and per output-channel block (9x or more for a 3x3 conv), so
folding would read the float activation (2-4 bytes) that many times and round it again each time, where the
separate quantizer reads it twice and the conv then reads 1-byte values. The two kernels read x once each
(partial minima/maxima, then quantize) and write only the int8 tensor and the 0-d scale and zero point, where
the torch formulas take about eight passes with float32 copies of the activation.

Guarded: AVAILABLE is False when triton is not importable (the package still imports; the backend then reports
itself unavailable). With TRITON_INTERPRET=1 in the environment *before triton is first imported* the kernels
run on CPU tensors (that is how the tests check them without a GPU). INTERPRETED records which mode the kernels
were built in.

The kernels reproduce the torch formulas of `quant` bit for bit on the GPU too: divisions are IEEE (`div_rn`;
Triton's `/` on float32 is an approximate division there), and every launch passes `enable_fp_fusion=False` so
no multiply-add is contracted into an FMA that torch's separate kernels do not use. Scalars that live on the
device (the conv's activation scale and zero point) are passed as pointers, never read on the host.
"""

# No `from __future__ import annotations`: Triton 3.0's interpreter recognises `tl.constexpr` parameters only by
# their annotation object, not a string.
import functools
import inspect
import os

import torch

from .quant import conv_output_shape

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the package must import without triton
    triton = None
    tl = None
    AVAILABLE = False


def _interpreted() -> bool:
    if not AVAILABLE:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # Triton releases before `triton.knobs`
        return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETED = _interpreted()
# Launch option: no FMA contraction (see the module docstring).
EXACT = {"enable_fp_fusion": False}
# The kernels need `tl.math.div_rn` (Triton 3.0, the release PyTorch 2.4 ships with).
TOO_OLD = None if not AVAILABLE or hasattr(tl.math, "div_rn") else (
    f"this Triton ({getattr(triton, '__version__', '?')}) has no tl.math.div_rn: Triton 3.0 or newer is needed")



def _configs(interpreted: tuple[dict, int], tuned: list[tuple[dict, int]]) -> list:
    """Autotuning candidates, (block sizes, warps) each: under the interpreter only `interpreted`, one large
    block (it runs programs one after another in numpy, so fewer programs are faster and nothing is timed)."""
    chosen = [interpreted] if INTERPRETED else tuned
    return [triton.Config(dict(blocks), num_warps=warps) for blocks, warps in chosen]


# Autotuning times every candidate on a layer shape's first call, which is inside calibration. Triton's default
# benchmark gives each candidate 25 ms of warm-up and 100 ms of timing: for an SDXL UNet's few dozen layer shapes
# (about 4 candidates each, conv, quantizers and GEMM) that was most of a 25 s calibration on the H200. A few
# milliseconds each still runs a candidate tens of times or more on any shape of a diffusion model.
AUTOTUNE_WARMUP_MS = 3
AUTOTUNE_REP_MS = 12


def _autotune(configs: list, key: list[str], prune=None):
    """`triton.autotune` with the short benchmark above: through `do_bench` where Triton takes one (Triton 3.6 does,
    and deprecates `warmup`/`rep` there), else through `warmup`/`rep` (Triton 3.0); the kernel it makes launches as
    a `ChosenConfigAutotuner`. `prune(configs, named_args, **launch_keywords)`: the candidates worth timing for one
    tuning key (Triton's `early_config_prune`; at least one)."""
    options = {} if prune is None else {"prune_configs_by": {"early_config_prune": prune}}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        def bench(kernel_call, quantiles):
            from triton.testing import do_bench

            return do_bench(kernel_call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=quantiles)

        autotune = triton.autotune(configs=configs, key=key, do_bench=bench, **options)
    else:
        autotune = triton.autotune(configs=configs, key=key, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, **options)

    def decorate(fn):
        tuned = autotune(fn)
        # Triton's constructor differs between releases; its instance takes the subclass's launch path as it is.
        tuned.__class__ = ChosenConfigAutotuner
        tuned.chosen_configs = {}
        tuned.tensor_positions = {}
        tuned.key_positions = tuple((tuned.arg_names.index(name), name) for name in key)
        return tuned

    return decorate


if AVAILABLE:
    from triton.runtime.autotuner import Autotuner

    class ChosenConfigAutotuner(Autotuner):
        """An autotuned kernel that, once autotuning chose a config for a tuning key (the key arguments' values
        and the tensor arguments' dtypes, as the autotuner keys them), launches straight through its JIT function
        with that config. Every launch through `Autotuner.run` first builds dictionaries of all the kernel's
        arguments to find its key: about 10 us of host time per launch with Triton 3.6 and 3.8 on the 2-core
        Xeon (bench/results/launch_overhead.md), and an eager INT8 Linear launches two kernels per call."""

        chosen_configs: dict  # tuning key -> the chosen config's launch keywords
        key_positions: tuple  # (position, name) of each key argument
        tensor_positions: dict  # number of positional arguments -> the positions of the tensors among them

        def run(self, *args, **kwargs):
            key = self._tuning_key(args, kwargs)
            chosen = self.chosen_configs.get(key)
            if chosen is None:
                launched = super().run(*args, **kwargs)
                self.chosen_configs[key] = self.best_config.all_kwargs()
                return launched
            return self.fn.run(*args, **kwargs, **chosen)

        def _tuning_key(self, args: tuple, kwargs: dict) -> tuple:
            count = len(args)
            tensors = self.tensor_positions.get(count)
            if tensors is None:  # which positional arguments are tensors: the same at every launch of a call site
                tensors = self.tensor_positions[count] = tuple(
                    index for index, arg in enumerate(args) if isinstance(arg, torch.Tensor))
            key = [args[index] if index < count else kwargs.get(name) for index, name in self.key_positions]
            key += [args[index].dtype for index in tensors]
            return tuple(key)


# The widest row the one-pass quantizer holds in registers, and how many of a row block's float32 values one thread
# may hold: 128 of a thread's 255 registers (the rest hold the row offsets, masks and the int8 values). A program of
# 8 warps (256 threads) then holds 32768 values, 4 rows of 8192: every Linear input of SDXL (up to 5120 wide) and of
# Flux but its MLP output (12288, which takes the two-pass kernel: at the next power of two, 16384, one candidate of
# the four would be left).
ONE_PASS_MAX_K = 8192
VALUES_PER_THREAD = 128


def _row_blocks_in_registers(configs: list, named_args: dict, **launch: object) -> list:
    """The one-pass quantizer's candidates whose row block (BLOCK_M rows of the row width rounded up to a power of
    two, the caller's BLOCK_K) takes at most VALUES_PER_THREAD values per thread, else the one with the fewest (the
    single candidate under the interpreter). The width comes from K, a positional argument, which every Triton release
    passes here (not all pass the launch's keywords, BLOCK_K among them)."""
    block_k = next_power_of_2(named_args["K"])

    def per_thread(config) -> float:
        return config.kwargs["BLOCK_M"] * block_k / (32 * config.num_warps)

    return [c for c in configs if per_thread(c) <= VALUES_PER_THREAD] or [min(configs, key=per_thread)]


if AVAILABLE:
    # Keyed on sizes fixed per layer (reduction and output widths), so tuning happens on a layer's first call
    # (a warm-up), not on every new token count.
    @_autotune(configs=_configs(({"BLOCK_M": 64, "BLOCK_K": 128}, 4), [
        ({"BLOCK_M": 4, "BLOCK_K": 512}, 4), ({"BLOCK_M": 8, "BLOCK_K": 256}, 4),
        ({"BLOCK_M": 16, "BLOCK_K": 128}, 4), ({"BLOCK_M": 16, "BLOCK_K": 256}, 8)]), key=["K"])
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_qm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # Same formula as quant.quantize_rows_symmetric: q = clamp(floor(x * (127 / amax) + 0.5), -127, 127).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        # Row offsets in int64: M * K passes 2**31 for long token sequences (video); a row's K columns fit int32.
        x_rows = rows.to(tl.int64) * stride_xm
        q_rows = rows.to(tl.int64) * stride_qm
        cols = tl.arange(0, BLOCK_K)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & ((k0 + cols) < K)[None, :]
            v = tl.load(x_ptr + x_rows[:, None] + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        safe = tl.where(amax > 0, amax, 1.0)
        inv_scale = tl.math.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), safe)
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & ((k0 + cols) < K)[None, :]
            v = tl.load(x_ptr + x_rows[:, None] + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.floor(v * inv_scale[:, None] + 0.5)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(q_ptr + q_rows[:, None] + (k0 + cols)[None, :], q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + rows, tl.math.div_rn(safe, tl.full([BLOCK_M], 127.0, tl.float32)), mask=row_mask)

    # The same quantizer in one pass over x where a row block fits in registers (K up to ONE_PASS_MAX_K): each
    # row is loaded once, its amax taken and its values quantized from the loaded block, where the kernel above
    # loads every row twice. BLOCK_K is the row width rounded up to a power of two (the caller's); BLOCK_M rows per
    # program and the warps, autotuned, keyed on K; only candidates whose block fits the registers are timed.
    @_autotune(configs=_configs(({"BLOCK_M": 16}, 4), [
        ({"BLOCK_M": 1}, 4), ({"BLOCK_M": 2}, 4), ({"BLOCK_M": 4}, 8), ({"BLOCK_M": 8}, 8)]), key=["K"],
        prune=_row_blocks_in_registers)
    @triton.jit
    def _quantize_rows_one_pass_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_qm, BLOCK_M: tl.constexpr,
                                       BLOCK_K: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        v = tl.load(x_ptr + (rows.to(tl.int64) * stride_xm)[:, None] + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)  # fmt: skip
        amax = tl.max(tl.abs(v), axis=1)
        safe = tl.where(amax > 0, amax, 1.0)
        inv_scale = tl.math.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), safe)
        q = tl.floor(v * inv_scale[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + (rows.to(tl.int64) * stride_qm)[:, None] + cols[None, :], q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + rows, tl.math.div_rn(safe, tl.full([BLOCK_M], 127.0, tl.float32)), mask=rows < M)

    @_autotune(configs=_configs(({"BLOCK_M": 128, "BLOCK_N": 128}, 4), [
        ({"BLOCK_M": 64, "BLOCK_N": 64}, 4), ({"BLOCK_M": 128, "BLOCK_N": 64}, 4),
        ({"BLOCK_M": 64, "BLOCK_N": 128}, 4), ({"BLOCK_M": 128, "BLOCK_N": 128}, 8)]), key=["N"])
    @triton.jit
    def _rescale_kernel(acc_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        rows64 = rows.to(tl.int64)  # M * N passes 2**31 for long token sequences
        acc = tl.load(acc_ptr + (rows64 * stride_am)[:, None] + cols[None, :], mask=mask, other=0)
        row_scale = tl.load(row_scale_ptr + rows, mask=rows < M, other=0.0)
        col_scale = tl.load(col_scale_ptr + cols, mask=cols < N, other=0.0)
        y = acc.to(tl.float32) * row_scale[:, None] * col_scale[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + (rows64 * stride_om)[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

    # The fused Linear: int8 [M, K] @ int8 [N, K]^T accumulated in int32 by the tensor cores (tl.dot on int8;
    # Hopper's wgmma takes 8-bit operands K-major, which both are), rescaled in the epilogue with the same float32
    # operations in the same order as _rescale_kernel, so its output equals torch._int_mm + rescale bit for bit
    # while never writing the int32 product to memory. Keyed on the weight's sizes, like the rescale.
    # Three candidates: each costs a compile on a layer's first call (calibration), and these are the tile shapes
    # int8 GEMMs favour on Ampere and Hopper (128-byte K steps, large N tiles for the wide Linear layers).
    @_autotune(configs=_configs(({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, 4), [
        ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, 8),
        ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8}, 8),
        ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, 4)]), key=["N", "K"])
    @triton.jit
    def _gemm_rescale_kernel(a_ptr, w_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_am,
                             stride_wn, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
        # Programs walk GROUP_M row blocks down one column block before moving right: neighbours share tiles in L2.
        pid = tl.program_id(0)
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        rows64 = rows.to(tl.int64)  # M * K and M * N pass 2**31 for long token sequences
        a_ptrs = a_ptr + (rows64 * stride_am)[:, None] + ks[None, :]
        w_ptrs = w_ptr + (cols.to(tl.int64) * stride_wn)[None, :] + ks[:, None]  # a [BLOCK_K, BLOCK_N] tile of W^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=(rows < M)[:, None] & ((k0 + ks) < K)[None, :], other=0)
            w = tl.load(w_ptrs, mask=((k0 + ks) < K)[:, None] & (cols < N)[None, :], other=0)
            acc += tl.dot(a, w, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        _gemm_rescale_epilogue(acc, rows, cols, M, N, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, stride_om,
                               HAS_BIAS)  # fmt: skip

    @triton.jit
    def _gemm_rescale_epilogue(acc, rows, cols, M, N, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, stride_om,
                               HAS_BIAS: tl.constexpr):  # fmt: skip
        # The int32 tile of rows x cols rescaled with the same float32 operations in the same order as
        # _rescale_kernel, the bias added, stored in the output's dtype (the fused GEMMs' epilogue).
        row_scale = tl.load(row_scale_ptr + rows, mask=rows < M, other=0.0)
        col_scale = tl.load(col_scale_ptr + cols, mask=cols < N, other=0.0)
        y = acc.to(tl.float32) * row_scale[:, None] * col_scale[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        out_rows = rows.to(tl.int64) * stride_om  # M * N passes 2**31 for long token sequences
        tl.store(out_ptr + out_rows[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv_tile(B, H_out, W_out, C_out_g, stride_h, stride_w, pad_h, pad_w, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
        # An implicit-GEMM conv program's tile: rows m = (b, oh, ow) of the output, columns n = output channels of
        # the group. Returns the rows' mask, image and pixel, the input row and column under each row's first
        # tap, and the columns' output channels and mask.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        b_idx = offs_m // (H_out * W_out)
        pix = offs_m % (H_out * W_out)
        ih0 = (pix // W_out) * stride_h - pad_h
        iw0 = (pix % W_out) * stride_w - pad_w
        co = tl.program_id(2) * C_out_g + offs_n
        return offs_m < B * H_out * W_out, b_idx, pix, ih0, iw0, co, offs_n < C_out_g

    @triton.jit
    def _conv_epilogue(acc, m_mask, b_idx, pix, co, n_mask, x_zero_point, x_scale, col_sum_ptr, w_scale_ptr, bias_ptr,
                       out_ptr, C_out, H_out, W_out, HAS_BIAS: tl.constexpr):  # fmt: skip
        # Removes the activation zero point exactly (in int32, through the weight column sums), rescales, adds the
        # bias and stores the NCHW output in its dtype.
        col_sum = tl.load(col_sum_ptr + co, mask=n_mask, other=0)
        acc = acc - x_zero_point * col_sum[None, :]
        w_scale = tl.load(w_scale_ptr + co, mask=n_mask, other=0.0)
        y = acc.to(tl.float32) * (x_scale * w_scale)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + co, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_rows = b_idx.to(tl.int64) * C_out * (H_out * W_out) + pix
        out_cols = co.to(tl.int64) * (H_out * W_out)
        tl.store(out_ptr + out_rows[:, None] + out_cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    @_autotune(configs=_configs(({"BLOCK_M": 128, "BLOCK_K": 64}, 4), [
        ({"BLOCK_M": 64, "BLOCK_K": 32}, 4), ({"BLOCK_M": 64, "BLOCK_K": 64}, 4),
        ({"BLOCK_M": 128, "BLOCK_K": 32}, 4), ({"BLOCK_M": 128, "BLOCK_K": 64}, 8)]),
        key=["C_out_g", "K", "BLOCK_N"])
    @triton.jit
    def _conv2d_int8_kernel(
        x_ptr, w_ptr, col_sum_ptr, w_scale_ptr, bias_ptr, out_ptr, x_zero_point_ptr, x_scale_ptr,
        B, C_in, H, W, C_out, H_out, W_out, C_in_g, C_out_g, K,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Implicit GEMM: rows m = (b, oh, ow), columns n = output channel in the group, reduction k = (c, i, j).
        group = tl.program_id(2)
        m_mask, b_idx, pix, ih0, iw0, co, n_mask = _conv_tile(B, H_out, W_out, C_out_g, stride_h, stride_w, pad_h,
                                                               pad_w, BLOCK_M, BLOCK_N)  # fmt: skip
        # Element offsets in int64 (a video latent's batch passes 2**31 elements), split into a part per row (the
        # input element under the output pixel's first tap) and a part per column (channel and tap): per tile
        # only one int64 add per element. Indices (pixels, taps, channels) and the weight's offsets (C_out x K
        # elements) stay int32: each is far below 2**31.
        x_rows = ((b_idx.to(tl.int64) * C_in + group * C_in_g) * H + ih0) * W + iw0
        x_zero_point = tl.load(x_zero_point_ptr)
        x_scale = tl.load(x_scale_ptr)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            c = offs_k // (KH * KW)
            tap = offs_k % (KH * KW)
            dh = (tap // KW) * dil_h
            dw = (tap % KW) * dil_w
            ih = ih0[:, None] + dh[None, :]
            iw = iw0[:, None] + dw[None, :]
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            load_mask = m_mask[:, None] & k_mask[None, :] & inside
            x_cols = (c.to(tl.int64) * H + dh) * W + dw
            a = tl.load(x_ptr + x_rows[:, None] + x_cols[None, :], mask=load_mask, other=0)
            # Zero padding is the quantized value of 0.0, i.e. the zero point; its contribution is removed
            # below with the full weight column sums, so the int32 result is exact.
            a = tl.where(inside, a, x_zero_point).to(tl.int8)
            w = tl.load(w_ptr + co[None, :] * K + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
            acc += tl.dot(a, w, out_dtype=tl.int32)
        _conv_epilogue(acc, m_mask, b_idx, pix, co, n_mask, x_zero_point, x_scale, col_sum_ptr, w_scale_ptr, bias_ptr,
                       out_ptr, C_out, H_out, W_out, HAS_BIAS)  # fmt: skip


    @triton.jit
    def _round_half_even(v):
        # torch.round: to nearest, ties to even, exact for every float32 (v - floor(v) and r + 1 are exact
        # wherever a fraction can exist, |v| < 2**23). libdevice's rint is not in every release's interpreter.
        r = tl.floor(v)
        fraction = v - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), r + 1.0, r)

    # Both affine kernels run a fixed grid of `programs` (from the tensor's size, not a config) that strides over
    # the tensor, so the quantize kernel's programs each reduce the same small partial buffer. Keyed on the
    # channel count (fixed per layer), not on the batch or resolution.
    @_autotune(configs=_configs(({"BLOCK": 8192}, 4), [
        ({"BLOCK": 1024}, 4), ({"BLOCK": 2048}, 4), ({"BLOCK": 4096}, 8), ({"BLOCK": 8192}, 8)]), key=["C"])
    @triton.jit
    def _affine_range_kernel(x_ptr, partial_ptr, N, C, programs, PARTIALS: tl.constexpr, BLOCK: tl.constexpr):
        # partial_ptr: [2, PARTIALS] float32, row 0 min(x, 0) and row 1 max(x, 0) of this program's elements.
        pid = tl.program_id(0)
        # int64: start + offs runs past N, which may be just below 2**31.
        offs = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        lo = tl.zeros([BLOCK], dtype=tl.float32)
        hi = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, programs * BLOCK):  # host-side bounds: the interpreter takes no tensor here
            v = tl.load(x_ptr + start + offs, mask=start + offs < N, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, v)
            hi = tl.maximum(hi, v)
        tl.store(partial_ptr + pid, tl.min(lo, axis=0))
        tl.store(partial_ptr + PARTIALS + pid, tl.max(hi, axis=0))

    @triton.jit
    def _affine_qparams(partial_ptr, programs, PARTIALS: tl.constexpr):
        # Same formulas as quant.affine_qparams, from the range kernel's partials, which already hold min(x, 0) and
        # max(x, 0): the clamps to zero are in them. Returns (scale, zero point, 1 / scale), unsigned zero point.
        parts = tl.arange(0, PARTIALS)
        lo = tl.min(tl.load(partial_ptr + parts, mask=parts < programs, other=0.0), axis=0)
        hi = tl.max(tl.load(partial_ptr + PARTIALS + parts, mask=parts < programs, other=0.0), axis=0)
        span = hi - lo
        scale = tl.where(span > 0, tl.math.div_rn(span, tl.full([], 255.0, tl.float32)), 1.0)
        zero_point = _round_half_even(tl.math.div_rn(-lo, scale))
        zero_point = tl.minimum(tl.maximum(zero_point, 0.0), 255.0)
        return scale, zero_point, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)

    @triton.jit
    def _quantize_affine_values(v, inv_scale, zero_point):
        # quant.round_affine, stored signed (q - 128) as float
        q = _round_half_even(v.to(tl.float32) * inv_scale + zero_point)
        return tl.minimum(tl.maximum(q, 0.0), 255.0) - 128.0

    @_autotune(configs=_configs(({"BLOCK": 8192}, 4), [
        ({"BLOCK": 1024}, 4), ({"BLOCK": 2048}, 4), ({"BLOCK": 4096}, 8), ({"BLOCK": 8192}, 8)]), key=["C"])
    @triton.jit
    def _quantize_affine_kernel(x_ptr, partial_ptr, q_ptr, scale_ptr, zero_point_ptr, N, C, programs,
                                PARTIALS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        # Signed storage: q - 128 and zero point - 128.
        pid = tl.program_id(0)
        scale, zero_point, inv_scale = _affine_qparams(partial_ptr, programs, PARTIALS)
        offs = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # as in _affine_range_kernel
        for start in range(0, N, programs * BLOCK):
            mask = start + offs < N
            v = tl.load(x_ptr + start + offs, mask=mask, other=0.0)
            tl.store(q_ptr + start + offs, _quantize_affine_values(v, inv_scale, zero_point).to(tl.int8), mask=mask)
        if pid == 0:
            tl.store(scale_ptr, scale)
            tl.store(zero_point_ptr, (zero_point - 128.0).to(tl.int32))

    # The same quantizer writing channels-last (NHWC) int8 for the NHWC conv: each program quantizes a tile of
    # BLOCK_C channels x BLOCK_P pixels of one image, read along the pixels (contiguous in NCHW) and written along
    # the channels (contiguous in NHWC); the compiler stages the tile through shared memory between the two.
    @_autotune(configs=_configs(({"BLOCK_C": 16, "BLOCK_P": 64}, 4), [
        ({"BLOCK_C": 32, "BLOCK_P": 64}, 4), ({"BLOCK_C": 64, "BLOCK_P": 64}, 4),
        ({"BLOCK_C": 64, "BLOCK_P": 128}, 8), ({"BLOCK_C": 128, "BLOCK_P": 64}, 8)]), key=["C"])
    @triton.jit
    def _quantize_affine_nhwc_kernel(x_ptr, partial_ptr, q_ptr, scale_ptr, zero_point_ptr, C, HW, programs,
                                     PARTIALS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
        scale, zero_point, inv_scale = _affine_qparams(partial_ptr, programs, PARTIALS)
        pixels = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        # Offsets in int64: a video latent's batch passes 2**31 elements, and so may one large image.
        image = tl.program_id(2).to(tl.int64) * C * HW
        mask = (channels < C)[:, None] & (pixels < HW)[None, :]
        v = tl.load(x_ptr + image + (channels.to(tl.int64) * HW)[:, None] + pixels[None, :], mask=mask, other=0.0)
        q = _quantize_affine_values(v, inv_scale, zero_point).to(tl.int8)
        tl.store(q_ptr + image + channels[:, None] + (pixels.to(tl.int64) * C)[None, :], q, mask=mask)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            tl.store(scale_ptr, scale)
            tl.store(zero_point_ptr, (zero_point - 128.0).to(tl.int32))

    # Implicit-GEMM INT8 conv on channels-last int8 activations and [C_out, KH, KW, C_in_g] weight rows: per kernel
    # tap, the reduction runs along the channels, contiguous in both operands (whole-vector loads, no index
    # arithmetic per element); a pixel outside the image reads the zero point for all of its channels. Same int32
    # result and epilogue as _conv2d_int8_kernel, so the same output bit for bit; NCHW output.
    @_autotune(configs=_configs(({"BLOCK_M": 32, "BLOCK_K": 32}, 4), [
        ({"BLOCK_M": 64, "BLOCK_K": 64}, 4), ({"BLOCK_M": 128, "BLOCK_K": 64}, 8),
        ({"BLOCK_M": 128, "BLOCK_K": 128}, 8), ({"BLOCK_M": 64, "BLOCK_K": 128}, 4)]),
        key=["C_in_g", "C_out_g", "BLOCK_N"])
    @triton.jit
    def _conv2d_int8_nhwc_kernel(
        x_ptr, w_ptr, col_sum_ptr, w_scale_ptr, bias_ptr, out_ptr, x_zero_point_ptr, x_scale_ptr,
        B, C_in, H, W, C_out, H_out, W_out, C_in_g, C_out_g,
        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        group = tl.program_id(2)
        m_mask, b_idx, pix, ih0, iw0, co, n_mask = _conv_tile(B, H_out, W_out, C_out_g, stride_h, stride_w, pad_h,
                                                               pad_w, BLOCK_M, BLOCK_N)  # fmt: skip
        channels = tl.arange(0, BLOCK_K)
        x_zero_point = tl.load(x_zero_point_ptr)
        x_scale = tl.load(x_scale_ptr)
        K = KH * KW * C_in_g
        w_cols = co * K  # the weight's offsets stay int32: C_out x K elements
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        # One loop over (tap, channel block), not a loop per tap: the compiler pipelines the innermost loop only,
        # and unrolled taps made the kernel 9x larger (40 s to compile one candidate for sm_90, against 1.5 s).
        channel_blocks = (C_in_g + BLOCK_K - 1) // BLOCK_K
        for step in range(0, KH * KW * channel_blocks):
            tap = step // channel_blocks
            c = (step % channel_blocks) * BLOCK_K + channels
            c_mask = c < C_in_g
            ih = ih0 + (tap // KW) * dil_h
            iw = iw0 + (tap % KW) * dil_w
            inside = m_mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            # int64: the input passes 2**31 elements for a video latent's batch
            x_rows = ((b_idx.to(tl.int64) * H + ih) * W + iw) * C_in + group * C_in_g
            a = tl.load(x_ptr + x_rows[:, None] + c[None, :], mask=inside[:, None] & c_mask[None, :], other=0)
            # Padding is the quantized value of 0.0, the zero point; channels past C_in_g meet zero weights.
            a = tl.where(inside[:, None], a, x_zero_point).to(tl.int8)
            w = tl.load(w_ptr + w_cols[None, :] + (tap * C_in_g + c)[:, None], mask=c_mask[:, None] & n_mask[None, :],
                        other=0)
            acc += tl.dot(a, w, out_dtype=tl.int32)
        _conv_epilogue(acc, m_mask, b_idx, pix, co, n_mask, x_zero_point, x_scale, col_sum_ptr, w_scale_ptr, bias_ptr,
                       out_ptr, C_out, H_out, W_out, HAS_BIAS)  # fmt: skip


# Host-side sizes in plain Python: `triton.cdiv` and `triton.next_power_of_2` are constexpr functions in recent
# Triton releases, which unwrap their arguments at every call (about 2 us each on the 2-core CPU, several per
# launch through the grid functions).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _require() -> None:
    if not AVAILABLE:
        raise RuntimeError("triton is not importable")


def _row_blocks(meta: dict, m: int) -> tuple[int]:
    return (cdiv(m, meta["BLOCK_M"]),)


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 quantization of a float [M, K] matrix: (int8 [M, K], float32 scale [M]), in one
    launch; rows up to ONE_PASS_MAX_K wide are read once, wider ones twice."""
    _require()
    x2d = x2d.contiguous()
    m, k = x2d.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x2d.device)
    grid = functools.partial(_row_blocks, m=m)
    # Row strides of contiguous [M, K] matrices: K (a size-1 dim may report another stride; no offset reads it)
    if k <= ONE_PASS_MAX_K:
        _quantize_rows_one_pass_kernel[grid](x2d, q, scale, m, k, k, k, BLOCK_K=next_power_of_2(k), **EXACT)
    else:
        _quantize_rows_kernel[grid](x2d, q, scale, m, k, k, k, **EXACT)
    return q, scale


def _float32_vector(t: torch.Tensor) -> torch.Tensor:
    """A weight's per-channel scale as the kernels read it, contiguous float32: the layer's own buffer as it is
    (what the layers hold), else a converted copy."""
    if t.dtype is torch.float32 and t.is_contiguous():
        return t
    return t.to(torch.float32).contiguous()


# The affine kernels' grid: one program per AFFINE_GRAIN elements, at most AFFINE_PROGRAMS (a power of two: the
# partial buffer each quantize program reduces). Fewer under the interpreter, which runs programs one by one.
AFFINE_GRAIN = 16384 if INTERPRETED else 32768
AFFINE_PROGRAMS = 16 if INTERPRETED else 512


def quantize_affine(x: torch.Tensor, channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cuda.quantize_conv_input` in two launches: (int8 q - 128, contiguous; 0-d int32 zero point - 128; 0-d
    float32 scale), bit for bit. One kernel reads x for partial minima and maxima, the other reads it again to
    quantize; nothing else of x's size is allocated and nothing is read on the host. The channel count (dim 1, or
    1) keys the autotuning. q has x's shape, or with `channels_last` (x NCHW) the NHWC shape [B, H, W, C]."""
    _require()
    x = x.detach().contiguous()
    n = x.numel()
    channels = x.shape[1] if x.dim() > 1 else 1
    programs = max(1, min(cdiv(n, AFFINE_GRAIN), AFFINE_PROGRAMS))
    partials = torch.empty((2, AFFINE_PROGRAMS), dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    zero_point = torch.empty((), dtype=torch.int32, device=x.device)
    _affine_range_kernel[(programs,)](x, partials, n, channels, programs, PARTIALS=AFFINE_PROGRAMS, **EXACT)
    if not channels_last:
        q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        _quantize_affine_kernel[(programs,)](x, partials, q, scale, zero_point, n, channels, programs,
                                             PARTIALS=AFFINE_PROGRAMS, **EXACT)  # fmt: skip
        return q, zero_point, scale
    b, c, h, w = x.shape
    q = torch.empty((b, h, w, c), dtype=torch.int8, device=x.device)
    grid = lambda meta: (cdiv(h * w, meta["BLOCK_P"]), cdiv(c, meta["BLOCK_C"]), b)  # noqa: E731
    _quantize_affine_nhwc_kernel[grid](x, partials, q, scale, zero_point, c, h * w, programs,
                                       PARTIALS=AFFINE_PROGRAMS, **EXACT)  # fmt: skip
    return q, zero_point, scale


def rescale(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """acc int32 [M, N] -> acc * row_scale[:, None] * col_scale[None, :] (+ bias), in `dtype`, one pass."""
    _require()
    m, n = acc.shape
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    col_scale = _float32_vector(col_scale)
    bias_arg = col_scale if bias is None else bias.contiguous()
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _rescale_kernel[grid](acc, row_scale.contiguous(), col_scale, bias_arg, out, m, n, acc.stride(0), out.stride(0),
                          HAS_BIAS=bias is not None, **EXACT)  # fmt: skip
    return out


def gemm_rescale(a: torch.Tensor, q_weight: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int8 a [M, K] @ int8 q_weight [N, K]^T, rescaled by row_scale[:, None] * col_scale[None, :] (+ bias), in
    `dtype`, in one kernel: equal to `rescale(torch._int_mm(a, q_weight.t()), ...)` bit for bit, with no padding
    of M, K or N and no int32 product in memory."""
    _require()
    a, q_weight = a.contiguous(), q_weight.contiguous()
    m, k = a.shape
    n = q_weight.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=a.device)
    col_scale = _float32_vector(col_scale)
    bias_arg = col_scale if bias is None else bias.contiguous()
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    # row strides of the contiguous operands and output, as in quantize_rows
    _gemm_rescale_kernel[grid](a, q_weight, row_scale.contiguous(), col_scale, bias_arg, out, m, n, k, k, k, n,
                               HAS_BIAS=bias is not None, **EXACT)  # fmt: skip
    return out


def _launch_conv(kernel, x_q: torch.Tensor, weight: torch.Tensor, image: tuple[int, int, int, int],
                 geometry: tuple[int, int, int, int], extra: tuple, x_zero_point: torch.Tensor, x_scale: torch.Tensor,
                 col_sum: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                 padding: list[int], dilation: list[int], groups: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """One of the conv kernels over NCHW `image` (B, C_in, H, W) and weight `geometry` (C_out, C_in/g, KH, KW), its
    own extra size arguments after the shapes; the NCHW output in `dtype`."""
    b, c_in, h, w = image
    c_out, c_in_g, kh, kw = geometry
    _, _, h_out, w_out = conv_output_shape(image, geometry, stride, padding, dilation)
    out = torch.empty((b, c_out, h_out, w_out), dtype=dtype, device=x_q.device)
    c_out_g = c_out // groups
    block_n = 128 if c_out_g > 64 else max(16, next_power_of_2(c_out_g))
    grid = lambda meta: (cdiv(b * h_out * w_out, meta["BLOCK_M"]), cdiv(c_out_g, block_n), groups)  # noqa: E731
    w_scale32 = _float32_vector(w_scale)
    kernel[grid](
        x_q, weight, col_sum, w_scale32, w_scale32 if bias is None else bias.contiguous(), out,
        x_zero_point, x_scale,
        b, c_in, h, w, c_out, h_out, w_out, c_in_g, c_out_g, *extra,
        stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
        KH=kh, KW=kw, HAS_BIAS=bias is not None, BLOCK_N=block_n, **EXACT,
    )  # fmt: skip
    return out


def conv2d_int8(x_q: torch.Tensor, x_zero_point: torch.Tensor, x_scale: torch.Tensor, q_weight: torch.Tensor,
                col_sum: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                padding: list[int], dilation: list[int], groups: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Implicit-GEMM INT8 conv on signed int8 NCHW activations with a zero point; NCHW output in `dtype`, written
    by the kernel's epilogue (no float32 copy).

    `x_zero_point` (int32) and `x_scale` (float32) are 0-d tensors on the device; `col_sum` is the int32 sum of
    each output channel's weights."""
    _require()
    x_q = x_q.contiguous()
    c_out, c_in_g, kh, kw = q_weight.shape
    k = c_in_g * kh * kw
    w2d = q_weight.reshape(c_out, k).contiguous()  # the weight's own memory for a contiguous weight
    return _launch_conv(_conv2d_int8_kernel, x_q, w2d, tuple(x_q.shape), tuple(q_weight.shape), (k,), x_zero_point,
                        x_scale, col_sum, w_scale, bias, stride, padding, dilation, groups, dtype)  # fmt: skip


def conv2d_int8_nhwc(x_q: torch.Tensor, x_zero_point: torch.Tensor, x_scale: torch.Tensor, w_rows: torch.Tensor,
                     col_sum: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                     padding: list[int], dilation: list[int], groups: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`conv2d_int8` on channels-last int8 activations `x_q` [B, H, W, C_in] (`quantize_affine(x,
    channels_last=True)`) and the weight as [C_out, KH, KW, C_in/groups] rows (`nhwc_conv_rows`); NCHW output in
    `dtype`, equal to `conv2d_int8`'s bit for bit."""
    _require()
    x_q = x_q.contiguous()
    b, h, w, c_in = x_q.shape
    c_out, kh, kw, c_in_g = w_rows.shape
    return _launch_conv(_conv2d_int8_nhwc_kernel, x_q, w_rows, (b, c_in, h, w), (c_out, c_in_g, kh, kw), (),
                        x_zero_point, x_scale, col_sum, w_scale, bias, stride, padding, dilation, groups, dtype)


def nhwc_conv_rows(q_weight: torch.Tensor) -> torch.Tensor:
    """int8 [C_out, C_in/g, KH, KW] -> the [C_out, KH, KW, C_in/g] rows `conv2d_int8_nhwc` reads (a new tensor)."""
    return q_weight.permute(0, 2, 3, 1).contiguous()
