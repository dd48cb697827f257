"""2x3 maps of continuous pixel coordinates: composed, inverted, the EXIF orientations, and boxes and keypoints
taken through one (the way back to a source image).

Coordinates are those of :mod:`.geometry`'s annotation kernels: pixel (i, j) covers [j, j + 1) x [i, i + 1),
so a W-wide grid spans [0, W]. A map ``M`` (2x3) sends (x, y) to ``M @ (x, y, 1)``; maps compose as 3x3
matrices with a last row (0, 0, 1). Pure float64 arithmetic, no I/O.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np

#: the EXIF orientations Pillow's ``exif_transpose`` turns (1 is the identity)
ORIENTATIONS = (2, 3, 4, 5, 6, 7, 8)
#: the orientations that turn the image a quarter (its height and width swap)
TURNS = (5, 6, 7, 8)

IDENTITY = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])

#: the key of an image field's meta under which a reduced decode hands its first resample the source's extent
#: ([height, width] in the decoded pixels, fractional: H/k, W/k) instead of resampling it onto its own grid
#: (``decoders/image.py``); the step that takes it (``resize``) removes it
EXTENT = "extent"
#: the key of a keypoints field's meta holding, per stored keypoint slot, the source's slot it holds, when a
#: mirror with ``flip_pairs`` swapped them (transforms/source_map.py writes it; Dataset.to_source reads it)
SOURCE_ORDER = "source_order"


def as_map(M: Any, what: str = "map") -> np.ndarray:
    """``M`` as a float64 (2, 3) array (a 3x3 one loses its last row, which must be 0 0 1); a ValueError for
    another shape or a non-finite value."""
    a = np.asarray(M, dtype=np.float64)
    if a.shape == (3, 3):
        if not np.array_equal(a[2], [0.0, 0.0, 1.0]):
            raise ValueError(f"{what}: a 3x3 map's last row must be 0 0 1, got {a[2].tolist()}")
        a = a[:2]
    if a.shape != (2, 3):
        raise ValueError(f"{what}: expected a 2x3 map, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{what}: the map holds a non-finite value")
    return a


def _full(M: np.ndarray) -> np.ndarray:
    return np.vstack([M, [0.0, 0.0, 1.0]])


def compose(A: Any, B: Any) -> np.ndarray:
    """The map that applies ``B`` first, then ``A`` (``A @ B`` in 3x3 form), as 2x3."""
    return (_full(as_map(A)) @ _full(as_map(B)))[:2]


def invert(M: Any) -> np.ndarray:
    """The inverse of a 2x3 map; a ValueError when it has none (its linear part is singular)."""
    a = as_map(M)
    det = a[0, 0] * a[1, 1] - a[0, 1] * a[1, 0]
    if det == 0 or not np.isfinite(det):
        raise ValueError(f"the map {a.tolist()} collapses the plane (determinant 0): it has no inverse")
    lin = np.array([[a[1, 1], -a[0, 1]], [-a[1, 0], a[0, 0]]]) / det
    return np.column_stack([lin, -lin @ a[:, 2]])


def scale_map(sx: float, sy: float) -> np.ndarray:
    """x' = sx x, y' = sy y."""
    return np.array([[float(sx), 0.0, 0.0], [0.0, float(sy), 0.0]])


def orientation_map(o: int, w: int, h: int) -> np.ndarray:
    """The forward map of EXIF orientation ``o`` (1..8) on a ``w`` x ``h`` image (the stored pixels, before the
    turn): where Pillow's ``exif_transpose`` puts each point (x in [0, w], y in [0, h])."""
    rows = {1: [[1, 0, 0], [0, 1, 0]], 2: [[-1, 0, w], [0, 1, 0]], 3: [[-1, 0, w], [0, -1, h]],
            4: [[1, 0, 0], [0, -1, h]], 5: [[0, 1, 0], [1, 0, 0]], 6: [[0, -1, h], [1, 0, 0]],
            7: [[0, -1, h], [-1, 0, w]], 8: [[0, 1, 0], [-1, 0, w]]}.get(o if isinstance(o, int) else None)
    if rows is None:
        raise ValueError(f"EXIF orientation {o!r} is not one of 1..8")
    return np.array(rows, dtype=np.float64)


def decode_map(decoded_hw: tuple[int, int], reduce: int = 1, orientation: int = 1,
               source_hw: Sequence[int] | None = None,
               extent: Sequence[float] | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """The map from a decoded image's pixels back to its source file's stored pixels, and the source's
    (height, width). The decoder read the source at 1/``reduce`` (the reduced image, ceil(H/k) x ceil(W/k),
    covers the whole source, so each axis scales by its reduced size over the source's) and then turned it by
    its EXIF ``orientation``. ``source_hw`` (the stored pixels' height and width) is needed when ``reduce`` > 1;
    without a reduction it is the decoded size, unturned. ``extent`` ([height, width], unturned, see
    :data:`EXTENT`): the source covers only that part of the decoded pixels (H/k x W/k: libjpeg's padding
    past the edges left for the first resample to cut)."""
    h, w = (int(decoded_hw[0]), int(decoded_hw[1]))
    o, k = int(orientation), int(reduce)
    hr, wr = (w, h) if o in TURNS else (h, w)      # the reduced image before its turn
    eh, ew = (hr, wr) if extent is None else (float(extent[0]), float(extent[1]))   # the source's part of it
    if source_hw is None:
        if k != 1 or extent is not None:
            raise ValueError(f"decoded at 1/{k} scale and the source's size is not recorded")
        H, W = hr, wr
    else:
        H, W = int(source_hw[0]), int(source_hw[1])
    if H < 1 or W < 1:
        raise ValueError(f"source size {H}x{W} is not a size")
    forward = compose(orientation_map(o, wr, hr), scale_map(ew / W, eh / H))
    return invert(forward), (H, W)


def boxes_through(boxes: Any, M: Any) -> np.ndarray:
    """(N, 4) boxes x1 y1 x2 y2 through map ``M``: the box enclosing the 4 mapped corners (exact for flips,
    scales, shifts and quarter turns; for a rotation by another angle, the rotated box's enclosing box).
    float64; NaN rows (padding) stay NaN."""
    b = np.asarray(boxes, dtype=np.float64)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"boxes must be (N, 4) x1, y1, x2, y2, got shape {b.shape}")
    m = as_map(M)
    corners = b[:, [0, 1, 2, 1, 0, 3, 2, 3]].reshape(-1, 4, 2)
    x, y = corners[..., 0], corners[..., 1]
    t = np.stack([m[0, 0] * x + m[0, 1] * y + m[0, 2], m[1, 0] * x + m[1, 1] * y + m[1, 2]], axis=-1)
    return np.concatenate([t.min(axis=1), t.max(axis=1)], axis=1)


def points_through(points: Any, M: Any) -> np.ndarray:
    """Points (..., 2 or more: x, y first; any further columns such as a visibility kept) through map ``M``;
    float64."""
    p = np.array(points, dtype=np.float64)
    if p.ndim < 1 or p.shape[-1] < 2:
        raise ValueError(f"points must end in an axis of x, y (and visibility), got shape {p.shape}")
    m = as_map(M)
    x, y = p[..., 0].copy(), p[..., 1].copy()
    p[..., 0] = m[0, 0] * x + m[0, 1] * y + m[0, 2]
    p[..., 1] = m[1, 0] * x + m[1, 1] * y + m[1, 2]
    return p


def to_json(M: Any) -> list[list[float]]:
    """A map as JSON: two rows of three floats (-0.0 written as 0.0); a number within 4 units in the last place
    of its 15-digit form is written as that (a composed 7.000000000000001 is the 7.0 it means, and the meta
    stays short), any other exactly (10.666666666666666 stays: its 15 digits would move it by 20 units)."""
    return [[_snap(float(v)) + 0.0 for v in row] for row in as_map(M)]


def _snap(v: float) -> float:
    r = float(f"{v:.15g}")
    return r if abs(r - v) <= 4 * math.ulp(v) else v


# The build records one map per image and step (transforms/source_map.py); the maps of a dataset repeat (one
# decode map per source size, one resize map per grid), and numpy's per-call cost on 2x3 arrays was ~0.2 ms a
# sample. These two give the very results of the functions they wrap, remembered per distinct input (a value
# equal as a key is equal as a number: 1 == 1.0; 0.0 == -0.0, whose signs to_json writes alike), as new lists.

def _key(M: Any) -> Any:
    """A hashable copy of a map given as nested lists or an array (TypeError for anything unhashable)."""
    rows = M.tolist() if isinstance(M, np.ndarray) else M
    return tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in rows)


@functools.lru_cache(maxsize=4096)
def _decode_map_json(decoded_hw: Any, reduce: Any, orientation: Any, source_hw: Any, extent: Any) -> Any:
    T, hw = decode_map(decoded_hw, reduce, orientation, source_hw, extent)
    return _key(to_json(T)), hw


def decode_map_json(decoded_hw: Sequence[int], reduce: Any = 1, orientation: Any = 1, source_hw: Any = None,
                    extent: Any = None) -> tuple[list[list[float]], tuple[int, int]]:
    """``to_json`` of :func:`decode_map`'s map, and the source's (height, width); remembered per input."""
    T, hw = _decode_map_json(tuple(decoded_hw), reduce, orientation,
                             None if source_hw is None else _key(source_hw),
                             None if extent is None else _key(extent))
    return [list(r) for r in T], hw


@functools.lru_cache(maxsize=4096)
def _back_through(T: Any, forward: Any) -> Any:
    return _key(to_json(compose(T, invert(forward))))


def back_through(T: Any, forward: Any) -> list[list[float]]:
    """``to_json(compose(T, invert(forward)))``: map ``T`` (back to the source) after a step that moved the
    image by ``forward``; remembered per input."""
    return [list(r) for r in _back_through(_key(T), _key(forward))]
