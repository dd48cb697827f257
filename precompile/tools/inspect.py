"""``precompile inspect``: describe a built output."""
from __future__ import annotations

import math
import os

from .. import format as fmt
from ..reader.dataset import open_dataset


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def describe(path: str) -> str:
    ds = open_dataset(path)
    a = ds.attrs
    lines = [f"{path}", f"  format       {a.get(fmt.A_OUTPUT)} (precompile format v{a.get(fmt.A_VERSION)})",
             f"  samples      {len(ds)} in {len(ds.shards)} shard(s)"]
    total = sum(s.get("bytes", 0) for s in ds.shards)
    lines.append(f"  bytes        {_human(total)} ({total} bytes in shards)")
    chunks = _chunking(ds)
    lines.append("  fields")
    for name, spec in ds.field_specs.items():
        shape = "(" + ", ".join(str(d) for d in spec["shape"]) + ")"
        ch = chunks.get(name)
        lines.append(f"    {name:<12} {spec['kind']:<7} {shape:<18} {spec['dtype']:<8}"
                     + (f" chunks of {ch[0]} sample(s), {_human(ch[1])}" if ch else ""))
    if ds.label_names:
        names = ", ".join(f"{i}={n}" for i, n in enumerate(ds.label_names))
        lines.append(f"  labels       {names}")
    lines.append(f"  copies       {a.get(fmt.A_COPIES)} augmented per sample (seed {a.get(fmt.A_SEED)})")
    lines.append(f"  recipe hash  {a.get(fmt.A_RECIPE_HASH)}")
    lines.append(f"  built by     precompile {a.get(fmt.A_PKG_VERSION)} on {a.get(fmt.A_BUILD_DATE)}")
    return "\n".join(lines)


def _chunking(ds) -> dict:
    import h5py

    out = {}
    if not ds.shards:
        return out
    p = os.path.join(os.path.dirname(ds.path), ds.shards[0]["file"])
    with h5py.File(p, "r") as f:
        for name in ds.field_specs:
            d = f[name]
            if d.chunks:
                out[name] = (d.chunks[0], int(d.dtype.itemsize * math.prod(d.chunks)))
    return out
