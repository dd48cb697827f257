"""The map-style dataset every format's reader shares: ``len(ds)``, ``ds[i]``, ``ds.batch(indices)``.

``precompile.open(index)`` asks the format that claims the index file
(:func:`precompile.formats.find_format`) to open it: an HDF5 build gives an
:class:`~precompile.formats.hdf5.H5Dataset`, a file-folder build (bmp, png,
wav; JSON index) a :class:`~precompile.formats.folder.FileDataset`. Every one
offers ``len``, ``ds[i]`` (a dict of arrays, each sample in its own shape),
``ds.batch(indices, pad=False)``, ``key(i)``, ``meta(i)``, ``copy(i)``,
``field_specs`` (shape dims that vary are ``None``), ``label_names``, ``coco``, ``attrs``
(JSON text for non-scalar values, as HDF5 attributes are), ``shards`` and
``recipe``, and ``to_source(i, boxes=..., keypoints=...)``: coordinates on a
stored image in its source image's pixels, through the map the build recorded
(``source_map(i)``; :mod:`precompile.transforms.source_map`).

A ``text`` field is stored as its UTF-8 bytes (a variable-shape uint8 field:
the ragged layout in HDF5, plain-h5py readable as bytes); ``ds[i]`` gives it
as ``str`` and ``batch`` as a list of ``str``.

``batch`` stacks fields; when a variable-shape field's samples differ it
raises :class:`ShapeMismatchError` naming the field and two shapes, unless
``pad`` is given (``True`` pads with 0, a number pads with that value): each
field is then padded at the end of every dimension to the batch's largest
size, and the returned :class:`Batch` says what it padded (``batch.padded``)
and every sample's own shape (``batch.shapes``). ``pad=True`` pads the rows of
an annotation field as the Loader does (:func:`precompile.kinds.pad_value`:
-1 for ``box_labels``, whose 0 is a class; NaN for boxes and keypoints).

This module owns :class:`Dataset` (metadata, indexing, stacking), :class:`Batch`
and :func:`stack_field`; it knows the on-disk names (``formats.names``), never
the recipe classes. Datasets open files lazily in each process (never before a
fork): they pickle without handles, so they work inside a torch DataLoader
with workers.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence

import numpy as np

from . import names as fmt
from ..errors import ShapeMismatchError, SourceMapError, clip, echo
from ..kinds import ANNOTATIONS, pad_value
from ..optschema import flag
from ..transforms.kernels import maps
from ..transforms.kernels.geometry import reflects, swap_pairs

__all__ = ["Batch", "Dataset", "ShapeMismatchError", "rows_of", "stack_field"]


class Batch(dict):
    """A dict of stacked arrays, plus ``padded`` ({field: {"to": shape, "value": v, "samples": [positions]}})
    and ``shapes`` ({field: (B, ndim) int array of each sample's own shape}) for variable-shape fields."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.padded: dict[str, dict[str, Any]] = {}
        self.shapes: dict[str, np.ndarray] = {}


_ANNOTATION_KINDS = frozenset(k.value for k in ANNOTATIONS)


def _pad_value(pad: Any) -> Any:
    if pad is None or pad is False:
        return None
    if pad is True:
        return 0
    if isinstance(pad, (int, float, np.integer, np.floating)):
        return pad
    raise TypeError(f"pad must be True, False or a number, got {echo(pad)}")


def _holds(dtype: np.dtype, value: Any) -> bool:
    """Whether ``dtype`` holds the pad ``value`` exactly (numpy's fill casts unsafely: NaN in an int64 field became
    -2^63, 0.5 became 0)."""
    if dtype.kind not in "iub":
        return True
    v = float(value)
    if not np.isfinite(v) or not v.is_integer():
        return False
    if dtype.kind == "b":
        return v in (0.0, 1.0)
    info = np.iinfo(dtype)
    return info.min <= int(value) <= info.max


def text_of(a: np.ndarray) -> str:
    """A stored ``text`` field (its UTF-8 bytes, uint8) as ``str``."""
    return np.ascontiguousarray(a, dtype=np.uint8).tobytes().decode("utf-8")


def stack_field(name: str, arrays: list[np.ndarray], spec: dict, pad: Any, out: Batch) -> None:
    """Stack one field's per-sample arrays into ``out[name]``: refuse or pad unequal shapes; a ``text``
    field becomes a list of ``str``."""
    if spec.get("kind") == "text":
        out[name] = [text_of(a) for a in arrays]
        return
    dtype = np.dtype(spec["dtype"])
    if not arrays:
        out[name] = np.empty((0, *[d or 0 for d in spec["shape"]]), dtype=dtype)
        return
    shapes = [a.shape for a in arrays]
    variable = any(d is None for d in spec["shape"])
    if variable:
        out.shapes[name] = np.asarray(shapes, dtype=np.int64).reshape(len(arrays), len(spec["shape"]))
    first = shapes[0]
    diff = next((i for i, s in enumerate(shapes) if s != first), None)
    if diff is None:
        out[name] = np.stack(arrays)
        return
    value = _pad_value(pad)
    if pad is True and spec.get("kind") in _ANNOTATION_KINDS:   # the Loader's rule: a padded row is never a real one
        value = pad_value(dtype)
    if value is not None and not _holds(dtype, value):
        raise ValueError(f"pad value {str(value)[:40]} cannot be stored in field {name!r} ({dtype}); pass pad=True "
                         f"(each field's own padding) or a value every padded field holds exactly")
    if value is None:
        raise ShapeMismatchError(
            f"field {name!r}: cannot stack samples of different shapes {first} (batch position 0) and "
            f"{shapes[diff]} (batch position {diff}); pass pad=True (or a pad value) to pad them, "
            f"read them one by one, or resize to a fixed size in the recipe")
    if any(len(s) != len(first) for s in shapes):
        raise ShapeMismatchError(f"field {name!r}: samples differ in rank ({first} and {shapes[diff]}); cannot pad")
    to = tuple(int(max(s[k] for s in shapes)) for k in range(len(first)))
    res = np.full((len(arrays), *to), value, dtype=dtype)
    for i, a in enumerate(arrays):
        res[(i, *[slice(0, n) for n in a.shape])] = a
    out[name] = res
    out.padded[name] = {"to": to, "value": value, "samples": [i for i, s in enumerate(shapes) if s != to]}


def rows_of(indices: Iterable[int] | slice, n: int) -> np.ndarray:
    """``indices`` as rows of ``n``, numpy's rules for one axis: integers (numpy ones too), negative from the end;
    a slice as a list takes it; a boolean mask of ``n`` values picks the rows where it is True (cast to integers,
    ``[True, False, True]`` quietly gave rows 1, 0, 1). A float, or an index of two or more dimensions, is a
    TypeError; a row out of range an IndexError naming it."""
    if isinstance(indices, slice):
        return np.arange(*indices.indices(n), dtype=np.int64)
    given = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices))
    if given.ndim > 1:
        raise TypeError(f"sample indices must be one list of rows, got an index of shape {given.shape}")
    if given.dtype.kind == "b":
        if given.size != n:
            raise IndexError(f"boolean index of {given.size} values for {n} samples (a mask has one value per "
                             f"sample)")
        return np.flatnonzero(given).astype(np.int64)
    if given.size and given.dtype.kind not in "iu":   # (1.5 became row 1)
        raise TypeError(f"sample indices must be integers, got {given.dtype} values such as "
                        f"{echo(str(given.flat[0]))}")
    idx = given.astype(np.int64).reshape(-1)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise IndexError(f"sample index {int(idx[np.argmax(bad)])} out of range for {n} samples")
    return np.where(idx < 0, idx + n, idx)


def _host(a: Any) -> Any:
    """A tensor (torch, on any device) as a host numpy array; anything else as it is."""
    if hasattr(a, "detach") and hasattr(a, "cpu"):
        return a.detach().cpu().numpy()
    return a


class Dataset:
    """What every format's dataset shares: metadata, ``len``, keys, stacking in ``batch``, and the way back to
    each sample's source image (:meth:`to_source`)."""

    path: str
    attrs: dict[str, Any]
    field_specs: dict[str, dict]
    label_names: list[str]
    fields: list[str]
    keys: list[str]
    copies: np.ndarray
    _shards: list[dict] | None = None

    def _setup(self, fields: Sequence[str] | None, counts: np.ndarray | None = None) -> None:
        """Fields, labels and every shard's first sample; ``counts`` (samples per shard, entry order) when the
        format read them without the entries (else they come from :attr:`shards`)."""
        self.field_specs = fmt.loads(self.attrs[fmt.A_FIELDS])
        self.label_names = fmt.loads(self.attrs[fmt.A_LABELS])
        self.fields = list(fields) if fields is not None else list(self.field_specs)
        for f in self.fields:
            if f not in self.field_specs:
                raise KeyError(f"no field {echo(f)} in {self.path} (fields: {', '.join(self.field_specs)})")
        if counts is None:
            counts = np.array([s["num_samples"] for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._n = int(self.offsets[-1])
        self._pid = None

    @property
    def shards(self) -> list[dict]:
        """The index's shard entries (``names.SHARD_ENTRY``), parsed from its ``shards`` JSON on first use."""
        if self._shards is None:
            self._shards = fmt.loads(self.attrs[fmt.A_SHARDS])
        return self._shards

    def variable(self, field: str) -> bool:
        """True when ``field``'s samples may differ in shape; a field the build has not is a ``KeyError`` naming it
        (cut to a bounded length) and the build's fields."""
        spec = self.field_specs.get(field) if isinstance(field, str) else None
        if spec is None:
            raise KeyError(f"no field {echo(field)} in {self.path} (fields: {', '.join(self.field_specs)})")
        return any(d is None for d in spec["shape"])

    @property
    def output_format(self) -> str:
        return str(self.attrs.get(fmt.A_OUTPUT, "hdf5"))

    def __len__(self) -> int:
        return self._n

    def _index(self, i: int) -> int:
        """``i`` as a row: an integer (a numpy one too), negative from the end, as a list takes it. A float or a
        string is a TypeError (``int()`` took 1.5 as row 1 and said "invalid literal" for a key), and so is a
        boolean, Python's, numpy's or a tensor's (``True`` and ``torch.tensor(True)`` read row 1 where
        ``np.True_`` was refused): a boolean is no row."""
        if isinstance(i, (bool, np.bool_)) or str(getattr(i, "dtype", "")) in ("bool", "torch.bool"):
            raise TypeError(f"sample index must be an integer, got a boolean ({type(i).__name__} "
                            f"{clip(str(i), 80)}); a boolean mask of one value per sample goes to ds.batch(mask)")
        try:
            j = operator.index(i)   # an int, a numpy integer, a one-element integer tensor
        except TypeError:
            raise TypeError(f"sample index must be an integer, got {type(i).__name__} {echo(str(i), 80)}") from None
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError(f"sample index {operator.index(i)} out of range for {self._n} samples")
        return j

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, position in the shard) of sample ``i``."""
        i = self._index(i)
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return s, i - int(self.offsets[s])

    def _indices(self, indices: Iterable[int] | slice) -> np.ndarray:
        """``indices`` as rows: :func:`rows_of`."""
        return rows_of(indices, self._n)

    def key(self, i: int) -> str:
        return self.keys[self._index(i)]

    def copy(self, i: int) -> int:
        return int(self.copies[self._index(i)])

    @property
    def recipe(self) -> dict:
        return fmt.loads(self.attrs[fmt.A_RECIPE])

    @property
    def coco(self) -> dict | None:
        """A build from ``inputs.coco``: ``categories`` ({id, name, supercategory} in box-label order: the
        COCO id of label i is ``categories[i]["id"]``), ``keypoints`` (names), ``skeleton`` (COCO's 1-based
        pairs), ``crowd``, ``mask`` and ``mask_ignore``; None for any other build (see docs/coco.md)."""
        text = self.attrs.get("coco")
        return None if text is None else fmt.loads(text)

    # -- back to the source ----------------------------------------------------------------------
    def _map_field(self, field: str | None) -> str:
        """The image field whose map ``to_source`` uses: ``field``, else the image the boxes are tied to, else
        the one image field."""
        images = [f for f, s in self.field_specs.items() if s.get("kind") == "image"]
        if field is not None:
            if field not in images:
                raise SourceMapError(f"{self.path}: no image field {echo(field)} (image fields: "
                                     f"{', '.join(images) or 'none'})")
            return field
        tied = {s.get("of") for s in self.field_specs.values() if s.get("kind") == "boxes"} & set(images)
        if len(tied) == 1:
            return tied.pop()
        if len(images) == 1:
            return images[0]
        if not images:
            have = ", ".join(f"{f} ({s.get('kind')})" for f, s in self.field_specs.items()) or "none"
            raise SourceMapError(f"{self.path}: no 2D image field (fields: {have}); to_source maps coordinates "
                                 f"on an image back to its source file")
        raise SourceMapError(f"{self.path}: image fields {', '.join(images)}: say which one the coordinates are "
                             f"on with field=")

    def source_map(self, i: int, field: str | None = None) -> tuple[np.ndarray, tuple[int, int]]:
        """Sample ``i``'s map back to its source: the (2, 3) float64 map from the stored image's pixel
        coordinates (continuous: pixel (r, c) covers [c, c + 1) x [r, r + 1)) to the source file's stored
        pixels, composed of the decode's scale and EXIF turn and every 2D step the build applied to this copy
        (random ones as drawn), and the source's (height, width). ``field``: the image field (default: the one
        the boxes are tied to, or the only one). A :class:`~precompile.errors.SourceMapError` when there is no
        such map (it says why: no image, a build from before maps were recorded, a step not known to be
        affine)."""
        f = self._map_field(field)
        i = self._index(i)
        m = self.meta(i).get(f)
        where = f"{self.path}: sample {i} (key {echo(self.key(i))}), field {f!r}"
        if isinstance(m, dict) and "unmapped" in m:
            raise SourceMapError(f"{where}: no map back to the source: {m['unmapped']}")
        if (not isinstance(m, dict) or "to_source" not in m) and self.attrs.get(fmt.A_MAPS) is not None:
            h, w = (int(v) for v in self._sample(i, [f])[f].shape[:2])   # left out: the identity over its size
            return np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), (h, w)
        if not isinstance(m, dict) or "to_source" not in m or "source_size" not in m:
            raise SourceMapError(f"{where}: the build recorded no map back to the source (built before precompile "
                                 f"recorded one); rebuild it to record the map")
        H, W = (int(v) for v in m["source_size"])
        return maps.as_map(m["to_source"], f"{where}: to_source"), (H, W)

    def to_source(self, i: int, boxes: Any = None, keypoints: Any = None, *, field: str | None = None,
                  device_map: Any = None, clip: bool = True, flip_pairs: Any = None) -> Any:
        """Coordinates on sample ``i``'s stored image (predictions, or the stored annotations) in its source
        image's pixels: ``boxes`` (N, 4) x1 y1 x2 y2 -> (N, 4), the box enclosing the 4 corners' images (exact
        for the flips, scales, crops, pads and quarter turns builds apply; after a ``random_affine`` rotation,
        the rotated box's enclosing box), clipped to the source image unless ``clip=False``; ``keypoints``
        (N, K, 2) x y or (N, K, 3) x y visibility -> the same shape, moved exactly (visibility kept), each point
        in its source slot where a mirror with ``flip_pairs`` swapped the slots (the keypoints field's
        ``source_order`` meta: the left eye back in the left eye's row). float64;
        NaN rows (a batch's padding) stay NaN. Returns the one array asked for, or ``(boxes, keypoints)``.

        ``device_map``: the (2, 3) map of the Loader's device steps for this sample
        (:meth:`precompile.Loader.batch_maps`), when the coordinates are on a device-augmented batch.
        ``flip_pairs``: with keypoints and a ``device_map`` that mirrors, the Loader's ``random_flip``
        ``flip_pairs`` (the pairs its mirror swapped; ``[]`` when none do): the map alone cannot say which slots
        the device swapped, so a mirroring ``device_map`` with keypoints and no ``flip_pairs`` is a
        :class:`~precompile.errors.SourceMapError`. ``field`` and the other errors: :meth:`source_map`. Tensors
        are taken too (copied to the host)."""
        clip = flag(clip, "clip")
        if boxes is None and keypoints is None:
            raise ValueError("to_source: give boxes=, keypoints= or both")
        T, (H, W) = self.source_map(i, field)
        swapped = None
        if device_map is not None:
            D = maps.as_map(_host(device_map), "device_map")
            T = maps.compose(T, D)
            if keypoints is not None and bool(reflects(D)):
                if flip_pairs is None:
                    raise SourceMapError(f"{self.path}: sample {i}: the device_map mirrors the image: pass the "
                                         f"Loader's flip_pairs (flip_pairs=[[left, right], ...] as its random_flip "
                                         f"has them, or flip_pairs=[] if none swap) so that each keypoint goes back "
                                         f"to its own slot")
                swapped = [list(p) for p in flip_pairs]
        out = []
        if boxes is not None:
            b = maps.boxes_through(_host(boxes), T)
            if clip:
                b = np.clip(b, 0.0, np.array([W, H, W, H], np.float64))
            out.append(b)
        if keypoints is not None:
            k = np.asarray(_host(keypoints), dtype=np.float64)
            if k.ndim != 3 or k.shape[2] not in (2, 3):
                raise ValueError(f"keypoints must be (N, K, 2) x, y or (N, K, 3) x, y, visibility, got shape "
                                 f"{k.shape}")
            back = maps.points_through(k, T)
            if swapped:   # the device's mirror swapped these slots: swapped back (a swap is its own inverse)
                back = swap_pairs(back, swapped)
            order = self._source_order(i, self._map_field(field), k.shape[1])
            if order is not None:   # a mirror with flip_pairs swapped the slots: each point back to its own
                back[:, order] = back.copy()
            out.append(back)
        return out[0] if len(out) == 1 else tuple(out)

    def _source_order(self, i: int, f: str, k: int) -> list[int] | None:
        """Sample ``i``'s keypoint slots as the source holds them (``meta[field]["source_order"]``: per stored
        slot, the source's slot; a mirror with ``flip_pairs`` swapped them) for keypoints of ``k`` points on
        image field ``f``, or None when every slot holds its own."""
        specs = self.field_specs
        fields = [g for g, s in specs.items() if s.get("kind") == "keypoints" and len(s.get("shape") or ()) == 3
                  and s["shape"][1] == k and specs.get(s.get("of"), {}).get("of", f) == f]
        if not fields:
            return None
        if (self.attrs.get(fmt.A_MAPS) or 0) < 2 and any(
                isinstance(st, dict) and isinstance(st.get("random_flip"), dict) and st["random_flip"].get("flip_pairs")
                for st in (self.recipe or {}).get("steps") or ()):
            raise SourceMapError(f"{self.path}: built before precompile recorded which keypoint slots a random_flip "
                                 f"with flip_pairs swapped (index attribute {fmt.A_MAPS} "
                                 f"{self.attrs.get(fmt.A_MAPS)!r}); rebuild it to map keypoints back")
        meta = self.meta(self._index(i))
        orders = set()
        for g in fields:
            m = meta.get(g)
            o = m.get(maps.SOURCE_ORDER) if isinstance(m, dict) else None
            orders.add(None if o is None else tuple(int(v) for v in o))
        if len(orders) > 1:
            raise SourceMapError(f"{self.path}: sample {i}: keypoints fields {', '.join(fields)} of {k} points had "
                                 f"their slots swapped differently (flip_pairs); to_source cannot tell which one "
                                 f"the keypoints are")
        order = orders.pop()
        return None if order is None else list(order)

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_pid"] = None
        self._drop_handles(d)
        return d

    def _drop_handles(self, state: dict) -> None:
        pass

    def _batch_by_sample(self, idx: np.ndarray, names: list[str], pad: Any, out: Batch) -> None:
        per = [self._sample(int(i), names) for i in idx]
        for name in names:
            stack_field(name, [p[name] for p in per], self.field_specs[name], pad, out)

    def _sample(self, i: int, names: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __getitem__(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = self._sample(self._index(i), self.fields)
        for name in self.fields:
            if self.field_specs[name].get("kind") == "text":
                out[name] = text_of(out[name])   # stored as UTF-8 bytes (a ragged uint8 field)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {self._n} samples, format {self.output_format}, fields={self.fields})"


