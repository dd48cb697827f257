"""Pure kernels: functions of ``(array, **params)`` with no RNG and no I/O.

Spatial arrays are channel-last: images and masks (H, W, C), flow (H, W, 2)
with (u, v) in pixels and NaN where the flow is unknown, video clips
(T, H, W, C), volumes (D, H, W) in (z, y, x) order, volume masks (D, H, W)
uint8, audio (C, N) channels first.

Flow semantics (shared with the augmentation steps, which call these kernels):
a resize scales u by the width ratio and v by the height ratio and never mixes
invalid (NaN) vectors into valid ones; a horizontal flip mirrors the grid and
negates u, a vertical flip negates v; a crop cuts every field at one window.
"""
from __future__ import annotations

import numpy as np

from ..kinds import Kind


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


def resize_flow(flow: np.ndarray, h: int, w: int, min_valid: float = 0.5) -> np.ndarray:
    """Resize an (H, W, 2) flow field and scale its vectors: u by w/W, v by h/H.

    Invalid (non-finite) vectors never leak into valid ones: the valid mask is
    resized with the same weights and used to renormalise, so each output vector
    is a weighted mean of valid input vectors only. An output pixel whose support
    is less than ``min_valid`` valid becomes NaN (invalid).
    """
    H, W = flow.shape[:2]
    if flow.ndim != 3 or flow.shape[-1] != 2:
        raise ValueError(f"flow must be (H, W, 2), got {flow.shape}")
    if h < 1 or w < 1:
        raise ValueError(f"cannot resize to {h}x{w}")
    valid = np.isfinite(flow).all(axis=-1).astype(np.float32)[..., None]
    f = np.where(valid > 0, flow, 0).astype(np.float32)
    if (H, W) == (h, w):
        out = np.where(valid > 0, f, np.nan).astype(np.float32)
        return out
    shrink = h <= H and w <= W
    mode = "area" if shrink else "linear"
    num = resize_hwc(f * valid, h, w, mode)
    den = resize_hwc(valid, h, w, mode)
    ok = den >= min_valid - 1e-6
    out = np.where(ok, num / np.maximum(den, 1e-6), np.nan).astype(np.float32)
    out[..., 0] *= w / W
    out[..., 1] *= h / H
    return out


def flip_hw(a: np.ndarray, horizontal: bool, vertical: bool = False) -> np.ndarray:
    """Mirror an (H, W, ...) array left-right and/or up-down (a copy)."""
    axes = ((1,) if horizontal else ()) + ((0,) if vertical else ())
    return np.flip(a, axis=axes).copy() if axes else a.copy()


def flip_flow(flow: np.ndarray, horizontal: bool, vertical: bool = False) -> np.ndarray:
    """Mirror an (H, W, 2) flow field: a horizontal flip negates u, a vertical one v."""
    out = flip_hw(flow, horizontal, vertical)
    if horizontal:
        out[..., 0] *= -1
    if vertical:
        out[..., 1] *= -1
    return out


def spatial_hw(a: np.ndarray, kind: Kind) -> tuple[int, int]:
    ay, ax = Kind.of(kind).hw_axes
    return a.shape[ay], a.shape[ax]


def crop_hw(a: np.ndarray, top: int, left: int, h: int, w: int) -> np.ndarray:
    """The (h, w) window at (top, left) of an (H, W, ...) array (a copy)."""
    return a[top:top + h, left:left + w].copy()


def pad_hw(a: np.ndarray, h: int, w: int, value: float = 0, center: bool = True) -> tuple[np.ndarray, int, int]:
    """Pad an (H, W, ...) array to (h, w) with ``value``; returns it and the (top, left) of the original."""
    H, W = a.shape[:2]
    top = (h - H) // 2 if center else 0
    left = (w - W) // 2 if center else 0
    out = np.full((h, w) + a.shape[2:], value, dtype=a.dtype)
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


# -- volumes (D, H, W) -------------------------------------------------------------------
def zoom_volume(v: np.ndarray, shape: tuple[int, int, int], order: int = 1) -> np.ndarray:
    """Resample a (D, H, W) array onto a grid of ``shape`` with voxel centres aligned at the corners
    of the field of view scaled by the size ratio (scipy.ndimage.zoom, ``grid_mode=True``)."""
    from scipy import ndimage

    shape = tuple(int(s) for s in shape)
    if any(s < 1 for s in shape):
        raise ValueError(f"cannot resample to shape {shape}")
    if tuple(v.shape) == shape:
        return v.copy()
    src = v.astype(np.float32) if order > 0 else v
    factors = [s / d for s, d in zip(shape, v.shape)]
    out = ndimage.zoom(src, factors, order=order, mode="grid-constant" if order == 0 else "nearest",
                       grid_mode=True, prefilter=False)
    if out.shape != shape:  # zoom rounds the output shape itself; pin it exactly
        fix = np.zeros(shape, out.dtype)
        sl = tuple(slice(0, min(a, b)) for a, b in zip(shape, out.shape))
        fix[sl] = out[sl]
        out = fix
    if np.issubdtype(v.dtype, np.integer) and out.dtype != v.dtype:
        info = np.iinfo(v.dtype)
        out = np.clip(np.rint(out), info.min, info.max)
    return out.astype(v.dtype, copy=False)


def spacing_shape(shape: tuple[int, ...], spacing: tuple[float, ...], target: tuple[float, ...]) -> tuple[int, ...]:
    """The grid size that covers the same extent as ``shape`` x ``spacing`` at ``target`` spacing."""
    return tuple(max(1, int(round(n * s / t))) for n, s, t in zip(shape, spacing, target))


def hu_window(v: np.ndarray, lo: float, hi: float, dtype: str = "float32") -> np.ndarray:
    """Clip to [lo, hi] and scale to [0, 1] (float32) or [0, 255] (uint8)."""
    if hi <= lo:
        raise ValueError(f"window upper bound {hi} must exceed the lower {lo}")
    x = (np.clip(v.astype(np.float32), lo, hi) - np.float32(lo)) / np.float32(hi - lo)
    if dtype == "uint8":
        return np.rint(x * 255).astype(np.uint8)
    return x.astype(np.float32)


def standardise(v: np.ndarray, mean: float, std: float) -> np.ndarray:
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    return ((v.astype(np.float32) - np.float32(mean)) / np.float32(std)).astype(np.float32)


def lung_mask(v: np.ndarray, threshold: float = -320.0, max_components: int = 2, min_fraction: float = 0.001,
              fill_holes: bool = True, closing: int = 1) -> np.ndarray:
    """A lung mask from a CT volume in HU: (D, H, W) -> (D, H, W) uint8 in {0, 1}.

    Voxels below ``threshold`` are air; air connected to the in-plane border of
    any slice (the room around the patient) is removed; of the remaining 3D
    connected components the ``max_components`` largest that hold at least
    ``min_fraction`` of the volume are kept; holes (vessels, nodules) are filled
    slice by slice and the mask is closed with a ball of radius ``closing``.
    """
    from scipy import ndimage

    if v.ndim != 3:
        raise ValueError(f"lung_mask needs a (D, H, W) volume, got shape {v.shape}")
    air = v < threshold
    # label air per slice in 2D to find what touches the in-plane border (outside the body)
    outside = np.zeros_like(air)
    for z in range(air.shape[0]):
        lab, n = ndimage.label(air[z])
        if n == 0:
            continue
        border = np.unique(np.concatenate([lab[0], lab[-1], lab[:, 0], lab[:, -1]]))
        outside[z] = np.isin(lab, border[border > 0])
    body_air = air & ~outside
    lab, n = ndimage.label(body_air, structure=ndimage.generate_binary_structure(3, 1))
    mask = np.zeros(v.shape, np.uint8)
    if n == 0:
        return mask
    sizes = np.bincount(lab.ravel())[1:]
    order = np.argsort(-sizes, kind="stable")
    keep = [i + 1 for i in order[:max_components] if sizes[i] >= min_fraction * v.size]
    m = np.isin(lab, keep)
    if closing > 0:
        r = int(closing)
        zz, yy, xx = np.mgrid[-r:r + 1, -r:r + 1, -r:r + 1]
        ball = (zz * zz + yy * yy + xx * xx) <= r * r
        m = ndimage.binary_closing(np.pad(m, r), structure=ball)[r:-r, r:-r, r:-r]
    if fill_holes:
        for z in range(m.shape[0]):
            m[z] = ndimage.binary_fill_holes(m[z])
    mask[m] = 1
    return mask


def patch_corners(shape: tuple[int, ...], size: tuple[int, ...], stride: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Corners of overlapping windows of ``size`` every ``stride`` that cover ``shape``; the last
    window on each axis is moved back to end at the border, so the whole extent is covered."""
    axes = []
    for n, s, st in zip(shape, size, stride):
        if n < s:
            raise ValueError(f"extent {n} is smaller than the patch size {s}")
        starts = list(range(0, n - s + 1, st))
        if starts[-1] != n - s:
            starts.append(n - s)
        axes.append(starts)
    import itertools

    return [tuple(c) for c in itertools.product(*axes)]


def pad_crop_center(a: np.ndarray, shape: tuple[int, ...], value: float = 0) -> tuple[np.ndarray, tuple[int, ...]]:
    """Centre-crop or pad the leading ``len(shape)`` axes to ``shape``.

    Returns the array and, per axis, the offset of the output's origin in the
    input (negative where padded)."""
    out = np.full(tuple(shape) + a.shape[len(shape):], value, dtype=a.dtype)
    src, dst, offs = [], [], []
    for n, s in zip(a.shape, shape):
        off = (n - s) // 2 if n >= s else -((s - n) // 2)
        offs.append(int(off))
        if n >= s:  # crop (off >= 0); padding by one voxel gives off == 0 too, hence not "off >= 0"
            src.append(slice(off, off + s))
            dst.append(slice(0, s))
        else:
            src.append(slice(0, n))
            dst.append(slice(-off, -off + n))
    out[tuple(dst)] = a[tuple(src)]
    return out, tuple(offs)


# -- clips and windows ----------------------------------------------------------------------
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


# -- audio (C, N) ------------------------------------------------------------------------------
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
