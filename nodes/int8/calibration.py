"""What calibration measures and decides: per-layer measurements, the decision rule, and the keys that say
which weights, LoRA patches, settings and latent size a decision belongs to."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from .settings import QuantizeSettings

CACHE_FORMAT_VERSION = 1
_SAMPLES_PER_TENSOR = 64


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
