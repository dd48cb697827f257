"""The sample type and field specs that flow between decoders, steps and writers.

A sample is a key (the relative source path: stable, used for seeding and in
messages) plus a dict of named arrays, each with a :class:`~precompile.kinds.Kind`
(see :mod:`precompile.kinds`)
and per-sample JSON metadata.

Some fields are tied to another (``Sample.links``, ``FieldSpec.of``; the rule is
:func:`link_fields`): a ``flow_valid`` field to its flow field, and it is *derived*:
:meth:`Sample.replace_fields` recomputes it whenever its flow changes, so no step
can leave it disagreeing with the flow's NaNs. A ``box_labels`` field and a
``keypoints`` field are tied to their ``boxes`` field: row i of each describes box i,
so a step that drops a box drops the same row of every field tied to it
(:func:`precompile.transforms.annotations.move_annotations`). A ``mask`` field may be tied to a
``boxes`` field too, but only when the tie is declared (``of``, ``links``, or :class:`Tied` as its
kind): it is then an *instance mask*, ``mask == i + 1`` the pixels of box i (0 background, the
dtype's largest value an ignored region), and a step that drops box i renumbers it so that this
stays true. A plain mask (a label map of classes) is never tied by a guess from its name.
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
    ``of`` names the field a tied field belongs to (a ``flow_valid``'s flow, a ``box_labels``' or
    ``keypoints``' boxes); ``classes`` is the number of classes a label map (``mask``, ``volume_mask``)
    may hold, when the recipe says, and ``class_ids`` their ids when they are not ``0 .. classes - 1``
    (a mask's ``classes: [0, 3, 7]``)."""

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


#: kinds tied to another field (``of``): kind -> (the kind it belongs to, the name suffix that ties it)
TIES: dict[Kind, tuple[Kind, str]] = {
    Kind.FLOW_VALID: (Kind.FLOW, "_valid"),
    Kind.BOX_LABELS: (Kind.BOXES, "_labels"),
    Kind.KEYPOINTS: (Kind.BOXES, "_keypoints"),
}
#: kinds that may stand alone (keypoints with no boxes field: a single pose, landmarks of one face)
_OPTIONAL_TIES = frozenset({Kind.KEYPOINTS})
#: ties that hold only where declared (never inferred): a mask tied to a boxes field is an instance mask
#: and a boxes field tied to an image field names the image it annotates (its grid, where planar fields differ
#: in size: a JPEG decoded at 1/k beside a mask at full size)
DECLARED_TIES: dict[Kind, Kind] = {Kind.MASK: Kind.BOXES, Kind.BOXES: Kind.IMAGE}
_DECLARED_WHAT = {Kind.MASK: "an instance mask", Kind.BOXES: "the image they annotate"}


class Tied(str):
    """A field's kind with the field it is tied to, for code that names kinds only (``kinds[f] = Tied("mask",
    "boxes")``): :class:`Sample` takes the tie into its ``links`` and keeps the plain kind. An instance mask
    made beside its boxes (``inputs.coco`` with ``mask: instance``) is declared this way."""

    of: str

    def __new__(cls, kind: Kind | str, of: str) -> "Tied":
        obj = super().__new__(cls, Kind.of(kind).value)
        obj.of = of
        return obj

    def __reduce__(self) -> Any:
        return (Tied, (str(self), self.of))


def link_fields(kinds: dict[str, Kind], links: dict[str, str] | None = None) -> dict[str, str]:
    """``{field: the field it belongs to}`` for every tied field of ``kinds`` (see :data:`TIES`):
    ``flow_valid`` -> its flow, ``box_labels`` -> its boxes, ``keypoints`` -> its boxes; and, only as
    ``links`` declares it (:data:`DECLARED_TIES`), an instance ``mask`` -> its boxes and ``boxes`` -> the image
    they annotate.

    A field not named in ``links`` is tied to ``<name>`` when it is called ``<name><suffix>``
    (``flow_valid``, ``boxes_labels``, ``boxes_keypoints``), or else to the only field of the kind
    it belongs to. A flow_valid or box_labels field with no such field is a ValueError (which
    would it follow?); a keypoints field with no boxes field stands alone."""
    links = dict(links or {})
    for f, k in kinds.items():
        if k not in TIES or f in links:
            continue
        owner, suffix = TIES[k]
        owners = [g for g, gk in kinds.items() if gk is owner]
        if f.endswith(suffix) and kinds.get(f[:-len(suffix)]) is owner:
            links[f] = f[:-len(suffix)]
        elif len(owners) == 1:
            links[f] = owners[0]
        elif owners or k not in _OPTIONAL_TIES:
            raise ValueError(f"{k.value} field {f!r} belongs to no {owner.value} field "
                             f"({owner.value} fields: {owners or 'none'}; name it <{owner.value} field>{suffix})")
    for v, f in links.items():
        k = kinds.get(v)
        owner = TIES[k][0] if k in TIES else DECLARED_TIES.get(k)
        if owner is None or kinds.get(f) is not owner:
            ties = [f"{a.value} -> {b.value}" for a, (b, _) in TIES.items()]
            ties += [f"{a.value} -> {b.value} ({_DECLARED_WHAT[a]}, declared)" for a, b in DECLARED_TIES.items()]
            raise ValueError(f"{v!r} -> {f!r} ties no field to the kind it belongs to ({', '.join(ties)})")
    return links


def tied_to(links: dict[str, str], owner: str) -> list[str]:
    """The fields tied to ``owner`` (a boxes field's labels, keypoints and instance masks)."""
    return [f for f, o in links.items() if o == owner]


@dataclass
class Sample:
    key: str
    fields: dict[str, np.ndarray]
    kinds: dict[str, Kind]
    meta: dict[str, Any] = field(default_factory=dict)
    copy: int = 0
    links: dict[str, str] = field(default_factory=dict)   # tied field -> its owner (see TIES)

    def __post_init__(self) -> None:
        if not all(isinstance(k, Kind) for k in self.kinds.values()):
            declared = {f: k.of for f, k in self.kinds.items() if isinstance(k, Tied)}
            if declared:
                self.links = {**declared, **self.links}
            self.kinds = {f: Kind.of(k) for f, k in self.kinds.items()}
        if self.links or any(k in TIES for k in self.kinds.values()):
            self.links = link_fields(self.kinds, self.links)

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
            if kinds.get(v) is Kind.FLOW_VALID and (f in new or v in new) and f in fields and v in fields:
                fields[v] = flow_validity(fields[f])
        return Sample(key=kw.get("key", self.key), fields=fields, kinds=kinds,
                      meta=dict(kw.get("meta", self.meta)), copy=kw.get("copy", self.copy), links=links)


# -- instance masks (mask == i + 1 is box i) ---------------------------------------------------
def ignore_id(dtype: np.dtype) -> int:
    """The id of an instance mask's ignored regions (COCO's ``crowd: ignore``): its dtype's largest value."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "ui":
        raise ValueError(f"an instance mask holds integer ids, not {dtype}")
    return int(np.iinfo(dtype).max)


def stray_ids(mask: np.ndarray, n: int) -> np.ndarray:
    """Where an instance mask (integer ids) beside ``n`` boxes holds an id that names no box: above ``n`` and not
    the ignore id, or negative."""
    top = ignore_id(mask.dtype)
    stray = (mask > n) & (mask != top) if n < top else np.zeros(mask.shape, bool)
    if mask.dtype.kind == "i":
        stray = stray | (mask < 0)
    return stray


def field_list(value: Any, what: str = "fields") -> list[str] | None:
    """The field names a reader argument gives (``fields``, ``convert_fields``): None stays None, one name (a
    str) is a list of it, a sequence of names a list; anything else is a ``ValueError`` naming ``what``. (A
    string was iterated character by character: ``fields="image"`` asked for a field ``'i'``.)"""
    from .errors import echo

    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{what} must be a list of field names, got {echo(value, 80)}")
    out = list(value)
    bad = [v for v in out if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{what}: field names are strings, got {echo(bad[0], 80)} in {echo(out, 120)}")
    return out


def exact_time(t: float) -> "Fraction":
    """A frame's timestamp (a pts times its stream's time base, stored in meta as a float) as the rational it is:
    4 * 1/12 is 1/3, not the decimal of its float (0.3333333333333333). Time clips place frames with it and the
    video decoder's seeks find frames with it, so both see one time per frame. Any time base with a denominator
    up to about 10**6 (1/90000, 1001/30000) is recovered exactly. A finer time base (mp4 timescale 2**31 - 1) is not:
    the nearest fraction with a denominator up to 10**9 may then be a simpler one far from the float (1/2 for
    2**30 / (2**31 - 1), 2.3e-10 away), which would put the frame on the wrong side of a clip slot; only a fraction
    that rounds to the float itself is taken, else the float's own value."""
    from fractions import Fraction

    x = float(t)
    r = Fraction(x).limit_denominator(10 ** 9)
    return r if float(r) == x else Fraction(x)
