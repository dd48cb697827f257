"""Annotations (boxes, keypoints) through a step: moved with the grid, their tied rows dropped with them.

A step that applies to ``boxes``/``keypoints`` gets, besides its parameters, ``grid``: the
(height, width) of the sample's planar fields (the image the annotations are in). Its
``apply_boxes`` returns the moved boxes with a row of NaN for every box it drops (nothing
visible, or less than the step's ``min_visibility``, ``min_area``, ``min_width`` or ``min_height``);
:func:`move_annotations` then removes those rows
from the boxes *and* from every field tied to them (``box_labels``, ``keypoints``: see
:func:`precompile.sample.link_fields`), so row i of each still describes the same object.
An instance mask tied to the boxes (``mask == i + 1`` is box i) is renumbered in the same
place (:func:`instance_ids`: the one rule the Loader's device steps use too), so that
stays true: a dropped box's pixels become 0 (background), a kept box's take its new row + 1,
and the ignored regions (the dtype's largest value) stay.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import StepError
from ..kinds import PLANAR, Kind
from ..sample import Sample, ignore_id, stray_ids, tied_to
from .kernels.geometry import spatial_hw


def annotation_grid(sample: Sample, targets: tuple[str, ...] = (), moved: tuple[str, ...] = ()) -> tuple[int, int]:
    """The (height, width) of the grid the annotations ``targets`` are in: the size every planar field of
    ``sample`` shares or, where they differ (a JPEG decoded at 1/k beside a mask at full size), the size of the
    image their boxes are declared to annotate (``links``: boxes -> image, as ``inputs.coco`` declares), else the
    one size of the planar fields the step was told to move with them (``moved``: its ``fields:``)."""
    sizes = {f: spatial_hw(a, sample.kinds[f]) for f, a in sample.fields.items() if sample.kinds[f] in PLANAR}
    if not sizes:
        raise ValueError("boxes and keypoints are coordinates on an image: the sample has no image, mask, flow "
                         "or video field to give their grid")
    if len(set(sizes.values())) > 1:
        links = sample.links
        boxes = {f if sample.kinds[f] is Kind.BOXES else links.get(f) for f in targets}
        images = {links.get(b) for b in boxes if b is not None}
        if len(images) == 1 and next(iter(images)) in sizes:
            return sizes[next(iter(images))]
        own = {sizes[f] for f in moved if f in sizes}
        if len(own) == 1:   # fields: [image, boxes] beside a flow of another size: the image's grid
            return own.pop()
        desc = ", ".join(f"{f} {h}x{w}" for f, (h, w) in sizes.items())
        raise ValueError(f"planar fields differ in size ({desc}); which one do the boxes annotate? "
                         f"(resize them to one size first, tie the boxes to their image: FieldSpec.of, or name "
                         f"the step's fields: the image and its boxes)")
    return next(iter(sizes.values()))


def move_annotations(step: Any, sample: Sample, targets: list[str],
                     params_of: Callable[[str], dict[str, Any]],
                     moved: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The new arrays of the annotation fields ``targets`` and of every field tied to a boxes field
    among them: moved by ``step`` (``apply(array, kind, grid=..., **params)``), dropped boxes' rows
    removed everywhere and a tied instance mask renumbered (``moved``: the grid fields the step already
    made, an instance mask among them)."""
    named = getattr(getattr(step, "params", None), "fields", None) or ()
    try:
        grid = annotation_grid(sample, tuple(targets), tuple(named))
    except ValueError as e:
        raise StepError(f"{step.name}: {e}", field=targets[0]) from e
    out: dict[str, np.ndarray] = {}
    for f in targets:
        try:
            out[f] = step.apply(sample.fields[f], sample.kinds[f], grid=grid, **params_of(f))
        except StepError:
            raise
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise StepError(f"{step.name}: {e}", field=f) from e
    for f in targets:
        if sample.kinds[f] is Kind.BOXES:
            _drop_rows(step.name, f, out, sample, moved or {})
    return out


def instance_ids(keep: np.ndarray) -> np.ndarray:
    """The renumbering of an instance mask when boxes are dropped: ``ids[old]`` is the new id of old id
    ``old`` in 0..N, for the N boxes ``keep`` (True: kept) describes. 0 (background) stays 0, box i's
    id i + 1 becomes its new row + 1 if it is kept and 0 if it is dropped. (N + 1,) int64."""
    keep = np.asarray(keep, bool)
    ids = np.zeros(len(keep) + 1, np.int64)
    ids[1:][keep] = np.arange(1, int(keep.sum()) + 1)
    return ids


def renumber_instances(mask: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``mask`` (any shape, integer ids) with :func:`instance_ids` applied: ids of dropped boxes -> 0,
    kept ones -> their new row + 1, 0 and the ignore id as they are. An id that names no box (above
    N, not the ignore id) is a ValueError: the mask does not describe these boxes."""
    top, n = ignore_id(mask.dtype), len(keep)
    stray = stray_ids(mask, n)
    if stray.any():
        bad = int(mask[stray].flat[0])
        raise ValueError(f"instance id {bad} names no box ({n} boxes: mask == i + 1 is box i)")
    ids = instance_ids(keep).astype(mask.dtype)
    return np.where(mask == top, mask, ids[np.minimum(mask, n)])


def _drop_rows(step: str, boxes: str, out: dict[str, np.ndarray], sample: Sample,
               moved: dict[str, np.ndarray]) -> None:
    """Remove the NaN rows of ``out[boxes]`` and the same rows of every field tied to it; renumber a tied
    instance mask (the one ``moved`` holds if the step moved it, else the sample's)."""
    keep = np.isfinite(out[boxes]).all(axis=1)
    for g in tied_to(sample.links, boxes):
        if sample.kinds[g] is Kind.MASK:   # an instance mask: ids, not rows
            if not keep.all():
                try:
                    out[g] = renumber_instances(moved.get(g, sample.fields[g]), keep)
                except ValueError as e:
                    raise StepError(f"{step}: field {g!r} tied to {boxes!r}: {e}", field=g) from e
            continue
        rows = out.get(g, sample.fields[g])
        if len(rows) != len(keep):
            raise StepError(f"{step}: field {g!r} has {len(rows)} rows for the {len(keep)} boxes of {boxes!r} "
                            f"it is tied to (row i describes box i)", field=g)
        if not keep.all():
            out[g] = rows[keep]
    if not keep.all():
        out[boxes] = out[boxes][keep]
