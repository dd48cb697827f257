"""Image decoding: JPEGs through libjpeg-turbo in strict mode, every other format through Pillow.

Modes: ``rgb8`` (H, W, 3) uint8, ``gray8`` (H, W, 1) uint8, ``gray16`` (H, W, 1)
uint16, ``rgba8`` (H, W, 4) uint8. Palette, CMYK, grayscale, 16-bit and alpha
inputs are converted to the requested mode; a truncated or corrupt file is a
:class:`DecodeError` naming it (Pillow refuses truncated data; OpenCV would
silently return a grey image, which is why it is not the decoder here). A JPEG is
decoded by :mod:`.jpeg_strict` (simplejpeg): libjpeg only *warns* when a scan ends
early (an EOI marker after a cut), which Pillow ignores; there the warning is the
input's error. Its pixels are Pillow's, byte for byte, at every scale. A plain JPEG (8-bit Huffman,
1, 3 or 4 components, at most one APP1 block and that one EXIF) is not opened in Pillow at all: its
header is read by :func:`_plain_jpeg` (the orientation from the EXIF block, the size and colour space by
libjpeg-turbo), with the same checks, pixels and meta; every other file goes through Pillow.

``reduce`` decodes JPEGs at 1/2, 1/4 or 1/8 scale from their DCT coefficients
(libjpeg-turbo's scaled IDCT): ``auto`` (default) at the
smallest scale the following steps allow (see :mod:`.jpeg_reduce`), ``off`` at
full size, ``2 | 4 | 8`` at that scale (other formats are then area-resized to
the same ceil(H/k) x ceil(W/k), so every input comes out at 1/k). A reduced
JPEG covers exactly the source, as a full decode does, whatever its size (see
:func:`_cover_source`), or, where the recipe's first step on the field is a ``resize`` that takes it
(``SourceNeed.fold``), it is left as libjpeg decodes it and its meta records the source's part of it,
``{"extent": [H/k, W/k]}``, which that resize samples from in one resample (and removes). A sample decoded at a reduced scale records it in its
meta: ``{"reduce": k, "source_size": [h, w]}`` (the stored pixels' size); one turned
by its EXIF orientation (2..8) records the orientation applied: ``{"orientation": o}``
(annotations of the stored pixels, inputs/coco/, are moved by it). The build adds
each image's map back to the source (``to_source``, :mod:`precompile.transforms.source_map`).
"""
from __future__ import annotations

import os
import struct
import warnings
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import Field, field_validator

from ..errors import DecodeError
from ..registry import DECODERS
from ..sample import FieldSpec
from ..transforms.kernels.maps import EXTENT
from .base import DEFAULT_INPUT_BYTES, Decoder, DecoderParams, check_budget
from .jpeg_reduce import SourceNeed, reduced_size
from .jpeg_strict import TURBO_MODES, decode_jpeg_strict, turbo_scale_is

_JPEG = ("JPEG", "MPO")  # MPO: a camera JPEG with extra frames; Pillow decodes the first like a JPEG
MODES = {"rgb8": (3, "uint8"), "gray8": (1, "uint8"), "gray16": (1, "uint16"), "rgba8": (4, "uint8")}


#: formats whose 16-bit grey Pillow opens as mode I (32-bit integers): PGM/PPM with a maxval over 255 (and PNG before
#: Pillow 10.3); in any other format (a TIFF of 32-bit integers) mode I holds values of no known range
_SIXTEEN_AS_I = ("PPM", "PNG")


def _to_mode(img, mode: str, fmt: Optional[str] = None) -> np.ndarray:
    """Convert a loaded PIL image to the array layout of ``mode`` (``label``: see :func:`label_array`); ``fmt``:
    the file's format (Pillow's name), which says what a mode I image's values are."""
    from PIL import Image

    if mode == "label":
        return label_array(img)
    if img.mode in ("P", "PA"):
        img = img.convert("RGBA")  # resolve the palette (and its transparency) first
    src = img.mode
    if src == "I":   # 32-bit integers: kept only where they are 16-bit grey values, never clipped or guessed
        a = np.asarray(img)
        lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
        if lo < 0 or hi > 65535:
            raise ValueError(f"a 32-bit integer image with values {lo}..{hi}, which 16 bits cannot hold: convert it "
                             f"to 8 or 16 bits first")
        if mode != "gray16" and fmt not in _SIXTEEN_AS_I:
            raise ValueError(f"a 32-bit integer image ({fmt or 'unknown format'}, values {lo}..{hi}) has no known "
                             f"range to scale to 8 bits: use mode gray16 (its values kept) or convert it to 8 bits")
    if mode == "gray16":
        if src in ("I;16", "I;16B", "I;16L", "I"):
            return np.asarray(img).astype(np.uint16)[..., None]
        a = np.asarray(img.convert("L"), dtype=np.uint16) * 257
        return a[..., None]
    if src in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit gray to 8 bits: keep the top byte (no rescaling by the image's own range)
        a = (np.clip(np.asarray(img), 0, 65535).astype(np.uint16) >> 8).astype(np.uint8)
        img = Image.fromarray(a, mode="L")
    elif src == "F":
        raise ValueError("32-bit float images are not supported by the image decoder")
    if mode == "gray8":
        return np.asarray(img.convert("L"))[..., None]
    if mode == "rgb8":
        return np.asarray(img.convert("RGB"))  # alpha is dropped
    if mode == "rgba8":
        return np.asarray(img.convert("RGBA"))
    raise ValueError(f"unknown mode {mode!r}")


def label_array(img) -> np.ndarray:
    """The stored values of a one-channel image as (H, W, 1) integers, never converted through
    colour: palette indices (a VOC-style mask), 1/8/16-bit grey. Colour images are refused."""
    src = img.mode
    if src in ("PA", "LA"):
        src = src[0]
        img = img.getchannel(0)
    if src in ("P", "L", "1"):
        return np.asarray(img).astype(np.uint8)[..., None]
    if src in ("I;16", "I;16B", "I;16L"):
        return np.asarray(img).astype(np.uint16)[..., None]
    if src == "I":
        a = np.asarray(img)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise ValueError(f"label values {int(a.min())}..{int(a.max())} do not fit 16 bits")
        return a.astype(np.uint16)[..., None]
    raise ValueError(f"a {src} image is not a label map: masks need one channel of class ids (grey or palette); "
                     f"convert colour-coded masks to ids first")


@DECODERS.register()
class ImageDecoder(Decoder):
    """Any image Pillow reads (JPEG, PNG, BMP, PPM, TIFF, WebP, ...)."""

    name = "image"
    kind = "image"
    output_version = 4   # 2: a JPEG libjpeg warns about (a scan cut short) is an error, no longer stored grey;
    #                      3: the meta records the EXIF orientation applied ({"orientation": o});
    #                      4: the meta records the source's size when reduced ({"source_size": [h, w]}), and every
    #                      image sample its map back to the source (transforms/source_map.py: to_source)

    class Params(DecoderParams):
        mode: Literal["rgb8", "gray8", "gray16", "rgba8"] = Field(
            "rgb8", description="pixel layout: RGB, gray or RGBA in 8 bits, or gray in 16 bits")
        exif_transpose: bool = Field(True, description="follow the EXIF orientation tag")
        reduce: Union[Literal["auto", "off"], Literal[2, 4, 8]] = Field(
            "auto", description="JPEG: decode at 1/2, 1/4 or 1/8 scale (auto: the largest reduction that a "
            "following resize still covers; off: full size)")

        @field_validator("reduce", mode="before")
        @classmethod
        def _reduce(cls, v: Any) -> Any:
            if isinstance(v, bool):
                return "auto" if v else "off"  # YAML 1.1 reads a bare `off` as false, `on` as true
            if v == 1 or v == "1":
                return "off"
            if isinstance(v, str) and v.strip() in ("2", "4", "8"):
                return int(v)
            return v

    # set by the recipe (jpeg_reduce.configure) for reduce: auto: what the steps ask of the image
    need: Optional[SourceNeed] = None
    need_reason: str = "not configured by a recipe"

    def spec(self) -> FieldSpec:
        c, dtype = MODES[self.params.mode]
        return FieldSpec(self.kind, (None, None, c), dtype)

    def read(self, path: str) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
        r = self.params.reduce
        reduce: int | SourceNeed | None = r if isinstance(r, int) else (self.need if r == "auto" else None)
        info: dict[str, Any] = {}
        arr, k = decode_image_scaled(path, self.params.mode, self.params.exif_transpose, reduce, self.max_bytes, info)
        meta = {**({"reduce": k} if k > 1 else {}), **info}
        return (arr, meta) if meta else arr


def decode_image_file(path: str, mode: str = "rgb8", exif_transpose: bool = True,
                      budget: int = DEFAULT_INPUT_BYTES) -> np.ndarray:
    """Decode ``path`` at full size to the array layout of ``mode``."""
    return decode_image_scaled(path, mode, exif_transpose, None, budget)[0]


def check_image_size(img, mode: str, path: str, budget: int, size: Optional[tuple[int, int]] = None,
                     held: int = 0) -> None:
    """Refuse an opened (not yet loaded) image whose decoding would take more than ``budget``: Pillow's
    own image (4 bytes a pixel for multi-band and 32-bit modes), its converted copy, and the output
    twice (Pillow's bytes, then the array), at ``size`` (w, h; default the image's), plus ``held``
    bytes (a JPEG's file, read whole for its decoder)."""
    W, H = size or img.size
    pil = 1 if img.mode in ("1", "L", "P") else 2 if img.mode.startswith("I;16") else 4
    out = MODES[mode][0] * np.dtype(MODES[mode][1]).itemsize if mode in MODES else 2
    conv = 0 if mode == "label" else 4
    check_budget(path, f"{W}x{H} pixels ({img.mode})", W * H * (pil + conv + 2 * out) + held, budget)


# what ImageOps.exif_transpose does for each EXIF orientation
_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}


def _transpose_array(a: np.ndarray, method: str) -> np.ndarray:
    """Pillow's ``Image.transpose(method)`` of an (H, W, C) uint8 array, by OpenCV: the same permutation of
    pixels, 5-15x faster than a numpy copy of the turned view (which strides across the cache lines)."""
    import cv2

    if method == "FLIP_LEFT_RIGHT":
        out = cv2.flip(a, 1)
    elif method == "ROTATE_180":
        out = cv2.flip(a, -1)
    elif method == "FLIP_TOP_BOTTOM":
        out = cv2.flip(a, 0)
    elif method == "TRANSPOSE":
        out = cv2.transpose(a)
    elif method == "ROTATE_270":   # Pillow turns counter-clockwise: 270 degrees is a quarter clockwise
        out = cv2.rotate(a, cv2.ROTATE_90_CLOCKWISE)
    elif method == "TRANSVERSE":
        out = cv2.flip(cv2.transpose(a), -1)
    else:   # ROTATE_90
        out = cv2.rotate(a, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return out.reshape(out.shape[0], out.shape[1], a.shape[2])


def _orientation(img) -> int:
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # damaged EXIF: exif_transpose decides (it warns and leaves the image)
        return 1


def _draft_scale(img, k: int) -> tuple[int, Optional[tuple[float, float]]]:
    """Ask a JPEG for 1/k scale decoding; returns the scale it will decode at (1 if none) and
    the extent (width, height) of the source in the reduced image's pixels: (W/k, H/k)."""
    if k <= 1 or img.format not in _JPEG:
        return 1, None
    W, H = img.size
    if W < k or H < k:
        return 1, None
    res = img.draft(None, (W // k, H // k))
    if res is None:
        return 1, None
    box = res[1]
    return max(1, int(round(W / box[2]))), (float(box[2]), float(box[3]))


def _cover_source(img, extent: Optional[tuple[float, float]]):
    """A 1/k decode of a W x H JPEG as ceil(W/k) x ceil(H/k) pixels that cover exactly the source.

    libjpeg's scaled IDCT decodes whole k x k blocks: its ceil(W/k) columns cover k * ceil(W/k)
    source columns, up to k - 1 more than W (the padding libjpeg adds past the right and bottom
    edges). Taken as covering the source, that stretched the image by up to (k - 1) / W against
    a full decode (a 0.2 output pixel shift after a resize at 1001 px and k = 4). The image is
    resampled (Pillow's bicubic, as ``Image.thumbnail`` does after ``draft``) from the part that
    shows the source, (0, 0, W/k, H/k), back to ceil(W/k) x ceil(H/k); sizes divisible by k are
    exact already and left alone."""
    if extent is None or (extent[0] == img.size[0] and extent[1] == img.size[1]):
        return img
    from PIL import Image

    return img.resize(img.size, Image.Resampling.BICUBIC, box=(0.0, 0.0, extent[0], extent[1]))


def decode_image_scaled(path: str, mode: str = "rgb8", exif_transpose: bool = True,
                        reduce: int | SourceNeed | None = None,
                        budget: int = DEFAULT_INPUT_BYTES, info: Optional[dict] = None) -> tuple[np.ndarray, int]:
    """Decode ``path``, a JPEG at reduced scale when ``reduce`` asks; returns (array, k), decoded at 1/k.

    ``reduce``: None decodes at full size; an int k gives a 1/k image for any format (JPEG
    by scaled IDCT, others by an area resize); a :class:`SourceNeed` lets the file's size
    and orientation pick the JPEG scale (other formats: full size). ``budget``: the most bytes the
    decode may take (:func:`check_image_size`, checked before pixels are decoded). ``info``, when given,
    gets ``orientation``: the EXIF orientation (2..8) that ``exif_transpose`` applied, if any, and, when the
    image was decoded at 1/k (k > 1), ``source_size``: the stored pixels' [height, width] (before the turn).
    """
    from PIL import Image, ImageFile, UnidentifiedImageError

    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise DecodeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set in this process; refusing to decode "
                          "images that may be silently truncated", path=path, stage="decode")
    try:
        got = _decode_turbo_alone(path, mode, exif_transpose, reduce, budget, info)
        if got is not None:
            arr, k, stored = got
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                # Pillow warns (UserWarning) about damaged metadata such as corrupt EXIF and decodes anyway
                warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
                with Image.open(path) as img:
                    arr, k, stored = _decode_opened(img, path, mode, exif_transpose, reduce, budget, info)
        if isinstance(reduce, int) and reduce > 1 and k == 1:
            # not a JPEG (or too small for libjpeg's scale): area-resize the full image to the same 1/k
            from ..transforms.kernels.geometry import resize_hwc

            arr = resize_hwc(arr, *reduced_size(arr.shape[0], arr.shape[1], reduce), "area")
            k = reduce
        if info is not None and k > 1:
            info["source_size"] = stored
    except FileNotFoundError:
        raise DecodeError("file not found", path=path, stage="decode") from None
    except UnidentifiedImageError:
        raise DecodeError("not an image Pillow can identify", path=path, stage="decode") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        msg = str(e) or type(e).__name__
        if "truncated" in msg.lower() or "broken data stream" in msg.lower():
            msg = f"truncated or corrupt image data ({msg})"
        raise DecodeError(msg, path=path, stage="decode") from None
    except (TypeError, IndexError, KeyError, struct.error, EOFError) as e:
        # Pillow's plugins let some damaged files escape as these (a palette PNG cut in half gives
        # "TypeError: function takes at most 3 arguments (4 given)" from its decoder's setup)
        raise DecodeError(f"damaged image data ({type(e).__name__}: {e})", path=path, stage="decode") from None
    return np.ascontiguousarray(arr), k


def _decode_opened(img, path: str, mode: str, exif_transpose: bool, reduce: int | SourceNeed | None, budget: int,
                   info: Optional[dict], data: Optional[bytes] = None) -> tuple[np.ndarray, int, list[int]]:
    """:func:`decode_image_scaled` of an opened image (Pillow's, or a :class:`_JpegHeader` with the file's
    ``data``): (array, k, the source's [height, width] before the turn)."""
    want = 1
    if isinstance(reduce, int):
        want = reduce
    elif reduce is not None and img.format in _JPEG and img.mode != "CMYK":
        # (CMYK: libjpeg would average in CMYK space, and the conversion to RGB is not
        # linear, so the result would drift from full decoding: auto leaves CMYK whole)
        W, H = img.size
        if exif_transpose and _orientation(img) in (5, 6, 7, 8):
            W, H = H, W  # shown turned a quarter: the steps see the axes swapped
        want = reduce.scale_for(H, W)
    o = _orientation(img) if exif_transpose else 1   # what both decode paths turn by
    stored = [int(img.size[1]), int(img.size[0])]   # the source's [height, width], before the turn
    if img.format in _JPEG and img.mode in TURBO_MODES:
        # the first resample may take the source's extent instead of a resample onto the grid
        fold = info is not None and isinstance(reduce, SourceNeed) and reduce.fold
        arr, k = _decode_jpeg(img, path, mode, exif_transpose, want, budget, info if fold else None, data)
    else:
        arr, k = _decode_pillow(img, path, mode, exif_transpose, want, budget)
    if info is not None and o in (2, 3, 4, 5, 6, 7, 8):
        info["orientation"] = o
    return arr, k, stored


class _PillowAfterAll(Exception):
    """The plain JPEG path met a case only Pillow's path handles (a tiny image at 1/k)."""


class _JpegHeader:
    """What the decode reads of an opened image (``size``, ``mode``, ``format``, ``getexif``), for a plain JPEG
    read without Pillow: see :func:`_plain_jpeg`."""

    format = "JPEG"

    def __init__(self, w: int, h: int, mode: str, orientation: int):
        self.size, self.mode, self._exif = (w, h), mode, {0x0112: orientation}

    def getexif(self) -> dict:
        return self._exif


_SPACES = {"Gray": "L", "RGB": "RGB", "YCbCr": "RGB", "CMYK": "CMYK", "YCCK": "CMYK"}   # libjpeg's -> Pillow's mode


def _exif_orientation(t: bytes) -> Optional[int]:
    """The Orientation (1..8) of an EXIF block's first IFD (TIFF data), 1 without one; None for anything
    unusual (then Pillow reads it)."""
    if len(t) < 8 or t[:2] not in (b"II", b"MM"):
        return None
    e = "little" if t[:2] == b"II" else "big"
    if int.from_bytes(t[2:4], e) != 42:
        return None
    off = int.from_bytes(t[4:8], e)
    if off < 8 or off + 2 > len(t):
        return None
    n = int.from_bytes(t[off:off + 2], e)
    if off + 2 + 12 * n > len(t):
        return None
    found = []
    for j in range(off + 2, off + 2 + 12 * n, 12):
        if int.from_bytes(t[j:j + 2], e) == 0x0112:
            if int.from_bytes(t[j + 2:j + 4], e) != 3 or int.from_bytes(t[j + 4:j + 8], e) != 1:
                return None   # not one SHORT
            found.append(int.from_bytes(t[j + 8:j + 10], e))
    if not found:
        return 1
    return found[0] if len(found) == 1 and 1 <= found[0] <= 8 else None


def _plain_jpeg(data: bytes) -> Optional[_JpegHeader]:
    """The header of a plain JPEG read without Pillow (its Python marker parser costs ~0.1 ms a file): the
    markers up to the first scan, at most one APP1 and that one EXIF, whose first IFD gives the orientation,
    and libjpeg-turbo's own header reader for the size and colour space. None for anything else (not a JPEG,
    an XMP block, which Pillow also reads an orientation from, a damaged marker, an unknown colour space):
    Pillow's path then decides, as for every other file."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    o, i, n, exif, sof = 1, 2, len(data), False, False
    while True:
        if i + 4 > n or data[i] != 0xFF:
            return None
        m = data[i + 1]
        if m == 0xDA:   # the first scan: the header is read
            if not sof:
                return None
            break
        if m == 0xFF or m == 0x01 or 0xD0 <= m <= 0xD8:
            return None   # fill bytes, a stray marker: unusual
        size = int.from_bytes(data[i + 2:i + 4], "big")
        if size < 2 or i + 2 + size > n:
            return None
        if 0xC0 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC):   # a frame header
            if m not in (0xC0, 0xC1, 0xC2) or sof or size < 8 or data[i + 4] != 8 or data[i + 9] not in (1, 3, 4):
                return None   # not 8-bit Huffman (baseline, extended, progressive) with 1, 3 or 4 components
            sof = True
        if m == 0xE1:
            if exif or data[i + 4:i + 10] != b"Exif\x00\x00":
                return None
            exif = True
            got = _exif_orientation(data[i + 10:i + 2 + size])
            if got is None:
                return None
            o = got
        i += 2 + size
    import simplejpeg

    try:
        h, w, space, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    mode = _SPACES.get(space)
    return None if mode is None or w < 1 or h < 1 else _JpegHeader(int(w), int(h), mode, o)


def _decode_turbo_alone(path: str, mode: str, exif_transpose: bool, reduce: int | SourceNeed | None, budget: int,
                        info: Optional[dict]) -> Optional[tuple[np.ndarray, int, list[int]]]:
    """:func:`_decode_opened` of a plain JPEG (:func:`_plain_jpeg`) without opening it in Pillow: the same
    checks (the file's bytes within the budget before it is read, Pillow's decompression-bomb limit, the size
    budget before decoding, the strict decode) and the same pixels and meta; None where Pillow's path decides
    (anything else, and a file over the budget, which that path refuses)."""
    from PIL import Image

    size = os.path.getsize(path)
    if size > budget:
        return None
    with open(path, "rb") as f:
        data = f.read()
    hdr = _plain_jpeg(data)
    if hdr is None:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if limit and hdr.size[0] * hdr.size[1] > limit:
        return None   # Pillow's path warns (an error here) or refuses
    part: dict[str, Any] = {}
    try:
        got = _decode_opened(hdr, path, mode, exif_transpose, reduce, budget, part if info is not None else None,
                             data)
    except _PillowAfterAll:
        return None
    if info is not None:
        info.update(part)
    return got


def _decode_pillow(img, path: str, mode: str, exif_transpose: bool, want: int, budget: int) -> tuple[np.ndarray, int]:
    """An opened image decoded by Pillow (a JPEG at 1/``want`` where its ``draft`` allows)."""
    from PIL import ImageOps

    k, extent = _draft_scale(img, want)
    check_image_size(img, mode, path, budget)
    img.load()
    img = _cover_source(img, extent)
    fmt = img.format
    if exif_transpose:
        img = ImageOps.exif_transpose(img)
    return _to_mode(img, mode, fmt), k


def _decode_jpeg(img, path: str, mode: str, exif_transpose: bool, want: int, budget: int,
                 fold: Optional[dict] = None, data: Optional[bytes] = None) -> tuple[np.ndarray, int]:
    """An opened JPEG decoded by libjpeg-turbo in strict mode (:mod:`.jpeg_strict`) at 1/``want`` (full size
    if a side is shorter than ``want``), then the same steps as :func:`_decode_pillow`: the same pixels.

    ``fold`` (the meta dict, when the first step takes the extent: ``SourceNeed.fold``): a 1/k image at a size
    not divisible by k that is not turned by its orientation is left as libjpeg decodes it, and
    ``fold["extent"]`` records the source's part of it, [H/k, W/k], for that step's one resample
    (:func:`_cover_source`'s resample onto the grid would be a second one)."""
    from PIL import Image

    W, H = img.size
    k = want if want > 1 and W >= want and H >= want else 1
    h, w = reduced_size(H, W, k)
    check_image_size(img, mode, path, budget, size=(w, h), held=os.path.getsize(path) if data is None else len(data))
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    if k > 1 and not turbo_scale_is(H, W, k):
        if isinstance(img, _JpegHeader):
            raise _PillowAfterAll
        # a tiny image (sides of 5 px or less) that TurboJPEG cannot be asked to decode at exactly 1/k:
        # checked strictly at full size, then decoded at 1/k by Pillow
        decode_jpeg_strict(data, H, W, img.mode, 1, path)
        return _decode_pillow(img, path, mode, exif_transpose, want, budget)
    raw = decode_jpeg_strict(data, H, W, img.mode, k, path)
    method = _TRANSPOSE.get(img.getexif().get(0x0112, 1)) if exif_transpose else None

    def pil():
        return Image.frombuffer(img.mode, (w, h), raw, "raw", TURBO_MODES[img.mode][2], 0, 1)

    cover = k > 1 and bool(W % k or H % k)
    if cover and fold is not None and method is None:
        fold[EXTENT] = [H / k, W / k]
        cover = False
    if (img.mode, mode) in (("RGB", "rgb8"), ("L", "gray8"), ("L", "label")):
        # libjpeg's output is the output's layout already: Pillow only for the resample, the turn by OpenCV
        if cover:
            raw = np.asarray(_cover_source(pil(), (W / k, H / k))).reshape(h, w, -1)
        return (raw if method is None else _transpose_array(raw, method)), k
    out = _cover_source(pil(), (W / k, H / k)) if cover else pil()
    if method is not None:
        out = out.transpose(Image.Transpose[method])
    return _to_mode(out, mode), k
