"""2D geometric steps, deterministic and random: resize, center_crop, random_crop,
random_resized_crop, random_flip, random_affine.

:class:`PlanarStep` is their base: it applies to image, mask, flow and video
fields, refuses volumes (name ``fields:`` to leave them), and gives the
per-kind defaults: a mask is an image moved with nearest neighbour and padded
with 0 (class values are never invented), a video maps the image kernel over
its frames. Flow has no default: each step says how its vectors follow the
geometry. ``flow_valid`` follows its flow (see :mod:`precompile.kinds`). A
random step draws once per sample and moves every field the same way.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import ConfigDict, Field, field_validator, model_validator

from ..kinds import ANNOTATIONS, PLANAR, VOLUMETRIC, Kind, kinds
from ..optschema import checked, one_of_required
from ..registry import STEPS
from ..sample import FieldSpec, Sample
from .annotations import annotation_grid
from ..errors import StepError, echo
from . import source_map
from .base import RandomParams, RandomStep, Step, StepParams, apply_fields, range_param, uniform
from .kernels.geometry import (affine_matrix, continuous_map, crop_hw, flip_flow, flip_hw, longer_side_size,
                               map_boxes, map_keypoints, pad_hw, reflects, resize_area_fast, resize_flow, resize_hwc,
                               shorter_side_size, spatial_hw, swap_pairs, warp_flow, warp_image)


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
    neighbour, and 0 where the step pads or fills.

    Boxes and keypoints move with the step's ``coord_map``: its forward map in continuous pixel
    coordinates (pixel i covers [i, i + 1)) and the output grid size. Boxes: the 4 corners mapped,
    the enclosing box clipped to the grid, dropped (with their tied rows) when nothing, or less than
    the step's ``min_visibility`` (a fraction) or ``min_area``/``min_width``/``min_height`` (output pixels),
    is visible; keypoints: mapped exactly, visibility 0 off the grid,
    declared ``flip_pairs`` swapped when the map mirrors."""

    applies = kinds(Kind.IMAGE, Kind.MASK, Kind.FLOW, Kind.VIDEO, Kind.BOXES, Kind.KEYPOINTS)
    refuses = VOLUMETRIC

    def coord_map(self, grid: tuple[int, int], **params: Any) -> tuple[np.ndarray, tuple[int, int]]:
        """The 2x3 forward map of coordinates and the (height, width) of the output grid."""
        raise NotImplementedError

    def apply_boxes(self, a: np.ndarray, grid: tuple[int, int], **params: Any) -> np.ndarray:
        return self.move_boxes(a, *self.coord_map(grid, **params))

    def apply_keypoints(self, a: np.ndarray, grid: tuple[int, int], **params: Any) -> np.ndarray:
        return self.move_keypoints(a, *self.coord_map(grid, **params))

    def move_boxes(self, a: np.ndarray, M: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
        """Boxes through map ``M`` (one, or one per box) onto an ``hw`` grid; NaN rows: dropped (the step's box
        filters: ``min_visibility``, ``min_area``, ``min_width``, ``min_height``)."""
        return map_boxes(a, M, hw, **{k: getattr(self.params, k, 0.0) for k in BOX_FILTERS})

    def move_keypoints(self, a: np.ndarray, M: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
        """Keypoints through map ``M`` (one, or one per row); ``flip_pairs`` swapped where it mirrors."""
        out = map_keypoints(a, M, hw)
        pairs = getattr(self.params, "flip_pairs", None)
        mirror = np.broadcast_to(reflects(M), out.shape[:1])
        if pairs and mirror.any():
            out[mirror] = swap_pairs(out[mirror], pairs)
        return out

    def targets(self, specs: dict[str, FieldSpec]) -> list[str]:
        out = super().targets(specs)
        notes = [f for f in out if specs[f].kind in ANNOTATIONS]
        if notes and not any(s.kind in PLANAR for s in specs.values()):
            raise ValueError(f"fields {notes} are coordinates on an image, and the sample has no image, mask, "
                             f"flow or video field to give their grid")
        return out

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


#: the kinds that get a 2D step's pad_value or fill (masks get 0, flow NaN)
_PADDED = kinds(Kind.IMAGE, Kind.VIDEO)

MAX_SIDE = 32768   # the largest output side a 2D step accepts (OpenCV's warps index pixels with 16-bit shorts)


def size_pair(v: Any) -> list[int]:
    """``n`` or ``[h, w]`` -> ``[h, w]``, positive integers (the one size rule of every 2D step)."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v, v]
    if not (isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        n = len(v) if isinstance(v, (list, tuple)) else None
        raise ValueError(f"expected an integer or 2 integers [height, width], got {n} values"
                         if n is not None and n != 2 else
                         f"expected an integer or 2 integers [height, width], got {echo(v, 80)}")
    if v[0] < 1 or v[1] < 1:
        raise ValueError("sizes must be positive")
    if max(v) > MAX_SIDE:
        raise ValueError(f"size {max(v)} is over the maximum side of {MAX_SIDE} pixels")
    return [int(v[0]), int(v[1])]


def _shift_scale(sx: float, sy: float, tx: float, ty: float) -> np.ndarray:
    """The coordinate map x' = sx x + tx, y' = sy y + ty."""
    return np.array([[sx, 0.0, tx], [0.0, sy, ty]], dtype=np.float64)


#: the options that decide which boxes a step keeps (every step that can move a box off the grid takes them all)
BOX_FILTERS = ("min_visibility", "min_area", "min_width", "min_height")


class _MinVisibility(StepParams):
    """The box filters: ``min_visibility``, the least fraction of a box's area that must stay on the grid for the
    box (and its tied rows) to be kept; 0.0 (default) drops only boxes with nothing visible. ``min_area``,
    ``min_width``, ``min_height``: the least visible (clipped) area, width and height in output pixels
    (albumentations' ``BboxParams`` filters); 0 (default) drops nothing more. Every threshold is inclusive."""

    min_visibility: float = Field(0.0, description="the least fraction of a box's area that must stay on the "
                                  "grid for the box to be kept (0: drop only boxes with nothing visible)",
                                  json_schema_extra=checked(ge=0, le=1))
    min_area: float = Field(0.0, description="the least visible area, in output pixels, of a box kept (its clipped "
                            "box after the step; albumentations' min_area)", json_schema_extra=checked(ge=0))
    min_width: float = Field(0.0, description="the least visible width, in output pixels, of a box kept (its "
                             "clipped box after the step)", json_schema_extra=checked(ge=0))
    min_height: float = Field(0.0, description="the least visible height, in output pixels, of a box kept (its "
                              "clipped box after the step)", json_schema_extra=checked(ge=0))

    @field_validator("min_visibility")
    @classmethod
    def _mv(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError("min_visibility is a fraction within [0, 1]")
        return v

    @field_validator("min_area", "min_width", "min_height")
    @classmethod
    def _size(cls, v: float, info: Any) -> float:
        if v < 0:
            raise ValueError(f"{info.field_name} is a size in output pixels, at least 0")
        return v


class _SizeParams(StepParams):
    size: Optional[Union[int, list[int]]] = Field(None, description="output size [height, width] (one integer: a "
                                                  "square)", json_schema_extra=checked(gt=0, item={"gt": 0}))

    @field_validator("size", mode="before")
    @classmethod
    def _v(cls, v: Any) -> Any:
        return None if v is None else size_pair(v)


@STEPS.register()
class Resize(PlanarStep):
    """Resize: ``size: [h, w]`` exactly, ``shorter: n`` or ``longer: n`` keeping aspect,
    or ``size`` with ``keep_aspect: true`` to fit inside and pad (letterbox)."""

    name = "resize"
    per_frame = True
    output_version = 2   # 2: keypoints on the right/bottom edge (x == w, y == h) stay in view

    class Params(_SizeParams):
        model_config = ConfigDict(json_schema_extra=one_of_required("size", "shorter", "longer"))
        shorter: Optional[int] = Field(None, le=MAX_SIDE, description="resize so the shorter side is this many pixels, "
                                       "keeping the aspect ratio", json_schema_extra=checked(ge=1))
        longer: Optional[int] = Field(None, le=MAX_SIDE, description="resize so the longer side is this many pixels, "
                                      "keeping the aspect ratio", json_schema_extra=checked(ge=1))
        keep_aspect: bool = Field(False, description="with size: fit inside it keeping the aspect ratio and "
                                  "pad the rest (letterbox)")
        pad_value: float = Field(0, description="the value of padded pixels (keep_aspect)")
        interpolation: Literal["auto", "area", "linear", "cubic", "nearest"] = Field(
            "auto", description="resampling filter (auto: area when shrinking, linear when growing); masks "
            "always use nearest")
        fast: bool = Field(False, description="an approximate area downscale (integer pre-reduction, then a "
                           "small blur and linear resize): 3-9x faster, >= 45 dB PSNR against the exact area "
                           "resize on photo-like content; off: the exact resize")

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

    def fill_values(self):
        return {"pad_value": (self.params.pad_value, _PADDED)} if self.params.keep_aspect else {}

    def target_size(self, H: int, W: int) -> tuple[int, int]:
        p = self.params
        if p.shorter is not None or p.longer is not None:
            h, w = shorter_side_size(H, W, p.shorter) if p.shorter is not None else longer_side_size(H, W, p.longer)
            if max(h, w) > MAX_SIDE:   # the input's aspect decides it: the plan cannot check it
                key = "shorter" if p.shorter is not None else "longer"
                raise ValueError(f"{key}: {getattr(p, key)} on a {H}x{W} input makes {h}x{w}; a side is at most "
                                 f"{MAX_SIDE}")
            return h, w
        h, w = p.size
        if p.keep_aspect:
            s = min(h / H, w / W)
            return max(1, min(h, int(round(H * s)))), max(1, min(w, int(round(W * s))))
        return h, w

    def run(self, sample: Sample, rng: Any) -> list[Sample]:
        """``Step.run``, and an image field whose reduced decode left the source's extent for its first
        resample (``source_map.pending_extent``) is resized from that extent in one resample (its map
        composed with that scale) and the extent taken off its meta."""
        meta0 = sample.meta
        if not any(source_map.pending_extent(sample, meta0, f) is not None for f in sample.fields):
            return super().run(sample, rng)
        try:
            targets = self.targets(sample.specs())
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e
        ext = {f: e for f in targets if (e := source_map.pending_extent(sample, meta0, f)) is not None}

        def params_of(f: str) -> dict[str, Any]:
            return {"extent": ext[f]} if f in ext else {}

        new = apply_fields(self, sample, targets, params_of)
        meta = source_map.track(self, sample, targets, params_of, meta0)
        meta = dict(meta)
        for f in ext:
            fm = dict(meta[f])
            fm.pop(source_map.EXTENT, None)
            meta[f] = fm
        return [sample.replace_fields(new, meta=meta)]

    def coord_map(self, grid, extent: Optional[list[float]] = None, **_):
        H, W = grid
        h, w = self.target_size(H, W)
        out, top, left = (h, w), 0, 0
        if self.params.keep_aspect and (h, w) != tuple(self.params.size):
            out = tuple(self.params.size)
            top, left = (out[0] - h) // 2, (out[1] - w) // 2   # pad_hw's centred placement
        eh, ew = (H, W) if extent is None else extent   # the part of the grid the output spans
        return _shift_scale(w / ew, h / eh, left, top), out

    def apply_image(self, a: np.ndarray, label: bool = False, extent: Optional[list[float]] = None,
                    **_: Any) -> np.ndarray:
        h, w = self.target_size(*a.shape[:2])
        self.check_output_bytes((*self.params.size, *a.shape[2:]) if self.params.keep_aspect else (h, w, *a.shape[2:]),
                                a.dtype)
        mode = "nearest" if label else self.params.interpolation
        shrink = h <= a.shape[0] and w <= a.shape[1]
        if extent is not None:
            out = resize_hwc(a, h, w, mode, extent=extent)
        elif self.params.fast and shrink and mode in ("auto", "area"):
            out = resize_area_fast(a, h, w)
        else:
            out = resize_hwc(a, h, w, mode)
        if self.params.keep_aspect and (h, w) != tuple(self.params.size):
            out, _, _ = pad_hw(out, *self.params.size, value=0 if label else self.params.pad_value)
        return out

    def apply_flow(self, a: np.ndarray, **_: Any) -> np.ndarray:
        h, w = self.target_size(*a.shape[:2])
        self.check_output_bytes((h, w, *a.shape[2:]), a.dtype)
        out = resize_flow(a, h, w)
        if self.params.keep_aspect and (h, w) != tuple(self.params.size):
            out, _, _ = pad_hw(out, *self.params.size, value=np.nan)
        return out


@STEPS.register()
class CenterCrop(PlanarStep):
    """Cut the central ``size: [h, w]`` window; smaller inputs are an error unless ``pad: true``."""

    name = "center_crop"
    per_frame = True
    output_version = 2   # 2: a tied instance mask renumbered when a box is dropped; edge keypoints in view

    class Params(_SizeParams, _MinVisibility):
        model_config = ConfigDict(json_schema_extra={"required": ["size"]})
        pad: bool = Field(False, description="pad inputs smaller than size (centred) instead of failing")
        pad_value: float = Field(0, description="the value of padded pixels")

        @model_validator(mode="after")
        def _need(self):
            if self.size is None:
                raise ValueError("size is required")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return crop_spec(spec, self.params.size, self.params.pad)

    def fill_values(self):
        return {"pad_value": (self.params.pad_value, _PADDED)} if self.params.pad else {}

    def _padded(self, H: int, W: int) -> tuple[int, int]:
        h, w = self.params.size
        if (H < h or W < w) and not self.params.pad:
            raise ValueError(f"input {H}x{W} is smaller than the crop {h}x{w} (set pad: true to pad)")
        return max(H, h), max(W, w)

    def coord_map(self, grid, **_):
        (H, W), (h, w) = grid, self.params.size
        PH, PW = self._padded(H, W)
        return _shift_scale(1, 1, (PW - W) // 2 - (PW - w) // 2, (PH - H) // 2 - (PH - h) // 2), (h, w)

    def _crop(self, a: np.ndarray, value: float) -> np.ndarray:
        h, w = self.params.size
        H, W = self._padded(*a.shape[:2])
        if (H, W) != a.shape[:2]:
            a, _, _ = pad_hw(a, H, W, value=value)
        return crop_hw(a, (H - h) // 2, (W - w) // 2, h, w)

    def apply_image(self, a: np.ndarray, label: bool = False, **_: Any) -> np.ndarray:
        return self._crop(a, 0 if label else self.params.pad_value)

    def apply_flow(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return self._crop(a, np.nan)


class _Spatial2D(RandomStep, PlanarStep):
    """Random 2D geometric steps: every image, mask, flow and clip field, with one size for all."""

    def common_hw(self, sample: Sample, targets: list[str]) -> tuple[int, int]:
        grids = [f for f in targets if sample.kinds[f] not in ANNOTATIONS]
        if not grids:   # only annotations named: the grid they are on
            return annotation_grid(sample, tuple(targets))
        sizes = {f: spatial_hw(sample.fields[f], sample.kinds[f]) for f in grids}
        if len(set(sizes.values())) > 1:
            desc = ", ".join(f"{f} {h}x{w}" for f, (h, w) in sizes.items())
            raise ValueError(f"fields differ in size ({desc}); one draw needs one size (resize them first)")
        return next(iter(sizes.values()))


class _CropParams(RandomParams, _MinVisibility):
    size: Union[int, list[int]] = Field(description="crop size [height, width] (one integer: a square)",
                                        json_schema_extra=checked(gt=0, item={"gt": 0}))
    padding: int = Field(0, description="pad every side by this much first (torchvision's RandomCrop "
                         "padding)", json_schema_extra=checked(ge=0))
    pad: bool = Field(False, description="inputs still smaller than size: pad them (centred) instead of "
                      "failing")
    pad_value: float = Field(0, description="the value of padded pixels")

    @field_validator("padding")
    @classmethod
    def _p(cls, v: int) -> int:
        if v < 0:
            raise ValueError("padding must be non-negative")
        return v

    @field_validator("size", mode="before")
    @classmethod
    def _v(cls, v: Any) -> Any:
        return size_pair(v)


@STEPS.register()
class RandomCrop(_Spatial2D):
    """Cut a ``size: [h, w]`` window at a random place (the same for every field), after padding
    every side by ``padding``. Inputs still smaller are an error unless ``pad: true`` (centred
    padding). Images pad with ``pad_value``, masks with 0, flow with NaN (unknown).
    Original copy: the centred window."""

    name = "random_crop"
    Params = _CropParams
    output_version = 2   # 2: a tied instance mask renumbered when a box is dropped; edge keypoints in view

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        p = 2 * self.params.padding
        if p:
            shape = list(spec.shape)
            for ax in spec.kind.hw_axes:
                shape[ax] = None if shape[ax] is None else shape[ax] + p
            spec = spec.with_(shape=tuple(shape))
        return crop_spec(spec, self.params.size, self.params.pad)

    def fill_values(self):
        p = self.params
        return {"pad_value": (p.pad_value, _PADDED)} if p.pad or p.padding else {}

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

    def coord_map(self, grid, top: int, left: int, **_):
        H, W = grid
        PH, PW = self._padded(H, W)
        p = self.params.padding   # padded by p on every side, then centred up to (PH, PW): pad_hw's placement
        return _shift_scale(1, 1, p + (PW - W - 2 * p) // 2 - left, p + (PH - H - 2 * p) // 2 - top), \
            tuple(self.params.size)

    def _crop(self, a: np.ndarray, top: int, left: int, value: float) -> np.ndarray:
        h, w = self.params.size
        H, W = a.shape[:2]
        PH, PW = self._padded(H, W)
        if (PH, PW) != (H, W):
            p = self.params.padding
            if p:
                a, _, _ = pad_hw(a, H + 2 * p, W + 2 * p, value=value)
            a, _, _ = pad_hw(a, PH, PW, value=value)
        if not (0 <= top <= PH - h and 0 <= left <= PW - w):
            raise ValueError(f"crop window at ({top}, {left}) of {h}x{w} is outside the {PH}x{PW} input")
        return crop_hw(a, top, left, h, w)

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
    output_version = 2   # 2: a tied instance mask renumbered when a box is dropped; edge keypoints in view

    class Params(RandomParams, _MinVisibility):
        size: Union[int, list[int]] = Field(description="output size [height, width] (one integer: a square)",
                                            json_schema_extra=checked(gt=0, item={"gt": 0}))
        scale: list[float] = Field([0.08, 1.0], description="[low, high] fraction of the input's area the "
                                   "window covers", json_schema_extra=checked(gt=0, le=1, item={"gt": 0, "le": 1}))
        ratio: list[float] = Field([3 / 4, 4 / 3], description="[low, high] aspect ratio (width / height) of "
                                   "the window, drawn log-uniformly", json_schema_extra=checked(gt=0, item={"gt": 0}))
        interpolation: Literal["auto", "area", "linear", "cubic", "nearest"] = Field(
            "auto", description="resampling filter (auto: area when shrinking, linear when growing); masks "
            "always use nearest")

        @field_validator("size", mode="before")
        @classmethod
        def _v(cls, v: Any) -> Any:
            return size_pair(v)

        @field_validator("scale", "ratio", mode="before")
        @classmethod
        def _r(cls, v: Any, info) -> Any:
            lo, hi = range_param(v, info.field_name)
            if lo <= 0 or (info.field_name == "scale" and hi > 1):
                raise ValueError(f"{info.field_name} must be within (0, 1]" if info.field_name == "scale"
                                 else "ratio must be positive")
            return [lo, hi]

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return _set_hw(spec, *self.params.size)

    def sample_params(self, rng, sample, targets):
        return self.draw_window(rng, *self.common_hw(sample, targets))

    def draw_window(self, rng: np.random.Generator, H: int, W: int) -> dict[str, int]:
        """One window on an ``H`` x ``W`` grid: the rule of the build step and of the Loader's device twin."""
        area = H * W
        lr = (math.log(self.params.ratio[0]), math.log(self.params.ratio[1]))
        for _ in range(10):
            a = area * uniform(rng, self.params.scale)
            r = math.exp(uniform(rng, lr))
            w = int(round(math.sqrt(a * r)))
            h = int(round(math.sqrt(a / r)))
            if 0 < w <= W and 0 < h <= H:
                return {"top": int(rng.integers(0, H - h + 1)), "left": int(rng.integers(0, W - w + 1)),
                        "height": h, "width": w}
        return self._fallback_window(H, W)

    def _fallback_window(self, H: int, W: int) -> dict[str, int]:
        """The window when 10 tries found none: the largest centred one within ``ratio``."""
        r = W / H
        if r < self.params.ratio[0]:
            w, h = W, max(1, int(round(W / self.params.ratio[0])))
        elif r > self.params.ratio[1]:
            h, w = H, max(1, int(round(H * self.params.ratio[1])))
        else:
            h, w = H, W
        return {"top": (H - h) // 2, "left": (W - w) // 2, "height": h, "width": w}

    def draw_windows(self, rng: np.random.Generator, H: int, W: int, n: int) -> dict[str, np.ndarray]:
        """``n`` windows by :meth:`draw_window`'s rule at once (the Loader's device twin draws a batch so): each
        window's 10 tries are drawn together, the first that fits is taken, else the same fallback; the same
        distribution, drawn in another order. Arrays of int64."""
        p = self.params

        def u(r: list[float], shape: tuple[int, int]) -> np.ndarray:   # base.uniform, for many draws
            return np.full(shape, float(r[0]) + 0.0) if r[0] == r[1] else rng.uniform(r[0], r[1], shape)

        lr = [math.log(p.ratio[0]), math.log(p.ratio[1])]
        a = (H * W) * u(p.scale, (n, 10))
        r = np.exp(u(lr, (n, 10)))
        w = np.rint(np.sqrt(a * r)).astype(np.int64)
        h = np.rint(np.sqrt(a / r)).astype(np.int64)
        fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
        first, hit = fits.argmax(axis=1), fits.any(axis=1)
        rows = np.arange(n)
        fb = self._fallback_window(H, W)
        hh = np.where(hit, h[rows, first], fb["height"])
        ww = np.where(hit, w[rows, first], fb["width"])
        top = np.where(hit, rng.integers(0, H - hh + 1), fb["top"]) if n else np.zeros(0, np.int64)
        left = np.where(hit, rng.integers(0, W - ww + 1), fb["left"]) if n else np.zeros(0, np.int64)
        return {"top": top.astype(np.int64), "left": left.astype(np.int64), "height": hh.astype(np.int64),
                "width": ww.astype(np.int64)}

    def neutral_params(self, sample, targets):
        # resize + centre crop: the largest centred window with the output's aspect ratio
        H, W = self.common_hw(sample, targets)
        h_out, w_out = self.params.size
        if W * h_out >= H * w_out:
            h, w = H, min(W, max(1, int(round(H * w_out / h_out))))
        else:
            h, w = min(H, max(1, int(round(W * h_out / w_out)))), W
        return {"top": (H - h) // 2, "left": (W - w) // 2, "height": h, "width": w}

    def coord_map(self, grid, top: int, left: int, height: int, width: int, **_):
        h, w = self.params.size
        sx, sy = w / width, h / height
        return _shift_scale(sx, sy, -left * sx, -top * sy), (h, w)

    def _window(self, a, top: int, left: int, height: int, width: int) -> np.ndarray:
        H, W = a.shape[:2]
        if not (0 <= top and top + height <= H and 0 <= left and left + width <= W and height > 0 and width > 0):
            raise ValueError(f"window ({top}, {left}) {height}x{width} is outside the {H}x{W} input")
        return crop_hw(a, top, left, height, width)

    def apply_image(self, a, top: int, left: int, height: int, width: int, label: bool = False, **_):
        win = self._window(a, top, left, height, width)
        return resize_hwc(win, *self.params.size, "nearest" if label else self.params.interpolation)

    def apply_flow(self, a, top: int, left: int, height: int, width: int, **_):
        return resize_flow(self._window(a, top, left, height, width), *self.params.size)


@STEPS.register()
class RandomFlip(_Spatial2D):
    """Mirror left-right with probability ``horizontal`` and up-down with probability
    ``vertical`` (one draw for all fields); flow negates u (horizontal) or v (vertical).
    Original copy: no flip."""

    name = "random_flip"
    output_version = 2   # 2: keypoints on the right/bottom edge (x == w, y == h) in view: flip twice = identity

    class Params(RandomParams):
        horizontal: float = Field(0.5, description="probability of a left-right mirror",
                                  json_schema_extra=checked(ge=0, le=1))
        vertical: float = Field(0.0, description="probability of an up-down mirror",
                                json_schema_extra=checked(ge=0, le=1))
        flip_pairs: Optional[list[list[int]]] = None   # keypoint indices (from 0) that swap when mirrored

        @field_validator("horizontal", "vertical")
        @classmethod
        def _p(cls, v: float) -> float:
            if not 0 <= v <= 1:
                raise ValueError("a probability must be within [0, 1]")
            return v

        @field_validator("flip_pairs")
        @classmethod
        def _pairs(cls, v: Optional[list[list[int]]]) -> Optional[list[list[int]]]:
            if v is None:
                return v
            seen: list[int] = []
            for pair in v:
                if len(pair) != 2 or pair[0] == pair[1] or min(pair) < 0:
                    raise ValueError(f"a flip pair is two different keypoint indices (from 0), got {pair}")
                if set(pair) & set(seen):
                    raise ValueError(f"keypoint {sorted(set(pair) & set(seen))[0]} is in two flip pairs")
                seen += pair
            return v

    def targets(self, specs: dict[str, FieldSpec]) -> list[str]:
        out = super().targets(specs)
        p = self.params
        for f in out:
            s = specs[f]
            if s.kind is not Kind.KEYPOINTS or not (p.horizontal or p.vertical):
                continue
            if p.flip_pairs is None:
                raise ValueError(f"keypoints field {f!r}: a mirror swaps left and right; say which keypoints "
                                 f"swap with flip_pairs: [[left, right], ...] (indices from 0), or "
                                 f"flip_pairs: [] if none do")
            k = s.shape[1] if len(s.shape) == 3 else None
            if k is not None and p.flip_pairs and max(max(q) for q in p.flip_pairs) >= k:
                raise ValueError(f"flip_pairs name keypoint {max(max(q) for q in p.flip_pairs)}, and field "
                                 f"{f!r} has {k} keypoints (indices from 0)")
        return out

    def __init__(self, params: Any = None):
        super().__init__(params)
        if self.params.flip_pairs:   # 3: a mirror that swaps flip_pairs records the keypoints' source_order (the
            self.output_version = 3  # meta to_source reads); without pairs the bytes are as before: version 2

    def sample_params(self, rng, sample, targets):
        return {"horizontal": bool(rng.random() < self.params.horizontal),
                "vertical": bool(rng.random() < self.params.vertical)}

    def neutral_params(self, sample, targets):
        return {"horizontal": False, "vertical": False}

    def coord_map(self, grid, horizontal: bool, vertical: bool, **_):
        H, W = grid   # a mirror maps x -> W - x (pixel i -> W - 1 - i), y -> H - y
        return _shift_scale(-1 if horizontal else 1, -1 if vertical else 1, W if horizontal else 0,
                            H if vertical else 0), (H, W)

    def apply_image(self, a, horizontal: bool, vertical: bool, label: bool = False, **_):
        return flip_hw(a, horizontal, vertical)

    def apply_flow(self, a, horizontal: bool, vertical: bool, **_):
        return flip_flow(a, horizontal, vertical)


@STEPS.register()
class RandomAffine(_Spatial2D):
    """Rotate by an angle from ``degrees`` (x or [lo, hi]; x means [-x, x]; positive is
    counter-clockwise), scale by a factor from ``scale`` ([lo, hi]) about the centre, and shift
    by up to ``translate`` (a fraction of width and height); the size stays. Uncovered pixels get
    ``fill`` (flow: NaN). Flow is resampled and its vectors rotated and scaled; masks use
    nearest neighbour. Original copy: the identity."""

    name = "random_affine"
    output_version = 2   # 2: a tied instance mask renumbered when a box is dropped; edge keypoints in view

    class Params(RandomParams, _MinVisibility):
        degrees: Union[float, list[float]] = Field(0.0, description="rotation in degrees: x for [-x, x], or "
                                                   "[low, high]", json_schema_extra=checked(ge=0))
        scale: Union[float, list[float]] = Field([1.0, 1.0], description="zoom factor: x exactly, or [low, "
                                                 "high]", json_schema_extra=checked(gt=0, item={"gt": 0}))
        translate: float = Field(0.0, description="largest shift as a fraction of width and height",
                                 json_schema_extra=checked(ge=0, le=1))
        fill: float = Field(0, description="the value of uncovered pixels (flow: NaN, masks: 0)")
        interpolation: Literal["linear", "cubic", "nearest"] = Field(
            "linear", description="resampling filter; masks always use nearest")

        @field_validator("degrees", mode="before")
        @classmethod
        def _d(cls, v: Any) -> Any:
            return range_param(v, "degrees", symmetric_about=0.0)

        @field_validator("scale", mode="before")
        @classmethod
        def _s(cls, v: Any) -> Any:
            lo, hi = range_param(v, "scale")
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
        return self.draw_affine(rng, *self.common_hw(sample, targets))

    def draw_affine(self, rng: np.random.Generator, H: int, W: int) -> dict[str, float]:
        """One draw on an ``H`` x ``W`` grid: the rule of the build step and of the Loader's device twin."""
        p = self.params
        angle = uniform(rng, p.degrees)
        scale = uniform(rng, p.scale)
        tx = uniform(rng, [-p.translate * W, p.translate * W])
        ty = uniform(rng, [-p.translate * H, p.translate * H])
        return {"angle": angle, "scale": scale, "tx": tx, "ty": ty}

    def neutral_params(self, sample, targets):
        return {"angle": 0.0, "scale": 1.0, "tx": 0.0, "ty": 0.0}

    def fill_values(self):
        return {"fill": (self.params.fill, _PADDED)}

    def coord_map(self, grid, angle: float, scale: float, tx: float, ty: float, **_):
        return continuous_map(affine_matrix(*grid, angle, scale, tx, ty)), tuple(grid)

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
