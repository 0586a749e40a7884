"""The calibration decisions and reports on disk, so a restart or another prompt skips calibration."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .calibration import CACHE_FORMAT_VERSION, CalibrationResult
from .environment import cache_dir_override
from .settings import QuantizeSettings

log = logging.getLogger("int8_accel.int8")


def cache_dir() -> Path:
    override = cache_dir_override()
    if override is not None:
        return override
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


def save_result(result: CalibrationResult, fingerprint: str, settings: QuantizeSettings) -> None:
    _report_generations[settings.key()] = report_generation(settings) + 1
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(result.to_json(), indent=1)
        tmp = directory / f".{result.key}.{os.getpid()}.tmp"
        tmp.write_text(payload)
        tmp.replace(directory / f"{result.key}.json")
        (directory / f"last-{_report_key(fingerprint, settings)}.txt").write_text(result.key)
    except OSError as exc:
        log.warning("int8-accel: could not write the calibration cache in %s (%s)", directory, exc)


def load_last_result(fingerprint: str, settings: QuantizeSettings) -> CalibrationResult | None:
    """The latest calibration of these weights, patches and settings (any latent size), shown by the next run."""
    try:
        key = (cache_dir() / f"last-{_report_key(fingerprint, settings)}.txt").read_text().strip()
    except OSError:
        return None
    return load_result(key)


def _report_key(fingerprint: str, settings: QuantizeSettings) -> str:
    return hashlib.sha256((fingerprint + settings.key()).encode()).hexdigest()[:32]
