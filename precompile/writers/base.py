"""The writer interface: one ``ShardWriter`` per shard task, ``finalize`` once in the parent.

A shard writer writes to a temporary name and renames on ``close`` (after an
fsync), so a killed build never leaves a half-written file under a final name.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..sample import FieldSpec, Sample


class WriterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        """Raise ValueError when a sample does not match the declared specs."""
        for f, spec in self.specs.items():
            if f not in sample.fields:
                raise ValueError(f"sample has no field {f!r}")
            a = sample.fields[f]
            if str(a.dtype) != spec.dtype:
                raise ValueError(f"field {f!r}: dtype {a.dtype} differs from the declared {spec.dtype}")
            if spec.fixed and tuple(a.shape) != tuple(spec.shape):
                raise ValueError(f"field {f!r}: shape {tuple(a.shape)} differs from the declared {tuple(spec.shape)}")

    def update_checksums(self, sample: Sample) -> None:
        for f in self.specs:
            self._hash[f].update(np.ascontiguousarray(sample.fields[f]).data)

    def checksums(self) -> dict[str, str]:
        return {f: h.hexdigest() for f, h in self._hash.items()}

    def add(self, sample: Sample) -> None:
        raise NotImplementedError

    def close(self) -> dict[str, Any]:
        """Finish the shard (rename into place); returns {num_samples, bytes, checksums}."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class Writer:
    """A registered output format."""

    name: ClassVar[str]
    Options: ClassVar[type[WriterOptions]] = WriterOptions
    shard_ext: ClassVar[str] = ".h5"

    def check_specs(self, specs: dict[str, FieldSpec]) -> None:
        """Raise ValueError when this format cannot hold these fields."""

    def open_shard(self, path: str, specs: dict[str, FieldSpec], shard_key: str, options: Any,
                   chunking: dict[str, int]) -> ShardWriter:
        raise NotImplementedError

    def read_shard_info(self, path: str) -> dict[str, Any] | None:
        """{key, num_samples, checksums, bytes} of a finished shard, or None if missing or unreadable."""
        raise NotImplementedError

    def finalize(self, out_path: str, shards: list[dict[str, Any]], specs: dict[str, FieldSpec],
                 attrs: dict[str, Any]) -> None:
        raise NotImplementedError


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
