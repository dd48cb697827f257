"""Deterministic 2D steps (resize, center_crop, convert) and the planar step family.

:class:`PlanarStep` is the base of every 2D geometric step, deterministic or
random: it applies to image, mask, flow and video fields, refuses volumes
(name ``fields:`` to leave them), and gives the per-kind defaults: a mask is
an image moved with nearest neighbour and padded with 0 (class values are
never invented), a video maps the image kernel over its frames. Flow has no
default: each step says how its vectors follow the geometry. ``flow_valid``
follows its flow (see :mod:`precompile.kinds`).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import field_validator, model_validator

from ..kinds import PLANAR, VOLUMETRIC, Kind, kinds
from ..registry import STEPS
from ..sample import FieldSpec
from . import functional as F
from .base import Step, StepParams


def _set_hw(spec: FieldSpec, h: int | None, w: int | None) -> FieldSpec:
    shape = list(spec.shape)
    a, b = spec.kind.hw_axes
    shape[a], shape[b] = h, w
    return spec.with_(shape=tuple(shape))


def _get_hw(spec: FieldSpec) -> tuple[int | None, int | None]:
    a, b = spec.kind.hw_axes
    return spec.shape[a], spec.shape[b]


def crop_spec(spec: FieldSpec, size: list[int], pad: bool) -> FieldSpec:
    """The spec of an (h, w) crop of ``spec``: a known input smaller than the crop needs ``pad``."""
    h, w = size
    H, W = _get_hw(spec)
    if not pad and H is not None and W is not None and (H < h or W < w):
        raise ValueError(f"size {h}x{w} is larger than the input {H}x{W}; add pad: true or resize first")
    return _set_hw(spec, h, w)


class PlanarStep(Step):
    """A 2D geometric step: ``apply_image`` and ``apply_flow`` are the step's own; masks and
    videos get the defaults below. ``apply_image`` takes ``label=True`` for label maps: nearest
    neighbour, and 0 where the step pads or fills."""

    applies = kinds(Kind.IMAGE, Kind.MASK, Kind.FLOW, Kind.VIDEO)
    refuses = VOLUMETRIC

    def apply_image(self, a: np.ndarray, label: bool = False, **params: Any) -> np.ndarray:
        raise NotImplementedError

    def apply_flow(self, a: np.ndarray, **params: Any) -> np.ndarray:
        raise NotImplementedError

    def apply_mask(self, a: np.ndarray, **params: Any) -> np.ndarray:
        return self.apply_image(a, label=True, **params)

    def apply_video(self, a: np.ndarray, **params: Any) -> np.ndarray:
        if len(a) == 0:
            shape = self.apply_image(np.zeros(a.shape[1:], a.dtype), **params).shape
            return np.zeros((0, *shape), a.dtype)
        return np.stack([self.apply_image(fr, **params) for fr in a])


def _size2(v: Any) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return (v[0], v[1])
    n = len(v) if isinstance(v, (list, tuple)) else None
    raise ValueError(f"expected an integer or 2 integers [height, width], got {n} values" if n is not None
                     else f"expected an integer or 2 integers [height, width], got {v!r}")


class _SizeParams(StepParams):
    size: Optional[Union[int, list[int]]] = None

    @field_validator("size", mode="before")
    @classmethod
    def _v(cls, v: Any) -> Any:
        if v is None:
            return v
        h, w = _size2(v)
        if h < 1 or w < 1:
            raise ValueError("sizes must be positive")
        return [h, w]


@STEPS.register()
class Resize(PlanarStep):
    """Resize: ``size: [h, w]`` exactly, ``shorter: n`` or ``longer: n`` keeping aspect,
    or ``size`` with ``keep_aspect: true`` to fit inside and pad (letterbox)."""

    name = "resize"

    class Params(_SizeParams):
        shorter: Optional[int] = None
        longer: Optional[int] = None
        keep_aspect: bool = False
        pad_value: float = 0
        interpolation: Literal["auto", "area", "linear", "cubic", "nearest"] = "auto"

        @model_validator(mode="after")
        def _one(self):
            given = [k for k in ("size", "shorter", "longer") if getattr(self, k) is not None]
            if len(given) != 1:
                raise ValueError("give exactly one of size, shorter, longer")
            for k in ("shorter", "longer"):
                if getattr(self, k) is not None and getattr(self, k) < 1:
                    raise ValueError(f"{k} must be positive")
            if self.keep_aspect and self.size is None:
                raise ValueError("keep_aspect needs size")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        p = self.params
        if p.size is not None:
            return _set_hw(spec, *p.size)
        return _set_hw(spec, None, None)

    def target_size(self, H: int, W: int) -> tuple[int, int]:
        p = self.params
        if p.shorter is not None:
            return F.shorter_side_size(H, W, p.shorter)
        if p.longer is not None:
            return F.longer_side_size(H, W, p.longer)
        h, w = p.size
        if p.keep_aspect:
            s = min(h / H, w / W)
            return max(1, min(h, int(round(H * s)))), max(1, min(w, int(round(W * s))))
        return h, w

    def apply_image(self, a: np.ndarray, label: bool = False, **_: Any) -> np.ndarray:
        h, w = self.target_size(*a.shape[:2])
        out = F.resize_hwc(a, h, w, "nearest" if label else self.params.interpolation)
        if self.params.keep_aspect and (h, w) != tuple(self.params.size):
            out, _, _ = F.pad_hw(out, *self.params.size, value=0 if label else self.params.pad_value)
        return out

    def apply_flow(self, a: np.ndarray, **_: Any) -> np.ndarray:
        h, w = self.target_size(*a.shape[:2])
        out = F.resize_flow(a, h, w)
        if self.params.keep_aspect and (h, w) != tuple(self.params.size):
            out, _, _ = F.pad_hw(out, *self.params.size, value=np.nan)
        return out


@STEPS.register()
class CenterCrop(PlanarStep):
    """Cut the central ``size: [h, w]`` window; smaller inputs are an error unless ``pad: true``."""

    name = "center_crop"

    class Params(_SizeParams):
        pad: bool = False
        pad_value: float = 0

        @model_validator(mode="after")
        def _need(self):
            if self.size is None:
                raise ValueError("size is required")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return crop_spec(spec, self.params.size, self.params.pad)

    def _crop(self, a: np.ndarray, value: float) -> np.ndarray:
        h, w = self.params.size
        H, W = a.shape[:2]
        if H < h or W < w:
            if not self.params.pad:
                raise ValueError(f"input {H}x{W} is smaller than the crop {h}x{w} (set pad: true to pad)")
            a, _, _ = F.pad_hw(a, max(H, h), max(W, w), value=value)
            H, W = a.shape[:2]
        return F.crop_hw(a, (H - h) // 2, (W - w) // 2, h, w)

    def apply_image(self, a: np.ndarray, label: bool = False, **_: Any) -> np.ndarray:
        return self._crop(a, 0 if label else self.params.pad_value)

    def apply_flow(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return self._crop(a, np.nan)


@STEPS.register()
class Convert(Step):
    """Convert image pixel format: ``mode: rgb8 | gray8 | gray16 | rgba8``."""

    name = "convert"
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(StepParams):
        mode: Literal["rgb8", "gray8", "gray16", "rgba8"]

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        c, dtype = {"rgb8": (3, "uint8"), "gray8": (1, "uint8"), "gray16": (1, "uint16"),
                    "rgba8": (4, "uint8")}[self.params.mode]
        if spec.dtype not in ("uint8", "uint16"):
            raise ValueError(f"convert needs uint8 or uint16 pixels, got {spec.dtype}")
        return spec.with_(shape=tuple(spec.shape[:-1]) + (c,), dtype=dtype)

    def apply_image(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return F.convert_mode(a, self.params.mode)

    apply_video = apply_image  # per pixel: frames need no loop
