"""Gathering: the Loader's batches are the dataset's bytes from mapped, in-memory and h5py-fallback
readers; both DirectReader gather paths; irregular and compressed layouts; open-file limits, dtype
mismatches, use after close, fallback files per process; host buffers recycled only once released.

Builds come from ``precompile.build`` (loader_cases, conftest); shards are rewritten with h5py where a
test needs a layout the writer never makes.
"""
from __future__ import annotations

import copy
import mmap
import os
import subprocess
import sys
import textwrap
import threading

import h5py
import numpy as np
import pytest
import torch

import precompile
from precompile.errors import FormatError, PrecompileError
from precompile.reader import direct, feed
from precompile.reader import views as view_tables
from precompile.reader.direct import DirectReader
from precompile.reader.feed import HostPool
from precompile.reader.loader import Loader

from conftest import image_recipe, write_recipe
from loader_cases import (N, REPO, _assert_same_as_dataset, _build, _chunk_addresses,  # noqa: F401
                          _rewrite_shard, built, ds,
                          _drop_chunk_tables)


@pytest.mark.parametrize("in_memory", [False, True])
def test_full_shuffle_matches_dataset_from_maps_and_memory(built, ds, in_memory):
    loader = Loader(built, batch_size=16, shuffle=True, seed=3, device="cpu", in_memory=in_memory)
    # 4 shards: mapped into one address range (POSIX), or copied into one array per field
    if sys.platform.startswith("linux"):
        assert (loader.reader.region is not None) == (not in_memory)
    assert _assert_same_as_dataset(loader, ds, epoch=1) == 8


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_in_memory_gives_the_mapped_loaders_batches(built, shuffle):
    # sort_batches orders a batch's rows by their place in the files; the in-memory copy keeps that order, so
    # in_memory=True changes where the rows are read from, not the batches. (It used to sort by row index: the
    # same members in another order wherever the files' order is not the rows' order, as in this build.)
    kw = dict(batch_size=16, shuffle=shuffle, seed=3, device="cpu")
    mapped, mem = Loader(built, **kw), Loader(built, in_memory=True, **kw)
    assert not np.array_equal(np.argsort(mapped.reader.gather_rank), np.arange(N))   # the orders differ here
    for epoch in (0, 1):
        mapped.set_epoch(epoch)
        mem.set_epoch(epoch)
        n = 0
        for x, y in zip(mapped, mem, strict=True):
            assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
            n += 1
        assert n == 8


@pytest.mark.parametrize("batches_per_task", [1, 32])
def test_sequential_batches_match_dataset(built, ds, batches_per_task, monkeypatch):
    monkeypatch.setattr(feed, "GROUP_BYTES", batches_per_task * 16 * (8 * 8 * 3 + 8))
    loader = Loader(built, batch_size=16, shuffle=False, device="cpu")
    assert loader.reader.fast and not loader.reader.fallbacks
    idx = loader.batch_indices()
    np.testing.assert_array_equal(np.concatenate(idx), np.arange(N))
    assert [len(i) for i in idx] == [16] * 7 + [8]
    assert _assert_same_as_dataset(loader, ds) == 8
    b = next(iter(Loader(built, batch_size=4, shuffle=False, device="cpu")))
    assert b["image"].dtype == torch.uint8 and b["image"].shape == (4, 8, 8, 3)
    assert b["label"].dtype == torch.int64


@pytest.mark.parametrize("in_memory", [False, True])
@pytest.mark.parametrize("threads", [2, 3])
def test_rows_split_across_threads_give_the_same_batches(built, ds, threads, in_memory, monkeypatch):
    # every task is cut into `threads` row ranges (one part per SPLIT_BYTES: 1 byte forces a part per thread)
    parts = []
    real = feed.RowSplitter.parts
    monkeypatch.setattr(feed, "SPLIT_BYTES", 1)
    monkeypatch.setattr(feed.RowSplitter, "parts", lambda self, n, rb: parts.append(real(self, n, rb)) or parts[-1])
    loader = Loader(built, batch_size=16, shuffle=True, seed=3, device="cpu", prefetch=1, num_threads=threads,
                    in_memory=in_memory)
    assert _assert_same_as_dataset(loader, ds, epoch=2) == 8
    assert parts and set(parts) == {threads}
    kw = dict(batch_size=16, shuffle=True, seed=3, device="cpu", in_memory=in_memory)
    split = list(Loader(built, prefetch=1, num_threads=threads, **kw))
    ref = list(Loader(built, num_threads=0, **kw))
    monkeypatch.setattr(feed, "SPLIT_BYTES", 1 << 40)      # no task large enough: one range, as before
    for x, y, z in zip(split, ref, Loader(built, num_threads=threads, **kw)):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["image"], z["image"])
        assert torch.equal(x["label"], y["label"])


def test_split_parts_follow_bytes_and_threads(built):
    r = Loader(built, batch_size=16, device="cpu").reader
    s = feed.RowSplitter(r, ["image"], 4, torch.device("cpu"))
    try:
        mb = feed.SPLIT_BYTES
        assert [s.parts(256, 4096), s.parts(256, mb // 256 * 2), s.parts(256, mb), s.parts(3, mb)] == [1, 2, 4, 3]
        assert feed.RowSplitter(r, ["image"], 1, torch.device("cpu")).parts(256, mb) == 1
    finally:
        s.close()


def test_a_task_does_not_wait_for_parts_no_split_thread_has_started(built, ds, monkeypatch):
    # the split threads are busy with another task's parts: the task's own thread gathers its queued parts
    # itself (two tasks in flight with prefetch=1 would otherwise queue behind each other on one split thread)
    monkeypatch.setattr(feed, "SPLIT_BYTES", 1)
    r = Loader(built, batch_size=16, device="cpu").reader
    s = feed.RowSplitter(r, ["image"], 2, torch.device("cpu"))
    release = threading.Event()
    busy = s._pool.submit(release.wait, 30)
    rows = np.array([5, 0, 17, 3, 9, 30, 2, 11])
    out = {"image": np.zeros((len(rows), *r.shapes["image"]), r.dtypes["image"])}
    t = threading.Thread(target=s.gather, args=(rows, out))
    try:
        t.start()
        t.join(10)
        assert not t.is_alive(), "the task waited for a part queued behind a busy split thread"
        np.testing.assert_array_equal(out["image"], ds.batch(rows)["image"])
    finally:
        release.set()
        busy.result()
        t.join()
        s.close()


@pytest.mark.parametrize("threads", [2, 0])
def test_batches_are_not_reused_buffers(built, ds, threads):
    # on CPU each batch owns its memory: holding on to all of them keeps them intact
    loader = Loader(built, batch_size=8, shuffle=True, seed=3, device="cpu", prefetch=1, num_threads=threads)
    held = list(loader)
    for b, i in zip(held, loader.batch_indices(0)):
        np.testing.assert_array_equal(b["image"].numpy(), ds.batch(i)["image"])


def test_direct_reader_read_any_order(built, ds):
    r = DirectReader(ds)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, N, 50)  # repeats and shard crossings
    got = r.read(idx)
    ref = ds.batch(idx)
    for f in ("image", "label"):
        np.testing.assert_array_equal(got[f], ref[f])
    with pytest.raises(IndexError):
        r.plan(np.array([N]))


def test_chunks_not_evenly_spaced(tmp_path):
    built = _build(str(tmp_path))
    d0 = precompile.open(built)
    shard0 = os.path.join(os.path.dirname(built), d0.shards[0]["file"])
    d0.close()
    _rewrite_shard(shard0, scramble=True)
    addr = _chunk_addresses(shard0, "image")
    steps = np.diff(addr)
    assert (steps < 0).any() and len(set(steps.tolist())) > 1  # the layout really is irregular
    assert any(a % 4096 for a in addr)                        # and unaligned
    ds = precompile.open(built)
    loader = Loader(ds, batch_size=9, shuffle=True, seed=0, device="cpu")
    assert loader.reader.fast
    _assert_same_as_dataset(loader, ds)
    # the in-memory copy reads the scrambled chunks from the files in runs: the same batches
    mem = Loader(ds, batch_size=9, shuffle=True, seed=0, device="cpu", in_memory=True, sort_batches=False)
    assert mem.reader.region is None and len(mem.reader._views["image"]) == 1
    _assert_same_as_dataset(mem, ds)
    ds.close()


def test_compressed_shard_falls_back_to_h5py(tmp_path):
    built = _build(str(tmp_path))
    d0 = precompile.open(built)
    shard1 = os.path.join(os.path.dirname(built), d0.shards[1]["file"])
    d0.close()
    _rewrite_shard(shard1, compression="gzip")
    ds = precompile.open(built)
    loader = Loader(ds, batch_size=16, shuffle="block", seed=1, device="cpu")
    assert not loader.reader.fast
    assert set(loader.reader.fallbacks) == {(1, "image"), (1, "label")}
    assert "filtered" in loader.reader.fallbacks[(1, "image")] and "deflate" in loader.reader.fallbacks[(1, "image")]
    _assert_same_as_dataset(loader, ds)
    _assert_same_as_dataset(Loader(ds, batch_size=16, shuffle=True, seed=1, device="cpu"), ds)
    ds.close()


def test_variable_shape_field_is_refused(ds):
    odd = copy.copy(ds)
    odd.field_specs = {**ds.field_specs, "image": {**ds.field_specs["image"], "shape": [None, None, 3]}}
    with pytest.raises(FormatError, match="'image' has shape .*unknown dimensions.*fixed-shape"):
        DirectReader(odd)
    with pytest.raises(KeyError, match="no field 'nope'"):
        DirectReader(ds, ["nope"])


@pytest.fixture
def residue_ds(tmp_path, image_tree):
    # 30x30x3 rows (2700 bytes) in chunks of 3 samples: chunk addresses fall into several residues
    r = image_recipe(image_tree, steps=[{"resize": {"size": [30, 30]}}],
                     output={"format": "hdf5", "samples_per_shard": 6, "chunk_samples": 3})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    return precompile.open(tmp_path / "out" / "imgs.h5")


@pytest.mark.parametrize("region", [True, False])
@pytest.mark.parametrize("max_views", [0, 64])
def test_gather_paths_match_the_dataset(residue_ds, monkeypatch, max_views, region):
    # the views (2700-byte rows have no factor of MIN_PIECE_BYTES; the labels' pieces are switched off too)
    monkeypatch.setattr(direct, "PIECE_TAKE", False)
    monkeypatch.setattr(view_tables, "MAX_VIEWS", max_views)
    monkeypatch.setattr(direct, "USE_REGION", region)
    r = direct.DirectReader(residue_ds)
    nshards = len(residue_ds.shards)
    if not region:
        assert r.region is None and len(r._maps) == nshards
    takeable = r._takeable["image"]
    spaces = 1 if r.region is not None else nshards
    if max_views == 0:
        assert takeable == [False] * spaces                # one strided view per mapped space
    else:                                                  # several residues, all served by np.take
        assert all(takeable) and len(takeable) > spaces
    calls = []
    run = r._gather_runs
    monkeypatch.setattr(r, "_gather_runs", lambda *a: calls.append(1) or run(*a))
    rng = np.random.default_rng(0)
    for size in (7, 7, 7, 40, 40):  # 40 scattered rows: many more runs than views, grouped by view first
        idx = rng.choice(len(residue_ds), size=size, replace=True)
        for order in (idx, r.order_batch(idx)):        # scattered and gather-ordered batches
            calls.clear()
            got = r.read(order)
            want = residue_ds.batch(order)
            for f in ("image", "label"):
                np.testing.assert_array_equal(got[f], want[f])
            grouped = len(calls) > 2                   # one call per field, plus one per field it grouped
            # one strided view (max_views 0, one region) is one run whatever the order
            assert grouped == (size == 40 and order is idx and len(takeable) > 1), (size, len(calls))


def test_one_region_serves_every_shard_and_in_memory_matches(residue_ds, monkeypatch):
    monkeypatch.setattr(direct, "USE_REGION", True)
    r = direct.DirectReader(residue_ds)
    if r.region is None:
        pytest.skip("no MAP_FIXED through ctypes on this platform")
    # every shard file lies in the one range, page aligned, in shard order
    assert len(r.region.bases) == len(residue_ds.shards) and (r.region.bases % mmap.PAGESIZE == 0).all()
    assert not r.region.array.flags.writeable
    with pytest.raises(ValueError):
        r.region.array[0] = 1
    # the views of the range cover the rows of every shard: their number does not grow with shards
    assert len(r._views["image"]) == len(np.unique(r._vid["image"]))
    m = direct.DirectReader(residue_ds, in_memory=True)
    assert m.region is None and len(m._views["image"]) == 1
    idx = np.random.default_rng(1).choice(len(residue_ds), size=25, replace=True)
    want = residue_ds.batch(idx)
    for reader in (r, m):
        got = reader.read(idx)
        for f in ("image", "label"):
            np.testing.assert_array_equal(got[f], want[f])
    r.close()
    m.close()


@pytest.fixture
def one_per_shard(tmp_path, image_tree) -> str:
    """10 samples of 16x16x3, one per shard: 10 shard files."""
    r = image_recipe(image_tree, steps=[{"resize": {"size": [16, 16]}}],
                     output={"format": "hdf5", "samples_per_shard": 1})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    return str(tmp_path / "out" / "imgs.h5")


_LIMITED = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    import precompile
    from precompile.errors import FormatError
    from precompile.reader import direct
    from precompile.reader.direct import DirectReader
    direct.USE_REGION = sys.argv[3] == "region"
    ds = precompile.open(sys.argv[1])
    ref = ds.batch(range(len(ds)))["image"]      # the map-style dataset's bytes (h5py)
    ds.close()
    ds = precompile.open(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 4   # room for 3 or so shards, the build has 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, low if sys.argv[2] == "fixed" else hard))
    try:
        r = DirectReader(ds)
    except FormatError as e:
        print("FormatError:", e)
        sys.exit(0)
    got = r.read(np.arange(len(ds)))["image"]
    print("read", len(got), "equal", bool(np.array_equal(got, ref)),
          "raised", resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low)
""")


def _run_limited(index: str, mode: str, maps: str = "per-shard") -> str:
    out = subprocess.run([sys.executable, "-c", _LIMITED, index, mode, maps], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or sys.platform == "win32",
                    reason="needs POSIX rlimits and /proc/self/fd to count open files")
def test_open_file_limit_is_raised_or_reported(one_per_shard):
    # one map per shard (the fallback where no region can be reserved):
    # the soft limit can go up to the hard one: the reader raises it and reads every shard
    assert _run_limited(one_per_shard, "raisable") == "read 10 equal True raised True"
    # the hard limit is too low: a FormatError that names the cause, not a bare OSError
    msg = _run_limited(one_per_shard, "fixed")
    if sys.version_info >= (3, 13):  # maps keep no descriptor: 10 shards fit
        assert msg.startswith("read 10 equal True"), msg
    else:
        assert msg.startswith("FormatError:") and "too many open files" in msg.lower() \
            and "open-file limit" in msg and "ulimit -n" in msg, msg
    # one region for all shards closes each descriptor once its file is mapped: no limit to raise
    if sys.platform.startswith("linux"):
        for mode in ("raisable", "fixed"):
            assert _run_limited(one_per_shard, mode, "region") == "read 10 equal True raised False"


def _rewrite_field(path: str, name: str, fn) -> None:
    with h5py.File(path, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = dict(f.attrs)
    os.remove(path)
    with h5py.File(path, "w") as g:
        for k, v in data.items():
            g.create_dataset(k, data=fn(v) if k == name else v)
        for k, v in attrs.items():
            g.attrs[k] = v
    _drop_chunk_tables(os.path.dirname(path)[:-len(".shards")] + ".h5")   # the h5py resolver's cases


def _shard(index: str, s: int) -> str:
    ds = precompile.open(index)
    p = os.path.join(os.path.dirname(index), ds.shards[s]["file"])
    ds.close()
    return p


def test_dtype_mismatch_is_refused_and_byte_order_falls_back(one_per_shard):
    shard = _shard(one_per_shard, 2)
    _rewrite_field(shard, "label", lambda v: v.astype(">i8"))     # same values, big-endian: h5py converts
    ds = precompile.open(one_per_shard)
    r = DirectReader(ds)
    assert "stored as >i8" in r.fallbacks[(2, "label")]
    np.testing.assert_array_equal(r.read(np.arange(len(ds)))["label"], ds.batch(range(len(ds)))["label"])
    r.close()
    ds.close()
    _rewrite_field(shard, "label", lambda v: v.astype(np.int32))  # another type: values would wrap silently
    ds = precompile.open(one_per_shard)
    with pytest.raises(FormatError, match=r"dataset 'label' has dtype <i4, the index says <i8"):
        DirectReader(ds)
    ds.close()


def test_reader_after_close_is_a_clear_error(one_per_shard):
    ds = precompile.open(one_per_shard)
    r = DirectReader(ds)
    np.testing.assert_array_equal(r.read([3, 1])["image"], ds.batch([3, 1])["image"])
    plan = r.plan(np.array([3, 1, 3, 0, 2, 1, 0, 3, 2, 1, 0]))  # planned before close, gathered after
    r.close()
    assert r.closed
    with pytest.raises(PrecompileError, match="reader is closed"):
        r.read([3, 1])
    with pytest.raises(PrecompileError, match="reader is closed"):
        r.gather("image", plan, np.empty((plan.size, 16, 16, 3), np.uint8))
    ds.close()


def test_fallback_shards_open_lazily_in_the_reading_process(one_per_shard):
    shard = _shard(one_per_shard, 4)
    with h5py.File(shard, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = dict(f.attrs)
    os.remove(shard)
    with h5py.File(shard, "w") as g:
        for k, v in data.items():
            g.create_dataset(k, data=v, compression="gzip" if k == "image" else None)
        for k, v in attrs.items():
            g.attrs[k] = v
    _drop_chunk_tables(one_per_shard)
    ds = precompile.open(one_per_shard)
    r = DirectReader(ds)
    assert "filtered" in r.fallbacks[(4, "image")]
    assert r._h5 == {}                               # nothing held open from construction
    want = ds.batch([4, 0, 4])["image"]
    np.testing.assert_array_equal(r.read([4, 0, 4])["image"], want)
    first = r._h5[4]
    assert first.id.valid
    r._pid = -1                                      # as if this reader had been inherited by a forked child
    np.testing.assert_array_equal(r.read([4])["image"], want[:1])
    assert r._h5[4] is not first and r._pid == os.getpid()
    second = r._h5[4]
    first.close()
    r.close()
    assert not second.id.valid and r._h5 == {}       # close() closes the files this process opened
    ds.close()


def test_in_memory_reader_copies_mapped_and_fallback_shards(one_per_shard):
    shard = _shard(one_per_shard, 4)
    with h5py.File(shard, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = dict(f.attrs)
    os.remove(shard)
    with h5py.File(shard, "w") as g:   # one shard compressed: served by h5py, then copied like the rest
        for k, v in data.items():
            g.create_dataset(k, data=v, compression="gzip" if k == "image" else None)
        for k, v in attrs.items():
            g.attrs[k] = v
    _drop_chunk_tables(one_per_shard)
    ds = precompile.open(one_per_shard)
    want = ds.batch(range(len(ds)))
    r = DirectReader(ds, in_memory=True)
    assert "filtered" in r.fallbacks[(4, "image")] and r._maps == {} and r.region is None
    idx = np.array([9, 4, 0, 4, 7, 1])
    for f in ("image", "label"):
        np.testing.assert_array_equal(r.read(idx)[f], want[f][idx])
        np.testing.assert_array_equal(r.read(np.arange(len(ds)))[f], want[f])
    r.close()
    with pytest.raises(PrecompileError, match="reader is closed"):
        r.read([0])
    ds.close()


def test_pool_reuses_only_released_buffers():
    pool = HostPool(limit=4)
    a = pool.get((3, 4), np.uint8)
    t = torch.from_numpy(a)[1:]          # a view keeps the ndarray alive
    del a
    b = pool.get((3, 4), np.uint8)
    assert b.ctypes.data != t.data_ptr() - 4  # still held: a fresh buffer
    del t
    c = pool.get((3, 4), np.uint8)
    assert c is pool.held((3, 4), np.uint8)[0]  # released: reused
    del b, c


def test_kept_batches_stay_intact_and_dropped_ones_are_recycled(image_recipe_file, tmp_path):
    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    loader = precompile.Loader(ds, batch_size=2, shuffle=True, seed=1, device="cpu", dtype="float32",
                               num_threads=0)
    kept = [{k: v.clone() for k, v in b.items()} | {"raw": b} for b in loader]   # hold every batch
    idx = loader.batch_indices(0)
    for b, i in zip(kept, idx):
        ref = ds.batch(i)
        np.testing.assert_allclose(b["raw"]["image"].numpy(), ref["image"] / 255, rtol=1e-6)
        np.testing.assert_array_equal(b["raw"]["image"].numpy(), b["image"].numpy())
    del kept
    ptrs = set()
    for e in range(4):                    # the consumer drops each batch: a few buffers go round
        loader.set_epoch(e)
        for b in loader:
            ptrs.add(b["image"].untyped_storage().data_ptr())
    assert len(ptrs) <= 2


def test_gather_buffers_start_on_a_page(built, ds):
    # a copy whose destination sits 1-31 bytes past its source (mod 4 KiB) runs at a quarter to half speed on
    # x86 (bench_mapped.py); mapped rows start on a page, so every buffer a gather fills starts on one too
    page = mmap.PAGESIZE
    pool = HostPool()
    for shape, dtype in (((256, 64, 64, 3), np.uint8), ((7, 5), np.float32), ((3,), np.int64), ((0, 4), np.uint8)):
        a = pool.get(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % page == 0
    for in_memory in (False, True):
        loader = Loader(built, batch_size=16, shuffle=True, seed=0, device="cpu", in_memory=in_memory)
        b = next(iter(loader))
        assert b["image"].data_ptr() % page == 0 and b["label"].data_ptr() % page == 0
        assert all(v[0].ctypes.data % page == 0 for v in loader.reader._views.values()) if in_memory else True
        rows = loader.reader.read([5, 2, 90])
        assert rows["image"].ctypes.data % page == 0
        np.testing.assert_array_equal(rows["image"], ds.batch([5, 2, 90])["image"])
        loader.close()


@pytest.mark.parametrize("views", ["per residue", "strided"])
def test_large_rows_in_many_alignments_are_taken_from_views(tmp_path, image_tree, monkeypatch, views):
    # 148x148x3 rows (65,712 bytes) in chunks of 2: 4 KiB aligned chunks land at many residues of the row
    # size; rows this large keep a view (one np.take) per residue, smaller ones one strided fancy index
    if views == "strided":
        monkeypatch.setattr(view_tables, "VIEW_ALL_BYTES", 1 << 62)
    r = image_recipe(image_tree, steps=[{"resize": {"size": [148, 148]}}],
                     output={"format": "hdf5", "samples_per_shard": 5, "chunk_samples": 2})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    big = precompile.open(tmp_path / "out" / "imgs.h5")
    loader = Loader(big, batch_size=4, shuffle=True, seed=2, device="cpu", num_threads=2)
    takeable = loader.reader._takeable["image"]
    if views == "per residue":
        assert len(takeable) > view_tables.MAX_VIEWS and all(takeable)
    else:
        assert takeable == [False]
    for e in range(2):
        _assert_same_as_dataset(loader, big, epoch=e)
    loader.close()
    big.close()


@pytest.fixture
def piece_ds(tmp_path, image_tree):
    # 16x16x3 rows (768 bytes = 3 pieces of 256) in chunks of 3 samples: 4 KiB aligned chunks fall at three
    # residues of the row size (three views), but every row address is a multiple of 256
    r = image_recipe(image_tree, steps=[{"resize": {"size": [16, 16]}}],
                     output={"format": "hdf5", "samples_per_shard": 6, "chunk_samples": 3})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    yield ds
    ds.close()


def _count_takes(monkeypatch) -> list[int]:
    """Count the gathers' np.take calls (those with an ``out``) from now on; returns the list it appends to."""
    calls: list[int] = []
    real = np.take

    def take(a, indices, *args, **kw):
        if kw.get("out") is not None:
            calls.append(int(np.size(indices)))
        return real(a, indices, *args, **kw)
    monkeypatch.setattr(np, "take", take)
    return calls


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_gather_is_one_take_per_field_whatever_the_views(piece_ds, monkeypatch, in_memory):
    # issue 33: a batch's rows are copied in ONE np.take per field (numpy holds no interpreter lock from its first
    # row to its last), whatever the shards, chunk alignments and order; the views needed one take per view
    r = DirectReader(piece_ds, in_memory=in_memory)
    if r.region is None and not in_memory:
        pytest.skip("no MAP_FIXED through ctypes on this platform: one map per shard, gathered by views")
    assert in_memory or len(r._views["image"]) == 3            # three alignments, three views
    calls = _count_takes(monkeypatch)
    rng = np.random.default_rng(0)
    for size in (1, 7, 40):
        idx = rng.choice(len(piece_ds), size=size, replace=True)
        for order in (idx, r.order_batch(idx)):        # scattered and gather-ordered batches
            calls.clear()
            got = r.read(order)
            want = piece_ds.batch(order)
            for f in ("image", "label"):
                np.testing.assert_array_equal(got[f], want[f])
            assert len(calls) == 2, calls                          # one per field
    r.close()


def test_split_ranges_are_one_take_each(piece_ds, monkeypatch):
    # a task cut into ranges across threads: each range of each field is one np.take, and the batches are the
    # dataset's bytes
    monkeypatch.setattr(feed, "SPLIT_BYTES", 1)
    monkeypatch.setattr(feed, "GROUP_BYTES", 1)         # a task per batch
    loader = Loader(piece_ds, batch_size=4, shuffle=True, seed=5, device="cpu", prefetch=1, num_threads=2)
    calls = _count_takes(monkeypatch)
    n = _assert_same_as_dataset(loader, piece_ds, epoch=1)
    # every task (one batch) in 2 ranges (1 for a batch of one row), 2 fields
    sizes = [len(b) for b in loader.batch_indices(1)]
    assert len(calls) == sum(2 * min(2, s) for s in sizes) and n == len(sizes)
    loader.close()


def test_piece_tables_follow_the_row_addresses():
    # field_pieces: the largest factor the row size shares with every served row's address in the range, or
    # None (the views serve the field) below MIN_PIECE_BYTES (MIN_PIECE_BYTES_LARGE for rows of 64 KiB or more)
    from precompile.reader.rows import _FieldRows

    arr = np.arange(1 << 20, dtype=np.int64).astype(np.uint8)
    offsets = np.array([0, 3, 5])                       # two shards of 3 and 2 rows, shard 1 at byte 8192

    def pieces(rb, addr, served=(True, True)):
        rows = _FieldRows(np.array(served), np.ones(2, np.int64), np.array(addr, np.int64))
        return view_tables.field_pieces(arr, np.array([0, 8192]), rows, offsets, rb)

    p = pieces(12288, [0, 12288, 24576, 0, 12288])      # 64x64x3 rows in 4 KiB aligned chunks
    assert p.view.shape[1] == 4096 and p.count == 3
    np.testing.assert_array_equal(p.first, [0, 3, 6, 2, 5])
    out = np.empty((2, 12288), np.uint8)
    p.take(p.first[[4, 0]], out)
    np.testing.assert_array_equal(out, [arr[8192 + 12288:][:12288], arr[:12288]])
    p = pieces(192, [0, 192, 4096, 0, 192])                # 8x8x3: pieces of 64 bytes
    assert p.view.shape[1] == 64 and p.count == 3
    assert pieces(2700, [0, 2700, 8192, 0, 2700]) is None          # 30x30x3: a factor of 4
    assert pieces(784, [0, 784, 4096, 0, 784]) is None             # 28x28: 16
    assert pieces(69312, [0, 69312, 4096 * 20, 0, 69312]) is None  # 152x152x3: 64, a large row
    p = pieces(8, [0, 8, 16, 4096, 4104])                          # int64 labels: whole rows
    assert p.view.shape[1] == 8 and p.count == 1
    p = pieces(192, [0, 192, 4096, 3, 5], served=(True, False))    # shard 1 served by h5py: not in the table
    np.testing.assert_array_equal(p.first, [0, 3, 64, -1, -1])


# -- issue 33: every layout the Loader reads, gathered byte for byte -------------------------------------------------

#: (kind, per-sample shape, dtype) of the fields of the layout store: rows of pieces of 256 bytes (16x16x3 uint8),
#: odd rows (5x7x3 uint8, 105 bytes: views), a float32 row of 64 KiB (pieces) and one just over it with no large
#: factor (130x130 float32, 67,600 bytes: views), int16 (128 bytes), float16 triples (6 bytes: views), int64
#: labels (whole-row pieces) and ragged boxes (padded by the Loader, not gathered)
LAYOUT_FIELDS = {"image": ("image", (16, 16, 3), "uint8"), "odd": ("image", (5, 7, 3), "uint8"),
                 "big": ("target", (128, 128), "float32"), "bigodd": ("target", (130, 130), "float32"),
                 "i16": ("target", (8, 8), "int16"), "half": ("target", (3,), "float16"),
                 "label": ("label", (), "int64"), "boxes": ("boxes", (None, 4), "float32")}
LAYOUT_N = 29


#: samples a chunk: the writer aligns objects of 4 KiB or more to 4 KiB (image, i16: pieces of 256 and 128 bytes),
#: smaller chunks (label, half) lie where HDF5 puts them
LAYOUT_CHUNKS = {"image": 6, "odd": 6, "big": 1, "bigodd": 1, "i16": 32, "half": 3, "label": 3, "boxes": 3}


def _layout_store(out_dir: str, cuts: list[int]) -> str:
    """A build of LAYOUT_FIELDS written through the project's HDF5 writer: shards ``cuts`` (an empty one where two
    cuts agree), LAYOUT_CHUNKS samples a chunk; every sample's values are random bytes (NaN payloads included)."""
    from precompile.formats import names as fmt
    from precompile.formats.hdf5 import Hdf5Format
    from precompile.sample import FieldSpec, Sample

    rng = np.random.default_rng(33)
    specs = {f: FieldSpec(k, s, d) for f, (k, s, d) in LAYOUT_FIELDS.items()}
    samples = []
    for i in range(LAYOUT_N):
        fields = {}
        for f, (k, s, d) in LAYOUT_FIELDS.items():
            shape = (int(rng.integers(0, 4)), 4) if None in s else s
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(d).itemsize
            fields[f] = np.frombuffer(rng.bytes(nbytes), dtype=d).reshape(shape).copy()
        fields["boxes"] = np.sort(rng.random((len(fields["boxes"]), 4), dtype=np.float32), axis=1)
        samples.append(Sample(key=f"{i:04d}", fields=fields, kinds={f: k for f, (k, _, _) in LAYOUT_FIELDS.items()}))
    w = Hdf5Format()
    sdir = os.path.join(out_dir, fmt.shard_dir_name("lay"))
    os.makedirs(sdir)
    shards = []
    for si, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        name = fmt.shard_file_name(si)
        sw = w.open_shard(os.path.join(sdir, name), specs, f"lay-{si}", None, LAYOUT_CHUNKS)
        for smp in samples[lo:hi]:
            sw.add(smp)
        info = sw.close()
        shards.append({"file": f"{fmt.shard_dir_name('lay')}/{name}", "num_samples": info["num_samples"],
                       "key": f"lay-{si}", "checksums": info["checksums"], "bytes": info["bytes"]})
    index = os.path.join(out_dir, "lay.h5")
    attrs = {fmt.A_FORMAT: fmt.FORMAT_NAME, fmt.A_VERSION: fmt.FORMAT_VERSION, fmt.A_OUTPUT: "hdf5",
             fmt.A_FIELDS: {f: s.to_json() for f, s in specs.items()}, fmt.A_LABELS: [], fmt.A_RECIPE: {},
             fmt.A_SEED: 0, fmt.A_COPIES: 0, fmt.A_SHARDS: shards}
    w.finalize(index, shards, specs, attrs)
    return index


FIXED = [f for f, (_, s, _) in LAYOUT_FIELDS.items() if None not in s]


def _assert_rows_are_the_datasets(got: dict, truth: dict, idx, fields) -> None:
    """``got[f][j]`` is ``truth[f][idx[j]]`` (``ds[idx[j]][f]``) byte for byte (NaN payloads too), every field."""
    for f in fields:
        want = truth[f][np.asarray(idx, dtype=np.int64)]
        assert got[f].dtype == want.dtype and got[f].shape == want.shape, f
        assert got[f].tobytes() == want.tobytes(), f


LAYOUTS = {"shards": [0, 7, 13, 20, LAYOUT_N], "one shard": [0, LAYOUT_N], "an empty shard": [0, 7, 7, 20, LAYOUT_N],
           "no chunk tables": [0, 7, 13, 20, LAYOUT_N], "a gzip shard": [0, 7, 13, 20, LAYOUT_N]}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_store(request, tmp_path_factory) -> tuple[str, str, dict]:
    """(layout, index, truth): a build of LAYOUT_FIELDS in that layout, and per field every row as
    ``precompile.open(index)[i]`` gives it (the boxes: a list of arrays)."""
    layout = request.param
    index = _layout_store(str(tmp_path_factory.mktemp("layout")), LAYOUTS[layout])
    if layout == "no chunk tables":
        _drop_chunk_tables(index)
    if layout == "a gzip shard":
        _gzip_shard(index, 1)
    ds = precompile.open(index)
    rows = [ds[i] for i in range(LAYOUT_N)]
    ds.close()
    truth = {f: np.stack([r[f] for r in rows]) for f in FIXED}
    truth["boxes"] = [r["boxes"] for r in rows]
    return layout, index, truth


@pytest.mark.parametrize("mode", ["mapped", "lazy", "per-shard maps", "in_memory"])
def test_every_layout_gathers_the_datasets_bytes(layout_store, monkeypatch, mode):
    # DirectReader.read over shuffled, sorted, repeated, shard-crossing, one-row and empty batches is ds[i] byte for
    # byte, for every field that takes pieces (image, big, i16; label where HDF5 put its chunks on 8 bytes) and
    # every one that keeps the views (odd, bigodd, half), from mapped files (one region; lazily mapped; one map
    # per shard), in memory, with h5py-served shards beside mapped ones
    layout, index, truth = layout_store
    monkeypatch.setattr(direct, "USE_REGION", mode != "per-shard maps")
    ds = precompile.open(index)
    r = DirectReader(ds, FIXED, in_memory=mode == "in_memory", lazy=mode == "lazy")
    if layout == "a gzip shard":
        assert {s for s, _ in r.fallbacks} == {1}
    if r.region is not None:       # which fields take pieces: the rows' sizes and addresses decide
        pieces = {f: r._pieces[f].count for f in FIXED if r._pieces[f] is not None}
        assert pieces.keys() >= {"image", "big", "i16"} and pieces["image"] > 1 and "odd" not in pieces, pieces
        assert "bigodd" not in pieces, pieces
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, LAYOUT_N, 40), rng.permutation(LAYOUT_N), np.arange(LAYOUT_N), np.array([5]),
               np.array([6, 7, 7, 6, 19, 20, 28, 0]), np.array([], np.int64)]
    for idx in batches:
        for order in (idx, r.order_batch(idx)):
            _assert_rows_are_the_datasets(r.read(order), truth, order, FIXED)
    r.close()
    ds.close()


def _gzip_shard(index: str, s: int) -> None:
    """Rewrite shard ``s``'s fixed-shape datasets with gzip chunks (the Loader reads them through h5py) and drop the
    index's chunk tables, which no longer match."""
    from precompile.formats import names as fmt

    with h5py.File(os.path.join(os.path.dirname(index), "lay.shards", fmt.shard_file_name(s)), "r+") as f:
        for k in FIXED:
            data, chunks, attrs = f[k][()], f[k].chunks, dict(f[k].attrs)
            del f[k]
            d = f.create_dataset(k, data=data, chunks=chunks, maxshape=(None, *data.shape[1:]), compression="gzip")
            d.attrs.update(attrs)
    _drop_chunk_tables(index)


@pytest.mark.parametrize("layout_store", ["a gzip shard"], indirect=True)
@pytest.mark.parametrize("in_memory", [False, True])
def test_loader_batches_over_every_field_kind_are_the_datasets(layout_store, monkeypatch, in_memory):
    # the Loader, its tasks split across 2 threads, with a gzip shard, ragged boxes beside the gathered fields:
    # each batch is ds[i] byte for byte (boxes: the sample's rows, then padding)
    _, index, truth = layout_store
    monkeypatch.setattr(feed, "SPLIT_BYTES", 1)
    ds = precompile.open(index)
    loader = Loader(ds, batch_size=6, shuffle=True, seed=4, device="cpu", prefetch=1, num_threads=2,
                    in_memory=in_memory)
    n = 0
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for b, idx in zip(loader, loader.batch_indices(), strict=True):
            _assert_rows_are_the_datasets({f: b[f].numpy() for f in FIXED}, truth, idx, FIXED)
            for j, i in enumerate(idx):
                want = truth["boxes"][int(i)]
                assert int(b["boxes__count"][j]) == len(want)
                assert b["boxes"][j, :len(want)].numpy().tobytes() == want.tobytes()
            n += 1
    assert n == 2 * 5
    loader.close()
    ds.close()
