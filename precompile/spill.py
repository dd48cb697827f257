"""Samples of one input held until the input is known good, with bounded memory.

The engine writes an input's samples only after all of them were made and
checked, so a failing input is dropped whole. An input that expands into very
many samples (thousands of clips of an hour-long video) would hold them all in
memory; :class:`SampleSpill` keeps the first ``limit`` bytes of arrays in
memory and writes the rest as raw bytes to an unnamed temporary file (deleted
when closed, by the OS if the process dies), reading them back in order. Only
array bytes go to the file (dtype and shape stay in memory): no pickle.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Iterator, Optional, Union

import numpy as np

from .sample import Sample

DEFAULT_LIMIT = 64 << 20


class _Spilled:
    __slots__ = ("key", "kinds", "meta", "copy", "links", "arrays")

    def __init__(self, s: Sample, arrays: list[tuple[str, str, tuple, int, int]]):
        self.key, self.kinds, self.meta, self.copy, self.links = s.key, s.kinds, s.meta, s.copy, s.links
        self.arrays = arrays


class SampleSpill:
    """An append-only list of samples that spills array bytes to disk past ``limit``."""

    def __init__(self, directory: Optional[str] = None, limit: Optional[int] = None):
        self.directory = directory
        self.limit = DEFAULT_LIMIT if limit is None else limit
        self.entries: list[Union[Sample, _Spilled]] = []
        self.in_memory = 0        # array bytes held in memory
        self.spilled = 0          # array bytes written to the file
        self._file: Any = None

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, sample: Sample) -> None:
        nbytes = sum(np.asarray(a).nbytes for a in sample.fields.values())
        if self.in_memory + nbytes <= self.limit:
            self.entries.append(sample)
            self.in_memory += nbytes
            return
        if self._file is None:
            d = self.directory if self.directory and os.path.isdir(self.directory) else None
            self._file = tempfile.TemporaryFile(prefix="precompile-spill-", dir=d)
        arrays = []
        for name, a in sample.fields.items():
            a = np.ascontiguousarray(a)
            off = self._file.tell()
            if a.nbytes:
                self._file.write(a.data.cast("B"))
            arrays.append((name, a.dtype.str, tuple(a.shape), off, a.nbytes))
        self.spilled += nbytes
        self.entries.append(_Spilled(sample, arrays))

    def extend(self, samples: Any) -> None:
        for s in samples:
            self.add(s)

    def __iter__(self) -> Iterator[Sample]:
        """The samples in order; may be iterated again until ``close``."""
        if self._file is not None:
            self._file.flush()
        for e in self.entries:
            if isinstance(e, Sample):
                yield e
                continue
            fields = {}
            for name, dtype, shape, off, nbytes in e.arrays:
                buf = bytearray(nbytes)
                if nbytes:
                    self._file.seek(off)
                    got = self._file.readinto(buf)
                    if got != nbytes:
                        raise OSError(f"spill file gave {got} of {nbytes} bytes")
                fields[name] = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            yield Sample(key=e.key, fields=fields, kinds=e.kinds, meta=e.meta, copy=e.copy, links=e.links)

    def close(self) -> None:
        self.entries = []
        if self._file is not None:
            self._file.close()
            self._file = None
