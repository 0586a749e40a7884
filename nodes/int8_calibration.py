"""Calibration bookkeeping for the INT8 core: fingerprints, per-layer measurements, the decision cache on
disk and the human-readable report. No sampling logic here."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("int8_accel")
CACHE_FORMAT_VERSION = 1
_SAMPLES_PER_TENSOR = 64


@dataclass(frozen=True)
class QuantizeSettings:
    bits: int = 8
    quantize_conv: bool = True
    quantize_linear: bool = True
    conv_mse_threshold: float = 0.1
    linear_mse_threshold: float = 0.1
    compute_density_threshold: int = 300

    SUPPORTED_BITS = (8,)

    def bits_error(self) -> str | None:
        if self.bits in self.SUPPORTED_BITS:
            return None
        return (f"bits={self.bits} is not supported: only bits=8 (W8A8: int8 weights per output channel, int8 "
                f"dynamic activations) is implemented")

    def validate(self) -> None:
        if self.bits_error():
            raise ValueError(self.bits_error())
        for name in ("conv_mse_threshold", "linear_mse_threshold"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} is outside 0..1")
        if self.compute_density_threshold < 0:
            raise ValueError(f"compute_density_threshold={self.compute_density_threshold} must be >= 0")

    def threshold_for(self, kind: str) -> float:
        return self.conv_mse_threshold if kind == "conv" else self.linear_mse_threshold

    def kind_enabled(self, kind: str) -> bool:
        enabled = self.quantize_conv if kind == "conv" else self.quantize_linear
        return enabled and self.threshold_for(kind) > 0.0

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


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

    @property
    def macs(self) -> int:
        return self.m * self.k * self.n

    @property
    def quantized(self) -> bool:
        return self.decision == "int8"


@dataclass
class CalibrationResult:
    key: str
    shape: list[int]
    layers: list[LayerMeasurement]
    model_error: float | None = None
    int8_flop_fraction: float = 0.0
    seconds: float = 0.0
    created: float = field(default_factory=time.time)

    @property
    def chosen(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.quantized]

    def to_json(self) -> dict:
        data = asdict(self)
        data["version"] = CACHE_FORMAT_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict) -> CalibrationResult:
        layers = [LayerMeasurement(**row) for row in data["layers"]]
        return cls(key=data["key"], shape=data["shape"], layers=layers, model_error=data.get("model_error"),
                   int8_flop_fraction=data.get("int8_flop_fraction", 0.0), seconds=data.get("seconds", 0.0),
                   created=data.get("created", 0.0))


def decide(layer: LayerMeasurement, settings: QuantizeSettings) -> str:
    if not settings.kind_enabled(layer.kind):
        return "float: kind disabled"
    if layer.density < settings.compute_density_threshold:
        return "float: density below threshold"
    if layer.error is None or layer.error > settings.threshold_for(layer.kind):
        return "float: error above threshold"
    return "int8"


# --- fingerprints ------------------------------------------------------------------------------------
def _sample_tensor(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
    picked = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
    return repr(tuple(tensor.shape)).encode() + picked.numpy().tobytes()


def _digest_patch(hasher, obj, depth: int = 0) -> None:
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        hasher.update(_sample_tensor(obj))
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


def model_fingerprint(patcher, weight_keys: list[str]) -> str:
    """Fingerprint of the weights `patcher` will run with: the original (unpatched) values of `weight_keys`,
    sampled, plus every weight patch (LoRA) it carries. Cheap enough to compute per sampling run."""
    import comfy.utils

    hasher = hashlib.sha256()
    for key in weight_keys:
        backup = patcher.backup.get(key)
        tensor = backup.weight if backup is not None else comfy.utils.get_attr(patcher.model, key)
        hasher.update(key.encode())
        hasher.update(_sample_tensor(tensor))
    for key in sorted(patcher.patches):
        hasher.update(key.encode())
        _digest_patch(hasher, patcher.patches[key])
    return hasher.hexdigest()[:32]


def calibration_key(fingerprint: str, settings: QuantizeSettings, spatial_shape, dtype: torch.dtype) -> str:
    text = json.dumps([CACHE_FORMAT_VERSION, fingerprint, settings.key(), list(spatial_shape), str(dtype)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- the decision cache on disk ------------------------------------------------------------------------
def cache_dir() -> Path:
    override = os.environ.get("INT8_ACCEL_CACHE_DIR")
    if override:
        return Path(override)
    import folder_paths

    return Path(folder_paths.get_user_directory()) / "int8_accel" / "calibration"


def load_result(key: str) -> CalibrationResult | None:
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("version") != CACHE_FORMAT_VERSION:
            return None
        return CalibrationResult.from_json(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("int8-accel: ignoring unreadable calibration cache %s (%s)", path, exc)
        return None


_report_generations: dict[str, int] = {}


def report_generation(settings: QuantizeSettings) -> int:
    """How many calibration reports were written in this process for these settings (changes when a new one is)."""
    return _report_generations.get(settings.key(), 0)


def save_result(result: CalibrationResult, fingerprint: str, settings: QuantizeSettings, report: str) -> None:
    _report_generations[settings.key()] = report_generation(settings) + 1
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(result.to_json(), indent=1)
        tmp = directory / f".{result.key}.{os.getpid()}.tmp"
        tmp.write_text(payload)
        tmp.replace(directory / f"{result.key}.json")
        (directory / f"report-{_report_key(fingerprint, settings)}.txt").write_text(report)
    except OSError as exc:
        log.warning("int8-accel: could not write the calibration cache in %s (%s)", directory, exc)


def load_last_report(fingerprint: str, settings: QuantizeSettings) -> str | None:
    try:
        return (cache_dir() / f"report-{_report_key(fingerprint, settings)}.txt").read_text()
    except OSError:
        return None


def _report_key(fingerprint: str, settings: QuantizeSettings) -> str:
    return hashlib.sha256((fingerprint + settings.key()).encode()).hexdigest()[:32]


# --- report --------------------------------------------------------------------------------------------
def format_report(result: CalibrationResult, settings: QuantizeSettings, weight_bytes: dict[str, int]) -> str:
    header = f"{'layer':<58} {'kind':<6} {'shape':<20} {'density':>9} {'norm. MSE':>10}  decision"
    lines = [f"INT8 calibration on latent {result.shape} ({result.seconds:.1f} s); "
             f"norm. MSE = mean((y_int8 - y)^2) / mean(y^2) per layer", header]
    for layer in result.layers:
        error = "-" if layer.error is None else f"{layer.error:.2e}"
        shape = "x".join(str(d) for d in layer.weight_shape)
        lines.append(f"{layer.name:<58} {layer.kind:<6} {shape:<20} {layer.density:>9.1f} {error:>10}  "
                     f"{layer.decision}")
    chosen = [layer for layer in result.layers if layer.quantized]
    float_bytes = sum(weight_bytes.get(layer.name, 0) for layer in chosen)
    int8_bytes = sum(layer.k * layer.n + 4 * layer.n for layer in chosen)
    counts = {kind: sum(1 for layer in chosen if layer.kind == kind) for kind in ("linear", "conv")}
    totals = {kind: sum(1 for layer in result.layers if layer.kind == kind) for kind in ("linear", "conv")}
    model_error = "-" if result.model_error is None else f"{result.model_error:.2e}"
    lines.append(
        f"summary: {len(chosen)}/{len(result.layers)} layers in INT8 (linear {counts['linear']}/{totals['linear']}, "
        f"conv {counts['conv']}/{totals['conv']}); {100 * result.int8_flop_fraction:.1f}% of the model's FLOPs in "
        f"INT8; weights of those layers {float_bytes / 2**20:.1f} MiB float -> {int8_bytes / 2**20:.1f} MiB INT8 "
        f"({(float_bytes - int8_bytes) / 2**20:.1f} MiB smaller; the float originals stay loaded so LoRA and "
        f"float layers keep working); whole-model output norm. MSE {model_error}")
    return "\n".join(lines)
