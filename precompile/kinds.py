"""Field kinds: what a field's array means, and so what every step may do to it.

A kind is not a label for display: it decides the layout of the array, how it
may be resampled and which values it may hold. Every step states, per kind,
whether it transforms a field of that kind, keeps it as it is, or refuses the
recipe (see :mod:`precompile.transforms.base`); nothing else in the package
decides that again.

========== ================= ==================================================
kind        layout            rule
========== ================= ==================================================
image       (H, W, C)         pixels; interpolated (area when shrinking, linear)
mask        (H, W, 1)         a label map (binary or multi-class; tied to boxes:
                              instance ids): nearest neighbour only, values
                              never invented
flow        (H, W, 2) float32 optical flow (u, v) in pixels, NaN where unknown;
                              vectors follow the geometry (a flip negates u, a
                              resize scales them)
flow_valid  (H, W, 1) uint8   1 where its flow field is finite. *Derived*: it is
                              recomputed from its flow after every change, so it
                              can never disagree with the NaNs
video       (T, H, W, C)      frames; a 2D step maps over the frames
volume      (D, H, W)         intensities (HU for CT); 3D steps only
volume_mask (D, H, W)         a 3D label volume: moves with its volume in every
                              3D step, nearest neighbour only
audio       (C, N)            samples, channels first
label       ()                a class id
index       (n,)              integers describing the sample (clip frames, corners)
boxes       (N, 4) float32    axis-aligned boxes x1, y1, x2, y2 in pixels of the
                              image they annotate (N varies per sample: ragged)
box_labels  (N,) int64        one class id per box of its boxes field (``of``);
                              a box a step drops takes its label with it
keypoints   (N, K, 3) float32 x, y in pixels and visibility (0 not labelled or
                              out of view, 1 labelled hidden, 2 visible)
text        ()  str           UTF-8 text describing the sample (a caption)
target      () or (n,) f32    regression or multi-label targets; NaN = blank
========== ================= ==================================================

``boxes``, ``box_labels`` and ``keypoints`` are *annotations* of a planar grid:
they hold coordinates, not pixels, so every geometric step states what it does
to them (the rules live with the steps, like every other kind's; the table is
docs/annotations.md). Coordinates are continuous pixels: pixel (i, j) covers
[j, j + 1) x [i, i + 1), so a W-wide image spans x in [0, W] and a flip maps
x -> W - x.

Ties (``FieldSpec.of``, ``Sample.links``; :func:`precompile.sample.link_fields`):
a ``box_labels`` field belongs to a boxes field (``<boxes>_labels``, or else the
only boxes field; none is an error), and a ``keypoints`` field may belong to
one (``<boxes>_keypoints``, or else the only boxes field; with no boxes field
it stands alone). Row i of a tied field describes box i: a step that drops a
box (nothing, or less than its ``min_visibility``, ``min_area``, ``min_width`` or
``min_height``, left in view) drops row i of every field tied to it. ``flow_valid`` is tied to its flow the same way. A
``mask`` tied to a boxes field (declared only, never guessed: ``of`` in its
spec; ``inputs.coco`` with ``mask: instance`` declares it) is an *instance
mask*: ``mask == i + 1`` is the pixels of box i, 0 background, the dtype's
largest value an ignored region; a step that drops a box renumbers it (the
dropped box's pixels become 0, later boxes' ids move down with their rows).

A batch pads the missing rows of a ragged annotation field with
:func:`pad_value`: NaN (boxes, keypoints) or -1 (box_labels).
"""
from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np

from .errors import PrecompileError


class Kind(str, Enum):
    IMAGE = "image"
    MASK = "mask"
    FLOW = "flow"
    FLOW_VALID = "flow_valid"
    VIDEO = "video"
    VOLUME = "volume"
    VOLUME_MASK = "volume_mask"
    AUDIO = "audio"
    LABEL = "label"
    INDEX = "index"
    BOXES = "boxes"
    BOX_LABELS = "box_labels"
    KEYPOINTS = "keypoints"
    TEXT = "text"
    TARGET = "target"

    def __str__(self) -> str:  # "image", not "Kind.IMAGE", in messages and JSON
        return self.value

    __format__ = str.__format__

    @classmethod
    def of(cls, value: Any) -> "Kind":
        """A :class:`Kind` from a kind or its name; an unknown name is a :class:`PrecompileError`."""
        if isinstance(value, Kind):
            return value
        try:
            return cls(value)
        except ValueError:
            raise PrecompileError(f"unknown field kind {value!r} (known: {', '.join(k.value for k in cls)})") from None

    # -- traits -----------------------------------------------------------------------------
    @property
    def planar(self) -> bool:
        """Has a 2D (H, W) grid that 2D geometric steps move."""
        return self in PLANAR

    @property
    def volumetric(self) -> bool:
        """Has a 3D (D, H, W) grid that 3D geometric steps move."""
        return self in VOLUMETRIC

    @property
    def labels(self) -> bool:
        """Holds class ids: resampled by nearest neighbour only, never blended or offset."""
        return self in (Kind.MASK, Kind.VOLUME_MASK, Kind.FLOW_VALID)

    @property
    def hw_axes(self) -> tuple[int, int]:
        """The (height, width) axes of a planar kind's array."""
        if self is Kind.VIDEO:
            return (1, 2)
        if self in PLANAR:
            return (0, 1)
        raise ValueError(f"a {self.value} field has no 2D grid")


PLANAR = frozenset({Kind.IMAGE, Kind.MASK, Kind.FLOW, Kind.FLOW_VALID, Kind.VIDEO})
VOLUMETRIC = frozenset({Kind.VOLUME, Kind.VOLUME_MASK})
#: kinds that describe the sample rather than hold a grid: every step keeps them as they are
DESCRIPTIVE = frozenset({Kind.LABEL, Kind.INDEX, Kind.TEXT, Kind.TARGET})
#: coordinates on a planar grid (ragged: N per sample varies): geometric steps move them with the pixels
ANNOTATIONS = frozenset({Kind.BOXES, Kind.BOX_LABELS, Kind.KEYPOINTS})


def kinds(*names: Any) -> frozenset[Kind]:
    return frozenset(Kind.of(n) for n in names)


def pad_value(dtype: Any) -> Any:
    """What pads the missing rows of a ragged annotation field (``boxes``, ``box_labels``, ``keypoints``)
    in a batch: NaN for float fields, -1 for integer ones, never a real box, point or class id (0 is a
    class). The one rule of the Loader's padded batches and ``ds.batch(pad=True)``."""
    return np.nan if np.issubdtype(np.dtype(dtype), np.floating) else -1


def flow_validity(flow: np.ndarray) -> np.ndarray:
    """The ``flow_valid`` array of a flow field: (..., H, W, 1) uint8, 1 where u and v are finite."""
    return np.isfinite(flow).all(axis=-1, keepdims=True).astype(np.uint8)
