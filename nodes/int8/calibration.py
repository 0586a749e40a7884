"""What calibration measures and decides: per-layer measurements, the decision rule, and the keys that say
which weights, LoRA patches, settings and latent size a decision belongs to."""

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

# 5: the error gate before the kernel size floor; 7: the whole-model guard; 8: CPU timings are the fastest sample,
# re-measured while other work disturbed them (decisions from disturbed medians are not reused)
CACHE_FORMAT_VERSION = 8
_SAMPLE_WORDS = 256

INT8 = "int8"
# The float decisions, by the gate that decided them, in the order `decide` applies the gates (the report and the
# decision picture name that gate).
FLOAT_BY_GATE = {"kind": "float: kind disabled", "density": "float: density below threshold",
                 "kernel size floor": "float: below the kernel size floor",
                 "error": "float: error above threshold", "speed": "float: slower in INT8",
                 "model error": "float: whole-model error guard"}
# Passed every gate but speed: slower in INT8 on the machine that calibrated (Save INT8 Model's
# smallest file still writes such layers in INT8).
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
    timing_conditions: str = ""  # speed.SETTLED, CLOSE, REMEASURED or NOISY ("": not timed, or a device that does not check)
    timing_replayed: bool = False  # the speed gate timed replays of CUDA graphs of the calls
    source: str = ""  # a core-quantized layer's format and how its INT8 weights were made ("": a float layer)
    # The kernel backend serving the calibration's device computes this layer's call in float at the calibration
    # shape (below its size floor), with the dequantized weight: INT8 would change the result and save nothing.
    below_kernel_floor: bool = False

    @property
    def macs(self) -> int:
        return self.m * self.k * self.n

    @property
    def quantized(self) -> bool:
        return self.decision == INT8

    @property
    def within_thresholds(self) -> bool:
        """Passed the kind, density and error gates: in INT8 now, or kept in float by the kernel size floor or the
        speed gate alone. Both are facts about the device that calibrated, not about what a file should hold: a file
        saved here may be computed on a device without the floor."""
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
    linear_gemm: str = ""  # the triton kernel backend's Linear GEMM ("fused" / "fused-tma" / "int-mm"); "" for the others
    conv_layout: str = ""  # the triton kernel backend's conv kernel ("nchw" / "nhwc"); "" for the others
    # the speed gate timed the layers as CUDA graph replays (Compile Model replays the model's calls from graphs)
    cuda_graph_timing: bool = False
    # ... and the Linears as their GEMM on quantized rows (inductor fuses their activation quantizer into the op
    # before them)
    fused_quantizer_timing: bool = False
    model_guard: dict = field(default_factory=dict)  # when the whole-model guard acted: limit, error_before, rounds

    @property
    def noisy_timings(self) -> bool:
        """Other work on the machine disturbed some layer's speed gate timing to the end of its bound: a decision
        to use in this session, not to reuse from disk in a later one."""
        return any(layer.timing_conditions == NOISY for layer in self.layers)

    @property
    def chosen(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.quantized]

    @property
    def within_thresholds(self) -> list[str]:
        """Every layer accurate enough in INT8, including those the kernel size floor or the speed gate kept in float
        on this machine."""
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


# The whole-model guard. Each layer's error gate judges the layer alone; a few layers each under the threshold can
# still throw the model's output far off together, as activation outlier channels do (a trained Flux-family model
# with 100x channels: whole-model error 0.0197 where it is 0.0003 without, and a 20 dB picture at the default
# threshold). When the chosen layers' whole-model output error exceeds MODEL_ERROR_LIMIT, the guard returns the
# layers above a tighter threshold to float (the kind's threshold divided by 4, then 16, then 64) and measures
# again, for at most MODEL_GUARD_ROUNDS more forwards. The limit is fixed, not a share of the thresholds: the
# trained models' INT8 errors are 0.0002-0.0026 and random tiny ones' about 0.0001, and a user who tightens the
# per-layer thresholds asks for fewer INT8 layers, not for a model error below what those layers add up to.
MODEL_ERROR_LIMIT = 0.005
MODEL_GUARD_ROUNDS = 3


def guard_round(result: CalibrationResult, settings: QuantizeSettings, round_number: int) -> list[str]:
    """Round `round_number` (1, 2, ...) of the whole-model guard: the INT8 layers whose error exceeds their kind's
    threshold divided by 4**round_number go back to float (decision "float: whole-model error guard"); their
    names."""
    dropped = []
    for layer in result.layers:
        limit = settings.threshold_for(layer.kind) / 4**round_number
        if layer.quantized and layer.error is not None and layer.error > limit:
            layer.decision = FLOAT_BY_GATE["model error"]
            dropped.append(layer.name)
    return dropped


def decide(layer: LayerMeasurement, settings: QuantizeSettings, measure_error: Callable[[], float],
           time_calls: Callable[[], Timing | None]) -> str:
    """Whether `layer` runs in INT8: the one decision, made once per layer at calibration, recorded in
    `layer.decision` and returned. INT8, or float named by the first gate it fails, in this order: kind (enabled
    in `settings`), density (at least the threshold), error (the INT8 copy's normalized error, from
    `measure_error()`, at most the kind's threshold; for a layer below the kernel size floor, the error of the INT8
    arithmetic a device without the floor runs), kernel size floor (`layer.below_kernel_floor`), speed
    (`time_calls()`: the timing of the layer's float and INT8 calls, or None when the speed gate is off; INT8 must
    be faster). A layer that passes kind, density and error is accurate enough for a file (`within_thresholds`)
    whatever the floor and the speed gate say about this device.

    The error and the timings cost a forward of the layer's INT8 copy and several timed calls, so they are
    measured only for a layer that reaches their gate; they are recorded in `layer` too."""
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
    """Fingerprint of the weights `patcher` will run with: `weights`, (state-dict key, original tensor) pairs,
    sampled, plus every weight patch (LoRA) it carries. Cheap enough to compute per sampling run."""
    hasher = hashlib.sha256()
    for key, tensor in weights:
        hasher.update(key.encode())
        hasher.update(_tensor_digest(tensor))
    for key in sorted(patcher.patches):
        hasher.update(key.encode())
        _digest_patch(hasher, patcher.patches[key])
    return hasher.hexdigest()[:32]


def bypass_fingerprint(hooks: dict) -> str:
    """Fingerprint of bypass-mode LoRA hooks ({layer name: hook}, see `comfy_contracts.bypass_hook`): each adapter's
    weights and strength."""
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
    """Key of a decision: the weights and patches, the settings, the latent's size and dtype, and what runs the
    INT8 layers (device, kernel backend, weight width), whether the speed gate decided, whether it timed CUDA
    graph replays (`cuda_graph_timing_for`) and whether it timed Linears without their fused quantizer: a decision
    measured on one is not reused on another."""
    parts = [CACHE_FORMAT_VERSION, fingerprint, settings.key(), list(x.shape[2:]), str(x.dtype),
             x.device.type, kernel_backend_for(x.device), linear_gemm_for(x.device), conv_layout_for(x.device),
             weight_bits(x.device), speed_gate_enabled()]
    if cuda_graph_timing:
        parts.append("cuda-graph timing")
    if fused_quantizer_timing:
        parts.append("fused quantizer timing")
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
