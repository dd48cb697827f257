"""A JPEG's scan data checked against its header before decoding.

libjpeg decodes a JPEG whose entropy-coded data ends early (an EOI marker after
64x64 pixels' worth of scan in a file whose frame header declares 9000x9000)
with a warning only, filling the rest with grey; Pillow does not surface that
warning, so such a file would be stored as a mostly grey image. Every block of a
Huffman-coded scan that codes DC coefficients (a baseline scan, or a progressive
DC scan) costs at least one bit, so such a scan over N blocks holds at least N/8
bytes; :func:`check_jpeg_scan` refuses a file whose first such scan is shorter.
The bound is loose (a real scan is far longer), so a sound file never fails it.
"""
from __future__ import annotations

import math
import re
from typing import Optional

from ..errors import DecodeError

_SOF_HUFFMAN = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7}   # arithmetic coding (0xC9..) is not bounded here
_SOF_ALL = _SOF_HUFFMAN | {0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")   # a marker ending an entropy-coded segment


def _frame(data: bytes, pos: int) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """(height, width, {component id: (h, v) sampling}) of the SOF segment at ``pos``."""
    h, w, n = int.from_bytes(data[pos + 5:pos + 7], "big"), int.from_bytes(data[pos + 7:pos + 9], "big"), data[pos + 9]
    comps = {data[pos + 10 + 3 * i]: (data[pos + 11 + 3 * i] >> 4, data[pos + 11 + 3 * i] & 15) for i in range(n)}
    return h, w, comps


def _scan_blocks(height: int, width: int, comps: dict[int, tuple[int, int]], ids: list[int]) -> int:
    """The 8x8 blocks a scan over components ``ids`` codes."""
    hmax = max(hv[0] for hv in comps.values()) or 1
    vmax = max(hv[1] for hv in comps.values()) or 1
    if len(ids) == 1:   # non-interleaved: the component's own blocks
        hs, vs = comps.get(ids[0], (1, 1))
        return math.ceil(math.ceil(width * hs / hmax) / 8) * math.ceil(math.ceil(height * vs / vmax) / 8)
    mcus = math.ceil(width / (8 * hmax)) * math.ceil(height / (8 * vmax))
    return mcus * sum(comps.get(c, (1, 1))[0] * comps.get(c, (1, 1))[1] for c in ids)


def check_jpeg_scan(data: bytes, path: str) -> None:
    """DecodeError when the first DC scan of JPEG ``data`` is too short for the size its header declares."""
    pos, frame = 2, None
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return   # not a marker where one should be: left to the decoder to report
        m = data[pos + 1]
        if m == 0xFF:
            pos += 1
            continue
        seglen = int.from_bytes(data[pos + 2:pos + 4], "big")
        if m in _SOF_ALL:
            if m not in _SOF_HUFFMAN:
                return
            frame = _frame(data, pos)
        elif m == 0xDA and frame is not None:
            ns = data[pos + 4]
            ids = [data[pos + 5 + 2 * i] for i in range(ns)]
            ss = data[pos + 5 + 2 * ns]
            start = pos + 2 + seglen
            end = _scan_end(data, start)
            if ss == 0:   # codes DC: at least one bit per block
                need = math.ceil(_scan_blocks(frame[0], frame[1], frame[2], ids) / 8)
                if end - start < need:
                    raise DecodeError(f"scan data ends early: the header declares {frame[1]}x{frame[0]} pixels, "
                                      f"whose scan needs at least {need} bytes, but it holds {end - start}",
                                      path=path, stage="decode")
                return
            pos = end
            continue
        elif m == 0xD9:
            return
        pos += 2 + seglen


def _scan_end(data: bytes, start: int) -> int:
    m: Optional[re.Match] = _MARKER.search(data, start)
    return m.start() if m else len(data)
