"""``precompile inspect``: describe a built output of any format (hdf5, png, bmp, wav).

Fields with kind, shape (``?`` for dims that vary, with the range seen), dtype
and where they are stored (the format's ``describe``: chunked dataset, ragged
flat array, one file per sample, companion ``.npy``, the JSON index); samples,
shards, file counts, bytes, labels and provenance.
"""
from __future__ import annotations

from ..formats import find_format, open_dataset
from ..formats import names as fmt
from ..formats.base import human_bytes


def _shape_text(shape: list) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def describe(path: str) -> str:
    ds = open_dataset(path)
    form = find_format(path)
    assert form is not None   # open_dataset found it
    a = ds.attrs
    lines = [f"{path}", f"  format       {ds.output_format} (precompile format v{a.get(fmt.A_VERSION)})",
             f"  samples      {len(ds)} in {len(ds.shards)} shard(s)"]
    total = sum(s.get("bytes", 0) for s in ds.shards)
    lines.append(f"  bytes        {human_bytes(total)} ({total} bytes in shards)")
    extra, where = form.describe(ds)
    lines.extend(extra)
    lines.append("  fields")
    for name, spec in ds.field_specs.items():
        lines.append(f"    {name:<12} {spec['kind']:<7} {_shape_text(spec['shape']):<18} {spec['dtype']:<8} "
                     f"{where.get(name, '')}".rstrip())
    if ds.label_names:
        names = ", ".join(f"{i}={n}" for i, n in enumerate(ds.label_names))
        lines.append(f"  labels       {names}")
    lines.append(f"  copies       {a.get(fmt.A_COPIES)} augmented per sample (seed {a.get(fmt.A_SEED)})")
    lines.append(f"  recipe hash  {a.get(fmt.A_RECIPE_HASH)}")
    lines.append(f"  built by     precompile {a.get(fmt.A_PKG_VERSION)} on {a.get(fmt.A_BUILD_DATE)}")
    return "\n".join(lines)
