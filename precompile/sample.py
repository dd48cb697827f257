"""The sample type and field specs that flow between decoders, steps and writers.

A sample is a key (the relative source path: stable, used for seeding and in
messages) plus a dict of named arrays, each with a kind (image, mask, flow,
video, volume, audio, label, ...) and per-sample JSON metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

Shape = tuple  # of int | None (None: known only after decoding)

_DTYPE_NAMES: dict = {}


def dtype_name(dt: np.dtype) -> str:
    """``str(dt)`` ("uint8", "float32", ...), cached: numpy builds the name in Python each time."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt)
    return name


@dataclass(frozen=True)
class FieldSpec:
    """What a field holds: kind, shape (None for a size known only after decoding), dtype."""

    kind: str
    shape: Shape
    dtype: str

    def with_(self, **kw: Any) -> "FieldSpec":
        return replace(self, **kw)

    @property
    def fixed(self) -> bool:
        return all(d is not None for d in self.shape)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def nbytes(self) -> int | None:
        if not self.fixed:
            return None
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.kind} ({dims}) {self.dtype}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class Sample:
    key: str
    fields: dict[str, np.ndarray]
    kinds: dict[str, str]
    meta: dict[str, Any] = field(default_factory=dict)
    copy: int = 0

    def specs(self) -> dict[str, FieldSpec]:
        """The actual spec of every field (kind, shape, dtype) of this sample."""
        return {f: FieldSpec(self.kinds[f], a.shape, dtype_name(a.dtype)) for f, a in self.fields.items()}

    def replace_fields(self, new: dict[str, np.ndarray], **kw: Any) -> "Sample":
        fields = dict(self.fields)
        fields.update(new)
        return Sample(key=kw.get("key", self.key), fields=fields, kinds=dict(kw.get("kinds", self.kinds)),
                      meta=dict(kw.get("meta", self.meta)), copy=kw.get("copy", self.copy))
