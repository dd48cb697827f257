"""The sample type and field specs that flow between decoders, steps and writers.

A sample is a key (the relative source path: stable, used for seeding and in
messages) plus a dict of named arrays, each with a :class:`~precompile.kinds.Kind`
(image, mask, flow, flow_valid, video, volume, volume_mask, audio, label, index)
and per-sample JSON metadata.

A ``flow_valid`` field is tied to its flow field (``Sample.links``, ``FieldSpec.of``)
and is *derived*: :meth:`Sample.replace_fields` recomputes it whenever its flow
changes, so no step can leave it disagreeing with the flow's NaNs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .kinds import Kind, flow_validity

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
    """What a field holds: kind, shape (None for a size known only after decoding), dtype;
    ``of`` names the flow field a ``flow_valid`` field belongs to; ``classes`` is the number of
    classes a label map (``mask``, ``volume_mask``) may hold, when the recipe says, and
    ``class_ids`` their ids when they are not ``0 .. classes - 1`` (a mask's ``classes: [0, 3, 7]``)."""

    kind: Kind
    shape: Shape
    dtype: str
    of: str | None = None
    classes: int | None = None
    class_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind.of(self.kind))

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
        extra = f" of {self.of}" if self.of else ""
        extra += f", {self.classes} classes" if self.classes else ""
        return f"{self.kind.value} ({dims}) {self.dtype}{extra}"

    def to_json(self) -> dict:
        out = {"kind": self.kind.value, "shape": list(self.shape), "dtype": self.dtype}
        if self.of is not None:
            out["of"] = self.of
        if self.classes is not None:
            out["classes"] = self.classes
        if self.class_ids is not None:
            out["class_ids"] = list(self.class_ids)
        return out


def link_validity(kinds: dict[str, Kind], links: dict[str, str] | None = None) -> dict[str, str]:
    """``{flow_valid field: its flow field}`` for every ``flow_valid`` field of ``kinds``.

    A field not named in ``links`` is tied to ``<name>`` when it is called ``<name>_valid``,
    or else to the only flow field; anything else is a ValueError (which flow would it follow?)."""
    links = dict(links or {})
    flows = [f for f, k in kinds.items() if k is Kind.FLOW]
    for f, k in kinds.items():
        if k is not Kind.FLOW_VALID or f in links:
            continue
        if f.endswith("_valid") and kinds.get(f[:-6]) is Kind.FLOW:
            links[f] = f[:-6]
        elif len(flows) == 1:
            links[f] = flows[0]
        else:
            raise ValueError(f"flow_valid field {f!r} belongs to no flow field (flow fields: {flows or 'none'})")
    for v, f in links.items():
        if kinds.get(v) is not Kind.FLOW_VALID or kinds.get(f) is not Kind.FLOW:
            raise ValueError(f"{v!r} -> {f!r} does not tie a flow_valid field to a flow field")
    return links


@dataclass
class Sample:
    key: str
    fields: dict[str, np.ndarray]
    kinds: dict[str, Kind]
    meta: dict[str, Any] = field(default_factory=dict)
    copy: int = 0
    links: dict[str, str] = field(default_factory=dict)   # flow_valid field -> its flow field

    def __post_init__(self) -> None:
        if not all(isinstance(k, Kind) for k in self.kinds.values()):
            self.kinds = {f: Kind.of(k) for f, k in self.kinds.items()}
        if Kind.FLOW_VALID in self.kinds.values() or self.links:
            self.links = link_validity(self.kinds, self.links)

    def specs(self) -> dict[str, FieldSpec]:
        """The actual spec of every field (kind, shape, dtype) of this sample."""
        links = self.links
        return {f: FieldSpec(self.kinds[f], a.shape, dtype_name(a.dtype), links.get(f))
                for f, a in self.fields.items()}

    def replace_fields(self, new: dict[str, np.ndarray], **kw: Any) -> "Sample":
        """A new sample with ``new`` arrays; every ``flow_valid`` field whose flow is in ``new`` is
        recomputed from it (a value a step gives for it is ignored: validity is derived)."""
        fields = dict(self.fields)
        fields.update(new)
        kinds = dict(kw.get("kinds", self.kinds))
        links = dict(kw.get("links", self.links))
        for v, f in links.items():
            if (f in new or v in new) and f in fields and v in fields:
                fields[v] = flow_validity(fields[f])
        return Sample(key=kw.get("key", self.key), fields=fields, kinds=kinds,
                      meta=dict(kw.get("meta", self.meta)), copy=kw.get("copy", self.copy), links=links)
