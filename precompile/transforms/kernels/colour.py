"""Pixel kernels: pixel-format conversion, colour jitter, gaussian noise."""
from __future__ import annotations

import numpy as np

from .common import dtype_clip


def to_gray8(a: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma with Pillow's integer rounding, (..., 3) uint8 -> (..., 1) uint8."""
    if a.shape[-1] == 1:
        return a.copy()
    r, g, b = (a[..., i].astype(np.uint32) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[..., None]


def convert_mode(a: np.ndarray, mode: str) -> np.ndarray:
    """Convert an image array between rgb8, gray8, gray16 and rgba8."""
    src16 = a.dtype == np.uint16
    if a.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"mode conversion needs uint8 or uint16 input, got {a.dtype}")
    if mode == "gray16":
        g = a if a.shape[-1] == 1 else (to_gray8((a >> 8).astype(np.uint8)) if src16 else to_gray8(a[..., :3]))
        if g.dtype == np.uint8:
            return g.astype(np.uint16) * 257
        return g.copy()
    a8 = (a >> 8).astype(np.uint8) if src16 else a
    if mode == "gray8":
        return to_gray8(a8[..., :3]) if a8.shape[-1] >= 3 else a8.copy()
    if mode == "rgb8":
        if a8.shape[-1] == 1:
            return np.repeat(a8, 3, axis=-1)
        return a8[..., :3].copy()
    if mode == "rgba8":
        if a8.shape[-1] == 4:
            return a8.copy()
        rgb = np.repeat(a8, 3, axis=-1) if a8.shape[-1] == 1 else a8[..., :3]
        return np.concatenate([rgb, np.full(rgb.shape[:-1] + (1,), 255, np.uint8)], axis=-1)
    raise ValueError(f"unknown mode {mode!r}")


def _gray(f: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma of float (..., 3) pixels; elementwise (no BLAS: same bytes on any thread count)."""
    return f[..., 0] * np.float32(0.299) + f[..., 1] * np.float32(0.587) + f[..., 2] * np.float32(0.114)


def color_jitter(a: np.ndarray, frames: bool, brightness: float = 1.0, contrast: float = 1.0,
                 saturation: float = 1.0) -> np.ndarray:
    """Scale brightness, then blend with the mean grey (contrast), then with each pixel's grey
    (saturation); factor 1 leaves the array as it is. Integer pixels are rounded and clipped to
    their type's range. Only the colour channels change (the first 3, or the first of 1-2), so
    an alpha channel is kept; saturation needs 3 colour channels. With ``frames`` the array is a
    (T, H, W, C) clip and contrast uses each frame's mean."""
    if brightness == 1.0 and contrast == 1.0 and saturation == 1.0:
        return a.copy()
    c = a.shape[-1]
    cc = 3 if c >= 3 else 1
    f = a[..., :cc].astype(np.float32)
    if brightness != 1.0:
        f = f * np.float32(brightness)
    if contrast != 1.0:
        gray = _gray(f) if cc == 3 else f[..., 0]
        axes = (1, 2) if frames else (-2, -1)
        m = gray.mean(axis=axes, dtype=np.float64).astype(np.float32)
        m = m[..., None, None, None] if frames else m
        f = f * np.float32(contrast) + m * np.float32(1 - contrast)
    if saturation != 1.0 and cc == 3:
        gray = _gray(f)[..., None]
        f = f * np.float32(saturation) + gray * np.float32(1 - saturation)
    out = a.copy()
    out[..., :cc] = dtype_clip(f, a.dtype)
    return out


def add_noise(a: np.ndarray, std: float, seed: int) -> np.ndarray:
    """Add zero-mean gaussian noise of ``std`` (array units) from ``default_rng(seed)``;
    integer arrays are rounded and clipped to their range."""
    if std == 0:
        return a.copy()
    noise = np.random.default_rng(seed).standard_normal(a.shape, dtype=np.float32) * np.float32(std)
    return dtype_clip(a.astype(np.float32) + noise, a.dtype)
