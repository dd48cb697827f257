"""The build lock of an output at a URL: one object, ``<name>.shards/.lock``, created with a conditional PUT.

Object stores have no ``flock``. The lock is a small JSON object (owner, host, pid, when it was taken, its
last heartbeat, when it expires, a random ``nonce`` of this holder and its process identity) created with
``If-None-Match: *``: of two builders only one creates it, the other gets "precondition failed" and stops
with a :class:`~precompile.errors.BuildError` that names the lock and its holder (as a second local build
does). The holder refreshes it every :data:`HEARTBEAT_S` seconds with ``If-Match: <its ETag>``; a build
that is killed stops refreshing, and its lock is taken over (``If-Match`` on the stale ETag, so of two
builders taking over only one wins) once it has expired (:data:`TTL_S` after the last heartbeat, by the
holder's clock: builders' clocks must agree to within a fraction of it; a damaged lock: below), or at once
when its process is known to be gone (:func:`process_gone`).

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

A lock object that cannot be read (not JSON, not an object, empty, binary, larger than any lock body) or
whose expiry or time-to-live cannot (no ``expires``, one without a timezone or not a date, a ``ttl_s`` that
is not a number of seconds up to :data:`MAX_TTL_S`) is *damaged* (:func:`read_lock`): it is held like any
lock, and the message names it, what is wrong and its age; it is taken over, with the same conditional PUT
as any stale lock, once it expired (a usable ``expires``), or else once its time-to-live (its own when
usable, else :data:`TTL_S`) has passed since the object was last written. That age is the store's: the
object's last-modified time (:func:`modified_of`), which every PUT of a holder renews (a body's own times
are the holder's clock, and may be what is damaged). An ``expires`` more than :data:`MAX_TTL_S` after the
object's last write is damage too (a holder writes its heartbeat's time plus its TTL), so a lock whose
expiry is centuries away (a flipped digit) blocks no longer than a TTL after it was last written. A sound
lock is judged by its expiry alone, as before. Values echoed from a lock body are cut (:func:`shown`).

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
import math
import os
import reprlib
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import __version__
from ..errors import BuildError

#: seconds after its last heartbeat that a lock is stale (another build may take it over)
TTL_S = 120.0
#: seconds between heartbeats
HEARTBEAT_S = 30.0
#: the largest ``ttl_s`` a lock body may give (a larger one is unusable: :data:`TTL_S` applies)
MAX_TTL_S = 3600.0
#: a lock object larger than this is no lock body (this package writes about 500 bytes): it is not read
MAX_LOCK_BYTES = 64 << 10
#: the largest pid a lock body may name (Linux's pid_max is at most 2**22)
MAX_PID = 2 ** 31 - 1

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 4, 4


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
    if not _is_pid(pid) or any(holder.get(k) is None or holder.get(k) != mine[k]
                                       for k in ("host", "boot_id", "pid_ns")):
        return None
    if not pid_alive(pid):
        return f"its process {pid} on this host is gone"
    started = pid_start(pid)
    if started is not None and _is_int(holder.get("pid_start")) and started != holder["pid_start"]:
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pid(v: Any) -> bool:
    """A pid that names one process (not a group: 0, -1; not a bool; not beyond any pid space)."""
    return _is_int(v) and 0 < v <= MAX_PID


def shown(v: Any) -> str:
    """A value from a lock body for a message: its repr, cut to a bounded length."""
    return _REPR.repr(v)


def _text(v: Any) -> str:
    """A lock body's informational value (owner, times) for a message: a string as it is, else its repr; cut."""
    if isinstance(v, str):
        return v if len(v) <= 60 else v[:57] + "..."
    return shown(v)


@dataclass
class StoredLock:
    """The lock object as found: its ``body`` (the JSON object; {} when it cannot be read), what is
    ``damaged`` in it (why it cannot be read, or which of its times cannot: [] for a sound lock), the store's
    ETag and the object's last-modified time (``modified``; None when the store gives none)."""

    body: dict[str, Any]
    damaged: list[str] = field(default_factory=list)
    etag: Optional[str] = None
    modified: Optional[_dt.datetime] = None

    def unreadable(self) -> bool:
        """True when nothing of the body could be read (not a JSON object)."""
        return bool(self.damaged) and not self.body


def read_lock(data: bytes, etag: Optional[str] = None, modified: Optional[_dt.datetime] = None) -> StoredLock:
    """The lock object's bytes ``data`` read as a :class:`StoredLock` (never raises)."""
    if not data:
        return StoredLock({}, ["it is empty"], etag, modified)
    if len(data) > MAX_LOCK_BYTES:
        return StoredLock({}, [f"it is {len(data)} bytes, more than a lock body"], etag, modified)
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return StoredLock({}, ["it is not UTF-8 text"], etag, modified)
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return StoredLock({}, ["it is not JSON"], etag, modified)
    if not isinstance(body, dict):
        kind = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
        return StoredLock({}, [f"it is JSON but not an object ({kind.get(type(body), 'null')})"], etag, modified)
    damaged = [why for why in (_expires(body, modified)[1], _ttl(body)[1]) if why]
    return StoredLock(body, damaged, etag, modified)


def _expires(holder: dict[str, Any], modified: Optional[_dt.datetime] = None
             ) -> tuple[Optional[_dt.datetime], Optional[str]]:
    """(the body's ``expires`` as an aware datetime, None) or (None, why it cannot be used): none, not a date,
    no timezone, or (``modified``: when the store last wrote the object) more than :data:`MAX_TTL_S` after that
    write, which no holder writes (its expiry is its heartbeat's time plus its TTL)."""
    v = holder.get("expires")
    if v is None:
        return None, "no 'expires'"
    if not isinstance(v, str):
        return None, f"'expires' is not a date ({shown(v)})"
    try:
        t = _dt.datetime.fromisoformat(v)
    except ValueError:
        return None, f"'expires' is not a date ({shown(v)})"
    if t.tzinfo is None or t.utcoffset() is None:
        return None, f"'expires' has no timezone ({shown(v)})"
    try:
        t = t.astimezone(_dt.timezone.utc)
    except (OverflowError, ValueError):   # beyond datetime's range in UTC (year 1 or 9999 with an offset)
        return None, f"'expires' is not a date ({shown(v)})"
    if modified is not None and (t - modified).total_seconds() > MAX_TTL_S:
        return None, f"'expires' is more than {MAX_TTL_S:.0f} s after the lock was last written ({shown(v)})"
    return t, None


def _ttl(holder: dict[str, Any]) -> tuple[float, Optional[str]]:
    """(the body's time-to-live in seconds, None), or (:data:`TTL_S`, why its own cannot be used); a body
    without ``ttl_s`` gets :data:`TTL_S` (not damage)."""
    if "ttl_s" not in holder:
        return TTL_S, None
    v = holder["ttl_s"]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not 0 < v <= MAX_TTL_S):
        return TTL_S, f"'ttl_s' is not a number of seconds from 0 to {MAX_TTL_S:.0f} ({shown(v)})"
    return float(v), None


def modified_of(info: dict[str, Any]) -> Optional[_dt.datetime]:
    """The object's last-modified time from the store's ``info`` (aware, UTC), or None when it gives none
    (s3fs: ``LastModified``; other fsspec stores: ``last_modified``, ``mtime``, ``updated``, ``created``)."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "modified", "created"):
        v = info.get(key)
        try:
            if isinstance(v, _dt.datetime):
                t = v
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                t = _dt.datetime.fromtimestamp(v, _dt.timezone.utc)
            elif isinstance(v, str):
                t = _dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
            else:
                continue
            return (t if t.tzinfo is not None else t.replace(tzinfo=_dt.timezone.utc)).astimezone(_dt.timezone.utc)
        except (ValueError, OverflowError, OSError):
            continue
    return None


def lock_age(modified: Optional[_dt.datetime], now: Optional[_dt.datetime] = None) -> Optional[float]:
    """Seconds since the lock object was last written (by the store's clock against ours), or None."""
    if modified is None:
        return None
    return max(0.0, ((now or _now()) - modified).total_seconds())


def stale_reason(holder: dict[str, Any], now: Optional[_dt.datetime] = None,
                 modified: Optional[_dt.datetime] = None) -> Optional[str]:
    """Why the lock ``holder`` (its JSON; {} when it cannot be read), last written at ``modified`` (the
    store's time; None: unknown), may be taken over, or None while it holds: its process is gone; its
    ``expires`` has passed (the holder's clock, as always); or, when its ``expires`` cannot be used (damaged:
    :func:`_expires`), its time-to-live (its ``ttl_s``, or :data:`TTL_S`) has passed since the store last
    wrote it. A sound lock is judged by its own expiry alone, as before damaged ones were handled."""
    now = now or _now()
    gone = process_gone(holder)
    if gone:
        return gone
    expires, _ = _expires(holder, modified)
    ttl, _ = _ttl(holder)
    if expires is not None:
        return f"it expired at {_text(holder['expires'])} (no heartbeat for {ttl:.0f} s)" if expires < now else None
    age = lock_age(modified, now)
    if age is not None and age > ttl:
        return f"it was last written {age:.0f} s ago, more than its time-to-live of {ttl:.0f} s"
    return None


def describe(holder: dict[str, Any], damaged: Optional[list[str]] = None) -> str:
    """'held by user@host pid 123 since ..., last heartbeat ...' for messages (``damaged``: what cannot be
    read, said first); values from the body cut."""
    words = f"held by {_text(holder.get('owner', '?'))} since {_text(holder.get('started', '?'))}, last " \
            f"heartbeat {_text(holder.get('heartbeat', '?'))}"
    if not damaged:
        return words
    return f"damaged: {', '.join(damaged)}" + (f"; {words}" if holder else "")


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

    def _stored(self) -> Optional[StoredLock]:
        """The lock object now (:func:`read_lock`: never raises for its content), or None when there is none.
        The ETag is read before the body: when the body is ours, so is the version the ETag names (no other
        writer puts our nonce back, and this holder sends one request at a time), so :meth:`_ours` may adopt
        it. An object larger than any lock body is not read."""
        self.fs.invalidate_cache(self.url)
        try:
            info = self.fs.info(self.url)
            size = info.get("size")
            if isinstance(size, int) and size > MAX_LOCK_BYTES:
                return StoredLock({}, [f"it is {size} bytes, more than a lock body"], info.get("ETag"),
                                  modified_of(info))
            data = self.fs.cat_file(self.url)
        except FileNotFoundError:
            return None
        return read_lock(data, info.get("ETag"), modified_of(info))

    def _ours(self) -> bool:
        """Whether the stored lock is this holder's (its nonce); adopts its ETag (a PUT of ours whose answer
        was lost was applied)."""
        found = self._stored()
        if found is None or found.body.get("nonce") != self.nonce:
            return False
        self.etag = found.etag
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
            found = self._stored()
            if found is not None and found.body.get("nonce") == self.nonce:   # our create, its answer lost
                self.etag, self._last_ok = found.etag, sent
                return
            if found is not None and self._take_over(found):
                return
        raise BuildError(f"cannot take the build lock {self.url}: other builds of {self.what} keep taking "
                         f"and releasing it; run build again")

    def _take_over(self, found: StoredLock) -> bool:
        """Take over the stale lock ``found``: True when done, False when it changed meanwhile (look again);
        BuildError while it holds."""
        holder, now = found.body, _now()
        why = stale_reason(holder, now, found.modified)
        if why is None:
            raise BuildError(self._held(found, now))
        etag = found.etag
        try:
            self._put(**({"IfMatch": etag} if self.conditional and etag else {}))
        except OSError as e:
            if not _refused(e):
                raise
            if not self._ours():   # another builder took it over first (or it was released): look again
                return False
        self.took_over = f"took over the stale build lock {self.url} ({describe(holder, found.damaged)}): {why}"
        return True

    def _held(self, found: StoredLock, now: _dt.datetime) -> str:
        """The message for the lock ``found``, which holds: its holder (what is damaged in it) and its age."""
        age = lock_age(found.modified, now)
        written = f", last written {age:.0f} s ago" if age is not None else ""
        if not found.damaged:
            return (f"another build of {self.what} is running (lock {self.url}, {describe(found.body)}{written}); "
                    f"wait for it to finish (a lock without a heartbeat for {TTL_S:.0f} s is taken over)")
        lead = (f"another build of {self.what} may be running: its lock {self.url} is damaged "
                f"({', '.join(found.damaged)})" + (f" ({describe(found.body)})" if found.body else ""))
        expires = _expires(found.body, found.modified)[0]
        if expires is not None:   # only its ttl_s is damaged: it expires as any lock does
            until = f"until it expires at {_text(found.body['expires'])}"
        elif age is None:
            return (f"{lead}, and its age cannot be told (the store gives no modification time): if no build of "
                    f"{self.what} is running, remove the lock object {self.url} by hand")
        else:
            until = f"until it is {_ttl(found.body)[0]:.0f} s old"
        return (f"{lead}{written}; it is held like any lock {until}, then a build takes it over: wait for the "
                f"build that holds it, or build again after that")

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
