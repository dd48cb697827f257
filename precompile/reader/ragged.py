"""Ragged annotation fields in the Loader: boxes, box_labels and keypoints as padded tensors plus counts.

A build stores these fields ragged (N rows per sample, N varying: flat data + offsets + shapes in
HDF5). They are small (16 bytes a box), so :class:`RaggedFields` reads each one whole into memory
when the Loader is made and pads the rows of a batch:

- ``batch[field]``: (B, Nmax, ...) with Nmax the largest count of the batch (at least 1); rows past
  a sample's count are NaN (float fields: boxes, keypoints) or -1 (integer fields: box_labels):
  :func:`precompile.kinds.pad_value`, the rule ``ds.batch(pad=True)`` follows too;
- ``batch[field + "__count"]``: (B,) int64, the sample's number of rows.

Device steps move annotations with the build step's own rules (:func:`move_annotations`): for each
sample, the step's drawn parameters go through the build step's ``apply_boxes``/``apply_keypoints``
(numpy, on the host: a few rows per sample), a dropped box takes the rows tied to it (and renumbers a
tied instance mask on the batch's device: the build's rule, ``instance_ids``), and the batch is padded
again. So CPU and CUDA batches are equal, and equal the build step's replay.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import FormatError
from ..formats import names as fmt
from ..sample import tied_to
from ..kinds import ANNOTATIONS, Kind, pad_value
from ..transforms.annotations import instance_ids

COUNT_SUFFIX = "__count"


def count_name(field: str) -> str:
    """The batch key of a ragged field's per-sample counts: ``<field>__count``."""
    return field + COUNT_SUFFIX


def check_count_names(loaded: Sequence[str], ragged: Sequence[str]) -> None:
    """A ValueError when a loaded field has the name of a ragged field's count key (``boxes__count``, a name a
    field may have): the batch would hold one in the other's place."""
    names = set(loaded)
    for f in ragged:
        if count_name(f) in names:
            raise ValueError(f"the field {count_name(f)!r} has the name of the batch key of {f!r}'s row counts; load "
                             f"the fields without one of them (fields=[...])")


def is_ragged_annotation(spec: dict) -> bool:
    """A boxes / box_labels / keypoints field whose row count varies (stored ragged)."""
    shape = spec.get("shape") or ()
    return Kind.of(spec.get("kind")) in ANNOTATIONS and len(shape) > 0 and shape[0] is None


def pad_rows(rows: Sequence[np.ndarray], inner: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (n_i, *inner) arrays -> (B, max(1, max n_i), *inner) padded, and the counts (B,) int64."""
    counts = np.asarray([len(r) for r in rows], np.int64)
    out = np.full((len(rows), max(1, int(counts.max(initial=0))), *inner), pad_value(dtype), dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, counts


class RaggedFields:
    """The ragged annotation fields ``fields`` of an opened HDF5 build, held in memory."""

    def __init__(self, ds: Any, fields: Sequence[str]):
        self.fields = list(fields)
        self.data: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.inner: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        h5py = _h5()
        with h5py.File(ds.path, "r") as f:
            for name in self.fields:
                spec = ds.field_specs[name]
                inner = tuple(spec["shape"][1:])
                if any(d is None for d in inner):
                    raise FormatError(f"{ds.path}: field {name!r} has shape {tuple(spec['shape'])}: the Loader pads "
                                      f"rows, and needs every other dimension fixed")
                if hasattr(ds, "ragged_arrays"):   # a build read from a URL: the data is in the shards only
                    self.data[name] = ds.ragged_arrays(name)
                else:
                    g = f[name]
                    self.data[name] = (g[fmt.RAGGED_DATA][:], g[fmt.RAGGED_OFFSETS][:], g[fmt.RAGGED_SHAPES][:])
                    check = getattr(ds, "check_index_dataset", None)   # the index's own crc32s (HDF5)
                    if check is not None:
                        check(f"{name}/{fmt.RAGGED_OFFSETS}", self.data[name][1])
                        check(f"{name}/{fmt.RAGGED_SHAPES}", self.data[name][2])
                self.inner[name], self.dtypes[name] = tuple(int(d) for d in inner), np.dtype(spec["dtype"])

    def rows(self, name: str, i: int) -> np.ndarray:
        data, offsets, shapes = self.data[name]
        return data[offsets[i]:offsets[i + 1]].reshape(tuple(int(d) for d in shapes[i]))

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Padded tensors and counts (CPU) of every field for dataset rows ``rows``, in that order."""
        out: dict[str, torch.Tensor] = {}
        for name in self.fields:
            a, n = pad_rows([self.rows(name, int(i)) for i in rows], self.inner[name], self.dtypes[name])
            out[name], out[count_name(name)] = torch.from_numpy(a), torch.from_numpy(n)
        return out

    def keys(self) -> list[str]:
        return [k for f in self.fields for k in (f, count_name(f))]

    def widths(self, group: dict[str, torch.Tensor], sizes: list[int]) -> list[dict[str, int]]:
        """Each batch's padded width per field (its largest count, at least 1), from a task's host counts."""
        out: list[dict[str, int]] = [{} for _ in sizes]
        for name in self.fields:
            for i, c in enumerate(torch.split(group[count_name(name)], sizes)):
                out[i][name] = max(1, int(c.max())) if len(c) else 1
        return out

    def trim(self, batch: dict[str, torch.Tensor], widths: dict[str, int]) -> dict[str, torch.Tensor]:
        """Cut each padded field to its batch's own width (a batch split from a larger task)."""
        for name in self.fields:
            batch[name] = batch[name][:, :widths[name]]
        return batch


def _h5() -> Any:
    import h5py

    return h5py


class AnnotationError(ValueError):
    """A device step cannot move a sample's annotations (a stored box with x2 < x1, tied rows that do not match
    their boxes): ``text`` says what, naming the step, the field and the row in the sample's own rows;
    ``sample`` is the sample's position in its batch (the Loader's :class:`~precompile.reader.feed.Finisher` names
    the build, dataset row and key from it)."""

    def __init__(self, text: str, sample: int):
        super().__init__(f"sample {sample} of the batch: {text}")
        self.text, self.sample = text, sample


def _sample_error(step: Any, field: str, mover: Any, a: np.ndarray, M: np.ndarray, counts: np.ndarray,
                  hw: tuple[int, int], err: ValueError) -> ValueError:
    """The error of moving a batch's rows, named by the first sample whose own rows fail alone (their row
    numbers then count from that sample's first row, as the build's message does)."""
    start = np.concatenate([[0], np.cumsum(counts)])
    for j in range(len(counts)):
        if counts[j] == 0:
            continue
        try:
            mover(a[start[j]:start[j + 1]], M[start[j]:start[j + 1]], hw)
        except ValueError as e:
            return AnnotationError(f"{step.name}: field {field!r}: {e}", j)
    return ValueError(f"{step.name}: field {field!r}: {err}")


def move_annotations(step: Any, batch: dict[str, torch.Tensor],
                     params: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Move the annotation fields a device step covers (``step.bound``) with the build step's rules
    (``move_boxes``/``move_keypoints``) and each sample's drawn ``params``: one coordinate map per
    sample, every row of the batch at once (the same float64 operations as the build's per-sample
    call, so the same bytes), on the grid the step sees (``step.hw``: what the step before it made).
    Dropped boxes take their tied rows along; the fields are padded again (in place in ``batch``, on
    the host). Returns, for each instance mask tied to boxes that lost a row, the samples to renumber
    and each one's id table (:func:`~precompile.transforms.annotations.instance_ids`, the build's rule;
    ids past a sample's boxes map to themselves): ``{mask: (rows, ids)}`` for
    :func:`~precompile.reader.gpu.renumber_masks`."""
    build = step.step
    n = len(next(iter(params.values()))) if params else len(next(iter(batch.values())))
    maps = [build.coord_map(step.hw, **{k: (bool(v[i]) if v.dtype == bool else int(v[i]) if v.dtype.kind in "iu"
                                            else float(v[i])) for k, v in params.items()})
            for i in range(n)]
    hw = maps[0][1]
    M = np.stack([m for m, _ in maps]) if maps else np.zeros((0, 2, 3))
    notes = [f for f, k in step.bound.items() if k in ANNOTATIONS]
    kinds = getattr(step, "kinds", step.bound)
    tied = {f: [t for t in tied_to(step.links, f) if t in batch and kinds.get(t) in ANNOTATIONS] for f in notes}
    masks = {f: [t for t in tied_to(step.links, f) if t in batch and kinds.get(t) is Kind.MASK] for f in notes}
    renumber: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    fields = list(dict.fromkeys([*notes, *(t for f in notes for t in tied[f])]))
    counts = {f: batch[count_name(f)].numpy() for f in fields}
    rows = {f: batch[f].numpy()[np.arange(batch[f].shape[1]) < counts[f][:, None]] for f in fields}
    for f in notes:
        per_row = np.repeat(M, counts[f], axis=0)
        mover = build.move_boxes if step.bound[f] is Kind.BOXES else build.move_keypoints
        try:
            rows[f] = mover(rows[f], per_row, hw)
        except ValueError as e:   # a stored row the step cannot move: name its sample and its own row
            raise _sample_error(step, f, mover, rows[f], per_row, counts[f], hw, e) from None
    for f in notes:
        if step.bound[f] is not Kind.BOXES:
            continue
        keep = np.isfinite(rows[f]).all(axis=1)
        owner = np.repeat(np.arange(n), counts[f])
        if masks[f] and not keep.all():
            ids = _instance_tables(keep, counts[f], owner)
            renumber.update({m: ids for m in masks[f]})
        for t in [f, *tied[f]]:
            if not np.array_equal(counts[t], counts[f]):
                bad = int(np.flatnonzero(counts[t] != counts[f])[0])
                raise AnnotationError(f"{step.name}: field {t!r} has {counts[t][bad]} rows for the "
                                      f"{counts[f][bad]} boxes of {f!r}", bad)
            rows[t] = rows[t][keep]
        for t in [f, *tied[f]]:
            counts[t] = np.bincount(owner[keep], minlength=n).astype(np.int64)
    for f in fields:
        parts = np.split(rows[f], np.cumsum(counts[f])[:-1]) if n else []
        a, c = pad_rows(parts, tuple(batch[f].shape[2:]), batch[f].numpy().dtype)
        batch[f], batch[count_name(f)] = torch.from_numpy(a), torch.from_numpy(c)
    return renumber


def _instance_tables(keep: np.ndarray, counts: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The samples that lost a box and, per sample, its instance mask's id table: :func:`instance_ids` of its
    boxes' ``keep``, the identity past its count (0 .. the batch's largest count)."""
    start = np.concatenate([[0], np.cumsum(counts)])
    lost = np.flatnonzero(np.bincount(owner[~keep], minlength=len(counts)))
    ids = np.tile(np.arange(int(counts.max(initial=0)) + 1, dtype=np.int64), (len(lost), 1))
    for r, j in enumerate(lost):
        ids[r, :counts[j] + 1] = instance_ids(keep[start[j]:start[j + 1]])
    return lost, ids
