"""Builds written to a URL, offline: a moto S3 server on 127.0.0.1 takes the output (tests/test_remote.py's
fixture). The remote layout is the local one byte for byte; a no-change rebuild reads the index and one
listing and writes nothing; a killed build resumes; snapshots, gc, verify and the lock work on objects; the
store's faults are OutputErrors naming the URL and what to set."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import precompile
from conftest import image_recipe, make_image_tree, write_recipe
from precompile.errors import BuildError, FormatError, OutputError, RecipeError
from test_remote import s3  # noqa: F401  (the module's moto server)

pytest.importorskip("s3fs", reason="s3fs is not installed (extra 's3')")

REPO = Path(__file__).resolve().parents[1]
OUT = "precompile-test-out"
SECRET = "not-a-real-secret-3f9c0a1b"   # moto takes any key: this one must never be stored


@pytest.fixture(scope="module")
def store(s3):  # noqa: F811
    """(endpoint, boto3 client) with the output bucket created."""
    endpoint, client = s3
    client.create_bucket(Bucket=OUT)
    return endpoint, client


@pytest.fixture
def env(monkeypatch, tmp_path):
    """Credentials in the environment (as a user sets them), no config files, a fixed build date."""
    for k in [k for k in os.environ if k.startswith("AWS_") and k != "AWS_EC2_METADATA_DISABLED"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")


def with_keys(endpoint: str) -> dict:
    """Storage options with the credentials in them: loky workers that earlier tests started keep the
    environment they started with (docs/reference-build.md), so -j 2 builds pass their keys this way."""
    return {"endpoint_url": endpoint, "key": "test", "secret": SECRET}


def objects(client, prefix: str) -> dict[str, bytes]:
    """{key under prefix: bytes} of every object under ``prefix/``."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=OUT, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1:]] = client.get_object(Bucket=OUT, Key=o["Key"])["Body"].read()
    return out


def local_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def recipe(tmp_path: Path, per_class: int = 5, **over) -> dict:
    root = tmp_path / "data"
    if not root.exists():
        make_image_tree(root, per_class=per_class)
    return image_recipe(root, **over)


def test_url_build_is_the_local_build_byte_for_byte(tmp_path, store, env):
    endpoint, client = store
    r = recipe(tmp_path)
    local = precompile.build(r, out_dir=tmp_path / "local", n_jobs=2)
    rep = precompile.build(r, out_dir=f"s3://{OUT}/same/j1", storage_options={"endpoint_url": endpoint})
    assert rep["shards"] == local["shards"] == {"total": 3, "built": 3, "skipped": 0, "reused": 0, "failed": 0}
    assert rep["output"] == f"s3://{OUT}/same/j1/imgs.h5"
    files = local_files(tmp_path / "local")
    for prefix, jobs in (("same/j1", 1), ("same/j2", 2)):
        if jobs == 2:
            precompile.build(r, out_dir=f"s3://{OUT}/{prefix}", n_jobs=2, storage_options=with_keys(endpoint))
        objs = objects(client, prefix)
        # the index and every shard: the same bytes; beside them each shard's .entry.json (URL builds only)
        assert {k: v for k, v in objs.items() if k.endswith(".h5")} == {k: v for k, v in files.items()
                                                                          if k.endswith(".h5")}
        sidecars = sorted(k for k in objs if k.endswith(".entry.json"))
        assert sidecars == sorted(k + ".entry.json" for k in files if k.startswith("imgs.shards/shard-"))
        assert ".lock" not in "".join(objs)   # released
        # the secret (from the environment, then from the storage options) and the options are stored nowhere
        assert not [k for k, v in objs.items() if SECRET.encode() in v or endpoint.encode() in v]
        report = json.loads(objs["imgs.report.json"])
        assert report["status"] == "ok" and report["num_samples"] == 10
    ds = precompile.open(tmp_path / "local" / "imgs.h5")
    assert ds.key(0) == "cat/000.jpg"


def test_endpoint_from_the_environment_travels_and_a_noop_reads_only_the_index_and_a_listing(
        tmp_path, s3, store, env, monkeypatch):  # noqa: F811  (s3: the server, for its request log)
    endpoint, client = store
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)   # botocore's own variable: no --storage-option needed
    r = recipe(tmp_path)
    first = precompile.build(r, out_dir=f"s3://{OUT}/noop")
    assert first["shards"]["built"] == 3
    before = objects(client, "noop")
    seen = len(served_since(s3, 0, "before"))
    again = precompile.build(r, out_dir=f"s3://{OUT}/noop")
    assert again["up_to_date"] and again["shards"] == {"total": 3, "built": 0, "skipped": 3, "reused": 0,
                                                        "failed": 0}
    served = [m.group(1, 2) for m in (re.search(r'"(\w+) (\S+) HTTP', ln) for ln in served_since(s3, seen, "after"))
              if m]
    # one listing, then the index read (a HEAD too, with some s3fs versions): no lock, no write
    assert served[0][0] == "GET" and served[0][1].startswith(f"/{OUT}?list-type=2"), served
    assert set(served[1:]) <= {("GET", f"/{OUT}/noop/imgs.h5"), ("HEAD", f"/{OUT}/noop/imgs.h5")}, served
    assert ("GET", f"/{OUT}/noop/imgs.h5") in served
    assert objects(client, "noop") == before


def served_since(server, start: int, mark: str) -> list[str]:
    """The request lines the moto server logged after the first ``start``, up to a marker request made now (the
    server logs a request after answering it, so the marker's line says the lines before it are written)."""
    import requests

    marker = f"/{OUT}/marker-{mark}-{time.monotonic_ns()}"
    requests.get(f"{server[0]}{marker}", timeout=10)
    deadline = time.monotonic() + 10
    while True:
        lines = server.requests()
        if any(marker in ln for ln in lines[start:]) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    time.sleep(0.05)   # the lines of requests answered just before the marker, from the server's other threads
    return [ln for ln in server.requests()[start:] if marker not in ln]


def test_a_changed_input_rebuilds_its_shard_beside_the_old_snapshot_then_gc(tmp_path, store, env):
    endpoint, client = store
    so = {"endpoint_url": endpoint}
    r = recipe(tmp_path)
    url = f"s3://{OUT}/snap"
    precompile.build(r, out_dir=url, storage_options=so)
    old = {k for k in objects(client, "snap") if k.startswith("imgs.shards/shard-")}
    other = make_image_tree(tmp_path / "other", per_class=5, seed=9)
    (tmp_path / "data" / "dog" / "004.jpg").write_bytes((other / "dog" / "004.jpg").read_bytes())  # last shard
    rep = precompile.build(r, out_dir=url, storage_options=with_keys(endpoint), n_jobs=2)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 2
    objs = objects(client, "snap")
    shards = {k for k in objs if k.startswith("imgs.shards/shard-") and k.endswith(".h5")}
    assert len(shards) == 4 and {k for k in old if k.endswith(".h5")} <= shards   # the replaced one is kept
    replaced = json.loads(objs["imgs.shards/previous.json"])["files"]
    assert len(replaced) == 3 and set(replaced) - {k[len("imgs.shards/"):] for k in shards} == set()
    precompile.build(r, out_dir=tmp_path / "local")
    assert objs["imgs.h5"] == (tmp_path / "local" / "imgs.h5").read_bytes()
    # gc keeps the replaced snapshot; --all removes it (the old last shard and its sidecar)
    from precompile.compiler.driver import collect_garbage
    from precompile.tools.verify import verify

    assert collect_garbage(f"{url}/imgs.h5", storage_options=so) == ([], 0)
    gone = sorted(k[len("imgs.shards/"):] for k in old if "shard-00002" in k)
    dry = _cli("gc", f"{url}/imgs.h5", "--all", "--dry-run", "--storage-option", f"endpoint_url={endpoint}")
    assert dry.returncode == 0 and dry.stdout.splitlines()[:2] == [f"would remove {n}" for n in gone], dry.stderr
    assert objects(client, "snap") == objs
    removed, freed = collect_garbage(f"{url}/imgs.h5", keep_previous=False, storage_options=so)
    assert removed == gone and len(gone) == 2 and freed == sum(len(objs["imgs.shards/" + n]) for n in gone)
    left = objects(client, "snap")
    assert set(objs) - set(left) == {"imgs.shards/" + n for n in gone}
    assert json.loads(left["imgs.shards/previous.json"]) == {"files": []}
    res = verify(f"{url}/imgs.h5", storage_options=so)
    assert res.ok and res.num_shards == 3 and res.num_samples == 10


def test_resume_keeps_uploaded_shards_by_their_entry_sidecars(tmp_path, store, env):
    """A build that uploaded every shard but died before the index: the rerun builds nothing (each shard's
    index parts come from its .entry.json) and writes the same index; a shard without its sidecar (killed
    between the two PUTs) is built again."""
    endpoint, client = store
    so = {"endpoint_url": endpoint}
    r = recipe(tmp_path)
    url = f"s3://{OUT}/resume"
    precompile.build(r, out_dir=url, storage_options=so)
    want = objects(client, "resume")
    for key in ("imgs.h5", "imgs.report.json"):
        client.delete_object(Bucket=OUT, Key=f"resume/{key}")
    rep = precompile.build(r, out_dir=url, storage_options=so)
    assert rep["shards"] == {"total": 3, "built": 0, "skipped": 3, "reused": 0, "failed": 0}
    assert objects(client, "resume")["imgs.h5"] == want["imgs.h5"]
    side = next(k for k in want if k.startswith("imgs.shards/shard-00001") and k.endswith(".entry.json"))
    client.delete_object(Bucket=OUT, Key=f"resume/{side}")
    client.delete_object(Bucket=OUT, Key="resume/imgs.h5")
    rep = precompile.build(r, out_dir=url, storage_options=so)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 2
    assert {k: v for k, v in objects(client, "resume").items() if k != "imgs.report.json"} == \
        {k: v for k, v in want.items() if k != "imgs.report.json"}


def test_skipped_inputs_sidecar_works_remotely(tmp_path, store, env):
    endpoint, client = store
    so = {"endpoint_url": endpoint}
    r = recipe(tmp_path)
    (tmp_path / "data" / "cat" / "002.jpg").write_bytes(b"not a jpeg")
    url = f"s3://{OUT}/skip"
    rep = precompile.build(r, out_dir=url, storage_options=so, on_error="skip")
    assert rep["skipped_inputs"] == 1 and rep["num_samples"] == 9
    objs = objects(client, "skip")
    sidecars = [k for k in objs if k.endswith(".skipped.json")]
    assert len(sidecars) == 1 and sidecars[0].startswith("imgs.shards/shard-00000-")
    assert "cat/002.jpg" in json.loads(objs[sidecars[0]])["failures"][0]["message"]
    again = precompile.build(r, out_dir=url, storage_options=so, on_error="skip")
    assert again["up_to_date"] and [f["previous_build"] for f in again["failures"]] == [True]


SLOW = '''"""Test-only decoder: the image decoder, slower, so that a kill lands mid-build."""
import time

from precompile.decoders.image import ImageDecoder
from precompile.registry import DECODERS


@DECODERS.register()
class SlowImage(ImageDecoder):
    name = "pcplug_remote_slow"

    def read(self, path):
        time.sleep(0.03)
        return super().read(path)
'''


def test_a_killed_build_resumes_and_its_lock_is_taken_over(tmp_path, store, env):
    endpoint, client = store
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "pcplug_remote_slow.py").write_text(SLOW)
    r = recipe(tmp_path, per_class=12)
    r["inputs"]["fields"]["image"]["decoder"] = "pcplug_remote_slow"
    r["output"]["samples_per_shard"] = 2
    rf = write_recipe(tmp_path / "r.yaml", r)
    url = f"s3://{OUT}/killed"
    (tmp_path / "tmp").mkdir()
    sub_env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, TMPDIR=str(tmp_path / "tmp"),
                   PYTHONPATH=os.pathsep.join([str(tmp_path / "plug"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = "import pcplug_remote_slow, runpy; runpy.run_module('precompile', run_name='__main__')"
    cmd = [sys.executable, "-c", run, "build", str(rf), "-o", url, "--no-progress"]
    proc = subprocess.Popen(cmd, env=sub_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if len([k for k in objects(client, "killed") if k.endswith(".entry.json")]) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    objs = objects(client, "killed")
    done = [k for k in objs if k.endswith(".entry.json")]
    assert 3 <= len(done) < 12 and "imgs.h5" not in objs and "imgs.shards/.lock" in objs
    holder = json.loads(objs["imgs.shards/.lock"])
    assert holder["pid"] == proc.pid and holder["host"] == socket.gethostname()
    # the killed build's local staging folder is left behind (its half-built shards) ...
    assert [p.name.startswith(f"precompile-out-{proc.pid}-") for p in (tmp_path / "tmp").iterdir()] == [True]
    r2 = subprocess.run(cmd, env=sub_env, capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert f"took over the stale build lock {url}/imgs.shards/.lock" in r2.stderr
    assert f"its process {proc.pid} on this host is gone" in r2.stderr
    assert list((tmp_path / "tmp").iterdir()) == []   # ... and the next build removes it
    rep = json.loads(objects(client, "killed")["imgs.report.json"])
    assert rep["shards"]["skipped"] >= len(done) and rep["shards"]["built"] == 12 - rep["shards"]["skipped"]
    ref = subprocess.run(cmd[:-2] + [str(tmp_path / "local"), "--no-progress"], env=sub_env, capture_output=True,
                         text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    final = objects(client, "killed")
    for name, data in local_files(tmp_path / "local").items():
        if name.endswith(".h5"):
            assert final[name] == data, name


def _lock_body(**over) -> bytes:
    """A lock another builder holds: written now, expiring in 120 s (``over`` changes it)."""
    import datetime as dt

    soon = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=120)).isoformat()
    body = {"owner": "ana@gpu-07 pid 4242", "host": "gpu-07", "pid": 4242, "started": "2026-01-01T00:00:00+00:00",
            "heartbeat": "2026-01-01T00:00:00+00:00", "expires": soon, "ttl_s": 120.0}
    return json.dumps({**body, **over}).encode()


def test_the_lock_stops_a_second_build_and_an_expired_one_is_taken_over(tmp_path, store, env, monkeypatch):
    from precompile.storage import url_lock

    endpoint, client = store
    monkeypatch.setattr(url_lock, "HEARTBEAT_S", 0.02)   # many heartbeats during a build: each If-Match holds
    so = {"endpoint_url": endpoint}
    r = recipe(tmp_path)
    url = f"s3://{OUT}/locked"
    client.put_object(Bucket=OUT, Key="locked/imgs.shards/.lock", Body=_lock_body())
    with pytest.raises(BuildError) as e:
        precompile.build(r, out_dir=url, storage_options=so)
    assert str(e.value).startswith(f"another build of 'imgs' into {url} is running (lock {url}/imgs.shards/.lock, "
                                   f"held by ana@gpu-07 pid 4242 since 2026-01-01T00:00:00+00:00, last heartbeat ")
    assert set(objects(client, "locked")) == {"imgs.shards/.lock"}   # nothing else written
    # the holder died long ago: its lock expired, the next build takes it over and says so
    client.put_object(Bucket=OUT, Key="locked/imgs.shards/.lock", Body=_lock_body(expires="2026-01-01T00:02:00+00:00"))
    rep = precompile.build(r, out_dir=url, storage_options=so)
    assert rep["shards"]["built"] == 3
    assert any(ev.startswith(f"took over the stale build lock {url}/imgs.shards/.lock (held by ana@gpu-07 pid 4242")
               and "expired at 2026-01-01T00:02:00+00:00" in ev for ev in rep["events"])
    assert "imgs.shards/.lock" not in objects(client, "locked")
    # gc takes the same lock
    client.put_object(Bucket=OUT, Key="locked/imgs.shards/.lock", Body=_lock_body())
    from precompile.compiler.driver import collect_garbage

    with pytest.raises(BuildError, match="another build of 'imgs' .* is running"):
        collect_garbage(f"{url}/imgs.h5", storage_options=so)
    client.delete_object(Bucket=OUT, Key="locked/imgs.shards/.lock")


@pytest.mark.parametrize("body,problem", [
    (b"\x00\xff lock", "it is not UTF-8 text"),
    (_lock_body(expires="2999-01-01T00:00:00"), "'expires' has no timezone ('2999-01-01T00:00:00')"),
    (_lock_body(ttl_s="120", expires="2000-01-01T00:00:00+00:00"), None),
], ids=["binary", "expires-without-timezone", "ttl_s-a-string"])
def test_a_damaged_lock_stops_a_build_until_its_ttl_then_a_build_takes_it_over(tmp_path, store, env, monkeypatch,
                                                                               body, problem):
    """A lock object a build cannot read (or whose expiry it cannot) gave TypeError / ValueError at every
    build until removed by hand. Now it is held like any lock (exit 3: another build may be running), named
    with its age; once older than the time-to-live a build takes it over and succeeds. A readable expiry
    in the past with a string ttl_s: the lock expired, taken over at once (the message no longer crashes)."""
    import datetime as dt

    from precompile.storage import url_lock

    endpoint, client = store
    so = {"endpoint_url": endpoint}
    r = recipe(tmp_path)
    case = re.sub(r"\W+", "-", str(problem))
    url = f"s3://{OUT}/damaged-{case}"
    client.put_object(Bucket=OUT, Key=f"damaged-{case}/imgs.shards/.lock", Body=body)
    if problem is not None:
        with pytest.raises(BuildError) as e:
            precompile.build(r, out_dir=url, storage_options=so)
        assert e.value.exit_code == 3
        assert str(e.value).startswith(f"another build of 'imgs' into {url} may be running: its lock "
                                       f"{url}/imgs.shards/.lock is damaged ({problem})"), str(e.value)
        assert re.search(r", last written \d+ s ago; it is held like any lock until it is 120 s old", str(e.value))
        assert set(objects(client, f"damaged-{case}")) == {"imgs.shards/.lock"}   # nothing else written
        real = url_lock._now
        monkeypatch.setattr(url_lock, "_now", lambda: real() + dt.timedelta(seconds=url_lock.TTL_S + 5))
    rep = precompile.build(r, out_dir=url, storage_options=so)
    assert rep["status"] == "ok" and rep["shards"]["built"] == 3
    took = [ev for ev in rep["events"] if ev.startswith(f"took over the stale build lock {url}/imgs.shards/.lock")]
    assert len(took) == 1 and (f"(damaged: {problem}" in took[0] and re.search(r"it was last written 1[2-9]\d s ago, "
                                                                              r"more than its time-to-live of 120 s$",
                                                                              took[0])
                               if problem else "it expired at 2000-01-01T00:00:00+00:00" in took[0]), took
    assert "imgs.shards/.lock" not in objects(client, f"damaged-{case}")


def test_a_lock_taken_over_while_held_stops_the_build_before_the_index(store, env, monkeypatch):
    import s3fs

    from precompile.storage import url_lock

    endpoint, client = store
    monkeypatch.setattr(url_lock, "HEARTBEAT_S", 0.05)
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    url = f"s3://{OUT}/lost/x.shards/.lock"
    fs.ls(f"{OUT}/")   # connected: conditional_puts reads the client's model
    if not url_lock.conditional_puts(fs):
        pytest.skip("this s3fs/botocore sends no conditional PUTs (s3fs < 2024.12): a lost lock cannot be noticed")
    with url_lock.UrlLock(fs, url, "'x'", conditional=True) as lk:
        lk.check()
        client.put_object(Bucket=OUT, Key="lost/x.shards/.lock", Body=_lock_body())   # another builder took it
        deadline = time.monotonic() + 10
        while lk.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(BuildError, match=r"build of 'x' stopped: the build lock .* was taken over by another "
                                             r"build .* the index was not replaced"):
            lk.check()
    assert json.loads(client.get_object(Bucket=OUT, Key="lost/x.shards/.lock")["Body"].read())["pid"] == 4242


def test_verify_streams_every_object_and_names_the_damaged_one(tmp_path, store, env):
    endpoint, client = store
    r = recipe(tmp_path)
    url = f"s3://{OUT}/verify"
    precompile.build(r, out_dir=url, storage_options={"endpoint_url": endpoint})
    objs = objects(client, "verify")
    victim = sorted(k for k in objs if k.endswith(".h5") and "shard-00001" in k)[0]
    data = bytearray(objs[victim])
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=OUT, Key=f"verify/{victim}", Body=bytes(data))
    args = ["verify", f"{url}/imgs.h5", "--storage-option", f"endpoint_url={endpoint}"]
    res = _cli(*args)
    assert res.returncode == FormatError.exit_code, res.stderr
    assert f"{victim}: whole-file sha256 differs from the index's: the object's bytes changed" in res.stderr
    assert f"error: 1 of 3 shard(s) failed verification: {victim}" in res.stderr
    from precompile.tools.verify import verify

    so = {"endpoint_url": endpoint}
    assert verify(f"{url}/imgs.h5", checksums=False, storage_options=so).ok   # same size: --quick sees nothing
    client.delete_object(Bucket=OUT, Key=f"verify/{victim}")
    quick = verify(f"{url}/imgs.h5", checksums=False, storage_options=so)
    assert quick.problems == [f"{victim}: file is missing"] and quick.exit_code == FormatError.exit_code
    client.put_object(Bucket=OUT, Key=f"verify/{victim}", Body=objs[victim])
    ok = verify(f"{url}/imgs.h5", storage_options=so)
    assert ok.ok and ok.bytes_checked == sum(len(v) for k, v in objs.items() if k.startswith("imgs.shards/shard-")
                                            and k.endswith(".h5"))
    with pytest.raises(FormatError, match=rf"^s3://{OUT}/nothing/imgs.h5: no such output \(build it first\)$"):
        verify(f"s3://{OUT}/nothing/imgs.h5", storage_options=so)
    # build --repair rebuilds exactly the damaged object
    client.put_object(Bucket=OUT, Key=f"verify/{victim}", Body=bytes(data))
    rep = precompile.build(r, out_dir=url, storage_options=so, repair=True)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 2
    assert objects(client, "verify")[victim] == objs[victim] and verify(f"{url}/imgs.h5", storage_options=so).ok


def test_verify_checks_the_index_copies_readers_use_and_repair_rewrites_it(tmp_path, store, env):
    """The reviewer's flipped key byte: a URL's verify runs the index checks of a local verify on the index it
    fetched (no shard read, --quick too), so wrong keys a reader would serve are named; --repair rewrites it."""
    import h5py

    from precompile.formats import names as fmt
    from precompile.tools.verify import verify

    endpoint, client = store
    so = {"endpoint_url": endpoint}
    r = recipe(tmp_path)
    url = f"s3://{OUT}/vidx"
    precompile.build(r, out_dir=url, storage_options=so)
    good = objects(client, "vidx")["imgs.h5"]
    local = tmp_path / "imgs.h5"
    local.write_bytes(good)
    with h5py.File(local, "r+") as f:
        f[fmt.KEY_UTF8][0] ^= 1                      # 'cat/000.jpg' -> 'bat/000.jpg' in the copy readers use
        rows = f[fmt.SHARD_TABLE][()]
        rows["bytes"][1] += 1                        # and a row of its shard table
        f[fmt.SHARD_TABLE][...] = rows
    client.put_object(Bucket=OUT, Key="vidx/imgs.h5", Body=local.read_bytes())
    with pytest.raises(FormatError) as e:           # a reader served 'bat/000.jpg' before the index's own checksums
        precompile.open(f"{url}/imgs.h5", cache_dir=tmp_path / "c1", storage_options=so)
    assert str(e.value).startswith(f"{url}/imgs.h5: the index is damaged: the crc32 of its shard table (__shards__) "
                                   f"is not the one the build recorded (index_crc32); write the index again with: "
                                   f"precompile build <recipe> --repair (with the same -o")
    want = ["__shards__ column 'bytes' differs from the shard entries (first at entry 1)",
            "its two copies of the keys differ at sample 0: 'bat/000.jpg' in __key_utf8__, 'cat/000.jpg' in __key__",
            "the crc32 of its sample keys (__key_utf8__) is not the one the build recorded",
            "the crc32 of its shard table (__shards__) is not the one the build recorded"]
    for checksums in (True, False):
        res = verify(f"{url}/imgs.h5", checksums=checksums, storage_options=so)
        assert res.bad_shards == [] and res.index_problems == want and res.index_damaged
        assert res.problems == [f"index: {p}" for p in want] and res.exit_code == FormatError.exit_code
    cli = _cli("verify", f"{url}/imgs.h5", "--quick", "--storage-option", f"endpoint_url={endpoint}")
    assert cli.returncode == FormatError.exit_code and "error: the index is damaged (every shard is intact)" in \
        cli.stderr, cli.stderr
    rep = precompile.build(r, out_dir=url, storage_options=so, repair=True)
    assert rep["shards"]["built"] == 0 and rep["shards"]["skipped"] == 3   # the index written again, no shard
    assert objects(client, "vidx")["imgs.h5"] == good and verify(f"{url}/imgs.h5", storage_options=so).ok
    assert precompile.open(f"{url}/imgs.h5", cache_dir=tmp_path / "c2", storage_options=so).key(0) == "cat/000.jpg"


def _cli(*args: str, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "precompile", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_stores_faults_are_output_errors_before_any_work(tmp_path, store, env, monkeypatch):
    endpoint, client = store
    rf = write_recipe(tmp_path / "r.yaml", recipe(tmp_path))
    cases = []
    # no credentials: the CLI's one line and exit code 6
    res = _cli("build", str(rf), "-o", f"s3://{OUT}/faults", "--storage-option", f"endpoint_url={endpoint}",
               "--no-progress", drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    assert res.returncode == OutputError.exit_code, res.stderr
    assert res.stderr.startswith(f"error: output s3://{OUT}/faults: no credentials for s3:// (NoCredentialsError: ")
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment" in res.stderr
    assert "nothing was written" in res.stderr and res.stderr.count("\n") == 1
    # nothing listening at the endpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    no_retries = {"retries": {"max_attempts": 1}}   # botocore's backoff would take 10 s to give up
    cases.append(({"endpoint_url": dead, "config_kwargs": no_retries}, f"s3://{OUT}/faults",
                  f"output s3://{OUT}/faults: cannot reach the endpoint {dead} (EndpointConnectionError"))
    cases.append(({"endpoint_url": endpoint}, "s3://no-such-bucket/out",
                  "output s3://no-such-bucket/out: the bucket 'no-such-bucket' does not exist"))
    cases.append(({"endpoint_url": endpoint, "no_such_option": 1}, f"s3://{OUT}/faults",
                  f"output s3://{OUT}/faults: a --storage-option that s3:// does not take ("))
    for so, url, msg in cases:
        with pytest.raises(OutputError) as e:
            precompile.build(rf, out_dir=url, storage_options=so)
        assert str(e.value).startswith(msg) and "nothing was written" in str(e.value)
    assert objects(client, "faults") == {}


def test_a_full_local_staging_folder_is_an_output_error_naming_it(tmp_path, store, env):
    """Shards are built in a local folder before their upload: a full disk there is named (and TMPDIR)."""
    endpoint, client = store
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount): {r.stderr.strip()}")
    try:
        rf = write_recipe(tmp_path / "r.yaml", recipe(tmp_path))
        sub_env = dict(os.environ, TMPDIR=str(mnt),
                       PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        res = subprocess.run([sys.executable, "-m", "precompile", "build", str(rf), "-o", f"s3://{OUT}/full",
                              "--storage-option", f"endpoint_url={endpoint}", "--no-progress"],
                             capture_output=True, text=True, env=sub_env, timeout=120)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert res.returncode == OutputError.exit_code, res.stderr
    assert res.stderr.startswith(f"error: output folder {mnt}/precompile-out-") and " is out of space: " in res.stderr
    assert res.stderr.rstrip().endswith(f"(the local staging folder of s3://{OUT}/full/imgs.shards: TMPDIR moves it)")
    assert "imgs.h5" not in objects(client, "full")


def test_access_denied_is_an_output_error(tmp_path, store, env, monkeypatch):
    """Credentials that may read the bucket but not write it (moto enforcing IAM for this test only)."""
    import boto3
    import requests

    endpoint, client = store
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                       aws_secret_access_key="test")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                                                  "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    if requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).status_code != 200:
        pytest.skip("this moto cannot enforce IAM permissions (no /moto-api/reset-auth)")
    try:
        with pytest.raises(OutputError) as e:   # the bucket's root: moto checks these listings' signatures right
            precompile.build(recipe(tmp_path), out_dir=f"s3://{OUT}", storage_options={"endpoint_url": endpoint})
    finally:
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10)
    # (the lock's PUT is refused; with older s3fs moto already refuses the listing's signature)
    assert str(e.value).startswith(f"output s3://{OUT}: access denied (PermissionError: ")
    assert "while building 'imgs'; the credentials in use may not write there" in str(e.value)
    assert "nothing was written" in str(e.value)


def test_what_a_url_output_refuses(tmp_path, store, env):
    endpoint, _ = store
    so = {"endpoint_url": endpoint}
    with pytest.raises(RecipeError, match=r"output.format: format 'png' cannot be written to a URL "
                                          rf"\(s3://{OUT}/png\): it writes one object per sample"):
        precompile.build(recipe(tmp_path, output={"format": "png"}), out_dir=f"s3://{OUT}/png", storage_options=so)
    with pytest.raises(RecipeError, match="stats: stats cannot be stored in an output at a URL"):
        precompile.build(recipe(tmp_path), out_dir=f"s3://{OUT}/st", storage_options=so, stats=True)
    with pytest.raises(OutputError, match=r"output 's3://bkt/x': credentials in the URL are refused"):
        precompile.build(recipe(tmp_path), out_dir=f"s3://AKIA:{SECRET}@bkt/x")
    with pytest.raises(OutputError, match=r"give a local output folder as a path, not a file:// URL"):
        precompile.build(recipe(tmp_path), out_dir="file:///tmp/x")
    with pytest.raises(OutputError, match=r"is a local folder: storage options \(anon\) apply to a URL output"):
        precompile.build(recipe(tmp_path), out_dir=tmp_path / "o", storage_options={"anon": True})
    bad = _cli("build", "r.yaml", "-o", "s3://b/x", "--storage-option", "anon")
    assert bad.returncode == 2 and "use KEY=VALUE" in bad.stderr


def test_storage_options_are_yaml_scalars():
    import click

    from precompile.cli import _storage_options

    got = _storage_options(None, None, ("anon=true", "max_concurrency=8", "endpoint_url=http://h:9/x",
                                        "secret=a#b:c", "region_name="))
    assert got == {"anon": True, "max_concurrency": 8, "endpoint_url": "http://h:9/x", "secret": "a#b:c",
                   "region_name": ""}
    with pytest.raises(click.BadParameter, match="key: the value must be a scalar"):
        _storage_options(None, None, ("key=[1, 2]",))
    assert yaml.safe_load("x") == "x"
