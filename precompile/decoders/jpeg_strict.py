"""JPEG decoding that stops on libjpeg's warnings (libjpeg-turbo's TurboJPEG API through simplejpeg).

libjpeg decodes a JPEG whose entropy-coded data ends early (a file cut short, with
or without an EOI marker after the cut) with a *warning* only ("Corrupt JPEG data:
premature end of data segment", "Premature end of JPEG file"), filling the rest
with grey; Pillow does not surface that warning, so a cut photo was stored as a
mostly grey image. simplejpeg's ``strict`` mode turns every libjpeg warning into
an error, which :func:`decode_jpeg_strict` raises as a :class:`DecodeError` naming
the file and quoting libjpeg's message.

One warning is not an error: "N extraneous bytes before marker 0xd9" (bytes between
the last scan and the EOI marker, which some cameras and editors write). libjpeg
reports the *first* warning of a decode and decodes to the end in any case, so when
that is the message, every scan decoded without a warning and the image is whole.

The pixels are Pillow's, byte for byte: both call libjpeg-turbo with the same
settings (accurate integer IDCT, fancy upsampling; CMYK and YCCK files come out as
CMYK, which Pillow reads as Adobe's inverted CMYK, ``CMYK;I``), at full size and at
1/2, 1/4 and 1/8 scale (Pillow's ``draft``), for baseline and progressive files,
grey, 4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1 and CMYK (tests/test_jpeg_strict.py). The one
difference is how a scale is asked for: TurboJPEG takes an output size and decodes
at the largest of its scales n/8 (n = 1..16) that fits it, so for a few tiny images
(both sides 1-5 pixels; :func:`turbo_scale_is`) ceil(W/k) x ceil(H/k) is met by
another scale than 1/k (a 5x5 image asked for 2x2 decodes at 3/8, not 1/4); the image
decoder decodes those with Pillow after a strict check here.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import DecodeError
from .jpeg_reduce import reduced_size

#: Pillow's mode of a JPEG -> (simplejpeg colorspace, channels, the rawmode Pillow unpacks libjpeg's output with)
TURBO_MODES = {"L": ("GRAY", 1, "L"), "RGB": ("RGB", 3, "RGB"), "CMYK": ("CMYK", 4, "CMYK;I")}
_WHOLE = re.compile(r"Corrupt JPEG data: \d+ extraneous bytes before marker 0xd9")
_MSG_MAX = 200   # libjpeg's messages are short; anything echoed is cut to this


def turbo_scale_is(h: int, w: int, k: int) -> bool:
    """Whether TurboJPEG, asked for ceil(h/k) x ceil(w/k) pixels, decodes an h x w JPEG at exactly 1/k.

    It takes the largest scale n/8 (n = 16 .. 1) whose output, ceil(h*n/8) x ceil(w*n/8), fits."""
    oh, ow = reduced_size(h, w, k)
    for n in range(16, 0, -1):
        if -(-h * n // 8) <= oh and -(-w * n // 8) <= ow:
            return n * k == 8
    return False


def decode_jpeg_strict(data, h: int, w: int, pil_mode: str, k: int, path: str) -> np.ndarray:
    """Decode JPEG ``data`` (the file's bytes; Pillow reads it as ``pil_mode``, ``h`` x ``w``) at 1/``k``.

    Returns (ceil(h/k), ceil(w/k), C) uint8 as libjpeg writes it (Pillow's raw data for that mode:
    unpack it with ``TURBO_MODES[pil_mode][2]``). Any libjpeg warning but an intact image's
    "extraneous bytes before marker 0xd9" raises a :class:`DecodeError`. Needs
    :func:`turbo_scale_is` (h, w, k) for k > 1."""
    import simplejpeg

    colorspace, c, _ = TURBO_MODES[pil_mode]
    oh, ow = reduced_size(h, w, k)
    out = np.empty((oh, ow, c), np.uint8)
    size = {"min_height": oh, "min_width": ow} if k > 1 else {}
    try:
        got = simplejpeg.decode_jpeg(data, colorspace, buffer=out, strict=True, **size)
    except ValueError as e:
        msg = str(e)
        if not _WHOLE.fullmatch(msg):
            if len(msg) > _MSG_MAX:
                msg = msg[:_MSG_MAX] + "..."
            raise DecodeError(f"truncated or corrupt JPEG data (libjpeg-turbo: {msg})", path=path,
                              stage="decode") from None
        got = out
    if got.shape != out.shape:   # the two header readers disagree: never seen, refused rather than guessed
        raise DecodeError(f"libjpeg-turbo decodes {got.shape[1]}x{got.shape[0]} pixels where the header "
                          f"read {ow}x{oh}", path=path, stage="decode")
    return out
