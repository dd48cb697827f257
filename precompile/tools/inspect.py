"""``precompile inspect``: describe a built output of any format (hdf5, png, bmp, wav).

Fields with kind, shape (``?`` for dims that vary, with the range seen), dtype
and where they are stored (chunked dataset, ragged flat array, one file per
sample, companion ``.npy``, the JSON index); samples, shards, file counts,
bytes, labels and provenance.
"""
from __future__ import annotations

import math
import os

import numpy as np

from .. import format as fmt
from ..reader.dataset import Dataset, FileDataset, open_dataset


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _shape_text(shape: list) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _range_text(shapes: np.ndarray) -> str:
    """'(64..96, 80..128, 3)' from an (N, ndim) array of sample shapes."""
    if shapes.size == 0:
        return "no samples"
    lo, hi = shapes.min(axis=0), shapes.max(axis=0)
    return "(" + ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in zip(lo, hi)) + ")"


def describe(path: str) -> str:
    ds = open_dataset(path)
    a = ds.attrs
    lines = [f"{path}", f"  format       {ds.output_format} (precompile format v{a.get(fmt.A_VERSION)})",
             f"  samples      {len(ds)} in {len(ds.shards)} shard(s)"]
    total = sum(s.get("bytes", 0) for s in ds.shards)
    lines.append(f"  bytes        {_human(total)} ({total} bytes in shards)")
    if isinstance(ds, FileDataset):
        nfiles = sum(len(s["files"]) for s in ds.samples)
        nnpy = sum(1 for st in ds.storage.values() if st["store"] == fmt.STORE_NPY) * len(ds.shards)
        lines.append(f"  files        {nfiles} sample file(s)" + (f", {nnpy} .npy companion(s)" if nnpy else "")
                     + f", {len(ds.shards)} {fmt.SHARD_INFO}")
        where = _file_storage(ds)
    else:
        where = _hdf5_storage(ds)
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


def _file_storage(ds: FileDataset) -> dict[str, str]:
    out = {}
    for name, st in ds.storage.items():
        store = st["store"]
        if store == fmt.STORE_INDEX:
            out[name] = "in the JSON index"
            continue
        shapes = np.array([s["shapes"][name] for s in ds.samples], dtype=np.int64).reshape(len(ds.samples), -1)
        rng = f", shapes {_range_text(shapes)}" if ds.variable(name) else ""
        if store == fmt.STORE_FILE:
            out[name] = f"one {st['ext']} file per sample{rng}"
        else:
            out[name] = f"{fmt.npy_file_name(name)} per shard ({st.get('layout', 'stacked')}){rng}"
    return out


def _hdf5_storage(ds: Dataset) -> dict[str, str]:
    import h5py

    out = {}
    with h5py.File(ds.path, "r") as idx:
        shard0 = None
        if ds.shards:
            shard0 = h5py.File(os.path.join(os.path.dirname(ds.path), ds.shards[0]["file"]), "r")
        try:
            for name in ds.field_specs:
                if ds.variable(name):
                    shapes = idx[name][fmt.RAGGED_SHAPES][:]
                    text = f"ragged: flat data + offsets + shapes, shapes {_range_text(shapes)}"
                    if shard0 is not None and shard0[name][fmt.RAGGED_DATA].chunks:
                        d = shard0[name][fmt.RAGGED_DATA]
                        text += f", chunks of {_human(d.dtype.itemsize * d.chunks[0])}"
                    out[name] = text
                elif shard0 is not None and shard0[name].chunks:
                    d = shard0[name]
                    out[name] = f"chunks of {d.chunks[0]} sample(s), {_human(int(d.dtype.itemsize * math.prod(d.chunks)))}"
        finally:
            if shard0 is not None:
                shard0.close()
    return out
