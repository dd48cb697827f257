"""The build lock of an output at a URL: one object, ``<name>.shards/.lock``, created with a conditional PUT.

Object stores have no ``flock``. The lock is a small JSON object (owner, host, pid, when it was taken, its
last heartbeat, when it expires, a random ``nonce`` of this holder and its process identity) created with
``If-None-Match: *``: of two builders only one creates it, the other gets "precondition failed" and stops
with a :class:`~precompile.errors.BuildError` that names the lock and its holder (as a second local build
does). The holder refreshes it every :data:`HEARTBEAT_S` seconds with ``If-Match: <its ETag>``; a build
that is killed stops refreshing, and its lock is taken over (``If-Match`` on the stale ETag, so of two
builders taking over only one wins) once it has expired (:data:`TTL_S` after the last heartbeat, by the
holder's clock: builders' clocks must agree to within a fraction of it), or at once when its process is
known to be gone (:func:`process_gone`).

Owning the lock is decided by the store, never assumed:

- a PUT whose answer is lost (a timeout; botocore sends it again) may have been applied: the next
  ``If-Match`` (or the create's ``If-None-Match``) then gets 412. On a 412 the holder reads the object
  (HEAD, then GET) and, when the body's nonce is its own, adopts the stored ETag and goes on;
- :meth:`UrlLock.check`, called before the index is written and before any object is removed, sends a
  heartbeat itself: it passes only when that conditional PUT succeeds (a fresh expiry: a full TTL for
  the write that follows), and fails when the object is another builder's or gone;
- a lock whose last successful heartbeat was sent more than :data:`TTL_S` ago (a partition, a stall, a
  suspended machine: :func:`elapsed`) is lost for good, even when the store answers again: another
  builder may have taken it over, collected, and released it meanwhile;
- a build that stops (lost lock, error, or done) removes the lock object only when it is still its own:
  refreshed with ``If-Match`` first, so that no takeover can be under way while it is deleted.

The window left (a takeover between :meth:`~UrlLock.check` and the index PUT) needs that PUT to take the
whole TTL.

Conditional requests are S3's (AWS since 2024, moto, MinIO), sent when the client can (s3fs >= 2024.12 and
a botocore that knows ``IfNoneMatch`` / ``IfMatch``: :func:`conditional_puts`); otherwise, and on other
stores, the lock is created by "exists, then write", and refreshed by "read the nonce, then write", which
two builders acting within the same instant can both pass: there, start one build of an output at a time
(docs/faults.md, "Concurrent builders").
"""
from __future__ import annotations

import datetime as _dt
import functools
import getpass
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Optional

from .. import __version__
from ..errors import BuildError

#: seconds after its last heartbeat that a lock is stale (another build may take it over)
TTL_S = 120.0
#: seconds between heartbeats
HEARTBEAT_S = 30.0


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def elapsed() -> float:
    """Seconds on a clock that never goes back and keeps counting while the machine is suspended (Linux
    ``CLOCK_BOOTTIME``; elsewhere ``time.monotonic``): the age of a heartbeat."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` of this pid namespace exists (or may: another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _proc_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pid_start(pid: int) -> Optional[int]:
    """When process ``pid`` started (field 22 of ``/proc/<pid>/stat``: clock ticks after boot), or None
    where that cannot be read (no such process, no ``/proc``)."""
    text = _proc_text(f"/proc/{pid}/stat")
    try:   # the name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
        return int(text.rsplit(")", 1)[1].split()[19]) if text else None
    except (IndexError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _this_machine() -> tuple[Optional[str], Optional[str]]:
    """(boot id, pid namespace) of this process: the kernel's boot and the namespace its pids belong to."""
    try:
        ns: Optional[str] = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    return _proc_text("/proc/sys/kernel/random/boot_id"), ns


def process_identity() -> dict[str, Any]:
    """What tells this process apart from every other, in the lock body: host name, boot id, pid namespace,
    pid and its start time (the Linux ones None elsewhere)."""
    boot, ns = _this_machine()
    return {"host": socket.gethostname(), "boot_id": boot, "pid_ns": ns, "pid": os.getpid(),
            "pid_start": pid_start(os.getpid())}


def process_gone(holder: dict[str, Any]) -> Optional[str]:
    """Why the process that wrote the lock ``holder`` is known to be gone, or None. Known only where its pid
    means the same process here: the same host name, boot id and pid namespace (containers that share a host
    name but not a pid namespace, or another machine of the same name, never qualify); then its pid is gone,
    or belongs to a process started at another time (the pid was reused)."""
    pid, mine = holder.get("pid"), process_identity()
    if not isinstance(pid, int) or any(holder.get(k) is None or holder.get(k) != mine[k]
                                       for k in ("host", "boot_id", "pid_ns")):
        return None
    if not pid_alive(pid):
        return f"its process {pid} on this host is gone"
    started = pid_start(pid)
    if started is not None and isinstance(holder.get("pid_start"), int) and started != holder["pid_start"]:
        return f"its process {pid} on this host is gone (the pid is now another process's)"
    return None


def conditional_puts(fs: Any) -> bool:
    """True when ``fs`` (an s3fs filesystem) sends ``If-None-Match`` / ``If-Match`` with a PUT: its
    ``pipe_file`` takes ``mode="create"`` and botocore's PutObject knows both conditions."""
    import inspect

    if "mode" not in inspect.signature(fs._pipe_file).parameters:
        return False
    try:
        client = getattr(fs, "s3", None)   # the filesystem's connected client: its model is loaded already
        if client is not None:
            model = client.meta.service_model
        else:
            import botocore.session

            model = botocore.session.get_session().get_service_model("s3")
        members = model.operation_model("PutObject").input_shape.members
    except Exception:  # not botocore's store, or a model that cannot be read: no conditions
        return False
    return "IfNoneMatch" in members and "IfMatch" in members


def _refused(e: BaseException) -> bool:
    """A conditional PUT the store refused: 412 (the object changed, or appeared, since we looked), or 404
    for ``If-Match`` on an object that is gone."""
    text = str(e).lower()
    return isinstance(e, FileNotFoundError) or \
        (isinstance(e, OSError) and ("pre-condition" in text or "precondition" in text))


def stale_reason(holder: dict[str, Any], now: Optional[_dt.datetime] = None) -> Optional[str]:
    """Why the lock ``holder`` (its JSON) may be taken over, or None while it holds."""
    now = now or _now()
    gone = process_gone(holder)
    if gone:
        return gone
    try:
        expires = _dt.datetime.fromisoformat(str(holder["expires"]))
    except (KeyError, ValueError):
        return "it is unreadable"
    if expires < now:
        return f"it expired at {holder['expires']} (no heartbeat for {holder.get('ttl_s', TTL_S):.0f} s)"
    return None


def describe(holder: dict[str, Any]) -> str:
    """'user@host pid 123, since ..., last heartbeat ...' for messages."""
    return (f"held by {holder.get('owner', '?')} since {holder.get('started', '?')}, last heartbeat "
            f"{holder.get('heartbeat', '?')}")


class UrlLock:
    """The lock object at ``url`` (see the module docstring); ``with UrlLock(...)`` holds it."""

    def __init__(self, fs: Any, url: str, what: str, conditional: bool):
        self.fs, self.url, self.what = fs, url, what
        self.conditional = conditional      # the store takes If-Match / If-None-Match (S3)
        self.nonce = secrets.token_hex(16)  # this holder's mark in the body: a lock with it is ours
        self.etag: Optional[str] = None
        self.lost: Optional[str] = None
        self.taken = False                  # the object is another builder's (or gone): never remove it
        self.started = _now().replace(microsecond=0).isoformat()
        self._last_ok: Optional[float] = None   # elapsed() when the last PUT that succeeded was sent
        self._mutex = threading.Lock()      # one writer at a time: the heartbeat thread, check(), release
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.took_over: Optional[str] = None   # why a stale lock was taken over (for the report's events)

    def body(self) -> bytes:
        now = _now()
        user = _user()
        ident = process_identity()
        return json.dumps({
            **ident, "owner": f"{user}@{ident['host']} pid {ident['pid']}", "user": user, "nonce": self.nonce,
            "started": self.started, "heartbeat": now.replace(microsecond=0).isoformat(),
            "expires": (now + _dt.timedelta(seconds=TTL_S)).isoformat(), "ttl_s": TTL_S,
            "precompile_version": __version__}, sort_keys=True).encode()

    def _put(self, **cond: Any) -> None:
        sent = elapsed()    # before the body: the expiry it records is counted from no earlier than this
        out = self.fs.pipe_file(self.url, self.body(), **cond)
        self.etag = out.get("ETag") if isinstance(out, dict) else None   # None: read with the nonce (_ours)
        self._last_ok = sent

    def _stored(self) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """(ETag, body) of the lock object now, or (None, None) when there is none. The ETag is read before
        the body: when the body is ours, so is the version the ETag names (no other writer puts our nonce
        back, and this holder sends one request at a time), so :meth:`_ours` may adopt it."""
        self.fs.invalidate_cache(self.url)
        try:
            etag = self.fs.info(self.url).get("ETag")
            text = self.fs.cat_file(self.url)
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        return etag, holder if isinstance(holder, dict) else {}

    def _ours(self) -> bool:
        """Whether the stored lock is this holder's (its nonce); adopts its ETag (a PUT of ours whose answer
        was lost was applied)."""
        etag, holder = self._stored()
        if holder is None or holder.get("nonce") != self.nonce:
            return False
        self.etag = etag
        return True

    def _rewrite(self) -> bool:
        """Write the lock again if it is still ours: ``If-Match`` (on a refusal, once more with the stored
        ETag when the stored body is ours), or without conditions "read the nonce, then write". False when
        the object is another builder's or gone; the store's other errors are raised."""
        if not self.conditional:
            if not self._ours():
                return False
            self._put()
            return True
        for again in (False, True):
            if self.etag is not None:   # else no ETag of ours is known yet (a PUT that raised): read it
                try:
                    self._put(IfMatch=self.etag)
                    return True
                except OSError as e:
                    if not _refused(e):
                        raise
            if again or not self._ours():
                return False
        return False

    def _refresh(self) -> None:
        """One heartbeat: the lock rewritten while it is ours; ``lost`` set when it is not (or when the last
        successful heartbeat is older than the TTL). The store's errors are raised."""
        with self._mutex:
            if self.lost:
                return
            age = elapsed() - self._last_ok if self._last_ok is not None else 0.0
            if age > TTL_S:
                self.lost = (f"no heartbeat of the build lock {self.url} reached the store for {age:.0f} s (more "
                             f"than its {TTL_S:.0f} s expiry): another build may have taken it over meanwhile")
            elif not self._rewrite():
                self.taken = True
                self.lost = f"the build lock {self.url} was taken over by another build (or removed)"

    def acquire(self) -> None:
        """Create the lock object, or take over a stale one; BuildError while another build holds it."""
        for _ in range(3):   # the holder may release it between our create and our read
            sent = elapsed()
            try:
                if self.conditional:
                    self._put(mode="create")
                    return
                self.fs.invalidate_cache(self.url)
                if not self.fs.exists(self.url):
                    self._put()
                    return
            except FileExistsError:
                pass
            etag, holder = self._stored()
            if holder is not None and holder.get("nonce") == self.nonce:   # our create, its answer lost
                self.etag, self._last_ok = etag, sent
                return
            if holder is not None and self._take_over(etag, holder):
                return
        raise BuildError(f"cannot take the build lock {self.url}: other builds of {self.what} keep taking "
                         f"and releasing it; run build again")

    def _take_over(self, etag: Optional[str], holder: dict[str, Any]) -> bool:
        """Take over the stale lock ``holder`` (stored as ``etag``): True when done, False when it changed
        meanwhile (look again); BuildError while it holds."""
        why = stale_reason(holder)
        if why is None:
            raise BuildError(f"another build of {self.what} is running (lock {self.url}, {describe(holder)}); "
                             f"wait for it to finish (a lock without a heartbeat for {TTL_S:.0f} s is taken over)")
        try:
            self._put(**({"IfMatch": etag} if self.conditional and etag else {}))
        except OSError as e:
            if not _refused(e):
                raise
            if not self._ours():   # another builder took it over first (or it was released): look again
                return False
        self.took_over = f"took over the stale build lock {self.url} ({describe(holder)}): {why}"
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S) and not self.lost:
            try:
                self._refresh()
            except Exception:  # a network error: try again at the next beat (the TTL covers several)
                continue

    def check(self) -> None:
        """Raise BuildError unless the lock is still this build's, confirmed by the store now: a heartbeat is
        sent (see the module docstring). Called before anything the lock protects is written; an
        unreachable store raises its own error (nothing is written then)."""
        self._refresh()
        if self.lost:
            raise BuildError(f"build of {self.what} stopped: {self.lost}; nothing was removed and the index was "
                             f"not replaced; finished shards are kept, run build again")

    def release(self) -> None:
        """Remove the lock object if it is still ours (rewritten first, so no takeover is under way)."""
        if self.taken:
            return
        try:
            with self._mutex:
                if self._rewrite():
                    self.fs.rm_file(self.url)
        except Exception:  # the store is unreachable: the lock expires by itself
            pass

    def __enter__(self) -> "UrlLock":
        try:
            self.acquire()
        except BuildError:
            raise
        except Exception:   # the store's error after a PUT of ours that it may have applied: remove that
            self.release()
            raise
        self._thread = threading.Thread(target=self._beat, name="precompile-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.release()


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (a container without /etc/passwd entry)
        return "?"
