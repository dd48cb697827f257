"""The shard cache's locks between processes of a node (precompile/storage/shard_cache.py), without a store: processes with
several threads waiting on each other's downloads, a lock file opened and closed elsewhere in a process, a reader
that forked workers and was killed, and the space a download takes on disk."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precompile.storage.shard_cache import ShardCache

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the shard cache needs POSIX record locks")


def blob(n: int, size: int = 50_000) -> tuple[bytes, str]:
    data = bytes([n]) * size
    return data, hashlib.sha256(data).hexdigest()


def spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=ENV, stdout=subprocess.PIPE, text=True)


CROSS = r"""
import hashlib, json, os, sys, threading, time
from precompile.storage.shard_cache import ShardCache
cache, me, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
data = {n: bytes([n]) * 50_000 for n in (0, 1)}
sha = {n: hashlib.sha256(d).hexdigest() for n, d in data.items()}
c = ShardCache(cache, 1 << 20)
mark = lambda name: open(os.path.join(out, name), "w").close()
seen = lambda name: os.path.exists(os.path.join(out, name))

def slow(a, b):   # holds this file's download lock while the other process's second thread waits for it
    mark(f"fetching-{me}")
    while not seen(f"fetching-{1 - me}"):
        time.sleep(0.01)
    time.sleep(1.0)
    return data[me][a:b]

errors = []
def get(n, read):
    try:
        path = c.open(sha[n], len(data[n]), f"mem://x/{n}", read)
        assert open(path, "rb").read() == data[n]
        c.unpin(sha[n])
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")

first = threading.Thread(target=get, args=(me, slow))
first.start()
while not (seen("fetching-0") and seen("fetching-1")):
    time.sleep(0.01)
get(1 - me, lambda a, b: data[1 - me][a:b])   # downloaded by the other process: waits for it, then a hit
first.join()
print(json.dumps({"errors": errors, "downloads": c.stats.downloads, "hits": c.stats.hits}))
"""


def test_threads_of_two_processes_wait_for_each_others_downloads(tmp_path):
    """Each process downloads one file in one thread and asks for the other's in a second: the waits cross
    between processes but no thread waits on itself. POSIX record locks are deadlock-checked per process, so
    Linux failed one wait with EDEADLK ('Resource deadlock avoided'); the cache's locks belong to its open file."""
    out = tmp_path / "out"
    out.mkdir()
    procs = [spawn(CROSS, tmp_path / "c", me, out) for me in (0, 1)]
    got = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert got == [{"errors": [], "downloads": 1, "hits": 1}] * 2
    assert sorted(os.listdir(tmp_path / "c" / "files")) == sorted(f"{blob(n)[1]}.h5" for n in (0, 1))


EVICT = r"""
import sys
from precompile.storage.shard_cache import ShardCache
data = bytes([7]) * int(sys.argv[3])
import hashlib
got = ShardCache(sys.argv[1], int(sys.argv[2])).open(hashlib.sha256(data).hexdigest(), len(data), "mem://x/7",
                                                     lambda a, b: data[a:b], wait=False)
print("no room" if got is None else "evicted")
"""


def evict_from_another_process(cache: Path, limit: int, size: int) -> str:
    """What a download of ``size`` bytes that needs every other file gone finds in another process."""
    p = spawn(EVICT, cache, limit, size)
    return p.communicate(timeout=60)[0].strip()


def test_a_pin_survives_the_lock_file_closed_elsewhere_in_the_process(tmp_path):
    """A POSIX record lock is dropped when its process closes any descriptor of the file; a pin must not be."""
    cache = ShardCache(tmp_path / "c", 120_000)
    data, sha = blob(1)
    path = cache.open(sha, len(data), "mem://x/1", lambda a, b: data[a:b])
    os.close(os.open(tmp_path / "c" / "locks", os.O_RDONLY))   # e.g. a second ShardCache state, a stray tool
    assert evict_from_another_process(tmp_path / "c", 120_000, 100_000) == "no room"
    assert Path(path).read_bytes() == data
    cache.unpin(sha)
    assert evict_from_another_process(tmp_path / "c", 120_000, 100_000) == "evicted"
    assert not Path(path).exists()


FORKER = r"""
import hashlib, os, sys, time
from precompile.storage.shard_cache import ShardCache
data = bytes([1]) * 50_000
c = ShardCache(sys.argv[1], 120_000)
c.open(hashlib.sha256(data).hexdigest(), len(data), "mem://x/1", lambda a, b: data[a:b])
child = os.fork()
if child == 0:   # a worker forked while the file is pinned (a DataLoader worker): outlives its parent
    time.sleep(60)
    os._exit(0)
print("pinned", child, flush=True)
time.sleep(60)
"""


def test_a_killed_reader_with_forked_workers_leaves_no_pins(tmp_path):
    """Locks that belong to an open file are shared by a forked child that keeps the descriptor: the child
    must not keep its killed parent's pins."""
    p = spawn(FORKER, tmp_path / "c")
    child = None
    try:
        word, pid = p.stdout.readline().split()
        assert word == "pinned"
        child = int(pid)
        assert evict_from_another_process(tmp_path / "c", 120_000, 100_000) == "no room"
        p.kill()
        p.wait()
        assert evict_from_another_process(tmp_path / "c", 120_000, 100_000) == "evicted"
    finally:
        for pid in (p.pid, child):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        p.wait()
        p.stdout.close()


def test_a_download_takes_its_disk_space_before_its_bytes_arrive(tmp_path):
    """The limit counts a download at its full size from the start: its blocks are allocated then too, so a
    full disk is found before anything is read (where the file system allocates ahead: ext4, xfs, tmpfs)."""
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("os.posix_fallocate is absent on this platform (the .part file is then sparse)")
    size = 3 << 20
    data, sha = blob(3, size)
    seen = []

    def read(a: int, b: int) -> bytes:
        part = tmp_path / "c" / "files" / f"{sha}.part"
        seen.append((os.stat(part).st_size, os.stat(part).st_blocks * 512))
        return data[a:b]

    cache = ShardCache(tmp_path / "c", 8 << 20)
    path = cache.open(sha, len(data), "mem://x/3", read)
    assert seen[0][0] == size and seen[0][1] >= size, seen
    assert Path(path).read_bytes() == data


WAITER = r"""
import hashlib, sys
import precompile.storage.cache_room as room
import precompile.storage.shard_cache as sc
room.WAIT_S = 30.0
data = bytes([9]) * 100_000
print("asking", flush=True)
sc.ShardCache(sys.argv[1], 120_000).open(hashlib.sha256(data).hexdigest(), len(data), "mem://x/9",
                                         lambda a, b: data[a:b])
print("got it", flush=True)
"""


def test_a_prefetch_takes_no_room_while_another_process_waits_for_some(tmp_path):
    """Room(prefetch=True): a download that fits is not made while a read elsewhere waits for room (a Loader's
    fetch ahead gives way to the batches of every process on the node)."""
    from precompile.storage.shard_cache import Room

    cache = ShardCache(tmp_path / "c", 120_000)
    (a, sha_a), (b, sha_b) = blob(1), blob(2, 20_000)
    cache.open(sha_a, len(a), "mem://x/1", lambda s, e: a[s:e])   # pinned: the waiter's 100 000 bytes cannot fit
    p = spawn(WAITER, tmp_path / "c")
    try:
        assert p.stdout.readline().strip() == "asking"
        refused, deadline = False, time.monotonic() + 20
        while not refused and time.monotonic() < deadline:   # until the other process is in its wait
            got = cache.open(sha_b, len(b), "mem://x/2", lambda s, e: b[s:e], wait=False, room=Room(prefetch=True))
            refused = got is None
            if got is not None:
                cache.unpin(sha_b)
                os.remove(got)
            time.sleep(0.05)
        assert refused   # 50 000 + 20 000 bytes fit in 120 000: refused only because the other process waits
        cache.unpin(sha_a)
        assert p.stdout.readline().strip() == "got it" and p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    got = cache.open(sha_b, len(b), "mem://x/2", lambda s, e: b[s:e], wait=False, room=Room(prefetch=True))
    assert got is not None and Path(got).read_bytes() == b   # nobody waits now


def test_a_download_first_lets_go_of_the_callers_files(tmp_path):
    """Room(let_go=...): before it waits, the caller lets go of its own files, and the download goes on."""
    from precompile.storage.shard_cache import Room

    cache = ShardCache(tmp_path / "c", 120_000)
    (a, sha_a), (b, sha_b) = blob(1), blob(2)
    cache.open(sha_a, len(a), "mem://x/1", lambda s, e: a[s:e])
    cache.open(sha_b, len(b), "mem://x/2", lambda s, e: b[s:e])   # both pinned: 100 000 of 120 000 bytes
    c, sha_c = blob(3)   # 150 000 bytes with the two: the caller lets go of one, then it fits
    calls = []

    def let_go() -> bool:
        calls.append(len(calls))
        if len(calls) > 1:
            return False
        cache.unpin(sha_a)
        return True

    assert cache.open(sha_c, len(c), "mem://x/3", lambda s, e: c[s:e], room=Room(let_go=let_go)) is not None
    assert calls == [0] and sorted(os.listdir(tmp_path / "c" / "files")) == sorted(f"{h}.h5" for h in (sha_b, sha_c))
    assert cache.stats.evictions == 1
