"""``precompile.hf``: Hugging Face ``datasets`` both ways.

``to_hf(build)`` gives a built output as a ``datasets.Dataset``: one row per sample, a
column per field (typed: ``ClassLabel`` for a label with names, ``Value`` for scalars and
text, ``Image`` for image and mask fields a PNG holds exactly, a fixed-size ``List`` for other
arrays of a fixed shape, a ``List`` plus a shape column for other arrays of a variable shape,
nested ``List`` for ragged annotations) plus ``__key__`` (and ``__copy__`` in an augmented
build). An ``Image`` column stores each image once, as a lossless PNG; an array of two or more
dimensions (flow, clips, volumes, audio windows) is stored flat, its values in C order and
nothing else (the build's bytes; ``ArrayND`` and nested lists pay an int32 offset beside every
innermost list: :func:`flat_shape`), with its shape in ``info.description`` (:func:`shapes`);
where the shape varies (no resize fixed it: :func:`variable_flat`), each row's shape is in the
column ``<field>__shape`` (int32, one per dimension) and :func:`shapes` has None for the
dimensions that vary. :func:`array` gives a row's array back either way.
``with_format("numpy", dtype=None)`` gives the values in their own dtype (without
``dtype=None``, ``datasets`` makes integers int64 and floats float32). It is
written through ``Dataset.from_generator`` into ``cache_dir`` (Hugging Face's cache by
default), keyed by the build's shard keys, so a rebuilt output never comes back stale from
the cache.

``build_from_hf(dataset, recipe, out_dir)`` builds a recipe whose inputs are the rows of a
``datasets.Dataset``: the media columns (``Image``, ``Audio``, ``Video``, ``Nifti`` features) are written as the
files they hold, under ``<out_dir>/<name>.hf-input/<column>/`` (``column-<hash>/`` for a column whose name is
not a plain file name, such as ``../x`` or ``a/b``), and every other column
(``ClassLabel`` as its names) into ``table.parquet`` there; the recipe's ``inputs`` become
that table (``inputs.table``), its ``inputs.fields`` and ``inputs.columns`` naming the
dataset's columns as any table recipe does. A field named like a media column reads that
column's file; the sample key is the row number (``key:`` a column to choose another).
Files whose bytes did not change are not rewritten, so a rebuild is incremental as usual.
Nothing is written outside ``out_dir``.

Needs the ``hf`` extra (``pip install 'precompile[hf]'``: ``datasets``, ``pyarrow``).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import io
import json
import math
import numbers
import os
from typing import Any, Iterator, Optional, Sequence

from .errors import MissingDependencyError, PrecompileError, RecipeError, echo
from .kinds import ANNOTATIONS
from .sample import field_list

HF_EXTRA = "pip install 'precompile[hf]' (datasets)"
KEY, COPY = "__key__", "__copy__"
SHAPES = "precompile_shapes"
#: the description's key of the other array columns' shapes as the build declares them (None where they vary):
#: nested lists (boxes, keypoints) and ``Image`` columns, so that :func:`array` gives back a sample with no rows
#: as (0, 4) and a one-channel image as (H, W, 1), as ``ds[i]`` has them
ARRAYS = "precompile_arrays"
#: the suffix of a variable-shape field's shape column: ``flow`` -> ``flow__shape``
SHAPE_SUFFIX = "__shape"


def _datasets() -> Any:
    if importlib.util.find_spec("datasets") is None:
        raise MissingDependencyError(f"precompile.hf needs Hugging Face datasets: {HF_EXTRA}")
    import datasets

    return datasets


# --- a build as a datasets.Dataset -----------------------------------------------------------

def hf_feature(spec: dict[str, Any], label_names: Sequence[str] = ()) -> Any:
    """The ``datasets`` feature of one field (its spec as the index stores it)."""
    d = _datasets()
    kind, shape, dtype = spec.get("kind"), list(spec.get("shape") or []), str(spec.get("dtype"))
    if kind == "text":
        return d.Value("string")
    if png_image(spec):
        return d.Image()
    if kind == "label" and label_names and not shape:
        return d.ClassLabel(names=list(label_names))
    if not shape:
        return d.Value(dtype)
    flat = flat_shape(spec)
    if flat is not None or (len(shape) == 1 and shape[0]):
        # Arrow's fixed-size list: the values and nothing else (Arrow has none of length 0)
        return d.List(d.Value(dtype), length=math.prod(flat or shape))
    if variable_flat(spec):
        return d.List(d.Value(dtype))      # the values in C order; the shape in <field>__shape
    feat: Any = d.Value(dtype)
    for _ in shape:
        feat = d.List(feat)
    return feat


def flat_shape(spec: dict[str, Any]) -> Optional[tuple[int, ...]]:
    """The shape of a field ``to_hf`` stores flat (one fixed-size list of its values in C order, the shape in
    :func:`shapes`): an array of a fixed shape of two or more dimensions, none 0, that is not an ``Image``
    column. ``datasets``' ``Array2D`` .. ``Array5D`` are nested variable lists, an int32 offset beside every
    innermost list (1.5x a flow's bytes, 2.4x an RGB clip's, 5x a one-channel uint8 mask's); nested
    fixed-size lists hold the bytes alone but ``datasets`` reads them back element by element (40-400x
    ``Array3D``'s time); a flat one is both the build's bytes and read as one array (benchmarks/bench_hf_bytes.py)."""
    shape = list(spec.get("shape") or [])
    if spec.get("kind") == "text" or png_image(spec) or len(shape) < 2 or not all(shape):
        return None
    return tuple(int(n) for n in shape)


def variable_flat(spec: dict[str, Any]) -> bool:
    """Whether ``to_hf`` stores a field as one variable-length list of its values in C order plus a shape
    column ``<field>__shape`` (a fixed-size list of int32, one per dimension): an array of two or more
    dimensions, one of them variable (``None`` in the plan's shape: flow, clips, volumes built without a
    resize), that is neither an ``Image`` column, text, nor a ragged annotation (``boxes``, ``box_labels``,
    ``keypoints`` keep nested lists). Nested variable lists pay an int32 offset beside every innermost list
    (1.5x a flow's bytes, 2.4x an RGB clip's, 5x a flow_valid mask's); this is the build's bytes plus
    4 (offset) + 4 x rank (shape) bytes a row, as the build itself stores a ragged field (flat values,
    offsets, shapes)."""
    shape = list(spec.get("shape") or [])
    return (len(shape) >= 2 and None in shape and spec.get("kind") != "text"
            and str(spec.get("kind")) not in {k.value for k in ANNOTATIONS} and not png_image(spec))


def shape_feature(spec: dict[str, Any]) -> Any:
    """The feature of a :func:`variable_flat` field's shape column: a fixed-size list of int32, its rank long."""
    d = _datasets()
    return d.List(d.Value("int32"), length=len(spec.get("shape") or []))


def shapes(dataset: Any) -> dict[str, tuple[Optional[int], ...]]:
    """The shapes of ``dataset``'s columns that :func:`to_hf` stored flat, ``{column: shape}``: kept as JSON in
    ``dataset.info.description`` (``{"precompile_shapes": {...}}``: ``save_to_disk``, ``map``, ``select``,
    ``concatenate_datasets`` keep it; a Parquet export does not). A fixed shape's row is
    ``row[c].reshape(shape)``, a batch's ``batch[c].reshape(-1, *shape)``; a variable shape has None for the
    dimensions that vary, and each row's own shape is in the column ``c + "__shape"``:
    ``row[c].reshape(row[c + "__shape"])``. :func:`array` does either."""
    got = _described(dataset, SHAPES)
    return {c: tuple(None if n is None else int(n) for n in s) for c, s in got.items() if c in dataset.column_names}


def _described(dataset: Any, key: str) -> dict[str, Any]:
    """The dict :func:`to_hf` kept under ``key`` in ``dataset.info.description`` (JSON), or {}."""
    try:
        meta = json.loads(getattr(dataset.info, "description", "") or "{}")
    except ValueError:
        return {}
    got = meta.get(key) if isinstance(meta, dict) else None
    return got if isinstance(got, dict) else {}


def array(dataset: Any, row: dict[str, Any], field: str) -> Any:
    """Row ``row`` of ``dataset`` (a :func:`to_hf` dataset, any format: Python lists, ``numpy``...) as the
    build's array of ``field``: its values in the column's dtype, reshaped by the row's ``<field>__shape``
    (a variable shape) or by :func:`shapes` (a fixed one); a nested list (boxes, keypoints) as rows of the build's
    shape and dtype (a sample with no boxes: (0, 4)) and a one-channel ``Image`` column as (H, W, 1), from the
    shapes :func:`to_hf` keeps in the description (:data:`ARRAYS`); any other column's value as an array. The values
    are the build's bits with ``with_format("numpy", dtype=None)`` or the Python format; ``numpy`` without
    ``dtype=None`` has already made a float64 field float32."""
    import numpy as np

    d = _datasets()
    feat = dataset.features[field]
    inner = feat
    lists = tuple(t for t in (d.List, d.LargeList, getattr(d, "Sequence", None)) if isinstance(t, type))
    while isinstance(inner, lists):   # nested lists (boxes, keypoints): the innermost value's dtype
        inner = inner.feature
    dtype = inner.dtype if isinstance(inner, d.Value) and inner.dtype != "string" else None
    values = np.asarray(row[field], dtype=dtype)
    if field + SHAPE_SUFFIX in row:
        return values.reshape(tuple(int(n) for n in np.asarray(row[field + SHAPE_SUFFIX]).reshape(-1)))
    shape = shapes(dataset).get(field)
    if shape is not None and None in shape:
        raise ValueError(f"column {field!r} has a variable shape {shape} and the row has no {field + SHAPE_SUFFIX!r} "
                         f"column (its shape)")
    if shape is not None:
        return values.reshape(shape)
    declared = _declared(dataset).get(field)
    if declared is None:
        return values
    if isinstance(feat, d.Image):   # one channel comes back (H, W): the build's (H, W, 1)
        return values.reshape(*values.shape[:2], 1) if len(declared) == 3 and values.ndim == 2 else values
    if len(declared) >= 2 and all(n is not None for n in declared[1:]):   # rows of a fixed shape, (0, 4) too
        return values.reshape(-1, *declared[1:])
    return values


def _declared(dataset: Any) -> dict[str, tuple[Optional[int], ...]]:
    """The build's shapes of the array columns :func:`shapes` does not hold (:data:`ARRAYS`), ``{column: shape}``."""
    got = _described(dataset, ARRAYS)
    return {c: tuple(None if n is None else int(n) for n in s) for c, s in got.items()
            if c in dataset.column_names and isinstance(s, list)}


#: the PIL modes of the arrays a PNG holds exactly: (dtype, channels) -> mode (channels 0: an (H, W) array)
_PNG_MODES = {("uint8", 0): "L", ("uint8", 1): "L", ("uint8", 3): "RGB", ("uint8", 4): "RGBA",
              ("uint16", 0): "I;16", ("uint16", 1): "I;16"}


def png_image(spec: dict[str, Any]) -> bool:
    """Whether a field goes to an ``Image`` column: an image or mask of a layout a PNG holds exactly (8-bit
    gray, RGB, RGBA; 16-bit gray), any height and width. ``datasets`` gives it back as a PIL image, or with
    ``with_format("numpy")`` as its array in its own dtype; one channel comes back (H, W)."""
    shape = list(spec.get("shape") or [])
    if spec.get("kind") not in ("image", "mask") or len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] is None):
        return False
    return (str(spec.get("dtype")), int(shape[2]) if len(shape) == 3 else 0) in _PNG_MODES


def png_bytes(a: Any) -> bytes:
    """An (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) uint8 array, or a one-channel uint16 one, as lossless PNG
    bytes (zlib level 1: pixels that do not compress cost their own bytes plus about 0.1 %)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(a)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[..., 0]
    key = (str(a.dtype), 0 if a.ndim == 2 else int(a.shape[2]) if a.ndim == 3 else -1)
    if key not in _PNG_MODES:
        raise ValueError(f"a PNG holds 8-bit gray, RGB or RGBA, or 16-bit gray images, not {a.dtype} of shape {a.shape}")
    im = Image.fromarray(np.ascontiguousarray(a))
    if im.mode != _PNG_MODES[key]:   # Pillow infers the mode from the dtype and shape: never another one
        raise ValueError(f"Pillow made a {im.mode} image of a {a.dtype} array of shape {a.shape}, not {_PNG_MODES[key]}")
    buf = io.BytesIO()
    im.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


#: the stored bytes of rows :func:`to_hf` puts in one Arrow record batch by default (:func:`default_writer_batch_size`)
WRITER_BATCH_BYTES = 256 << 20
#: the rows of one record batch at most by default: ``datasets``' own default (``config.DEFAULT_MAX_BATCH_SIZE``)
MAX_WRITER_BATCH = 1000


def row_bytes(ds: Any, names: Sequence[str]) -> int:
    """An upper estimate of the stored bytes of one row of ``names`` in the build ``ds``: each field of a fixed
    shape its values' bytes (an ``Image`` column's PNG about its pixels'), and no less than the largest
    bytes a row of any shard (its file's bytes over its samples: the variable and ragged fields, whose rows
    the index does not size)."""
    import numpy as np

    fixed = 0
    for f in names:
        spec = ds.field_specs[f]
        shape = list(spec.get("shape") or [])
        if spec.get("kind") != "text" and all(isinstance(n, int) for n in shape):
            fixed += math.prod(shape) * np.dtype(str(spec.get("dtype"))).itemsize
    per_shard = [int(s.get("bytes") or 0) / int(s["num_samples"]) for s in ds.shards if s.get("num_samples")]
    return int(max([fixed, *per_shard]))


def default_writer_batch_size(ds: Any, names: Sequence[str]) -> int:
    """The rows of one Arrow record batch :func:`to_hf` writes by default: about :data:`WRITER_BATCH_BYTES` of
    :func:`row_bytes`, at least 1, at most :data:`MAX_WRITER_BATCH` (``datasets``' default). A record batch's
    variable lists and PNG bytes have int32 offsets (2^31 values at most); ``datasets``' own default is 1,000
    rows (100 with an ``Image`` column), which rows of a few MB (volumes, long clips, large flow) overflow,
    and holds the whole batch in memory while it is written."""
    return int(max(1, min(MAX_WRITER_BATCH, WRITER_BATCH_BYTES // max(1, row_bytes(ds, names)))))


#: the builds :func:`to_hf` is writing, ``{(location, fields, digest): opened build}``: :func:`_rows` reads the
#: very build whose shard keys gave the cache's digest (opening the path again read a build rebuilt since, and
#: cached its rows under the old build's digest)
_WRITING: dict[tuple[str, str, str], Any] = {}


def _digest_of(ds: Any) -> str:
    """The digest :func:`to_hf` caches an opened build's rows under: of its shard keys, in order."""
    return hashlib.sha256("\n".join(str(s.get("key")) for s in ds.shards).encode()).hexdigest()


def _rows(path: str, fields: str, copies: bool, build_digest: str, images: str = "[]",
          flat: str = "[]", variable: str = "[]", batch_rows: int = 0) -> Iterator[dict[str, Any]]:
    """The build's rows. Arguments are strings, not lists (``datasets`` would shard a list across
    generator calls); ``build_digest`` (of the shard keys) and ``batch_rows`` (the record batch's rows) are
    there so that ``datasets`` caches per build and per layout;
    ``images``: the fields written as PNG (an ``Image`` column's ``{"bytes", "path"}``); ``flat``: the
    fields written as their values in C order (:func:`flat_shape`); ``variable``: those written as their values
    in C order plus their shape (:func:`variable_flat`). The rows are read from the build :func:`to_hf` opened
    and took the digest of; where it is not at hand (another process), the path is opened again and a build
    of other shard keys (rebuilt since) is a :class:`~precompile.errors.PrecompileError`, never its rows
    under this digest."""
    import numpy as np

    from .formats import open_dataset

    ds = _WRITING.get((path, fields, build_digest))
    if ds is None:
        ds = open_dataset(path, fields=json.loads(fields))
        if _digest_of(ds) != build_digest:
            ds.close()
            raise PrecompileError(f"to_hf: {path} was rebuilt while its rows were being written (its shard keys "
                                  f"are no longer those to_hf read); call to_hf again")
    pngs, flats, varying = json.loads(images), json.loads(flat), json.loads(variable)
    for i in range(len(ds)):
        row = {KEY: ds.key(i), **ds[i]}
        for f in pngs:
            row[f] = {"bytes": png_bytes(row[f]), "path": None}
        for f in flats:
            row[f] = row[f].reshape(-1)     # a copy where the array is not C-contiguous
        for f in varying:
            a = row[f]
            row[f + SHAPE_SUFFIX] = np.asarray(a.shape, dtype=np.int32)
            row[f] = a.reshape(-1)
        if copies:
            row[COPY] = int(ds.copy(i))
        yield row


def _open_for_hf(build: Any, fields: Optional[Sequence[str]],
                 storage_options: Optional[dict[str, Any]]) -> tuple[str, Any, list[str], list[Any]]:
    """``(location, the build opened with the fields to write, those fields, what to close afterwards, last
    first)``: a local index path (made absolute), a URL (as ``precompile.open`` reads it, with
    ``storage_options``), or a build opened with ``precompile.open`` (its own cache and storage options)."""
    from .formats import open_dataset
    from .storage.remote import is_url

    opened: list[Any] = []
    if hasattr(build, "field_specs") and hasattr(build, "shards") and hasattr(build, "__len__"):
        if storage_options is not None:
            raise ValueError("to_hf: storage_options apply to a build given by its URL; this one is opened "
                             "already (precompile.open(url, storage_options=...) took them)")
        first = build
        location = str(getattr(first, "url", None) or os.path.abspath(str(first.path)))
    else:
        if not isinstance(build, (str, os.PathLike)):
            raise TypeError(f"to_hf: build must be an index path, a URL or a build opened with precompile.open, "
                            f"got {type(build).__name__} {echo(str(build), 100)}")
        url = is_url(build)
        location = str(build) if url else os.path.abspath(str(build))
        first = open_dataset(location, storage_options=storage_options)   # (local: a ValueError naming them)
        opened.append(first)
    try:
        names = field_list(fields) or list(first.fields)   # (one name, or a list of them)
        for f in names:
            if f not in first.field_specs:
                raise ValueError(f"{location}: no field {echo(f)} (fields: {', '.join(first.field_specs)})")
        if names == list(first.fields):
            return location, first, names, opened
        reopen = getattr(first, "reopen", None)   # a build read from a URL: the same snapshot, its cached shards
        ds = reopen(names) if reopen is not None else open_dataset(first.path, fields=names)
        opened.append(ds)
        if _digest_of(ds) != _digest_of(first):   # a local build opened again: rebuilt in between
            raise PrecompileError(f"to_hf: {location} was rebuilt while to_hf opened it (its shard keys changed); "
                                  f"call to_hf again")
        return location, ds, names, opened
    except BaseException:
        _close_all(opened)
        raise


def _close_all(opened: list[Any]) -> None:
    """Close the builds to_hf opened, the last opened first (a URL build's index copy released)."""
    for ds in reversed(opened):
        getattr(ds, "release", ds.close)()


def to_hf(build: Any, fields: Optional[Sequence[str]] = None, cache_dir: Optional[str] = None,
          writer_batch_size: Optional[int] = None, storage_options: Optional[dict[str, Any]] = None) -> Any:
    """The output at ``build`` as a ``datasets.Dataset``; see the module docstring. ``build``: its index file, the
    URL of an HDF5 build's index (read as ``precompile.open`` reads it, with ``storage_options``, through the
    default shard cache), or a build opened with ``precompile.open`` (any of its arguments: a URL build's
    ``cache_dir`` and ``cache_limit`` too). ``cache_dir``: Hugging Face's cache the rows are written to.
    ``writer_batch_size``: the rows of each Arrow record batch written (``datasets``' option of that name);
    None: :func:`default_writer_batch_size` of the build's rows (about 256 MB a record batch, at most
    1,000 rows). The rows written are those of the build whose shard keys name the cache entry: the build
    opened once, its digest and its rows from that one opening (a rebuild meanwhile is not read)."""
    d = _datasets()

    if writer_batch_size is not None and (isinstance(writer_batch_size, bool) or not isinstance(
            writer_batch_size, numbers.Integral) or writer_batch_size < 1):
        raise ValueError(f"to_hf: writer_batch_size must be a whole number of rows >= 1 (or None: from the rows' "
                         f"size), got {str(writer_batch_size)[:100]!r}")
    path, ds, names, opened = _open_for_hf(build, fields, storage_options)
    try:
        return _to_hf(d, path, ds, names, cache_dir, writer_batch_size)
    finally:
        _close_all(opened)


def _to_hf(d: Any, path: str, ds: Any, names: list[str], cache_dir: Optional[str],
           writer_batch_size: Optional[int]) -> Any:
    batch_rows = int(writer_batch_size) if writer_batch_size is not None else default_writer_batch_size(ds, names)
    # an augmented build's rows hold copies 1..K; a build of no rows (an empty split) says so in its recipe
    copies = (any(ds.copy(i) for i in range(len(ds))) if len(ds)
              else int((ds.recipe or {}).get("copies") or 0) > 0)
    images = [f for f in names if png_image(ds.field_specs[f])]
    feats = {KEY: d.Value("string"), **{f: hf_feature(ds.field_specs[f], ds.label_names) for f in names}}
    if copies:
        feats[COPY] = d.Value("int32")
    flat = {f: list(s) for f in names if (s := flat_shape(ds.field_specs[f])) is not None}
    variable = [f for f in names if variable_flat(ds.field_specs[f])]
    for f in variable:
        if f + SHAPE_SUFFIX in ds.field_specs or f + SHAPE_SUFFIX in feats:
            raise ValueError(f"{path}: field {f!r} has a variable shape and its shape column {f + SHAPE_SUFFIX!r} "
                             f"is the name of another column")
        flat[f] = list(ds.field_specs[f]["shape"])
    ordered: dict[str, Any] = {}
    for k, v in feats.items():       # each shape column right after its field's
        ordered[k] = v
        if k in variable:
            ordered[k + SHAPE_SUFFIX] = shape_feature(ds.field_specs[k])
    feats = ordered
    digest = _digest_of(ds)
    if not len(ds):   # (a split no sample fell into) from_generator refuses no rows: "corresponds to no data"
        out = d.Dataset.from_dict({c: [] for c in feats}, features=d.Features(feats))
    else:
        token = (path, json.dumps(names), digest)
        _WRITING[token] = ds   # _rows reads this very build (the one the digest is of)
        try:
            out = d.Dataset.from_generator(_rows, features=d.Features(feats), cache_dir=cache_dir,
                                           writer_batch_size=batch_rows,
                                           gen_kwargs={"path": path, "fields": token[1], "copies": copies,
                                                       "build_digest": digest, "images": json.dumps(images),
                                                       "flat": json.dumps([f for f in flat if f not in variable]),
                                                       "variable": json.dumps(variable), "batch_rows": batch_rows})
        finally:
            if _WRITING.get(token) is ds:
                del _WRITING[token]
    declared = {f: list(ds.field_specs[f]["shape"]) for f in names if f not in flat and len(ds.field_specs[f].get(
        "shape") or []) >= 2 and ds.field_specs[f].get("kind") != "text"}
    if flat or declared:
        out.info.description = json.dumps({**({SHAPES: flat} if flat else {}), **({ARRAYS: declared} if declared else {})})
    return out


# --- a datasets.Dataset as a build's inputs --------------------------------------------------

#: the ``datasets`` features whose cells are files: each staged as the file it holds
MEDIA_FEATURES = ("Image", "Audio", "Video", "Nifti")
_AUDIO_MAGIC = ((b"RIFF", ".wav"), (b"fLaC", ".flac"), (b"OggS", ".ogg"), (b"ID3", ".mp3"), (b"\xff\xfb", ".mp3"))


def _sniff(data: bytes, kind: str) -> str:
    """The file extension the bytes of a ``kind`` media cell ("image", "audio", "video", "nifti") call for."""
    if kind == "audio":
        return next((e for magic, e in _AUDIO_MAGIC if data.startswith(magic)), ".bin")
    if kind == "video":
        if data[4:8] == b"ftyp":
            return ".mp4"
        if data.startswith(b"RIFF") and data[8:12] == b"AVI ":
            return ".avi"
        return ".mkv" if data.startswith(b"\x1aE\xdf\xa3") else ".bin"   # (EBML: Matroska and WebM)
    if kind == "nifti":   # nibabel picks its reader by the suffix
        if data.startswith(b"\x1f\x8b"):
            return ".nii.gz"
        return ".nii" if data[344:348] in (b"n+1\x00", b"n+2\x00") else ".bin"
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return "." + (im.format or "bin").lower().replace("jpeg", "jpg")
    except Exception:  # not an image Pillow knows: the image decoder names the file when it fails
        return ".bin"


def _suffix(value: dict[str, Any], kind: str) -> str:
    """The file extension of a ``kind`` media cell: its path's (``.nii.gz`` whole), else sniffed from the bytes."""
    path = str(value.get("path") or "").lower()
    if kind == "nifti" and path.endswith(".nii.gz"):
        return ".nii.gz"
    ext = os.path.splitext(path)[1]
    if ext and len(ext) <= _MAX_SUFFIX and ext[1:].isascii() and ext[1:].isalnum():
        return ext   # (a suffix of other characters, or a long one, is the data's, not a name: sniffed instead)
    return _sniff(value.get("bytes") or b"", kind)


def _write_if_changed(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` unless it already holds exactly that (so its mtime, and the shard keys, stay)."""
    if os.path.isfile(path) and os.path.getsize(path) == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp-hf"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


#: a column name used as is for its staged media folder: a plain file name (:data:`NAME_RE`'s letters, at most 100);
#: any other (``../x``, ``a/b``, ``table.parquet``, 300 characters...) gets a folder named by its hash, so that no
#: column name places a file outside the staging folder or over the table
_MAX_SUFFIX = 16


def media_folder(column: str) -> str:
    """The staged media folder (one path component) of the column named ``column``."""
    from .formats.names import MAX_NAME_CHARS, NAME_RE

    if NAME_RE.match(column) and len(column) <= MAX_NAME_CHARS and column != "table.parquet" \
            and not column.endswith(".tmp-hf"):
        return column
    return "column-" + hashlib.sha256(column.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _media_bytes(value: Any, col: str, row: int) -> bytes:
    if value is None:
        raise RecipeError(f"hf dataset column {col!r}, row {row}: no file (the cell is None); drop the rows without "
                          f"one first (dataset.filter)")
    if not isinstance(value, dict):
        raise RecipeError(f"hf dataset column {col!r}, row {row}: expected an undecoded media cell, got "
                          f"{type(value).__name__}")
    data = value.get("bytes")
    if data is None and value.get("path") and os.path.isfile(value["path"]):
        with open(value["path"], "rb") as f:
            data = f.read()
    if data is None:
        raise RecipeError(f"hf dataset column {col!r}, row {row}: the cell holds no bytes and no readable file "
                          f"({value.get('path')!r})")
    return data


def stage_hf(dataset: Any, folder: str) -> tuple[str, list[str]]:
    """Write ``dataset`` under ``folder`` as media files plus ``table.parquet``; returns the table's path
    and the media columns (their cells in the table are the files' paths relative to ``folder``)."""
    d = _datasets()
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {getattr(d, n): n.lower() for n in MEDIA_FEATURES if hasattr(d, n)}   # (Video, Nifti: datasets >= 4)
    media = [c for c, f in dataset.features.items() if type(f) in kinds]
    labels = {c: f for c, f in dataset.features.items() if isinstance(f, d.ClassLabel)}
    undecoded = dataset
    for c in media:
        undecoded = undecoded.cast_column(c, type(dataset.features[c])(decode=False))
    cols: dict[str, list[Any]] = {KEY: [f"{i:08d}" for i in range(len(dataset))]}
    for c in dataset.column_names:
        if c in media:
            kind = kinds[type(dataset.features[c])]
            paths = []
            for i, v in enumerate(undecoded[c]):
                data = _media_bytes(v, c, i)
                rel = f"{media_folder(c)}/{i:08d}{_suffix(v, kind)}"
                _write_if_changed(os.path.join(folder, *rel.split("/")), data)
                paths.append(rel)
            cols[c] = paths
        elif c in labels:
            cols[c] = [labels[c].int2str(int(v)) if v is not None and v >= 0 else None for v in dataset[c]]
        else:
            cols[c] = list(dataset[c])
    for c, values in cols.items():   # one column at a time, so that a column no table can hold is named
        try:
            cols[c] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            feature = dataset.features.get(c)
            raise RecipeError(f"hf dataset column {c!r} ({str(feature)[:200]}): its values cannot go into the staged "
                              f"table ({str(e)[:300]}); only {', '.join(MEDIA_FEATURES)} columns are staged as files: "
                              f"drop the column (dataset.remove_columns) or cast it") from e
    buf = io.BytesIO()
    pq.write_table(pa.table(cols), buf)
    table = os.path.join(folder, "table.parquet")
    _write_if_changed(table, buf.getvalue())
    return table, media


def hf_recipe(recipe: dict[str, Any], folder: str, table: str, media: list[str]) -> dict[str, Any]:
    """``recipe`` with its inputs pointed at the staged table (see the module docstring)."""
    r = copy.deepcopy(recipe)
    inp = r.setdefault("inputs", {})
    for k in ("root", "table", "match", "where"):
        if k in inp:
            raise RecipeError(f"build_from_hf: inputs.{k} is set from the dataset; leave it out of the recipe")
    inp["root"], inp["table"] = folder, table
    fields = inp.setdefault("fields", {})
    for name, decl in fields.items():
        if isinstance(decl, dict) and "path" not in decl and name in media:
            decl["path"] = "{" + name + "}"
    if "path" not in inp and "key" not in inp:
        inp["path"] = "{" + media[0] + "}" if media else None
        inp["key"] = KEY
        if inp["path"] is None:
            del inp["path"]
    return r


def build_from_hf(dataset: Any, recipe: dict[str, Any], out_dir: str | os.PathLike = "build", **build_kwargs: Any) -> Any:
    """Build ``recipe`` over the rows of the ``datasets.Dataset`` ``dataset`` into ``out_dir``; returns the
    build report. ``build_kwargs`` go to :func:`precompile.build` (``n_jobs``, ``force``, ``stats``...)."""
    from .compiler import build
    from .formats import names as fmt
    from .formats.names import MAX_NAME_CHARS, NAME_RE

    name = (recipe.get("output") or {}).get("name") or recipe.get("name")
    if not isinstance(name, str) or not name:
        raise RecipeError("build_from_hf: the recipe needs a name")
    if not NAME_RE.match(name) or len(name) > MAX_NAME_CHARS:   # it names the staging folder, before the recipe is read
        raise RecipeError(f"build_from_hf: the recipe's name {name[:MAX_NAME_CHARS]!r} must be letters, digits, '_', "
                          f"'.', '-' (at most {MAX_NAME_CHARS}): it names files in the output folder")
    out = os.path.abspath(str(out_dir))
    folder = os.path.join(out, f"{name}.hf-input")
    if fmt.SHARD_DIR_SUFFIX and folder.endswith(fmt.SHARD_DIR_SUFFIX):
        raise RecipeError(f"build_from_hf: {folder!r} would clash with the shard folder")
    table, media = stage_hf(dataset, folder)
    return build(hf_recipe(recipe, folder, table, media), out_dir=out, **build_kwargs)
