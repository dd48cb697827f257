"""``precompile inspect``: describe a built output of any format (hdf5, png, bmp, wav).

Fields with kind, shape (``?`` for dims that vary, with the range seen), dtype
and where they are stored (the format's ``describe``: chunked dataset, ragged
flat array, one file per sample, companion ``.npy``, the JSON index); samples,
shards, file counts, bytes, labels and provenance.
"""
from __future__ import annotations

from ..formats import find_format, open_dataset
from ..formats import names as fmt
from ..storage.files import human_bytes


MIN_WIDTHS = (12, 7, 18, 8)   # name, kind, shape, dtype: the least width of each column


def _shape_text(shape: list) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def field_table(specs: dict[str, dict], where: dict[str, str]) -> list[str]:
    """One line per field: name, kind, shape, dtype and storage in columns as wide as their longest
    entry (a ``volume_mask`` or a long field name moves the later columns, never misaligns them)."""
    rows = [[name, str(spec["kind"]), _shape_text(spec["shape"]), str(spec["dtype"]), where.get(name, "")]
            for name, spec in specs.items()]
    if not rows:
        return []
    widths = [max(least, *(len(r[i]) for r in rows)) for i, least in enumerate(MIN_WIDTHS)]
    return [("    " + " ".join(c.ljust(w) for c, w in zip(r, widths)) + " " + r[4]).rstrip() for r in rows]


def describe(path: str) -> str:
    """The text of ``precompile inspect`` for the output at ``path`` (a URL too: read through the default cache,
    with the store's environment)."""
    ds = open_dataset(path)
    form = find_format(ds.path)   # (a URL's index: its copy in the cache)
    assert form is not None   # open_dataset found it
    a = ds.attrs
    lines = [f"{path}", f"  format       {ds.output_format} (precompile format v{a.get(fmt.A_VERSION)})",
             f"  samples      {len(ds)} in {len(ds.shards)} shard(s)"]
    total = sum(s.get("bytes", 0) for s in ds.shards)
    lines.append(f"  bytes        {human_bytes(total)} ({total} bytes in shards)")
    extra, where = form.describe(ds)
    lines.extend(extra)
    lines.append("  fields")
    lines.extend(field_table(ds.field_specs, where))
    if ds.label_names:
        names = ", ".join(f"{i}={n}" for i, n in enumerate(ds.label_names))
        lines.append(f"  labels       {names}")
    lines.append(f"  copies       {a.get(fmt.A_COPIES)} augmented per sample (seed {a.get(fmt.A_SEED)})")
    lines.append(f"  recipe hash  {a.get(fmt.A_RECIPE_HASH)}")
    lines.append(f"  built by     precompile {a.get(fmt.A_PKG_VERSION)} on {a.get(fmt.A_BUILD_DATE)}")
    return "\n".join(lines)
