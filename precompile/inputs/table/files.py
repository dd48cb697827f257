"""Which files a table is, and one of them read: ``inputs.table`` as a path (relative to the recipe's folder), a
URL (streamed from the store through its fsspec filesystem, with ``inputs.storage_options``), a glob of either,
or a list of such (:func:`table_files`); each file read whole by its extension's reader (:func:`read_table`:
CSV and TSV cells as text, :mod:`.read` making pyarrow's reading the standard library's). pyarrow (the
``tables`` extra) is imported here, and only when a recipe has a table.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Optional

from ...errors import MissingDependencyError, RecipeError, clip
from ...storage.remote import file_fingerprint, filesystem, glob_urls, is_url, store_error
from .read import read_delimited, read_jsonl

#: extension -> reader name
TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl",
                 ".parquet": "parquet", ".pq": "parquet"}


def table_format(path: str) -> str:
    """The reader for ``path`` by its extension (``.gz``/``.bz2`` allowed after it for CSV/TSV/JSON Lines)."""
    low = path.lower()
    for comp in (".gz", ".bz2"):
        if low.endswith(comp):
            low = low[:-len(comp)]
            if low.endswith((".parquet", ".pq")):
                break
    ext = os.path.splitext(low)[1]
    if ext not in TABLE_FORMATS:
        raise ValueError(f"unknown table extension {ext or '(none)'!r}: use "
                         + ", ".join(sorted(TABLE_FORMATS)) + " (.gz or .bz2 after csv/tsv/jsonl)")
    return TABLE_FORMATS[ext]


def load_pyarrow(parquet: bool = False) -> Any:
    """pyarrow with its CSV and JSON readers, and with ``parquet`` its Parquet reader (15 ms more to import,
    only for a Parquet table)."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.csv  # noqa: F401
        import pyarrow.json  # noqa: F401
        if parquet:
            import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError("table inputs (inputs.table) need pyarrow: pip install 'precompile[tables]'") from e
    return pyarrow


def read_table(path: str, source: Optional[str] = None, select: Optional[Any] = None,
               storage_options: Optional[dict[str, Any]] = None, quoting: Optional[str] = None,
               texts: Optional[set[str]] = None, exact: Optional[set[str]] = None) -> Any:
    """The table file (a local path or a URL, streamed from the store) as a pyarrow Table (CSV and TSV
    cells as text), read as Python's csv and json modules read it (:mod:`.read`); a RecipeError
    naming the file (and the row) when it cannot be read, a PlanError naming the URL when the store
    refuses it (missing, access denied, no credentials). ``select(column names) -> the names to read``
    (it may raise): only those columns are kept. ``quoting`` (``inputs.quoting``): ``csv`` or ``none``
    for a CSV or TSV file (default: ``csv`` for .csv, ``none`` for .tsv/.tab: TSV has no quoting).
    ``texts``: the columns read as text (a JSON Lines number column among them holds the numbers'
    texts as ``str`` of ``json.loads``' values: ``1``, not pyarrow's ``1.0``). ``exact``: the columns
    ``inputs.where`` compares with numbers (a JSON Lines column of them read as floats that cannot hold one of its
    integers is refused: :func:`.read.read_jsonl`)."""
    pa = load_pyarrow()
    kind = table_format(path)
    if kind == "parquet":
        load_pyarrow(parquet=True)
    remote = is_url(path)
    if remote:   # the store's own answer (pyarrow's fsspec handler calls every refusal "not found")
        file_fingerprint(path, storage_options, f"table {path!r}")
    elif not os.path.isfile(path):
        raise RecipeError(f"table file {path!r} does not exist", source=source, loc="inputs.table")
    fs, name = _arrow_filesystem(path, storage_options)
    pick = select or (lambda names: names)
    try:
        if kind in ("csv", "tsv"):
            with fs.open_input_stream(name, compression="detect") as f:
                data = f.read()
            quote = (quoting or ("csv" if kind == "csv" else "none")) == "csv"
            return read_delimited(pa, data, path, "\t" if kind == "tsv" else ",", quote, pick, source)
        if kind == "jsonl":
            with fs.open_input_stream(name, compression="detect") as f:
                data = f.read()
            return read_jsonl(pa, data, path, pick, source, texts or set(), exact or set())
        with fs.open_input_file(name) as f:
            pq = pa.parquet.ParquetFile(f)
            return pq.read(columns=pick(list(pq.schema_arrow.names)))
    except (pa.ArrowException, OSError, ValueError) as e:
        if remote and _store_fault(pa, e):
            raise store_error(f"table {path!r}", path, e, "read") from None
        raise RecipeError(f"table file {path!r} cannot be read as {kind}: {clip(str(e))}", source=source,
                          loc="inputs.table") from None
    except RecipeError:
        raise
    except Exception as e:  # a store's own errors (botocore's NoCredentialsError, ...) are not OSErrors
        if remote:
            raise store_error(f"table {path!r}", path, e, "read") from None
        raise


def _store_fault(pa: Any, e: BaseException) -> bool:
    """Whether reading a remote table failed in the store (a missing object, access denied, the network),
    not in its bytes."""
    return isinstance(e, (FileNotFoundError, PermissionError)) or (isinstance(e, OSError)
                                                                   and not isinstance(e, pa.ArrowException))


def _arrow_filesystem(path: str, storage_options: Optional[dict[str, Any]]) -> tuple[Any, str]:
    """A pyarrow filesystem that opens ``path`` and the name to open it by: the local one, or the URL's fsspec
    filesystem (:func:`precompile.storage.remote.filesystem`) seen through pyarrow, so a remote table is streamed."""
    import pyarrow.fs as pafs

    if not is_url(path):
        return pafs.LocalFileSystem(), path
    fs = filesystem(path, storage_options)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), fs._strip_protocol(path)


#: a table entry with one of these is a glob pattern
GLOB_CHARS = re.compile(r"[*?[]")


def table_files(recipe: Any) -> list[str]:
    """Every file ``inputs.table`` names, sorted, each once: a path relative to the recipe's folder (or
    absolute), a URL (read with ``inputs.storage_options``), or a glob of either (``meta/part-*.parquet``);
    a list of such entries. A glob that matches nothing is an error naming it."""
    t = recipe.model.inputs.table
    found: set[str] = set()
    for entry in [t] if isinstance(t, str) else t:
        pattern = GLOB_CHARS.search(entry) is not None
        if is_url(entry):
            found.update(glob_urls(entry, recipe.model.inputs.storage_options, f"table {entry!r}") if pattern
                         else [entry])
            continue
        local = os.path.expanduser(entry)   # ~/data/t.csv: the user's home, as coco.file and inputs.root
        path = local if os.path.isabs(local) else os.path.normpath(os.path.join(recipe.base_dir, local))
        if not pattern:
            found.add(path)
            continue
        matches = [m for m in glob.glob(path) if os.path.isfile(m)]
        if not matches:
            raise RecipeError(f"table {entry!r} matches no file (under {recipe.base_dir})", source=recipe.source,
                              loc="inputs.table")
        found.update(matches)
    return sorted(found)
