"""The six settings of the INT8 node, as one immutable value the core and its caches key on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

ENABLE = ("enable", "disable")


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

    def problem(self) -> str | None:
        """Why these settings cannot run (naming the input), or None. NaN fails every range check here."""
        if self.bits_error():
            return self.bits_error()
        for name in ("conv_mse_threshold", "linear_mse_threshold"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                return f"{name}={value} is outside the allowed range 0..1"
        if not self.compute_density_threshold >= 0:
            return f"compute_density_threshold={self.compute_density_threshold} must be >= 0"
        return None

    def validate(self) -> None:
        if self.problem():
            raise ValueError(self.problem())

    def threshold_for(self, kind: str) -> float:
        return self.conv_mse_threshold if kind == "conv" else self.linear_mse_threshold

    def kind_enabled(self, kind: str) -> bool:
        enabled = self.quantize_conv if kind == "conv" else self.quantize_linear
        return enabled and self.threshold_for(kind) > 0.0

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def settings_from_widgets(bits: int = 8, quantize_conv: str = "enable", quantize_linear: str = "enable",
                          conv_mse_threshold: float = 0.1, linear_mse_threshold: float = 0.1,
                          compute_density_threshold: int = 300) -> QuantizeSettings:
    for name, value in (("quantize_conv", quantize_conv), ("quantize_linear", quantize_linear)):
        if value not in ENABLE:
            raise ValueError(f"{name} must be 'enable' or 'disable', not {value!r}")
    settings = QuantizeSettings(bits=int(bits), quantize_conv=quantize_conv == "enable",
                                quantize_linear=quantize_linear == "enable",
                                conv_mse_threshold=float(conv_mse_threshold),
                                linear_mse_threshold=float(linear_mse_threshold),
                                compute_density_threshold=int(compute_density_threshold))
    settings.validate()
    return settings
