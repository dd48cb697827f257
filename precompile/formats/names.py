"""On-disk names, attributes and the format version, shared by every format's writer and reader
(was ``precompile/format.py``); also the one check of an index's header, :func:`check_header`.

An HDF5 build is an index file ``<out>/<name>.h5`` plus one file per shard
under ``<out>/<name>.shards/``, named by its index and content key
(``shard-00003-<first 16 hex digits of the shard key>.h5``, :func:`shard_file_name`): a rebuilt shard
gets a new name, so no build ever overwrites a file an index points to (snapshot rebuilds: see
``docs/faults.md``, "On-disk layout and snapshots"). ``<name>.shards/previous.json`` lists the files of the
snapshot the last build replaced (kept until the next build starts, for readers still open on it). Every shard holds one dataset per field with
the samples along axis 0, chunked by whole samples, uncompressed, and the
columns ``__key__`` (sample key), ``__copy__`` (augmentation copy index) and
``__meta__`` (per-sample JSON). The index file holds a virtual dataset per
field and column over the shards (so plain h5py sees one array per field),
``__chunks__`` (every shard's chunk byte ranges, for readers that map the shard
files), ``__shards__`` (the shard entries' sample counts, sizes, file names and
chunk spans as one compound dataset, so that opening a build reads them with
numpy instead of parsing the ``shards`` JSON; valid only while its
``entries_crc32`` matches that JSON), ``__key_utf8__`` and ``__key_offsets__``
(the keys as one byte buffer, read whole without HDF5's per-string cost; see
``formats/index_columns.py``), the metadata as JSON text attributes, and
``index_crc32``: the crc32 of every attribute but ``shards`` and of every
dataset a reader takes from the index, checked before any of it is served.
Nothing is pickled.

Variable-shape fields (a spec with ``None`` dims, e.g. images kept at their
native size) are a group ``<field>`` (attribute ``layout = "ragged"``) holding
``data`` (1-D, flat, chunked, uncompressed), ``offsets`` (N+1 int64: sample i
is ``data[offsets[i]:offsets[i+1]]``) and ``shapes`` (N x ndim int64): the same
in every shard (local offsets) and in the index file (``data`` a virtual
dataset over the shards, ``offsets`` global). Fixed-shape fields keep a
dataset ``<field>`` of shape (N, *shape).

A file-folder build (bmp, png, wav) is a JSON index ``<out>/<name>.json`` plus
one folder per shard, ``<name>.shards/shard-00003-<key16>/``, holding one file per
sample and field (``000123.png``, or ``000123.<field>.png`` when a sample has
several file fields), ``<field>.npy`` for fields the format cannot hold
(``np.save``, no pickle; (N, *shape), or flat 1-D for variable shapes) and
``info.json`` (shard key, counts, checksums, per-sample entries). The index
holds ``attrs`` (the same attributes as an HDF5 index, as JSON values),
``storage`` ({field: {store: file|npy|index, ...}}) and ``samples``: one entry
per sample with ``shard``, ``key``, ``copy``, ``meta``, ``files``, ``shapes``
and ``values`` (label ids and other scalars kept in the index).
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from ..errors import FormatError

#: a name that names a file or a dataset (a field, an output, a split, a recipe): letters, digits, '_', '.', '-'
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


#: the longest name of a recipe, an output or a split: each names files (``NAME.SPLIT.h5.tmp-PID``, ``NAME.shards``),
#: and a file name is at most 255 bytes
MAX_NAME_CHARS = 100


def check_name_length(name: str, what: str = "") -> str:
    """``name`` if it is at most :data:`MAX_NAME_CHARS` long; else a ValueError saying so (``what``: e.g.
    ``"split name 'x...' "``), before any file is made with it."""
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{what}is {len(name)} characters long; at most {MAX_NAME_CHARS} (it names the output's files)")
    return name


def check_field_name(name: str) -> str:
    """``name`` if it can name a field's dataset (letters, digits, '_', '.', '-'; not starting with '__', which the
    key and meta columns use); else a ValueError saying so."""
    if not NAME_RE.match(name) or name.startswith("__"):
        raise ValueError(f"field name {name!r} must be letters, digits, '_', '.', '-' and not start with '__'")
    return name


def entry_problem(entry: object) -> str | None:
    """Why ``entry`` (a shard's or a sample file's path as an index lists it, relative to the index's folder, as
    every build writes it) cannot be one: not text, empty, absolute, a '..' or '.' part, a backslash or a NUL;
    None when it is fine. An index is data: a crafted one must not make the reader open files elsewhere."""
    if not isinstance(entry, str) or not entry:
        return "is not a relative path"
    if "\0" in entry or "\\" in entry or entry.startswith("/") or ":" in entry.split("/")[0]:
        return "is not a relative path inside the index's folder"
    if any(part in ("", ".", "..") for part in entry.split("/")):
        return "has an empty, '.' or '..' part: it would leave the index's folder"
    return None


def check_entry(index: str, entry: object, what: str) -> str:
    """``entry`` if :func:`entry_problem` finds nothing, else a FormatError naming the index and the entry."""
    why = entry_problem(entry)
    if why is not None:
        raise FormatError(f"{index}: {what} {str(entry)[:200]!r} {why}; the index is damaged or was not written by "
                          f"precompile")
    return entry  # type: ignore[return-value]


FORMAT_NAME = "precompile"
#: 2: shards named by content key (snapshot rebuilds); an index of another version is refused by the
#: reader ("build it again") and rebuilt whole by the build (the version is part of every shard key)
FORMAT_VERSION = 2

KEY = "__key__"
COPY = "__copy__"
META = "__meta__"
COLUMNS = (KEY, COPY, META)

# attributes of the index file (all JSON text or plain scalars)
A_FORMAT = "precompile_format"
A_VERSION = "format_version"
A_OUTPUT = "output_format"          # hdf5 | bmp | png | wav
A_FIELDS = "fields"                 # {name: {kind, shape, dtype, meta}}
A_LABELS = "label_names"            # [class names] in id order, or []
A_RECIPE = "recipe"                 # the resolved recipe
A_RECIPE_HASH = "recipe_hash"
A_PKG_VERSION = "precompile_version"
A_BUILD_DATE = "build_date"
A_NUM = "num_samples"
A_SHARDS = "shards"                 # [{file, num_samples, key, checksums, bytes, sha256}] (see SHARD_ENTRY)
E_CHUNKS = "chunks"                 # in a shard entry: {field: [rows per chunk, chunks]} (see SHARD_ENTRY)
CHUNKS = "__chunks__"               # index dataset: (chunks, 2) uint64 byte address, size (entry order)
SHARD_TABLE = "__shards__"          # index dataset: the entries' columns readers need (formats/index_columns.py)
T_FIELDS = "fields"                 # on __shards__: JSON list of the fields of its chunk columns
T_ENTRIES_CRC = "entries_crc32"     # on __shards__: crc32 of the `shards` text it was written from
KEY_UTF8 = "__key_utf8__"           # index dataset: every key's UTF-8 bytes, concatenated (index_columns.py)
KEY_OFFSETS = "__key_offsets__"     # index dataset: (N+1,) int64, key i is __key_utf8__[o[i]:o[i+1]]
A_MAPS = "source_maps"              # index attribute: 1 = each image field's meta holds its map back to the
#                                     source (to_source, source_size) unless that map is the identity over the
#                                     stored image's own size: then it is left out (transforms/source_map.py);
#                                     2 = and each keypoints field's meta its source_order where a mirror with
#                                     flip_pairs swapped its slots
MAPS_VERSION = 2                    # what a build writes as A_MAPS
A_INDEX_CRC = "index_crc32"         # index attribute: JSON {"attrs": {name: crc32}, "datasets": {name: crc32}}
                                    # of what readers take from the index (formats/index_columns.py)
A_SHARD_KEY = "shard_key"           # on a shard file: the key it was built for
A_CHECKSUMS = "checksums"           # on a shard file: {field: sha256 of its sample bytes}
A_SEED = "seed"
A_COPIES = "copies"

# variable-shape ("ragged") HDF5 fields
A_LAYOUT = "layout"                 # on a ragged field's group
LAYOUT_RAGGED = "ragged"
RAGGED_DATA = "data"
RAGGED_OFFSETS = "offsets"
RAGGED_SHAPES = "shapes"

# file-folder builds (bmp, png, wav)
INDEX_JSON_EXT = ".json"
SHARD_INFO = "info.json"            # inside each shard folder
J_ATTRS = "attrs"
J_STORAGE = "storage"               # {field: {"store": "file"|"npy"|"index", "ext": ..., "layout": ...}}
J_SAMPLES = "samples"
STORE_FILE = "file"
STORE_NPY = "npy"
STORE_INDEX = "index"

SHARD_DIR_SUFFIX = ".shards"
PREVIOUS_SNAPSHOT = "previous.json"  # in a shard folder: {"files": [...]} of the snapshot the last build replaced
LOCK_FILE = ".lock"                  # in a shard folder: the build lock
COCO_PLAN_CACHE = "coco-plan.h5"     # in a shard folder: the parsed inputs.coco file (inputs/coco/cache.py)
SKIPPED_SIDECAR = ".skipped.json"    # <shard>.skipped.json: the inputs skipped while building it (when any)
#: <shard>.entry.json (builds written to a URL): the shard's index entry and its parts
#: (formats/hdf5_parts.py), uploaded after the shard, so a resumed build needs neither the shard's bytes
#: nor an index that names it
ENTRY_SIDECAR = ".entry.json"
SIDECARS = (SKIPPED_SIDECAR, ENTRY_SIDECAR)
KEY_CHARS = 16                       # hex digits of the shard key in a shard's file name

#: the keys of one entry of the index's shard list. ``checksums``: {field: sha256 of its samples' bytes};
#: ``bytes``: the shard's size on disk; ``sha256``: of the whole shard file (a folder shard: of its
#: manifest, :func:`precompile.formats.base.shard_digest`); ``chunks`` (HDF5): {field: [rows per chunk,
#: chunks]}, the chunks' byte ranges being the next rows of the index's ``__chunks__`` dataset, so that a
#: reader needs only the index. Readers ignore keys they do not know (see docs/faults.md, "On-disk layout
#: and snapshots").
SHARD_ENTRY = ("file", "num_samples", "key", "checksums", "bytes", "sha256", "chunks")
REPORT_SUFFIX = ".report.json"


def shard_dir_name(name: str) -> str:
    return name + SHARD_DIR_SUFFIX


def shard_file_name(index: int, ext: str = ".h5", key: str | None = None) -> str:
    """``shard-00003-<key16>.h5`` (``shard-00003.h5`` without a key: benchmarks' hand-made shards)."""
    return f"shard-{index:05d}{'-' + key[:KEY_CHARS] if key else ''}{ext}"


def sample_file_name(index: int, ext: str, field: str | None = None) -> str:
    """``000123.png``, or ``000123.<field>.png`` when a sample has several file fields."""
    return f"{index:06d}{'.' + field if field else ''}{ext}"


def npy_file_name(field: str) -> str:
    return f"{field}.npy"


def dumps(obj: Any) -> str:
    """Canonical JSON text for attributes and hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads(text: str | bytes) -> Any:
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text)


def check_header(path: str, attrs: Mapping[str, Any]) -> None:
    """Raise :class:`FormatError` unless an index's attributes name precompile and this format version."""
    name = attrs.get(A_FORMAT, "")
    if (name.decode() if isinstance(name, bytes) else str(name)) != FORMAT_NAME:
        raise FormatError(f"{path}: not a precompile output (no {A_FORMAT!r} attribute)")
    version = int(attrs.get(A_VERSION, -1))
    if version != FORMAT_VERSION:
        raise FormatError(f"{path}: format version {version}, this precompile reads {FORMAT_VERSION}: "
                          f"build the recipe again (the build rewrites every shard)")
