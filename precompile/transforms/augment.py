"""Seeded augmentation steps (``random = True``), with their pure kernels at the top.

A random step draws its parameters once per sample (``sample_params``), from
the generator the engine gives it (``seeding.rng_for(seed, key, copy)``), and
applies them to every targeted field, so an image pair, its flow and its masks
get the same crop, flip and rotation; a volume and its mask the same flips and
deformation. Flow vectors follow the geometry (a horizontal flip negates u, a
scale scales them, a rotation rotates them); masks are resampled with nearest
neighbour; colour steps touch only images and clips.

Drawn parameters are plain JSON values and are recorded in
``sample.meta["augment"]`` as ``{"step": name, **params}``, one record per
random step that had fields to change, in step order. :func:`replay` re-runs a
recipe's steps from those records and reproduces the stored bytes.

For the un-augmented original (copy 0 when ``copies > 0`` and
``keep_original``) the engine calls :meth:`RandomStep.run_original`: each step
applies its *neutral* parameters (no flip, no jitter, the centred window for
crops), so the original has the same shape as the augmented copies.

Kernels: functions of ``(array, ...)``, no RNG and no I/O. Layouts are
channel-last: images and masks (H, W, C), flow (H, W, 2), clips (T, H, W, C),
volumes (D, H, W) (trailing channel axes carried along), audio (C, N).
"""
from __future__ import annotations

import math
from typing import Any, Literal, Optional, Sequence, Union

import numpy as np
from pydantic import ConfigDict, field_validator, model_validator

from ..errors import StepError
from ..kinds import PLANAR, VOLUMETRIC, Kind, kinds
from ..registry import STEPS
from ..sample import FieldSpec, Sample
from . import functional as F
from .base import Step, StepParams
from .geometric import PlanarStep, _set_hw, crop_spec


# ==================================================================================
# pure kernels
# ==================================================================================
def _cv2():
    import cv2

    return cv2



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
    Mi = _cv2().invertAffineTransform(M)
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
    cv2 = _cv2()
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


def _dtype_clip(f: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(f), info.min, info.max).astype(dtype)
    return f.astype(dtype)


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
    out[..., :cc] = _dtype_clip(f, a.dtype)
    return out


def add_noise(a: np.ndarray, std: float, seed: int) -> np.ndarray:
    """Add zero-mean gaussian noise of ``std`` (array units) from ``default_rng(seed)``;
    integer arrays are rounded and clipped to their range."""
    if std == 0:
        return a.copy()
    noise = np.random.default_rng(seed).standard_normal(a.shape, dtype=np.float32) * np.float32(std)
    return _dtype_clip(a.astype(np.float32) + noise, a.dtype)


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


def apply_gain(a: np.ndarray, gain_db: float, clip: bool = False) -> np.ndarray:
    """Multiply audio by 10^(gain_db/20); optionally clip to [-1, 1]."""
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


def flip_axes(a: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    return np.flip(a, axis=tuple(axes)).copy() if axes else a.copy()


def rot90(a: np.ndarray, k: int, plane: Sequence[int]) -> np.ndarray:
    return np.rot90(a, k, axes=tuple(plane)).copy()


def elastic_displacement(shape: Sequence[int], grid: int, magnitude: float, seed: int) -> np.ndarray:
    """A smooth (3, D, H, W) float32 displacement: a ``grid``^3 lattice of N(0, magnitude)
    voxel offsets from ``default_rng(seed)``, upsampled with cubic splines."""
    coarse = np.random.default_rng(seed).standard_normal((3, grid, grid, grid)) * magnitude
    wz, wy, wx = (_spline_matrix(int(n), grid) for n in shape[:3])
    # cubic-spline upsampling is separable: one small matrix per axis. Plain einsum loops (no
    # BLAS, whose thread count could change the summation order and so the bytes)
    t = np.einsum("ck,dijk->dijc", wx, coarse, optimize=False)
    t = np.einsum("bj,dijc->dibc", wy, t, optimize=False)
    return np.einsum("ai,dibc->dabc", wz, t, optimize=False).astype(np.float32)


def _spline_matrix(n: int, g: int) -> np.ndarray:
    """(n, g): row i weights the g lattice values for output position i (``ndimage.zoom``, cubic)."""
    from scipy import ndimage

    eye = np.eye(g)
    return np.stack([ndimage.zoom(eye[j], n / g, order=3, mode="nearest")[:n] for j in range(g)], axis=1)


def elastic(a: np.ndarray, grid: int, magnitude: float, seed: int, label: bool = False) -> np.ndarray:
    """Deform a (D, H, W[, ...]) volume by :func:`elastic_displacement` with
    ``scipy.ndimage.map_coordinates``: linear, or nearest for a label volume (``label``); edges repeated."""
    if magnitude == 0:
        return a.copy()
    from scipy import ndimage

    shp = a.shape[:3]
    disp = elastic_displacement(shp, grid, magnitude, seed)
    coords = np.indices(shp, dtype=np.float32) + disp
    order = 0 if label else 1
    flat = a.reshape(*shp, -1)
    out = np.empty_like(flat)
    for c in range(flat.shape[-1]):
        ch = flat[..., c]
        if order == 0:
            out[..., c] = ndimage.map_coordinates(ch, coords, order=0, mode="nearest", output=ch.dtype)
        else:
            r = ndimage.map_coordinates(ch.astype(np.float64), coords, order=1, mode="nearest")
            out[..., c] = _dtype_clip(r, a.dtype)
    return out.reshape(a.shape)


# ==================================================================================
# parameter helpers
# ==================================================================================
def _pair(v: Any, what: str, symmetric_about: float | None = None, lo_min: float | None = None) -> list[float]:
    """A number or [lo, hi] -> [lo, hi]. A number x means [c - x, c + x] about ``symmetric_about``
    (or exactly x when that is None)."""
    if isinstance(v, bool):
        raise ValueError(f"{what}: expected a number or [low, high], got {v!r}")
    if isinstance(v, (int, float)):
        if symmetric_about is None:
            lo = hi = float(v)
        else:
            if v < 0:
                raise ValueError(f"{what}: expected a non-negative number, got {v!r}")
            lo, hi = symmetric_about - float(v), symmetric_about + float(v)
    elif isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in v):
        lo, hi = float(v[0]), float(v[1])
    else:
        raise ValueError(f"{what}: expected a number or [low, high], got {v!r}")
    if lo > hi:
        raise ValueError(f"{what}: low {lo} is above high {hi}")
    if lo_min is not None:
        lo = max(lo, lo_min)
        if hi < lo_min:
            raise ValueError(f"{what}: must be at least {lo_min}")
    return [lo, hi]


def _uniform(rng: np.random.Generator, r: Sequence[float]) -> float:
    return float(r[0]) + 0.0 if r[0] == r[1] else float(rng.uniform(r[0], r[1]))  # + 0.0: no -0.0


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2 ** 63 - 1))




def _size_param(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v, v]
    if not (isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        n = len(v) if isinstance(v, (list, tuple)) else None
        raise ValueError(f"expected an integer or 2 integers [height, width], got {n} values" if n is not None
                         else f"expected an integer or 2 integers [height, width], got {v!r}")
    if v[0] < 1 or v[1] < 1:
        raise ValueError("sizes must be positive")
    return [int(v[0]), int(v[1])]


def _specs_of(sample: Sample) -> dict[str, FieldSpec]:
    return sample.specs()


class _Params(StepParams):
    model_config = ConfigDict(validate_default=True)  # defaults go through the same validators


class _NoRng:
    """Stands in for the generator where none may be used (replaying deterministic steps)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("a deterministic step tried to draw random numbers during replay")


# ==================================================================================
# the random step base
# ==================================================================================
class RandomStep(Step):
    """A step that draws its parameters from the rng; see the module docstring."""

    random = True

    def neutral_params(self, sample: Sample, targets: list[str]) -> dict[str, Any]:
        """The parameters of the un-augmented original (identity, or the centred window)."""
        raise NotImplementedError

    def field_params(self, params: dict[str, Any], field: str) -> dict[str, Any]:
        """The keyword arguments ``apply`` gets for one field (default: all of ``params``)."""
        return params

    def _targets(self, sample: Sample) -> list[str]:
        try:
            return self.targets(_specs_of(sample))
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e

    def replay(self, sample: Sample, params: dict[str, Any]) -> Sample:
        """Apply ``params`` (drawn or recorded) to every target field and record them in meta."""
        targets = self._targets(sample)
        if not targets:
            return sample
        new = {}
        for f in targets:
            try:
                new[f] = self.apply(sample.fields[f], sample.kinds[f], **self.field_params(params, f))
            except StepError:
                raise
            except (ValueError, TypeError, IndexError, KeyError) as e:
                raise StepError(f"{self.name}: {e}", field=f) from e
        meta = dict(sample.meta)
        meta["augment"] = [*meta.get("augment", []), {"step": self.name, **params}]
        return sample.replace_fields(new, meta=meta)

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        targets = self._targets(sample)
        if not targets:
            return [sample]
        try:
            params = self.sample_params(rng, sample, targets)
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e
        return [self.replay(sample, params)]

    def run_original(self, sample: Sample) -> list[Sample]:
        """The un-augmented original: the step with its neutral parameters (recorded too)."""
        targets = self._targets(sample)
        if not targets:
            return [sample]
        try:
            params = self.neutral_params(sample, targets)
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e
        return [self.replay(sample, params)]


class _Spatial2D(RandomStep, PlanarStep):
    """Random 2D geometric steps: every image, mask, flow and clip field, with one size for all."""

    def common_hw(self, sample: Sample, targets: list[str]) -> tuple[int, int]:
        sizes = {f: F.spatial_hw(sample.fields[f], sample.kinds[f]) for f in targets}
        if len(set(sizes.values())) > 1:
            desc = ", ".join(f"{f} {h}x{w}" for f, (h, w) in sizes.items())
            raise ValueError(f"fields differ in size ({desc}); one draw needs one size (resize them first)")
        return next(iter(sizes.values()))


# ==================================================================================
# 2D geometry
# ==================================================================================
class _CropParams(_Params):
    size: Union[int, list[int]]
    padding: int = 0          # pad every side by this much first (torchvision's RandomCrop padding)
    pad: bool = False         # inputs still smaller than size: pad them (centred) instead of failing
    pad_value: float = 0

    @field_validator("padding")
    @classmethod
    def _p(cls, v: int) -> int:
        if v < 0:
            raise ValueError("padding must be non-negative")
        return v

    @field_validator("size", mode="before")
    @classmethod
    def _v(cls, v: Any) -> Any:
        return _size_param(v)


@STEPS.register()
class RandomCrop(_Spatial2D):
    """Cut a ``size: [h, w]`` window at a random place (the same for every field), after padding
    every side by ``padding``. Inputs still smaller are an error unless ``pad: true`` (centred
    padding). Images pad with ``pad_value``, masks with 0, flow with NaN (unknown).
    Original copy: the centred window."""

    name = "random_crop"
    Params = _CropParams

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        p = 2 * self.params.padding
        if p:
            shape = list(spec.shape)
            for ax in spec.kind.hw_axes:
                shape[ax] = None if shape[ax] is None else shape[ax] + p
            spec = spec.with_(shape=tuple(shape))
        return crop_spec(spec, self.params.size, self.params.pad)

    def _padded(self, H: int, W: int) -> tuple[int, int]:
        h, w = self.params.size
        H, W = H + 2 * self.params.padding, W + 2 * self.params.padding
        if (H < h or W < w) and not self.params.pad:
            raise ValueError(f"input {H}x{W} is smaller than the crop {h}x{w} (set pad: true to pad)")
        return max(H, h), max(W, w)

    def sample_params(self, rng, sample, targets):
        H, W = self._padded(*self.common_hw(sample, targets))
        h, w = self.params.size
        return {"top": int(rng.integers(0, H - h + 1)), "left": int(rng.integers(0, W - w + 1))}

    def neutral_params(self, sample, targets):
        H, W = self._padded(*self.common_hw(sample, targets))
        h, w = self.params.size
        return {"top": (H - h) // 2, "left": (W - w) // 2}

    def _crop(self, a: np.ndarray, top: int, left: int, value: float) -> np.ndarray:
        h, w = self.params.size
        H, W = a.shape[:2]
        PH, PW = self._padded(H, W)
        if (PH, PW) != (H, W):
            p = self.params.padding
            if p:
                a, _, _ = F.pad_hw(a, H + 2 * p, W + 2 * p, value=value)
            a, _, _ = F.pad_hw(a, PH, PW, value=value)
        if not (0 <= top <= PH - h and 0 <= left <= PW - w):
            raise ValueError(f"crop window at ({top}, {left}) of {h}x{w} is outside the {PH}x{PW} input")
        return F.crop_hw(a, top, left, h, w)

    def apply_image(self, a, top: int, left: int, label: bool = False, **_):
        return self._crop(a, top, left, 0 if label else self.params.pad_value)

    def apply_flow(self, a, top: int, left: int, **_):
        return self._crop(a, top, left, np.nan)


@STEPS.register()
class RandomResizedCrop(_Spatial2D):
    """Cut a window of random area (``scale``, fraction of the input) and aspect ratio
    (``ratio``, width/height, drawn log-uniformly), then resize it to ``size: [h, w]``
    (torchvision's algorithm: 10 tries, then the largest centred window within ``ratio``).
    Flow vectors are scaled with the resize; masks use nearest neighbour.
    Original copy: the largest centred window with the output's aspect ratio, resized to
    ``size`` (resize + centre crop)."""

    name = "random_resized_crop"

    class Params(_Params):
        size: Union[int, list[int]]
        scale: list[float] = [0.08, 1.0]
        ratio: list[float] = [3 / 4, 4 / 3]
        interpolation: Literal["auto", "area", "linear", "cubic", "nearest"] = "auto"

        @field_validator("size", mode="before")
        @classmethod
        def _v(cls, v: Any) -> Any:
            return _size_param(v)

        @field_validator("scale", "ratio", mode="before")
        @classmethod
        def _r(cls, v: Any, info) -> Any:
            lo, hi = _pair(v, info.field_name)
            if lo <= 0 or (info.field_name == "scale" and hi > 1):
                raise ValueError(f"{info.field_name} must be within (0, 1]" if info.field_name == "scale"
                                 else "ratio must be positive")
            return [lo, hi]

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return _set_hw(spec, *self.params.size)

    def sample_params(self, rng, sample, targets):
        H, W = self.common_hw(sample, targets)
        area = H * W
        lr = (math.log(self.params.ratio[0]), math.log(self.params.ratio[1]))
        for _ in range(10):
            a = area * _uniform(rng, self.params.scale)
            r = math.exp(_uniform(rng, lr))
            w = int(round(math.sqrt(a * r)))
            h = int(round(math.sqrt(a / r)))
            if 0 < w <= W and 0 < h <= H:
                return {"top": int(rng.integers(0, H - h + 1)), "left": int(rng.integers(0, W - w + 1)),
                        "height": h, "width": w}
        r = W / H
        if r < self.params.ratio[0]:
            w, h = W, max(1, int(round(W / self.params.ratio[0])))
        elif r > self.params.ratio[1]:
            h, w = H, max(1, int(round(H * self.params.ratio[1])))
        else:
            h, w = H, W
        return {"top": (H - h) // 2, "left": (W - w) // 2, "height": h, "width": w}

    def neutral_params(self, sample, targets):
        # resize + centre crop: the largest centred window with the output's aspect ratio
        H, W = self.common_hw(sample, targets)
        h_out, w_out = self.params.size
        if W * h_out >= H * w_out:
            h, w = H, min(W, max(1, int(round(H * w_out / h_out))))
        else:
            h, w = min(H, max(1, int(round(W * h_out / w_out)))), W
        return {"top": (H - h) // 2, "left": (W - w) // 2, "height": h, "width": w}

    def _window(self, a, top: int, left: int, height: int, width: int) -> np.ndarray:
        H, W = a.shape[:2]
        if not (0 <= top and top + height <= H and 0 <= left and left + width <= W and height > 0 and width > 0):
            raise ValueError(f"window ({top}, {left}) {height}x{width} is outside the {H}x{W} input")
        return F.crop_hw(a, top, left, height, width)

    def apply_image(self, a, top: int, left: int, height: int, width: int, label: bool = False, **_):
        win = self._window(a, top, left, height, width)
        return F.resize_hwc(win, *self.params.size, "nearest" if label else self.params.interpolation)

    def apply_flow(self, a, top: int, left: int, height: int, width: int, **_):
        return F.resize_flow(self._window(a, top, left, height, width), *self.params.size)


@STEPS.register()
class RandomFlip(_Spatial2D):
    """Mirror left-right with probability ``horizontal`` and up-down with probability
    ``vertical`` (one draw for all fields); flow negates u (horizontal) or v (vertical).
    Original copy: no flip."""

    name = "random_flip"

    class Params(_Params):
        horizontal: float = 0.5
        vertical: float = 0.0

        @field_validator("horizontal", "vertical")
        @classmethod
        def _p(cls, v: float) -> float:
            if not 0 <= v <= 1:
                raise ValueError("a probability must be within [0, 1]")
            return v

    def sample_params(self, rng, sample, targets):
        return {"horizontal": bool(rng.random() < self.params.horizontal),
                "vertical": bool(rng.random() < self.params.vertical)}

    def neutral_params(self, sample, targets):
        return {"horizontal": False, "vertical": False}

    def apply_image(self, a, horizontal: bool, vertical: bool, label: bool = False, **_):
        return F.flip_hw(a, horizontal, vertical)

    def apply_flow(self, a, horizontal: bool, vertical: bool, **_):
        return F.flip_flow(a, horizontal, vertical)


@STEPS.register()
class RandomAffine(_Spatial2D):
    """Rotate by an angle from ``degrees`` (x or [lo, hi]; x means [-x, x]; positive is
    counter-clockwise), scale by a factor from ``scale`` ([lo, hi]) about the centre, and shift
    by up to ``translate`` (a fraction of width and height); the size stays. Uncovered pixels get
    ``fill`` (flow: NaN). Flow is resampled and its vectors rotated and scaled; masks use
    nearest neighbour. Original copy: the identity."""

    name = "random_affine"

    class Params(_Params):
        degrees: Union[float, list[float]] = 0.0
        scale: Union[float, list[float]] = [1.0, 1.0]
        translate: float = 0.0
        fill: float = 0
        interpolation: Literal["linear", "cubic", "nearest"] = "linear"

        @field_validator("degrees", mode="before")
        @classmethod
        def _d(cls, v: Any) -> Any:
            return _pair(v, "degrees", symmetric_about=0.0)

        @field_validator("scale", mode="before")
        @classmethod
        def _s(cls, v: Any) -> Any:
            lo, hi = _pair(v, "scale")
            if lo <= 0:
                raise ValueError("scale factors must be positive")
            return [lo, hi]

        @field_validator("translate")
        @classmethod
        def _t(cls, v: float) -> float:
            if not 0 <= v <= 1:
                raise ValueError("translate is a fraction within [0, 1]")
            return v

    def sample_params(self, rng, sample, targets):
        H, W = self.common_hw(sample, targets)
        p = self.params
        angle = _uniform(rng, p.degrees)
        scale = _uniform(rng, p.scale)
        tx = _uniform(rng, [-p.translate * W, p.translate * W])
        ty = _uniform(rng, [-p.translate * H, p.translate * H])
        return {"angle": angle, "scale": scale, "tx": tx, "ty": ty}

    def neutral_params(self, sample, targets):
        return {"angle": 0.0, "scale": 1.0, "tx": 0.0, "ty": 0.0}

    def apply_image(self, a, angle: float, scale: float, tx: float, ty: float, label: bool = False, **_):
        if angle == 0 and scale == 1 and tx == 0 and ty == 0:
            return a.copy()
        M = affine_matrix(*a.shape[:2], angle, scale, tx, ty)
        if label:
            return warp_image(a, M, 0, "nearest")
        return warp_image(a, M, self.params.fill, self.params.interpolation)

    def apply_flow(self, a, angle: float, scale: float, tx: float, ty: float, **_):
        if angle == 0 and scale == 1 and tx == 0 and ty == 0:
            return a.copy()
        return warp_flow(a, affine_matrix(*a.shape[:2], angle, scale, tx, ty), self.params.interpolation)


# ==================================================================================
# colour and noise
# ==================================================================================
@STEPS.register()
class ColorJitter(RandomStep):
    """Random brightness, contrast and saturation factors, each drawn from [1 - x, 1 + x]
    (x given) or [lo, hi], applied in that order to images and clips only (see
    :func:`color_jitter`). Original copy: factors 1."""

    name = "color_jitter"
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(_Params):
        brightness: Union[float, list[float]] = 0.0
        contrast: Union[float, list[float]] = 0.0
        saturation: Union[float, list[float]] = 0.0

        @field_validator("brightness", "contrast", "saturation", mode="before")
        @classmethod
        def _f(cls, v: Any, info) -> Any:
            return _pair(v, info.field_name, symmetric_about=1.0, lo_min=0.0)

    def sample_params(self, rng, sample, targets):
        p = self.params
        return {"brightness": _uniform(rng, p.brightness), "contrast": _uniform(rng, p.contrast),
                "saturation": _uniform(rng, p.saturation)}

    def neutral_params(self, sample, targets):
        return {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0}

    def apply_image(self, a, brightness: float, contrast: float, saturation: float, **_):
        return color_jitter(a, False, brightness, contrast, saturation)

    def apply_video(self, a, brightness: float, contrast: float, saturation: float, **_):
        return color_jitter(a, True, brightness, contrast, saturation)


@STEPS.register()
class GaussianNoise(RandomStep):
    """Add gaussian noise with a standard deviation from ``std`` (a number, or [lo, hi] drawn
    uniformly; in the array's units, e.g. 0-255 for uint8) to images, clips, volumes and audio.
    The std is drawn once per sample; every field gets its own noise (a frame pair must not
    share one pattern), from its own recorded seed. Original copy: no noise."""

    name = "gaussian_noise"
    applies = kinds(Kind.IMAGE, Kind.VIDEO, Kind.VOLUME, Kind.AUDIO)

    class Params(_Params):
        std: Union[float, list[float]]

        @field_validator("std", mode="before")
        @classmethod
        def _s(cls, v: Any) -> Any:
            lo, hi = _pair(v, "std")
            if lo < 0:
                raise ValueError("std must be non-negative")
            return [lo, hi]

    def sample_params(self, rng, sample, targets):
        std = _uniform(rng, self.params.std)
        return {"std": std, "seed": {f: _seed(rng) for f in targets}}

    def neutral_params(self, sample, targets):
        return {"std": 0.0, "seed": {f: 0 for f in targets}}

    def field_params(self, params, field):
        return {"std": params["std"], "seed": params["seed"][field]}

    def apply(self, a, kind, std: float, seed: int, **_):
        """The same kernel for every kind it applies to: noise is elementwise."""
        if Kind.of(kind) not in self.applies:
            raise ValueError(f"{self.name} cannot handle a {Kind.of(kind).value} field")
        return add_noise(a, std, seed)


# ==================================================================================
# clips
# ==================================================================================
@STEPS.register()
class TemporalJitter(RandomStep):
    """Take ``length`` frames from a (T, H, W, C) clip: a random start, a stride drawn from
    ``strides``, and each index moved by up to ``jitter`` frames (kept in order); a clip shorter
    than the span repeats its last frame. The chosen indices are recorded. Every clip field of
    the sample gets the same indices (their frame counts must agree). Original copy: the centred
    span at the first stride, no jitter."""

    name = "temporal_jitter"
    applies = kinds(Kind.VIDEO)

    class Params(_Params):
        length: int
        strides: list[int] = [1]
        jitter: int = 0

        @model_validator(mode="after")
        def _v(self):
            if self.length < 1:
                raise ValueError("length must be positive")
            if not self.strides or any(s < 1 for s in self.strides):
                raise ValueError("strides must be a non-empty list of positive integers")
            if self.jitter < 0:
                raise ValueError("jitter must be non-negative")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=(self.params.length, *spec.shape[1:]))

    def _frames(self, sample, targets) -> int:
        ts = {f: sample.fields[f].shape[0] for f in targets}
        if len(set(ts.values())) > 1:
            raise ValueError(f"clips differ in length ({ts}); one draw needs one length")
        T = next(iter(ts.values()))
        if T < 1:
            raise ValueError("the clip has no frames")
        return T

    def sample_params(self, rng, sample, targets):
        T = self._frames(sample, targets)
        p = self.params
        stride = int(p.strides[int(rng.integers(0, len(p.strides)))])
        span = (p.length - 1) * stride + 1
        start = int(rng.integers(0, max(0, T - span) + 1))
        offsets = rng.integers(-p.jitter, p.jitter + 1, p.length) if p.jitter else None
        return {"indices": jitter_indices(T, p.length, stride, start, offsets)}

    def neutral_params(self, sample, targets):
        T = self._frames(sample, targets)
        stride = self.params.strides[0]
        span = (self.params.length - 1) * stride + 1
        return {"indices": jitter_indices(T, self.params.length, stride, max(0, (T - span) // 2))}

    def apply_video(self, a, indices: list[int], **_):
        if len(indices) != self.params.length:
            raise ValueError(f"expected {self.params.length} frame indices, got {len(indices)}")
        if max(indices) >= len(a) or min(indices) < 0:
            raise ValueError(f"frame index out of range for a clip of {len(a)} frames")
        return take_frames(a, indices)


# ==================================================================================
# audio
# ==================================================================================
@STEPS.register()
class RandomGain(RandomStep):
    """Multiply (C, N) audio by a gain drawn uniformly in decibels from ``db`` (x means [-x, x]);
    ``clip: true`` clips to [-1, 1]. Original copy: 0 dB."""

    name = "random_gain"
    applies = kinds(Kind.AUDIO)

    class Params(_Params):
        db: Union[float, list[float]] = 6.0
        clip: bool = False

        @field_validator("db", mode="before")
        @classmethod
        def _d(cls, v: Any) -> Any:
            return _pair(v, "db", symmetric_about=0.0)

    def sample_params(self, rng, sample, targets):
        return {"gain_db": _uniform(rng, self.params.db)}

    def neutral_params(self, sample, targets):
        return {"gain_db": 0.0}

    def apply_audio(self, a, gain_db: float, **_):
        if gain_db == 0 and not self.params.clip:
            return a.copy()
        return apply_gain(a, gain_db, self.params.clip)


@STEPS.register()
class TimeShift(RandomStep):
    """Shift (C, N) audio in time by a whole number of samples drawn uniformly from
    [-m, m], m = ``max_shift`` samples or ``max_fraction`` of the length; ``mode: roll`` wraps
    around, ``zero`` pads with silence. Original copy: no shift."""

    name = "time_shift"
    applies = kinds(Kind.AUDIO)

    class Params(_Params):
        max_shift: Optional[int] = None
        max_fraction: float = 0.1
        mode: Literal["roll", "zero"] = "roll"

        @model_validator(mode="after")
        def _v(self):
            if self.max_shift is not None and self.max_shift < 0:
                raise ValueError("max_shift must be non-negative")
            if not 0 <= self.max_fraction <= 1:
                raise ValueError("max_fraction must be within [0, 1]")
            return self

    def sample_params(self, rng, sample, targets):
        ns = {f: sample.fields[f].shape[-1] for f in targets}
        n = min(ns.values())
        m = self.params.max_shift if self.params.max_shift is not None else int(self.params.max_fraction * n)
        m = min(m, n)
        return {"shift": int(rng.integers(-m, m + 1))}

    def neutral_params(self, sample, targets):
        return {"shift": 0}

    def apply_audio(self, a, shift: int, **_):
        if abs(shift) > a.shape[-1]:
            raise ValueError(f"shift {shift} is longer than the {a.shape[-1]} samples")
        return shift_time(a, shift, self.params.mode)


# ==================================================================================
# volumes
# ==================================================================================
class _Volume(RandomStep):
    """Random 3D steps on (D, H, W) volumes and their label volumes (``volume_mask``), which
    always move together; 2D fields are refused (name ``fields:`` to leave them)."""

    applies = VOLUMETRIC
    refuses = PLANAR

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        if len(spec.shape) < 3:
            raise ValueError(f"{self.name} needs (D, H, W) arrays, got {spec.describe()}")
        return spec

    def common_shape(self, sample: Sample, targets: list[str]) -> tuple[int, int, int]:
        shapes = {f: tuple(sample.fields[f].shape[:3]) for f in targets}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"fields differ in shape ({shapes}); one draw needs one shape")
        return next(iter(shapes.values()))


@STEPS.register()
class RandomFlip3d(_Volume):
    """Mirror a volume (and its mask) along each of ``axes`` (0 = z, 1 = y, 2 = x) with
    probability ``prob``, drawn per axis. Original copy: no flip."""

    name = "random_flip3d"

    class Params(_Params):
        prob: float = 0.5
        axes: list[int] = [0, 1, 2]

        @model_validator(mode="after")
        def _v(self):
            if not 0 <= self.prob <= 1:
                raise ValueError("prob must be within [0, 1]")
            if any(a not in (0, 1, 2) for a in self.axes) or len(set(self.axes)) != len(self.axes):
                raise ValueError("axes must be distinct values among 0, 1, 2")
            return self

    def sample_params(self, rng, sample, targets):
        return {"axes": [int(a) for a in self.params.axes if rng.random() < self.params.prob]}

    def neutral_params(self, sample, targets):
        return {"axes": []}

    def apply_volume(self, a, axes: list[int], **_):
        return flip_axes(a, axes)

    apply_volume_mask = apply_volume  # a mirror moves voxels, it never mixes them


@STEPS.register()
class RandomRot90(_Volume):
    """Rotate a volume (and its mask) by k quarter turns, k drawn from ``k``, in a plane drawn
    from ``planes`` (axis pairs; default the axial y-x plane [1, 2]). Odd k needs a square
    plane so every copy keeps one shape. Original copy: k = 0."""

    name = "random_rot90"

    class Params(_Params):
        planes: list[list[int]] = [[1, 2]]
        k: list[int] = [0, 1, 2, 3]

        @model_validator(mode="after")
        def _v(self):
            if not self.planes:
                raise ValueError("planes must not be empty")
            for p in self.planes:
                if len(p) != 2 or p[0] == p[1] or any(a not in (0, 1, 2) for a in p):
                    raise ValueError(f"a plane is two different axes among 0, 1, 2, got {p}")
            if not self.k or any(k not in (0, 1, 2, 3) for k in self.k):
                raise ValueError("k must be a non-empty list of values among 0, 1, 2, 3")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        spec = super().output_spec(spec)
        if any(k % 2 for k in self.params.k):
            shape = list(spec.shape)
            for a, b in self.params.planes:
                if shape[a] is not None and shape[b] is not None and shape[a] != shape[b]:
                    raise ValueError(f"odd quarter turns in plane [{a}, {b}] change the shape {tuple(spec.shape)}; "
                                     f"use k: [0, 2] or make that plane square")
                if shape[a] != shape[b]:
                    shape[a] = shape[b] = None
            spec = spec.with_(shape=tuple(shape))
        return spec

    def sample_params(self, rng, sample, targets):
        plane = self.params.planes[int(rng.integers(0, len(self.params.planes)))]
        return {"plane": [int(x) for x in plane], "k": int(self.params.k[int(rng.integers(0, len(self.params.k)))])}

    def neutral_params(self, sample, targets):
        return {"plane": [int(x) for x in self.params.planes[0]], "k": 0}

    def apply_volume(self, a, plane: list[int], k: int, **_):
        return rot90(a, k, plane)

    apply_volume_mask = apply_volume


@STEPS.register()
class Elastic(_Volume):
    """Elastic deformation of a volume and its mask: a ``grid``^3 lattice of random offsets
    (std ``magnitude`` voxels, drawn uniformly from [lo, hi] when a pair is given) smoothed to
    a dense field (see :func:`elastic`); linear for volumes, nearest for masks. The recorded
    seed regenerates the field. Original copy: magnitude 0."""

    name = "elastic"

    class Params(_Params):
        magnitude: Union[float, list[float]] = 2.0
        grid: int = 4

        @field_validator("magnitude", mode="before")
        @classmethod
        def _m(cls, v: Any) -> Any:
            lo, hi = _pair(v, "magnitude")
            if lo < 0:
                raise ValueError("magnitude must be non-negative")
            return [lo, hi]

        @field_validator("grid")
        @classmethod
        def _g(cls, v: int) -> int:
            if not 2 <= v <= 32:
                raise ValueError("grid must be within [2, 32]")
            return v

    def sample_params(self, rng, sample, targets):
        self.common_shape(sample, targets)
        return {"magnitude": _uniform(rng, self.params.magnitude), "seed": _seed(rng)}

    def neutral_params(self, sample, targets):
        return {"magnitude": 0.0, "seed": 0}

    def apply_volume(self, a, magnitude: float, seed: int, label: bool = False, **_):
        if a.ndim < 3:
            raise ValueError(f"elastic needs a (D, H, W) array, got shape {a.shape}")
        return elastic(a, self.params.grid, magnitude, seed, label)

    def apply_volume_mask(self, a, magnitude: float, seed: int, **_):
        return self.apply_volume(a, magnitude, seed, label=True)


# ==================================================================================
# replay
# ==================================================================================
def replay_step(step: Step, sample: Sample, params: dict[str, Any]) -> Sample:
    """Apply one random step's recorded ``params`` (its record without ``"step"``) to ``sample``.

    Steps of this module use :meth:`RandomStep.replay`; any other non-expanding random step is
    replayed the way ``Step.run`` applies parameters: ``apply(array, kind, **params)`` on every
    target field, the record appended to ``meta["augment"]``.
    """
    if isinstance(step, RandomStep):
        return step.replay(sample, params)
    if step.expands:
        raise ValueError(f"step {step.name!r} expands samples and cannot be replayed from records")
    targets = step.targets(_specs_of(sample))
    if not targets:
        return sample
    new = {f: step.apply(sample.fields[f], sample.kinds[f], **params) for f in targets}
    meta = dict(sample.meta)
    if params:
        meta["augment"] = [*meta.get("augment", []), {"step": step.name, **params}]
    return sample.replace_fields(new, meta=meta)


def replay(steps: Sequence[Step], sample: Sample, records: Sequence[dict[str, Any]]) -> list[Sample]:
    """Re-run ``steps`` on a decoded ``sample`` with the random steps' recorded parameters
    (``meta["augment"]`` of a stored sample) instead of new draws; returns the samples the
    build wrote for that copy. Raises ValueError if the records do not fit the steps."""
    todo = list(records)
    samples = [sample]
    for step in steps:
        if len(samples) != 1:
            raise ValueError("replay does not follow expanding steps (one sample became several)")
        out: list[Sample] = []
        for s in samples:
            if not step.random:
                out.extend(step.run(s, _NoRng()))  # type: ignore[arg-type]
                continue
            if not step.targets(_specs_of(s)):
                out.append(s)
                continue
            if not todo:
                raise ValueError(f"no record left for step {step.name!r}")
            rec = dict(todo.pop(0))
            name = rec.pop("step", None)
            if name != step.name:
                raise ValueError(f"the next record is for {name!r}, not {step.name!r}")
            out.append(replay_step(step, s, rec))
        samples = out
    if todo:
        raise ValueError(f"{len(todo)} record(s) left over after the last step")
    return samples
