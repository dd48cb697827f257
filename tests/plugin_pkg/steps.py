"""Custom decoder ``r8_test`` (a tiny raw 8-bit format) and custom step ``posterize_test``.

The ``.r8`` format: b"R8", then height and width as little-endian uint16, then H*W
bytes. Both classes use only the public plugin API (:mod:`precompile.plugins`).
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np
from pydantic import Field

from precompile.decoders import Decoder, DecoderParams
from precompile.errors import DecodeError
from precompile.plugins import register_decoder, register_step
from precompile.sample import FieldSpec
from precompile.transforms import Step, StepParams


def write_r8(path, arr: np.ndarray) -> None:
    arr = np.asarray(arr, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(b"R8" + struct.pack("<HH", *arr.shape) + arr.tobytes())


@register_decoder()
class R8Decoder(Decoder):
    """A ``.r8`` file -> (H, W, 1) uint8 image."""

    name = "r8_test"
    kind = "image"

    class Params(DecoderParams):
        invert: bool = False

    def spec(self) -> FieldSpec:
        return FieldSpec("image", (None, None, 1), "uint8")

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 6 or data[:2] != b"R8":
            raise DecodeError("not an r8 file (no 'R8' magic)")
        h, w = struct.unpack("<HH", data[2:6])
        if len(data) != 6 + h * w:
            raise DecodeError(f"truncated: {len(data) - 6} pixel bytes for {h}x{w}")
        arr = np.frombuffer(data, np.uint8, offset=6).reshape(h, w, 1)
        return (255 - arr if self.params.invert else arr.copy()), {"r8_size": [h, w]}


@register_step()
class PosterizeTest(Step):
    """Keep the top ``bits`` bits of every uint8 pixel (images)."""

    name = "posterize_test"
    kinds = frozenset({"image"})

    class Params(StepParams):
        bits: int = Field(4, ge=1, le=8)

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        if spec.dtype != "uint8":
            raise ValueError(f"posterize_test needs uint8 images, got {spec.dtype}")
        return spec

    def apply(self, array: np.ndarray, kind: str, **params: Any) -> np.ndarray:
        keep = 8 - self.params.bits
        return (array >> keep) << keep
