"""Each image field's way back to its source: the composed map the build applied, recorded in the sample's meta.

Every ``image`` field of a sample carries, in its decoder's meta (``meta[field]``), ``to_source``: the 2x3 map
from the stored image's continuous pixel coordinates (pixel (i, j) covers [j, j + 1) x [i, i + 1)) to the
source file's stored pixels, and ``source_size`` ([height, width] of those). It starts as the decode's map
(:func:`start`: the decode scale ``reduce`` and the EXIF ``orientation`` the image decoder records) and each
step that moves the field composes its own (:func:`track`, called where steps apply: ``Step.run``,
``RandomStep.replay``, ``replay_step``): a 2D step's ``coord_map`` with the parameters it used (drawn ones
too), so a random flip of copy 3 is in copy 3's map. A step that only changes values (``keeps_grid``: the
colour steps) leaves the map as it is. Any other step that changes the field (a user step without a
``coord_map``: not known to be a 2D affine map) replaces the map with ``unmapped``: a sentence naming the
step, which ``Dataset.to_source`` gives as its error.

Only ``image`` fields are tracked: coordinates (boxes, keypoints) annotate images; masks and flow move with
them; a clip's frames may be decoded through their steps in a stream, and a volume has no 2D map.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..kinds import Kind
from ..sample import Sample
from .kernels import maps
from .kernels.geometry import reflects, spatial_hw, swap_pairs

#: the keys of a field's meta this module writes
TO_SOURCE, SOURCE_SIZE, UNMAPPED = "to_source", "source_size", "unmapped"
#: in a keypoints field's meta: per stored keypoint slot, the source's slot it holds, when a mirror with
#: ``flip_pairs`` swapped them (left out while every slot holds its own)
SOURCE_ORDER = maps.SOURCE_ORDER
EXTENT = maps.EXTENT


def pending_extent(sample: Sample, meta: dict[str, Any], f: str) -> list[float] | None:
    """The source's extent ([height, width] in the array's pixels) that image field ``f``'s decode left for
    its first resample (:data:`~.kernels.maps.EXTENT`), or None."""
    if sample.kinds.get(f) is not Kind.IMAGE:
        return None
    m = meta.get(f)
    return m.get(EXTENT) if isinstance(m, dict) else None


def settle(sample: Sample) -> Sample:
    """``sample`` with every image field whose decode left its extent to a resample that did not come (a
    safety net: ``jpeg_reduce`` hands it only to a ``resize`` that runs first) resampled onto its own grid
    from that extent (linear), and the extent taken off its meta; the same sample when there is none."""
    if not any(pending_extent(sample, sample.meta, f) is not None for f in image_fields(sample)):
        return sample
    from .kernels.geometry import resize_hwc

    meta = start(sample)
    new, out = {}, dict(meta)
    for f in image_fields(sample):
        ext = pending_extent(sample, meta, f)
        if ext is None:
            continue
        a = sample.fields[f]
        new[f] = resize_hwc(a, a.shape[0], a.shape[1], "linear", extent=ext)
        fm = _field_meta(meta, f)
        if TO_SOURCE in fm:   # the grid now spans the extent: scale the map's input by extent / size
            h, w = a.shape[:2]
            fm[TO_SOURCE] = maps.to_json(maps.compose(fm[TO_SOURCE], maps.scale_map(ext[1] / w, ext[0] / h)))
        fm.pop(EXTENT, None)
        out[f] = fm
    return sample.replace_fields(new, meta=out)


def compact(sample: Sample) -> Sample:
    """``sample`` with the map left out of every image field whose map is the identity over the stored image's
    own size (no reduce, no turn, no step that moved it: most native-size builds), as the build stores it: an
    index with ``source_maps`` reads a missing map as that identity (formats/dataset.py), and a tiny image's
    meta does not grow by the map's 70 bytes."""
    out = None
    for f in image_fields(sample):
        fm = sample.meta.get(f)
        if not isinstance(fm, dict) or TO_SOURCE not in fm or EXTENT in fm:
            continue
        h, w = spatial_hw(sample.fields[f], Kind.IMAGE)
        if list(fm.get(SOURCE_SIZE, ())) == [h, w] and fm[TO_SOURCE] == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]:
            out = dict(sample.meta) if out is None else out
            rest = {k: v for k, v in fm.items() if k not in (TO_SOURCE, SOURCE_SIZE)}
            if rest:
                out[f] = rest
            else:
                del out[f]
    return sample if out is None else sample.replace_fields({}, meta=out)


def image_fields(sample: Sample) -> list[str]:
    """The sample's ``image`` fields, in field order."""
    return [f for f, k in sample.kinds.items() if k is Kind.IMAGE]


def _field_meta(meta: dict[str, Any], f: str) -> dict[str, Any]:
    m = meta.get(f)
    return dict(m) if isinstance(m, dict) else {}


def start(sample: Sample, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``meta`` (default the sample's) with every image field that has no map yet given its decode's map; the
    same dict when there is nothing to add, else a new one (the given dicts are never changed)."""
    meta = sample.meta if meta is None else meta
    out = None
    for f in image_fields(sample):
        m = meta.get(f)
        if isinstance(m, dict) and (TO_SOURCE in m or UNMAPPED in m):
            continue
        fm = _field_meta(meta, f)
        try:
            T, (H, W) = maps.decode_map_json(spatial_hw(sample.fields[f], Kind.IMAGE), fm.get("reduce", 1),
                                             fm.get("orientation", 1), fm.get(SOURCE_SIZE), fm.get(EXTENT))
            fm.update({TO_SOURCE: T, SOURCE_SIZE: [H, W]})
        except (ValueError, TypeError) as e:
            fm[UNMAPPED] = f"the decode's map is not known ({e})"
        out = dict(meta) if out is None else out
        out[f] = fm
    return meta if out is None else out


def track(step: Any, sample: Sample, targets: list[str], params_of: Callable[[str], dict[str, Any]],
          meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` (the moved sample's, from ``sample``) with the map of every image field among ``targets``
    composed with ``step``'s, for the parameters ``params_of(field)`` it used; see the module docstring."""
    meta = _track_order(step, sample, targets, params_of, meta)
    moved = [f for f in targets if sample.kinds.get(f) is Kind.IMAGE]
    if not moved:
        return meta
    meta = start(sample, meta)
    out = dict(meta)
    for f in moved:
        fm = _field_meta(meta, f)
        if UNMAPPED in fm or getattr(step, "keeps_grid", False):
            continue
        coord_map = getattr(step, "coord_map", None)
        why = None
        if coord_map is None:
            why = ("it has no coord_map: its move is not known to be a 2D affine map (a step that changes "
                   "values only says keeps_grid = True)")
        else:
            try:
                forward, _ = coord_map(spatial_hw(sample.fields[f], Kind.IMAGE), **params_of(f))
                fm[TO_SOURCE] = maps.back_through(fm[TO_SOURCE], forward)
            except NotImplementedError:
                why = "its coord_map is not implemented"
            except ValueError as e:
                why = f"its map has no inverse ({e})"
        if why is not None:
            fm.pop(TO_SOURCE, None)
            fm[UNMAPPED] = f"step {step.name!r} moved field {f!r} and {why}"
        out[f] = fm
    return out


def _track_order(step: Any, sample: Sample, targets: list[str], params_of: Callable[[str], dict[str, Any]],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the :data:`SOURCE_ORDER` of every keypoints field among ``targets`` that ``step`` mirrors
    with ``flip_pairs`` (its keypoint slots swapped, as ``move_keypoints`` swaps them), so that
    ``Dataset.to_source`` puts each keypoint back in its source's slot; the same dict when nothing swaps."""
    pairs = getattr(getattr(step, "params", None), "flip_pairs", None)
    coord_map = getattr(step, "coord_map", None)
    points = [f for f in targets if sample.kinds.get(f) is Kind.KEYPOINTS]
    if not pairs or coord_map is None or not points:
        return meta
    grids = [spatial_hw(a, sample.kinds[g]) for g, a in sample.fields.items()
             if sample.kinds.get(g) in (Kind.IMAGE, Kind.MASK)]
    out = None
    for f in points:
        try:
            forward, _ = coord_map(grids[0] if grids else (1, 1), **params_of(f))
        except (NotImplementedError, ValueError):
            continue
        if not bool(reflects(forward)):
            continue
        k = int(np.asarray(sample.fields[f]).shape[1])
        fm = _field_meta(meta, f)
        order = np.asarray(fm.get(SOURCE_ORDER, range(k)), np.int64)
        order = swap_pairs(order[None, :, None], pairs)[0, :, 0]
        if (order == np.arange(k)).all():
            fm.pop(SOURCE_ORDER, None)
        else:
            fm[SOURCE_ORDER] = [int(v) for v in order]
        out = dict(meta) if out is None else out
        if fm:
            out[f] = fm
        else:
            out.pop(f, None)
    return meta if out is None else out
