"""``format: bmp``: one BMP per sample and image field, uint8 gray or RGB only (no 16 bits, no
alpha that readers keep). Written by Pillow; read by
:func:`precompile.formats.image.read_image_file`."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..registry import WRITERS
from ..sample import Sample
from .image import ImageFolderFormat


@WRITERS.register()
class BmpFormat(ImageFolderFormat):
    name = "bmp"
    label = "BMP"
    file_ext = ".bmp"
    allowed = {"uint8": (1, 3)}

    def write_file(self, path: str, field: str, array: np.ndarray, sample: Sample, options: Any) -> np.ndarray:
        from PIL import Image

        a = array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array
        Image.fromarray(np.ascontiguousarray(a)).save(path, format="BMP")
        return array
