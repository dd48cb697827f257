"""Reading a build from a URL (a moto S3 server on 127.0.0.1; the fixture is test_remote's) through the local
cache: the same samples and batches as the local build, downloads checked against the index, eviction within
cache_limit, several processes sharing one cache, and clear errors."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import precompile
from precompile.errors import CacheError, FormatError, PrecompileError
from precompile.recipe import parse_recipe
from precompile.storage.shard_cache import ShardCache, default_cache_dir, parse_size
from loader_cases import _make_inputs
from test_remote import BUCKET, s3, upload_tree  # noqa: F401  (s3: the fixture; skips without s3fs/moto)

torch = pytest.importorskip("torch", reason="torch is not installed (the Loader needs it)")
from precompile.reader.loader import Loader  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PER_SHARD = 8   # 120 samples of 8x8x3: 15 shards of about 10 KB


def build(root: Path, name: str = "t", seed_inputs: bool = True) -> Path:
    """120 samples of 8x8 RGB, 8 per shard, 4 per chunk; returns the index."""
    if seed_inputs:
        _make_inputs(str(root / "in"))
    recipe = parse_recipe({
        "name": name, "seed": 0,
        "inputs": {"root": "in", "match": "{label}/{name}.{ext}", "where": {"ext": "png|jpg"},
                   "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [8, 8]}}],
        "output": {"format": "hdf5", "samples_per_shard": PER_SHARD, "chunk_samples": 4},
    }, base_dir=str(root))
    precompile.build(recipe, out_dir=str(root / "out"))
    return root / "out" / f"{name}.h5"


@pytest.fixture(scope="module")
def remote(s3, tmp_path_factory):  # noqa: F811
    """(index URL, storage_options, local index, boto3 client): the build uploaded under ``read1/``."""
    endpoint, client = s3
    root = tmp_path_factory.mktemp("remote_read")
    index = build(root)
    upload_tree(client, index.parent, "read1")
    return f"s3://{BUCKET}/read1/t.h5", {"endpoint_url": endpoint, "anon": True}, index, client


def entries(index: Path) -> list[dict]:
    return precompile.open(index).shards


def cache_files(cache: Path) -> list[str]:
    return sorted(os.listdir(cache / "files"))


def same_batches(a: Loader, b: Loader, epochs: int = 2) -> int:
    """Every batch of ``epochs`` epochs equal, byte for byte; the number of batches compared."""
    n = 0
    for e in range(epochs):
        a.set_epoch(e)
        b.set_epoch(e)
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (e, n, k)
            n += 1
    return n


def test_open_url_gives_the_local_samples_and_caches_verified_copies(remote, tmp_path):
    url, so, index, _ = remote
    local = precompile.open(index)
    ds = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so)
    assert url in repr(ds) and len(ds) == len(local) == 120
    for i in range(len(ds)):
        assert ds.key(i) == local.key(i) and ds.meta(i) == local.meta(i)
        for f in ("image", "label"):
            np.testing.assert_array_equal(ds[i][f], local[i][f])
    order = [7, 119, 0, 64, 3]
    for f in ("image", "label"):
        np.testing.assert_array_equal(ds.batch(order)[f], local.batch(order)[f])
    shas = {e["sha256"] for e in entries(index)}
    index_sha = hashlib.sha256(index.read_bytes()).hexdigest()
    assert cache_files(tmp_path / "c") == sorted(f"{h}.h5" for h in shas | {index_sha})
    for e in entries(index):   # each copy is the shard's bytes, under the name of its digest
        assert (tmp_path / "c" / "files" / f"{e['sha256']}.h5").read_bytes() == (index.parent / e["file"]).read_bytes()
    before = ds.remote.cache.stats.downloads
    again = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so)
    for i in range(len(again)):
        again[i]
    assert again.remote.cache.stats.downloads == before   # every shard a cache hit
    assert len(ds._held) <= 8   # a dataset keeps at most OPEN_SHARDS shard files open


@pytest.mark.parametrize("kw", [dict(shuffle="full", seed=3), dict(shuffle="block", seed=1),
                                dict(shuffle="shard", seed=2, block_window=2), dict(shuffle=False),
                                dict(shuffle="full", seed=5, rank=1, world_size=3),
                                dict(shuffle="block", seed=4, rank=0, world_size=2, uneven="drop", drop_last=True),
                                dict(shuffle="full", seed=6, in_memory=True)],
                         ids=["full", "block", "shard", "sequential", "rank1of3", "rank0of2", "in_memory"])
def test_loader_from_url_gives_the_local_batches(remote, tmp_path, kw):
    url, so, index, _ = remote
    a = Loader(str(index), batch_size=12, device="cpu", **kw)
    b = Loader(url, batch_size=12, device="cpu", cache_dir=tmp_path / "c", storage_options=so, **kw)
    assert same_batches(a, b) == 2 * len(a)
    if kw.get("in_memory"):
        assert b.reader.streaming is None and b.window is None
    a.close()
    b.close()


def test_in_memory_loads_a_build_larger_than_the_cache(remote, tmp_path):
    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    limit = index.stat().st_size + 2 * max(sizes)
    b = Loader(url, batch_size=16, device="cpu", shuffle="full", in_memory=True, cache_dir=tmp_path / "c",
               cache_limit=limit, storage_options=so)
    a = Loader(str(index), batch_size=16, device="cpu", shuffle="full")
    assert sum(sizes) > limit and same_batches(a, b, epochs=1) == len(a)
    assert ShardCache(tmp_path / "c").usage() <= limit


def deleted_cache_maps(cache: Path) -> list[str]:
    """Files of the cache that this process maps although they were unlinked (blocks the limit cannot see)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    return [ln for ln in maps.read_text().splitlines() if str(cache) in ln and ln.endswith("(deleted)")]


def test_a_cache_smaller_than_the_build_streams_within_its_limit(remote, tmp_path):
    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    limit = index.stat().st_size + 4 * max(sizes)
    assert sum(sizes) > limit + 4 * max(sizes)
    cache = tmp_path / "c"
    a = Loader(str(index), batch_size=8, device="cpu", shuffle="shard", block_window=1, seed=9)
    b = Loader(url, batch_size=8, device="cpu", shuffle="shard", block_window=1, seed=9, cache_dir=cache,
               cache_limit=limit, storage_options=so, prefetch=1, fetch_ahead=max(sizes))
    stats = b.ds.remote.cache.stats
    first = stats.downloads
    peak = 0
    for e in range(2):
        a.set_epoch(e)
        b.set_epoch(e)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
            peak = max(peak, ShardCache(cache).usage())
            assert not deleted_cache_maps(cache)
    assert peak <= limit
    # one stretch per shard and epoch: each shard fetched at most once per epoch (a shard still cached when the
    # next epoch starts with it is a hit), the least recently used evicted to make room
    assert 2 * len(sizes) - 4 <= stats.downloads - first <= 2 * len(sizes)
    assert stats.evictions >= stats.downloads - first - 4
    b.close()


def test_limits_are_clear_errors_at_construction(remote, tmp_path):
    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    with pytest.raises(CacheError, match=rf"{url}: the index is .* \({index.stat().st_size} bytes\), more than "
                                         rf"cache_limit 1000 B \(1000 bytes\) of {tmp_path / 'c'}: raise cache_limit"):
        precompile.open(url, cache_dir=tmp_path / "c", cache_limit=1000, storage_options=so)
    with pytest.raises(CacheError, match=rf"s3://x/y.h5: the shard is .* \({max(sizes)} bytes\), more than "
                                         rf"cache_limit .* \(1000 bytes\) of .*: raise cache_limit above the largest"):
        ShardCache(tmp_path / "c", 1000).open("ab" * 32, max(sizes), "s3://x/y.h5", lambda start, end: b"")
    limit = index.stat().st_size + 4 * max(sizes)   # the index fits; four shards beside it, not a full shuffle's
    with pytest.raises(CacheError, match=r"the batches in flight at once .* read .* of shards, plus the index .* that "
                                         rf"the reader holds: more than cache_limit .* \({limit} bytes\): a full "
                                         r"shuffle reads from nearly every shard"):
        Loader(url, batch_size=32, device="cpu", shuffle="full", cache_dir=tmp_path / "c", cache_limit=limit,
               storage_options=so)
    with pytest.raises(CacheError, match=r"map_shards='all' holds every shard in the cache"):
        Loader(url, batch_size=8, device="cpu", map_shards="all", cache_dir=tmp_path / "c", cache_limit=limit,
               storage_options=so)
    with pytest.raises(ValueError, match=r"cache_limit must be a number of bytes >= 1 or a size such as '20GiB'"):
        precompile.open(url, cache_dir=tmp_path / "c", cache_limit="lots", storage_options=so)
    with pytest.raises(ValueError, match="cache_dir, cache_limit and storage_options apply to a build read from a URL"):
        precompile.open(index, cache_limit="1GiB")
    with pytest.raises(ValueError, match="fetch_ahead applies to a build read from a URL"):
        Loader(str(index), batch_size=8, device="cpu", fetch_ahead="1MiB")


def test_limit_checks_count_the_index_the_reader_holds(remote, tmp_path, monkeypatch):
    """Every shard fits the limit, the shards and the index a reader pins while open do not: a clear error when
    the reader is made (it waited, then failed 'the cache is full' in the middle of an epoch)."""
    import precompile.storage.cache_room as sc

    monkeypatch.setattr(sc, "WAIT_S", 0.3)
    url, so, index, _ = remote
    sizes, isz = [e["bytes"] for e in entries(index)], index.stat().st_size
    limit = sum(sizes) + isz // 2
    kw = dict(cache_dir=tmp_path / "c", cache_limit=limit, storage_options=so)
    with pytest.raises(CacheError, match=rf"{url}: the batches in flight at once .* read .* \({sum(sizes)} bytes\) "
                                         rf"of shards, plus the index .* \({isz} bytes\) that the reader holds: more "
                                         rf"than cache_limit .* \({limit} bytes\): a full shuffle .* set cache_limit "
                                         rf"above the build's size, .* \({sum(sizes) + isz} bytes\)"):
        Loader(url, batch_size=32, device="cpu", shuffle="full", **kw)
    with pytest.raises(CacheError, match=rf"{url}: map_shards='all' holds every shard in the cache, .* "
                                         rf"\({sum(sizes)} bytes\), plus the index .* \({isz} bytes\) that the reader "
                                         rf"holds; cache_limit is .* \({limit} bytes\): raise cache_limit"):
        Loader(url, batch_size=8, device="cpu", map_shards="all", **kw)
    big = int(np.argmax(sizes))
    small = isz + sizes[big] - 1
    with pytest.raises(CacheError, match=rf"s3://{BUCKET}/read1/{entries(index)[big]['file']}: the shard is .* "
                                         rf"\({sizes[big]} bytes\), plus the index .* \({isz} bytes\) that the reader "
                                         rf"holds: more than cache_limit .* \({small} bytes\) of .*: raise cache_limit "
                                         rf"to at least .* \({isz + max(sizes)} bytes\)"):
        precompile.open(url, cache_dir=tmp_path / "c", cache_limit=small, storage_options=so)


def test_a_dataset_lets_go_of_its_own_shards_when_the_cache_is_full(remote, tmp_path, monkeypatch):
    """A dataset keeps up to 8 shards open; when the cache has no room for the next one, it closes its own least
    recently used ones first (it waited for other processes, then failed 'the cache is full')."""
    import precompile.storage.cache_room as sc

    monkeypatch.setattr(sc, "WAIT_S", 0.3)
    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    limit = index.stat().st_size + 3 * max(sizes)   # the index and three shards
    local = precompile.open(index)
    ds = precompile.open(url, cache_dir=tmp_path / "c", cache_limit=limit, storage_options=so)
    for i in [*range(0, len(ds), PER_SHARD), 5, 119, 64]:
        np.testing.assert_array_equal(ds[i]["image"], local[i]["image"])
        assert ShardCache(tmp_path / "c").usage() <= limit
    assert len(ds._held) <= 3 and list(ds._held)[-1] == 8 and ds.remote.cache.stats.evictions >= len(sizes) - 3
    np.testing.assert_array_equal(ds.batch([118, 3, 70, 9])["image"], local.batch([118, 3, 70, 9])["image"])


def test_parse_size_and_default_folder(monkeypatch):
    assert parse_size(123) == 123 and parse_size("20GiB") == 20 << 30 and parse_size("1.5 KB") == 1500
    assert parse_size("2mib") == 2 << 20 and parse_size(" 7 ") == 7
    for bad in ("0", "-1", "1 XB", True, 2.5, None):
        with pytest.raises(ValueError, match="must be a number of bytes >= 1"):
            parse_size(bad)
    monkeypatch.setenv("PRECOMPILE_CACHE", "/some/where")
    assert default_cache_dir() == "/some/where"
    monkeypatch.delenv("PRECOMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert default_cache_dir() == "/xdg/precompile"


def test_a_damaged_object_is_refused_and_nothing_is_kept(remote, tmp_path):
    url, so, index, client = remote
    upload_tree(client, index.parent, "read2")
    e = entries(index)[3]
    data = bytearray((index.parent / e["file"]).read_bytes())
    data[-100] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=f"read2/{e['file']}", Body=bytes(data), ACL="public-read")
    bad = hashlib.sha256(bytes(data)).hexdigest()
    ds = precompile.open(f"s3://{BUCKET}/read2/t.h5", cache_dir=tmp_path / "c", storage_options=so)
    ds[0]
    with pytest.raises(FormatError, match=rf"s3://{BUCKET}/read2/{e['file']}: read {len(data)} bytes with sha256 "
                                          rf"{bad}; the index s3://{BUCKET}/read2/t.h5 records {e['bytes']} bytes "
                                          rf"with sha256 {e['sha256']}: the object is damaged"):
        ds[3 * PER_SHARD]
    names = cache_files(tmp_path / "c")
    assert f"{e['sha256']}.h5" not in names and not [n for n in names if n.endswith(".part")]
    client.put_object(Bucket=BUCKET, Key=f"read2/{e['file']}", Body=bytes(data[:-1]), ACL="public-read")
    with pytest.raises(FormatError, match=rf"read {len(data) - 1} bytes with sha256 \w+; the index .* records "
                                          rf"{e['bytes']} bytes"):
        ds[3 * PER_SHARD]


def test_a_cached_copy_is_rehashed_by_verify(remote, tmp_path):
    url, so, index, _ = remote
    ds = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so)
    want = ds[0]["image"].copy()
    ds.close()
    e = entries(index)[0]
    path = tmp_path / "c" / "files" / f"{e['sha256']}.h5"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so, verify=True)
    assert not path.exists()   # damaged: removed, fetched again when read
    np.testing.assert_array_equal(ds[0]["image"], want)
    assert path.read_bytes() == (index.parent / e["file"]).read_bytes()
    assert ds.verify_cached() == {"intact": 1, "damaged": 0, "absent": len(entries(index)) - 1}


def test_a_replaced_build_is_seen_by_the_next_open(remote, tmp_path):
    url, so, index, client = remote
    root = tmp_path / "b"
    build(root)
    upload_tree(client, root / "out", "read3")
    u = f"s3://{BUCKET}/read3/t.h5"
    old = precompile.open(u, cache_dir=tmp_path / "c", storage_options=so)
    old[0]
    # the last input changes: its shard (the last) is rebuilt under a new name, the new index uploaded last
    last = len(old) - 1
    src = root / "in" / old.key(last)
    from PIL import Image

    Image.fromarray(np.full((10, 12, 3), 7, np.uint8)).save(src)
    before = {e["file"] for e in entries(root / "out" / "t.h5")}
    build(root, seed_inputs=False)
    new_entries = entries(root / "out" / "t.h5")
    assert [i for i, e in enumerate(new_entries) if e["file"] not in before] == [len(new_entries) - 1]
    upload_tree(client, root / "out", "read3")
    stats = old.remote.cache.stats
    n0, cached = stats.downloads, set(cache_files(tmp_path / "c"))
    new = precompile.open(u, cache_dir=tmp_path / "c", storage_options=so)
    local = precompile.open(root / "out" / "t.h5")
    for i in range(len(new)):
        np.testing.assert_array_equal(new[i]["image"], local[i]["image"])
    # unchanged shards keep their names and digests: the one cached already is a hit
    assert f"{new_entries[0]['sha256']}.h5" in cached
    assert stats.downloads - n0 == len([e for e in new_entries if f"{e['sha256']}.h5" not in cached])
    assert (new[last]["image"] != old[last]["image"]).any()   # the old dataset still reads its own snapshot
    np.testing.assert_array_equal(new[last]["image"], local[last]["image"])


def test_missing_objects_credentials_and_endpoints_are_clear(remote, tmp_path, monkeypatch):
    url, so, index, client = remote
    with pytest.raises(FormatError, match=rf"s3://{BUCKET}/nowhere/t.h5: no such object: build to this URL first"):
        precompile.open(f"s3://{BUCKET}/nowhere/t.h5", cache_dir=tmp_path / "c", storage_options=so)
    upload_tree(client, index.parent, "read4")
    u4 = f"s3://{BUCKET}/read4/t.h5"
    ds = precompile.open(u4, cache_dir=tmp_path / "c2", storage_options=so)
    again = precompile.open(u4, cache_dir=tmp_path / "c2", storage_options=so)
    # a shard object deleted by hand under the same index: not "the build was replaced ... open it again"
    client.delete_object(Bucket=BUCKET, Key=f"read4/{ds.shards[2]['file']}")
    shard = f"s3://{BUCKET}/read4/{ds.shards[2]['file']}"
    missing = (f"{shard}: no such object: {u4} is the index this reader opened, and the index names this shard, but "
               f"there is no such object: it was deleted (not by precompile, which never collects a shard that an "
               f"index names) or never uploaded; see which shards are missing with: precompile verify {u4}; build "
               f"to this URL again to upload them")
    with pytest.raises(FormatError) as e:
        ds[2 * PER_SHARD]
    assert str(e.value) == missing
    loader = Loader(ds, batch_size=PER_SHARD, device="cpu")
    with pytest.raises(FormatError) as e:          # the Loader's reads from a URL fetch through the same source
        for _ in loader:
            pass
    assert str(e.value) == missing
    loader.close()
    # the index replaced since (another build uploaded over it): the snapshot was collected, open it again
    with open(index, "rb") as f:
        client.put_object(Bucket=BUCKET, Key="read4/t.h5", Body=f.read() + b"\0", ACL="public-read")
    with pytest.raises(FormatError) as e:
        again[2 * PER_SHARD]
    assert str(e.value) == (f"{shard}: no such object: the build was replaced and its old snapshot collected "
                            f"since {u4} was opened: open it again (precompile.open, or a new Loader)")
    client.delete_object(Bucket=BUCKET, Key="read4/t.h5")     # and removed altogether
    with pytest.raises(FormatError, match=rf"^{shard}: no such object, nor is there an index at {u4} now: the "
                                          rf"build was removed since it was opened$"):
        again[2 * PER_SHARD + 1]
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(FormatError, match=rf"{url}: no credentials for s3:// \(NoCredentialsError\); set "
                                          r"AWS_ACCESS_KEY_ID"):
        precompile.open(url, cache_dir=tmp_path / "c", storage_options={"endpoint_url": so["endpoint_url"]})
    with pytest.raises(FormatError, match=rf"{url}: bad storage_options for s3://: .*no_such_option"):
        precompile.open(url, cache_dir=tmp_path / "c", storage_options={**so, "no_such_option": 1})
    closed = {"endpoint_url": "http://127.0.0.1:9", "anon": True,
              "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    with pytest.raises(FormatError, match=rf"{url}: cannot read from the store: \w+: .*; check the endpoint"):
        precompile.open(url, cache_dir=tmp_path / "c", storage_options=closed)
    with pytest.raises(FormatError, match=r"a JSON index \(a png, bmp or wav build\); reading from a URL serves "
                                          r"HDF5 builds only"):
        client.put_object(Bucket=BUCKET, Key="read4/x.json", Body=b'{"attrs": {}}', ACL="public-read")
        precompile.open(f"s3://{BUCKET}/read4/x.json", cache_dir=tmp_path / "c", storage_options=so)


@pytest.fixture(scope="module")
def text_build(s3, tmp_path_factory):  # noqa: F811
    """(index URL, storage_options, local index): a build of a target and a text column only, uploaded."""
    endpoint, client = s3
    root = tmp_path_factory.mktemp("text_build")
    (root / "t.jsonl").write_text("".join(json.dumps({"id": f"r{i:03d}", "x": i / 4, "t": "ab" * (i % 7)}) + "\n"
                                          for i in range(40)))
    recipe = parse_recipe({"name": "c", "inputs": {"root": ".", "table": "t.jsonl", "key": "id", "columns": {
        "x": {"column": "x", "kind": "target"}, "t": {"column": "t", "kind": "text"}}},
        "output": {"format": "hdf5", "samples_per_shard": 8}}, base_dir=str(root))
    precompile.build(recipe, out_dir=str(root / "out"))
    upload_tree(client, root / "out", "text1")
    return f"s3://{BUCKET}/text1/c.h5", {"endpoint_url": endpoint, "anon": True}, root / "out" / "c.h5"


def test_a_loader_that_maps_no_field_reads_from_a_url(remote, text_build, tmp_path):
    """fields=[] or only text fields: nothing to map, so no address range to reserve (it failed 'this platform
    does not allow' naming the cached index)."""
    url, so, index = text_build
    kw = dict(batch_size=6, device="cpu", shuffle=True, seed=4)
    for fields in (["t"], []):
        a = Loader(str(index), fields=fields, **kw)
        b = Loader(url, fields=fields, cache_dir=tmp_path / "c", storage_options=so, **kw)
        assert b.reader.streaming is None and b.window is None
        got = list(b)
        assert got == list(a) and len(got) == 7
        assert not fields or [t for batch in got for t in batch["t"]] == [
            precompile.open(index)[int(i)]["t"] for i in np.concatenate(b.batch_indices(0))]
        a.close()
        b.close()
    url, so, index, _ = remote
    b = Loader(url, fields=[], batch_size=8, device="cpu", cache_dir=tmp_path / "c2", storage_options=so)
    assert len(list(b)) == 15 and b.reader.mapped_shards == 0 and b.ds.remote.cache.stats.downloads == 0


def test_closing_a_loader_lets_go_of_everything_it_held_in_the_cache(text_build, tmp_path):
    """Its text fields' dataset (up to 8 shards) and the dataset it opened (the index, ragged fields' shards) were
    left to the garbage collector: another process could not evict them after close()."""
    from test_shard_cache import evict_from_another_process

    url, so, index = text_build
    ld = Loader(url, batch_size=6, device="cpu", shuffle=False, cache_dir=tmp_path / "c", storage_options=so)
    assert [t for b in ld for t in b["t"]] == [precompile.open(index)[i]["t"] for i in range(40)]
    used = ShardCache(tmp_path / "c").usage()
    assert evict_from_another_process(tmp_path / "c", used, used) == "no room"
    ds = ld.ds
    ld.close()
    assert evict_from_another_process(tmp_path / "c", used, used) == "evicted"
    with pytest.raises(PrecompileError, match=rf"^{url}: the dataset was released when the Loader that opened it "
                                              r"closed: open the build again"):
        ds[0]
    mine = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so)
    Loader(mine, batch_size=6, device="cpu").close()   # a dataset given to a Loader stays the caller's
    assert mine[39]["t"] == "ab" * (39 % 7)


def test_reader_messages_name_the_url(remote, tmp_path):
    url, so, index, client = remote
    b = Loader(url, batch_size=8, device="cpu", cache_dir=tmp_path / "c", storage_options=so)
    next(iter(b))
    b.close()
    with pytest.raises(PrecompileError, match=rf"^{url}: reader is closed \(open a new Loader to read again\)"):
        next(iter(b))
    # the index's chunk table points past shard 0's end: the message names the URL, the shard and the field
    bad = tmp_path / "bad"
    shutil.copytree(index.parent, bad)
    first_label_chunk = entries(index)[0]["chunks"]["image"][1]
    with h5py.File(bad / "t.h5", "r+") as f:
        f["__chunks__"][first_label_chunk, 0] = 10 ** 9
    upload_tree(client, bad, "read6")
    u = f"s3://{BUCKET}/read6/t.h5"
    with pytest.raises(FormatError, match=rf"^{u}: the index is damaged: the crc32 of its chunk tables "
                                          r"\(__chunks__\) is not the one the build recorded"):
        Loader(u, batch_size=8, device="cpu", cache_dir=tmp_path / "c", storage_options=so)
    with h5py.File(bad / "t.h5", "r+") as f:   # as a tool that changed it would: no checksums, the table's checks
        del f.attrs["index_crc32"]
    upload_tree(client, bad, "read6")
    with pytest.raises(FormatError, match=rf"^{u}: shard {entries(index)[0]['file']}, field 'label': the index's "
                                          r"chunk table points outside the shard's \d+ bytes"):
        Loader(u, batch_size=8, device="cpu", cache_dir=tmp_path / "c", storage_options=so)
    # a cached copy removed behind the reader's back (its pin stops precompile, not rm): URL and cache folder named
    ld = Loader(url, batch_size=8, device="cpu", shuffle=False, cache_dir=tmp_path / "c2", storage_options=so)
    pin = ld.ds.remote.pin

    def pin_then_lose(s: int, *args: object, **kw: object) -> str:
        path = pin(s, *args, **kw)
        # (two gather threads may pin the shard at once: the second finds it already removed)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return path

    ld.ds.remote.pin = pin_then_lose
    with pytest.raises(FormatError, match=rf"^s3://{BUCKET}/read1/{entries(index)[0]['file']}: its verified copy "
                                          rf"{tmp_path / 'c2' / 'files'}/\w+\.h5 is gone while held open: something "
                                          rf"other than precompile removed it from the cache folder {tmp_path / 'c2'}"):
        next(iter(ld))
    ld.close()


def test_dataloader_workers_share_the_cache(remote, tmp_path):
    url, so, index, _ = remote
    ds = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so)
    local = precompile.open(index)
    dl = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=2, shuffle=False)
    got = torch.cat([b["image"] for b in dl])
    np.testing.assert_array_equal(got.numpy(), local.batch(range(len(local)))["image"])
    shas = {e["sha256"] for e in entries(index)}
    assert shas <= {n[:-3] for n in cache_files(tmp_path / "c")}   # the workers' downloads, in the shared cache


def test_a_forked_child_reads_through_a_loop_of_its_own(remote, tmp_path):
    """fsspec's IO loop runs on a thread of the parent, which a fork does not copy: a child that used the parent's
    loop state would send its requests to a loop nobody runs and wait for ever (fsspec 2024.12 resets nothing at
    a fork; later versions leave its lock). precompile resets both in the child."""
    import multiprocessing
    import queue

    import fsspec.asyn

    url, so, index, _ = remote
    ds = precompile.open(url, cache_dir=tmp_path / "c", storage_options=so)   # the index came through the loop
    fsspec.asyn.get_lock()
    assert fsspec.asyn.loop[0] is not None
    last = len(ds) - 1
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        fresh = (fsspec.asyn.loop[0] is None, fsspec.asyn._lock is None)
        q.put((*fresh, ds[last]["image"].tobytes()))   # a shard nobody fetched yet: a request from the child

    p = ctx.Process(target=child)
    p.start()
    try:
        got = q.get(timeout=60)
    except queue.Empty:
        pytest.fail("the forked child's read did not finish in 60 s")
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    assert got[:2] == (True, True)
    assert got[2] == precompile.open(index)[last]["image"].tobytes()
    assert p.exitcode == 0


READER = r"""
import hashlib, json, os, sys, time
import numpy as np
import precompile
from precompile.storage.shard_cache import ShardCache
url, so, cache, limit, me, out, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    int(sys.argv[5]), sys.argv[6], sys.argv[7]
open(os.path.join(out, f"ready-{me}"), "w").close()
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.01)
h, peak, deleted = hashlib.sha256(), 0, 0
if mode == "dataset":
    ds = precompile.open(url, cache_dir=cache, cache_limit=limit, storage_options=so)
    for i in np.random.default_rng(me).permutation(len(ds)):
        h.update(int(i).to_bytes(4, "little") + ds[int(i)]["image"].tobytes())
    stats = ds.remote.cache.stats
else:
    import precompile.storage.cache_room as sc
    from precompile.reader.loader import Loader
    kw = json.loads(mode)[me]   # this process's Loader options
    sc.WAIT_S = kw.pop("wait_s", sc.WAIT_S)
    ld = Loader(url, device="cpu", seed=me, cache_dir=cache, cache_limit=limit, storage_options=so, **kw)
    for e in range(2):
        ld.set_epoch(e)
        for b in ld:
            h.update(b["image"].numpy().tobytes())
            peak = max(peak, ShardCache(cache).usage())
            deleted += sum(1 for ln in open("/proc/self/maps") if cache in ln and ln.rstrip().endswith("(deleted)"))
    stats = ld.ds.remote.cache.stats
json.dump({"digest": h.hexdigest(), "downloads": stats.downloads, "evictions": stats.evictions, "peak": peak,
           "deleted": deleted}, open(os.path.join(out, f"done-{me}.json"), "w"))
"""


def run_readers(url: str, so: dict, cache: Path, limit: int, n: int, out: Path, mode: str) -> list[dict]:
    """``n`` processes that wait at a barrier, then read the whole build through one cache folder: ``mode``
    "dataset" (``ds[i]`` in a random order), or a JSON list of each process's Loader options (two epochs)."""
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", READER, url, json.dumps(so), str(cache), str(limit), str(i),
                               str(out), mode], env=env) for i in range(n)]
    try:
        deadline = time.monotonic() + 120
        while len(list(out.glob("ready-*"))) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        (out / "go").touch()
        for p in procs:
            assert p.wait(timeout=180) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"done-{i}.json").read_text()) for i in range(n)]


def test_processes_sharing_a_cache_download_each_shard_once(remote, tmp_path):
    url, so, index, _ = remote
    local = precompile.open(index)
    got = run_readers(url, so, tmp_path / "c", 1 << 30, 4, tmp_path / "out", "dataset")
    for i, r in enumerate(got):
        h = hashlib.sha256()
        for j in np.random.default_rng(i).permutation(len(local)):
            h.update(int(j).to_bytes(4, "little") + local[int(j)]["image"].tobytes())
        assert r["digest"] == h.hexdigest()
    assert sum(r["downloads"] for r in got) == len(local.shards)   # asked at once by four: fetched once each


def check_streamed(got: list[dict], index: Path, options: list[dict], limit: int) -> None:
    """Each reader of :func:`run_readers` got the local build's batches, within the limit, mapping no evicted file."""
    for i, (r, kw) in enumerate(zip(got, options)):
        kw = {k: v for k, v in kw.items() if k not in ("fetch_ahead", "wait_s")}
        a = Loader(str(index), device="cpu", seed=i, **kw)
        h = hashlib.sha256()
        for e in range(2):
            a.set_epoch(e)
            for b in a:
                h.update(b["image"].numpy().tobytes())
        assert r["digest"] == h.hexdigest() and r["peak"] <= limit and r["deleted"] == 0
    assert sum(r["evictions"] for r in got) > 0


def test_processes_streaming_through_a_small_cache(remote, tmp_path):
    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    limit = index.stat().st_size + 6 * max(sizes)   # (the index holds each image's map back to the source too)
    assert sum(sizes) > limit
    options = [dict(batch_size=8, shuffle="shard", block_window=1, prefetch=1, fetch_ahead=0)] * 3
    got = run_readers(url, so, tmp_path / "c", limit, 3, tmp_path / "out", json.dumps(options))
    check_streamed(got, index, options, limit)


def test_processes_prefetching_share_a_small_cache(remote, tmp_path):
    """Three Loaders that fetch ahead, in one cache whose limit holds the index and 6 shards. Each holds more than
    a third of it at times (its tasks in flight, what it fetched ahead); a gather that finds no room (or waits for
    another process's download) makes its process let go of what no gather reads now, and a prefetch leaves a
    shard's room free and never waits. Before, prefetched shards stayed pinned while gathers everywhere waited,
    and a process failed 'the cache is full'."""
    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    limit = index.stat().st_size + 6 * max(sizes)
    kw = dict(batch_size=5, block_window=1, prefetch=3, num_threads=2, fetch_ahead=limit // 6, wait_s=20)
    options = [dict(kw, shuffle="shard"), dict(kw, shuffle="shard"), dict(kw, shuffle=False)]
    got = run_readers(url, so, tmp_path / "c", limit, 3, tmp_path / "out", json.dumps(options))
    check_streamed(got, index, options, limit)


HOLDER = r"""
import json, sys, time
import precompile
ds = precompile.open(sys.argv[1], cache_dir=sys.argv[3], storage_options=json.loads(sys.argv[2]))
ds[0]   # shard 0 open: pinned by this process
print("held", flush=True)
time.sleep(120)
"""


def test_a_killed_reader_leaves_no_pins_and_a_dead_download_no_part(remote, tmp_path, monkeypatch):
    url, so, index, _ = remote
    import precompile.storage.cache_room as sc

    monkeypatch.setattr(sc, "WAIT_S", 0.3)
    cache = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, url, json.dumps(so), str(cache)], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        sizes = [e["bytes"] for e in entries(index)]
        limit = index.stat().st_size + sizes[0] + sizes[2] - 1   # the index, shard 0 (held elsewhere), not shard 2
        ds = precompile.open(url, cache_dir=cache, cache_limit=limit, storage_options=so)
        held = index.stat().st_size + sizes[0]
        with pytest.raises(CacheError, match=rf"the cache {cache} is full: .*shard-00002-\w+.h5 needs .* \({sizes[2]} "
                                             rf"bytes\), cache_limit is .* \({limit} bytes\), and .* \({held} "
                                             rf"bytes\) of it are files open or mapped by readers .* after waiting "
                                             rf"0.3 s"):
            ds[2 * PER_SHARD]   # the index is held here (no shard of its own to let go), shard 0 by the other
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    # the kernel dropped the killed process's locks: shard 0 can go now; a download left half done by a dead
    # process (no one holds its lock) is removed by the next download
    stale = cache / "files" / ("f" * 64 + ".part")
    stale.write_bytes(b"x" * 100)
    np.testing.assert_array_equal(ds[2 * PER_SHARD]["image"], precompile.open(index)[2 * PER_SHARD]["image"])
    assert not stale.exists() and ShardCache(cache).usage() <= limit


def test_inspect_a_url_with_the_stores_environment(remote, tmp_path):
    from click.testing import CliRunner

    from precompile.cli import main

    url, so, index, _ = remote
    env = {"PRECOMPILE_CACHE": str(tmp_path / "c"), "AWS_ENDPOINT_URL": so["endpoint_url"],
           "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    got = CliRunner(env=env).invoke(main, ["inspect", url])
    assert got.exit_code == 0, got.output
    want = CliRunner().invoke(main, ["inspect", str(index)]).output
    assert got.output.split("\n", 1)[1] == want.split("\n", 1)[1] and got.output.startswith(url)
    assert (tmp_path / "c" / "files").is_dir()


def test_the_resident_upload_streams_through_a_small_cache(remote, tmp_path):
    from precompile.reader.resident import ResidentFeeder

    url, so, index, _ = remote
    sizes = [e["bytes"] for e in entries(index)]
    limit = index.stat().st_size + 3 * max(sizes)
    kw = dict(batch_size=8, device="cpu", shuffle=False, prefetch=1)
    got = Loader(url, cache_dir=tmp_path / "c", cache_limit=limit, storage_options=so, **kw)
    got.window = None   # as in_memory="gpu" makes it, with the device's tensors on the CPU
    got.feeder = ResidentFeeder.for_loader(got, torch.device("cpu"))
    assert got.reader.mapped_shards == 0 and ShardCache(tmp_path / "c").usage() <= limit
    assert same_batches(Loader(str(index), **kw), got) == 2 * len(got)


@pytest.mark.parametrize("kw", [dict(shuffle="block", seed=1), dict(shuffle="shard", seed=2, block_window=2)],
                         ids=["block", "shard"])
def test_a_local_state_resumes_the_build_read_from_its_url(remote, tmp_path, kw):
    """A URL and its local copy give the same batches, so a state taken over one resumes the other: its
    layout digest (keys, chunks, shards) is of the build, not of where its files are."""
    url, so, index, _ = remote
    a = Loader(str(index), batch_size=12, device="cpu", **kw)
    it = iter(a)
    next(it)
    state = json.loads(json.dumps(a.state_dict()))
    want = [b["image"].numpy().copy() for b in it]
    b = Loader(url, batch_size=12, device="cpu", cache_dir=tmp_path / "c", storage_options=so, **kw)
    b.load_state_dict(state)
    got = [x["image"].numpy().copy() for x in b]
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    a.close()
    b.close()
