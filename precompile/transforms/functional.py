"""Pure kernels: functions of ``(array, **params)`` with no RNG and no I/O.

Spatial arrays are channel-last: images and masks (H, W, C), flow (H, W, 2)
with (u, v) in pixels, video clips (T, H, W, C).
"""
from __future__ import annotations

import numpy as np

INTERP = {"nearest": 0, "linear": 1, "cubic": 2, "area": 3}


def _cv2():
    import cv2

    return cv2


def resize_hwc(a: np.ndarray, h: int, w: int, interpolation: str = "auto") -> np.ndarray:
    """Resize an (H, W, C) array to (h, w, C). ``auto``: area when shrinking, linear when growing."""
    cv2 = _cv2()
    H, W = a.shape[:2]
    if (H, W) == (h, w):
        return a.copy()
    if h < 1 or w < 1:
        raise ValueError(f"cannot resize to {h}x{w}")
    if interpolation == "auto":
        interpolation = "area" if h <= H and w <= W else "linear"
    flag = getattr(cv2, {"nearest": "INTER_NEAREST_EXACT", "linear": "INTER_LINEAR", "cubic": "INTER_CUBIC",
                         "area": "INTER_AREA"}[interpolation])
    src = a
    if a.dtype == np.uint16 and interpolation == "area" and a.shape[2] > 4:
        src = a.astype(np.float32)
    c = a.shape[2]
    if c <= 4:
        out = cv2.resize(np.ascontiguousarray(src), (w, h), interpolation=flag)
    else:  # OpenCV handles at most 4 channels per call for some interpolations
        out = np.stack([cv2.resize(np.ascontiguousarray(src[..., i]), (w, h), interpolation=flag)
                        for i in range(c)], axis=-1)
    if out.ndim == 2:
        out = out[..., None]
    return out.astype(a.dtype, copy=False)


def resize_flow(flow: np.ndarray, h: int, w: int) -> np.ndarray:
    """Resize an (H, W, 2) flow field and scale its vectors: u by w/W, v by h/H.

    Non-finite (invalid) vectors do not leak into their neighbours: the valid
    mask is resized with the same weights and used to renormalise.
    """
    H, W = flow.shape[:2]
    valid = np.isfinite(flow).all(axis=-1).astype(np.float32)[..., None]
    f = np.where(valid > 0, flow, 0).astype(np.float32)
    shrink = h <= H and w <= W
    mode = "area" if shrink else "linear"
    num = resize_hwc(f * valid, h, w, mode)
    den = resize_hwc(valid, h, w, mode)
    out = np.where(den > 1e-6, num / np.maximum(den, 1e-6), np.nan).astype(np.float32)
    out[..., 0] *= w / W
    out[..., 1] *= h / H
    return out


def resize_any(a: np.ndarray, kind: str, h: int, w: int, interpolation: str = "auto") -> np.ndarray:
    """Resize a spatial array of any kind to (h, w) with the kind's semantics."""
    if kind == "flow":
        return resize_flow(a, h, w)
    if kind == "mask":
        interpolation = "nearest"
    if kind == "video":
        return np.stack([resize_hwc(fr, h, w, interpolation) for fr in a]) if len(a) else \
            np.zeros((0, h, w, a.shape[-1]), a.dtype)
    return resize_hwc(a, h, w, interpolation)


def spatial_hw(a: np.ndarray, kind: str) -> tuple[int, int]:
    return tuple(a.shape[1:3]) if kind == "video" else tuple(a.shape[:2])


def crop(a: np.ndarray, kind: str, top: int, left: int, h: int, w: int) -> np.ndarray:
    if kind == "video":
        return a[:, top:top + h, left:left + w].copy()
    return a[top:top + h, left:left + w].copy()


def pad_to(a: np.ndarray, kind: str, h: int, w: int, value: float = 0, center: bool = True) -> tuple[np.ndarray, int, int]:
    """Pad to (h, w); returns the array and the (top, left) offset of the original."""
    H, W = spatial_hw(a, kind)
    top = (h - H) // 2 if center else 0
    left = (w - W) // 2 if center else 0
    if kind == "flow":
        value = np.nan
    shape = (a.shape[0], h, w, a.shape[-1]) if kind == "video" else (h, w, a.shape[-1])
    out = np.full(shape, value, dtype=a.dtype)
    if kind == "video":
        out[:, top:top + H, left:left + W] = a
    else:
        out[top:top + H, left:left + W] = a
    return out, top, left


def shorter_side_size(H: int, W: int, n: int) -> tuple[int, int]:
    if H <= W:
        return n, max(1, int(round(W * n / H)))
    return max(1, int(round(H * n / W))), n


def longer_side_size(H: int, W: int, n: int) -> tuple[int, int]:
    if H >= W:
        return n, max(1, int(round(W * n / H)))
    return max(1, int(round(H * n / W))), n


# -- pixel formats --------------------------------------------------------------------
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
