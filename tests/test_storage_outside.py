"""An outside attack on object storage: a build read from a URL whose index lies about its shards, a store
that serves other bytes than the index promises, and builds written to a URL. Every object lives in fsspec's
in-process ``memory://`` store (one prefix per test), so each test takes well under a second."""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import uuid
from pathlib import Path

import fsspec
import h5py
import numpy as np
import pytest
from PIL import Image

import precompile
from precompile.errors import FormatError
from precompile.recipe import parse_recipe


def tiny_build(root: Path, n: int = 4, fixed: bool = False) -> Path:
    """``n`` 4x4 RGB images whose pixels are 20 times their number, 2 per shard (``fixed``: stored as a field of
    fixed shape, which a Loader gathers); returns the local index."""
    (root / "in" / "a").mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((4, 4, 3), 20 * i, np.uint8)).save(root / "in" / "a" / f"{i}.png")
    recipe = parse_recipe({"name": "t", "seed": 0,
                           "inputs": {"root": "in", "match": "{label}/{name}.png",
                                      "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
                           "steps": [{"resize": {"size": [4, 4]}}] if fixed else [],
                           "output": {"format": "hdf5", "samples_per_shard": 2}}, base_dir=str(root))
    precompile.build(recipe, out_dir=str(root / "out"))
    return root / "out" / "t.h5"


def upload(out: Path) -> str:
    """Every file of the local output folder ``out`` under a new memory:// prefix; the prefix's URL."""
    fs = fsspec.filesystem("memory")
    url = f"memory://sa-{uuid.uuid4().hex[:12]}/p"
    for p in sorted(out.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{url}/{p.relative_to(out).as_posix()}", p.read_bytes())
    return url


def set_entries(index: Path, change) -> None:
    """Rewrite the index's shard entries (its ``shards`` attribute) with ``change(entries)``."""
    with h5py.File(index, "r+") as f:
        shards = json.loads(f.attrs["shards"])
        change(shards)
        f.attrs["shards"] = json.dumps(shards)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- an index at a URL whose shard entries lie ---------------------------------------------------------------
@pytest.mark.parametrize("file", ["../q/t.shards/x.h5", "t.shards/../../q/x.h5", "/abs/x.h5", "t.shards//x.h5",
                                  "./t.shards/x.h5", "", "t.shards/x.h5\0", "t.shards\\..\\..\\x.h5",
                                  "t.shards/%2e%2e/%2E%2e/q/x.h5"])
def test_a_shard_entry_naming_a_file_outside_the_index_folder_is_refused_at_open(tmp_path, file):
    """A shard path that leaves the index's folder (or names no object) is a damaged index, said at open:
    nothing is requested from another prefix of the store (an HTTP client resolves ``..`` and ``%2e%2e``)."""
    index = tiny_build(tmp_path)

    def change(shards):
        shards[0]["file"] = file
    set_entries(index, change)
    url = upload(index.parent)
    before = files_under(tmp_path)
    with pytest.raises(FormatError) as e:
        precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    assert str(e.value).startswith(f"{url}/t.h5: the index is damaged: shard entry 0 names the file {file!r}, "
                                   f"which is not a path inside the index's folder"), str(e.value)
    assert files_under(tmp_path) - before <= {"c", "c/files", "c/locks"} | \
        {f"c/files/{n}" for n in os.listdir(tmp_path / "c" / "files")}
    assert all(n.endswith(".h5") and len(n) == 67 for n in os.listdir(tmp_path / "c" / "files"))


@pytest.mark.parametrize("field, value, what", [
    ("sha256", "000000000000000/../../x", "its sha256 '000000000000000/../../x' is not 64 lowercase hex digits"),
    ("sha256", "0x" + "a" * 62, "its sha256 '0x" + "a" * 62 + "' is not 64 lowercase hex digits"),
    ("sha256", "A" * 64, "its sha256 '" + "A" * 64 + "' is not 64 lowercase hex digits"),
    ("bytes", -5, "its size (bytes) -5 is not a number of bytes >= 0"),
    ("bytes", True, "its size (bytes) True is not a number of bytes >= 0")])
def test_a_shard_entry_with_a_malformed_digest_or_size_is_a_damaged_index(tmp_path, field, value, what):
    """The digest names the cached copy's file and its byte in the cache's locks: one that is no sha256 was
    taken for a store fault ("cannot read from the store: ValueError ..., check the network")."""
    index = tiny_build(tmp_path)

    def change(shards):
        shards[0][field] = value
    set_entries(index, change)
    url = upload(index.parent)
    with pytest.raises(FormatError) as e:
        ds = precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
        ds[0]
    assert str(e.value).startswith(f"{url}/t.h5: the index is damaged: shard entry 0 "), str(e.value)
    assert what in str(e.value), str(e.value)
    assert not (tmp_path / "c" / "files").exists() or \
        all(len(n) == 67 for n in os.listdir(tmp_path / "c" / "files"))


# -- an input root over HTTP: paths from data must not leave it ----------------------------------------------
@contextlib.contextmanager
def http_server(folder: Path):
    """A plain HTTP server of ``folder`` on 127.0.0.1 in a thread; yields (base URL, the paths it was asked)."""
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(folder), **kw)

        def send_head(self):
            asked.append(self.path)
            return super().send_head()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", asked
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("cell", ["a/%2e%2e/%2e%2e/secret.png", "a/%2E%2E/%2e./secret.png", "a/.%2e/.%2E/secret.png"])
def test_a_percent_encoded_dot_dot_in_a_table_cell_does_not_leave_an_http_root(tmp_path, cell):
    """An HTTP client decodes ``%2e%2e`` to ``..`` and resolves it (``root/a/%2e%2e/%2e%2e/secret.png`` is a GET
    of ``/secret.png``): such a path leaves inputs.root, and fails its own input at decode (on_error: skip
    drops it); nothing outside the root is requested."""
    pytest.importorskip("aiohttp", reason="http:// inputs need aiohttp (the http extra)")
    srv = tmp_path / "srv"
    (srv / "top" / "a").mkdir(parents=True)
    Image.fromarray(np.full((4, 4, 3), 7, np.uint8)).save(srv / "top" / "a" / "0.png")
    Image.fromarray(np.full((4, 4, 3), 99, np.uint8)).save(srv / "secret.png")
    (tmp_path / "t.csv").write_text(f"Path\na/0.png\n{cell}\n")
    with http_server(srv) as (base, asked):
        recipe = parse_recipe({"name": "t", "on_error": "skip",
                               "inputs": {"root": f"{base}/top", "table": "t.csv", "path": "{Path}",
                                          "fields": {"image": {"decoder": "image"}}},
                               "output": {"samples_per_shard": 4}}, base_dir=str(tmp_path))
        report = precompile.build(recipe, out_dir=str(tmp_path / "out"))
    assert not [p for p in asked if p != "/top" and not p.startswith("/top/")], asked   # (the plan lists the root)
    ds = precompile.open(tmp_path / "out" / "t.h5")
    assert len(ds) == 1 and int(ds[0]["image"].max()) == 7
    (f,) = report.failures
    assert (f.path, f.stage, f.field) == (f"{base}/top/{cell}", "decode", "image")
    assert f.detail.startswith(f"the path leaves inputs.root '{base}/top' (a '..' part once percent-decoded"), \
        f.detail


@pytest.mark.parametrize("rel, leaves", [("a\\..\\..\\x.png", True), ("a/..%2f..%2fx.png", True),
                                         ("a/%252e%252e/x.png", False), ("a/50%25.png", False),
                                         ("a/b..c/%2e.png", False), ("a\\b.png", False)])
def test_the_remote_path_rule_sees_dot_dots_a_client_or_server_resolves(rel, leaves):
    """Below a remote root, a '..' hidden by percent-encoding or between backslashes (which some servers take
    for separators) leaves the root; an encoded '%' or dots inside a name do not."""
    from precompile.errors import DecodeError
    from precompile.inputs.paths import InputRoot

    class R:
        input_root = "https://h.example/top"

        class model:
            class inputs:
                follow_links = "inside"
    rule = InputRoot(R)
    if not leaves:
        assert rule.check(f"https://h.example/top/{rel}") is False
        return
    with pytest.raises(DecodeError) as e:
        rule.check(f"https://h.example/top/{rel}")
    assert e.value.stage == "decode" and e.value.path == f"https://h.example/top/{rel}"
    assert str(e.value) == (f"https://h.example/top/{rel}, stage decode: the path leaves inputs.root "
                            f"'https://h.example/top' (a '..' part once percent-decoded, or between backslashes: "
                            f"an HTTP client or a server resolves it to another place)")


# -- the cache folder ------------------------------------------------------------------------------------------
def test_a_full_disk_while_the_index_is_cached_is_a_cache_error_and_leaves_no_part(tmp_path, monkeypatch):
    """The index's copy meets a full disk as a shard's download does: a CacheError naming the cache folder and
    the URL, and no ``.part`` file left behind (it was a bare OSError, and the part stayed)."""
    import errno

    from precompile.errors import CacheError
    from precompile.storage import cache_fetch

    url = upload(tiny_build(tmp_path).parent)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(cache_fetch, "_write_all", full)
    with pytest.raises(CacheError) as e:
        precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    assert str(e.value).startswith(f"the cache folder {tmp_path / 'c'} is out of disk space while fetching "
                                   f"{url}/t.h5 (No space left on device): lower cache_limit"), str(e.value)
    assert os.listdir(tmp_path / "c" / "files") == []


# -- HDF5 files from a URL that read local files -----------------------------------------------------------------
def _entry_of(index: Path, s: int) -> dict:
    with h5py.File(index, "r") as f:
        return json.loads(f.attrs["shards"])[s]


def _point_at(h5: Path, name: str, how: str, target: Path) -> None:
    """Make ``name`` in the HDF5 file ``h5`` take its data from the local file ``target``: external storage
    (``external``), an external link (``link``) or a virtual dataset (``virtual``) of the same shape and type."""
    with h5py.File(h5, "r+") as f:
        d = f[name]
        shape, dtype, attrs = d.shape, d.dtype, dict(d.attrs)
        del f[name]
        if how == "external":
            nd = f.create_dataset(name, shape=shape, dtype=dtype,
                                  external=[(str(target), 0, int(np.prod(shape)) * dtype.itemsize)])
        elif how == "link":
            f[name] = h5py.ExternalLink(str(target), "/x")
            return
        else:
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(target), "x", shape=shape)
            nd = f.create_virtual_dataset(name, layout)
        for k, v in attrs.items():
            nd.attrs[k] = v


def _reseal(index: Path, s: int) -> None:
    """Record shard ``s``'s present bytes (size and sha256) in its index entry, as a writer would."""
    import hashlib

    data = (index.parent / _entry_of(index, s)["file"]).read_bytes()

    def change(shards):
        shards[s]["bytes"], shards[s]["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    set_entries(index, change)


def _secret(tmp_path: Path) -> Path:
    """A local file the attacker wants: raw bytes 0..95 (``secret.bin``), and the same as dataset ``x`` of an
    HDF5 file (``secret.h5``)."""
    raw = tmp_path / "secret.bin"
    raw.write_bytes(bytes(range(96)))
    with h5py.File(tmp_path / "secret.h5", "w") as f:
        f["x"] = np.arange(96, dtype=np.uint8)
    return raw


@pytest.mark.parametrize("how", ["external", "link", "virtual"])
def test_a_shard_from_a_url_that_reads_a_local_file_is_refused(tmp_path, how):
    """A shard whose bytes are the ones its index records, but whose HDF5 structure takes a field's data from
    a local file (external storage, an external link, a virtual dataset): the reader returned that file's
    bytes as the sample (bytes 0, 1, 2, ... of ``secret.bin``). It is refused, naming the shard and the file."""
    index = tiny_build(tmp_path)
    raw = _secret(tmp_path)
    target = raw if how == "external" else tmp_path / "secret.h5"
    _point_at(index.parent / _entry_of(index, 0)["file"], "image/data", how, target)
    _reseal(index, 0)
    url = upload(index.parent)
    ds = precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    with pytest.raises(FormatError) as e:
        ds[0]
    what = {"external": f"the dataset 'image/data' keeps its data in the file {str(raw)!r}",
            "link": f"'image/data' is an external link to the file {str(target)!r}",
            "virtual": f"the dataset 'image/data' is virtual, with data from the file {str(target)!r}"}[how]
    assert str(e.value) == (f"{url}/{_entry_of(index, 0)['file']}: the shard reads outside its own file ({what}): "
                            f"refused, nothing of it was read; a build writes no such shard: the index {url}/t.h5 "
                            f"and its shards were not written by precompile build")
    assert ds[2]["image"].max() == 40   # the other shard reads as built


def test_an_index_from_a_url_that_reads_a_local_file_is_refused_at_open(tmp_path):
    """The index's own columns (keys, copies, ...) are read from its cached copy: external storage there read
    the local file; its virtual fields may only take data from its shard files."""
    index = tiny_build(tmp_path)
    raw = _secret(tmp_path)
    _point_at(index, "__copy__", "external", raw)
    url = upload(index.parent)
    with pytest.raises(FormatError) as e:
        precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    assert str(e.value) == (f"{url}/t.h5: the index reads outside its own file (the dataset '__copy__' keeps its "
                            f"data in the file {str(raw)!r}): refused, nothing of it was read; a build writes no "
                            f"such index: it was not written by precompile build")
    index = tiny_build(tmp_path / "v")
    _point_at(index, "label", "virtual", tmp_path / "secret.h5")
    url = upload(index.parent)
    with pytest.raises(FormatError, match=r"the dataset 'label' is virtual, with data from the file '/"):
        precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")


@pytest.mark.parametrize("how", ["external", "link", "virtual"])
def test_a_local_build_whose_shard_or_index_reads_another_file_is_refused(tmp_path, how):
    """The same crafted structures in a build on a local disk (copied from an untrusted source): the URL reader
    refused them, the local one read the other file's bytes as the sample (external storage made the direct reader
    fall back to h5py, which follows it). A shard is refused when first opened, an index at open. (The Loader's
    gather reads the bytes the index's chunk table places inside the shard file itself: never another file.)"""
    index = tiny_build(tmp_path)
    raw = _secret(tmp_path)
    target = raw if how == "external" else tmp_path / "secret.h5"
    shard = index.parent / _entry_of(index, 0)["file"]
    _point_at(shard, "image/data", how, target)
    ds = precompile.open(index)
    what = {"external": f"the dataset 'image/data' keeps its data in the file {str(raw)!r}",
            "link": f"'image/data' is an external link to the file {str(target)!r}",
            "virtual": f"the dataset 'image/data' is virtual, with data from the file {str(target)!r}"}[how]
    with pytest.raises(FormatError) as e:
        ds[0]
    assert str(e.value) == f"{shard}: the shard reads outside its own file ({what}): refused; a build writes no such shard"
    assert ds[2]["image"].max() == 40   # the other shard reads as built
    index = tiny_build(tmp_path / "i")
    _point_at(index, "__copy__", "external", raw)
    with pytest.raises(FormatError) as e:
        precompile.open(index)
    assert str(e.value) == (f"{index}: the index reads outside its own file (the dataset '__copy__' keeps its data in "
                            f"the file {str(raw)!r}): refused; a build writes no such index")


def test_a_damaged_cached_copy_of_the_index_is_replaced_by_the_bytes_just_fetched(tmp_path):
    """Each open fetches the index whole; a cached copy of the same size whose bytes were damaged since (a key
    changed on disk) was trusted by its size, and every later open of the URL failed ('the index is damaged',
    with a remedy for the build at the URL, which is intact) until the cache was emptied by hand."""
    import hashlib

    index = tiny_build(tmp_path)
    url = upload(index.parent)
    sha = hashlib.sha256(index.read_bytes()).hexdigest()
    ds = precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    keys = [ds.key(i) for i in range(len(ds))]
    ds.release()
    copy = tmp_path / "c" / "files" / f"{sha}.h5"
    data = copy.read_bytes()
    assert data == index.read_bytes() and data.count(b"a/2.png") >= 1
    copy.write_bytes(data.replace(b"a/2.png", b"a/9.png"))   # the key column (and the keys in the report)
    again = precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    assert [again.key(i) for i in range(len(again))] == keys == ["a/0.png", "a/1.png", "a/2.png", "a/3.png"]
    assert [int(again[i]["image"].max()) for i in range(4)] == [0, 20, 40, 60]
    assert copy.read_bytes() == index.read_bytes()


# -- inputs listed at a URL ------------------------------------------------------------------------------------
def test_objects_whose_names_no_local_file_system_takes_are_read(tmp_path):
    """An object name may be longer than a local file name can be (S3 keys: 1024 bytes; NAME_MAX: 255): the
    fetch named its local copy after it and failed ('OSError: [Errno 36] File name too long'), dropping a valid
    input. Long ASCII and multi-byte names; a plain one beside them."""
    import io

    fs = fsspec.filesystem("memory")
    root = f"memory://in-{uuid.uuid4().hex[:12]}/r"
    names = {"a/" + "x" * 300 + ".png": 10, "a/" + "\u00e9" * 130 + ".png": 20, "a/s.png": 30}
    for name, v in names.items():
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), v, np.uint8)).save(buf, format="PNG")
        fs.pipe_file(f"{root}/{name}", buf.getvalue())
    recipe = parse_recipe({"name": "t", "inputs": {"root": root, "match": "{label}/{name}.png",
                                                   "fields": {"image": {"decoder": "image"}}},
                           "output": {"samples_per_shard": 8}}, base_dir=str(tmp_path))
    report = precompile.build(recipe, out_dir=str(tmp_path / "out"))
    assert report.failures == []
    ds = precompile.open(tmp_path / "out" / "t.h5")
    got = {ds.key(i): int(ds[i]["image"].max()) for i in range(len(ds))}
    assert got == names
    assert all(ds[i]["image"].shape == (4, 4, 3) for i in range(len(ds)))


@pytest.mark.parametrize("stray", ["notes.part", "my-build.h5", "README", "Ab12.part"])
def test_files_the_cache_did_not_make_neither_break_it_nor_are_removed(tmp_path, stray):
    """A file in ``<cache_dir>/files`` that precompile did not name (a user's copy, an editor's backup): taking
    its name for a digest made every download fail ('cannot read from the store: ValueError: invalid literal
    for int() with base 16', naming the network). The cache leaves it alone and reads as before."""
    index = tiny_build(tmp_path)
    url = upload(index.parent)
    (tmp_path / "c" / "files").mkdir(parents=True)
    (tmp_path / "c" / "files" / stray).write_bytes(b"not the cache's")
    os.utime(tmp_path / "c" / "files" / stray, (1, 1))   # the oldest file: the first one eviction looks at
    # the index and one shard fit, the second shard needs the first's room (the cache's own files are evicted)
    ds = precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c", cache_limit=25_000)
    assert [int(ds[i]["image"].max()) for i in range(4)] == [0, 20, 40, 60]
    assert ds.remote.cache.stats.evictions == 1
    assert (tmp_path / "c" / "files" / stray).read_bytes() == b"not the cache's"


def _png(v: int, side: int = 4) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(np.full((side, side, 3), v, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_changed_object_named_by_a_table_under_a_url_root_rebuilds_its_shard(tmp_path):
    """Remote inputs' fingerprints come from the plan's listing of the root (reference-recipe.md: "a changed
    object rebuilds its shard"); a table's rows under a URL root were never listed, so every input's
    fingerprint was ['missing'] and a changed object kept its old shard: the output served the old pixels."""
    fs = fsspec.filesystem("memory")
    root = f"memory://in-{uuid.uuid4().hex[:12]}/r"
    fs.pipe_file(f"{root}/a/0.png", _png(10))
    fs.pipe_file(f"{root}/a/1.png", _png(20))
    (tmp_path / "t.csv").write_text("Path\na/0.png\na/1.png\n")
    recipe = {"name": "t", "inputs": {"root": root, "table": "t.csv", "path": "{Path}",
                                      "fields": {"image": {"decoder": "image"}}},
              "output": {"samples_per_shard": 1}}
    first = precompile.build(parse_recipe(recipe, base_dir=str(tmp_path)), out_dir=str(tmp_path / "out"))
    assert first["shards"]["built"] == 2
    same = precompile.build(parse_recipe(recipe, base_dir=str(tmp_path)), out_dir=str(tmp_path / "out"))
    assert same["shards"]["built"] == 0 and same["shards"]["skipped"] == 2
    fs.pipe_file(f"{root}/a/1.png", _png(99, side=5))
    again = precompile.build(parse_recipe(recipe, base_dir=str(tmp_path)), out_dir=str(tmp_path / "out"))
    assert again["shards"]["built"] == 1 and again["shards"]["skipped"] == 1
    ds = precompile.open(tmp_path / "out" / "t.h5")
    assert [ds[i]["image"].shape for i in range(2)] == [(4, 4, 3), (5, 5, 3)]
    assert [int(ds[i]["image"].max()) for i in range(2)] == [10, 99]


def test_a_table_under_a_url_root_the_store_will_not_list_still_builds(tmp_path, monkeypatch):
    """The plan lists a table's URL root for fingerprints; a store that refuses the listing but serves the
    objects (a bucket that grants GetObject, not ListBucket) leaves the rows without them, and the build
    reads every row as before (no fingerprints: a changed object is not seen)."""
    from fsspec.implementations.memory import MemoryFileSystem

    fs = fsspec.filesystem("memory")
    root = f"memory://in-{uuid.uuid4().hex[:12]}/r"
    for i in range(2):
        fs.pipe_file(f"{root}/a/{i}.png", _png(10 * (i + 1)))
    (tmp_path / "t.csv").write_text("Path\na/0.png\na/1.png\n")

    def refused(self, *a, **kw):
        raise PermissionError("Access Denied (s3:ListBucket)")
    monkeypatch.setattr(MemoryFileSystem, "find", refused)
    recipe = parse_recipe({"name": "t", "inputs": {"root": root, "table": "t.csv", "path": "{Path}",
                                                   "fields": {"image": {"decoder": "image"}}},
                           "output": {"samples_per_shard": 4}}, base_dir=str(tmp_path))
    report = precompile.build(recipe, out_dir=str(tmp_path / "out"))
    assert report.failures == []
    ds = precompile.open(tmp_path / "out" / "t.h5")
    assert [int(ds[i]["image"].max()) for i in range(2)] == [10, 20]


def test_a_table_glob_over_http_names_each_part_once(tmp_path):
    """``table: https://host/top/t-*.csv``: the HTTP filesystem gives the matches as whole URLs, and the
    protocol was put in front again ('table 'http://http://host/top/t-0.csv' does not exist')."""
    pytest.importorskip("aiohttp", reason="http:// inputs need aiohttp (the http extra)")
    srv = tmp_path / "srv" / "top"
    (srv / "a").mkdir(parents=True)
    for i in range(2):
        (srv / "a" / f"{i}.png").write_bytes(_png(10 * (i + 1)))
        (srv / f"t-{i}.csv").write_text(f"Path\na/{i}.png\n")
    with http_server(tmp_path / "srv") as (base, asked):
        recipe = parse_recipe({"name": "t", "inputs": {"root": f"{base}/top", "table": f"{base}/top/t-*.csv",
                                                       "path": "{Path}", "fields": {"image": {"decoder": "image"}}},
                               "output": {"samples_per_shard": 4}}, base_dir=str(tmp_path))
        report = precompile.build(recipe, out_dir=str(tmp_path / "out"))
    assert report.failures == [] and "/top/t-1.csv" in asked
    ds = precompile.open(tmp_path / "out" / "t.h5")
    assert {ds.key(i): int(ds[i]["image"].max()) for i in range(2)} == {"a/0.png": 10, "a/1.png": 20}


def test_an_index_over_cache_limit_is_refused_after_reading_no_more_than_the_limit(tmp_path, monkeypatch):
    """The index is fetched whole into memory; a URL naming a huge object (not an index, or a cache_limit far
    too small) was read to its end before the limit was checked: the read is bounded by cache_limit."""
    from fsspec.implementations.memory import MemoryFileSystem

    from precompile.errors import CacheError

    url = upload(tiny_build(tmp_path).parent)
    size = fsspec.filesystem("memory").size(f"{url}/t.h5")
    read: list[int] = []
    real = MemoryFileSystem.cat_file

    def counted(self, path, start=None, end=None, **kw):
        out = real(self, path, start=start, end=end, **kw)
        read.append(len(out))
        return out
    monkeypatch.setattr(MemoryFileSystem, "cat_file", counted)
    with pytest.raises(CacheError) as e:
        precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c", cache_limit=1000)
    assert read and max(read) <= 1001 < size, (read, size)
    assert str(e.value) == (f"{url}/t.h5: the index is {size / 1024:.1f} KiB ({size} bytes), more than cache_limit "
                            f"1000 B (1000 bytes) of {tmp_path / 'c'}: raise cache_limit above the index's size")
    assert os.listdir(tmp_path / "c" / "files") == []


FETCHER = r"""
import os, signal, sys, time, fsspec
from precompile.storage.remote import local_copy
fs = fsspec.filesystem("memory")
fs.pipe_file("memory://b/x.png", b"0123456789")
with local_copy("memory://b/x.png") as local:
    assert open(local, "rb").read() == b"0123456789"
    print(os.path.dirname(local), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "hold":
        sys.stdin.read()
"""


def test_the_fetched_copies_of_a_killed_worker_are_removed_by_the_next_one(tmp_path):
    """A shard task fetches each remote input into a temporary folder and removes it when done; a worker
    killed meanwhile (SIGKILL, the OOM killer) left the copy in the temporary folder for good, one per kill.
    The next process that fetches removes the folders of processes that died, never a running one's."""
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                        os.environ.get("PYTHONPATH", "")]))

    def start(mode):
        return subprocess.Popen([sys.executable, "-c", FETCHER, mode], env=env, text=True, stdout=subprocess.PIPE,
                                stdin=subprocess.PIPE if mode == "hold" else subprocess.DEVNULL)
    holder = start("hold")
    held = Path(holder.stdout.readline().strip())
    killed = start("kill")
    dead = Path(killed.stdout.readline().strip())
    assert killed.wait(timeout=60) == -9 and (dead / "x.png").read_bytes() == b"0123456789"
    after = start("run")
    done = Path(after.stdout.readline().strip())
    assert after.wait(timeout=60) == 0
    assert not dead.exists() and not done.exists()   # the dead worker's copy, and the finished one's
    assert (held / "x.png").read_bytes() == b"0123456789"   # a running worker's copy stays
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0 and not held.exists()
    holder.stdout.close(), killed.stdout.close(), after.stdout.close()
    assert [p for p in tmp.rglob("*")] == []


def test_an_empty_object_at_the_index_url_is_named_as_no_index(tmp_path, monkeypatch):
    """S3 answers a range GET of an empty object with 416 (s3fs: 'OSError: [Errno 22] The requested range is
    not satisfiable'; seen with moto); the index's GET is a range GET (bounded by cache_limit), so an empty
    object read as a store fault ('check the endpoint ... and the network') instead of 'no index'. The memory
    store is given S3's answer."""
    import errno

    from fsspec.implementations.memory import MemoryFileSystem

    fs = fsspec.filesystem("memory")
    url = f"memory://sa-{uuid.uuid4().hex[:12]}/p/t.h5"
    fs.pipe_file(url, b"")
    real = MemoryFileSystem.cat_file

    def like_s3(self, path, start=None, end=None, **kw):
        if (start is not None or end is not None) and self.size(path) == 0:
            raise OSError(errno.EINVAL, "The requested range is not satisfiable")
        return real(self, path, start=start, end=end, **kw)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", like_s3)
    with pytest.raises(FormatError) as e:
        precompile.open(url, cache_dir=tmp_path / "c")
    assert str(e.value) == (f"{url}: neither an HDF5 nor a JSON index; reading from a URL serves HDF5 builds only: "
                            f"copy the build to a local folder and open it there")


def test_a_folder_input_over_http_does_not_fetch_a_link_out_of_the_folder(tmp_path):
    """A folder input (a DICOM series) at an HTTP root is fetched whole from its index page's links; a link
    ``%2e%2e/%2e%2e/secret.bin`` was listed as a file of the folder, and fetched (a GET of ``/secret.bin``)
    into the series. It fails the input, naming the link; links fsspec resolves out of the folder are left
    out as before."""
    pytest.importorskip("aiohttp", reason="http:// inputs need aiohttp (the http extra)")
    from precompile.errors import DecodeError
    from precompile.storage.remote import local_copy

    srv = tmp_path / "srv"
    (srv / "top" / "series").mkdir(parents=True)
    (srv / "top" / "series" / "a.dcm").write_bytes(b"A")
    (srv / "top" / "other.bin").write_bytes(b"OTHER")
    (srv / "secret.bin").write_bytes(b"SECRET")
    with http_server(srv) as (base, asked):
        (srv / "top" / "series" / "index.html").write_text(
            f'<a href="a.dcm">a</a> <a href="../other.bin">o</a> <a href="{base}/secret.bin">s</a> '
            f'<a href="%2e%2e/%2e%2e/secret.bin">u</a>')
        with pytest.raises(DecodeError) as e:
            with local_copy(f"{base}/top/series", folder=True):
                pass
        assert str(e.value) == (f"{base}/top/series, stage decode: the folder's file '%2e%2e/%2e%2e/secret.bin' "
                                f"leaves the folder (a '..' part once percent-decoded, or between backslashes: an "
                                f"HTTP client or a server resolves it to another place)")
        (srv / "top" / "series" / "index.html").write_text('<a href="a.dcm">a</a> <a href="../other.bin">o</a>')
        with local_copy(f"{base}/top/series", folder=True) as local:
            assert {p.name: p.read_bytes() for p in Path(local).rglob("*") if p.is_file()} == {"a.dcm": b"A"}
    assert "/secret.bin" not in asked and "/top/other.bin" not in asked, asked


# -- builds written to a URL ---------------------------------------------------------------------------------
def test_an_upload_cut_on_a_store_that_keeps_part_of_it_is_built_again(tmp_path, monkeypatch):
    """A store that keeps what was sent of a cut upload (a partial object: not S3, whose PUT is whole or
    nothing) holds half a shard and no entry sidecar; the build stops naming the shard and the store's
    default endpoint ('cannot reach the endpoint the store's default endpoint' read doubled), and the next
    build rebuilds that shard: the result is the local build's bytes."""
    from fsspec.implementations.memory import MemoryFileSystem

    from precompile.errors import OutputError

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    index = tiny_build(tmp_path, n=6)
    recipe = parse_recipe({"name": "t", "seed": 0, "inputs": {"root": "in", "match": "{label}/{name}.png",
                                                              "fields": {"image": {"decoder": "image"}},
                                                              "label": {"capture": "label"}},
                           "output": {"format": "hdf5", "samples_per_shard": 2}}, base_dir=str(tmp_path))
    url = f"memory://out-{uuid.uuid4().hex[:12]}/p"
    real, puts = MemoryFileSystem.put_file, []

    def cut(self, lpath, rpath, **kw):
        if "/t.shards/shard-" in rpath and rpath.endswith(".h5"):
            puts.append(rpath)
            if len(puts) == 2:
                data = Path(lpath).read_bytes()
                self.pipe_file(rpath, data[:len(data) // 2])
                raise ConnectionError("connection reset by peer")
        return real(self, lpath, rpath, **kw)
    monkeypatch.setattr(MemoryFileSystem, "put_file", cut)
    with pytest.raises(OutputError) as e:
        precompile.build(recipe, out_dir=url, n_jobs=1)
    assert str(e.value).startswith(f"output {puts[1]}: cannot reach the store's default endpoint (ConnectionError: "
                                   f"connection reset by peer), while uploading shard 1; check the address"), \
        str(e.value)
    monkeypatch.setattr(MemoryFileSystem, "put_file", real)
    report = precompile.build(recipe, out_dir=url, n_jobs=1)
    assert report["shards"] == {"total": 3, "built": 2, "skipped": 1, "reused": 0, "failed": 0}
    fs = fsspec.filesystem("memory")
    for p in sorted(index.parent.rglob("*.h5")):
        assert fs.cat_file(f"{url}/{p.relative_to(index.parent).as_posix()}") == p.read_bytes(), p
