"""Which stored copy each sample shows in an epoch: ``epoch_rows`` and ``epoch_view``.

A build with ``copies: K`` stores several variants (copies) of every sample key.
Epoch ``e`` shows key ``k`` as its variant number ``e mod n_k`` in a per-key
permutation of its ``n_k`` stored copies, seeded by (seed, key). So every key
shows a different variant in consecutive epochs (when it has more than one),
each variant once every ``n_k`` epochs, and no augmentation work happens at
training time. Pure numpy (no torch, no h5py): the permutation ranks come from
a 64-bit mix of the seed, ``seeding.stable_hash(key)`` and the copy index, so
they are the same in every process and run.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from ..formats.dataset import rows_of
from ..seeding import stable_hash

_M64 = (1 << 64) - 1
_SALT = 0x45504F4348434F50  # "EPOCHCOP": keeps these draws apart from other uses of the key hash


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


class CopySchedule:
    """The per-key copy permutations of a build, computed once; ``rows(epoch)`` is cheap.

    ``keys[i]`` and ``copies[i]`` describe row ``i``. Rows that share a key and a copy (an
    expanding step wrote several samples per copy) form one variant and are returned together.
    ``include_original=False`` leaves copy 0 out for keys that have other copies.
    """

    def __init__(self, keys: Sequence[str], copies: np.ndarray, seed: int, include_original: bool = True):
        copies = np.asarray(copies, dtype=np.int64).reshape(-1)
        if len(keys) != len(copies):
            raise ValueError(f"{len(keys)} keys but {len(copies)} copy indices")
        key_id, ids = _key_ids(keys)
        self.num_keys = len(ids)
        hashes = np.fromiter((stable_hash(k) for k in ids), dtype=np.uint64, count=self.num_keys)
        rows = np.arange(len(copies), dtype=np.int64)
        if not include_original:
            keep = _augmented_rows(key_id, copies, self.num_keys)
            rows, key_id, copies = rows[keep], key_id[keep], copies[keep]
        # variants: distinct (key, copy) pairs
        pairs, pair_of_row = np.unique(np.stack([key_id, copies], axis=1), axis=0, return_inverse=True)
        pair_of_row = pair_of_row.reshape(-1)
        pkey, pcopy = pairs[:, 0], pairs[:, 1]
        seed64 = np.uint64(int(seed) & _M64)
        score = _mix64(_mix64(hashes[pkey] ^ seed64 ^ np.uint64(_SALT)) ^ pcopy.astype(np.uint64))
        order = np.lexsort((pcopy, score, pkey))        # by key, then score (copy breaks ties)
        counts = np.bincount(pkey, minlength=self.num_keys)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rank = np.empty(len(pairs), dtype=np.int64)
        rank[order] = np.arange(len(pairs), dtype=np.int64) - starts[pkey[order]]
        self.variants = counts                          # n_k per key id
        self._rank_of_row = rank[pair_of_row]
        self._key_of_row = key_id
        self._rows = rows

    def rows(self, epoch: int) -> np.ndarray:
        """Row indices for ``epoch``: keys in first-appearance order, one variant each."""
        n = self.variants[self._key_of_row]
        pick = self._rank_of_row == (int(epoch) % np.maximum(n, 1))
        sel_rows, sel_keys = self._rows[pick], self._key_of_row[pick]
        return sel_rows[np.lexsort((sel_rows, sel_keys))].astype(np.int64)


def _key_ids(keys: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
    """Each row's key as a number (first-appearance order), and the numbering."""
    ids: dict[str, int] = {}
    key_id = np.fromiter((ids.setdefault(k, len(ids)) for k in keys), dtype=np.int64, count=len(keys))
    return key_id, ids


def _augmented_rows(key_id: np.ndarray, copies: np.ndarray, num_keys: int) -> np.ndarray:
    """A mask of the rows ``include_original=False`` keeps: every row but copy 0 of the keys that have other
    copies (a key stored as its original alone keeps it)."""
    has_other = np.zeros(num_keys, dtype=bool)
    has_other[key_id[copies != 0]] = True
    return (copies != 0) | ~has_other[key_id]


class AllCopies:
    """``copies="all"`` with ``include_original=False``: every epoch, every row but the originals (copy 0) of the
    keys that have other copies, in file order (the Loader's shuffle then orders them)."""

    def __init__(self, keys: Sequence[str], copies: np.ndarray):
        copies = np.asarray(copies, dtype=np.int64).reshape(-1)
        if len(keys) != len(copies):
            raise ValueError(f"{len(keys)} keys but {len(copies)} copy indices")
        key_id, ids = _key_ids(keys)
        self._rows = np.flatnonzero(_augmented_rows(key_id, copies, len(ids))).astype(np.int64)

    def rows(self, epoch: int) -> np.ndarray:
        return self._rows


def epoch_rows(keys: Sequence[str], copies: np.ndarray, seed: int, epoch: int,
               include_original: bool = True) -> np.ndarray:
    """int64 row indices for ``epoch``: for each distinct key (first-appearance order), the
    row(s) of its copy number ``epoch mod n`` in a (seed, key)-seeded permutation of its copies."""
    return CopySchedule(keys, copies, seed, include_original).rows(epoch)


class EpochView:
    """A map-style view of one epoch of a dataset: ``len``, ``[i]``, ``batch``, ``key``, ``meta``.

    ``view[i]`` is ``ds[rows[i]]``; ``rows`` holds the underlying row indices.
    """

    def __init__(self, ds: Any, rows: np.ndarray, epoch: int):
        self.ds = ds
        self.rows = np.asarray(rows, dtype=np.int64)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.ds[int(self.rows[i])]

    def batch(self, indices: Iterable[int], pad: Any = False) -> Any:
        """``ds.batch`` of the rows at view positions ``indices`` (the dataset's index rules over this view's
        positions: a boolean mask of ``len(view)`` values, a slice, negatives from the end)."""
        return self.ds.batch(self.rows[rows_of(indices, len(self.rows))], pad)

    # what precompile.collate and the readers read from a dataset
    @property
    def fields(self) -> list[str]:
        return self.ds.fields

    @property
    def field_specs(self) -> dict[str, dict]:
        return self.ds.field_specs

    @property
    def label_names(self) -> list[str]:
        return self.ds.label_names

    @property
    def coco(self) -> Any:
        return getattr(self.ds, "coco", None)

    def key(self, i: int) -> str:
        return self.ds.keys[int(self.rows[i])]

    def copy(self, i: int) -> int:
        return int(self.ds.copies[int(self.rows[i])])

    def meta(self, i: int) -> dict:
        return self.ds.meta(int(self.rows[i]))

    def __repr__(self) -> str:
        return f"EpochView(epoch={self.epoch}, {len(self)} of {len(self.ds)} rows)"


def _seed_of(ds: Any) -> int:
    attrs = getattr(ds, "attrs", None) or {}
    if "seed" not in attrs:
        raise ValueError("the dataset records no seed; pass seed=")
    return int(attrs["seed"])


def epoch_view(ds: Any, epoch: int, seed: int | None = None, include_original: bool = True,
               schedule: CopySchedule | None = None) -> EpochView:
    """One epoch of ``ds`` (an H5Dataset: ``.keys``, ``.copies``, ``[i]``, ``batch``): each sample
    key once, as the copy :func:`epoch_rows` picks. ``seed`` defaults to the build's seed; pass a
    ``CopySchedule`` to reuse its work across epochs on large datasets."""
    if schedule is None:
        schedule = CopySchedule(ds.keys, ds.copies, _seed_of(ds) if seed is None else seed, include_original)
    return EpochView(ds, schedule.rows(epoch), epoch)
