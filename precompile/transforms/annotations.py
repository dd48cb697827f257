"""Annotations (boxes, keypoints) through a step: moved with the grid, their tied rows dropped with them.

A step that applies to ``boxes``/``keypoints`` gets, besides its parameters, ``grid``: the
(height, width) of the sample's planar fields (the image the annotations are in). Its
``apply_boxes`` returns the moved boxes with a row of NaN for every box it drops (nothing
visible, or less than ``min_visibility``); :func:`move_annotations` then removes those rows
from the boxes *and* from every field tied to them (``box_labels``, ``keypoints``: see
:func:`precompile.sample.link_fields`), so row i of each still describes the same object.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import StepError
from ..kinds import PLANAR, Kind
from ..sample import Sample, tied_to
from .kernels.geometry import spatial_hw


def annotation_grid(sample: Sample) -> tuple[int, int]:
    """The (height, width) every planar field of ``sample`` shares: the grid its annotations are in."""
    sizes = {f: spatial_hw(a, sample.kinds[f]) for f, a in sample.fields.items() if sample.kinds[f] in PLANAR}
    if not sizes:
        raise ValueError("boxes and keypoints are coordinates on an image: the sample has no image, mask, flow "
                         "or video field to give their grid")
    if len(set(sizes.values())) > 1:
        desc = ", ".join(f"{f} {h}x{w}" for f, (h, w) in sizes.items())
        raise ValueError(f"planar fields differ in size ({desc}); which one do the boxes annotate? "
                         f"(resize them to one size first)")
    return next(iter(sizes.values()))


def move_annotations(step: Any, sample: Sample, targets: list[str],
                     params_of: Callable[[str], dict[str, Any]]) -> dict[str, np.ndarray]:
    """The new arrays of the annotation fields ``targets`` and of every field tied to a boxes field
    among them: moved by ``step`` (``apply(array, kind, grid=..., **params)``), dropped boxes' rows
    removed everywhere."""
    try:
        grid = annotation_grid(sample)
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
            _drop_rows(step.name, f, out, sample)
    return out


def _drop_rows(step: str, boxes: str, out: dict[str, np.ndarray], sample: Sample) -> None:
    """Remove the NaN rows of ``out[boxes]`` and the same rows of every field tied to it."""
    keep = np.isfinite(out[boxes]).all(axis=1)
    for g in tied_to(sample.links, boxes):
        rows = out.get(g, sample.fields[g])
        if len(rows) != len(keep):
            raise StepError(f"{step}: field {g!r} has {len(rows)} rows for the {len(keep)} boxes of {boxes!r} "
                            f"it is tied to (row i describes box i)", field=g)
        if not keep.all():
            out[g] = rows[keep]
    if not keep.all():
        out[boxes] = out[boxes][keep]
