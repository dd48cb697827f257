"""Multi-class label maps: the ``mask`` decoder.

A segmentation mask is an image whose values are class ids, not colours. The
decoder reads the stored values as they are (8- or 16-bit grey, palette
indices, 1-bit), refuses colour images, and gives an (H, W, 1) ``mask`` field,
which every step moves by nearest neighbour only: no value is ever invented.
``classes`` lists the ids the masks may hold (any other value is a decode
error naming the file and the values); ``remap: true`` stores each id's
position in that list instead (contiguous ids for a loss). ``max_label`` is the
looser check. The plan records the class count (and the ids, when they are not
``0 .. count - 1``) in the field's spec; ``precompile stats`` lists exactly those.
"""
from __future__ import annotations

from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from ..errors import DecodeError
from ..kinds import Kind
from ..registry import DECODERS
from ..sample import FieldSpec
from .base import Decoder, DecoderParams
from .image import decode_image_file


@DECODERS.register()
class MaskDecoder(Decoder):
    """A label map (PNG, BMP, TIFF, ...) -> (H, W, 1) uint8/uint16 class ids, values as stored."""

    name = "mask"
    kind = Kind.MASK
    output_version = 2   # 2: a JPEG label map libjpeg warns about (a scan cut short) is an error, no longer stored

    class Params(DecoderParams):
        classes: Optional[list[int]] = None     # the ids masks may hold (in order, for remap)
        max_label: Optional[int] = None         # or: ids must be <= this
        remap: bool = False                     # store the position of each id in classes
        dtype: Literal["uint8", "uint16"] = Field("uint8", description="the stored integer type of class ids")
        exif_transpose: bool = True             # follow EXIF orientation, as the image decoder does

        @model_validator(mode="after")
        def _v(self):
            if self.classes is not None:
                if not self.classes or len(set(self.classes)) != len(self.classes) or min(self.classes) < 0:
                    raise ValueError("classes must be distinct non-negative ids")
                if self.max_label is not None:
                    raise ValueError("give classes or max_label, not both")
            if self.remap and self.classes is None:
                raise ValueError("remap needs classes")
            if self.max_label is not None and self.max_label < 0:
                raise ValueError("max_label must be non-negative")
            top = (len(self.classes) - 1 if self.remap else max(self.classes)) if self.classes else self.max_label
            if top is not None and top > np.iinfo(self.dtype).max:
                raise ValueError(f"{'max_label' if self.classes is None else 'classes'}: label {top} does not fit "
                                 f"{self.dtype}")
            return self

    def num_classes(self) -> int | None:
        """How many classes the masks may hold: the declared ids (``classes``), or ``0 .. max_label``."""
        p = self.params
        if p.classes is not None:
            return len(p.classes)
        return None if p.max_label is None else p.max_label + 1

    def class_ids(self) -> tuple[int, ...] | None:
        """The stored ids when they are not ``0 .. num_classes - 1``: the declared ``classes`` unless remapped."""
        p = self.params
        if p.classes is None or p.remap or sorted(p.classes) == list(range(len(p.classes))):
            return None
        return tuple(sorted(p.classes))

    def spec(self) -> FieldSpec:
        return FieldSpec(Kind.MASK, (None, None, 1), self.params.dtype, classes=self.num_classes(),
                         class_ids=self.class_ids())

    def read(self, path: str) -> tuple[np.ndarray, dict]:
        p = self.params
        a = decode_image_file(path, "label", p.exif_transpose, self.max_bytes)
        values = np.unique(a)
        if p.classes is not None:
            bad = np.setdiff1d(values, np.asarray(p.classes))
            if bad.size:
                raise DecodeError(f"label values {bad[:8].tolist()} are not in classes {p.classes}", path=path)
        elif p.max_label is not None and values.size and values[-1] > p.max_label:
            raise DecodeError(f"label value {int(values[-1])} is above max_label {p.max_label}", path=path)
        if p.remap:  # ids -> positions in classes (the validator checked they fit the dtype)
            lut = np.zeros(int(max(p.classes)) + 1, dtype=p.dtype)
            lut[np.asarray(p.classes)] = np.arange(len(p.classes), dtype=p.dtype)
            a = lut[a]
        elif values.size and values[-1] > np.iinfo(p.dtype).max:
            raise DecodeError(f"label value {int(values[-1])} does not fit {p.dtype} (set dtype: uint16)", path=path)
        return a.astype(p.dtype, copy=False), {"values": [int(v) for v in values]}
