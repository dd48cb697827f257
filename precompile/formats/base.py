"""The :class:`Format` interface every output format implements, and what formats share.

A format owns both sides of its files: options and spec checks
(``check_specs``), shard writing (``open_shard`` -> :class:`ShardWriter`, one
per shard task; ``read_shard_info`` for incremental rebuilds), the index
(``finalize``, once in the parent), and reading back: ``claims`` (does this
index file belong to me?), ``open`` (a :class:`~precompile.formats.dataset.Dataset`),
``describe`` (for ``precompile inspect``), ``verify`` (for ``precompile
verify``) and ``set_index_attr`` (for ``precompile stats``). Formats register
in ``registry.WRITERS``; :func:`precompile.formats.find_format` picks the one
that claims an index file.

A shard writer writes to a temporary name and renames on ``close`` (after an
fsync), so a killed build never leaves a half-written file under a final name.
Also here: :class:`VerifyResult`, :func:`shard_digest` and :func:`tile_rows`; the local-file helpers
(sha256, fsync, JSON written atomically) are :mod:`precompile.storage.files`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import FormatError, SampleError
from ..kinds import Kind
from ..sample import FieldSpec, Sample, dtype_name, ignore_id, stray_ids
from ..storage.files import file_sha256

if TYPE_CHECKING:
    from .dataset import Dataset


class WriterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)  # validators built on first use


class ShardWriter:
    def __init__(self, path: str, specs: dict[str, FieldSpec], shard_key: str, options: Any, chunking: dict[str, int]):
        self.path = path
        self.tmp_path = f"{path}.tmp-{os.getpid()}"
        self.specs = specs
        self.shard_key = shard_key
        self.options = options
        self.chunking = chunking
        self.count = 0
        self._hash = {f: hashlib.sha256() for f in specs}

    def check(self, sample: Sample) -> None:
        """Raise :class:`SampleError` when a sample does not match the declared specs (dtype, rank,
        fixed dims) or cannot be stored; ``add`` of a checked sample fails only on I/O errors."""
        for f, spec in self.specs.items():
            if f not in sample.fields:
                raise SampleError(f"sample has no field {f!r}", f)
            a = sample.fields[f]
            if dtype_name(a.dtype) != spec.dtype:
                raise SampleError(f"field {f!r}: dtype {a.dtype} differs from the declared {spec.dtype}", f)
            if spec.fixed:
                if tuple(a.shape) != tuple(spec.shape):
                    raise SampleError(f"field {f!r}: shape {tuple(a.shape)} differs from the declared "
                                      f"{tuple(spec.shape)}", f)
            elif a.ndim != len(spec.shape) or any(d is not None and d != n for d, n in zip(spec.shape, a.shape)):
                raise SampleError(f"field {f!r}: shape {tuple(a.shape)} does not fit the declared {spec.describe()}", f)
        check_annotations(self.specs, sample)

    def update_checksums(self, sample: Sample) -> None:
        for f in self.specs:
            self._hash[f].update(np.ascontiguousarray(sample.fields[f]).data)

    def checksums(self) -> dict[str, str]:
        return {f: h.hexdigest() for f, h in self._hash.items()}

    def add(self, sample: Sample) -> None:
        raise NotImplementedError

    def close(self) -> dict[str, Any]:
        """Finish the shard (rename into place); returns {num_samples, bytes, checksums, sha256} and, for a
        format whose index gathers from its shards, ``parts`` (what finalize needs, see ``Format.finalize``)."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


def check_annotations(specs: dict[str, FieldSpec], sample: Sample) -> None:
    """What the build stores as annotations holds what their readers assume (docs/annotations.md), whatever
    made them (a plugin decoder, a table, no step at all): boxes finite with x1 <= x2 and y1 <= y2; the rows
    tied to boxes (``box_labels``, ``keypoints``) one per box; an instance mask tied to boxes holding 0, the
    ignore id or ``i + 1`` for a box ``i`` only. Before, a build with no step that drops a box stored such
    fields unchecked, and the Loader's device steps later moved the wrong pixels without a word."""
    for f, spec in specs.items():
        if spec.kind is Kind.BOXES:
            b = sample.fields[f]
            if b.ndim != 2 or b.shape[1] != 4:
                raise SampleError(f"field {f!r}: boxes must be (N, 4) x1, y1, x2, y2, got shape {tuple(b.shape)}", f)
            fin = np.isfinite(b).all(axis=1)
            bad = np.flatnonzero(~fin | (b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1]))
            if bad.size:
                i = int(bad[0])
                what = "holds a non-finite value" if not fin[i] else "has x2 < x1 or y2 < y1"
                raise SampleError(f"field {f!r}: box {i} {np.asarray(b[i]).tolist()} {what} (boxes are x1, y1, x2, y2)", f)
    for f, spec in specs.items():
        boxes = spec.of
        if boxes is None or boxes not in specs or specs[boxes].kind is not Kind.BOXES:
            continue
        n = len(sample.fields[boxes])
        a = sample.fields[f]
        if spec.kind in (Kind.BOX_LABELS, Kind.KEYPOINTS) and len(a) != n:
            raise SampleError(f"field {f!r} has {len(a)} rows for the {n} boxes of {boxes!r} (one row per box)", f)
        if spec.kind is Kind.MASK and a.dtype.kind in "ui":
            stray, top = stray_ids(a, n), ignore_id(a.dtype)
            if stray.any():
                bad_id = int(a[stray].flat[0])
                raise SampleError(f"field {f!r}: instance id {bad_id} names no box of {boxes!r} ({n} boxes: mask == i + 1 "
                                  f"is box i, {top} is ignored)", f)


@dataclass
class VerifyResult:
    """What ``verify`` found; ``problems`` is empty for an intact output."""

    num_shards: int = 0
    num_samples: int = 0
    bytes_checked: int = 0
    counted: str = "bytes of field data"   # what bytes_checked counts (each byte once), for messages
    problems: list[str] = field(default_factory=list)
    bad_shards: list[str] = field(default_factory=list)
    index_problems: list[str] = field(default_factory=list)   # damage to the index, not to any shard
    exit_code: int = FormatError.exit_code

    @property
    def index_damaged(self) -> bool:
        return bool(self.index_problems)

    @property
    def ok(self) -> bool:
        return not self.problems


class Format:
    """A registered output format: writes shards and the index, and reads, describes and verifies them."""

    name: ClassVar[str]
    Options: ClassVar[type[WriterOptions]] = WriterOptions
    shard_ext: ClassVar[str] = ".h5"    # "" for a shard that is a folder
    index_ext: ClassVar[str] = ".h5"

    # -- build side -----------------------------------------------------------------------
    def check_specs(self, specs: dict[str, FieldSpec], options: Any = None) -> None:
        """Raise ValueError (naming the field) when this format cannot hold these fields."""

    @staticmethod
    def chunking(specs: dict[str, FieldSpec], n: int, chunk_bytes: int, chunk_samples: int | None = None
                 ) -> dict[str, int]:
        """Rows per chunk of each fixed-shape field of a shard of ``n`` rows; for a variable-shape field,
        elements per chunk of its flat data array (``chunk_bytes`` worth). Passed to :meth:`open_shard`.

        Chunks tile the shard: at most ``chunk_bytes`` each, as few as that allows, and all of
        the same size where the shard's row count has a divisor that gives at most twice as many
        chunks (256 rows of 12 KiB under 2 MiB: 2 chunks of 128, not 170 + 86 in 340 rows);
        otherwise the rows are spread evenly and the last chunk lacks fewer rows than there are
        chunks. A recipe's ``chunk_samples`` is taken as given. Formats that store no chunks (the
        file folders) get the same numbers and ignore them.
        """
        n = max(1, int(n))
        res = {}
        for f, s in specs.items():
            if not s.fixed:
                res[f] = max(1, chunk_bytes // s.itemsize)
            elif chunk_samples:
                res[f] = chunk_samples
            else:
                res[f] = tile_rows(n, chunk_bytes // max(1, s.nbytes() or 1))
        return res

    def open_shard(self, path: str, specs: dict[str, FieldSpec], shard_key: str, options: Any,
                   chunking: dict[str, int]) -> ShardWriter:
        raise NotImplementedError

    def read_shard_info(self, path: str) -> dict[str, Any] | None:
        """{key, num_samples, checksums, bytes} of a finished shard, or None if missing or unreadable."""
        raise NotImplementedError

    def finalize(self, out_path: str, shards: list[dict[str, Any]], specs: dict[str, FieldSpec],
                 attrs: dict[str, Any], parts: Sequence[Any] | None = None) -> None:
        """Write the index at ``out_path`` over ``shards`` (their entries, in order). ``parts``: per shard, what
        its writer's ``close`` returned as ``parts`` (None where unknown: the format reads its shard)."""
        raise NotImplementedError

    # -- read side ------------------------------------------------------------------------
    @classmethod
    def claims(cls, head: bytes) -> bool:
        """True when an index file starting with ``head`` (its first bytes) is this format's."""
        return False

    def open(self, path: str, fields: Sequence[str] | None = None) -> "Dataset":
        """The map-style dataset over the index file at ``path``."""
        raise NotImplementedError

    def describe(self, ds: "Dataset") -> tuple[list[str], dict[str, str]]:
        """For ``precompile inspect``: extra summary lines, and per field where/how it is stored."""
        return [], {}

    def verify(self, path: str, checksums: bool = True) -> VerifyResult:
        """Re-read every shard of the output at ``path`` and check it against the index; raises
        FormatError only when the index itself is unusable."""
        raise NotImplementedError

    def set_index_attr(self, path: str, name: str, text: str) -> None:
        """Store the JSON text ``text`` as attribute ``name`` of the index file at ``path``, atomically."""
        raise NotImplementedError


def tile_rows(n: int, cap: int) -> int:
    """Rows per chunk for ``n`` rows, at most ``cap`` (>= 1) per chunk; see :meth:`Format.chunking`."""
    cap = max(1, min(n, cap))
    k = -(-n // cap)                     # the fewest chunks that respect the cap
    for kk in range(k, 2 * k + 1):       # the fewest that tile exactly, if not many more
        if n % kk == 0:
            return n // kk
    return -(-n // k)                    # spread evenly: the last chunk lacks < k rows




def range_text(shapes: np.ndarray) -> str:
    """'(64..96, 80..128, 3)' from an (N, ndim) array of sample shapes, for ``describe``."""
    if shapes.size == 0:
        return "no samples"
    lo, hi = shapes.min(axis=0), shapes.max(axis=0)
    return "(" + ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in zip(lo, hi)) + ")"




def shard_digest(path: str) -> str:
    """The whole-shard sha256 the index records (``sha256`` of a shard entry): of the file, or for a shard
    that is a folder, of its manifest: one ``<relative name>\t<sha256 of the file>\n`` line per file, sorted."""
    if not os.path.isdir(path):
        return file_sha256(path)
    lines = []
    for dirpath, dirnames, files in os.walk(path):
        dirnames.sort()
        for n in sorted(files):
            p = os.path.join(dirpath, n)
            lines.append(f"{os.path.relpath(p, path).replace(os.sep, '/')}\t{file_sha256(p)}\n")
    return hashlib.sha256("".join(sorted(lines)).encode()).hexdigest()
