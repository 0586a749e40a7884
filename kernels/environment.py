"""Every environment variable the kernels read, in one place (the README's Configuration table lists them).

All of them are for measuring and testing the kernels (benches, the suite, a person comparing paths); none is
needed to run the pack. Read at import unless a function below says otherwise.
"""

from __future__ import annotations

import os

WEIGHT_BITS = "INT8_ACCEL_WEIGHT_BITS"
LINEAR_ACTIVATIONS = "INT8_ACCEL_LINEAR_ACTIVATIONS"
LINEAR_MIN_MACS = "INT8_ACCEL_LINEAR_MIN_MACS"
CONV_MIN_MACS = "INT8_ACCEL_CONV_MIN_MACS"
MIN_REDUCTION = "INT8_ACCEL_MIN_REDUCTION"
IM2COL_MAX_ROWS = "INT8_ACCEL_IM2COL_MAX_ROWS"
COMPILE_QUANTIZER = "INT8_ACCEL_COMPILE_QUANTIZER"
TRACED_QUANTIZER = "INT8_ACCEL_TRACED_QUANTIZER"
TRACED_QUANTIZER_CHOICES = ("1", "0")
TRITON_LINEAR = "INT8_ACCEL_TRITON_LINEAR"
TRITON_LINEAR_CHOICES = ("auto", "int-mm", "fused", "fused-tma")
TRITON_CONV = "INT8_ACCEL_TRITON_CONV"
TRITON_CONV_CHOICES = ("auto", "nchw", "nhwc")


def forced_weight_bits() -> int | None:
    """7 when `INT8_ACCEL_WEIGHT_BITS=7` (read at every call, so a test can set it), None when unset; any other
    value is an error."""
    forced = os.environ.get(WEIGHT_BITS, "").strip()
    if not forced:
        return None
    if forced == "7":
        return 7
    raise ValueError(f"{WEIGHT_BITS}={forced!r} is not supported: set it to 7 or leave it unset")


def linear_activations() -> str:
    """The initial Linear activation granularity, "token" (default) or "tensor"."""
    return os.environ.get(LINEAR_ACTIVATIONS, "token")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name}={value!r} must be a whole number") from None


def linear_min_macs(default: int) -> int:
    """Multiply-accumulates per call below which the cpu backend runs a Linear in float."""
    return _int(LINEAR_MIN_MACS, default)


def conv_min_macs(default: int) -> int:
    """The same for Conv2d."""
    return _int(CONV_MIN_MACS, default)


def min_reduction(default: int) -> int:
    """Reduction length (K, or Cin*kh*kw) below which the cpu backend runs a Linear or Conv2d in float."""
    return _int(MIN_REDUCTION, default)


def im2col_max_rows(default: int) -> int:
    """Output pixels up to which the cpu backend runs an INT8 conv as one GEMM over im2col rows."""
    return _int(IM2COL_MAX_ROWS, default)


def compiled_quantizer_disabled_reason() -> str | None:
    """Why the cpu backend's activation quantizers never use torch.compile (`INT8_ACCEL_COMPILE_QUANTIZER=0`), or
    None."""
    return f"{COMPILE_QUANTIZER}=0" if os.environ.get(COMPILE_QUANTIZER) == "0" else None


def _choice(name: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def triton_linear_gemm() -> str:
    """How the triton backend multiplies a Linear (read at every call): "auto" (default: the backend picks per
    GPU, `triton_backend.linear_gemm`), "int-mm" (torch._int_mm, then the rescale kernel), "fused" (one Triton
    INT8 GEMM with the rescale in its epilogue) or "fused-tma" (the same GEMM as a persistent kernel reading its
    tiles through TMA, on GPUs of compute capability 9.0 and newer; "fused" where a layer cannot take it)."""
    return _choice(TRITON_LINEAR, TRITON_LINEAR_CHOICES)


def triton_conv_layout() -> str:
    """Which INT8 conv kernel the triton backend runs (read at every call): "auto" (default: the backend picks,
    `triton_backend.conv_layout`), "nchw" (the implicit GEMM on NCHW int8 activations) or "nhwc" (activations
    quantized to channels-last, the reduction along contiguous channels)."""
    return _choice(TRITON_CONV, TRITON_CONV_CHOICES)


def traced_linear_quantizer() -> bool:
    """Whether torch.compile traces a GPU Linear's per-token activation quantizer as torch ops, apart from its
    GEMM, so that inductor fuses it into the ops before it (read when a graph is traced). `INT8_ACCEL_TRACED_QUANTIZER=0`
    keeps it inside the INT8 op, a kernel of its own, as in eager mode; `1` (or unset) traces it; any other value is
    an error."""
    return _choice(TRACED_QUANTIZER, TRACED_QUANTIZER_CHOICES) == "1"
