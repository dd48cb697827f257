"""Remote inputs through fsspec: ``inputs.root`` may be ``s3://``, ``gs://``, ``http(s)://`` (any fsspec URL).

- The tree is **listed once**, at plan time, in the parent (:func:`list_tree`);
  each object's fingerprint (ETag, size, modification time, as the store reports
  them) is kept in :data:`LISTED` and is what the shard keys hash
  (:func:`fingerprint`), so an unchanged bucket rebuilds nothing and a changed
  object rebuilds its shard. No request is made to compute a key.
- A shard task fetches each input it decodes into a private temporary folder
  (a folder input, such as a DICOM series, is fetched whole), decodes the local
  copy and deletes it (:func:`local_copy`). The output stays local.
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
import os
import re
import shutil
import sys
import threading
from typing import Any, Iterator, Optional
from urllib.parse import unquote

from ..errors import DecodeError, MissingDependencyError, PlanError, PrecompileError, echo

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
        return fsspec.filesystem(proto, **(storage_options or {}))
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
    for k in ("LastModified", "last_modified", "mtime", "updated", "modified", "created"):
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
    files: dict[str, list] = {}
    for name, info in found.items():
        if info.get("type", "file") != "file":
            continue
        name = fs._strip_protocol(name)
        if not name.startswith(stripped + "/"):
            continue
        rel = name[len(stripped) + 1:]
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        files[rel] = _fp(info)
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


@contextlib.contextmanager
def local_copy(url: str, storage_options: Optional[dict[str, Any]] = None, folder: bool = False) -> Iterator[str]:
    """Fetch ``url`` (a file, or with ``folder`` everything under it) into a temporary folder; yields the local path."""
    fs = filesystem(url, storage_options)
    tmp, owner = fetch_folder()
    name = local_name(url.rstrip("/").rsplit("/", 1)[-1] or "input")
    local = os.path.join(tmp, name)
    try:
        try:
            if folder:
                os.makedirs(local)
                src = fs._strip_protocol(url.rstrip("/"))
                for path in sorted(fs.find(url.rstrip("/"))):
                    name = fs._strip_protocol(path)
                    if not name.startswith(src + "/"):
                        continue
                    rel = name[len(src) + 1:]
                    if not rel or ".." in rel.split("/"):
                        continue
                    if dotted(rel):   # an HTTP listing's link that the client resolves out of the folder
                        raise DecodeError(f"the folder's file {echo(rel)} leaves the folder (a '..' part once "
                                          f"percent-decoded, or between backslashes: an HTTP client or a server "
                                          f"resolves it to another place)", path=url, stage="decode")
                    dst = os.path.join(local, *map(local_name, rel.split("/")))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    fs.get_file(path, dst)
            else:
                fs.get_file(url, local)
        except FileNotFoundError:
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
