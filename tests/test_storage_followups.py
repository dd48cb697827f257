"""Follow-ups of the outside review of object storage (tests/test_storage_outside.py): what a verify of a URL
could not check, a cached copy found damaged while another reader holds it, folder inputs whose fetched files
must be the fingerprinted ones, a fetched object that changed since the listing, and HTTP 5xx retries. Every
object is tiny and lives in fsspec's ``memory://`` store or on a loopback HTTP server."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_storage_outside import set_entries, tiny_build, upload  # noqa: E402

from precompile.tools.verify_url import verify_url  # noqa: E402

try:
    from test_remote import s3  # noqa: F401  (the module's moto server)
except pytest.skip.Exception:   # moto is not installed: only the test that needs the server skips
    @pytest.fixture
    def s3():
        pytest.skip("moto is not installed (test dependency)")


# -- 5. verify of a URL says what it could not check ----------------------------------------------------------
def test_verify_of_a_url_reports_a_shard_entry_without_a_sha256_as_not_checked(tmp_path):
    """An entry without ``sha256`` (or ``bytes``) cannot be checked object by object: verify says so, by name,
    and the build is not reported intact (readers of the URL refuse such an entry too)."""
    index = tiny_build(tmp_path)

    files = []

    def change(shards):
        files.extend(e["file"] for e in shards)
        del shards[0]["sha256"]
        del shards[1]["bytes"]
    set_entries(index, change)
    url = upload(index.parent)
    res = verify_url(f"{url}/t.h5")
    assert not res.ok
    assert res.problems == [
        f"index: shard entry 0 ({files[0]}) records no sha256: its object's bytes could not be checked "
        "(readers of the URL refuse the entry too): build to this URL again",
        f"index: shard entry 1 ({files[1]}) records no size (bytes): its object's size could not be checked "
        "(readers of the URL refuse the entry too): build to this URL again"], res.problems
    assert res.index_damaged and not res.bad_shards
    shard1 = (index.parent / files[1]).stat().st_size
    assert res.bytes_checked == shard1   # entry 1's sha256 is there: its object is still hashed
    quick = verify_url(f"{url}/t.h5", checksums=False)   # --quick asks no sha256: only the size is missing
    assert [p.split(")")[0] for p in quick.problems] == [f"index: shard entry 1 ({files[1]}"], quick.problems


# -- 4. a remote folder input: what is fetched is what is fingerprinted ---------------------------------------
def _memory_tree(files: dict[str, bytes]) -> str:
    """``files`` (relative name -> bytes) under a new memory:// prefix; its URL."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://sf-{uuid.uuid4().hex[:12]}/root"
    for rel, data in files.items():
        fs.pipe_file(f"{url}/{rel}", data)
    return url


def _fetched(local: str) -> dict[str, bytes]:
    return {p.relative_to(local).as_posix(): p.read_bytes() for p in Path(local).rglob("*") if p.is_file()}


def test_a_remote_folder_input_fetches_exactly_the_files_its_fingerprint_holds(caplog):
    """A folder input's key is made from the plan's listing, which leaves out hidden names and names with a
    '..' part; its fetch took every object under the folder (a hidden file too, and skipped '..' in silence).
    Now the fetch takes the listed files, and the listing reports what it left out."""
    from precompile.storage.remote import LISTED, list_tree, local_copy

    url = _memory_tree({"s/a.dcm": b"A", "s/sub/b.dcm": b"BB", "s/.DS_Store": b"H", "s/.git/c.dcm": b"C",
                        "s/../evil.dcm": b"E", "t/x.dcm": b"X"})
    with caplog.at_level("INFO", logger="precompile.remote"):
        assert list_tree(url, dirs=True) == ["s", "s/sub", "t"]
    assert [rel for rel, _ in LISTED[f"{url}/s"]] == ["a.dcm", "sub/b.dcm"]
    with local_copy(f"{url}/s", folder=True) as local:
        assert _fetched(local) == {"a.dcm": b"A", "sub/b.dcm": b"BB"}
    said = [r.getMessage() for r in caplog.records]
    assert f"{url}: 1 object(s) left out: their names hold an empty, '.' or '..' part, by which no local copy " \
           f"can be placed: 's/../evil.dcm'" in said, said
    assert f"{url}: 2 hidden object(s) left out (a name part starting with '.', as locally): 's/.DS_Store', " \
           f"'s/.git/c.dcm'" in said, said


def test_a_remote_folder_fetched_without_the_plans_listing_keeps_the_listings_rule(caplog):
    """A worker without the plan's listing (spawned: loky, dask) lists the folder itself, with the same rule:
    hidden names and '..' parts are left out, and reported."""
    from precompile.storage.remote import local_copy

    url = _memory_tree({"s/a.dcm": b"A", "s/.DS_Store": b"H", "s/../evil.dcm": b"E"})
    with caplog.at_level("INFO", logger="precompile.remote"):
        with local_copy(f"{url}/s", folder=True) as local:
            assert _fetched(local) == {"a.dcm": b"A"}
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{url}/s: 1 object(s) left out: ") and m.endswith("'../evil.dcm'") for m in said), said
    assert f"{url}/s: 1 hidden object(s) left out (a name part starting with '.', as locally): '.DS_Store'" in said


# -- 2. an input changed since the plan listed it ------------------------------------------------------------
@pytest.mark.parametrize("new", [b"longer bytes", b"BBBB"], ids=["other size", "same size"])
def test_a_remote_file_changed_since_the_listing_fails_its_input(new):
    """The shard key hashes the listing's fingerprint; bytes fetched after the object changed would be kept
    under the old key (and a rebuild would keep them). The fetch compares its copy with the listing (its size,
    then the store's fingerprint now): a change fails the input, naming the URL."""
    import fsspec

    from precompile.errors import DecodeError
    from precompile.storage.remote import list_tree, local_copy

    url = _memory_tree({"a/0.bin": b"AAAA"})
    list_tree(url, dirs=False)
    with local_copy(f"{url}/a/0.bin") as local:   # unchanged: no false alarm
        assert Path(local).read_bytes() == b"AAAA"
    fsspec.filesystem("memory").pipe_file(f"{url}/a/0.bin", new)
    with pytest.raises(DecodeError) as e:
        with local_copy(f"{url}/a/0.bin"):
            pass
    assert str(e.value).startswith(f"{url}/a/0.bin, stage decode: the object "), str(e.value)
    assert str(e.value).endswith("since the plan listed it: the shard's key was made from the listing, so its "
                                 "bytes are not kept; build again (the next plan lists the new object)")


@pytest.mark.parametrize("change", ["edit", "add", "remove"])
def test_a_remote_folder_changed_since_the_listing_fails_its_input(change):
    import fsspec

    from precompile.errors import DecodeError
    from precompile.storage.remote import list_tree, local_copy

    url = _memory_tree({"s/a.dcm": b"AAAA", "s/b.dcm": b"BB"})
    list_tree(url, dirs=True)
    fs = fsspec.filesystem("memory")
    with local_copy(f"{url}/s", folder=True) as local:
        assert _fetched(local) == {"a.dcm": b"AAAA", "b.dcm": b"BB"}
    if change == "edit":
        fs.pipe_file(f"{url}/s/a.dcm", b"ZZZZ")
    elif change == "add":
        fs.pipe_file(f"{url}/s/c.dcm", b"C")
    else:
        fs.rm_file(f"{url}/s/b.dcm")
    with pytest.raises(DecodeError) as e:
        with local_copy(f"{url}/s", folder=True):
            pass
    assert str(e.value).startswith(f"{url}/s, stage decode: the folder's "), str(e.value)
    assert "since the plan listed it" in str(e.value)


def test_an_s3_object_is_checked_by_its_etag_without_false_alarms(s3):
    """On S3 the listing's fingerprint (LIST) and the check's (HEAD) give the modification time in other
    precisions: the ETag decides. An unchanged object passes; one rewritten with other bytes of the same size
    fails its input."""
    pytest.importorskip("s3fs", reason="s3:// needs s3fs (the s3 extra)")
    import uuid

    from test_remote import BUCKET

    from precompile.errors import DecodeError
    from precompile.storage.remote import list_tree, local_copy

    endpoint, client = s3
    prefix = f"sf-{uuid.uuid4().hex[:8]}"
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/a/0.bin", Body=b"AAAA", ACL="public-read")
    opts = {"endpoint_url": endpoint, "anon": True}
    root = f"s3://{BUCKET}/{prefix}"
    list_tree(root, False, opts)
    with local_copy(f"{root}/a/0.bin", opts) as local:
        assert Path(local).read_bytes() == b"AAAA"
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/a/0.bin", Body=b"ZZZZ", ACL="public-read")
    with pytest.raises(DecodeError) as e:
        with local_copy(f"{root}/a/0.bin", opts):
            pass
    assert str(e.value).startswith(f"{root}/a/0.bin, stage decode: the object changed since the plan "
                                   f"listed it"), str(e.value)


# -- 1. a cached copy found damaged while another process holds it --------------------------------------------
def _rehash_elsewhere(root: Path, sha: str, size: int) -> str:
    """``ShardCache(root).rehash(sha, size)`` in another process; what it returned."""
    import os
    import subprocess

    code = ("import sys; from precompile.storage.shard_cache import ShardCache; "
            "print(ShardCache(sys.argv[1]).rehash(sys.argv[2], int(sys.argv[3])))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, str(root), sha, str(size)], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_copy_found_damaged_while_another_process_holds_it_is_told_truly_and_fetched_again(tmp_path):
    """``verify=True`` in one process re-hashes the cached copies, and removes a damaged one; a reader in
    another process that held it pinned (a Loader's shard fetched ahead) then found it gone, and was told that
    "something other than precompile" removed it. Now it is told what happened; the copy is fetched again
    (and checked) at the next pin, and the message is the plain one again."""
    import hashlib

    import fsspec

    from precompile.storage.remote_source import RemoteSource
    from precompile.storage.shard_cache import ShardCache

    data = bytes(range(256)) * 4
    sha = hashlib.sha256(data).hexdigest()
    url = _memory_tree({"t.shards/s.h5": data})
    fs = fsspec.filesystem("memory")
    cache = ShardCache(tmp_path / "c")
    src = RemoteSource(f"{url}/t.h5", [{"file": "t.shards/s.h5", "sha256": sha, "bytes": len(data)}], cache, None, fs)
    path = src.pin(0)
    plain = src.lost(0)
    assert "something other than precompile removed it" in plain
    with open(path, "r+b") as f:   # the disk changes a byte of the held copy
        f.seek(100)
        f.write(b"\xff")
    assert _rehash_elsewhere(tmp_path / "c", sha, len(data)) == "False"
    assert not Path(path).exists()   # a new reader never gets the damaged copy
    assert src.lost(0) == (
        f"{url}/t.shards/s.h5: its verified copy {path} was found damaged (its bytes no longer hash to the "
        f"index's sha256) and removed by a re-hash (verify=True) while this reader held it: the bytes it held are "
        f"not the build's; open the build again (the next read fetches the shard and checks it again)")
    src.unpin(0)
    again = src.pin(0)
    assert Path(again).read_bytes() == data
    assert src.lost(0) == plain
    src.unpin(0)
    assert _rehash_elsewhere(tmp_path / "c", sha, len(data)) == "True"
    with open(again, "r+b") as f:   # nobody holds it now: removed, and no mark is left
        f.write(b"\x00\x00")
    assert cache.rehash(sha, len(data)) is False
    assert not Path(again).exists() and not Path(cache.damaged_mark(sha)).exists()


# -- 3. an HTTP server's transient 5xx ------------------------------------------------------------------------
@contextlib.contextmanager
def flaky_http(folder: Path, fails: int, status: int = 503, etag: bool = False):
    """An HTTP server of ``folder`` on 127.0.0.1 that answers ``status`` to the first ``fails`` requests of each
    path (``etag``: files are sent with an ETag, a digest of their bytes); yields (base URL, the (method, path,
    status) of every request)."""
    import http.server
    import threading

    seen: list[tuple[str, str, int]] = []
    count: dict[str, int] = {}
    lock = threading.Lock()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(folder), **kw)

        def send_head(self):
            with lock:
                n = count[self.path] = count.get(self.path, 0) + 1
            if n <= fails:
                seen.append((self.command, self.path, status))
                self.send_error(status)
                return None
            seen.append((self.command, self.path, 200))
            return super().send_head()

        def send_header(self, keyword, value):
            super().send_header(keyword, value)
            if etag and keyword == "Last-Modified":
                import hashlib

                data = Path(self.translate_path(self.path)).read_bytes()
                super().send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def quick_backoff(monkeypatch):
    import inspect

    aiohttp = pytest.importorskip("aiohttp", reason="http:// needs aiohttp (the http extra)")
    if "middlewares" not in inspect.signature(aiohttp.ClientSession.__init__).parameters:
        pytest.skip(f"aiohttp {aiohttp.__version__} has no client middlewares (3.12+): 5xx answers are not retried")
    from precompile.storage import http_retry

    monkeypatch.setattr(http_retry, "BACKOFF_S", 0.01)


def test_an_http_input_answered_503_twice_is_fetched_on_the_third_try(tmp_path, quick_backoff):
    from precompile.storage.remote import local_copy

    (tmp_path / "a.bin").write_bytes(b"DATA" * 10)
    with flaky_http(tmp_path, fails=2) as (base, seen):
        with local_copy(f"{base}/a.bin") as local:
            assert Path(local).read_bytes() == b"DATA" * 10
    assert [s for m, p, s in seen if p == "/a.bin" and m == "GET"][:3] == [503, 503, 200], seen


def test_an_http_input_that_keeps_failing_is_a_clear_error_naming_the_url(tmp_path, quick_backoff):
    from precompile.errors import DecodeError
    from precompile.storage import http_retry
    from precompile.storage.remote import local_copy

    (tmp_path / "a.bin").write_bytes(b"DATA")
    with flaky_http(tmp_path, fails=100, status=502) as (base, seen):
        with pytest.raises(DecodeError) as e:
            with local_copy(f"{base}/a.bin"):
                pass
    tries = http_retry.RETRIES + 1
    assert [s for m, p, s in seen if m == "GET"] == [502] * tries, seen
    msg = str(e.value)
    assert msg.startswith(f"{base}/a.bin: cannot fetch the remote input: HTTPServerError: GET {base}/a.bin: the "
                          f"server answered HTTP 502 Bad Gateway {tries} times over "), msg
    assert msg.endswith(" s (a server error, asked again with backoff); try again later, or check the server"), msg


def test_a_build_read_over_http_rides_out_503s_of_its_index_and_shards(tmp_path, quick_backoff):
    """The index and every shard (range GETs into the cache) are answered 503 once each: read all the same."""
    import numpy as np

    import precompile

    index = tiny_build(tmp_path)
    want = [precompile.open(index)[i]["image"] for i in range(4)]
    with flaky_http(index.parent, fails=1) as (base, seen):
        ds = precompile.open(f"{base}/t.h5", cache_dir=tmp_path / "c")
        for i in range(4):
            np.testing.assert_array_equal(ds[i]["image"], want[i])
        ds.close()
    assert {p for m, p, s in seen if s == 503} >= {"/t.h5"} and \
        sum(1 for m, p, s in seen if s == 503 and p.startswith("/t.shards/")) == 2, seen


def test_an_http_file_whose_server_keeps_failing_is_not_called_missing(tmp_path, quick_backoff):
    """fsspec's HTTP ``info`` turns any failure into FileNotFoundError: a table whose server keeps answering
    503 was "does not exist". It is the server's error, named with the URL."""
    from precompile.errors import PlanError
    from precompile.storage.remote import file_fingerprint

    (tmp_path / "t.csv").write_text("Path\na.png\n")
    with flaky_http(tmp_path, fails=100) as (base, seen):
        with pytest.raises(PlanError) as e:
            file_fingerprint(f"{base}/t.csv", what=f"table {base}/t.csv")
    assert str(e.value).startswith(f"table {base}/t.csv cannot be read: HTTPServerError: GET {base}/t.csv: the "
                                   f"server answered HTTP 503 Service Unavailable 5 times over "), str(e.value)


def test_an_http_input_changed_in_place_changes_its_fingerprint(tmp_path, quick_backoff):
    """An HTTP index page gives names only: every input's fingerprint was ``["remote", None, None, None]``, so an
    input changed in place never rebuilt its shard, and a fetch had nothing to check. The listing now asks each
    such file's size, ETag and Last-Modified (one HEAD each, concurrently); a change shows in the next listing,
    and a fetch after a change fails its input."""
    import os

    from precompile.errors import DecodeError
    from precompile.storage.remote import LISTED, list_tree, local_copy

    (tmp_path / "r" / "a").mkdir(parents=True)
    f = tmp_path / "r" / "a" / "0.bin"
    f.write_bytes(b"AAAA")
    os.utime(f, (1_700_000_000, 1_700_000_000))
    with flaky_http(tmp_path, fails=0) as (base, seen):
        root = f"{base}/r"
        import fsspec

        info = fsspec.filesystem("http").info(f"{root}/a/0.bin")
        if not {"ETag", "Last-Modified", "last_modified"} & set(info):   # (the floors job's fsspec 2024.12.0)
            pytest.skip(f"fsspec {fsspec.__version__}'s HTTP info gives no ETag or Last-Modified: an HTTP file's "
                        f"fingerprint holds its size only there")
        assert list_tree(root, False) == ["a/0.bin"]
        before = LISTED[f"{root}/a/0.bin"]
        assert before[2] == 4 and before[3] is not None, before
        with local_copy(f"{root}/a/0.bin") as local:   # unchanged: no false alarm
            assert Path(local).read_bytes() == b"AAAA"
        f.write_bytes(b"ZZZZ")   # same size, another modification time
        os.utime(f, (1_700_000_100, 1_700_000_100))
        with pytest.raises(DecodeError) as e:
            with local_copy(f"{root}/a/0.bin"):
                pass
        assert str(e.value).startswith(f"{root}/a/0.bin, stage decode: the object changed since the plan listed "
                                       f"it"), str(e.value)
        list_tree(root, False)
        assert LISTED[f"{root}/a/0.bin"] != before


def test_an_http_folder_input_with_etags_is_checked_without_false_alarms(tmp_path, quick_backoff):
    """A folder input over HTTP: the plan describes each file (HEAD: size, ETag, Last-Modified), the fetch
    lists the folder again and describes it the same way: unchanged, it passes; a file rewritten with other
    bytes of the same size and the same modification time (only its ETag tells) fails the input."""
    import os

    from precompile.errors import DecodeError
    from precompile.storage.remote import LISTED, list_tree, local_copy

    s = tmp_path / "r" / "s"
    s.mkdir(parents=True)
    for name, data in (("a.dcm", b"AAAA"), ("b.dcm", b"BB")):
        (s / name).write_bytes(data)
        os.utime(s / name, (1_700_000_000, 1_700_000_000))
    with flaky_http(tmp_path, fails=0, etag=True) as (base, seen):
        root = f"{base}/r"
        assert list_tree(root, True) == ["s"]
        assert all(fp[1] for _, fp in LISTED[f"{root}/s"]), LISTED[f"{root}/s"]
        with local_copy(f"{root}/s", folder=True) as local:
            assert _fetched(local) == {"a.dcm": b"AAAA", "b.dcm": b"BB"}
        (s / "a.dcm").write_bytes(b"ZZZZ")
        os.utime(s / "a.dcm", (1_700_000_000, 1_700_000_000))
        with pytest.raises(DecodeError) as e:
            with local_copy(f"{root}/s", folder=True):
                pass
    assert str(e.value) == (f"{root}/s, stage decode: the folder's files changed ('a.dcm') since the plan listed "
                            f"it: the shard's key was made from the listing, so its bytes are not kept; build again "
                            f"(the next plan lists the new object)")


@pytest.mark.parametrize("jobs", [1, 2], ids=["inline", "forked workers"])
def test_a_build_fails_only_the_input_changed_between_its_plan_and_its_fetch(tmp_path, monkeypatch, jobs):
    """In a build: an object rewritten after the plan listed it fails its own input (on_error: skip drops it,
    naming the URL); the others are built, and a second build (a new listing) builds it with its new bytes.
    Forked workers inherit the plan's listing (and the memory:// store)."""
    import io

    import fsspec
    import numpy as np
    from PIL import Image

    import precompile
    from precompile.recipe import parse_recipe
    from precompile.storage import remote

    def png(v: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), v, np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    url = _memory_tree({f"a/{i}.png": png(10 * i) for i in range(3)})
    listing = remote.list_tree

    def list_then_change(*a, **kw):
        out = listing(*a, **kw)
        fsspec.filesystem("memory").pipe_file(f"{url}/a/1.png", png(99))   # after the plan's listing
        return out
    monkeypatch.setattr(remote, "list_tree", list_then_change)
    monkeypatch.setattr("precompile.inputs.listing.list_tree", list_then_change)
    recipe = {"name": "t", "on_error": "skip", "inputs": {"root": url, "match": "a/{name}.png",
                                                         "fields": {"image": {"decoder": "image"}}},
              "output": {"samples_per_shard": 2}}
    report = precompile.build(parse_recipe(recipe, base_dir=str(tmp_path)), out_dir=str(tmp_path / "out"),
                              n_jobs=jobs)
    (f,) = report.failures
    assert f.path == f"{url}/a/1.png" and f.detail.startswith("the object changed since the plan listed it"), f
    assert sorted(int(s["image"].max()) for s in precompile.open(tmp_path / "out" / "t.h5")) == [0, 20]
    monkeypatch.setattr("precompile.inputs.listing.list_tree", listing)
    report = precompile.build(parse_recipe(recipe, base_dir=str(tmp_path)), out_dir=str(tmp_path / "out"),
                              n_jobs=jobs)
    assert not report.failures
    assert sorted(int(s["image"].max()) for s in precompile.open(tmp_path / "out" / "t.h5")) == [0, 20, 99]
