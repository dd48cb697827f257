"""The docs' rules, written again from the docs (never calling the code under test), as references.

Coordinates are continuous pixels (docs/annotations.md): pixel (i, j) covers [j, j + 1) x [i, i + 1).
A map is a 2x3 float64 matrix ``x' = A x + t``. Where the docs leave a rounding convention open (the
centred window of an odd margin, the size a ``shorter`` resize rounds to), the convention is stated here and
checked against the stored shapes, so a change of convention shows as a shape mismatch, not a silent pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

GEOMETRIC_2D = {"resize", "center_crop", "random_crop", "random_resized_crop", "random_flip", "random_affine"}
COLOUR_2D = {"convert", "color_jitter", "gaussian_noise"}
RANDOM_STEPS = {"random_crop", "random_resized_crop", "random_flip", "random_affine", "color_jitter",
                "gaussian_noise", "temporal_jitter", "random_gain", "time_shift", "random_flip3d", "random_rot90",
                "elastic"}


def shift_scale(sx: float, sy: float, tx: float, ty: float) -> np.ndarray:
    return np.array([[sx, 0.0, tx], [0.0, sy, ty]])


IDENTITY = shift_scale(1, 1, 0, 0)


def compose(second: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The map ``second(first(x))``."""
    A = second[:, :2] @ first[:, :2]
    t = second[:, :2] @ first[:, 2] + second[:, 2]
    return np.column_stack([A, t])


def exif_map(orientation: int, H: int, W: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Stored -> displayed coordinates of an EXIF orientation (the TIFF/EXIF definitions: 2 mirror, 3 turn 180,
    4 flip, 5 transpose, 6 turn 90 clockwise, 7 transverse, 8 turn 90 counter-clockwise)."""
    o = orientation
    if o == 1:
        return IDENTITY, (H, W)
    if o == 2:
        return shift_scale(-1, 1, W, 0), (H, W)
    if o == 3:
        return shift_scale(-1, -1, W, H), (H, W)
    if o == 4:
        return shift_scale(1, -1, 0, H), (H, W)
    if o == 5:   # x' = y, y' = x
        return np.array([[0.0, 1, 0], [1, 0, 0]]), (W, H)
    if o == 6:   # x' = H - y, y' = x
        return np.array([[0.0, -1, H], [1, 0, 0]]), (W, H)
    if o == 7:   # x' = H - y, y' = W - x
        return np.array([[0.0, -1, H], [-1, 0, W]]), (W, H)
    if o == 8:   # x' = y, y' = W - x
        return np.array([[0.0, 1, 0], [-1, 0, W]]), (W, H)
    raise ValueError(orientation)


def reduced(h: int, w: int, k: int) -> tuple[int, int]:
    return -(-h // k), -(-w // k)


def side_round(H: int, W: int, n: int, shorter: bool) -> tuple[int, int]:
    """``shorter`` / ``longer``: that side becomes n, the other keeps the aspect ratio, rounded half to even
    (Python's round; checked against the stored shape)."""
    if (H <= W) == shorter:
        return n, max(1, int(round(W * n / H)))
    return max(1, int(round(H * n / W))), n


def resize_target(p: dict, H: int, W: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(scaled size, output size, (top, left) of the scaled image in the output)."""
    if p.get("shorter") is not None:
        hw = side_round(H, W, p["shorter"], True)
        return hw, hw, (0, 0)
    if p.get("longer") is not None:
        hw = side_round(H, W, p["longer"], False)
        return hw, hw, (0, 0)
    size = p["size"] if isinstance(p["size"], list) else [p["size"], p["size"]]
    h, w = size
    if p.get("keep_aspect"):
        s = min(h / H, w / W)
        sh, sw = max(1, min(h, int(round(H * s)))), max(1, min(w, int(round(W * s))))
        return (sh, sw), (h, w), ((h - sh) // 2, (w - sw) // 2)   # centred: the extra pixel goes after
    return (h, w), (h, w), (0, 0)


def pair(v: Any) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


@dataclass
class Move:
    """One step's effect on the grid: ``M`` maps input to output coordinates; ``hw`` is the output size."""
    name: str
    M: np.ndarray
    hw: tuple[int, int]
    resample: str          # none (pixels moved whole), scale (a resize), affine (a warp)
    min_visibility: float
    scale: tuple[float, float] = (1.0, 1.0)   # output px per input px (x, y)
    params: Optional[dict] = None
    min_area: float = 0.0     # albumentations' size filters: the clipped box's area, width, height in output px
    min_width: float = 0.0
    min_height: float = 0.0


def step_move(name: str, p: dict, rec: Optional[dict], grid: tuple[int, int]) -> Optional[Move]:
    """The documented map of a 2D step on a ``grid`` (H, W), with its recorded draw ``rec``; None for steps
    that keep the grid (colour, audio, ...)."""
    mv = float(p.get("min_visibility", 0.0))
    if p.get("fields") == [] or name not in GEOMETRIC_2D:
        return None
    m = _step_move(name, p, rec, grid, mv)
    for k in SIZE_FILTERS:
        setattr(m, k, float(p.get(k, 0.0)))
    return m


#: docs/annotations.md: the steps that take min_visibility take albumentations' size filters too (resize and
#: random_flip take neither: they never move an on-image box off it)
SIZE_FILTERS = ("min_area", "min_width", "min_height")


def _step_move(name: str, p: dict, rec: Optional[dict], grid: tuple[int, int], mv: float) -> Move:
    H, W = grid
    if name == "resize":
        (sh, sw), out, (top, left) = resize_target(p, H, W)
        return Move(name, shift_scale(sw / W, sh / H, left, top), out, "scale", 0.0, (sw / W, sh / H))
    if name == "center_crop":
        h, w = pair(p["size"])
        PH, PW = max(H, h), max(W, w)
        # padded centred ((PH - H) // 2 before), then the centred window ((PH - h) // 2 from the top)
        return Move(name, shift_scale(1, 1, (PW - W) // 2 - (PW - w) // 2, (PH - H) // 2 - (PH - h) // 2), (h, w),
                    "none", mv)
    if name == "random_crop":
        h, w = pair(p["size"])
        pad = p.get("padding", 0)
        PH, PW = max(H + 2 * pad, h), max(W + 2 * pad, w)
        ty = pad + (PH - H - 2 * pad) // 2 - rec["top"]
        tx = pad + (PW - W - 2 * pad) // 2 - rec["left"]
        return Move(name, shift_scale(1, 1, tx, ty), (h, w), "none", mv)
    if name == "random_resized_crop":
        h, w = pair(p["size"])
        sx, sy = w / rec["width"], h / rec["height"]
        return Move(name, shift_scale(sx, sy, -rec["left"] * sx, -rec["top"] * sy), (h, w), "scale", mv, (sx, sy))
    if name == "random_flip":
        hz, vt = rec["horizontal"], rec["vertical"]
        return Move(name, shift_scale(-1 if hz else 1, -1 if vt else 1, W if hz else 0, H if vt else 0), (H, W),
                    "none", 0.0, params={"mirror": hz != vt, "pairs": p.get("flip_pairs") or []})
    if name == "random_affine":
        a, s = math.radians(rec["angle"]), rec["scale"]
        # rotation counter-clockwise as displayed (y down) and scale about the centre (W/2, H/2), then the shift
        c, d = s * math.cos(a), s * math.sin(a)
        M = np.array([[c, d, W / 2 - c * W / 2 - d * H / 2 + rec["tx"]],
                      [-d, c, H / 2 + d * W / 2 - c * H / 2 + rec["ty"]]])
        trivial = rec["angle"] == 0 and s == 1 and rec["tx"] == 0 and rec["ty"] == 0
        return Move(name, M, (H, W), "none" if trivial else "affine", mv, (s, s))
    raise AssertionError(name)


def mirrors(M: np.ndarray) -> bool:
    return float(np.linalg.det(M[:, :2])) < 0


@dataclass
class BoxRef:
    box: np.ndarray          # (4,) float64, clipped
    kept: bool
    ambiguous: bool          # the keep decision is within float noise of its threshold
    clipped: bool = False    # the moved box left the grid in part: the object's visible pixels may not reach it


def move_box(b: np.ndarray, m: Move, eps: float = 1e-4) -> BoxRef:
    """docs/annotations.md: 4 corners through the map, the enclosing box, clipped; dropped when nothing is
    visible or the visible fraction is under min_visibility (inclusive); a zero-area box is visible while on
    the image; dropped too when the clipped box's area, width or height in output pixels is under min_area,
    min_width, min_height (inclusive: albumentations' BboxParams)."""
    x1, y1, x2, y2 = b
    pts = np.array([[x1, y1], [x2, y1], [x1, y2], [x2, y2]], np.float64)
    q = pts @ m.M[:, :2].T + m.M[:, 2]
    e = np.array([q[:, 0].min(), q[:, 1].min(), q[:, 0].max(), q[:, 1].max()])
    h, w = m.hw
    c = np.array([min(max(e[0], 0), w), min(max(e[1], 0), h), min(max(e[2], 0), w), min(max(e[3], 0), h)])
    area = (e[2] - e[0]) * (e[3] - e[1])
    vis_w, vis_h = max(c[2] - c[0], 0.0), max(c[3] - c[1], 0.0)
    sizes = ((vis_w * vis_h, m.min_area), (vis_w, m.min_width), (vis_h, m.min_height))
    big = all(v >= t for v, t in sizes)
    near_size = any(t > 0 and abs(v - t) < eps * max(1.0, t) for v, t in sizes)
    if area <= 0:
        on = e[0] >= 0 and e[2] <= w and e[1] >= 0 and e[3] <= h
        near = min(abs(e[0]), abs(e[2] - w), abs(e[1]), abs(e[3] - h)) < eps
        return BoxRef(c, bool(on and big), bool(near or near_size), not np.allclose(c, e))
    frac = vis_w * vis_h / area
    kept = vis_w > 0 and vis_h > 0 and frac >= m.min_visibility and big
    amb = min(vis_w, vis_h) < eps or abs(frac - m.min_visibility) < eps or near_size
    return BoxRef(c, bool(kept), bool(amb), bool(np.abs(c - e).max() > 1e-9))


def move_keypoints(kp: np.ndarray, m: Move, pairs: list) -> np.ndarray:
    """docs/annotations.md: exact map; visibility 0 off [0, w] x [0, h] (the edges are on the image: a mirror maps
    x = 0 to x = W), judged with 1e-6 px of slack for the float noise of composed maps (seeds 101475, 101567,
    101690: a point on an edge, put a hair outside by a flip, then moved inside by an affine, stayed at 0 here
    where the docs keep it visible); a mirror swaps flip_pairs."""
    out = kp.astype(np.float64).copy()
    if len(out) == 0:
        return out
    xy = out[..., :2] @ m.M[:, :2].T + m.M[:, 2]
    out[..., :2] = xy
    h, w = m.hw
    eps = 1e-6
    off = (xy[..., 0] < -eps) | (xy[..., 0] > w + eps) | (xy[..., 1] < -eps) | (xy[..., 1] > h + eps)
    out[..., 2] = np.where(off, 0, out[..., 2])
    if mirrors(m.M):
        for a, b in pairs:
            out[..., [a, b], :] = out[..., [b, a], :]
    return out


def geometric_records(steps: list[dict], augment: list[dict]) -> list[tuple[str, dict, Optional[dict]]]:
    """(name, options, drawn parameters) per step, pairing each random step with its record in
    ``meta["augment"]`` (recorded in step order)."""
    out, recs = [], list(augment or [])
    for s in steps:
        (name, p), = s.items()
        p = p or {}
        rec = None
        if name in RANDOM_STEPS and p.get("fields") == []:
            out.append((name, p, None))   # a step told to change nothing records no draw
            continue
        if name in RANDOM_STEPS:
            j = next((i for i, r in enumerate(recs) if r.get("step") == name), None)
            if j is None:
                raise LookupError(f"meta['augment'] has no record of step {name!r}: {augment}")
            rec = recs.pop(j)
        out.append((name, p, rec))
    return out


# -- audio ------------------------------------------------------------------------------------------------------
def window_starts(n: int, length: int, hop: int, short: str, tail: str) -> list[int]:
    """docs/reference-steps.md `windows`: starts 0, hop, ... of every full window; a recording shorter than
    one window is dropped or padded to one; with tail: pad, one more window over the samples after the last."""
    if n < length:
        return [0] if short == "pad" else []
    starts = list(range(0, n - length + 1, hop))
    last_end = starts[-1] + length
    if tail == "pad" and last_end < n:
        starts.append(starts[-1] + hop)
    return starts


# -- video ------------------------------------------------------------------------------------------------------
def frame_clips(n: int, length: int, every: int, stride: Optional[int], short: str, pad: str,
                max_clips: Optional[int]) -> list[list[int]]:
    """docs/reference-steps.md `clips` by frames: clip k takes frames s_k + j * every (j < length), starts
    ``stride`` apart (default the clip's span, (length - 1) * every + 1); a video shorter than one span is
    dropped, or padded to one clip with its last frame (``last``) or black frames (``zero``, index -1)."""
    span = (length - 1) * every + 1
    stride = stride or span
    clips = []
    if n >= span:
        s = 0
        while s + span <= n:
            clips.append([s + j * every for j in range(length)])
            s += stride
    elif short == "pad" and n > 0:
        idx = [j * every for j in range(length)]
        clips.append([i if i < n else (n - 1 if pad == "last" else -1) for i in idx])
    if max_clips is not None:
        clips = clips[:max_clips]
    return clips


def time_clips(pts: list[float], fps: float, length: int, stride_s: float, short: str, pad: str,
               max_clips: Optional[int], duration: float) -> list[list[int]]:
    """`clips` by time: frame j of clip k is the frame on screen at t0 + k stride_s + j / fps (the last
    frame whose pts <= t)."""
    clips = []
    t0 = pts[0] if pts else 0.0
    span = (length - 1) / fps
    k = 0
    while True:
        start = t0 + k * stride_s
        if start + span > duration + 1e-9 and not (k == 0 and short == "pad"):
            break
        clip = []
        for j in range(length):
            t = start + j / fps
            on = [i for i, p in enumerate(pts) if p <= t + 1e-6]
            clip.append(on[-1] if on else 0)
        clips.append(clip)
        k += 1
        if start + span > duration + 1e-9:
            break
        if max_clips is not None and len(clips) >= max_clips:
            break
    return clips[:max_clips] if max_clips is not None else clips
