"""2D grid kernels: resize, flip, crop and pad (H, W, ...) arrays; affine warps; flow kernels.

Flow semantics: a resize scales u by the width ratio and v by the height ratio
and never mixes unknown (NaN) vectors into known ones; a horizontal flip
mirrors the grid and negates u, a vertical flip negates v; a warp multiplies
the vectors by the map's linear part; uncovered pixels are unknown.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from ...kinds import Kind
from .common import load_cv2


def resize_hwc(a: np.ndarray, h: int, w: int, interpolation: str = "auto",
               extent: Optional[Sequence[float]] = None) -> np.ndarray:
    """Resize an (H, W, C) array to (h, w, C). ``auto``: area when shrinking, linear when growing.

    ``extent`` (eh, ew): resample only the part [0, ew) x [0, eh) of the array's continuous pixel grid (pixel
    (i, j) covers [j, j + 1) x [i, i + 1)), eh <= H and ew <= W, fractional allowed: the output's extent is
    that box, in one resample (a reduced JPEG decode whose last row and column of pixels show partly the
    padding libjpeg adds past the source's edge: see ``decoders/image.py``). ``auto`` then compares the output
    with the box. OpenCV resamples at the scale it is given (``fx``, ``fy``: w / ew, h / eh) from the array's
    origin and covers the whole array; the output pixels past the box are cut off. Exact: the area resize
    weighs each source pixel by its overlap with the output pixel's box."""
    cv2 = load_cv2()
    H, W = a.shape[:2]
    if extent is not None:
        eh, ew = float(extent[0]), float(extent[1])
        if not (0 < eh <= H and 0 < ew <= W):
            raise ValueError(f"extent {eh}x{ew} is not within the {H}x{W} input")
        if (eh, ew) == (H, W):
            extent = None
    else:
        eh, ew = H, W
    if extent is None and (H, W) == (h, w):
        return a.copy()
    if h < 1 or w < 1:
        raise ValueError(f"cannot resize to {h}x{w}")
    if interpolation == "auto":
        interpolation = "area" if h <= eh and w <= ew else "linear"
    flag = getattr(cv2, {"nearest": "INTER_NEAREST_EXACT", "linear": "INTER_LINEAR", "cubic": "INTER_CUBIC",
                         "area": "INTER_AREA"}[interpolation])
    src = a
    if a.dtype == np.uint16 and interpolation == "area" and a.shape[2] > 4:
        src = a.astype(np.float32)
    if extent is None:
        def one(x: np.ndarray) -> np.ndarray:
            return cv2.resize(x, (w, h), interpolation=flag)
    else:
        fx, fy = w / ew, h / eh

        def one(x: np.ndarray) -> np.ndarray:   # round(W * fx) >= w, round(H * fy) >= h: then cut to (h, w)
            return cv2.resize(x, None, fx=fx, fy=fy, interpolation=flag)[:h, :w]
    c = a.shape[2]
    if c <= 4:
        out = one(np.ascontiguousarray(src))
    else:  # OpenCV handles at most 4 channels per call for some interpolations
        out = np.stack([one(np.ascontiguousarray(src[..., i])) for i in range(c)], axis=-1)
    if out.ndim == 2:
        out = out[..., None]
    return np.ascontiguousarray(out).astype(a.dtype, copy=False)


_FAST_DTYPES = (np.uint8, np.uint16, np.float32)


def resize_area_fast(a: np.ndarray, h: int, w: int) -> np.ndarray:
    """An approximate area downscale of an (H, W, C) array to (h, w, C), several times faster than
    the exact one (OpenCV's generic ``INTER_AREA`` path is scalar for non-integer ratios).

    Integer pre-reduction: both axes are halved together while both ratios stay at least 4 (a
    linear resize at scale 2 averages pixel pairs: OpenCV's vectorised path). An axis whose ratio
    is then still at least 2 goes to twice its target size, and is halved last. The step between
    takes the remaining ratio r (mostly in [1, 2)) by a 3-tap blur [a, 1 - 2a, a] with the variance
    the area kernel adds over a linear one (a = (r^2 - 1) / 24) and a linear resize. Every stage
    maps the image's extent onto the next one's (no shift). Other dtypes, more than 4 channels or a
    growing axis: the exact resize.
    """
    H, W = a.shape[:2]
    if a.dtype.type not in _FAST_DTYPES or a.shape[2] > 4 or h > H or w > W:
        return resize_hwc(a, h, w, "area")
    cv2 = load_cv2()
    src = np.ascontiguousarray(a)
    while H >= 4 * h and W >= 4 * w:
        H, W = H // 2, W // 2
        src = cv2.resize(src, (W, H), interpolation=cv2.INTER_LINEAR)
    ky, kx = (2 if H >= 2 * h else 1), (2 if W >= 2 * w else 1)
    ay, ax = ((min(r, 4.0) ** 2 - 1) / 24 for r in (H / (ky * h), W / (kx * w)))
    if ay > 0 or ax > 0:
        kx_, ky_ = (np.array([t, 1 - 2 * t, t], np.float32) for t in (ax, ay))
        src = cv2.sepFilter2D(src, -1, kx_, ky_, borderType=cv2.BORDER_REFLECT)
    out = cv2.resize(src, (kx * w, ky * h), interpolation=cv2.INTER_LINEAR)
    if kx > 1 or ky > 1:
        out = cv2.resize(out, (w, h), interpolation=cv2.INTER_LINEAR)
    return out.reshape(h, w, a.shape[2])


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


def affine_matrix(h: int, w: int, angle: float, scale: float, tx: float = 0.0, ty: float = 0.0) -> np.ndarray:
    """The 2x3 forward map (x, y) -> (x', y') rotating by ``angle`` degrees (counter-clockwise as
    displayed) and scaling about the image centre, then translating by (tx, ty) pixels."""
    r = math.radians(angle)
    a, b = scale * math.cos(r), scale * math.sin(r)
    cx, cy = (w - 1) / 2.0, (h - 1) / 2.0
    return np.array([[a, b, (1 - a) * cx - b * cy + tx],
                     [-b, a, b * cx + (1 - a) * cy + ty]], dtype=np.float64)


def _inverse_maps(M: np.ndarray, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Source coordinates (map_x, map_y), float32 (h, w), of every output pixel under forward map M."""
    Mi = load_cv2().invertAffineTransform(M)
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    mx = Mi[0, 0] * xs + Mi[0, 1] * ys + Mi[0, 2]
    my = Mi[1, 0] * xs + Mi[1, 1] * ys + Mi[1, 2]
    return mx.astype(np.float32), my.astype(np.float32)


def remap_nearest(a: np.ndarray, mx: np.ndarray, my: np.ndarray, fill: Any = 0) -> np.ndarray:
    """Nearest-neighbour gather of an (H, W, ...) array of any dtype at source coordinates."""
    H, W = a.shape[:2]
    xi = np.floor(mx + 0.5).astype(np.int64)
    yi = np.floor(my + 0.5).astype(np.int64)
    inside = (xi >= 0) & (xi < W) & (yi >= 0) & (yi < H)
    out = a[np.clip(yi, 0, H - 1), np.clip(xi, 0, W - 1)]
    out[~inside] = fill
    return out


def _remap_linear(a: np.ndarray, mx: np.ndarray, my: np.ndarray, fill: float, interpolation: str) -> np.ndarray:
    cv2 = load_cv2()
    flag = {"linear": cv2.INTER_LINEAR, "cubic": cv2.INTER_CUBIC}[interpolation]
    c = a.shape[2]
    src = a if a.dtype in (np.uint8, np.uint16, np.int16, np.float32, np.float64) else a.astype(np.float64)
    parts = []
    for i in range(0, c, 4):
        blk = np.ascontiguousarray(src[..., i:i + 4])
        n = blk.shape[2]
        o = cv2.remap(blk, mx, my, flag, borderMode=cv2.BORDER_CONSTANT, borderValue=(fill,) * 4)
        parts.append(o.reshape(o.shape[:2] + (n,)))
    out = np.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    if out.dtype != a.dtype:
        out = np.rint(out).astype(a.dtype) if np.issubdtype(a.dtype, np.integer) else out.astype(a.dtype)
    return out


def warp_image(a: np.ndarray, M: np.ndarray, fill: float = 0, interpolation: str = "linear") -> np.ndarray:
    """Warp an (H, W, C) array with the forward 2x3 map ``M``, keeping its size; uncovered pixels
    get ``fill``. ``interpolation: nearest`` gathers (label maps: no value is invented)."""
    H, W = a.shape[:2]
    mx, my = _inverse_maps(M, H, W)
    if interpolation == "nearest":
        return remap_nearest(a, mx, my, fill)
    return _remap_linear(a, mx, my, fill, interpolation)


def warp_flow(a: np.ndarray, M: np.ndarray, interpolation: str = "linear") -> np.ndarray:
    """Warp an (H, W, 2) flow field with the forward 2x3 map ``M``: resampled with invalid (NaN)
    vectors kept out of the interpolation (or gathered, for ``nearest``), pixels from outside the
    input NaN, and every vector multiplied by M's linear part."""
    H, W = a.shape[:2]
    mx, my = _inverse_maps(M, H, W)
    if interpolation == "nearest":
        out = remap_nearest(a, mx, my, np.nan).astype(np.float32)
    else:
        valid = np.isfinite(a).all(axis=-1)
        # one 3-channel call for (u, v, valid): OpenCV treats edges differently per channel count
        f = np.dstack([np.where(valid[..., None], a, 0), valid[..., None]]).astype(np.float32)
        r = _remap_linear(f, mx, my, 0.0, "linear")
        num, den = r[..., :2], r[..., 2:]
        out = np.where(den > 1e-3, num / np.maximum(den, 1e-3), np.nan).astype(np.float32)
    (a00, a01), (a10, a11) = (np.float32(x) for x in M[0, :2]), (np.float32(x) for x in M[1, :2])
    u, v = out[..., 0], out[..., 1]  # elementwise, not matmul: no BLAS in the byte path
    return np.stack([a00 * u + a01 * v, a10 * u + a11 * v], axis=-1).astype(np.float32)


# -- annotations: boxes and keypoints ----------------------------------------------------------
# Coordinates are continuous pixel coordinates: pixel (i, j) covers [j, j + 1) x [i, i + 1), so its
# centre is (j + 0.5, i + 0.5) and a W-wide grid spans [0, W]. A step's ``coord_map`` is a 2x3
# forward map in these coordinates; the kernels below move annotations with it.

def continuous_map(M: np.ndarray) -> np.ndarray:
    """The forward map of :func:`affine_matrix` (pixel-index coordinates: a centre at integer i)
    in continuous coordinates (a centre at i + 0.5): x' = A (x - 0.5) + t + 0.5."""
    A = np.asarray(M, np.float64)[:, :2]
    t = np.asarray(M, np.float64)[:, 2] + 0.5 - A @ np.array([0.5, 0.5])
    return np.column_stack([A, t])


def reflects(M: np.ndarray) -> np.ndarray:
    """Whether the map mirrors (its linear part has a negative determinant): left and right swap.
    ``M`` is one 2x3 map (a bool array of shape ()) or one per row, (n, 2, 3) (shape (n,))."""
    M = np.asarray(M, np.float64)
    return M[..., 0, 0] * M[..., 1, 1] - M[..., 0, 1] * M[..., 1, 0] < 0


def _points(p: np.ndarray, M: np.ndarray) -> np.ndarray:
    """Points (..., 2) through the map ``M``: one 2x3 map, or one per row of ``p`` ((n, 2, 3) for
    ``p`` of shape (n, ..., 2)); the same float64 operations either way."""
    M = np.asarray(M, np.float64)
    x, y = p[..., 0], p[..., 1]
    lead = M.shape[:-2]
    m = M.reshape(lead + (1,) * (x.ndim - len(lead)) + (2, 3))
    return np.stack([m[..., 0, 0] * x + m[..., 0, 1] * y + m[..., 0, 2],
                     m[..., 1, 0] * x + m[..., 1, 1] * y + m[..., 1, 2]], axis=-1)


def check_boxes(b: np.ndarray) -> np.ndarray:
    """``b`` as float64 (N, 4); a ValueError for another shape, non-finite values or x2 < x1 / y2 < y1."""
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"boxes must be (N, 4) x1, y1, x2, y2, got shape {b.shape}")
    b = b.astype(np.float64)
    if not np.isfinite(b).all():
        raise ValueError(f"box {int(np.flatnonzero(~np.isfinite(b).all(axis=1))[0])} holds a non-finite value")
    bad = np.flatnonzero((b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1]))
    if bad.size:
        raise ValueError(f"box {int(bad[0])} {b[bad[0]].tolist()} has x2 < x1 or y2 < y1 (boxes are x1, y1, x2, y2)")
    return b


def box_visibility(b: np.ndarray, hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Boxes clipped to an (h, w) grid, and the visible fraction of each: clipped area / area
    (a zero-area box: 1 if it lies on the grid, else 0)."""
    h, w = hw
    c = np.clip(b, 0, np.array([w, h, w, h], np.float64))
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    clipped = (c[:, 2] - c[:, 0]) * (c[:, 3] - c[:, 1])
    on_grid = (c == b).all(axis=1).astype(np.float64)
    vis = np.where(area > 0, clipped / np.where(area > 0, area, 1.0), on_grid)
    return c, vis


def map_boxes(boxes: np.ndarray, M: np.ndarray, hw: tuple[int, int], min_visibility: float = 0.0,
              min_area: float = 0.0, min_width: float = 0.0, min_height: float = 0.0) -> np.ndarray:
    """Move (N, 4) boxes with the forward map ``M`` (one, or one per box: (N, 2, 3)) onto an (h, w)
    grid: the 4 corners mapped, their enclosing box taken and clipped to the grid. A box with nothing
    visible, a visible fraction under ``min_visibility``, or a visible (clipped) area, width or height in
    output pixels under ``min_area``, ``min_width``, ``min_height`` (albumentations' ``BboxParams`` filters)
    comes back as a row of NaN (the caller drops it and its tied rows). Every threshold is inclusive."""
    b = check_boxes(np.asarray(boxes))
    corners = b[:, [0, 1, 2, 1, 0, 3, 2, 3]].reshape(-1, 4, 2)   # (N, 4 corners, x y)
    t = _points(corners, M)
    moved = np.concatenate([t.min(axis=1), t.max(axis=1)], axis=1)
    clipped, vis = box_visibility(moved, hw)
    out = clipped.astype(np.float32)
    # nothing visible: decided on the stored (float32) box, so a box with area never comes back with
    # none; the fraction in float64, with rounding's slack (1e-9) at the boundary
    area = (moved[:, 2] - moved[:, 0]) * (moved[:, 3] - moved[:, 1])
    flat = (out[:, 2] <= out[:, 0]) | (out[:, 3] <= out[:, 1])
    gone = np.where(area > 0, flat, vis <= 0)
    small = vis < min_visibility - 1e-9
    if min_area or min_width or min_height:   # the clipped box's size in output pixels, float64, the same slack
        cw, ch = clipped[:, 2] - clipped[:, 0], clipped[:, 3] - clipped[:, 1]
        small |= (cw * ch < min_area - 1e-9) | (cw < min_width - 1e-9) | (ch < min_height - 1e-9)
    out[gone | small] = np.nan
    return out


def map_keypoints(kp: np.ndarray, M: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Move (N, K, 3) keypoints (x, y, visibility) with the forward map ``M`` exactly; a point that
    lands off the (h, w) grid (outside [0, w] x [0, h]: the image's extent, edges included, so a
    mirror maps the points in view onto the points in view) or is not finite gets visibility 0, and
    keeps its moved coordinates."""
    k = np.asarray(kp)
    if k.ndim != 3 or k.shape[2] != 3:
        raise ValueError(f"keypoints must be (N, K, 3) x, y, visibility, got shape {k.shape}")
    k = k.astype(np.float64)
    xy = _points(k[..., :2], M).astype(np.float32)   # in view or not: decided on the stored coordinates
    h, w = hw
    with np.errstate(invalid="ignore"):
        x, y = xy[..., 0], xy[..., 1]
        seen = np.isfinite(xy).all(axis=-1) & (x >= 0) & (x <= w) & (y >= 0) & (y <= h)
    vis = np.where(seen, k[..., 2], 0.0)
    return np.concatenate([xy, vis[..., None]], axis=-1).astype(np.float32)


def swap_pairs(kp: np.ndarray, pairs: list[list[int]]) -> np.ndarray:
    """(N, K, 3) keypoints with each declared (left, right) pair of keypoint indices swapped."""
    order = np.arange(kp.shape[1])
    for a, b in pairs:
        if not (0 <= a < len(order) and 0 <= b < len(order)):
            raise ValueError(f"flip pair [{a}, {b}] is outside the {len(order)} keypoints (indices from 0)")
        order[a], order[b] = b, a
    return kp[:, order]
