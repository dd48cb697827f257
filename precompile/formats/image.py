"""What the image-file formats (png, bmp) share: which fields become image files, and reading them back.

Image and mask fields become one file per sample; label ids go into the JSON
index; anything else goes into a companion ``.npy`` per shard (or the recipe
is refused, as ``output.options.extra_fields`` says). What a format cannot
store is refused at plan time with the field's name, from the format's
``allowed`` table (dtype -> channel counts).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import FormatError
from ..kinds import Kind, kinds
from ..sample import FieldSpec
from .folder import FolderFormat

IMAGE_KINDS = kinds(Kind.IMAGE, Kind.MASK, Kind.FLOW_VALID)   # (H, W, C) grids of pixels or class ids


def _channels(spec: FieldSpec) -> int | None:
    if len(spec.shape) == 2:
        return 1
    if len(spec.shape) == 3:
        return spec.shape[2]
    return -1


class ImageFolderFormat(FolderFormat):
    """A folder format of image files: one per sample and image field."""

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

    @classmethod
    def read_file(cls, path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
        return read_image_file(path, dtype, shape)


def read_image_file(path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A PNG or BMP written by precompile, as an array of ``shape`` and ``dtype``."""
    if np.dtype(dtype) == np.uint16 and len(shape) == 3 and shape[2] in (3, 4):
        import cv2

        a = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        if a is None:
            raise FormatError(f"{path}: OpenCV cannot read this image")
        a = a[..., [2, 1, 0]] if shape[2] == 3 else a[..., [2, 1, 0, 3]]
    else:
        from PIL import Image

        try:
            with Image.open(path) as img:
                a = np.asarray(img)
        except OSError as e:
            raise FormatError(f"{path}: cannot read image: {e}") from None
    a = np.ascontiguousarray(a).astype(dtype, copy=False)
    if not a.flags.writeable:   # numpy over Pillow's bytes: read-only, unlike every other field a reader gives
        a = a.copy()
    if a.size != int(np.prod(shape)):
        raise FormatError(f"{path}: holds {a.shape}, the index says {tuple(shape)}")
    return a.reshape(tuple(shape))
