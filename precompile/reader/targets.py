"""Detection targets in the form models take them, and a collate for ``precompile.open`` in a DataLoader.

torchvision's detection models (Faster / Mask / Keypoint R-CNN, RetinaNet, SSD, FCOS) take, in training, a list
with one dict per image (torchmetrics' ``MeanAveragePrecision`` takes its ground truth so too: ``boxes``,
``labels``, and for ``iou_type="segm"`` bool masks, ``masks.bool()``):

- ``boxes``: FloatTensor[N, 4], ``x1, y1, x2, y2`` in pixels of the image (the build's own convention);
- ``labels``: Int64Tensor[N], the class of each box;
- ``masks``: UInt8Tensor[N, H, W], box i's pixels (``mask == i + 1`` of an instance mask tied to the boxes);
- ``keypoints``: FloatTensor[N, K, 3], ``x, y, visibility``.

N is the image's own number of boxes: no padding, no count. A build stores these fields ragged, and the Loader
batches them padded (:mod:`precompile.reader.ragged`); this module gives them back per image:

- :func:`detection_targets` (``precompile.detection_targets``): a padded batch (the Loader's, or
  :class:`Collate`'s) -> the list of per-image dicts, on the batch's device;
- :func:`target_fields`: which loaded fields make the dicts, from the build's ties (``FieldSpec.of``): the one
  boxes field, the ``box_labels`` and ``keypoints`` tied to it, and an instance mask tied to it (declared only:
  a mask beside boxes that is not tied is a label map of classes, never made into instance masks);
- :class:`Collate` (``precompile.collate(ds)``): the ``collate_fn`` of a plain ``torch.utils.data.DataLoader``
  over ``precompile.open(...)``, which pads the ragged fields as the Loader does (torch's default collate
  cannot stack them), or with ``targets="list"`` gives the per-image dicts.

``Loader(..., targets="list")`` puts the dicts in ``batch["targets"]`` in place of the padded fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ShapeMismatchError, echo
from ..kinds import Kind
from ..sample import link_fields, tied_to
from .ragged import check_count_names, count_name, is_ragged_annotation, pad_rows

__all__ = ["TARGETS_KEY", "Collate", "TargetFields", "check_targets", "collate", "detection_targets",
           "image_target", "loader_targets", "replace_with_targets", "target_fields"]

#: the batch key of the per-image target dicts (``targets="list"``)
TARGETS_KEY = "targets"


def check_targets(targets: Any) -> str | None:
    """``targets``: None (padded tensors plus counts, the default) or ``"list"`` (per-image dicts)."""
    if targets not in (None, "list"):
        raise ValueError(f"targets must be None (padded tensors and <field>__count) or 'list' (one dict of tensors "
                         f"per image, as torchvision's detection models take them), got {echo(targets)}")
    return targets


@dataclass(frozen=True)
class TargetFields:
    """The loaded fields that make a target dict: ``boxes``, and those tied to it (None where absent)."""

    boxes: str
    labels: str | None = None
    masks: str | None = None
    keypoints: str | None = None

    def ragged(self) -> list[str]:
        """The padded fields the dicts replace (the boxes and the rows tied to them)."""
        return [f for f in (self.boxes, self.labels, self.keypoints) if f is not None]


def with_declared_ties(specs: dict[str, dict], coco: dict | None) -> dict[str, dict]:
    """``specs``, with the instance mask of an ``inputs.coco`` build made before its tie was declared (issue 32)
    tied to ``boxes`` (as the Loader ties it)."""
    if coco and coco.get("mask") == "instance" and "mask" in specs and "of" not in specs["mask"]:
        specs = {**specs, "mask": {**specs["mask"], "of": "boxes"}}
    return specs


def target_fields(specs: dict[str, dict]) -> TargetFields:
    """The fields of the target dicts among the loaded fields ``specs`` (``{field: spec}`` as the index stores
    them): exactly one boxes field, and the ``box_labels``, ``keypoints`` and instance ``mask`` fields tied to
    it. No boxes field, several, or several fields of one kind tied to the boxes are a ``ValueError`` naming
    them."""
    kinds = {f: Kind.of(s.get("kind")) for f, s in specs.items()}
    boxes = [f for f, k in kinds.items() if k is Kind.BOXES]
    if len(boxes) != 1:
        why = "none is loaded" if not boxes else f"{len(boxes)} are loaded: {', '.join(boxes)}; load one with fields=[...]"
        raise ValueError(f"targets='list' makes one dict per image from one boxes field; {why} "
                         f"(loaded: {', '.join(specs) or 'nothing'})")
    declared = {f: s["of"] for f, s in specs.items() if s.get("of") in specs}
    links = link_fields(kinds, declared)
    tied = tied_to(links, boxes[0])

    def one(kind: Kind, what: str) -> str | None:
        got = [f for f in tied if kinds[f] is kind]
        if len(got) > 1:
            raise ValueError(f"targets='list': {len(got)} {what} fields are tied to {boxes[0]!r} ({', '.join(got)}); "
                             f"load one with fields=[...]")
        return got[0] if got else None

    return TargetFields(boxes[0], one(Kind.BOX_LABELS, "box_labels"), one(Kind.MASK, "instance mask"),
                        one(Kind.KEYPOINTS, "keypoints"))


def variable_fields(specs: dict[str, dict], ragged: Sequence[str]) -> list[str]:
    """The array fields ``targets="list"`` gives as a list of tensors of their own shapes: those whose declared
    shape varies (a ``None`` dimension: images of several sizes and their masks), neither text nor the ragged
    annotation fields (padded, or made into the target dicts)."""
    return [f for f, s in specs.items() if f not in ragged and s.get("kind") != "text"
            and any(d is None for d in (s.get("shape") or ()))]


def instance_masks(mask: torch.Tensor, n: int) -> torch.Tensor:
    """An instance mask ((H, W) or (H, W, 1) ids: ``mask == i + 1`` is box i, 0 background, the dtype's largest
    value ignored) as n binary masks: UInt8Tensor[n, H, W], on its device."""
    m = mask[..., 0] if mask.ndim == 3 else mask
    if m.ndim != 2:
        raise ValueError(f"an instance mask is (H, W) or (H, W, 1) ids, got shape {tuple(mask.shape)}")
    if m.dtype.is_floating_point:
        raise ValueError(f"an instance mask holds integer ids, got {m.dtype} (a converted mask: leave it out of "
                         f"convert_fields)")
    ids = torch.arange(1, n + 1, dtype=torch.int32, device=m.device)
    return (m.to(torch.int32).unsqueeze(0) == ids[:, None, None]).to(torch.uint8)


def image_target(boxes: Any, labels: Any = None, mask: Any = None, keypoints: Any = None) -> dict[str, torch.Tensor]:
    """One image's target dict from its own rows (numpy arrays or tensors, N rows each): ``boxes`` float32
    (N, 4), ``labels`` int64 (N,), ``masks`` uint8 (N, H, W) from the instance mask, ``keypoints`` float32
    (N, K, 3); keys only for what is given."""
    def tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:   # numpy: a copy (a folder build's rows are read-only)
        return (a if isinstance(a, torch.Tensor) else torch.from_numpy(np.array(a))).to(dtype)

    b = tensor(boxes, torch.float32)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"boxes must be (N, 4) x1, y1, x2, y2, got shape {tuple(b.shape)}")
    out = {"boxes": b}
    n = b.shape[0]
    for key, a, dtype in (("labels", labels, torch.int64), ("keypoints", keypoints, torch.float32)):
        if a is None:
            continue
        out[key] = tensor(a, dtype)
        if out[key].shape[0] != n:
            raise ValueError(f"{key} has {out[key].shape[0]} rows for {n} boxes (row i describes box i)")
    if mask is not None:
        out["masks"] = instance_masks(mask if isinstance(mask, torch.Tensor) else torch.from_numpy(np.array(mask)), n)
    return out


def detection_targets(batch: dict[str, Any], boxes: str = "boxes", labels: str | None = "box_labels",
                      masks: str | None = None, keypoints: str | None = "keypoints") -> list[dict[str, torch.Tensor]]:
    """A padded batch (the Loader's, or :class:`Collate`'s: ``batch[boxes]`` (B, Nmax, 4) with
    ``batch[boxes + "__count"]``; or ``ds.batch(idx, pad=True)``'s, each sample's rows in ``batch.shapes``) as one
    dict per image, each holding exactly that image's rows: ``boxes``
    (N, 4) float32, ``labels`` (N,) int64 (from ``batch[labels]``), ``masks`` (N, H, W) uint8 (from the
    instance mask ``batch[masks]``: ``masks[i] = mask == i + 1``), ``keypoints`` (N, K, 3) float32 (a boxes
    field of fixed shape, with no count, gives every row). ``labels``
    and ``keypoints`` are used when the batch holds them; ``masks`` only when named (a mask is an instance mask
    only where the build ties it to the boxes: :func:`target_fields` reads the ties). The tensors are views of
    the batch's (masks: new), on its device; the counts are read on the host (on CUDA, one copy of B integers)."""
    if boxes not in batch:
        raise KeyError(f"detection_targets: the batch has no boxes field {echo(boxes)} (keys: {', '.join(batch)})")
    own = getattr(batch, "shapes", {})   # ds.batch(idx, pad=True): each sample's own shape, no counts

    def rows_of(f: str) -> list[int] | None:
        c = batch.get(count_name(f))
        if c is not None:
            return c.tolist() if isinstance(c, torch.Tensor) else np.asarray(c).tolist()
        if f in own:
            return [int(n) for n in np.asarray(own[f])[:, 0]]
        return None

    counts = rows_of(boxes)
    if counts is None:   # a boxes field of fixed shape (every sample has as many rows): every row is real
        counts = [int(batch[boxes].shape[1])] * int(batch[boxes].shape[0])
    if masks is not None and masks not in batch:
        raise KeyError(f"detection_targets: the batch has no mask field {echo(masks)} (keys: {', '.join(batch)})")
    got = {k: f for k, f in (("labels", labels), ("keypoints", keypoints)) if f is not None and f in batch}
    for f in got.values():
        c = rows_of(f)
        if c is not None and c != counts:
            raise ValueError(f"detection_targets: {f!r} has other row counts than {boxes!r} ({c} and {counts}; is "
                             f"{f!r} tied to {boxes!r}?)")
    out = []
    for i, n in enumerate(counts):
        rows = {k: batch[f][i, :n] for k, f in got.items()}
        out.append(image_target(batch[boxes][i, :n], rows.get("labels"),
                                None if masks is None else batch[masks][i], rows.get("keypoints")))
    return out


def replace_with_targets(batch: dict[str, Any], fields: TargetFields) -> dict[str, Any]:
    """``batch`` with the padded fields of ``fields`` (and their counts) replaced by ``batch["targets"]``, the
    per-image dicts; the instance mask stays in the batch as it is."""
    batch[TARGETS_KEY] = detection_targets(batch, fields.boxes, fields.labels, fields.masks, fields.keypoints)
    for f in fields.ragged():
        batch.pop(f, None)
        batch.pop(count_name(f), None)
    return batch


def loader_targets(specs: dict[str, dict], loaded: Sequence[str]) -> TargetFields:
    """The Loader's target fields (``targets="list"``), checked: no field named ``targets``. (The instance mask is
    never converted: ``convert_fields`` refuses every mask, :class:`~precompile.reader.options.Conversion`.)"""
    check_target_key(loaded)
    return target_fields(specs)


def check_target_key(loaded: Sequence[str]) -> None:
    if TARGETS_KEY in loaded:
        raise ValueError(f"targets='list' puts the per-image dicts in batch[{TARGETS_KEY!r}], and a field is named "
                         f"{TARGETS_KEY!r}; load it under fields=[...] without it, or keep targets=None")


# -- a collate for precompile.open in a DataLoader ----------------------------------------------------------
class Collate:
    """``collate_fn`` for ``torch.utils.data.DataLoader(precompile.open(path), ...)``: a list of samples
    (``ds[i]`` dicts) -> one batch.

    - ragged annotation fields (boxes, box_labels, keypoints) are padded as the Loader pads them: (B, Nmax, ...)
      with NaN (float) or -1 (integer) past a sample's rows (Nmax at least 1), plus ``<field>__count`` (B,)
      int64; ``targets="list"``: the boxes field and the rows tied to it become ``batch["targets"]``, one dict
      per sample (:func:`detection_targets`' dicts, from the sample's own arrays);
    - every other array field is stacked by numpy into a new tensor, numbers and text go through torch's
      ``default_collate`` (a tensor, a list of str); samples of different shapes are a
      :class:`ShapeMismatchError` naming the field and two shapes.

    It holds only the build's field specs (plain data), so it pickles into DataLoader workers."""

    def __init__(self, ds: Any, targets: str | None = None):
        while not hasattr(ds, "field_specs") and hasattr(ds, "dataset") and hasattr(ds, "indices"):
            ds = ds.dataset   # a torch Subset (random_split): the build it wraps
        if not hasattr(ds, "field_specs"):
            raise TypeError(f"precompile.collate(ds) takes a dataset of precompile.open (or a Subset of one), got "
                            f"{type(ds).__name__}")
        loaded = getattr(ds, "fields", None)   # (an empty list loads nothing)
        fields = list(ds.field_specs if loaded is None else loaded)
        specs = with_declared_ties({f: dict(ds.field_specs[f]) for f in fields}, getattr(ds, "coco", None))
        self.specs = specs
        self.targets = check_targets(targets)
        self.ragged = [f for f in fields if is_ragged_annotation(specs[f])]
        check_count_names(fields, self.ragged)
        self.fields = target_fields(specs) if self.targets else None
        if self.fields is not None:
            check_target_key(fields)
        #: with targets="list": the array fields whose shape varies (images of several sizes, their instance
        #: masks), given as a list of tensors of their own sizes, as torchvision's detection models take images
        self.listed = set(variable_fields(specs, self.ragged)) if self.targets else set()

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        from torch.utils.data import default_collate

        if not samples:
            raise ValueError("precompile.collate: an empty batch")
        out: dict[str, Any] = {}
        skip = set(self.fields.ragged()) if self.fields is not None else set()
        for name in samples[0]:
            values = [s[name] for s in samples]
            if name in skip:
                continue
            if name in self.ragged:
                spec = self.specs[name]
                a, n = pad_rows([np.asarray(v) for v in values], tuple(int(d) for d in spec["shape"][1:]),
                                np.dtype(spec["dtype"]))
                out[name], out[count_name(name)] = torch.from_numpy(a), torch.from_numpy(n)
                continue
            if name in self.listed:   # numpy: a copy (a folder build's arrays are read-only)
                out[name] = [torch.from_numpy(np.array(v)) for v in values]
                continue
            shapes = [np.shape(v) for v in values]
            diff = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
            if diff is not None and not isinstance(values[0], str):
                raise ShapeMismatchError(
                    f"field {name!r}: cannot stack samples of different shapes {shapes[0]} (batch position 0) and "
                    f"{shapes[diff]} (batch position {diff}); resize to a fixed size in the recipe, leave the "
                    f"field out (precompile.open(path, fields=[...])), or with targets='list' (a field the build "
                    f"declares of varying shape) take it as a list of tensors")
            out[name] = (torch.from_numpy(np.stack(values)) if isinstance(values[0], np.ndarray)
                         else default_collate(values))
        if self.fields is not None:
            f = self.fields
            out[TARGETS_KEY] = [image_target(s[f.boxes], s[f.labels] if f.labels else None,
                                             s[f.masks] if f.masks else None,
                                             s[f.keypoints] if f.keypoints else None) for s in samples]
        return out

    def __repr__(self) -> str:
        return f"precompile.collate(<{len(self.specs)} fields>, targets={self.targets!r})"


def collate(ds: Any, targets: str | None = None) -> Collate:
    """The ``collate_fn`` for a ``torch.utils.data.DataLoader`` over ``ds`` (``precompile.open(path)``, an
    ``epoch_view`` of it, or a torch ``Subset`` of either, as ``random_split`` makes): ragged
    annotation fields padded as the Loader pads them, plus ``<field>__count``; ``targets="list"``: per-image
    target dicts in ``batch["targets"]``. See :class:`Collate`."""
    if isinstance(ds, (list, tuple)):
        raise TypeError("precompile.collate(ds) makes the collate function of a build: "
                        "DataLoader(ds, collate_fn=precompile.collate(ds)), not collate_fn=precompile.collate")
    return Collate(ds, targets)
