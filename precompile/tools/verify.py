"""``precompile verify``: re-read a built output and check it against its index.

The index records, per shard, its file, size, sample count, key and a sha256
per field of the fields' sample bytes (the same digests the writer computed
while writing, and also stored in the shard's own attributes). Verification
re-reads every field dataset of every shard, recomputes the digests and names
each shard whose bytes, size, key or count differ, or which is missing or
unreadable.

File-folder outputs (png, bmp, wav: a JSON index) are checked the same way per
shard folder (``info.json`` present, its key and count), and per sample file:
every file is hashed and compared with the sha256 its shard recorded when it
was written, so a changed byte names the very file; with ``checksums`` every
field is also decoded again and its digest compared with the index's (this
covers the ``.npy`` companions and the values kept in the index).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import format as fmt
from ..errors import FormatError

BLOCK_BYTES = 8 << 20


@dataclass
class VerifyResult:
    """What ``verify`` found; ``problems`` is empty for an intact output."""

    num_shards: int = 0
    num_samples: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    bad_shards: list[str] = field(default_factory=list)
    exit_code: int = FormatError.exit_code

    @property
    def ok(self) -> bool:
        return not self.problems


def _attr(a: Any) -> Any:
    return a.decode() if isinstance(a, bytes) else a


def field_digest(dset: Any, block_bytes: int = BLOCK_BYTES) -> tuple[str, int]:
    """sha256 of a dataset's samples (axis 0) in C order, read in blocks; and the bytes read."""
    h = hashlib.sha256()
    n = dset.shape[0]
    per = max(1, int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize)
    step = max(1, block_bytes // per)
    total = 0
    for i in range(0, n, step):
        a = np.ascontiguousarray(dset[i:i + step])
        h.update(a.data)
        total += a.nbytes
    return h.hexdigest(), total


def _read_index(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    import h5py

    if not os.path.exists(path):
        raise FormatError(f"{path}: no such output (build it first)")
    try:
        with h5py.File(path, "r") as f:
            a = f.attrs
            if _attr(a.get(fmt.A_FORMAT)) != fmt.FORMAT_NAME:
                raise FormatError(f"{path}: not a precompile output (no {fmt.A_FORMAT!r} attribute)")
            if int(a.get(fmt.A_VERSION, -1)) != fmt.FORMAT_VERSION:
                raise FormatError(f"{path}: format version {a.get(fmt.A_VERSION)} is not {fmt.FORMAT_VERSION}")
            fields = fmt.loads(_attr(a[fmt.A_FIELDS]))
            shards = fmt.loads(_attr(a[fmt.A_SHARDS]))
            total = int(a[fmt.A_NUM])
    except OSError as e:
        raise FormatError(f"{path}: cannot read the index file as HDF5 ({e})") from None
    except (KeyError, ValueError) as e:
        raise FormatError(f"{path}: the index file's metadata is damaged ({e})") from None
    return fields, shards, total


def verify(path: str | os.PathLike, checksums: bool = True) -> VerifyResult:
    """Check every shard of the output at ``path``; raises FormatError only when the index itself is unusable."""
    import h5py

    path = str(path)
    if path.endswith(fmt.INDEX_JSON_EXT):
        return verify_folders(path, checksums)
    fields, shards, total = _read_index(path)
    base = os.path.dirname(os.path.abspath(path))
    res = VerifyResult(num_shards=len(shards))
    if sum(int(s["num_samples"]) for s in shards) != total:
        res.problems.append(f"index: num_samples {total} differs from the sum over its shards")
    for s in shards:
        name = s["file"]
        bad: list[str] = []
        sp = os.path.join(base, name)
        if not os.path.isfile(sp):
            bad.append("file is missing")
        else:
            size = os.path.getsize(sp)
            if "bytes" in s and size != int(s["bytes"]):
                bad.append(f"size {size} bytes differs from the recorded {s['bytes']}")
            try:
                with h5py.File(sp, "r") as f:
                    a = f.attrs
                    if _attr(a.get(fmt.A_SHARD_KEY)) != s["key"]:
                        bad.append("shard key differs from the index's (the shard was rebuilt or replaced)")
                    n = int(a.get(fmt.A_NUM, -1))
                    if n != int(s["num_samples"]):
                        bad.append(f"holds {n} samples, the index says {s['num_samples']}")
                    stored = fmt.loads(_attr(a[fmt.A_CHECKSUMS])) if fmt.A_CHECKSUMS in a else {}
                    for fname in fields:
                        if fname not in f:
                            bad.append(f"field {fname!r} is missing")
                            continue
                        d = f[fname]
                        if isinstance(d, h5py.Group):  # variable-shape field: flat data + offsets + shapes
                            rows = d[fmt.RAGGED_OFFSETS].shape[0] - 1
                            d = d[fmt.RAGGED_DATA]     # the writer hashed the samples' bytes in order: the data
                        else:
                            rows = d.shape[0]
                        if rows != int(s["num_samples"]):
                            bad.append(f"field {fname!r} has {rows} samples, the index says {s['num_samples']}")
                            continue
                        want = s["checksums"].get(fname)
                        if stored.get(fname) != want:
                            bad.append(f"field {fname!r}: checksum attribute differs from the index's")
                        if checksums:
                            got, nb = field_digest(d)
                            res.bytes_checked += nb
                            if got != want:
                                bad.append(f"field {fname!r}: data checksum mismatch (sha256 {got[:16]}..., "
                                           f"recorded {str(want)[:16]}...): its bytes changed")
                    for col in fmt.COLUMNS:
                        if col in f and f[col].shape[0] != int(s["num_samples"]):
                            bad.append(f"column {col!r} has {f[col].shape[0]} rows, the index says {s['num_samples']}")
            except (OSError, KeyError, ValueError, RuntimeError, AttributeError) as e:
                bad.append(f"unreadable ({type(e).__name__}: {e})")
        res.num_samples += int(s["num_samples"])
        if bad:
            res.bad_shards.append(name)
            res.problems.extend(f"{name}: {b}" for b in bad)
    return res


def verify_folders(path: str, checksums: bool = True) -> VerifyResult:
    """:func:`verify` for a file-folder output (png, bmp, wav) with a JSON index."""
    from ..reader.dataset import FileDataset
    from ..writers.base import _read_info, file_sha256

    if not os.path.exists(path):
        raise FormatError(f"{path}: no such output (build it first)")
    ds = FileDataset(path)
    base = os.path.dirname(os.path.abspath(path))
    res = VerifyResult(num_shards=len(ds.shards))
    for k, s in enumerate(ds.shards):
        name = s["file"]
        bad: list[str] = []
        folder = os.path.join(base, name)
        info = _read_info(folder) if os.path.isdir(folder) else None
        if not os.path.isdir(folder):
            bad.append("shard folder is missing")
        elif info is None:
            bad.append(f"{fmt.SHARD_INFO} is missing or unreadable")
        else:
            if info.get("key") != s["key"]:
                bad.append("shard key differs from the index's (the shard was rebuilt or replaced)")
            if info.get("num_samples") != s["num_samples"]:
                bad.append(f"holds {info.get('num_samples')} samples, the index says {s['num_samples']}")
        lo, hi = int(ds.offsets[k]), int(ds.offsets[k + 1])
        digests = {f: hashlib.sha256() for f in ds.field_specs}
        readable = True
        for i in range(lo, hi):
            e = ds.samples[i]
            for f, rel in e["files"].items():
                p = os.path.join(base, rel)
                if not os.path.isfile(p):
                    bad.append(f"{rel}: file is missing")
                    readable = False
                    continue
                want = e.get("sha256", {}).get(f)
                if want is not None:
                    got = file_sha256(p)
                    res.bytes_checked += os.path.getsize(p)
                    if got != want:
                        bad.append(f"{rel}: bytes changed (sha256 {got[:16]}..., recorded {want[:16]}...)")
            if checksums and readable:
                try:
                    sample = ds[i]
                except (FormatError, OSError, ValueError) as ex:
                    bad.append(f"sample {e['key']!r}: unreadable ({ex})")
                    readable = False
                    continue
                for f, a in sample.items():
                    a = np.ascontiguousarray(a)
                    digests[f].update(a.data)
                    res.bytes_checked += a.nbytes
        if checksums and readable:
            for f, h in digests.items():
                want = s["checksums"].get(f)
                if h.hexdigest() != want:
                    bad.append(f"field {f!r}: data checksum mismatch (sha256 {h.hexdigest()[:16]}..., "
                               f"recorded {str(want)[:16]}...): its bytes changed")
        res.num_samples += int(s["num_samples"])
        if bad:
            res.bad_shards.append(name)
            res.problems.extend(f"{name}: {b}" for b in bad)
    return res
