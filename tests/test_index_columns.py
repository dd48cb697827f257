"""The index's columnar copies (``__shards__``, ``__key_utf8__``/``__key_offsets__``): opening a build reads
them with numpy instead of parsing every shard entry's JSON or HDF5's variable-length keys.

Checked against the JSON entries and the ``__key__`` column they copy (the sources of truth), against an
index without them (as built before them: the same dataset and the same Loader batches), and against a
table that no longer matches its entries (ignored, never read) or that is damaged.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib

import h5py
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Loader needs torch")

import precompile  # noqa: E402
from precompile.errors import FormatError  # noqa: E402
from precompile.formats import names as fmt  # noqa: E402
from precompile.formats.index_columns import ShardTable, index_crcs, read_key_column, write_key_column  # noqa: E402
from precompile.reader.direct import DirectReader  # noqa: E402
from precompile.reader.loader import Loader  # noqa: E402

from loader_cases import CHUNK, N, PER_SHARD, _assert_same_as_dataset, _build  # noqa: E402


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("columns")))


@pytest.fixture()
def copy_of(tmp_path, index):
    """A private copy of the module's build (tests that change its index)."""
    out = tmp_path / "out"
    shutil.copytree(os.path.dirname(index), out)
    return str(out / os.path.basename(index))


def _unseal(path: str) -> None:
    """The index without its own checksums (``index_crc32``), as written before them or by a tool that changed
    what they cover: the checks behind them are reached."""
    with h5py.File(path, "r+") as f:
        del f.attrs[fmt.A_INDEX_CRC]


def _drop_columns(path: str) -> None:
    """The index as written before the columnar copies existed."""
    with h5py.File(path, "r+") as f:
        for name in (fmt.SHARD_TABLE, fmt.KEY_UTF8, fmt.KEY_OFFSETS):
            del f[name]


def _batches(loader: Loader) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


def test_the_shard_table_is_the_entries_columns(index):
    with h5py.File(index, "r") as f:
        text = f.attrs[fmt.A_SHARDS]
        entries = json.loads(text)
        d = f[fmt.SHARD_TABLE]
        rows = d[()]
        assert json.loads(d.attrs[fmt.T_FIELDS]) == ["image", "label"]
        assert int(d.attrs[fmt.T_ENTRIES_CRC]) == zlib.crc32(text.encode())
        assert h5py.check_string_dtype(d.dtype["file"]).encoding == "utf-8"
    assert len(entries) == len(rows) == -(-N // PER_SHARD)
    assert rows["num_samples"].tolist() == [e["num_samples"] for e in entries]
    assert rows["bytes"].tolist() == [e["bytes"] for e in entries]
    assert [b.decode() for b in rows["file"]] == [e["file"] for e in entries]
    assert rows["rows_per_chunk"].tolist() == [[e["chunks"]["image"][0], e["chunks"]["label"][0]] for e in entries]
    assert rows["chunks"].tolist() == [[e["chunks"]["image"][1], e["chunks"]["label"][1]] for e in entries]
    assert rows["rows_per_chunk"][0, 0] == CHUNK


def test_open_and_loader_read_no_entry_json(index, monkeypatch):
    parsed: list[int] = []
    real = fmt.loads
    monkeypatch.setattr(fmt, "loads", lambda text: (parsed.append(len(text)), real(text))[1])
    ds = precompile.open(index)
    loader = Loader(ds, batch_size=16, shuffle=True, seed=1, device="cpu")
    assert ds.shard_table.source == "table" and ds._shards is None
    with h5py.File(index, "r") as f:
        big = len(f.attrs[fmt.A_SHARDS])
    assert big not in parsed and all(n < big for n in parsed)           # fields, labels: never the entries
    got = _batches(loader)                                             # a whole pass: still not parsed
    assert ds._shards is None and ds.shard_path(3) == os.path.join(os.path.dirname(index), ds.shard_table.file(3))
    for b, rows in zip(got, loader.batch_indices(0), strict=True):
        np.testing.assert_array_equal(b["image"], ds.batch(rows)["image"])
    with h5py.File(index, "r") as f:
        assert ds.shards == json.loads(f.attrs[fmt.A_SHARDS])          # asked for: parsed, the same entries
    loader.close()
    ds.close()


def test_an_index_without_the_columns_reads_the_same(index, copy_of):
    _drop_columns(copy_of)
    new, old = precompile.open(index), precompile.open(copy_of)
    assert new.shard_table.source == "table" and old.shard_table.source == "entries"
    assert old._key_column is None and new._keys is None                # old: __key__ read at open; new: lazily
    assert new.keys == old.keys and [new.key(i) for i in (0, 7, -1)] == [old.key(i) for i in (0, 7, -1)]
    with h5py.File(index, "r") as f:
        assert new.keys == [k.decode() for k in f[fmt.KEY][:]]
    np.testing.assert_array_equal(new.offsets, old.offsets)
    for in_memory in (False, True):
        a = _batches(Loader(new, batch_size=9, shuffle=True, seed=4, device="cpu", in_memory=in_memory))
        b = _batches(Loader(old, batch_size=9, shuffle=True, seed=4, device="cpu", in_memory=in_memory))
        assert len(a) == len(b) == -(-N // 9)
        for x, y in zip(a, b):
            for f in ("image", "label"):
                np.testing.assert_array_equal(x[f], y[f])
    new.close()
    old.close()


def test_a_table_not_written_from_the_entries_is_not_read(index, copy_of):
    with h5py.File(copy_of, "r+") as f:     # entries rewritten by another tool: the table is stale
        entries = json.loads(f.attrs[fmt.A_SHARDS])
        entries[0]["note"] = "edited"
        f.attrs[fmt.A_SHARDS] = json.dumps(entries)
        f[fmt.SHARD_TABLE][0, "num_samples"] = 1                       # would be wrong if it were read
    ds = precompile.open(copy_of)
    assert ds.shard_table.source == "entries" and len(ds) == N
    ref = precompile.open(index)
    _assert_same_as_dataset(Loader(ds, batch_size=13, shuffle=True, seed=2, device="cpu"), ref)
    ds.close()
    ref.close()


def test_a_damaged_table_falls_back_to_the_entries(copy_of, caplog):
    """A table that cannot be read as one: the index's own checksum refuses it (tests/test_index_checksum.py);
    in an index without that checksum (written before it, or by a tool that removed it) the entries are read."""
    with h5py.File(copy_of, "r+") as f:
        crc = f[fmt.SHARD_TABLE].attrs[fmt.T_ENTRIES_CRC]
        del f[fmt.SHARD_TABLE]
        d = f.create_dataset(fmt.SHARD_TABLE, data=np.arange(4))      # not a table of entries
        d.attrs[fmt.T_ENTRIES_CRC] = crc
        d.attrs[fmt.T_FIELDS] = "[]"
    with pytest.raises(FormatError, match=r"t\.h5: the index is damaged: the crc32 of its shard table \(__shards__\) "
                                          r"is not the one the build recorded"):
        precompile.open(copy_of)
    _unseal(copy_of)
    ds = precompile.open(copy_of)
    assert ds.shard_table.source == "entries" and len(ds) == N
    assert f"cannot read {fmt.SHARD_TABLE}" in caplog.text and "reading the shard entries instead" in caplog.text
    r = DirectReader(ds)
    np.testing.assert_array_equal(r.read([N - 1, 0])["image"], ds.batch([N - 1, 0])["image"])
    r.close()
    ds.close()


def test_a_table_that_disagrees_with_the_chunk_table_is_refused(copy_of):
    _unseal(copy_of)                                                   # (else its own checksum refuses it first)
    with h5py.File(copy_of, "r+") as f:                                # the crc still matches: the table is read
        rows = f[fmt.SHARD_TABLE][()]
        rows["chunks"][1, 0] += 3
        f[fmt.SHARD_TABLE][...] = rows
    ds = precompile.open(copy_of)
    assert ds.shard_table.source == "table"
    with pytest.raises(FormatError, match=r"t\.h5: the index's chunk table has 52 chunks, its shard entries count "
                                          r"55: the index is damaged"):
        DirectReader(ds)
    ds.close()
    with h5py.File(copy_of, "r+") as f:
        rows["chunks"][1, 0] -= 3
        rows["num_samples"][1] += 1
        f[fmt.SHARD_TABLE][...] = rows
    with pytest.raises(FormatError, match=r"t\.h5: the index's shard entries count 121 samples, its __copy__ column "
                                          r"120: the index is damaged"):
        precompile.open(copy_of)


def test_keys_are_the_opened_snapshots_after_the_index_is_replaced(tmp_path, copy_of):
    other = _build(str(tmp_path / "other"), name="t")
    with h5py.File(other, "r+") as f:                                 # another build: other keys
        keys = [k.decode() for k in f[fmt.KEY][:]]
        del f[fmt.KEY_UTF8], f[fmt.KEY_OFFSETS]
        write_key_column(f, [f"x{k}" for k in keys])
        f.attrs[fmt.A_INDEX_CRC] = fmt.dumps(index_crcs(f))            # as that build would record them
    ds = precompile.open(copy_of)
    with h5py.File(copy_of, "r") as f:
        want = [k.decode() for k in f[fmt.KEY][:]]
    os.replace(other, copy_of)                                         # a rebuild replaces the index
    assert ds.key(5) == want[5] and ds.keys == want
    new = precompile.open(copy_of)
    assert new.key(5) == f"x{keys[5]}"
    new.close()
    ds.close()


@pytest.mark.parametrize("keys", [[], ["a"], ["", "ab", "", "c"],
                                  ["żółw/ä.png", "plain", "日本/語", "tab\tand\nnl"]])
def test_the_key_column_round_trips(tmp_path, keys):
    with h5py.File(tmp_path / "k.h5", "w") as f:
        write_key_column(f, keys)
    with h5py.File(tmp_path / "k.h5", "r") as f:
        col = read_key_column(f, len(keys))
        assert col is not None and col.tolist() == keys and [col.key(i) for i in range(len(keys))] == keys
        assert read_key_column(f, len(keys) + 1) is None                   # not this many samples' keys


def test_shard_table_from_entries_lists_fields_in_name_order():
    entries = [{"file": "s/a.h5", "num_samples": 3, "bytes": 10, "chunks": {"z": [2, 2], "a": [3, 1]}},
               {"file": "s/b.h5", "num_samples": 0},
               {"file": "s/ç.h5", "num_samples": 1, "chunks": {"a": [1, 1]}}]
    t = ShardTable.from_entries(entries)
    assert t.fields == ("a", "z") and t.total_chunks() == 4 and t.has_chunks()
    assert t.bytes.tolist() == [10, -1, -1] and t.file(2) == "s/ç.h5"
    c, k, start = t.spans("z")
    assert c.tolist() == [2, 0, 0] and k.tolist() == [2, 0, 0] and start.tolist() == [1, 3, 4]
    c, k, start = t.spans("a")
    assert c.tolist() == [3, 0, 1] and k.tolist() == [1, 0, 1] and start.tolist() == [0, 3, 3]
    assert t.spans("missing")[0].tolist() == [0, 0, 0]


def test_verify_names_a_columnar_copy_that_disagrees(copy_of):
    from precompile.formats.hdf5_verify import verify_hdf5

    assert verify_hdf5(copy_of, checksums=False).index_problems == []
    with h5py.File(copy_of, "r+") as f:
        k7 = bytes(f[fmt.KEY_UTF8][f[fmt.KEY_OFFSETS][7]:f[fmt.KEY_OFFSETS][8]]).decode()
        f[fmt.KEY_UTF8][f[fmt.KEY_OFFSETS][7]] ^= 1                       # one bit of sample 7's key
        rows = f[fmt.SHARD_TABLE][()]
        rows["bytes"][2] += 1                                            # the table is current: it would be read
        f[fmt.SHARD_TABLE][...] = rows
    flipped = chr(ord(k7[0]) ^ 1) + k7[1:]
    with pytest.raises(FormatError, match="the index is damaged"):    # a reader served the flipped key before
        precompile.open(copy_of)
    res = verify_hdf5(copy_of, checksums=False)
    assert res.bad_shards == [] and res.index_problems == [
        "__shards__ column 'bytes' differs from the shard entries (first at entry 2)",
        f"its two copies of the keys differ at sample 7: {flipped!r} in __key_utf8__, {k7!r} in __key__",
        "the crc32 of its sample keys (__key_utf8__) is not the one the build recorded",
        "the crc32 of its shard table (__shards__) is not the one the build recorded"]
