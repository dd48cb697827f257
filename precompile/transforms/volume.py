"""3D volume steps (kind ``volume`` (D, H, W) and ``volume_mask`` (D, H, W) uint8): the lung-CT pipeline.

``resample_volume`` (to a spacing or a shape, masks nearest-neighbour),
``hu_window`` and ``standardise`` (intensity), ``lung_mask`` (threshold,
connected components, hole filling -> a new ``volume_mask`` field),
``apply_mask``, ``crop_pad_volume`` (centre crop/pad to a fixed shape) and the
expanding ``patches3d`` (overlapping patches, each a sample with its corner), and the random
``random_flip3d``, ``random_rot90`` and ``elastic``.
Volume masks (label volumes) have their own kind: every 3D geometric step
moves them with their volume, by nearest neighbour; 2D fields are refused. Spacing is read from and written to the decoder's metadata
(``meta[field]["spacing"]``, [slice, row, col] in mm).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Literal, Optional, Union

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..errors import StepError, echo
from ..kinds import ANNOTATIONS, PLANAR, VOLUMETRIC, Kind, kinds
from ..optschema import checked
from ..registry import STEPS
from ..sample import FieldSpec, Sample
from .base import RandomParams, RandomStep, Step, StepParams, draw_seed, nonnegative_range, uniform
from .kernels.volume import (center_offset, elastic, flip_axes, hu_window, lung_mask, pad_crop_center, patch_corners,
                             rot90, spacing_shape, standardise, voxel_map, zoom_volume)


class VolumeStep(Step):
    """A 3D geometric step: volumes and their label volumes move together; 2D fields are refused."""

    applies = VOLUMETRIC
    refuses = PLANAR | ANNOTATIONS   # 2D grids and their coordinates: a 3D step cannot move them


def _three(v: Any, kind: type, what: str) -> Any:
    if v is None:
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v, v, v]
    if not isinstance(v, (list, tuple)) or len(v) != 3:
        raise ValueError(f"expected 3 {what} [depth, height, width], got {echo(v)}")
    if kind is int:   # never cut: 16.5 is not 16, True is not 1, and int(inf) is an OverflowError
        bad = next((x for x in v if isinstance(x, bool) or not isinstance(x, (int, float))
                    or isinstance(x, float) and not x.is_integer()), None)
        if bad is not None:
            raise ValueError(f"{what} must be whole numbers, got {echo(bad)}")
    out = [kind(x) for x in v]
    if any(x <= 0 for x in out):
        raise ValueError(f"{what} must be positive")
    return out


def _targets_of(step: Step, sample: Sample) -> list[str]:
    specs = sample.specs()
    return step.targets(specs)


def _spacing_of(sample: Sample, fields: list[str], ref: Optional[str]) -> Optional[list[float]]:
    for f in ([ref] if ref else fields):
        m = sample.meta.get(f)
        if isinstance(m, dict) and m.get("spacing") and all(x is not None for x in m["spacing"]):
            return [float(x) for x in m["spacing"]]
    return None


_OPPOSITE = dict(zip("LRPAISlrpais", "RLAPSIrlapsi"))


def carry_geometry(m: Any, P: np.ndarray, t: np.ndarray, shape: tuple[int, ...]) -> Any:
    """A volume field's meta after its voxels moved by ``old_index = P @ new_index + t`` (P a
    signed permutation, see :func:`voxel_map`) to a volume of ``shape``: ``spacing`` and
    ``spacing_rcs`` follow their axes, ``orientation`` (direction cosines of W, H, D) and
    ``axis_directions`` follow them with their signs, ``origin`` becomes the position of the new
    first voxel. Keys a decoder did not give stay absent; a non-dict meta is returned as is."""
    if not isinstance(m, dict):
        return m
    src = [int(np.flatnonzero(P[:, b])[0]) for b in range(3)]    # the old axis each new axis runs along
    sign = [int(P[a, b]) for b, a in enumerate(src)]
    out = {**m, "shape": [int(n) for n in shape[:3]]}
    sp = m.get("spacing")
    if isinstance(sp, list) and len(sp) == 3:
        out["spacing"] = [sp[a] for a in src]
        if "spacing_rcs" in m:
            out["spacing_rcs"] = [out["spacing"][1], out["spacing"][2], out["spacing"][0]]
    codes = m.get("axis_directions")
    if isinstance(codes, list) and len(codes) == 3:
        out["axis_directions"] = [codes[a] if s > 0 else _OPPOSITE.get(codes[a], codes[a]) for a, s in zip(src, sign)]
    ori = m.get("orientation")
    dirs = None
    if isinstance(ori, list) and len(ori) == 3:
        dirs = [np.asarray(ori[2], float), np.asarray(ori[1], float), np.asarray(ori[0], float)]  # D, H, W
        new = [dirs[a] * s for a, s in zip(src, sign)]
        out["orientation"] = [[round(float(x), 7) + 0.0 for x in v] for v in (new[2], new[1], new[0])]
    if m.get("origin") is not None and any(t):
        if dirs is None or not isinstance(sp, list) or any(sp[a] is None for a in range(3) if t[a]):
            out["origin"] = None   # cannot be placed without directions and spacings: not left wrong
        else:
            o = np.asarray(m["origin"], float) + sum(float(t[a]) * float(sp[a]) * dirs[a] for a in range(3) if t[a])
            out["origin"] = [round(float(x), 5) + 0.0 for x in o]
    return out


@STEPS.register()
class ResampleVolume(VolumeStep):
    """Resample volumes (and their masks, nearest) to ``spacing: [z, y, x]`` mm or ``shape: [d, h, w]``.

    The spacing comes from ``meta[spacing_from]["spacing"]`` (default: the first
    targeted field with one); every targeted field gets the same output grid.
    ``order`` (0-3) is the spline order for volumes; every order interpolates (2 and 3
    prefilter the volume first, so a voxel on the old grid keeps its value)."""

    name = "resample_volume"
    output_version = 2   # 2: orders 2-3 prefiltered (they smoothed before); origin and spacing_rcs follow

    class Params(StepParams):
        spacing: Optional[list[float]] = Field(None, description="target voxel spacing [depth, height, width] "
                                               "in mm (one number: isotropic)", json_schema_extra=checked(gt=0, item={"gt": 0}))
        shape: Optional[list[int]] = Field(None, description="target shape [depth, height, width] (one "
                                           "integer: a cube)", json_schema_extra=checked(gt=0, item={"gt": 0}))
        order: int = Field(1, ge=0, le=3)      # spline order for volumes (masks always 0)
        spacing_from: Optional[str] = Field(None, description="take the input spacing from this field's "
                                            "meta instead of the volume's own")

        @field_validator("spacing", mode="before")
        @classmethod
        def _sp(cls, v: Any) -> Any:
            return _three(v, float, "spacings")

        @field_validator("shape", mode="before")
        @classmethod
        def _sh(cls, v: Any) -> Any:
            if isinstance(v, (list, tuple)) and any(isinstance(x, float) for x in v):
                raise ValueError("shape must be integers")
            return _three(v, int, "sizes")

        @model_validator(mode="after")
        def _one(self):
            if (self.spacing is None) == (self.shape is None):
                raise ValueError("give exactly one of spacing, shape")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(self.params.shape) if self.params.shape else (None, None, None))

    def sample_params(self, rng: np.random.Generator, sample: Sample, targets: list[str]) -> dict[str, Any]:
        shape0 = sample.fields[targets[0]].shape
        for f in targets[1:]:
            if sample.fields[f].shape != shape0:
                raise StepError(f"resample_volume: {f} has shape {sample.fields[f].shape}, {targets[0]} "
                                f"{shape0}; they must share a grid", field=f)
        if self.params.shape:
            return {"shape": list(self.params.shape)}
        sp = _spacing_of(sample, targets, self.params.spacing_from)
        if sp is None:
            raise StepError("resample_volume: no spacing in the sample's metadata (decode with dicom/dicom_series, "
                            "or use shape:)", field=targets[0])
        shape = list(spacing_shape(shape0, sp, self.params.spacing))
        for f in targets:   # the plan cannot know this shape (each input's spacing decides it): checked here
            self.check_output_bytes(shape, np.result_type(sample.fields[f].dtype, np.float32), field=f)
        return {"shape": shape, "spacing": sp}

    def apply_volume(self, a: np.ndarray, shape: list[int], order: int | None = None, **_: Any) -> np.ndarray:
        if a.ndim != 3:
            raise ValueError(f"expected a (D, H, W) volume, got shape {a.shape}")
        return zoom_volume(a, tuple(shape), self.params.order if order is None else order)

    def apply_volume_mask(self, a: np.ndarray, shape: list[int], **_: Any) -> np.ndarray:
        return self.apply_volume(a, shape, order=0)

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        targets = _targets_of(self, sample)
        if not targets:
            return [sample]
        prm = self.sample_params(rng, sample, targets)
        old = sample.fields[targets[0]].shape
        new = {}
        for f in targets:
            try:
                new[f] = self.apply(sample.fields[f], sample.kinds[f], **prm)
            except ValueError as e:
                raise StepError(f"{self.name}: {e}", field=f) from e
        meta = dict(sample.meta)
        # zoom_volume scales the field of view (grid_mode): the new first voxel's centre lies at
        # old index (0.5) * old/new - 0.5 along each axis, so the origin moves by that much
        t = np.asarray([0.5 * o / n - 0.5 for o, n in zip(old, prm["shape"])])
        for f in targets:
            m = meta.get(f)
            if isinstance(m, dict) and m.get("spacing"):
                sp = [None if s is None else round(float(s) * o / n, 6) for s, o, n in zip(m["spacing"], old, prm["shape"])]
                m = {**carry_geometry(m, np.eye(3, dtype=np.int64), t, tuple(prm["shape"])), "spacing": sp}
                if "spacing_rcs" in m:
                    m["spacing_rcs"] = [sp[1], sp[2], sp[0]]
                meta[f] = m
        return [sample.replace_fields(new, meta=meta)]


@STEPS.register()
class HuWindow(Step):
    """Clip volumes to a HU window and scale to [0, 1] float32 (or 0..255 uint8).

    ``window: [lo, hi]`` or ``level`` + ``width`` (lung: level -600, width 1500)."""

    name = "hu_window"
    applies = kinds(Kind.VOLUME)

    class Params(StepParams):
        window: Optional[list[float]] = Field(None, description="[low, high] values mapped to [0, 1] (or "
                                              "0-255), the rest clipped", json_schema_extra={"minItems": 2, "maxItems": 2})
        level: Optional[float] = Field(None, description="the window's centre (with width)")
        width: Optional[float] = Field(None, gt=0, description="the window's width (with level)")
        dtype: Literal["float32", "uint8"] = Field("float32", description="output as float32 in [0, 1] or "
                                                   "uint8 in [0, 255]")

        @model_validator(mode="after")
        def _one(self):
            if self.window is not None:
                if len(self.window) != 2 or self.window[1] <= self.window[0]:
                    raise ValueError("window must be [lo, hi] with lo < hi")
                if self.level is not None or self.width is not None:
                    raise ValueError("give window or level+width, not both")
            elif self.level is None or self.width is None:
                raise ValueError("give window: [lo, hi] or both level and width")
            return self

    def bounds(self) -> tuple[float, float]:
        p = self.params
        if p.window is not None:
            return p.window[0], p.window[1]
        return p.level - p.width / 2, p.level + p.width / 2

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(dtype=self.params.dtype)

    def apply_volume(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return hu_window(a, *self.bounds(), self.params.dtype)


@STEPS.register()
class Standardise(Step):
    """(x - mean) / std as float32: fixed ``mean``/``std``, or ``per_sample: true`` (the volume's own,
    optionally inside ``mask``)."""

    name = "standardise"
    applies = kinds(Kind.VOLUME)

    class Params(StepParams):
        mean: Optional[float] = Field(None, description="subtract this (with std)")
        std: Optional[float] = Field(None, gt=0, description="then divide by this (with mean)")
        per_sample: bool = Field(False, description="use each volume's own mean and std instead")
        mask: Optional[str] = None      # with per_sample: statistics over voxels where this mask is set

        @model_validator(mode="after")
        def _one(self):
            if self.per_sample == (self.mean is not None or self.std is not None):
                raise ValueError("give mean and std, or per_sample: true")
            if not self.per_sample and (self.mean is None or self.std is None):
                raise ValueError("give both mean and std")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(dtype="float32")

    def sample_params(self, rng: np.random.Generator, sample: Sample, targets: list[str]) -> dict[str, Any]:
        if not self.params.per_sample:
            return {}
        m = None
        if self.params.mask is not None:
            if self.params.mask not in sample.fields:
                raise StepError(f"standardise: no mask field {self.params.mask!r}", field=self.params.mask)
            m = sample.fields[self.params.mask] > 0
        return {"mask": m}

    def apply_volume(self, a: np.ndarray, mask: Optional[np.ndarray] = None, **_: Any) -> np.ndarray:
        if not self.params.per_sample:
            return standardise(a, self.params.mean, self.params.std)
        x = a[mask] if mask is not None and mask.shape == a.shape and mask.any() else a
        x = x.astype(np.float64)
        return standardise(a, float(x.mean()), float(x.std()) or 1.0)


@STEPS.register()
class LungMask(Step):
    """Make a lung mask from a HU volume: air below ``threshold`` not connected to the outside, the
    ``components`` largest 3D components, holes filled -> new (D, H, W) uint8 field ``out``."""

    name = "lung_mask"
    applies = kinds(Kind.VOLUME)

    class Params(StepParams):
        out: str = Field("lung_mask", description="the name of the volume_mask field it adds")
        threshold: float = Field(-320.0, description="HU below which a voxel may be air or lung")
        components: int = Field(2, ge=1, description="keep at most this many largest connected regions")
        min_fraction: float = Field(0.001, ge=0, le=1, description="drop regions smaller than this fraction "
                                    "of the volume")
        closing: int = Field(1, ge=0, le=5, description="iterations of morphological closing (0: none)")
        fill_holes: bool = Field(True, description="fill enclosed holes (vessels) in each slice")

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        t = self.targets(specs)
        if len(t) != 1:
            raise ValueError(f"needs exactly one volume field (found {t}); set fields: [name]")
        if self.params.out in specs:
            raise ValueError(f"out field {self.params.out!r} already exists")
        out = dict(specs)
        out[self.params.out] = FieldSpec(Kind.VOLUME_MASK, specs[t[0]].shape, "uint8", classes=2)
        return out

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        t = _targets_of(self, sample)
        if len(t) != 1:
            raise StepError(f"lung_mask: needs exactly one volume field, found {t}")
        p = self.params
        try:
            m = lung_mask(sample.fields[t[0]], p.threshold, p.components, p.min_fraction, p.fill_holes, p.closing)
        except ValueError as e:
            raise StepError(f"lung_mask: {e}", field=t[0]) from e
        kinds = dict(sample.kinds)
        kinds[p.out] = Kind.VOLUME_MASK
        meta = dict(sample.meta)
        if isinstance(meta.get(t[0]), dict):
            meta[p.out] = {"spacing": meta[t[0]].get("spacing"), "voxels": int(m.sum())}
        return [sample.replace_fields({p.out: m}, kinds=kinds, meta=meta)]


@STEPS.register()
class ApplyMask(Step):
    """Set volume voxels outside ``mask`` (a volume_mask field) to ``fill``."""

    name = "apply_mask"
    applies = kinds(Kind.VOLUME)

    class Params(StepParams):
        mask: str = Field("lung_mask", description="the volume_mask field; voxels outside it are set to fill")
        fill: float = Field(0.0, description="the value of voxels outside the mask")

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        if self.params.mask not in specs:
            raise ValueError(f"no mask field {self.params.mask!r} (fields: {', '.join(specs)})")
        if specs[self.params.mask].kind is not Kind.VOLUME_MASK:
            raise ValueError(f"{self.params.mask!r} is a {specs[self.params.mask].kind.value}, not a volume_mask")
        return super().plan(specs)

    def fill_values(self):
        return {"fill": (self.params.fill, kinds(Kind.VOLUME))}

    def sample_params(self, rng: np.random.Generator, sample: Sample, targets: list[str]) -> dict[str, Any]:
        if self.params.mask not in sample.fields:
            raise StepError(f"apply_mask: no mask field {self.params.mask!r}")
        return {"mask": sample.fields[self.params.mask]}

    def apply_volume(self, a: np.ndarray, mask: np.ndarray, **_: Any) -> np.ndarray:
        if mask.shape != a.shape:
            raise ValueError(f"mask shape {mask.shape} differs from the volume's {a.shape}")
        return np.where(mask > 0, a, np.asarray(self.params.fill).astype(a.dtype)).astype(a.dtype)


@STEPS.register()
class CropPadVolume(VolumeStep):
    """Centre-crop or pad volumes and their masks to ``shape: [d, h, w]`` (volumes padded with
    ``pad_value``, masks with 0)."""

    name = "crop_pad_volume"
    output_version = 2   # 2: the origin (and shape) in meta follow the crop

    class Params(StepParams):
        shape: list[int] = Field(description="output shape [depth, height, width] (one integer: a cube), "
                                 "centred", json_schema_extra=checked(gt=0, item={"gt": 0}))
        pad_value: float = Field(0.0, description="the value of padded voxels (masks: 0)")

        @field_validator("shape", mode="before")
        @classmethod
        def _sh(cls, v: Any) -> Any:
            return _three(v, int, "sizes")

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(self.params.shape))

    def fill_values(self):
        return {"pad_value": (self.params.pad_value, kinds(Kind.VOLUME))}   # masks pad with 0

    def apply_volume(self, a: np.ndarray, value: float | None = None, **_: Any) -> np.ndarray:
        if a.ndim != 3:
            raise ValueError(f"expected a (D, H, W) volume, got shape {a.shape}")
        return pad_crop_center(a, tuple(self.params.shape), self.params.pad_value if value is None else value)[0]

    def apply_volume_mask(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return self.apply_volume(a, value=0)  # label volumes pad with background

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        """The crop/pad, with each field's ``origin`` moved to the new first voxel (and ``shape``)."""
        out = super().run(sample, rng)
        meta = dict(out[0].meta)
        for f in _targets_of(self, sample):
            t = np.asarray([center_offset(n, s) for n, s in zip(sample.fields[f].shape, self.params.shape)])
            if f in meta:
                meta[f] = carry_geometry(meta[f], np.eye(3, dtype=np.int64), t, tuple(self.params.shape))
        return [out[0].replace_fields({}, meta=meta)]


@STEPS.register()
class Patches3d(VolumeStep):
    """Cut overlapping 3D patches of ``size`` every ``stride``: one volume -> many samples.

    Every volume/mask field is cut at the same corners; each patch sample gets the
    key ``<key>#p<n>``, ``meta["patch"]`` = {index, corner, size} and, with
    ``corner_field``, an int32 (3,) field of its corner. ``mask`` +
    ``min_fraction`` keep only patches where that much of the mask is set. Volumes
    smaller than a patch are padded (``pad_value``) when ``pad: true``, else dropped."""

    name = "patches3d"
    expands = True
    output_version = 2   # 2: each patch's origin (and shape) in meta

    class Params(StepParams):
        size: list[int] = Field(description="patch shape [depth, height, width] (one integer: a cube)",
                                json_schema_extra=checked(gt=0, item={"gt": 0}))
        stride: Optional[list[int]] = Field(None, description="step between patch corners (default: size, no "
                                            "overlap)", json_schema_extra=checked(gt=0, item={"gt": 0}))
        pad: bool = Field(True, description="pad the volume so patches cover it to the end")
        pad_value: float = Field(0.0, description="the value of padded voxels (masks: 0)")
        mask: Optional[str] = Field(None, description="a volume_mask field; with min_fraction, keep only "
                                    "patches where enough of it is set")
        min_fraction: float = Field(0.0, ge=0, le=1, description="the least fraction of a patch's voxels set "
                                    "in mask for the patch to be kept")
        max_patches: Optional[int] = Field(None, ge=1, description="keep at most this many patches per volume")
        corner_field: Optional[str] = Field(None, description="also output each patch's corner [z, y, x] as "
                                            "this int field")

        @field_validator("size", "stride", mode="before")
        @classmethod
        def _sh(cls, v: Any) -> Any:
            return _three(v, int, "sizes")

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(self.params.size))

    def fill_values(self):
        return {"pad_value": (self.params.pad_value, kinds(Kind.VOLUME))} if self.params.pad else {}   # masks: 0

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        if self.params.mask is not None and self.params.mask not in specs:
            raise ValueError(f"no mask field {self.params.mask!r}")
        out = super().plan(specs)
        if self.params.corner_field is not None:
            if self.params.corner_field in specs:
                raise ValueError(f"corner_field {self.params.corner_field!r} clashes with an existing field")
            out[self.params.corner_field] = FieldSpec(Kind.INDEX, (3,), "int32")
        return out

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        return list(self.outputs(sample, rng))

    def outputs(self, sample: Sample, rng: np.random.Generator) -> Iterator[Sample]:
        """The patches one at a time (the build spills them past a bound: a CT cut into overlapping 64^3
        patches is thousands of them, gigabytes at once)."""
        p = self.params
        targets = _targets_of(self, sample)
        if not targets:
            yield sample
            return
        shape = sample.fields[targets[0]].shape
        for f in targets[1:]:
            if sample.fields[f].shape != shape:
                raise StepError(f"patches3d: {f} has shape {sample.fields[f].shape}, {targets[0]} {shape}", field=f)
        if len(shape) != 3:
            raise StepError(f"patches3d: expected (D, H, W) volumes, got {shape}", field=targets[0])
        for f in targets:
            try:
                self.check_fills(f, sample.kinds[f], sample.fields[f].dtype)
            except ValueError as e:
                raise StepError(f"patches3d: {e}", field=f) from e
        size = tuple(p.size)
        arrays = {f: sample.fields[f] for f in targets}
        if p.mask is not None and p.mask not in targets:
            if p.mask not in sample.fields:
                raise StepError(f"patches3d: no mask field {p.mask!r}")
            arrays[p.mask] = sample.fields[p.mask]
        offset = (0, 0, 0)
        if any(n < s for n, s in zip(shape, size)):
            if not p.pad:
                return
            grown = tuple(max(n, s) for n, s in zip(shape, size))
            padded = {}
            for f, a in arrays.items():
                padded[f], offset = pad_crop_center(a, grown, p.pad_value if sample.kinds[f] is Kind.VOLUME else 0)
            arrays = padded
            shape = grown
        corners = patch_corners(shape, size, tuple(p.stride or size))
        n = 0
        for c in corners:
            sl = tuple(slice(a, a + s) for a, s in zip(c, size))
            if p.mask is not None and p.min_fraction > 0:
                if np.count_nonzero(arrays[p.mask][sl]) < p.min_fraction * np.prod(size):
                    continue
            new = {f: np.ascontiguousarray(arrays[f][sl]).copy() for f in targets}
            corner = [int(a + o) for a, o in zip(c, offset)]   # in the input volume's voxel grid
            kinds = sample.kinds
            if p.corner_field is not None:
                new[p.corner_field] = np.asarray(corner, np.int32)
                kinds = {**kinds, p.corner_field: Kind.INDEX}
            meta = dict(sample.meta)
            for f in targets:   # each patch's origin is its first voxel's position
                if f in meta:
                    meta[f] = carry_geometry(meta[f], np.eye(3, dtype=np.int64), np.asarray(corner), size)
            meta["patch"] = {"index": n, "corner": corner, "size": list(size)}
            yield sample.replace_fields(new, key=f"{sample.key}#p{n}", meta=meta, kinds=kinds)
            n += 1
            if p.max_patches is not None and n >= p.max_patches:
                break


class _Volume(RandomStep, VolumeStep):
    """Random 3D steps on (D, H, W) volumes and their label volumes (``volume_mask``), which
    always move together; 2D fields are refused (name ``fields:`` to leave them)."""

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        if len(spec.shape) < 3:
            raise ValueError(f"{self.name} needs (D, H, W) arrays, got {spec.describe()}")
        return spec

    def common_shape(self, sample: Sample, targets: list[str]) -> tuple[int, int, int]:
        shapes = {f: tuple(sample.fields[f].shape[:3]) for f in targets}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"fields differ in shape ({shapes}); one draw needs one shape")
        return next(iter(shapes.values()))

    def voxel_op(self, params: dict[str, Any]) -> Optional[Callable[[np.ndarray], np.ndarray]]:
        """The axis permutation / flip this step's ``params`` make (as a numpy view), or None
        when the step moves voxels some other way (the geometry in meta then stays)."""
        return None

    def replay(self, sample: Sample, params: dict[str, Any]) -> Sample:
        out = super().replay(sample, params)
        op = self.voxel_op(params)
        targets = self._targets(sample)
        if op is None or not targets:
            return out
        P, t = voxel_map(op, sample.fields[targets[0]].shape[:3])
        meta = dict(out.meta)
        for f in targets:
            if f in meta:
                meta[f] = carry_geometry(meta[f], P, t, out.fields[f].shape)
        return out.replace_fields({}, meta=meta)


@STEPS.register()
class RandomFlip3d(_Volume):
    """Mirror a volume (and its mask) along each of ``axes`` (0 = z, 1 = y, 2 = x) with
    probability ``prob``, drawn per axis. Original copy: no flip."""

    name = "random_flip3d"
    output_version = 2   # 2: origin, orientation and axis directions follow the flip

    class Params(RandomParams):
        prob: float = Field(0.5, description="probability of a flip, drawn per axis",
                            json_schema_extra=checked(ge=0, le=1))
        axes: list[int] = Field([0, 1, 2], description="axes that may be flipped (0: depth, 1: height, 2: "
                                "width)", json_schema_extra={"uniqueItems": True, "items": {"type": "integer", "enum": [0, 1, 2]}})

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

    def voxel_op(self, params: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
        axes = tuple(params["axes"])
        return lambda a: np.flip(a, axis=axes) if axes else a

    apply_volume_mask = apply_volume  # a mirror moves voxels, it never mixes them


@STEPS.register()
class RandomRot90(_Volume):
    """Rotate a volume (and its mask) by k quarter turns, k drawn from ``k``, in a plane drawn
    from ``planes`` (axis pairs; default the axial y-x plane [1, 2]). Odd k needs a square
    plane so every copy keeps one shape. Original copy: k = 0."""

    name = "random_rot90"
    output_version = 2   # 2: spacing, origin, orientation and axis directions follow the turn

    class Params(RandomParams):
        planes: list[list[int]] = Field([[1, 2]], description="planes [axis, axis] to rotate in; one is drawn",
                                        json_schema_extra={"minItems": 1, "items": {
                                            "minItems": 2, "maxItems": 2, "items": {"type": "integer", "enum": [0, 1, 2]}}})
        k: list[int] = Field([0, 1, 2, 3], description="quarter turns to draw from",
                             json_schema_extra={"minItems": 1, "items": {"type": "integer", "enum": [0, 1, 2, 3]}})

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

    def voxel_op(self, params: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
        return lambda a: np.rot90(a, params["k"], axes=tuple(params["plane"]))

    apply_volume_mask = apply_volume


@STEPS.register()
class Elastic(_Volume):
    """Elastic deformation of a volume and its mask: a ``grid``^3 lattice of random offsets
    (std ``magnitude`` voxels, drawn uniformly from [lo, hi] when a pair is given) smoothed to
    a dense field (see :func:`elastic`); linear for volumes, nearest for masks. The recorded
    seed regenerates the field. Original copy: magnitude 0."""

    name = "elastic"

    class Params(RandomParams):
        magnitude: Union[float, list[float]] = Field(2.0, description="largest displacement in voxels: x, or "
                                                     "[low, high]", json_schema_extra=checked(ge=0, item={"ge": 0}))
        grid: int = Field(4, description="control points per axis of the displacement grid",
                          json_schema_extra=checked(ge=2, le=32))

        @field_validator("magnitude", mode="before")
        @classmethod
        def _m(cls, v: Any) -> Any:
            return nonnegative_range(v, "magnitude")

        @field_validator("grid")
        @classmethod
        def _g(cls, v: int) -> int:
            if not 2 <= v <= 32:
                raise ValueError("grid must be within [2, 32]")
            return v

    def sample_params(self, rng, sample, targets):
        self.common_shape(sample, targets)
        return {"magnitude": uniform(rng, self.params.magnitude), "seed": draw_seed(rng)}

    def neutral_params(self, sample, targets):
        return {"magnitude": 0.0, "seed": 0}

    def apply_volume(self, a, magnitude: float, seed: int, label: bool = False, **_):
        if a.ndim < 3:
            raise ValueError(f"elastic needs a (D, H, W) array, got shape {a.shape}")
        return elastic(a, self.params.grid, magnitude, seed, label)

    def apply_volume_mask(self, a, magnitude: float, seed: int, **_):
        return self.apply_volume(a, magnitude, seed, label=True)
