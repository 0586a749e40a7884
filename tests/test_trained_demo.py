"""The picture `make demo` draws (harness/trained_demo.py): the shipped nodes on a trained model, one column per
variant, each sample upscaled in its cell and labelled with its PSNR against plain."""

from __future__ import annotations

import math

import numpy as np

from harness import picture_grid
from harness import trained_demo as td


def _find_rows(strip: np.ndarray, block: np.ndarray) -> list[int]:
    """The y offsets where `block` appears exactly in the column `strip` (both HxWx3, same width)."""
    return [y for y in range(strip.shape[0] - block.shape[0] + 1)
            if np.array_equal(strip[y:y + block.shape[0]], block)]


def test_the_demo_picture_shows_each_variant_of_a_trained_model_in_its_column(pack):
    """Flux-family model, 2 seeds, 6 steps: the INT8 columns really ran the INT8 arithmetic and plain and
    DeepCache alone did not; INT8 stays close to plain, DeepCache's cached steps change the picture; the grid
    has one 4x nearest-neighbour cell per variant and seed, each in its variant's column, top to bottom."""
    run = td.run_family("flux", seeds=[1, 2], steps=6)

    assert run.int8_path_calls("INT8") > 0 and run.int8_path_calls("full stack") > 0, run.int8_calls
    assert all(run.int8_path_calls(v) == 0 for v in ("plain", "DeepCache reuse", "DeepCache forecast"))
    for row in range(2):
        assert 40 < run.psnr("INT8", row) < math.inf
        assert 20 < run.psnr("full stack", row) < math.inf
        assert 20 < run.psnr("DeepCache reuse", row) < math.inf

    image = np.asarray(td.demo_picture([run]))
    cell = 32 * td.SCALE
    columns = len(td.VARIANTS)
    margin, gap, label_width = picture_grid.MARGIN, picture_grid.GAP, picture_grid.ROW_LABEL_WIDTH
    assert image.shape[1] == 2 * margin + label_width + columns * (cell + gap) - gap
    for column, variant in enumerate(td.VARIANTS):
        x = margin + label_width + column * (cell + gap)
        strip = image[:, x:x + cell]
        found = [_find_rows(strip, np.repeat(np.repeat(td.to_uint8(picture), td.SCALE, 0), td.SCALE, 1))
                 for picture in run.pictures[variant]]
        assert all(found), f"{variant}: a sample is missing from its column"
        assert found[0][0] < found[1][0], f"{variant}: the seeds' rows are out of order"
