"""Middlebury ``.flo`` optical flow: a strict reader, a writer, and a binary-mask decoder.

Layout: float32 magic 202021.25, int32 width, int32 height, then height x
width x 2 float32 (u, v), little-endian, row-major. The reader checks the
magic, that the dimensions are sane and that the file length is exactly what
they imply; values whose magnitude exceeds 1e9 (Middlebury's "unknown") and
non-finite values become NaN, and the decoder can emit a ``<field>_valid``
uint8 ``flow_valid`` field beside the flow (derived from it, so it follows the flow
through every step). ``flow_mask`` reads an image (e.g. Sintel's
invalid/occlusion PNGs) as a binary (H, W, 1) uint8 mask.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import DecodeError
from ..kinds import Kind, flow_validity
from ..registry import DECODERS
from ..sample import FieldSpec
from .base import Decoder, DecoderParams

MAGIC = np.float32(202021.25)
UNKNOWN = 1e9
MAX_SIDE = 1 << 15     # 32768 pixels a side: anything larger is a corrupt header
HEADER = 12


def read_flo(path: str) -> np.ndarray:
    """Read a ``.flo`` file into an (H, W, 2) float32 array with NaN for unknown flow."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER)
            if len(head) < HEADER:
                raise DecodeError(f"not a .flo file: {len(head)} bytes, shorter than the 12-byte header", path=path)
            magic = np.frombuffer(head, "<f4", 1, 0)[0]
            if magic != MAGIC:
                raise DecodeError(f"not a .flo file: magic {float(magic)!r}, expected 202021.25", path=path)
            w, h = (int(x) for x in np.frombuffer(head, "<i4", 2, 4))
            if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE):
                raise DecodeError(f"corrupt .flo header: absurd size {w}x{h} (width x height)", path=path)
            need = HEADER + w * h * 2 * 4
            if size != need:
                raise DecodeError(f"corrupt .flo file: header says {w}x{h} ({need} bytes) but the file has "
                                  f"{size} bytes" + (" (truncated)" if size < need else ""), path=path)
            data = np.frombuffer(f.read(need - HEADER), "<f4")
    except FileNotFoundError:
        raise DecodeError("file not found", path=path) from None
    except IsADirectoryError:
        raise DecodeError("is a folder, not a .flo file", path=path) from None
    except OSError as e:
        raise DecodeError(f"cannot read: {e.strerror or e}", path=path) from None
    if data.size != w * h * 2:
        raise DecodeError("file changed size while being read", path=path)
    flow = data.reshape(h, w, 2).astype(np.float32)  # native-endian copy
    bad = ~np.isfinite(flow) | (np.abs(flow) > UNKNOWN)
    bad = bad.any(axis=-1)
    if bad.any():
        flow[bad] = np.nan
    return flow


def write_flo(path: str, flow: np.ndarray) -> None:
    """Write an (H, W, 2) flow as ``.flo``; NaN (invalid) is stored as 1e10 (Middlebury's unknown)."""
    flow = np.asarray(flow)
    if flow.ndim != 3 or flow.shape[-1] != 2 or flow.shape[0] < 1 or flow.shape[1] < 1:
        raise ValueError(f"flow must be (H, W, 2), got {flow.shape}")
    h, w = flow.shape[:2]
    out = np.where(np.isfinite(flow), flow, np.float32(1e10)).astype("<f4")
    with open(path, "wb") as f:
        f.write(np.array([MAGIC], "<f4").tobytes())
        f.write(np.array([w, h], "<i4").tobytes())
        f.write(out.tobytes())


@DECODERS.register()
class FloDecoder(Decoder):
    """Middlebury ``.flo`` -> (H, W, 2) float32 flow, NaN where unknown (``valid_mask`` adds ``<field>_valid``)."""

    name = "flo"
    kind = "flow"

    class Params(DecoderParams):
        valid_mask: bool = False   # also output <field>_valid: (H, W, 1) uint8, 1 where the flow is known

    def output_specs(self, field: str) -> dict[str, FieldSpec]:
        out = {field: FieldSpec("flow", (None, None, 2), "float32")}
        if self.params.valid_mask:
            out[f"{field}_valid"] = FieldSpec(Kind.FLOW_VALID, (None, None, 1), "uint8", of=field)
        return out

    def decode(self, path: str, field: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        flow = read_flo(path)
        out = {field: flow}
        valid = flow_validity(flow)
        if self.params.valid_mask:
            out[f"{field}_valid"] = valid
        return out, {"invalid": int(valid.size - np.count_nonzero(valid))}


@DECODERS.register()
class FlowMaskDecoder(Decoder):
    """An image read as a binary mask: (H, W, 1) uint8, 1 where the pixel is non-zero (``invert`` flips it)."""

    name = "flow_mask"
    kind = "mask"
    output_version = 2   # 2: a JPEG libjpeg warns about (a scan cut short) is an error, no longer stored

    class Params(DecoderParams):
        invert: bool = False       # 1 where the pixel is zero (e.g. turn an 'invalid' map into a valid mask)

    def spec(self) -> FieldSpec:
        return FieldSpec("mask", (None, None, 1), "uint8")

    def read(self, path: str) -> np.ndarray:
        from .image import decode_image_file

        g = decode_image_file(path, "gray8", exif_transpose=False, budget=self.max_bytes)
        m = g > 0
        if self.params.invert:
            m = ~m
        return m.astype(np.uint8)
