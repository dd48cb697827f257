"""The index's chunk tables (issue 20): a Loader learns where every row lives from the index alone.

Checked against h5py's own chunk query on the shard files (an independent reader of the same bytes),
against an index without tables (the h5py resolver, as before the tables existed) and against the
map-style dataset; the shards a Loader opens are counted; damaged or mismatched tables are refused.
"""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Loader needs torch")

import precompile  # noqa: E402
from precompile.errors import FormatError  # noqa: E402
from precompile.formats import names as fmt  # noqa: E402
from precompile.reader import direct, rows  # noqa: E402
from precompile.reader.direct import DirectReader  # noqa: E402
from precompile.reader.loader import Loader  # noqa: E402

from loader_cases import CHUNK, N, PER_SHARD, _assert_same_as_dataset, _build, _drop_chunk_tables  # noqa: E402


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("tables")))


@pytest.fixture()
def copy_of(tmp_path, index):
    """A private copy of the module's build (tests that damage it). Its ``index_crc32`` is removed: these tests
    change the chunk tables as another tool would (docs/faults.md: such a tool removes it), to reach the checks
    behind it (tests/test_index_checksum.py: the index's own checksums refuse such a table first)."""
    out = tmp_path / "out"
    shutil.copytree(os.path.dirname(index), out)
    with h5py.File(out / os.path.basename(index), "r+") as f:
        del f.attrs[fmt.A_INDEX_CRC]
    return str(out / os.path.basename(index))


def _entries(path: str) -> list[dict]:
    with h5py.File(path, "r") as f:
        return fmt.loads(f.attrs[fmt.A_SHARDS])


def _set_entries(path: str, entries: list[dict]) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs[fmt.A_SHARDS] = fmt.dumps(entries)


def test_index_tables_are_the_shards_chunk_addresses(index):
    base = os.path.dirname(index)
    with h5py.File(index, "r") as f:
        table = f[fmt.CHUNKS][:]
    assert table.dtype == np.uint64 and table.ndim == 2 and table.shape[1] == 2
    pos = 0
    entries = _entries(index)
    assert len(entries) == -(-N // PER_SHARD)
    for e in entries:
        assert list(e[fmt.E_CHUNKS]) == ["image", "label"]                # fields in name order
        with h5py.File(os.path.join(base, e["file"]), "r") as sf:
            for name, (rows, count) in e[fmt.E_CHUNKS].items():
                d = sf[name]
                assert rows == d.chunks[0] and count == d.id.get_num_chunks() == -(-e["num_samples"] // rows)
                info = [d.id.get_chunk_info(i) for i in range(count)]
                want = [(ci.byte_offset, ci.size) for ci in sorted(info, key=lambda ci: ci.chunk_offset[0])]
                got = table[pos:pos + count]
                assert [(int(a), int(b)) for a, b in got] == want
                pos += count
                # the bytes at the recorded address are the rows h5py reads
                raw = np.fromfile(os.path.join(base, e["file"]), np.uint8, count=int(got[0, 1]),
                                  offset=int(got[0, 0]))
                np.testing.assert_array_equal(raw.view(d.dtype).reshape(-1, *d.shape[1:])[:rows], d[:rows])
    assert pos == len(table)
    assert entries[0][fmt.E_CHUNKS]["image"][0] == CHUNK


def test_batches_with_and_without_tables_are_identical(index, copy_of):
    _drop_chunk_tables(copy_of)
    with_t, without = precompile.open(index), precompile.open(copy_of)
    for shuffle in (True, "block", False):
        for in_memory in (False, True):
            a = Loader(with_t, batch_size=7, shuffle=shuffle, seed=3, device="cpu", in_memory=in_memory)
            b = Loader(without, batch_size=7, shuffle=shuffle, seed=3, device="cpu", in_memory=in_memory)
            assert a.reader._tables is not None and b.reader._tables is None and a.reader.fast and b.reader.fast
            for x, y in zip(a, b, strict=True):
                for f in ("image", "label"):
                    np.testing.assert_array_equal(x[f].numpy(), y[f].numpy())
            _assert_same_as_dataset(a, with_t, epoch=1)
    with_t.close()
    without.close()


def test_loader_opens_no_shard_with_h5py_and_lazy_maps_only_what_it_reads(index, monkeypatch):
    opened: list[str] = []
    real_file = h5py.File

    def counting(name, *a, **kw):
        opened.append(os.path.basename(str(name)))
        return real_file(name, *a, **kw)

    monkeypatch.setattr(h5py, "File", counting)
    mapped: list[int] = []
    real_slot = direct.Region.map_slot

    def slot(self, i, idx=None, opened=None):
        mapped.append(i)
        return real_slot(self, i, idx, opened)

    monkeypatch.setattr(direct.Region, "map_slot", slot)
    ds = precompile.open(index)
    loader = Loader(ds, batch_size=8, shuffle=False, device="cpu", map_shards="lazy")
    assert [n for n in opened if n.startswith("shard-")] == []           # the index only
    assert loader.reader.mapped_shards == 0 and mapped == []
    got = list(loader)                                                     # a pass maps every shard once
    assert sorted(mapped) == list(range(len(ds.shards))) and loader.reader.mapped_shards == len(ds.shards)
    np.testing.assert_array_equal(got[0]["image"].numpy(), ds.batch(range(8))["image"])
    mapped.clear()
    r = DirectReader(ds, lazy=True)
    np.testing.assert_array_equal(r.read([7, 0, 3])["image"], ds.batch([7, 0, 3])["image"])
    assert mapped == [0] and r.mapped_shards == 1                          # shard 0 only
    rows = r.read([N - 1, 3])                                              # the last shard, and shard 0 again
    assert mapped == [0, len(ds.shards) - 1]
    np.testing.assert_array_equal(rows["image"], ds.batch([N - 1, 3])["image"])
    r.close()
    opened.clear()                                                         # (ds.batch read shards with h5py)
    eager = Loader(ds, batch_size=8, shuffle=False, device="cpu")
    assert eager.reader.mapped_shards == len(ds.shards)
    assert [n for n in opened if n.startswith("shard-")] == []
    with pytest.raises(ValueError, match="map_shards must be 'all' or 'lazy', got 'some'"):
        Loader(ds, batch_size=8, device="cpu", map_shards="some")
    ds.close()


def test_a_table_that_disagrees_with_the_entry_is_refused(copy_of):
    entries = _entries(copy_of)
    entries[1][fmt.E_CHUNKS]["image"] = [2 * CHUNK, 7]              # 32 rows in chunks of 10 are 4, not 7
    _set_entries(copy_of, entries)
    ds = precompile.open(copy_of)
    with pytest.raises(FormatError, match=r"shard-00001-[0-9a-f]{16}\.h5, field 'image': the index's chunk table "
                                          r"lists 7 chunk\(s\) of 10 rows for 32 samples: the index is damaged"):
        DirectReader(ds)
    entries[1][fmt.E_CHUNKS]["image"] = [CHUNK, 2]                  # and the entries no longer add up to the table
    _set_entries(copy_of, entries)
    ds = precompile.open(copy_of)
    with pytest.raises(FormatError, match=r"t\.h5: the index's chunk table has 52 chunks, its shard entries count "
                                          r"47: the index is damaged"):
        DirectReader(ds)
    ds.close()


def test_a_table_past_the_end_of_the_shard_is_refused(copy_of):
    e0 = _entries(copy_of)[0][fmt.E_CHUNKS]
    with h5py.File(copy_of, "r+") as f:
        f[fmt.CHUNKS][e0["image"][1], 0] = 10 ** 9                     # shard 0's first 'label' chunk
    ds = precompile.open(copy_of)
    with pytest.raises(FormatError, match=r"field 'label': the index's chunk table points outside the shard's "
                                          r"\d+ bytes"):
        DirectReader(ds)
    ds.close()


def test_a_short_or_missing_table_is_refused(copy_of):
    with h5py.File(copy_of, "r+") as f:
        t = f[fmt.CHUNKS][:]
        del f[fmt.CHUNKS]
        f.create_dataset(fmt.CHUNKS, data=t[:-1])
    ds = precompile.open(copy_of)
    with pytest.raises(FormatError, match=r"t\.h5: the index's chunk table has 51 chunks, its shard entries count "
                                          r"52: the index is damaged"):
        DirectReader(ds)
    with h5py.File(copy_of, "r+") as f:
        del f[fmt.CHUNKS]
        f.create_dataset(fmt.CHUNKS, data=np.concatenate([t, t[:1]]))
    with pytest.raises(FormatError, match=r"the index's chunk table has 53 chunks, its shard entries count 52"):
        DirectReader(ds)
    with h5py.File(copy_of, "r+") as f:
        del f[fmt.CHUNKS]
    with pytest.raises(FormatError, match="the shard entries list chunks but the index has no __chunks__ table"):
        DirectReader(ds)
    ds.close()


@pytest.mark.parametrize("lazy", [False, True, "one map per shard"])
def test_a_shard_file_that_is_not_the_one_the_table_describes_is_refused(copy_of, lazy, monkeypatch):
    if lazy == "one map per shard":
        monkeypatch.setattr(direct, "USE_REGION", False)
        lazy = False
    e = _entries(copy_of)[2]
    p = os.path.join(os.path.dirname(copy_of), e["file"])
    with open(p, "ab") as f:
        f.write(b"\0" * 100)                                          # replaced behind the index's back
    ds = precompile.open(copy_of)
    msg = (rf"{e['file'].split('/')[-1]}: the shard file is {e['bytes'] + 100} bytes, the index says {e['bytes']}: "
           rf"it is not the file the index's chunk table describes")
    if not lazy:
        with pytest.raises(FormatError, match=msg):
            DirectReader(ds)
    else:
        r = DirectReader(ds, lazy=True)
        np.testing.assert_array_equal(r.read([0, 40])["image"], ds.batch([0, 40])["image"])
        with pytest.raises(FormatError, match=msg):
            r.read([2 * PER_SHARD])
        r.close()
    ds.close()


def test_lazy_loader_names_a_shard_removed_before_it_was_mapped(copy_of):
    ds = precompile.open(copy_of)
    r = DirectReader(ds, lazy=True)
    os.remove(os.path.join(os.path.dirname(copy_of), ds.shards[3]["file"]))
    np.testing.assert_array_equal(r.read([1])["label"], ds.batch([1])["label"])
    with pytest.raises(FormatError, match=r"the shard file is missing: the index is the one this reader opened, and "
                                          r".* names it, but it is not there: it was deleted .* see which shards are "
                                          r"missing with: precompile verify "):
        r.read([N - 1])   # deleted by hand under an unchanged index: not "rebuilt, open it again"
    r.close()
    ds.close()


def test_a_partial_rebuild_keeps_tables_for_kept_and_new_shards(tmp_path):
    index = _build(str(tmp_path))
    before = _entries(index)
    src = tmp_path / "in"
    victim = sorted(src.glob("*/*.png"))[-1]
    from PIL import Image

    Image.fromarray(np.full((10, 12, 3), 9, np.uint8)).save(victim)
    rep = precompile.build(_recipe_of(tmp_path), out_dir=str(tmp_path / "out"))
    assert rep["shards"]["built"] == 1
    after = _entries(index)
    assert all(fmt.E_CHUNKS in e for e in after)
    assert [e[fmt.E_CHUNKS] for e in after] == [e[fmt.E_CHUNKS] for e in before]
    ds = precompile.open(index)
    _assert_same_as_dataset(Loader(ds, batch_size=11, shuffle=True, seed=5, device="cpu"), ds)
    ds.close()


def _recipe_of(tmp_path):
    from precompile.recipe import parse_recipe

    return parse_recipe({
        "name": "t", "seed": 0,
        "inputs": {"root": "in", "match": "{label}/{name}.{ext}", "where": {"ext": "png|jpg"},
                   "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [8, 8]}}],
        "output": {"format": "hdf5", "samples_per_shard": PER_SHARD, "chunk_samples": CHUNK},
    }, base_dir=str(tmp_path))


def test_a_closed_reader_unmaps_its_shards_without_waiting_for_the_gc(index):
    import gc

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this system")
    ds = precompile.open(index)
    gc.collect()
    gc.disable()
    try:
        before = maps()
        r = DirectReader(ds)
        assert r.region is not None and maps() >= before + len(ds.shards)
        rows = r.read([0, N - 1])
        r.close()
        del r
        assert maps() == before          # no reference cycle keeps the range mapped until a gc pass
        np.testing.assert_array_equal(rows["image"], ds.batch([0, N - 1])["image"])
    finally:
        gc.enable()
        ds.close()


def test_an_entry_without_a_table_for_a_field_opens_that_shard_only(copy_of, monkeypatch):
    entries = _entries(copy_of)
    pos = sum(k for e in entries[:1] for _, k in e[fmt.E_CHUNKS].values())      # shard 1's rows start here
    k = entries[1][fmt.E_CHUNKS]["image"][1]                                  # 'image' first (name order)
    del entries[1][fmt.E_CHUNKS]["image"]                                    # as a writer that could not map it
    _set_entries(copy_of, entries)
    with h5py.File(copy_of, "r+") as f:
        t = f[fmt.CHUNKS][:]
        del f[fmt.CHUNKS]
        f.create_dataset(fmt.CHUNKS, data=np.concatenate([t[:pos], t[pos + k:]]))
    opened: list[str] = []
    real = rows.open_h5
    monkeypatch.setattr(rows, "open_h5", lambda p: (opened.append(os.path.basename(p)), real(p))[1])
    ds = precompile.open(copy_of)
    r = DirectReader(ds)
    assert opened == [os.path.basename(entries[1]["file"])] and r.fast
    np.testing.assert_array_equal(r.read(np.arange(N)[::-1])["image"], ds.batch(np.arange(N)[::-1])["image"])
    r.close()
    ds.close()
