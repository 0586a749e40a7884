"""The decision picture for ComfyUI's Preview Image (an IMAGE tensor): each layer's normalized error against its compute
density on log axes, coloured by its decision, thresholds drawn. Drawn with Pillow, which ComfyUI ships."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from .calibration import FLOAT_BY_GATE, INT8, CalibrationResult
from .settings import QuantizeSettings

SIZE = (768, 512)  # width, height: fixed, whatever the model
PLOT = (96, 74, SIZE[0] - 24, SIZE[1] - 92)  # left, top, right, bottom of the axes box
UNMEASURED_Y = SIZE[1] - 58  # the strip below the axes for layers whose error was not measured
BACKGROUND, INK, GRID = (255, 255, 255), (30, 30, 30), (225, 225, 225)
# (decision, legend label, colour), drawn in order so INT8 points stay on top; float labels name the deciding gate.
DECISIONS = (
    (FLOAT_BY_GATE["kind"], "kind", (170, 170, 170)),
    (FLOAT_BY_GATE["density"], "density", (120, 144, 200)),
    (FLOAT_BY_GATE["kernel size floor"], "kernel size floor", (150, 100, 190)),
    (FLOAT_BY_GATE["speed"], "speed", (240, 150, 30)),
    (FLOAT_BY_GATE["error"], "error", (214, 39, 40)),
    (FLOAT_BY_GATE["model error"], "whole-model guard", (140, 20, 20)),
    (INT8, "INT8", (30, 150, 60)),
)
THRESHOLD_COLOUR = (90, 90, 90)
MIN_ERROR = 1e-12


def _log_range(values: list[float]) -> tuple[float, float]:
    low, high = math.log10(min(values)), math.log10(max(values))
    if high - low < 1:
        low, high = (low + high) / 2 - 0.5, (low + high) / 2 + 0.5
    pad = 0.05 * (high - low)
    return low - pad, high + pad


def _ticks(log_low: float, log_high: float) -> list[float]:
    steps = (1, 2, 5) if log_high - log_low < 2.5 else (1,)
    return [step * 10.0**exponent for exponent in range(math.floor(log_low), math.ceil(log_high) + 1)
            for step in steps if log_low <= math.log10(step * 10.0**exponent) <= log_high]


def _wrap(text: str, font, width: int, draw: ImageDraw.ImageDraw, max_lines: int) -> list[str]:
    lines, current = [], ""
    for word in text.split(" "):
        trial = f"{current} {word}".strip()
        if current and draw.textlength(trial, font=font) > width:
            lines.append(current)
            current = word
        else:
            current = trial
    lines.append(current)
    return lines[:max_lines]


def _dashed(draw: ImageDraw.ImageDraw, start: tuple[float, float], end: tuple[float, float]) -> None:
    (x0, y0), (x1, y1) = start, end
    length = math.hypot(x1 - x0, y1 - y0)
    for i in range(0, int(length), 10):
        t0, t1 = i / length, min(i + 6, length) / length
        draw.line([(x0 + (x1 - x0) * t0, y0 + (y1 - y0) * t0), (x0 + (x1 - x0) * t1, y0 + (y1 - y0) * t1)],
                  fill=THRESHOLD_COLOUR, width=2)


def to_image_tensor(image: Image.Image) -> torch.Tensor:
    """A Pillow RGB image as ComfyUI's IMAGE: float32 [1, height, width, 3] in 0..1."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)[None]


def message_picture(text: str) -> torch.Tensor:
    """A picture of the same size holding only `text` (before the first calibration, or nothing to quantize)."""
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(18)
    lines = _wrap(text, font, SIZE[0] - 80, draw, max_lines=8)
    for i, line in enumerate(lines):
        draw.text((40, SIZE[1] // 2 - 14 * len(lines) + 28 * i), line, fill=INK, font=font)
    return to_image_tensor(image)


def decision_picture(result: CalibrationResult, settings: QuantizeSettings, title: str) -> torch.Tensor:
    """The decision of `result` (made with `settings`) as an IMAGE tensor of SIZE, `title` on top."""
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    small, label = ImageFont.load_default(12), ImageFont.load_default(14)
    left, top, right, bottom = PLOT

    densities = [max(layer.density, MIN_ERROR) for layer in result.layers] or [1.0]
    if settings.compute_density_threshold > 0:
        densities.append(settings.compute_density_threshold)
    thresholds = sorted({settings.threshold_for(kind) for kind in ("conv", "linear") if settings.kind_enabled(kind)})
    errors = [max(layer.error, MIN_ERROR) for layer in result.layers if layer.error is not None]
    errors += [t for t in thresholds if t > 0] or ([] if errors else [1e-3, 1e-1])
    x_low, x_high = _log_range(densities)
    y_low, y_high = _log_range(errors)

    def px(density: float) -> float:
        return left + (math.log10(max(density, MIN_ERROR)) - x_low) / (x_high - x_low) * (right - left)

    def py(error: float) -> float:
        return bottom - (math.log10(max(error, MIN_ERROR)) - y_low) / (y_high - y_low) * (bottom - top)

    for density in _ticks(x_low, x_high):
        x = px(density)
        draw.line([(x, top), (x, bottom)], fill=GRID)
        draw.text((x, bottom + 4), f"{density:g}", fill=INK, font=small, anchor="ma")
    for error in _ticks(y_low, y_high):
        y = py(error)
        draw.line([(left, y), (right, y)], fill=GRID)
        draw.text((left - 6, y), f"{error:.0e}", fill=INK, font=small, anchor="rm")
    draw.rectangle([left, top, right, bottom], outline=INK)
    draw.text(((left + right) / 2, bottom + 20), "compute density (log)", fill=INK, font=label, anchor="ma")
    y_label = Image.new("RGB", (int(bottom - top), 20), BACKGROUND)
    ImageDraw.Draw(y_label).text((y_label.width / 2, 10), "norm. MSE (log)", fill=INK, font=label, anchor="mm")
    image.paste(y_label.rotate(90, expand=True), (8, top))
    draw.text((left - 6, UNMEASURED_Y), "no error:", fill=INK, font=small, anchor="rb")
    draw.text((left - 6, UNMEASURED_Y), "not measured", fill=INK, font=small, anchor="rt")

    if settings.compute_density_threshold > 0:
        x = px(settings.compute_density_threshold)
        _dashed(draw, (x, top), (x, UNMEASURED_Y + 8))
        draw.text((x + 4, top + 2), f"density {settings.compute_density_threshold}", fill=THRESHOLD_COLOUR, font=small)
    for threshold in thresholds:
        if threshold <= 0:
            continue
        kinds = "/".join(kind for kind in ("conv", "linear")
                         if settings.kind_enabled(kind) and settings.threshold_for(kind) == threshold)
        y = py(threshold)
        _dashed(draw, (left, y), (right, y))
        draw.text((right - 4, y - 3), f"{kinds} error {threshold:g}", fill=THRESHOLD_COLOUR, font=small, anchor="rb")

    for decision, _, colour in DECISIONS:
        for layer in result.layers:
            if layer.decision != decision:
                continue
            x = px(layer.density)
            y = UNMEASURED_Y if layer.error is None else py(layer.error)
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour, outline=INK if decision == INT8 else None)

    legend_x = 12.0
    int8_entry, float_entries = DECISIONS[-1], DECISIONS[:-1]
    for i, (decision, name, colour) in enumerate((int8_entry, *float_entries)):
        if i == 1:
            draw.text((legend_x, SIZE[1] - 15), "float by:", fill=INK, font=label, anchor="lm")
            legend_x += 8 + draw.textlength("float by:", font=label)
        count = sum(1 for layer in result.layers if layer.decision == decision)
        text = f"{name} {count}"
        draw.ellipse([legend_x, SIZE[1] - 20, legend_x + 10, SIZE[1] - 10], fill=colour)
        draw.text((legend_x + 14, SIZE[1] - 15), text, fill=INK, font=label, anchor="lm")
        legend_x += 24 + draw.textlength(text, font=label)

    for i, line in enumerate(_wrap(title, label, SIZE[0] - 24, draw, max_lines=3)):
        draw.text((12, 8 + 19 * i), line, fill=INK, font=label)
    return to_image_tensor(image)


def node_picture(plan, report: str) -> torch.Tensor:
    """The node's picture: the decision its report describes, else the report's text; `plan`: its Int8Plan or None."""
    from .report import summary_line

    result = getattr(plan, "shown_result", None)
    if result is None:
        return message_picture(report)
    return decision_picture(result, plan.settings, summary_line(result, from_cache=True))
