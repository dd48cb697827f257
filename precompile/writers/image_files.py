"""Image-file shards: ``format: png`` (zlib level 0, 8 or 16 bits) and ``format: bmp`` (8 bits).

Image and mask fields become one file per sample; label ids go into the JSON
index; anything else goes into a companion ``.npy`` per shard (or the recipe
is refused, as ``output.options.extra_fields`` says). What a format cannot
store is refused at plan time with the field's name: BMP holds uint8 gray or
RGB only (no 16 bits, no alpha that readers keep); PNG holds uint8 gray,
gray+alpha, RGB, RGBA and uint16 gray, RGB, RGBA.

PNG is written by Pillow with ``compress_level=0`` (stored zlib blocks: the
file is the raw pixels plus one filter byte per row and a few dozen bytes),
except uint16 with 3 or 4 channels, which Pillow cannot write: OpenCV writes
those, with ``IMWRITE_PNG_COMPRESSION 0``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kinds import Kind, kinds
from ..registry import WRITERS
from ..sample import FieldSpec, Sample
from .base import FolderWriter

IMAGE_KINDS = kinds(Kind.IMAGE, Kind.MASK, Kind.FLOW_VALID)   # (H, W, C) grids of pixels or class ids


def _channels(spec: FieldSpec) -> int | None:
    if len(spec.shape) == 2:
        return 1
    if len(spec.shape) == 3:
        return spec.shape[2]
    return -1


class _ImageFiles(FolderWriter):
    allowed: dict[str, tuple[int, ...]]     # dtype -> channel counts

    def file_field(self, name: str, spec: FieldSpec) -> bool:
        if spec.kind not in IMAGE_KINDS:
            return False
        c = _channels(spec)
        ok = self.allowed.get(spec.dtype, ())
        if c == -1 or c is None or c not in ok:
            can = "; ".join(f"{dt} with {' or '.join(map(str, cs))} channel(s)" for dt, cs in self.allowed.items())
            why = ("the channel count must be known at plan time" if c is None else
                   f"it is {spec.describe()}")
            hint = " (use format png, which keeps 16 bits, or hdf5)" if self.name == "bmp" and spec.dtype == "uint16" else ""
            raise ValueError(f"field {name!r} cannot be stored as {self.label}: {why}; {self.label} holds "
                             f"(H, W) or (H, W, C) images of {can}{hint}")
        return True


@WRITERS.register()
class PngWriter(_ImageFiles):
    name = "png"
    label = "PNG"
    file_ext = ".png"
    allowed = {"uint8": (1, 2, 3, 4), "uint16": (1, 3, 4)}

    def write_file(self, path: str, field: str, array: np.ndarray, sample: Sample, options: Any) -> np.ndarray:
        write_png(path, array)
        return array


@WRITERS.register()
class BmpWriter(_ImageFiles):
    name = "bmp"
    label = "BMP"
    file_ext = ".bmp"
    allowed = {"uint8": (1, 3)}

    def write_file(self, path: str, field: str, array: np.ndarray, sample: Sample, options: Any) -> np.ndarray:
        from PIL import Image

        a = array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array
        Image.fromarray(np.ascontiguousarray(a)).save(path, format="BMP")
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
