"""Remote inputs through fsspec: ``inputs.root`` may be ``s3://``, ``gs://``, ``http(s)://`` (any fsspec URL).

- The tree is **listed once**, at plan time, in the parent (:func:`list_tree`);
  each object's fingerprint (ETag, size, modification time, as the store reports
  them) is kept in :data:`LISTED` and is what the shard keys hash
  (:func:`fingerprint`), so an unchanged bucket rebuilds nothing and a changed
  object rebuilds its shard. No request is made to compute a key.
- A shard task fetches each input it decodes into a private temporary folder
  (a folder input, such as a DICOM series, is fetched whole), decodes the local
  copy and deletes it (:func:`local_copy`). The output stays local. The copy is checked against the
  listing its key was made from (:func:`changed`), where the process has it: a shard never keeps bytes that
  disagree with its key. Names with a hidden part are not listed, and names with an empty, ``.`` or ``..``
  part cannot be (:func:`skipped`, logged); a folder input's fetch takes exactly the files it lists.
- ``http(s)://``: a server's transient 5xx is asked again with backoff (:mod:`.http_retry`).
- An ``inputs.table`` (a file or a glob: :func:`glob_urls`) or ``inputs.coco.file`` at a URL is read once,
  at plan time, in the parent; :func:`file_fingerprint` asks the store for one file's fingerprint (the
  COCO parse kept in the output is keyed by it). The store's refusals while listing or reading (a missing
  object, access denied, no credentials) are PlanErrors naming the URL and what to do (:func:`store_error`).
- ``inputs.storage_options`` (the same for the root, the table and the COCO file) are passed to
  ``fsspec.filesystem`` (e.g.
  ``endpoint_url``, ``anon``, ``requester_pays``). Credentials do not belong in
  a recipe (the resolved recipe is stored in the output): they are refused there;
  use the store's usual environment variables or config files.

fsspec and the protocol's package are optional extras; a missing one is a
:class:`MissingDependencyError` naming the extra (``s3``, ``gcs``, ``http``).

A forked child (a DataLoader worker) gets fsspec's IO loop state reset (:func:`_reset_fsspec_after_fork`): the
loop belongs to a thread that a fork does not copy.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import threading
from typing import Any, Iterator, Optional
from urllib.parse import unquote

from ..errors import DecodeError, MissingDependencyError, PlanError, PrecompileError, echo

log = logging.getLogger("precompile.remote")
URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# protocol -> (extra, package that provides it)
EXTRAS = {"s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
          "http": ("http", "aiohttp"), "https": ("http", "aiohttp")}
SECRET_KEYS = re.compile(r"(secret|password|passwd|token|credential|private|^key$|access_key)", re.I)

# url -> fingerprint of every file listed at plan time in this process
LISTED: dict[str, list] = {}
_lock = threading.Lock()


def _reset_fsspec_after_fork() -> None:
    """In a forked child, forget fsspec's IO loop (and its lock): the loop runs on a thread of the parent, which
    the fork does not copy, so a filesystem made in the child would hand its requests to a loop nobody runs and
    wait for ever. fsspec 2024.12 resets nothing at a fork; later versions reset the loop but not the lock (a
    typo: ``global lock``). ``reset_lock`` is fsspec's own function for this, in every supported version."""
    asyn = sys.modules.get("fsspec.asyn")
    reset = getattr(asyn, "reset_lock", None)
    if reset is not None:
        reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_fsspec_after_fork)


def is_url(path: Any) -> bool:
    return isinstance(path, str) and URL_RE.match(path) is not None and not path.startswith("file://")


def dotted(rel: str) -> bool:
    """Whether the part of a URL below a remote ``inputs.root`` holds a '..' that a client or server may resolve
    although the text has none: percent-encoded (``%2e%2e``, ``.%2E``: an HTTP client such as aiohttp decodes
    the unreserved dots, then resolves the dot segments, so ``root/a/%2e%2e/%2e%2e/x`` is a GET of ``/x``), or
    between backslashes or an encoded ``/`` (which some servers take as a separator)."""
    if "%" not in rel and "\\" not in rel:
        return False
    return ".." in re.split(r"[/\\]", unquote(rel))


HIDDEN, OUTSIDE = "hidden", "outside"


def skipped(rel: str) -> Optional[str]:
    """Why the object at ``rel`` (below a listed root or a fetched folder) is neither listed nor fetched, or
    None: :data:`HIDDEN` (a part starting with '.', as a local listing and the folder decoders leave them out)
    or :data:`OUTSIDE` (an empty, ``.`` or ``..`` part: a local copy could not be placed under its folder, nor
    the object be asked for by that name). A name that :func:`dotted` finds is kept: the path rule fails its
    input, naming it (a file at decode, a folder's file at its fetch)."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return OUTSIDE
    if any(p.startswith(".") for p in parts):
        return HIDDEN
    return None


def report_skipped(where: str, skips: dict[str, list[str]]) -> None:
    """Log what :func:`skipped` left out under ``where``: names leaving their folder as a warning (an object
    no build can read), hidden names at info level (the rule of local listings); a few names, each cut."""
    for why, names in sorted(skips.items()):
        some = ", ".join(echo(n) for n in sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        if why == OUTSIDE:
            log.warning("%s: %d object(s) left out: their names hold an empty, '.' or '..' part, by which no local "
                        "copy can be placed: %s",
                        where, len(names), some)
        else:
            log.info("%s: %d hidden object(s) left out (a name part starting with '.', as locally): %s",
                     where, len(names), some)


def protocol(url: str) -> str:
    m = URL_RE.match(url)
    return m.group(1).lower() if m else "file"


CREDENTIALS_HINT = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, or "
          "storage_options: {anon: true} for a public bucket",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS in the environment, or storage_options: {token: anon} for a public "
          "bucket",
}
CREDENTIALS_HINT["s3a"] = CREDENTIALS_HINT["s3"]
CREDENTIALS_HINT["gcs"] = CREDENTIALS_HINT["gs"]


def is_credentials_error(e: BaseException) -> bool:
    """True for a store's "no/partial/invalid credentials" error (botocore, google-auth), by its class names."""
    names = {c.__name__ for c in type(e).__mro__}
    return any(n in names for n in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                                    "DefaultCredentialsError", "RefreshError"))


def check_storage_options(opts: dict[str, Any]) -> Optional[str]:
    """The first option that looks like a credential, or None."""
    for k in opts:
        if SECRET_KEYS.search(str(k)):
            return str(k)
    return None


def filesystem(url: str, storage_options: Optional[dict[str, Any]] = None, what: str = "inputs.storage_options",
               error: type[PrecompileError] = PlanError) -> Any:
    """The fsspec filesystem for ``url``; a missing package is a MissingDependencyError naming the extra. Bad
    options raise ``error`` naming them as ``what`` (the recipe's ``inputs.storage_options``, or an output's)."""
    proto = protocol(url)
    extra, pkg = EXTRAS.get(proto, ("remote", None))
    try:
        import fsspec
    except ImportError:
        raise MissingDependencyError(f"{url}: remote inputs need fsspec: pip install 'precompile[{extra}]'") from None
    try:
        opts = dict(storage_options or {})
        if proto in ("http", "https"):   # a server's transient 5xx asked again (s3fs, gcsfs retry their own)
            from .http_retry import client_kwargs

            opts = client_kwargs(opts)
        return fsspec.filesystem(proto, **opts)
    except ImportError as e:
        what = pkg or str(e)
        raise MissingDependencyError(f"{url}: reading {proto}:// needs {what}: pip install 'precompile[{extra}]' "
                                     f"({e})") from None
    except ValueError as e:  # an unknown protocol
        raise error(f"{url}: fsspec cannot open {proto}:// URLs: {e}") from None
    except TypeError as e:  # a storage option the filesystem does not take
        raise error(f"{url}: bad {what} for {proto}://: {e}") from None


def _fp(info: dict[str, Any]) -> list:
    etag = None
    for k in ("ETag", "etag", "md5Hash", "md5", "crc32c", "checksum"):
        if info.get(k):
            etag = str(info[k]).strip('"')
            break
    mtime = None
    for k in ("LastModified", "last_modified", "mtime", "updated", "modified", "created", "Last-Modified"):
        if info.get(k) is not None:
            v = info[k]
            mtime = v.isoformat() if hasattr(v, "isoformat") else str(v)
            break
    size = info.get("size", info.get("Size"))
    return ["remote", etag, None if size is None else int(size), mtime]


_VERBS = {"list": ("listing", "listed"), "read": ("reading", "read")}


def store_error(what: str, url: str, e: Exception, verb: str, missing: str = "does not exist") -> PlanError:
    """The error a store raised while it was asked to ``verb`` (``list``, ``read``) ``what`` (e.g. ``input
    root 's3://b/x'``, at ``url``), as a PlanError saying what to do: a missing object, access denied, no
    credentials (with what to set), or anything else by its type."""
    doing, done = _VERBS[verb]
    from .http_retry import server_error

    e = server_error(e) or e
    if isinstance(e, FileNotFoundError):
        return PlanError(f"{what} {missing}")
    if isinstance(e, PermissionError):
        return PlanError(f"{what}: permission denied while {doing} ({e}); check the store's credentials in the "
                         f"environment, or storage_options such as anon: true")
    if is_credentials_error(e):
        return PlanError(f"{what}: no credentials for {protocol(url)}:// ({type(e).__name__}: {e}); "
                         f"{CREDENTIALS_HINT.get(protocol(url), 'set the store credentials in its environment')}")
    return PlanError(f"{what} cannot be {done}: {type(e).__name__}: {e}")


def list_tree(root: str, dirs: bool, storage_options: Optional[dict[str, Any]] = None) -> list[str]:
    """Relative '/'-separated paths of the files (or folders) under ``root``, sorted; fingerprints are recorded."""
    fs = filesystem(root, storage_options)
    base = root.rstrip("/")
    stripped = fs._strip_protocol(base).rstrip("/")
    fs.invalidate_cache()  # a cached listing from an earlier build in this process would hide changes
    try:
        found = fs.find(base, detail=True)
    except Exception as e:  # OSErrors, and the store's own errors (botocore's NoCredentialsError, ...)
        raise store_error(f"input root {root!r}", root, e, "list", "does not exist (nothing listed)") from None
    kept, skips = _kept_files(fs, found, stripped)
    files = {rel: _fp(info) for rel, _, info in kept}
    report_skipped(root, skips)
    _fill_blind(fs, base, files)
    with _lock:
        for k in [k for k in LISTED if k.startswith(base + "/")]:
            del LISTED[k]  # objects deleted since an earlier listing
        for rel, fp in files.items():
            LISTED[f"{base}/{rel}"] = fp
        if dirs:
            folders: dict[str, list] = {}
            for rel in sorted(files):
                parts = rel.split("/")
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i])
                    folders.setdefault(d, []).append(["/".join(parts[i:]), files[rel]])
            for d, content in folders.items():
                LISTED[f"{base}/{d}"] = content
            return sorted(folders)
    return sorted(files)


#: files asked at once for their fingerprint (:func:`_fill_blind`)
INFO_BATCH = 32


def _fill_blind(fs: Any, base: str, files: dict[str, list]) -> None:
    """Ask the store for the fingerprint of each listed file whose listing gave none (no ETag, size nor
    modification time: an HTTP index page gives names only), one ``info`` (a HEAD) each, :data:`INFO_BATCH` at
    a time: without it such an input changed in place would keep its key, and its shard its old bytes. A
    file the store then cannot describe keeps the empty fingerprint (logged)."""
    blind = [rel for rel, fp in files.items() if fp[1:] == [None, None, None]]
    if not blind:
        return
    urls = [f"{base}/{rel}" for rel in blind]
    if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
        from fsspec.asyn import _run_coros_in_chunks, sync

        infos = sync(fs.loop, _run_coros_in_chunks, [fs._info(u) for u in urls], batch_size=INFO_BATCH,
                     return_exceptions=True)
    else:
        infos = []
        for u in urls:
            try:
                infos.append(fs.info(u))
            except Exception as e:  # noqa: BLE001  (the store's own errors)
                infos.append(e)
    failed = []
    for rel, info in zip(blind, infos):
        if isinstance(info, BaseException):
            failed.append(rel)
        else:
            files[rel] = _fp(info)
    if failed:
        log.warning("%s: %d listed file(s) could not be described (no size, ETag or modification time): a change "
                    "to them in place will not rebuild their shards: %s", base, len(failed),
                    ", ".join(echo(r) for r in failed[:3]) + (", ..." if len(failed) > 3 else ""))


def glob_urls(pattern: str, storage_options: Optional[dict[str, Any]] = None, what: str = "") -> list[str]:
    """The URLs of the files matching the glob ``pattern`` (``s3://bucket/meta/part-*.parquet``), sorted; a
    PlanError naming ``what`` when none does or the store refuses the listing."""
    fs = filesystem(pattern, storage_options)
    fs.invalidate_cache()
    what = what or repr(pattern)
    try:
        found = fs.glob(pattern, detail=True)
    except Exception as e:  # OSErrors, and the store's own errors (botocore's NoCredentialsError, ...)
        raise store_error(what, pattern, e, "list", "matches nothing (nothing listed)") from None
    proto = protocol(pattern)
    urls = sorted(_as_url(proto, fs._strip_protocol(p)) for p, info in found.items()
                  if info.get("type", "file") == "file")
    if not urls:
        raise PlanError(f"{what} matches no object")
    return urls


def _as_url(proto: str, path: str) -> str:
    """The URL of a path a filesystem of ``proto`` gave: s3fs and the like give it without the protocol
    (``bucket/key``), the HTTP filesystem with it (``https://host/x``), which must not get a second one."""
    return path if URL_RE.match(path) else f"{proto}://{path}"


def file_fingerprint(url: str, storage_options: Optional[dict[str, Any]] = None, what: str = "") -> list:
    """The fingerprint of one remote file (ETag, size, modification time, as the store reports them): one
    request; a PlanError naming ``what`` when the store refuses it or the file is missing."""
    fs = filesystem(url, storage_options)
    fs.invalidate_cache()
    try:
        return _fp(fs.info(url))
    except Exception as e:  # OSErrors, and the store's own errors
        raise store_error(what or repr(url), url, e, "read") from None


def fingerprint(url: str) -> list:
    """The plan-time fingerprint of a listed file or folder (``["missing"]`` if it was not listed)."""
    return LISTED.get(url.rstrip("/"), ["missing"])


#: the longest file name (in bytes) local file systems take (NAME_MAX); an object's name may be longer (S3: 1024)
NAME_MAX = 255


def local_name(name: str) -> str:
    """``name`` as the name of a local copy: itself when a local file system takes it (at most :data:`NAME_MAX`
    bytes), else a digest of it with its extension kept (a decoder may go by the extension)."""
    raw = name.encode("utf-8", "surrogatepass")
    if len(raw) <= NAME_MAX:
        return name
    import hashlib

    _, dot, ext = name.rpartition(".")
    ext = f".{ext}" if dot and 0 < len(ext.encode("utf-8", "surrogatepass")) <= 32 else ""
    return hashlib.sha256(raw).hexdigest()[:40] + ext


FETCH_PREFIX = "precompile-fetch-"
_cleaned: Optional[int] = None   # the pid of this process once it removed the fetch folders of dead ones


def fetch_folder() -> tuple[str, int]:
    """A new folder for one fetched copy, ``precompile-fetch-<pid>-*`` in the temporary folder, and the
    descriptor of its owner lock (:func:`~.owned.owned_folder`): a worker killed while it held a copy (SIGKILL,
    the OOM killer) leaves the folder, and the first fetch of each later process removes it."""
    global _cleaned
    from .owned import owned_folder

    with _lock:
        clean, _cleaned = _cleaned != os.getpid(), os.getpid()
    return owned_folder(FETCH_PREFIX, clean)


def changed(listed: list, now: list) -> bool:
    """Whether an object's fingerprint ``now`` differs from the ``listed`` one (both :func:`_fp`): by size where
    both have one; by ETag where the listing has one, else by modification time where both have one (as
    instants: a listing may give a number where a HEAD gives a date, and whole seconds where it gave finer)."""
    if listed[1:] == [None, None, None]:   # nothing to compare: a store that describes nothing
        return False
    _, etag, size, mtime = listed
    _, etag2, size2, mtime2 = now
    if size is not None and size2 is not None and size != size2:
        return True
    if etag is not None and etag2 is not None:
        return etag != etag2
    a, b = _instant(mtime), _instant(mtime2)
    if a is None or b is None:
        return mtime is not None and mtime2 is not None and mtime != mtime2
    if a == int(a) or b == int(b):   # one of them in whole seconds
        return int(a) != int(b)
    return abs(a - b) > 1e-6


def _instant(v: Optional[str]) -> Optional[float]:
    """Seconds since the epoch of a fingerprint's modification time (a number, an ISO date or an HTTP date)."""
    if v is None:
        return None
    import datetime
    from email.utils import parsedate_to_datetime

    try:
        return float(v)
    except ValueError:
        pass
    for parse in (datetime.datetime.fromisoformat, parsedate_to_datetime):
        try:
            d = parse(v)
        except (ValueError, TypeError, IndexError):
            continue
        return (d if d.tzinfo else d.replace(tzinfo=datetime.timezone.utc)).timestamp()
    return None


def _folder_files(fs: Any, url: str) -> tuple[list[tuple[str, str, list]], dict[str, list[str]]]:
    """(``(rel, path, fingerprint)`` of each file under the folder ``url`` that a listing keeps, sorted;
    what :func:`skipped` left out) from one listing."""
    src = fs._strip_protocol(url)
    fs.invalidate_cache(url)
    kept, skips = _kept_files(fs, dict(sorted(fs.find(url, detail=True).items())), src)
    return [(rel, path, _fp(info)) for rel, path, info in kept], skips


def _kept_files(fs: Any, found: dict[str, dict],
                under: str) -> tuple[list[tuple[str, str, dict]], dict[str, list[str]]]:
    """``(rel, path, info)`` of each file of a listing ``found`` (``fs.find(detail=True)``) below the stripped
    folder ``under`` that :func:`skipped` keeps, in the listing's order, and what it left out, by why."""
    kept: list[tuple[str, str, dict]] = []
    skips: dict[str, list[str]] = {}
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        name = fs._strip_protocol(path)
        if not name.startswith(under + "/"):
            continue
        rel = name[len(under) + 1:]
        why = skipped(rel)
        if why:
            skips.setdefault(why, []).append(rel)
            continue
        kept.append((rel, path, info))
    return kept, skips


def _changed_error(url: str, what: str) -> DecodeError:
    return DecodeError(f"{what} since the plan listed it: the shard's key was made from the listing, so its "
                       f"bytes are not kept; build again (the next plan lists the new object)", path=url,
                       stage="decode")


@contextlib.contextmanager
def local_copy(url: str, storage_options: Optional[dict[str, Any]] = None, folder: bool = False,
               listed: Any = None) -> Iterator[str]:
    """Fetch ``url`` (a file, or with ``folder`` everything under it) into a temporary folder; yields the local
    path.

    ``listed``: the fingerprint the plan listed for ``url`` (default: :func:`fingerprint`'s, from
    :data:`LISTED`, which a forked worker inherits). With one, the copy is checked against it after the
    fetch: a file's size (free) and the store's fingerprint of it now (one ``info`` request); a folder's
    files are the listed ones, fetched by name, and its listing now must fingerprint the same; a change is a
    DecodeError of the input, so a shard's bytes never disagree with its key. Without one (a
    worker that does not have the plan's listing: ``PRECOMPILE_WORKERS=loky``, dask), the folder's files are
    the ones a listing would keep (:func:`skipped`), and a change since the plan is found by the next build.
    """
    fs = filesystem(url, storage_options)
    base = url.rstrip("/")
    if listed is None:
        listed = LISTED.get(base)
    tmp, owner = fetch_folder()
    name = local_name(base.rsplit("/", 1)[-1] or "input")
    local = os.path.join(tmp, name)
    try:
        try:
            if folder:
                os.makedirs(local)
                if listed is not None:
                    files = [(rel, f"{base}/{rel}", fp) for rel, fp in listed]
                else:
                    files, skips = _folder_files(fs, base)
                    report_skipped(url, skips)
                for rel, path, fp in files:
                    if dotted(rel):   # an HTTP listing's link that the client resolves out of the folder
                        raise DecodeError(f"the folder's file {echo(rel)} leaves the folder (a '..' part once "
                                          f"percent-decoded, or between backslashes: an HTTP client or a server "
                                          f"resolves it to another place)", path=url, stage="decode")
                    dst = os.path.join(local, *map(local_name, rel.split("/")))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    try:
                        fs.get_file(path, dst)
                    except FileNotFoundError:
                        if listed is None:
                            raise
                        raise _changed_error(url, f"the folder's file {echo(rel)} was removed") from None
                    if listed is not None and _size_differs(fp, dst):
                        raise _changed_error(url, f"the folder's file {echo(rel)} changed")
                if listed is not None:
                    now = {rel: fp for rel, _, fp in _folder_files(fs, base)[0]}
                    _fill_blind(fs, base, now)   # an HTTP page's names: described as the plan described them
                    was = dict(listed)
                    if now.keys() != was.keys() or any(changed(was[r], now[r]) for r in was):
                        new = sorted(set(now) ^ set(was)) or [r for r in was if changed(was[r], now[r])]
                        raise _changed_error(url, f"the folder's files changed ({echo(new[0])}"
                                                  f"{', ...' if len(new) > 1 else ''})")
            else:
                fs.get_file(url, local)
                if listed is not None and listed[0] == "remote":
                    if _size_differs(listed, local):
                        raise _changed_error(url, f"the object is {os.path.getsize(local)} bytes, not the "
                                                  f"{listed[2]} listed: it changed")
                    if (listed[1] is not None or listed[3] is not None) and \
                            changed(listed, _fp(_info_now(fs, url))):
                        raise _changed_error(url, "the object changed")
        except FileNotFoundError as e:
            from .http_retry import server_error

            if server_error(e) is not None:
                raise DecodeError(f"cannot fetch the remote input: HTTPServerError: {server_error(e)}",
                                  path=url) from None
            raise DecodeError("the remote object is missing (it was listed at plan time)", path=url) from None
        except (MemoryError, DecodeError):
            raise
        except Exception as e:  # network errors, permissions
            if is_credentials_error(e):
                raise PlanError(f"{url}: no credentials for {protocol(url)}:// ({type(e).__name__}); "
                                f"{CREDENTIALS_HINT.get(protocol(url), 'set the store credentials')}") from None
            raise DecodeError(f"cannot fetch the remote input: {type(e).__name__}: {e}", path=url) from None
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(owner)


def _info_now(fs: Any, url: str) -> dict:
    fs.invalidate_cache(url)   # not a listing cached since the plan (an inline build lists in this process)
    return fs.info(url)


def _size_differs(fp: list, local: str) -> bool:
    return fp[2] is not None and os.path.getsize(local) != fp[2]
