"""What the HDF5 index needs from each shard, without opening the shard: :class:`ShardParts`.

The index (``Hdf5Format.finalize``) gathers, per shard, its ``__key__`` / ``__copy__`` / ``__meta__``
rows, the chunk tables of its mappable fields (:func:`precompile.formats.hdf5_layout.shard_chunk_tables`) and
the local offsets and shapes of its variable-shape fields. They come from:

- the writer, as it closes a shard (in the worker): the parent never reopens a shard it built, and a
  build to a URL never has the shard's bytes in the parent at all;
- the index being replaced, for the shards a rebuild keeps (:func:`parts_from_index`);
- the JSON sidecar a URL build uploads beside each shard (:meth:`ShardParts.to_json`), for a shard a
  killed build uploaded but no index names yet;
- the shard file itself (:func:`read_parts`), the fallback for a local shard none of the above covers.

Each source gives the same values, so the index bytes do not depend on where they came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from . import names as fmt
from ..sample import FieldSpec


@dataclass
class ShardParts:
    """One shard's share of the index: its columns, chunk tables and ragged tables."""

    keys: list[str]
    copies: np.ndarray                                    # int32, one per sample
    metas: list[str]                                      # JSON text, one per sample
    chunks: dict[str, tuple[int, np.ndarray]]             # field -> (rows per chunk, (chunks, 2) uint64)
    ragged: dict[str, tuple[np.ndarray, np.ndarray]]      # field -> (offsets N+1 int64, shapes (N, ndim) int64)

    def to_json(self) -> dict[str, Any]:
        """A JSON value (no pickle) that :meth:`from_json` turns back into equal parts."""
        return {"keys": list(self.keys), "copies": [int(c) for c in self.copies], "metas": list(self.metas),
                "chunks": {f: [int(c), a.astype(np.uint64).tolist()] for f, (c, a) in sorted(self.chunks.items())},
                "ragged": {f: {"offsets": o.tolist(), "shapes": s.tolist(), "ndim": int(s.shape[1])}
                           for f, (o, s) in sorted(self.ragged.items())}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardParts":
        """Parts from :meth:`to_json`'s value; raises KeyError, TypeError or ValueError when it is not one."""
        n = len(d["keys"])
        copies = np.asarray(d["copies"], dtype=np.int32)
        if len(d["metas"]) != n or copies.shape != (n,):
            raise ValueError(f"{n} keys but {len(d['metas'])} metas and {copies.size} copies")
        chunks = {str(f): (int(c), np.asarray(rows, dtype=np.uint64).reshape(-1, 2)) for f, (c, rows)
                  in d["chunks"].items()}
        ragged = {str(f): (np.asarray(r["offsets"], dtype=np.int64),
                           np.asarray(r["shapes"], dtype=np.int64).reshape(-1, int(r["ndim"])))
                  for f, r in d["ragged"].items()}
        return cls([str(k) for k in d["keys"]], copies, [str(m) for m in d["metas"]], chunks, ragged)


def _texts(values: Iterable[Any]) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else v for v in values]


def read_parts(path: str, specs: dict[str, FieldSpec]) -> ShardParts:
    """The parts of the shard file at ``path`` (read with h5py)."""
    import h5py

    from .hdf5_layout import shard_chunk_tables

    with h5py.File(path, "r") as sf:
        ragged = {name: (sf[name][fmt.RAGGED_OFFSETS][:], sf[name][fmt.RAGGED_SHAPES][:])
                  for name, spec in specs.items() if not spec.fixed}
        return ShardParts(_texts(sf[fmt.KEY][:]), sf[fmt.COPY][:], _texts(sf[fmt.META][:]),
                          shard_chunk_tables(sf, [n for n, s in specs.items() if s.fixed]), ragged)


def parts_from_index(index_path: str, entries: list[dict[str, Any]], wanted: set[str]) -> dict[str, ShardParts]:
    """{file: parts} for the shard entries of the index at ``index_path`` whose ``file`` is in ``wanted``.

    ``entries`` is the index's shard list (its ``shards`` attribute, in order): sample rows, chunk-table
    rows and ragged offsets follow it. An index without chunk tables (written before they existed) gives
    nothing (the caller falls back to the shard's own parts). Every row taken is checked against the index's
    recorded crc32s (``index_crc32``): a damaged index raises ValueError (the caller then reads the shards'
    own parts), so a rebuild never copies damaged rows into the index it writes."""
    import h5py

    from ..errors import FormatError
    from .index_columns import check_dataset, dataset_values, recorded_crcs

    out: dict[str, ShardParts] = {}
    with h5py.File(index_path, "r") as f:
        if fmt.CHUNKS not in f or not wanted:
            return out
        try:
            crcs = recorded_crcs(f, index_path)
            raw = {name: dataset_values(f, name) for name in (fmt.KEY, fmt.META)}
            keys, copies, metas = _texts(raw[fmt.KEY]), f[fmt.COPY][:], _texts(raw[fmt.META])
            table = f[fmt.CHUNKS][:]
            ragged = {n: (g[fmt.RAGGED_OFFSETS][:], g[fmt.RAGGED_SHAPES][:]) for n, g in f.items()
                      if isinstance(g, h5py.Group) and g.attrs.get(fmt.A_LAYOUT) == fmt.LAYOUT_RAGGED}
            for name, values in [*raw.items(), (fmt.COPY, copies), (fmt.CHUNKS, table),
                                 *((f"{n}/{fmt.RAGGED_OFFSETS}", o) for n, (o, _) in ragged.items()),
                                 *((f"{n}/{fmt.RAGGED_SHAPES}", sh) for n, (_, sh) in ragged.items())]:
                check_dataset(index_path, crcs, name, values)
        except FormatError as e:
            raise ValueError(str(e)) from None
    row = chunk_row = 0
    for e in entries:
        n = int(e["num_samples"])
        chunks: dict[str, tuple[int, np.ndarray]] = {}
        for name, (c, k) in sorted((e.get(fmt.E_CHUNKS) or {}).items()):
            chunks[name] = (int(c), table[chunk_row:chunk_row + int(k)])
            chunk_row += int(k)
        if e["file"] in wanted:
            rg = {name: (o[row:row + n + 1] - o[row], s[row:row + n]) for name, (o, s) in ragged.items()}
            out[e["file"]] = ShardParts(keys[row:row + n], copies[row:row + n], metas[row:row + n],
                                        chunks if n else {}, rg)
        row += n
    return out
