"""``format: png``: one uncompressed PNG per sample and image field (uint8 gray, gray+alpha, RGB,
RGBA; uint16 gray, RGB, RGBA).

PNG is written by Pillow with ``compress_level=0`` (stored zlib blocks: the
file is the raw pixels plus one filter byte per row and a few dozen bytes),
except uint16 with 3 or 4 channels, which Pillow cannot write: OpenCV writes
those, with ``IMWRITE_PNG_COMPRESSION 0``. Reading is
:func:`precompile.formats.image.read_image_file`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..registry import WRITERS
from ..sample import Sample
from .image import ImageFolderFormat


@WRITERS.register()
class PngFormat(ImageFolderFormat):
    name = "png"
    label = "PNG"
    file_ext = ".png"
    allowed = {"uint8": (1, 2, 3, 4), "uint16": (1, 3, 4)}

    def write_file(self, path: str, field: str, array: np.ndarray, sample: Sample, options: Any) -> np.ndarray:
        write_png(path, array)
        return array


def write_png(path: str, array: np.ndarray) -> None:
    """An uncompressed (zlib level 0) PNG of a (H, W) or (H, W, C) uint8/uint16 array."""
    a = array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16 and a.ndim == 3:
        import cv2

        bgr = a[..., [2, 1, 0]] if a.shape[2] == 3 else a[..., [2, 1, 0, 3]]
        if not cv2.imwrite(path, np.ascontiguousarray(bgr), [cv2.IMWRITE_PNG_COMPRESSION, 0]):
            raise OSError(f"{path}: OpenCV could not write the PNG")
        return
    from PIL import Image

    Image.fromarray(a).save(path, format="PNG", compress_level=0)
