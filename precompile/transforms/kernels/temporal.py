"""Frame-index kernels: clip starts, padded takes, jittered indices."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def clip_starts(n: int, span: int, stride: int, short: str) -> list[int]:
    """Start indices of windows spanning ``span`` items every ``stride`` in a sequence of ``n``.

    ``short='drop'``: a sequence shorter than one window gives none; ``'pad'``:
    it gives one window starting at 0 (to be padded)."""
    if n >= span:
        return list(range(0, n - span + 1, stride))
    return [0] if short == "pad" and n > 0 else []


def take_padded(a: np.ndarray, indices: list[int], pad: str = "last") -> tuple[np.ndarray, list[int]]:
    """``a[indices]`` along axis 0; indices past the end repeat the last item (``pad='last'``)
    or become zeros (``pad='zero'``). Returns the array and the source indices (-1 for zeros)."""
    n = len(a)
    src = []
    for i in indices:
        if i < n:
            src.append(i)
        else:
            src.append(n - 1 if pad == "last" else -1)
    out = np.zeros((len(indices),) + a.shape[1:], a.dtype)
    for j, i in enumerate(src):
        if i >= 0:
            out[j] = a[i]
    return out, src


def take_frames(a: np.ndarray, indices: Sequence[int]) -> np.ndarray:
    """Frames ``indices`` of a (T, ...) clip, in that order."""
    return a[np.asarray(indices, dtype=np.int64)].copy()


def jitter_indices(T: int, length: int, stride: int, start: int, offsets: Sequence[int] | None = None) -> list[int]:
    """``length`` frame indices from ``start`` at ``stride``, each moved by its offset, clamped to
    the clip and kept non-decreasing (a short clip repeats its last frame)."""
    idx = start + stride * np.arange(length, dtype=np.int64)
    if offsets is not None:
        idx = idx + np.asarray(offsets, dtype=np.int64)
    idx = np.maximum.accumulate(np.clip(idx, 0, T - 1))
    return [int(i) for i in idx]
