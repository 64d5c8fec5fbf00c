"""Real photos of several shapes, made from the ones scikit-image ships: what fidelity is
judged on, in the tests and in ``python -m benchmarks agreement``."""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np
from PIL import Image


@functools.cache
def photos() -> tuple[bytes, ...]:
    """Two photos of each of five shapes, as PNG (a reference decodes exactly what the server
    decodes): landscape 3:2 (coffee), near 3:2 of odd sides (the cat), square (the
    astronaut), portrait 2:3 (coffee turned) and a wide 16:5 strip (of the rocket); the second
    of each its mirror image, so that equal shapes share batches and still answer
    differently."""
    import skimage.data

    data: Any = skimage.data  # untyped
    arrays = [data.coffee(), data.chelsea(), data.astronaut()]
    arrays.append(np.ascontiguousarray(np.rot90(data.coffee())))  # 600 x 400
    arrays.append(data.rocket()[120:320])  # 200 x 640
    shots = []
    for array in arrays:
        for picture in (array, array[:, ::-1]):
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(picture)).save(buffer, "PNG")
            shots.append(buffer.getvalue())
    return tuple(shots)


def shapes() -> int:
    """How many shapes the photos come in."""
    return len(photos()) // 2
