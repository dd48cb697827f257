"""The build lock of an output at a URL: one object, ``<name>.shards/.lock``, created with a conditional PUT.

Object stores have no ``flock``. The lock is a small JSON object (owner, host, pid, when it was taken, its
last heartbeat and when it expires) created with ``If-None-Match: *``: of two builders only one creates
it, the other gets "precondition failed" and stops with a :class:`~precompile.errors.BuildError` that
names the lock and its holder (as a second local build does). The holder refreshes it every
:data:`HEARTBEAT_S` seconds with ``If-Match: <its ETag>``; a build that is killed stops refreshing, and
its lock is taken over (``If-Match`` on the stale ETag, so of two builders taking over only one wins)
once it has expired (:data:`TTL_S` after the last heartbeat, by the holder's clock: builders' clocks must
agree to within a fraction of it), or at once by a build on the same host when the holder's pid is gone.

A holder whose heartbeat is refused (another builder took the lock over: this one was stalled for longer
than the TTL) has lost it: :meth:`UrlLock.check`, called before the index is written and before any
object is removed, stops the build. The window left (a takeover between that check and the PUT) needs a
build stalled for the whole TTL at exactly that moment.

Conditional requests are S3's (AWS since 2024, moto, MinIO), sent when the client can (s3fs >= 2024.12 and
a botocore that knows ``IfNoneMatch`` / ``IfMatch``: :func:`conditional_puts`); otherwise, and on other
stores, the lock is created by "exists, then write", which two builders starting within the same instant
can both pass: there, start one build of an output at a time (docs/faults.md, "Concurrent builders").
"""
from __future__ import annotations

import datetime as _dt
import getpass
import json
import os
import socket
import threading
from typing import Any, Optional

from .. import __version__
from ..errors import BuildError

#: seconds after its last heartbeat that a lock is stale (another build may take it over)
TTL_S = 120.0
#: seconds between heartbeats
HEARTBEAT_S = 30.0


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` of this machine exists (or may: another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


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


def _precondition_failed(e: BaseException) -> bool:
    """A 412 from the store: the object changed (or appeared) since we looked."""
    text = str(e).lower()
    return isinstance(e, OSError) and ("pre-condition" in text or "precondition" in text)


def stale_reason(holder: dict[str, Any], now: Optional[_dt.datetime] = None) -> Optional[str]:
    """Why the lock ``holder`` (its JSON) may be taken over, or None while it holds."""
    now = now or _now()
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
            and not pid_alive(holder["pid"]):
        return f"its process {holder['pid']} on this host is gone"
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
        self.etag: Optional[str] = None
        self.lost: Optional[str] = None
        self.started = _now().replace(microsecond=0).isoformat()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.took_over: Optional[str] = None   # why a stale lock was taken over (for the report's events)

    def body(self) -> bytes:
        now = _now()
        user = _user()
        host = socket.gethostname()
        return json.dumps({
            "owner": f"{user}@{host} pid {os.getpid()}", "user": user, "host": host, "pid": os.getpid(),
            "started": self.started, "heartbeat": now.replace(microsecond=0).isoformat(),
            "expires": (now + _dt.timedelta(seconds=TTL_S)).isoformat(), "ttl_s": TTL_S,
            "precompile_version": __version__}, sort_keys=True).encode()

    def _put(self, **cond: Any) -> None:
        out = self.fs.pipe_file(self.url, self.body(), **cond)
        etag = out.get("ETag") if isinstance(out, dict) else None
        self.etag = etag or (self.fs.info(self.url).get("ETag") if self.conditional else None)

    def _create(self) -> None:
        """Create the lock object; FileExistsError when there is one."""
        if self.conditional:
            self._put(mode="create")
            return
        self.fs.invalidate_cache(self.url)
        if self.fs.exists(self.url):
            raise FileExistsError(self.url)
        self._put()

    def acquire(self) -> None:
        for _ in range(3):   # the holder may release it between our create and our read
            try:
                self._create()
                return
            except FileExistsError:
                pass
            try:
                info, text = self.fs.info(self.url), self.fs.cat_file(self.url)
                break
            except FileNotFoundError:
                continue
        else:
            raise BuildError(f"cannot take the build lock {self.url}: other builds of {self.what} keep taking "
                             f"and releasing it; run build again")
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        why = stale_reason(holder if isinstance(holder, dict) else {})
        if why is None:
            raise BuildError(f"another build of {self.what} is running (lock {self.url}, {describe(holder)}); "
                             f"wait for it to finish (a lock without a heartbeat for {TTL_S:.0f} s is taken over)")
        try:
            self._put(**({"IfMatch": info["ETag"]} if self.conditional else {}))
        except OSError as e:
            if not _precondition_failed(e):
                raise
            raise BuildError(f"another build of {self.what} took over the stale lock {self.url} first; wait for "
                             f"it to finish") from None
        self.took_over = f"took over the stale build lock {self.url} ({describe(holder)}): {why}"

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._put(**({"IfMatch": self.etag} if self.conditional and self.etag else {}))
            except OSError as e:
                if _precondition_failed(e):
                    self.lost = (f"the build lock {self.url} was taken over by another build (this one sent no "
                                 f"heartbeat for {TTL_S:.0f} s)")
                    return
            except Exception:  # a network error: try again at the next beat (the TTL covers several)
                continue

    def check(self) -> None:
        """Raise BuildError if the lock was lost (before anything is written that the lock protects)."""
        if self.lost:
            raise BuildError(f"build of {self.what} stopped: {self.lost}; nothing was removed and the index was "
                             f"not replaced; finished shards are kept, run build again")

    def __enter__(self) -> "UrlLock":
        self.acquire()
        self._thread = threading.Thread(target=self._beat, name="precompile-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        try:
            if not self.conditional or self.fs.info(self.url).get("ETag") == self.etag:
                self.fs.rm_file(self.url)
        except Exception:  # already gone, or the store is unreachable: it expires by itself
            pass


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (a container without /etc/passwd entry)
        return "?"
