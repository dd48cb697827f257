"""``verify`` of an HDF5 build: every byte of every shard, and the index told apart from the shards.

Each index entry records its shard's whole-file ``sha256`` (keys, copies, meta, every field and HDF5's
own structure), so one pass over the file checks all of it. The whole-file hash is the arbiter:

- it matches: the shard is intact; any disagreement between the shard and the index (a field's
  checksum, a ``__key__`` / ``__copy__`` / ``__meta__`` row) is damage to the **index**;
- it differs: the shard is damaged, and verify localises it: a field whose data no longer matches
  its checksum (the shard's own attribute and the index's agree), or a column row that differs from
  the index's copy (named by column, sample and key). When nothing localises, the bytes changed
  are HDF5 structure (or the index's recorded sha256 itself is damaged; a repair rebuilds the shard).

``checksums=False`` (``verify --quick``) checks files, sizes, keys, counts and columns only.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import names as fmt
from .base import VerifyResult
from ..storage.files import file_sha256
from .hdf5_layout import field_digest, read_index
from .index_columns import column_problems


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _index_columns(path: str) -> dict[str, np.ndarray]:
    """The index's own copies of the columns (``__key__``, ``__copy__``, ``__meta__``)."""
    import h5py

    with h5py.File(path, "r") as f:
        return {c: np.array([_text(v) for v in f[c][:]], dtype=object) if c != fmt.COPY else f[c][:]
                for c in fmt.COLUMNS if c in f}


def _column_problems(f: Any, cols: dict[str, np.ndarray], start: int, n: int) -> list[str]:
    """Rows of the shard's columns that differ from the index's copy: column, sample and key named."""
    out = []
    for c, full in cols.items():
        want = full[start:start + n]
        if c not in f:
            out.append(f"column {c!r} is missing")
            continue
        got = f[c][:]
        got = np.array([_text(v) for v in got], dtype=object) if c != fmt.COPY else got
        if got.shape != want.shape:
            out.append(f"column {c!r} has {got.shape[0]} rows, the index says {n}")
            continue
        diff = np.flatnonzero(got != want)
        if diff.size:
            i = int(diff[0])
            key = cols[fmt.KEY][start + i] if fmt.KEY in cols else "?"
            out.append(f"column {c!r} differs from the index's at sample {i} (key {key!r})"
                       + (f" and {diff.size - 1} more" if diff.size > 1 else ""))
    return out


def _field_problems(f: Any, s: dict[str, Any], fields: dict[str, Any], digests: bool
                    ) -> tuple[list[str], list[str], int]:
    """(damage to the shard, disagreements with the index, bytes hashed) for every field of shard file ``f``."""
    import h5py

    shard, index, nbytes = [], [], 0
    stored = fmt.loads(_text(f.attrs[fmt.A_CHECKSUMS])) if fmt.A_CHECKSUMS in f.attrs else {}
    n = int(s["num_samples"])
    for name in fields:
        if name not in f:
            shard.append(f"field {name!r} is missing")
            continue
        d = f[name]
        if isinstance(d, h5py.Group):   # variable shape: the writer hashed the flat data in order
            rows, d = d[fmt.RAGGED_OFFSETS].shape[0] - 1, d[fmt.RAGGED_DATA]
        else:
            rows = d.shape[0]
        if rows != n:
            shard.append(f"field {name!r} has {rows} samples, the index says {n}")
            continue
        want, own = s["checksums"].get(name), stored.get(name)
        got = None
        if digests:
            got, nb = field_digest(d)
            nbytes += nb
        if got is not None and got != own and got != want:
            shard.append(f"field {name!r}: data checksum mismatch (sha256 {got[:16]}..., recorded "
                         f"{str(want)[:16]}...): its bytes changed")
        elif own != want:
            (index if got is None or got == own else shard).append(
                f"field {name!r}: checksum {str(want)[:16]}... in the index differs from the shard's own "
                f"{str(own)[:16]}..." + (" (which its data match)" if got == own else ""))
    return shard, index, nbytes


def check_shard(sp: str, s: dict[str, Any], fields: dict[str, Any], cols: dict[str, np.ndarray], start: int,
                checksums: bool) -> tuple[list[str], list[str], int]:
    """(problems of the shard file, problems of the index's entry for it, bytes hashed)."""
    import h5py

    if not os.path.isfile(sp):
        return ["file is missing"], [], 0
    size = os.path.getsize(sp)
    if "bytes" in s and size != int(s["bytes"]):
        return [f"size {size} bytes differs from the recorded {s['bytes']}"], [], 0
    whole = s.get("sha256") if checksums else None
    intact = whole is not None and file_sha256(sp) == whole
    nbytes = size if whole is not None else 0
    try:
        with h5py.File(sp, "r") as f:
            a = f.attrs
            head = []
            if _text(a.get(fmt.A_SHARD_KEY)) != s["key"]:
                head.append("shard key differs from the index's (the shard was rebuilt or replaced)")
            if int(a.get(fmt.A_NUM, -1)) != int(s["num_samples"]):
                head.append(f"holds {int(a.get(fmt.A_NUM, -1))} samples, the index says {s['num_samples']}")
            shard, index, nb = _field_problems(f, s, fields, checksums and not intact)
            cols_bad = _column_problems(f, cols, start, int(s["num_samples"]))
    except (OSError, KeyError, ValueError, RuntimeError, AttributeError) as e:
        return ([f"unreadable ({type(e).__name__}: {e})"] if not intact else [],
                [] if not intact else [f"unreadable as the index describes it ({type(e).__name__}: {e})"], nbytes)
    if intact:   # the shard's bytes are the ones the build wrote: what disagrees is the index
        return [], head + shard + index + cols_bad, nbytes
    shard = head + shard + cols_bad
    if whole is not None:
        shard.insert(0, "whole-file sha256 differs from the index's" + ("" if shard or index else
                     ": the bytes changed are HDF5 structure outside the fields and columns (or the index's "
                     "recorded sha256 is damaged)"))
    return shard, index, nbytes + nb


def index_count_and_columns(path: str, shards: list[dict[str, Any]], total: int
                            ) -> tuple[list[str], dict[str, np.ndarray]]:
    """(what is wrong with the index at ``path`` before any shard is read: its sample count against its
    entries, columns it cannot read; its columns, for the shards' checks). A URL's verify runs it too."""
    problems = []
    if sum(int(s["num_samples"]) for s in shards) != total:
        problems.append(f"num_samples {total} differs from the sum over its shards")
    try:
        cols = _index_columns(path)
    except (OSError, KeyError, ValueError) as e:
        problems.append(f"its columns are unreadable ({type(e).__name__}: {e})")
        cols = {}
    return problems, cols


def columnar_copy_problems(path: str, shards: list[dict[str, Any]], cols: dict[str, np.ndarray]) -> list[str]:
    """How the index's columnar copies (``__shards__``, ``__key_utf8__``) disagree with its entries and
    ``__key__`` column (:func:`~.index_columns.column_problems`); no shard is read."""
    try:
        return column_problems(path, shards, cols.get(fmt.KEY))
    except (OSError, KeyError, ValueError) as e:
        return [f"its columnar copies are unreadable ({type(e).__name__}: {e})"]


def verify_hdf5(path: str, checksums: bool = True) -> VerifyResult:
    """Check every shard of the HDF5 output at ``path``; raises FormatError only when the index itself is
    unusable. Damage to the index (``index_problems``) is told apart from damage to a shard."""
    fields, shards, total = read_index(path)
    base = os.path.dirname(os.path.abspath(path))
    res = VerifyResult(num_shards=len(shards), counted="bytes of shard files" if checksums else "bytes")
    res.index_problems, cols = index_count_and_columns(path, shards, total)
    start = 0
    for s in shards:
        name = s["file"]
        bad, idx, nb = check_shard(os.path.join(base, name), s, fields, cols, start, checksums)
        start += int(s["num_samples"])
        res.bytes_checked += nb
        res.num_samples += int(s["num_samples"])
        res.index_problems.extend(f"entry of {name}: {p}" for p in idx)
        if bad:
            res.bad_shards.append(name)
            res.problems.extend(f"{name}: {b}" for b in bad)
    res.index_problems.extend(columnar_copy_problems(path, shards, cols))
    res.problems.extend(f"index: {p}" for p in res.index_problems)
    return res
