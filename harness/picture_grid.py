"""Labelled grids of small pictures, drawn with Pillow: one column per variant, rows grouped in sections, each
picture upscaled with nearest-neighbour (so a 32x32 sample shows its pixels instead of a blur) with a caption
under it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

BACKGROUND, INK, MUTED = (255, 255, 255), (30, 30, 30), (100, 100, 100)
MARGIN, GAP = 12, 8
ROW_LABEL_WIDTH = 76
TITLE_SIZE, LABEL_SIZE, CAPTION_SIZE = 16, 14, 13


@dataclass
class GridSection:
    """A block of rows under one heading: `pictures[row][column]` are uint8 HxWx3 arrays of one size, and
    `captions[row][column]` the text under each."""

    heading: str
    row_labels: list[str]
    pictures: list[list[np.ndarray]]
    captions: list[list[str]]


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size)


def _line_height(font: ImageFont.ImageFont) -> int:
    top, bottom = font.getbbox("Ag")[1::2]
    return bottom - top + 4


def labelled_grid(title: str, column_labels: list[str], sections: list[GridSection], scale: int = 4,
                  footer: str = "") -> Image.Image:
    """The grid as one RGB image: `title` on top, `column_labels` over the columns, then each section's heading
    and rows, and `footer` at the bottom (each of these split into lines on "\\n")."""
    if not sections or not sections[0].pictures:
        raise ValueError("a grid needs at least one section with one row")
    height, width = sections[0].pictures[0][0].shape[:2]
    cell_w, cell_h = width * scale, height * scale
    columns = len(column_labels)
    for section in sections:
        if any(len(row) != columns for row in section.pictures + section.captions):
            raise ValueError(f"{section.heading}: every row needs {columns} pictures and captions")
        if any(picture.shape[:2] != (height, width) for row in section.pictures for picture in row):
            raise ValueError(f"{section.heading}: pictures of different sizes")
    title_font, label_font, caption_font = _font(TITLE_SIZE), _font(LABEL_SIZE), _font(CAPTION_SIZE)
    title_h, label_h, caption_h = _line_height(title_font), _line_height(label_font), _line_height(caption_font)
    title_lines = title.split("\n")
    header_lines = max(label.count("\n") + 1 for label in column_labels)
    footer_lines = footer.split("\n") if footer else []
    row_h = cell_h + caption_h + GAP
    total_w = MARGIN * 2 + ROW_LABEL_WIDTH + columns * (cell_w + GAP) - GAP
    total_h = (MARGIN + len(title_lines) * title_h + GAP + header_lines * label_h
               + sum(GAP + label_h + len(section.pictures) * row_h for section in sections)
               + len(footer_lines) * caption_h + MARGIN)

    image = Image.new("RGB", (total_w, total_h), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(title_lines):
        draw.text((MARGIN, MARGIN + i * title_h), line, fill=INK, font=title_font)
    y = MARGIN + len(title_lines) * title_h + GAP

    def column_x(column: int) -> int:
        return MARGIN + ROW_LABEL_WIDTH + column * (cell_w + GAP)

    for column, label in enumerate(column_labels):
        for i, line in enumerate(label.split("\n")):
            draw.text((column_x(column) + cell_w / 2, y + i * label_h), line, fill=INK if i == 0 else MUTED,
                      font=label_font, anchor="ma")
    y += header_lines * label_h
    for section in sections:
        y += GAP
        draw.text((MARGIN, y), section.heading, fill=INK, font=label_font)
        y += label_h
        for label, pictures, captions in zip(section.row_labels, section.pictures, section.captions, strict=True):
            draw.text((MARGIN, y + cell_h / 2), label, fill=MUTED, font=caption_font, anchor="lm")
            for column, (picture, caption) in enumerate(zip(pictures, captions, strict=True)):
                cell = Image.fromarray(picture, "RGB").resize((cell_w, cell_h), Image.NEAREST)
                image.paste(cell, (column_x(column), y))
                draw.text((column_x(column) + cell_w / 2, y + cell_h + 2), caption, fill=INK, font=caption_font,
                          anchor="ma")
            y += row_h
    for line in footer_lines:
        draw.text((MARGIN, y), line, fill=MUTED, font=caption_font)
        y += caption_h
    return image
