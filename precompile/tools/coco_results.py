"""Detections on a build from ``inputs.coco`` as a COCO results file, for ``COCOeval`` against the original
annotation file.

:func:`coco_results` takes per-sample predictions on the stored images (or on the Loader's device-augmented
batches, with each sample's ``device_map``), maps their boxes back to the source images' pixels
(``Dataset.to_source``: the build's recorded map), gives each the sample's COCO ``image_id`` (its meta's
``coco``) and each label the COCO category id (the index attribute ``coco``: categories in id order, label i is
``categories[i]["id"]``), and returns COCO's result records
``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}`` (and ``"keypoints"`` with keypoint predictions).
:func:`write_coco_results` writes them as JSON
(``COCO.loadRes`` reads the file). See docs/coco.md, "Predictions back to the source".
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ..errors import SourceMapError, echo
from ..storage.files import write_json_atomic


def _host(a: Any) -> np.ndarray:
    if hasattr(a, "detach") and hasattr(a, "cpu"):   # a torch tensor, on any device
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def _pairs(predictions: Any) -> Iterable[tuple[int, Any]]:
    if isinstance(predictions, Mapping):
        return predictions.items()
    return predictions


def coco_category_ids(ds: Any) -> list[Any]:
    """The COCO category id of each label id of a build from ``inputs.coco`` (``ds.coco["categories"]``, in
    label order); a ValueError naming the build for any other."""
    coco = ds.coco
    if not coco or not coco.get("categories"):
        raise ValueError(f"{ds.path}: not a build from inputs.coco (no categories in its index attribute 'coco'); "
                         f"pass category_ids= (the COCO id of each label id)")
    return [c["id"] for c in coco["categories"]]


def coco_results(ds: Any, predictions: Any, *, category_ids: Optional[Sequence[Any]] = None,
                 clip: bool = True, flip_pairs: Any = None) -> list[dict[str, Any]]:
    """COCO result records for ``predictions`` on the samples of ``ds`` (a ``precompile.open`` dataset).

    ``predictions``: a mapping ``{row: prediction}`` or pairs ``(row, prediction)``; a prediction is a mapping
    with ``boxes`` (N, 4) x1 y1 x2 y2 in the stored image's pixels, ``labels`` (N,) the build's label ids and
    ``scores`` (N,) (numpy arrays, lists or tensors, as torchvision's detection models return them), and
    optionally ``keypoints`` (N, K, 2) x y or (N, K, 3) x y visibility, one row per box (each record then has
    COCO's ``keypoints`` ``[x, y, v, ...]`` on the source image, every point in its source slot: see
    ``Dataset.to_source``; a point that is not finite is ``0, 0, 0``), and ``device_map``: the sample's map from a
    Loader batch (``Loader.batch_maps``) when the boxes are on a device-augmented batch. Rows of NaN (a batch's padding) are left out. ``category_ids``: the COCO id of
    each label id (default: the build's, :func:`coco_category_ids`). ``clip``: boxes clipped to the source image.
    ``flip_pairs``: with keypoints on device-augmented batches, the Loader's ``random_flip`` ``flip_pairs``
    (``Dataset.to_source`` needs them where a ``device_map`` mirrors).
    Errors name the row: a sample with no COCO image id, a label with no category, shapes that disagree, a
    row given twice or two rows of one COCO image (copies: COCOeval would count the image's detections
    twice), and the map's own (:class:`~precompile.errors.SourceMapError`)."""
    cats = list(category_ids) if category_ids is not None else coco_category_ids(ds)
    out: list[dict[str, Any]] = []
    seen: dict[str, int] = {}   # repr of a COCO image id -> the row whose predictions it has
    rows: set[int] = set()
    for row, pred in _pairs(predictions):
        row = int(row)
        if row < 0 and hasattr(ds, "_index"):
            row = ds._index(row)   # (-1 is the last row: the same sample as len(ds) - 1)
        where = f"{ds.path}: prediction for row {row}"
        if not isinstance(pred, Mapping) or not all(k in pred for k in ("boxes", "labels", "scores")):
            have = sorted(pred) if isinstance(pred, Mapping) else type(pred).__name__
            raise ValueError(f"{where}: expected a mapping with boxes, labels and scores, got {echo(have)}")
        boxes = _host(pred["boxes"]).astype(np.float64)
        if boxes.size == 0:
            boxes = boxes.reshape(0, 4)
        if boxes.ndim != 2 or boxes.shape[1] != 4:
            raise ValueError(f"{where}: boxes must be (N, 4) x1, y1, x2, y2, got shape {boxes.shape}")
        labels, scores = _host(pred["labels"]).reshape(-1), _host(pred["scores"]).reshape(-1)
        if not len(boxes) == len(labels) == len(scores):
            raise ValueError(f"{where}: {len(boxes)} boxes, {len(labels)} labels and {len(scores)} scores "
                             f"(one of each per detection)")
        image_id = (ds.meta(row).get("coco") or {}).get("image_id")
        if image_id is None:
            raise ValueError(f"{where}: sample {echo(ds.key(row))} has no COCO image id (meta 'coco'): not a "
                             f"build from inputs.coco")
        other = seen.setdefault(repr(image_id), row)
        if other == row and row in rows:
            raise ValueError(f"{where}: row {row} is given twice")
        if other != row:
            raise ValueError(f"{where}: rows {other} and {row} are copies {ds.copy(other)} and {ds.copy(row)} of "
                             f"COCO image {echo(image_id)}: COCOeval would count that image's detections twice; "
                             f"give one row per image (the rows of one copy: ds.copy(i) == 0), or merge the "
                             f"copies' detections yourself and give them under one row")
        rows.add(row)
        keep = np.isfinite(boxes).all(axis=1)
        boxes, labels, scores = boxes[keep], labels[keep], scores[keep]
        if not len(boxes):
            continue
        kps = None
        if pred.get("keypoints") is not None:
            kps = _host(pred["keypoints"]).astype(np.float64)
            if kps.ndim != 3 or kps.shape[2] not in (2, 3) or len(kps) != len(keep):
                raise ValueError(f"{where}: keypoints must be (N, K, 2) x, y or (N, K, 3) x, y, visibility, one row "
                                 f"per box ({len(keep)}), got shape {kps.shape}")
            kps = kps[keep]
        try:
            src = ds.to_source(row, boxes=boxes, device_map=pred.get("device_map"), clip=clip)
            if kps is not None:
                kps = ds.to_source(row, keypoints=kps, device_map=pred.get("device_map"), flip_pairs=flip_pairs)
        except SourceMapError:
            raise
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        for n, (b, lab, sc) in enumerate(zip(src.tolist(), labels.tolist(), scores.tolist())):
            if isinstance(lab, float) and not lab.is_integer() or not 0 <= int(lab) < len(cats):
                raise ValueError(f"{where}: label {echo(lab)} is not a label id of the build (0..{len(cats) - 1})")
            if not math.isfinite(float(sc)):
                raise ValueError(f"{where}: score {echo(sc)} is not a finite number")
            rec = {"image_id": image_id, "category_id": cats[int(lab)],
                   "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "score": float(sc)}
            if kps is not None:
                rec["keypoints"] = _coco_keypoints(kps[n])
            out.append(rec)
    return out


def _coco_keypoints(k: np.ndarray) -> list[float]:
    """One detection's (K, 2) or (K, 3) keypoints as COCO's flat ``[x, y, v, ...]``: ``v`` the given visibility
    (1 without one); a point that is not finite (padding, or not predicted) is ``0, 0, 0``."""
    v = k[:, 2] if k.shape[1] == 3 else np.ones(len(k))
    ok = np.isfinite(k[:, :2]).all(axis=1) & np.isfinite(v)
    flat = np.stack([np.where(ok, k[:, 0], 0.0), np.where(ok, k[:, 1], 0.0), np.where(ok, v, 0.0)], axis=1)
    return [float(x) for x in flat.ravel()]


def write_coco_results(path: str, ds: Any, predictions: Any, **kw: Any) -> int:
    """Write :func:`coco_results` of ``predictions`` to ``path`` as a JSON list (atomically: a temporary name,
    then a rename); returns the number of records. ``COCO(annotation_file).loadRes(path)`` reads it."""
    records = coco_results(ds, predictions, **kw)
    write_json_atomic(path, records)
    return len(records)
