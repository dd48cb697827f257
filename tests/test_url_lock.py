"""The build lock of an output at a URL against a store that drops answers and partitions (a moto S3 server on
127.0.0.1: tests/test_remote.py's fixture), and how a builder tells that a holder on its own host is gone.

Ownership is decided by the store: a heartbeat, a create or a takeover whose answer is lost (the PUT was
applied) keeps the lock by its nonce; a holder cut off while another builder takes its lock over finds out
in ``check()``; a holder whose heartbeats have not reached the store for the TTL has lost the lock; a holder
that stops removes the lock only while it is its own. Staging folders are removed only when no process
holds their owner lock (not by a pid, which another pid namespace sharing ``/tmp`` cannot see)."""
from __future__ import annotations

import datetime as dt
import errno
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from precompile.errors import BuildError
from test_remote import s3  # noqa: F401  (the module's moto server)

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (extra 's3')")

from precompile.storage import url_lock  # noqa: E402

LOCKS = "precompile-test-lock"


@pytest.fixture(scope="module")
def store(s3):  # noqa: F811
    endpoint, client = s3
    client.create_bucket(Bucket=LOCKS)
    return endpoint, client


@pytest.fixture
def fs(store, monkeypatch):
    """A fresh s3fs filesystem on the moto server that sends conditional PUTs; heartbeats every 20 ms."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setattr(url_lock, "HEARTBEAT_S", 0.02)
    f = s3fs.S3FileSystem(endpoint_url=store[0], skip_instance_cache=True)
    f.ls(f"{LOCKS}/")   # connected: conditional_puts reads the client's model
    if not url_lock.conditional_puts(f):
        pytest.skip("this s3fs/botocore sends no conditional PUTs (s3fs < 2024.12)")
    return f


class Network:
    """The lock's requests through ``fs`` behind a switch: ``down`` drops (and counts) every PUT (``fs.pipe_file``,
    the lock's only writer) and every read (``info``, ``cat_file``, ``exists``) before it reaches the store, as a
    partition does; ``lose`` (a predicate on the PUT's keyword arguments) lets one PUT reach the store and
    then raises ``lose_with`` instead of its answer, as a timed-out request (or botocore's retry of it) does.

    Reads are dropped too: a partition that let the heartbeat read its own nonce while another builder took
    the lock over, and let its PUT through once the switch is back, would test the best-effort mode's
    read-then-write window (inherent without conditional PUTs), not the partition."""

    def __init__(self, fs, monkeypatch):
        self.real, self.down, self.lose, self.dropped = fs.pipe_file, False, None, 0
        self.lose_with: BaseException = ConnectionError("Read timed out")
        monkeypatch.setattr(fs, "pipe_file", self)
        for name in ("info", "cat_file", "exists"):
            monkeypatch.setattr(fs, name, self._read(getattr(fs, name)))

    def _reach(self) -> None:
        """A request leaving for the store: dropped (counted, a network error) while ``down``."""
        if self.down:
            self.dropped += 1
            raise ConnectionError("Could not connect to the endpoint URL")

    def _read(self, real):
        def read(*args, **kw):
            self._reach()
            return real(*args, **kw)
        return read

    def __call__(self, path, value, **kw):
        self._reach()
        out = self.real(path, value, **kw)
        if self.lose is not None and self.lose(kw):
            self.lose = None
            raise self.lose_with
        return out


def stored(client, key: str):
    """The lock object's JSON, or None when there is none."""
    try:
        return json.loads(client.get_object(Bucket=LOCKS, Key=key)["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("conditional", [True, False], ids=["if-match", "best-effort"])
def test_a_holder_cut_off_while_its_lock_is_taken_over_stops_at_check(fs, store, monkeypatch, conditional):
    """The reviewer's partition: A's heartbeats fail (network errors, not 412), B takes the expired lock over;
    when the network is back, A's check() asks the store and stops A; A leaves B's lock alone. (Without
    conditional PUTs, the store's nonce tells A the same.)"""
    endpoint, client = store
    net = Network(fs, monkeypatch)
    url = f"s3://{LOCKS}/part-{conditional}/x.shards/.lock"
    key = f"part-{conditional}/x.shards/.lock"
    with url_lock.UrlLock(fs, url, "'x'", conditional=conditional) as a:
        a.check()
        net.down = True
        wait_for(lambda: net.dropped >= 3, "A's heartbeats to fail")
        body = stored(client, key)   # meanwhile A's lock expires: B takes it over
        client.put_object(Bucket=LOCKS, Key=key,
                          Body=json.dumps({**body, "expires": "2000-01-01T00:00:00+00:00"}).encode())
        other = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        b = url_lock.UrlLock(other, url, "'x'", conditional)
        b.acquire()
        assert b.took_over is not None and "expired at 2000-01-01T00:00:00+00:00" in b.took_over
        net.down = False
        with pytest.raises(BuildError) as e:
            a.check()
        assert str(e.value) == (f"build of 'x' stopped: the build lock {url} was taken over by another build (or "
                                f"removed); nothing was removed and the index was not replaced; finished shards "
                                f"are kept, run build again")
    assert stored(client, key)["nonce"] == b.nonce != a.nonce   # B's lock, untouched by A
    b.release()
    assert stored(client, key) is None


def test_a_lock_without_a_heartbeat_for_its_ttl_is_lost_then_released(fs, store, monkeypatch):
    """No heartbeat reached the store for longer than the TTL (the clock that counts it is moved on): the lock
    is lost even though nobody took it over and the store answers again; stopping, A removes it (its own)."""
    endpoint, client = store
    now = [1000.0]
    monkeypatch.setattr(url_lock, "elapsed", lambda: now[0])
    net = Network(fs, monkeypatch)
    url = f"s3://{LOCKS}/ttl/x.shards/.lock"
    with pytest.raises(BuildError, match=r"^build of 'x' stopped: no heartbeat of the build lock s3://\S+ "
                                         r"reached the store for 121 s \(more than its 120 s expiry\): another "
                                         r"build may have taken it over meanwhile; nothing was removed"):
        with url_lock.UrlLock(fs, url, "'x'", conditional=True) as a:
            net.down = True
            wait_for(lambda: net.dropped >= 3, "the heartbeats to fail")
            now[0] += url_lock.TTL_S + 1
            net.down = False
            time.sleep(0.1)   # heartbeats reach the store again: they do not win the lock back
            assert stored(client, "ttl/x.shards/.lock")["nonce"] == a.nonce
            a.check()
    assert stored(client, "ttl/x.shards/.lock") is None


def test_a_heartbeat_whose_answer_is_lost_keeps_the_lock(fs, store, monkeypatch):
    """The reviewer's lost answer: the heartbeat's PUT is applied, its answer never arrives; the next If-Match
    gets 412; the stored nonce is ours, so the holder adopts the stored ETag and goes on, then releases."""
    endpoint, client = store
    net = Network(fs, monkeypatch)
    url = f"s3://{LOCKS}/lost/x.shards/.lock"
    with url_lock.UrlLock(fs, url, "'x'", conditional=True) as lk:
        first = lk.etag
        net.lose = lambda kw: "IfMatch" in kw
        wait_for(lambda: net.lose is None, "a heartbeat to lose its answer")
        wait_for(lambda: lk.etag != first and client.head_object(Bucket=LOCKS, Key="lost/x.shards/.lock")["ETag"]
                 == lk.etag, "the stored ETag to be adopted")
        lk.check()
        assert lk.lost is None
    assert stored(client, "lost/x.shards/.lock") is None


def _expired(**over) -> bytes:
    return json.dumps({"owner": "ana@gpu-07 pid 4242", "host": "gpu-07", "pid": 4242, "nonce": "theirs",
                       "expires": "2000-01-01T00:00:00+00:00", **over}).encode()


def test_a_create_or_takeover_whose_answer_is_lost_is_adopted(fs, store, monkeypatch):
    """A create (If-None-Match) applied whose retry gets 412 (FileExistsError), and a takeover (If-Match)
    applied whose retry gets 412, are ours by their nonce; a create applied whose answer is a network error
    stops the build and the lock it wrote is removed."""
    endpoint, client = store
    net = Network(fs, monkeypatch)
    url = f"s3://{LOCKS}/adopt/x.shards/.lock"
    net.lose, net.lose_with = (lambda kw: kw.get("mode") == "create"), FileExistsError("pre-conditions failed")
    with url_lock.UrlLock(fs, url, "'x'", conditional=True) as lk:
        assert stored(client, "adopt/x.shards/.lock")["nonce"] == lk.nonce and lk.took_over is None
        lk.check()
    assert stored(client, "adopt/x.shards/.lock") is None

    client.put_object(Bucket=LOCKS, Key="adopt/x.shards/.lock", Body=_expired())
    net.lose = lambda kw: "IfMatch" in kw
    net.lose_with = OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold")
    with url_lock.UrlLock(fs, url, "'x'", conditional=True) as lk:
        assert lk.took_over.startswith(f"took over the stale build lock {url} (held by ana@gpu-07 pid 4242")
        lk.check()
    assert stored(client, "adopt/x.shards/.lock") is None

    net.lose, net.lose_with = (lambda kw: kw.get("mode") == "create"), ConnectionError("Read timed out")
    with pytest.raises(ConnectionError):
        with url_lock.UrlLock(fs, url, "'x'", conditional=True):
            pass
    assert stored(client, "adopt/x.shards/.lock") is None


def test_a_lock_of_another_builder_is_refused_with_its_holder_named(fs, store):
    endpoint, client = store
    soon = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=120)).isoformat()
    client.put_object(Bucket=LOCKS, Key="held/x.shards/.lock", Body=_expired(expires=soon))
    url = f"s3://{LOCKS}/held/x.shards/.lock"
    with pytest.raises(BuildError, match=r"^another build of 'x' is running \(lock s3://\S+, held by ana@gpu-07 "
                                         r"pid 4242 since \?, last heartbeat \?, last written \d s ago\); wait for "
                                         r"it to finish"):
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    assert stored(client, "held/x.shards/.lock")["nonce"] == "theirs"


# -- who is gone: a process of this host's boot and pid namespace, nothing else ---------------------------

@pytest.fixture
def me():
    ident = url_lock.process_identity()
    if ident["pid_ns"] is None or ident["boot_id"] is None or ident["pid_start"] is None:
        pytest.skip("no /proc here (boot id, pid namespace, process start times): only expiry frees a lock")
    return ident


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


FUTURE = {"expires": "2999-01-01T00:00:00+00:00"}


def test_a_holder_is_gone_only_where_its_pid_means_the_same_process(me):
    dead = dead_pid()
    assert url_lock.stale_reason({**me, **FUTURE, "pid": dead}) == f"its process {dead} on this host is gone"
    assert url_lock.stale_reason({**me, **FUTURE}) is None    # this process: alive, same start time
    assert url_lock.stale_reason({**me, **FUTURE, "pid_start": me["pid_start"] + 1}) == \
        f"its process {me['pid']} on this host is gone (the pid is now another process's)"
    # a container sharing the host name (host networking) but not the pid namespace: its pids are not ours
    assert url_lock.stale_reason({**me, **FUTURE, "pid": dead, "pid_ns": "pid:[1]"}) is None
    # another boot of a machine of that name, another machine, a lock without an identity: expiry only
    assert url_lock.stale_reason({**me, **FUTURE, "pid": dead, "boot_id": "0" * 36}) is None
    assert url_lock.stale_reason({**me, **FUTURE, "pid": dead, "host": "elsewhere"}) is None
    assert url_lock.stale_reason({"host": me["host"], "pid": dead, **FUTURE}) is None
    assert url_lock.stale_reason({**me, "pid": os.getpid(), "expires": "2000-01-01T00:00:00+00:00"}) == \
        "it expired at 2000-01-01T00:00:00+00:00 (no heartbeat for 120 s)"


def test_the_lock_body_records_the_identity_and_a_nonce(fs, store, me):
    endpoint, client = store
    with url_lock.UrlLock(fs, f"s3://{LOCKS}/body/x.shards/.lock", "'x'", conditional=True) as lk:
        body = stored(client, "body/x.shards/.lock")
    assert {k: body[k] for k in me} == me and body["nonce"] == lk.nonce and len(lk.nonce) == 32
    assert body["owner"] == f"{body['user']}@{me['host']} pid {os.getpid()}"


# -- staging folders ---------------------------------------------------------------------------------------

def test_a_staging_folder_is_removed_only_when_no_process_holds_it(store, tmp_path, monkeypatch):
    """A folder named with a pid this process cannot see (another pid namespace sharing /tmp) is kept while
    its owner's flock is held; removed once its owner is gone; one never locked (being created) is kept."""
    from precompile.compiler.url_output import UrlOutput

    endpoint, client = store
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    held, dead, fresh = (tmp_path / f"precompile-out-{dead_pid()}-{n}" for n in ("held", "dead", "fresh"))
    for d in (held, dead, fresh):
        d.mkdir()
    (dead / ".owner").write_text("4242\n")    # its build was killed: nobody holds the lock
    (fresh / ".owner").touch()                # its build is about to take the lock
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'1'); print('held', flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", hold, str(held / ".owner")], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline() == "held\n"
        with UrlOutput(f"s3://{LOCKS}/stage", {"endpoint_url": endpoint}) as out:
            mine = out.stage
            assert sorted(os.listdir(tmp_path)) == sorted([held.name, fresh.name, os.path.basename(mine)])
            assert os.path.basename(mine).startswith(f"precompile-out-{os.getpid()}-")
            assert (Path(mine) / ".owner").read_text() == f"{os.getpid()}\n"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    assert not os.path.exists(mine)
    with UrlOutput(f"s3://{LOCKS}/stage", {"endpoint_url": endpoint}) as out:
        assert sorted(os.listdir(tmp_path)) == sorted([fresh.name, os.path.basename(out.stage)])


# -- a damaged lock object: held like any lock, named with its age, taken over after its time-to-live ----------

def _live(**over) -> bytes:
    """A lock body as a running holder writes it (heartbeat now, expiry a TTL on), with ``over`` changed
    (a value None: the key left out)."""
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    body = {"owner": "ana@gpu-07 pid 4242", "host": "gpu-07", "pid": 4242, "nonce": "theirs",
            "started": now.isoformat(), "heartbeat": now.isoformat(),
            "expires": (now + dt.timedelta(seconds=120)).isoformat(), "ttl_s": 120.0, **over}
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


DAMAGED = {   # the lock object's bytes (made when the test runs: its times are now), what the message says
    "not JSON": (b'{"owner": "ana@gpu-07 pid 4242", "expires": ', "it is not JSON"),
    "JSON, not an object": (b'["ana@gpu-07 pid 4242", 4242]', "it is JSON but not an object (a list)"),
    "expires without timezone": (lambda: _live(expires="2999-01-01T00:00:00"),
                                 "'expires' has no timezone ('2999-01-01T00:00:00')"),
    "expires not a date": (lambda: _live(expires="next tuesday"), "'expires' is not a date ('next tuesday')"),
    "expires not a string": (lambda: _live(expires=17), "'expires' is not a date (17)"),
    "ttl_s a string": (lambda: _live(ttl_s="120"), "'ttl_s' is not a number of seconds from 0 to 3600 ('120')"),
    "ttl_s negative": (lambda: _live(ttl_s=-5), "'ttl_s' is not a number of seconds from 0 to 3600 (-5)"),
    "ttl_s huge": (lambda: _live(ttl_s=1e300), "'ttl_s' is not a number of seconds from 0 to 3600 (1e+300)"),
    "ttl_s NaN": (lambda: _live(ttl_s=float("nan")), "'ttl_s' is not a number of seconds from 0 to 3600 (nan)"),
    "fields missing": (b'{"owner": "ana@gpu-07 pid 4242"}', "no 'expires'"),
    "empty": (b"", "it is empty"),
    "binary garbage": (bytes(range(256)) * 4, "it is not UTF-8 text"),
    "nested 20,000 deep": (b"[" * 20_000 + b"]" * 20_000, "it is not JSON"),
}


_REAL_NOW = url_lock._now


def _later(monkeypatch, seconds: float) -> None:
    """The lock's clock (its ``_now``) ``seconds`` ahead of the real one: the stored object is that much older."""
    monkeypatch.setattr(url_lock, "_now", lambda: _REAL_NOW() + dt.timedelta(seconds=seconds))


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_lock_is_held_named_with_its_age_then_taken_over(fs, store, monkeypatch, case):
    """The attack: a lock whose body cannot be read (or whose expiry or time-to-live cannot) gave TypeError or
    ValueError, and every later build failed until the lock was removed by hand. Now it is held like any
    lock: the message names it, what is wrong with it and its age (from the object's last-modified time);
    once it is older than its time-to-live (the default 120 s when its own is unusable) a build takes it over,
    with the same conditional PUT as any takeover, and holds it."""
    endpoint, client = store
    data, problem = DAMAGED[case]
    data = data() if callable(data) else data
    key = f"damaged/{case.replace(' ', '-')}/x.shards/.lock"
    url = f"s3://{LOCKS}/{key}"
    client.put_object(Bucket=LOCKS, Key=key, Body=data)
    with pytest.raises(BuildError) as e:
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    msg = str(e.value)
    assert msg.startswith(f"another build of 'x' may be running: its lock {url} is damaged ({problem})"), msg
    assert re.search(r", last written \d s ago; it is held like any lock until it (is 120 s old|expires at \S+), "
                     r"then a build takes it over: wait for the build that holds it, or build again after that$",
                     msg), msg
    assert client.get_object(Bucket=LOCKS, Key=key)["Body"].read() == data       # left alone

    _later(monkeypatch, url_lock.TTL_S - 10)                                      # not yet
    with pytest.raises(BuildError, match=r"last written 1[01]\d s ago; it is held"):
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()

    _later(monkeypatch, url_lock.TTL_S + 5)
    taker = url_lock.UrlLock(fs, url, "'x'", conditional=True)
    with taker:
        assert stored(client, key)["nonce"] == taker.nonce
        assert taker.took_over.startswith(f"took over the stale build lock {url} (damaged: {problem}")
        assert re.search(r"(it was last written 1(2[5-9]|3\d) s ago, more than its time-to-live of 120 s|"
                         r"it expired at \S+ \(no heartbeat for 120 s\))$", taker.took_over), taker.took_over
        taker.check()
    assert stored(client, key) is None


def test_a_damaged_lock_keeps_its_own_usable_time_to_live(fs, store, monkeypatch):
    """An expiry that cannot be read with a usable ``ttl_s`` of 10 s: taken over 10 s after its last write."""
    endpoint, client = store
    key = "damaged/own-ttl/x.shards/.lock"
    url = f"s3://{LOCKS}/{key}"
    client.put_object(Bucket=LOCKS, Key=key, Body=_live(expires="soon", ttl_s=10))
    _later(monkeypatch, 5)
    with pytest.raises(BuildError, match=r"is damaged \('expires' is not a date \('soon'\)\) \(held by "
                                         r"ana@gpu-07 pid 4242 since .*, last written [5-9] s ago; it is held like "
                                         r"any lock until it is 10 s old"):
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    _later(monkeypatch, 12)
    with url_lock.UrlLock(fs, url, "'x'", conditional=True) as lk:
        assert re.search(r"\): it was last written 1[2-9] s ago, more than its time-to-live of 10 s$", lk.took_over)


def test_a_lock_whose_expiry_is_far_off_is_taken_over_a_ttl_after_its_last_write(fs, store, monkeypatch):
    """A lock whose expiry is centuries away (a flipped digit of its year: no holder writes an expiry more than
    an hour after its write) is damaged: held while it is written to, and taken over once its time-to-live
    has passed since its last write, instead of blocking every build until that year."""
    endpoint, client = store
    key = "damaged/far/x.shards/.lock"
    url = f"s3://{LOCKS}/{key}"
    client.put_object(Bucket=LOCKS, Key=key, Body=_live(expires="2999-01-01T00:00:00+00:00"))
    with pytest.raises(BuildError, match=r"^another build of 'x' may be running: its lock s3://\S+ is damaged "
                                         r"\('expires' is more than 3600 s after the lock was last written "
                                         r"\('2999-01-01T00:00:00\+00:00'\)\) \(held by ana@gpu-07 pid 4242 since "
                                         r"\S+, last heartbeat \S+\), last written \d s ago; it is held like any lock "
                                         r"until it is 120 s old"):
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    _later(monkeypatch, url_lock.TTL_S + 5)
    with url_lock.UrlLock(fs, url, "'x'", conditional=True) as lk:
        assert re.search(r"\): it was last written 1(2[5-9]|3\d) s ago, more than its time-to-live of 120 s$",
                         lk.took_over)


def test_a_damaged_lock_of_unknown_age_says_to_remove_it_by_hand(fs, store, monkeypatch):
    """A store that gives no modification time, and a body that gives no usable time either: the age cannot
    be told, so the lock is never taken over by itself; the message says so and names the object."""
    endpoint, client = store
    key = "damaged/ageless/x.shards/.lock"
    url = f"s3://{LOCKS}/{key}"
    client.put_object(Bucket=LOCKS, Key=key, Body=b"garbage")
    real = fs.info
    monkeypatch.setattr(fs, "info", lambda path, **kw: {k: v for k, v in real(path, **kw).items()
                                                        if k not in ("LastModified", "last_modified")})
    with pytest.raises(BuildError) as e:
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    assert str(e.value) == (f"another build of 'x' may be running: its lock {url} is damaged (it is not JSON), "
                            f"and its age cannot be told (the store gives no modification time): if no build of "
                            f"'x' is running, remove the lock object {url} by hand")


def test_a_huge_lock_object_is_not_read_and_values_echoed_are_cut(fs, store, monkeypatch):
    endpoint, client = store
    key = "damaged/huge/x.shards/.lock"
    url = f"s3://{LOCKS}/{key}"
    client.put_object(Bucket=LOCKS, Key=key, Body=b"x" * (1 << 20))
    reads = []
    real = fs.cat_file
    monkeypatch.setattr(fs, "cat_file", lambda path, *a, **kw: (reads.append(path), real(path, *a, **kw))[1])
    with pytest.raises(BuildError, match=r"is damaged \(it is 1048576 bytes, more than a lock body\), last "
                                         r"written \d s ago"):
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    assert reads == []
    client.put_object(Bucket=LOCKS, Key=key, Body=_live(owner="o" * 20_000, started=["x"] * 2_000,
                                                          expires="z" * 20_000))
    with pytest.raises(BuildError) as e:
        url_lock.UrlLock(fs, url, "'x'", conditional=True).acquire()
    assert len(str(e.value)) < 800 and "held by oooo" in str(e.value) and "'expires' is not a date ('zzz" in \
        str(e.value), str(e.value)


@pytest.mark.parametrize("pid", ["4242", True, -1, 0, 2**70, 4242.0, None])
def test_a_holder_with_a_pid_that_is_no_pid_is_never_gone(me, pid):
    """Only a positive int of this machine's pid space names a process: anything else waits for the expiry
    (a huge pid gave OverflowError, -1 or 0 would name a group)."""
    assert url_lock.stale_reason({**me, **FUTURE, "pid": pid}) is None
