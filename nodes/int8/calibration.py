"""Calibration's per-layer measurements, decision rule, and keys (weights, LoRA patches, settings, latent size)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch

from ...kernels import content_checksum, kernel_backend_for, weight_bits
from ...kernels.triton_backend import conv_layout, linear_gemm
from .environment import speed_gate_enabled
from .settings import QuantizeSettings
from .speed import NOISY, Timing

# 5: error gate ahead of the kernel size floor; 7: whole-model guard; 8: CPU timings are fastest samples, not medians
CACHE_FORMAT_VERSION = 8
_SAMPLE_WORDS = 256

INT8 = "int8"
# Float decisions by deciding gate, in `decide`'s gate order (the report and the decision picture name that gate).
FLOAT_BY_GATE = {"kind": "float: kind disabled", "density": "float: density below threshold",
                 "kernel size floor": "float: below the kernel size floor", "error": "float: error above threshold",
                 "speed": "float: slower in INT8", "model error": "float: whole-model error guard"}
# Passed every gate but speed (Save INT8 Model's smallest file still writes such layers in INT8).
SLOWER_IN_INT8 = FLOAT_BY_GATE["speed"]


@dataclass
class LayerMeasurement:
    name: str
    kind: str
    weight_shape: list[int]
    m: int
    k: int
    n: int
    density: float
    error: float | None
    decision: str = ""
    float_ms: float | None = None  # the speed gate's timings of this layer's call (None: not timed)
    int8_ms: float | None = None
    timing_pairs: int = 0  # float/INT8 sample pairs the speed gate took (0: not timed)
    timing_conditions: str = ""  # speed.SETTLED, CLOSE, REMEASURED or NOISY ("": not timed, or not checked here)
    timing_replayed: bool = False  # the speed gate timed replays of CUDA graphs of the calls
    source: str = ""  # a core-quantized layer's format and how its INT8 weights were made ("": a float layer)
    # Below the backend's size floor here: runs in float (dequantized weight); INT8 would change results, save nothing.
    below_kernel_floor: bool = False

    @property
    def macs(self) -> int:
        return self.m * self.k * self.n

    @property
    def quantized(self) -> bool:
        return self.decision == INT8

    @property
    def within_thresholds(self) -> bool:
        """Passed kind, density and error: fit for a file whatever this device's size floor and speed gate say."""
        return self.decision in (INT8, SLOWER_IN_INT8, FLOAT_BY_GATE["kernel size floor"])


@dataclass
class CalibrationResult:
    key: str
    shape: list[int]
    layers: list[LayerMeasurement]
    model_error: float | None = None
    int8_flop_fraction: float = 0.0
    seconds: float = 0.0
    kernel_backend: str = ""  # the kernel backend that ran the INT8 layers
    kernel_backend_fallback: dict[str, str] = field(default_factory=dict)  # first choice not used: why (kernels')
    kernel_calls: dict[str, int] = field(default_factory=dict)  # INT8 op calls of the checking step, by path
    memory: dict[str, int] = field(default_factory=dict)  # model_float_bytes, int8_bytes, calibration_peak_int8_bytes
    left_to_core: dict[str, str] = field(default_factory=dict)  # core-quantized layers in formats INT8 cannot take
    created: float = field(default_factory=time.time)
    weight_bits: int = 0  # width of the INT8 weights (8, or 7 on CPUs without VNNI); 0: not recorded
    linear_gemm: str = ""  # the triton kernel backend's Linear GEMM ("fused" / "fused-tma" / "int-mm"); "" for others
    conv_layout: str = ""  # the triton kernel backend's conv kernel ("nchw" / "nhwc"); "" for the others
    cuda_graph_timing: bool = False  # the speed gate timed CUDA graph replays (as Compile Model replays the calls)
    fused_quantizer_timing: bool = False  # ... and Linears as GEMMs on quantized rows (inductor fuses the quantizer)
    model_guard: dict = field(default_factory=dict)  # when the whole-model guard acted: limit, error_before, rounds

    @property
    def noisy_timings(self) -> bool:
        """Some speed gate timing stayed disturbed to its bound: decisions for this session, not to reuse from disk."""
        return any(layer.timing_conditions == NOISY for layer in self.layers)

    @property
    def chosen(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.quantized]

    @property
    def within_thresholds(self) -> list[str]:
        """Every layer accurate enough in INT8, including those the size floor or speed gate kept in float here."""
        return [layer.name for layer in self.layers if layer.within_thresholds]

    def to_json(self) -> dict:
        data = asdict(self)
        data["version"] = CACHE_FORMAT_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict) -> CalibrationResult:
        known = {f.name for f in fields(cls)} - {"layers"}
        return cls(layers=[LayerMeasurement(**row) for row in data["layers"]],
                   **{name: value for name, value in data.items() if name in known})


# The whole-model guard: layers each under their error threshold can together throw the model's output far off, as
# activation outlier channels do (a trained Flux-family model with 100x channels: whole-model error 0.0197, 0.0003
# without, a 20 dB picture at the default threshold); above MODEL_ERROR_LIMIT it runs up to MODEL_GUARD_ROUNDS
# `guard_round`s. The limit is a constant, not a share of the thresholds: trained models' INT8 errors are 0.0002-0.0026,
# random tiny ones' about 0.0001, and tighter layer thresholds ask for fewer INT8 layers, not a lower model error.
MODEL_ERROR_LIMIT = 0.005
MODEL_GUARD_ROUNDS = 3


def guard_round(result: CalibrationResult, settings: QuantizeSettings, round_number: int) -> list[str]:
    """Whole-model guard round `round_number` (from 1): the names of the INT8 layers it sends back to float."""
    dropped = []
    for layer in result.layers:
        limit = settings.threshold_for(layer.kind) / 4**round_number
        if layer.quantized and layer.error is not None and layer.error > limit:
            layer.decision = FLOAT_BY_GATE["model error"]
            dropped.append(layer.name)
    return dropped


def decide(layer: LayerMeasurement, settings: QuantizeSettings, measure_error: Callable[[], float],
           time_calls: Callable[[], Timing | None]) -> str:
    """Whether `layer` runs in INT8, decided once at calibration and recorded: INT8, or float named by the first gate it
    fails (see `_first_failed_gate`). `measure_error()` is the INT8 copy's normalized error (below the size floor:
    of the INT8 arithmetic a device without the floor runs); `time_calls()` is None while the speed gate is off. Both
    cost a forward or several timed calls, so only a layer that reaches their gate is measured."""
    layer.decision = _first_failed_gate(layer, settings, measure_error, time_calls)
    return layer.decision


def _first_failed_gate(layer: LayerMeasurement, settings: QuantizeSettings, measure_error: Callable[[], float],
                       time_calls: Callable[[], Timing | None]) -> str:
    if not settings.kind_enabled(layer.kind):
        return FLOAT_BY_GATE["kind"]
    if layer.density < settings.compute_density_threshold:
        return FLOAT_BY_GATE["density"]
    layer.error = measure_error()
    if not layer.error <= settings.threshold_for(layer.kind):  # a NaN error fails too
        return FLOAT_BY_GATE["error"]
    if layer.below_kernel_floor:
        return FLOAT_BY_GATE["kernel size floor"]
    timing = time_calls()
    if timing is not None:
        layer.float_ms, layer.int8_ms = 1e3 * timing.float_seconds, 1e3 * timing.int8_seconds
        layer.timing_pairs, layer.timing_conditions = timing.pairs, timing.conditions
        layer.timing_replayed = timing.replayed
        if not timing.int8_faster:
            return FLOAT_BY_GATE["speed"]
    return INT8


def decisive_gate(layer: LayerMeasurement) -> str:
    """The gate that kept the layer in float (a key of FLOAT_BY_GATE), or "all passed" for an INT8 layer."""
    for gate, decision in FLOAT_BY_GATE.items():
        if layer.decision == decision:
            return gate
    return "all passed"


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    checksum = content_checksum(tensor, sample_words=_SAMPLE_WORDS)
    return repr((tuple(tensor.shape), str(tensor.dtype), checksum)).encode()


def _digest_patch(hasher, obj, depth: int = 0) -> None:
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        hasher.update(_tensor_digest(obj))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _digest_patch(hasher, item, depth + 1)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        hasher.update(repr(obj).encode())
    elif hasattr(obj, "weights"):  # comfy.weight_adapter adapters (LoRA, LoHa, ...)
        hasher.update(type(obj).__name__.encode())
        _digest_patch(hasher, obj.weights, depth + 1)
    else:
        hasher.update(type(obj).__name__.encode())


def model_fingerprint(patcher, weights: list[tuple[str, torch.Tensor]]) -> str:
    """Fingerprint of `weights` ((key, original tensor), sampled: cheap per run) and `patcher`'s patches (LoRA)."""
    hasher = hashlib.sha256()
    for key, tensor in weights:
        hasher.update(key.encode())
        hasher.update(_tensor_digest(tensor))
    for key in sorted(patcher.patches):
        hasher.update(key.encode())
        _digest_patch(hasher, patcher.patches[key])
    return hasher.hexdigest()[:32]


def bypass_fingerprint(hooks: dict) -> str:
    """Fingerprint of bypass-mode LoRA hooks ({layer name: hook}, `comfy_contracts.bypass_hook`): weights, strength."""
    hasher = hashlib.sha256()
    for name in sorted(hooks):
        hasher.update(name.encode())
        _digest_patch(hasher, (hooks[name].adapter, float(hooks[name].multiplier)))
    return hasher.hexdigest()[:32]


def linear_gemm_for(device: torch.device) -> str:
    """The Linear GEMM of the kernel backend serving `device`: the triton backend's choice, "" for the others."""
    return linear_gemm(device) if kernel_backend_for(device) == "triton" else ""


def conv_layout_for(device: torch.device) -> str:
    """The conv kernel of the kernel backend serving `device`: the triton backend's choice, "" for the others."""
    return conv_layout(device) if kernel_backend_for(device) == "triton" else ""


def cuda_graph_timing_for(device: torch.device, replays_cuda_graphs: bool) -> bool:
    """Whether the speed gate times CUDA graph replays: on a CUDA device, for a model whose calls replay graphs."""
    return replays_cuda_graphs and device.type == "cuda"


def calibration_key(fingerprint: str, settings: QuantizeSettings, x: torch.Tensor,
                    cuda_graph_timing: bool = False, fused_quantizer_timing: bool = False) -> str:
    """Key of a decision: all it was measured under (weights, patches, settings, latent, INT8 runtime, speed gate)."""
    parts = [CACHE_FORMAT_VERSION, fingerprint, settings.key(), list(x.shape[2:]), str(x.dtype),
             x.device.type, kernel_backend_for(x.device), linear_gemm_for(x.device), conv_layout_for(x.device),
             weight_bits(x.device), speed_gate_enabled()]
    flags = (("cuda-graph timing", cuda_graph_timing), ("fused quantizer timing", fused_quantizer_timing))
    parts += [flag for flag, on in flags if on]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
