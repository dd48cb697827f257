"""(C, N) audio kernels: fixed length, band-limited resampling, PCM conversion, gain, shift."""
from __future__ import annotations

import numpy as np

from .common import dtype_clip


def fix_length(x: np.ndarray, length: int, align: str = "start", value: float = 0) -> tuple[np.ndarray, int]:
    """Crop or pad the last axis to ``length``; ``align`` start|center|end. Returns the array and
    the source offset of sample 0 (negative where padded at the front)."""
    n = x.shape[-1]
    if align == "start":
        off = 0
    elif align == "center":
        off = (n - length) // 2 if n >= length else -((length - n) // 2)
    elif align == "end":
        off = n - length
    else:
        raise ValueError(f"unknown align {align!r}")
    out = np.full(x.shape[:-1] + (length,), value, dtype=x.dtype)
    lo, hi = max(off, 0), min(off + length, n)
    if hi > lo:
        out[..., lo - off:hi - off] = x[..., lo:hi]
    return out, int(off)


def resample_audio(x: np.ndarray, rate_in: int, rate_out: int, quality: str = "HQ") -> np.ndarray:
    """(C, N) float -> (C, M) float32 at ``rate_out`` with soxr (band-limited; no sample dropping)."""
    if rate_in == rate_out:
        return x.astype(np.float32, copy=True)
    import soxr

    y = soxr.resample(np.ascontiguousarray(x.T, dtype=np.float32), rate_in, rate_out, quality=quality)
    if y.ndim == 1:
        y = y[:, None]
    return np.ascontiguousarray(y.T, dtype=np.float32)


def to_int16(x: np.ndarray) -> np.ndarray:
    """float in [-1, 1) -> int16 with the 32768 scale soundfile uses (16-bit PCM round-trips exactly)."""
    return np.clip(np.rint(x.astype(np.float64) * 32768.0), -32768, 32767).astype(np.int16)


def apply_gain(a: np.ndarray, gain_db: float, clip: bool = False) -> np.ndarray:
    """Multiply audio by 10^(gain_db/20). Float audio: in its own dtype, optionally clipped to [-1, 1];
    integer audio (int16 PCM): in float64, rounded and saturated to the dtype's range (its full scale, which
    is also what ``clip`` means there)."""
    if np.issubdtype(a.dtype, np.integer):
        return dtype_clip(a.astype(np.float64) * (10.0 ** (gain_db / 20.0)), a.dtype)
    out = a * np.asarray(10.0 ** (gain_db / 20.0), dtype=a.dtype)
    if clip:
        out = np.clip(out, -1, 1)
    return out.astype(a.dtype, copy=False)


def shift_time(a: np.ndarray, shift: int, mode: str = "roll") -> np.ndarray:
    """Shift (C, N) audio by ``shift`` samples (positive: later); ``roll`` wraps, ``zero`` pads silence."""
    if mode == "roll":
        return np.roll(a, shift, axis=-1)
    out = np.zeros_like(a)
    n = a.shape[-1]
    if shift >= 0:
        out[..., shift:] = a[..., :max(0, n - shift)]
    else:
        out[..., :n + shift] = a[..., -shift:]
    return out
