"""The DeepCache node's settings, as one immutable value: their ranges checked together, naming the input."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheMode(enum.Enum):
    """What a cached step puts in place of the deep features."""

    REUSE = "reuse"  # the value of the last full step
    FORECAST = "forecast"  # a second-order extrapolation from the last full steps

    @property
    def order(self) -> int:
        return 2 if self is CacheMode.FORECAST else 0


@dataclass(frozen=True)
class DeepCacheSettings:
    cache_interval: int
    cache_depth: int
    start_percent: float
    end_percent: float
    cache_mode: CacheMode = CacheMode.REUSE

    def problem(self) -> str | None:
        """Why these settings cannot run, naming the input, or None (NaN fails every range check here). How deep
        a model allows caching is known only once the model is: `apply_deepcache` checks cache_depth then."""
        if not self.cache_interval >= 1:
            return f"cache_interval={self.cache_interval} must be at least 1"
        if not self.cache_depth >= 1:
            return f"cache_depth={self.cache_depth} must be at least 1"
        if not 0.0 <= self.start_percent < self.end_percent <= 1.0:
            return (f"start_percent={self.start_percent} must be smaller than end_percent={self.end_percent}, "
                    "both within 0..1")
        return None
