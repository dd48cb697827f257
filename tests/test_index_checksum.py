"""The HDF5 index's own checksums (``index_crc32``): one flipped byte in what a reader takes from the index
(the key column, its offsets, the copy column, the shard table, the chunk tables, the attributes: label
names, field shapes and dtypes) made the reader serve a wrong key, label name or row; ``verify`` caught it,
opening did not. Now each of these is checked against the crc32 the build recorded before any of it is
served (the per-sample columns on first use, so that opening costs nothing more: benchmarks/
bench_index_checksum.py), and a mismatch is a FormatError naming the file, what is damaged and what to do.
An index without the checksums (written before them) opens as before; a rebuild that keeps shards never
carries damaged rows of the old index into the new one; ``verify`` reports the damage and ``build --repair``
writes the index again.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import h5py
import numpy as np
import pytest

import precompile
from precompile import build
from precompile.errors import FormatError
from precompile.formats import names as fmt
from precompile.formats.hdf5_layout import shard_chunk_tables
from precompile.recipe import parse_recipe

from loader_cases import N, PER_SHARD, _make_inputs

torch = pytest.importorskip("torch", reason="the Loader needs torch")

from precompile.reader.direct import DirectReader  # noqa: E402
from precompile.reader.loader import Loader  # noqa: E402


def _recipe(tmp: str, **output) -> object:
    return parse_recipe({
        "name": "t", "seed": 0,
        "inputs": {"root": "in", "match": "{label}/{name}.{ext}", "where": {"ext": "png|jpg"},
                   "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [8, 8]}}],
        "output": {"format": "hdf5", "samples_per_shard": PER_SHARD, "chunk_samples": 5, **output},
    }, base_dir=tmp)


def _build(tmp: str) -> str:
    _make_inputs(os.path.join(tmp, "in"))
    build(_recipe(tmp), out_dir=os.path.join(tmp, "out"))
    return os.path.join(tmp, "out", "t.h5")


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("checksum")))


@pytest.fixture()
def copy_of(tmp_path, index) -> str:
    """A private copy of the module's build (its inputs too: tests that rebuild it)."""
    shutil.copytree(os.path.dirname(os.path.dirname(index)), tmp_path / "b")
    return str(tmp_path / "b" / "out" / "t.h5")


def _flip(path: str, name: str, byte: int) -> None:
    """One bit of byte ``byte`` of dataset ``name`` of the index flipped in place (as a bad disk or copy does)."""
    with h5py.File(path, "r+") as f:
        a = f[name][()]
        a.reshape(-1).view(np.uint8)[byte] ^= 1
        f[name][...] = a


def _damage(path: str, what: str) -> str:
    """The index's ``__key_utf8__``, ... damaged by one flipped bit; the words the message uses for it."""
    with h5py.File(path, "r") as f:
        off = f[fmt.KEY_OFFSETS][()]
        labels = f.attrs[fmt.A_LABELS]
    if what == fmt.KEY_UTF8:
        _flip(path, what, int(off[7]) + 1)                                # sample 7's key, 2nd byte
        return "sample keys (__key_utf8__)"
    if what == fmt.KEY_OFFSETS:
        with h5py.File(path, "r+") as f:
            f[what][7] += 1                                               # keys 6 and 7 cut one byte later
        return "key offsets (__key_offsets__)"
    if what == fmt.COPY:
        _flip(path, what, 4 * 3)                                          # sample 3: copy 1
        return "copy column (__copy__)"
    if what == fmt.SHARD_TABLE:
        with h5py.File(path, "r+") as f:
            rows = f[what][()]
            rows["bytes"][1] ^= 1 << 20
            f[what][...] = rows
        return "shard table (__shards__)"
    if what == fmt.A_LABELS:
        with h5py.File(path, "r+") as f:
            f.attrs[what] = labels.replace("dog", "dof")
        return "attribute 'label_names'"
    if what == fmt.A_FIELDS:
        with h5py.File(path, "r+") as f:
            f.attrs[what] = f.attrs[what].replace('"uint8"', '"int8"')
        return "attribute 'fields'"
    raise AssertionError(what)


def _message(path: str, what: str) -> str:
    return (f"{path}: the index is damaged: the crc32 of its {what} is not the one the build recorded "
            f"(index_crc32); write the index again with: precompile build <recipe> --repair (with the same "
            f"-o: it checks every shard and rewrites the index from them); see what is damaged with: "
            f"precompile verify {path}")


@pytest.mark.parametrize("what", [fmt.KEY_UTF8, fmt.KEY_OFFSETS, fmt.COPY])
def test_a_flipped_byte_in_a_sample_column_is_refused_never_served(copy_of, index, what):
    """The attack: a flipped bit in the key column made ``key(7)`` another key. Opening reads the columns
    whole (the snapshot) but checks them on first use: nothing of them is served unchecked."""
    ref = precompile.open(index)
    words = _damage(copy_of, what)
    ds = precompile.open(copy_of)
    if what == fmt.COPY:
        with pytest.raises(FormatError) as e:
            ds.copy(3)
        assert str(e.value) == _message(copy_of, words)
        with pytest.raises(FormatError):
            ds.copies
    else:
        for ask in (lambda: ds.key(7), lambda: ds.keys, lambda: ds.key(0)):
            with pytest.raises(FormatError) as e:
                ask()
            assert str(e.value) == _message(copy_of, words)
    with h5py.File(index, "r") as f:
        assert ref.key(7) == f[fmt.KEY][7].decode() and ref.copy(3) == 0   # the undamaged build
    ds.close()
    ref.close()


@pytest.mark.parametrize("what", [fmt.SHARD_TABLE, fmt.A_LABELS, fmt.A_FIELDS])
def test_a_flipped_byte_in_what_opening_reads_is_refused_at_open(copy_of, what):
    """The shard table and the attributes are read at open: checked there (label names, and the dtype the
    Loader maps the rows as, would be served wrong)."""
    words = _damage(copy_of, what)
    with pytest.raises(FormatError) as e:
        precompile.open(copy_of)
    assert str(e.value) == _message(copy_of, words)


def test_a_chunk_table_pointing_at_another_chunk_is_refused(copy_of, index):
    """Two rows of the chunk table swapped (both inside the shard, both the right size: every structural
    check passes) served another chunk's samples; now the Loader's reader refuses the table."""
    with h5py.File(copy_of, "r+") as f:
        t = f[fmt.CHUNKS][()]
        t[[0, 1]] = t[[1, 0]]                               # shard 0, field 'image': chunks 0 and 1
        f[fmt.CHUNKS][...] = t
    ds = precompile.open(copy_of)
    with pytest.raises(FormatError) as e:
        DirectReader(ds)
    assert str(e.value) == _message(copy_of, "chunk tables (__chunks__)")
    with pytest.raises(FormatError, match=re.escape(_message(copy_of, "chunk tables (__chunks__)"))):
        Loader(copy_of, batch_size=8, device="cpu")
    ds.close()


def test_an_index_without_the_checksums_opens_and_reads_the_same(copy_of, index):
    """An index written before ``index_crc32`` (format version 2 all the same) is read as before."""
    with h5py.File(copy_of, "r+") as f:
        del f.attrs[fmt.A_INDEX_CRC]
    old, new = precompile.open(copy_of), precompile.open(index)
    assert old.keys == new.keys and old.label_names == new.label_names == ["cat", "dog", "eel"]
    assert old.copies.tolist() == new.copies.tolist()
    a = [b["image"].numpy().copy() for b in Loader(old, batch_size=9, shuffle=True, seed=3, device="cpu")]
    b = [b["image"].numpy().copy() for b in Loader(new, batch_size=9, shuffle=True, seed=3, device="cpu")]
    assert len(a) == len(b) == -(-N // 9) and all(np.array_equal(x, y) for x, y in zip(a, b))
    old.close()
    new.close()


def test_the_recorded_checksums_are_those_of_the_bytes_read_back(index, tmp_path):
    """What the writer records (from the arrays it wrote) equals what ``verify`` computes from the file, for
    every covered item: a ragged field, non-ASCII keys, meta, every attribute but the entries."""
    from precompile.formats.index_columns import index_crcs, recorded_crcs

    with h5py.File(index, "r") as f:
        rec, got = recorded_crcs(f, index), index_crcs(f)
        assert rec == got
        assert set(rec["datasets"]) == {fmt.KEY, fmt.COPY, fmt.META, fmt.KEY_UTF8, fmt.KEY_OFFSETS,
                                        fmt.SHARD_TABLE, fmt.CHUNKS}
        assert set(rec["attrs"]) == set(f.attrs) - {fmt.A_SHARDS, fmt.A_INDEX_CRC}
        assert rec["datasets"][fmt.KEY_UTF8] == zlib.crc32(f[fmt.KEY_UTF8][()].tobytes())
        assert rec["attrs"][fmt.A_LABELS] == zlib.crc32(b'["cat","dog","eel"]')
    root = tmp_path / "in"
    rng = np.random.default_rng(2)
    from PIL import Image

    for i, name in enumerate(["żółw", "plain", "日本語", "a b"]):
        os.makedirs(root / "x", exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (5 + i, 7 + 2 * i, 3), dtype=np.uint8)).save(root / "x" / f"{name}.png")
    r = parse_recipe({"name": "r", "inputs": {"root": "in", "match": "{label}/{name}.png",
                                              "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
                      "output": {"format": "hdf5", "samples_per_shard": 3}}, base_dir=str(tmp_path))
    build(r, out_dir=tmp_path / "out")
    with h5py.File(tmp_path / "out" / "r.h5", "r") as f:
        rec, got = recorded_crcs(f, "r.h5"), index_crcs(f)
        assert rec == got and {"image/offsets", "image/shapes"} <= set(rec["datasets"])
    ds = precompile.open(tmp_path / "out" / "r.h5")
    assert sorted(ds.keys) == sorted(f"x/{n}.png" for n in ["żółw", "plain", "日本語", "a b"])
    ds.close()


def test_verify_reports_the_damage_and_repair_writes_the_index_again(copy_of, index):
    from precompile.tools.verify import verify

    _damage(copy_of, fmt.KEY_UTF8)
    res = verify(copy_of, checksums=False)
    assert res.bad_shards == [] and res.index_damaged
    assert "the crc32 of its sample keys (__key_utf8__) is not the one the build recorded" in res.index_problems
    tmp = os.path.dirname(os.path.dirname(copy_of))
    rep = build(_recipe(tmp), out_dir=os.path.join(tmp, "out"), repair=True)
    assert rep["shards"]["built"] == 0
    ds, ref = precompile.open(copy_of), precompile.open(index)
    assert ds.keys == ref.keys and ds.key(7) == ref.key(7)
    assert verify(copy_of, checksums=False).index_problems == []
    ds.close()
    ref.close()


def test_a_rebuild_never_carries_damaged_rows_of_the_old_index_into_the_new(copy_of, index):
    """A rebuild takes a kept shard's rows (keys, meta, chunk table) from the index it replaces. A chunk
    table row damaged there was copied into the new index (and sealed with a new checksum); now the damaged
    index's rows are refused and the kept shards' own are read."""
    with h5py.File(copy_of, "r+") as f:
        t = f[fmt.CHUNKS][()]
        t[[0, 1]] = t[[1, 0]]
        f[fmt.CHUNKS][...] = t
    tmp = os.path.dirname(os.path.dirname(copy_of))
    last = sorted((p for p in os.scandir(os.path.join(tmp, "in", "eel"))), key=lambda p: p.name)[-1]
    os.remove(last.path)                                            # the last shard changes, the others are kept
    rep = build(_recipe(tmp), out_dir=os.path.join(tmp, "out"))
    assert rep["shards"]["skipped"] == 3 and rep["shards"]["built"] == 1
    with h5py.File(copy_of, "r") as f:
        entries = json.loads(f.attrs[fmt.A_SHARDS])
        table = f[fmt.CHUNKS][()]
    want = []
    for e in entries:
        with h5py.File(os.path.join(tmp, "out", e["file"]), "r") as sf:
            own = shard_chunk_tables(sf, ["image", "label"])
        want += [own[name][1] for name in sorted(own)]
    np.testing.assert_array_equal(table, np.concatenate(want))
    ds = precompile.open(copy_of)
    r = DirectReader(ds)
    np.testing.assert_array_equal(r.read(list(range(len(ds))))["image"], ds.batch(range(len(ds)))["image"])
    r.close()
    ds.close()


# -- a shard deleted by hand: the true cause, not "the build was replaced" ------------------------------------

def _missing(path: str, index: str) -> str:
    return (f"{path}: the shard file is missing: the index is the one this reader opened, and {index} names it, "
            f"but it is not there: it was deleted (not by precompile, which never removes a shard that an index "
            f"names) or never written (an output copied without all its shards); see which shards are missing "
            f"with: precompile verify {index}; build again to write them")


def test_a_shard_deleted_by_hand_is_reported_missing_with_what_to_do(copy_of):
    """It was reported as "the output was rebuilt since ... open the output again": wrong cause, and reopening
    mends nothing. The index is unchanged since it was opened, so the shard it names is missing; a rebuild
    (the index replaced) still says to reopen."""
    ds = precompile.open(copy_of)
    lazy = DirectReader(ds, lazy=True)
    victim = os.path.join(os.path.dirname(copy_of), ds.shard_table.file(2))
    os.remove(victim)
    for read in (lambda: ds[2 * PER_SHARD], lambda: lazy.read([2 * PER_SHARD]), lambda: DirectReader(ds)):
        with pytest.raises(FormatError) as e:
            read()
        assert str(e.value) == _missing(victim, copy_of)
    with pytest.raises(FormatError) as e:
        Loader(copy_of, batch_size=8, device="cpu")
    assert str(e.value) == _missing(victim, copy_of)
    from precompile.tools.verify import verify

    assert verify(copy_of, checksums=False).bad_shards == [ds.shard_table.file(2)]    # the advice holds
    tmp = os.path.dirname(os.path.dirname(copy_of))
    assert build(_recipe(tmp), out_dir=os.path.join(tmp, "out"))["shards"]["built"] == 1
    assert os.path.isfile(victim)                                   # the build wrote it again
    new = precompile.open(copy_of)
    # the index replaced since this reader opened it: the old message (reopen), not "missing"
    shutil.copyfile(copy_of, copy_of + ".new")
    os.replace(copy_of + ".new", copy_of)
    os.remove(victim)
    with pytest.raises(FormatError) as e:
        new[2 * PER_SHARD]
    assert str(e.value) == (f"{victim}: the shard file is gone: the output was rebuilt since {copy_of} was opened, "
                            f"and the snapshot this reader holds was removed (a build keeps the snapshot it replaces "
                            f"until the next build starts, or until 'precompile gc --all'); open the output again "
                            f"to read the new build")
    lazy.close()
    ds.close()
    new.close()


@pytest.mark.parametrize("text", ['[{"file": "t.shards/x.h5", "num_sam', '[{"file": "t.shards/x.h5"}]', '{"a": 1}'])
def test_entries_that_cannot_be_read_are_a_format_error_naming_the_index(copy_of, text):
    """The entries (``shards``) are outside the checksums (their own rule: a stale ``__shards__`` is not read);
    entries damaged beyond reading gave a JSONDecodeError or KeyError traceback at open."""
    with h5py.File(copy_of, "r+") as f:
        f.attrs[fmt.A_SHARDS] = text
    with pytest.raises(FormatError, match=rf"^{re.escape(copy_of)}: the index is damaged: its shard entries "
                                          r"\(shards\) cannot be read \((JSONDecodeError|KeyError|ValueError): .*\); "
                                          r"write the index again with: precompile build <recipe> --repair"):
        precompile.open(copy_of)


def test_precompile_s_own_attribute_writer_keeps_the_checksums_true(copy_of):
    """``set_index_attr`` (``precompile stats`` stores its attribute with it) updates the record of an attribute
    it records, so precompile never leaves its own index failing its checksums."""
    from precompile.formats.hdf5 import Hdf5Format

    Hdf5Format().set_index_attr(copy_of, fmt.A_LABELS, '["a","b","c"]')
    Hdf5Format().set_index_attr(copy_of, "stats", '{"n": 1}')          # not recorded: added as it is
    ds = precompile.open(copy_of)
    assert ds.label_names == ["a", "b", "c"] and ds.attrs["stats"] == '{"n": 1}'
    ds.close()
    from precompile.tools.verify import verify

    assert verify(copy_of, checksums=False).index_problems == []


def test_a_file_of_a_folder_build_deleted_by_hand_is_reported_missing(tmp_path, image_tree):
    """A png build's sample file deleted by hand under its unchanged JSON index: missing, not "rebuilt"."""
    from conftest import image_recipe

    precompile.build(image_recipe(image_tree, output={"format": "png", "samples_per_shard": 4}),
                     out_dir=tmp_path / "out")
    index = str(tmp_path / "out" / "imgs.json")
    ds = precompile.open(index)
    victim = os.path.join(os.path.dirname(index), ds.samples[5]["files"]["image"])
    os.remove(victim)
    with pytest.raises(FormatError) as e:
        ds[5]
    assert str(e.value) == _missing(victim, index)
    os.replace(index, index + ".old")                                    # the index replaced since it was opened
    shutil.copyfile(index + ".old", index)
    with pytest.raises(FormatError, match=r"the shard file is gone: the output was rebuilt since .* open the "
                                          r"output again to read the new build$"):
        ds[5]
