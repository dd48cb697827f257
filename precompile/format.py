"""On-disk names, attributes and the format version, shared by writers and readers.

An HDF5 build is an index file ``<out>/<name>.h5`` plus one file per shard
under ``<out>/<name>.shards/``. Every shard holds one dataset per field with
the samples along axis 0, chunked by whole samples, uncompressed, and the
columns ``__key__`` (sample key), ``__copy__`` (augmentation copy index) and
``__meta__`` (per-sample JSON). The index file holds a virtual dataset per
field and column over the shards (so plain h5py sees one array per field) and
the metadata as JSON text attributes. Nothing is pickled.
"""
from __future__ import annotations

import json
from typing import Any

FORMAT_NAME = "precompile"
FORMAT_VERSION = 1

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
A_SHARDS = "shards"                 # [{file, num_samples, key, checksums}]
A_SHARD_KEY = "shard_key"           # on a shard file: the key it was built for
A_CHECKSUMS = "checksums"           # on a shard file: {field: sha256 of its sample bytes}
A_SEED = "seed"
A_COPIES = "copies"

SHARD_DIR_SUFFIX = ".shards"
REPORT_SUFFIX = ".report.json"


def shard_dir_name(name: str) -> str:
    return name + SHARD_DIR_SUFFIX


def shard_file_name(index: int, ext: str = ".h5") -> str:
    return f"shard-{index:05d}{ext}"


def dumps(obj: Any) -> str:
    """Canonical JSON text for attributes and hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads(text: str | bytes) -> Any:
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text)
