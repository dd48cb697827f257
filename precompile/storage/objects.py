"""Objects under a URL prefix, as a build written to a URL and ``precompile verify`` of one see them.

:class:`UrlFolder` is the store side of an output at a URL (``-o s3://bucket/prefix``, any fsspec URL): a
fresh fsspec filesystem (credentials read from the environment now; the endpoint from
``AWS_ENDPOINT_URL(_S3)`` added to the options, :func:`with_endpoint`, so that it travels to workers on other
machines), one listing of the objects whose names start with ``<name>.`` (names and sizes, kept and updated by
what it writes and removes), local copies of objects fetched once into a local staging folder, small JSON
objects read and written, files put and objects removed. The staging folder (``precompile-out-<pid>-*`` in the
temporary folder) is held by an ``flock`` while its owner runs; the folders of owners that died are removed
when the next one is made (:func:`staging_folder`).

Errors of the store become :class:`~precompile.errors.OutputError` naming the URL and what to set
(:func:`url_fault`); credentials in the URL itself are refused (:func:`refuse_userinfo`: the URL is written
to reports). What a build keeps there, and in which order, is the build's (:mod:`precompile.compiler.url_output`).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional
from urllib.parse import urlsplit

from ..errors import OutputError
from .faults import KEPT, is_output_fault, output_error
from .files import json_bytes
from .owned import OWNER, owned_folder
from .remote import CREDENTIALS_HINT, filesystem, is_credentials_error, protocol

#: protocols whose fsspec filesystem does conditional PUTs (If-None-Match / If-Match) for the lock
CONDITIONAL = ("s3", "s3a")
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError"}


def with_endpoint(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus, for ``s3://``, the endpoint botocore would take from ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL`` (so that it travels with the shard tasks to workers that lack the variable)."""
    if protocol(url) not in CONDITIONAL or options.get("endpoint_url") or \
            (options.get("client_kwargs") or {}).get("endpoint_url"):
        return dict(options)
    env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {**options, "endpoint_url": env} if env else dict(options)


def _endpoint(options: dict[str, Any]) -> str:
    """``the endpoint <url>`` of the options, or ``the store's default endpoint``."""
    url = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    return f"the endpoint {url}" if url else "the store's default endpoint"


def url_fault(e: BaseException, url: str, options: dict[str, Any], doing: str, kept: str = KEPT
              ) -> Optional[OutputError]:
    """The OutputError for an error of the store at ``url`` met while ``doing`` (``kept``: what the message says
    is kept), or None when ``e`` is none."""
    names = {c.__name__ for c in type(e).__mro__}
    proto = protocol(url)
    text = str(e)
    if isinstance(e, TypeError) and "keyword argument" in text:   # s3fs passes its options on at first use
        return OutputError(f"output {url}: a --storage-option that {proto}:// does not take ({text}), while "
                           f"{doing}; {kept}")
    if is_credentials_error(e):
        head = f"no credentials for {proto}://"
        hint = (f"{CREDENTIALS_HINT.get(proto, 'set the store credentials in its environment')} "
                f"(or pass them with --storage-option)")
    elif names & _UNREACHABLE or isinstance(e, (ConnectionError, TimeoutError)):
        head = f"cannot reach {_endpoint(options)}"
        hint = "check the address: AWS_ENDPOINT_URL or --storage-option endpoint_url=... (and the network)"
    elif isinstance(e, FileNotFoundError) and "bucket" in text.lower():
        head = f"the bucket {urlsplit(url).netloc!r} does not exist"
        hint = "create it, or fix the URL"
    elif isinstance(e, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        head = "access denied"
        hint = ("the credentials in use may not write there: check AWS_PROFILE / AWS_ACCESS_KEY_ID (or "
                "--storage-option key=...) and the bucket's policy")
    elif isinstance(e, OSError) or names & {"BotoCoreError", "ClientError", "HTTPError"}:
        head = "the store failed"
        hint = "check the store and run build again"
    else:
        return None
    return OutputError(f"output {url}: {head} ({type(e).__name__}: {text}), while {doing}; {hint}; {kept}")


def refuse_userinfo(url: str) -> None:
    parts = urlsplit(url)
    if parts.username is not None:
        shown = parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]).geturl()
        raise OutputError(f"output {shown!r}: credentials in the URL are refused (the URL is "
                          f"written to the build report); set them in the store's environment or pass "
                          f"--storage-option")


STAGE_PREFIX = "precompile-out-"
#: the file in a staging folder that its build holds an ``flock`` on while it runs
STAGE_OWNER = OWNER


def staging_folder() -> tuple[str, int]:
    """(a new local staging folder ``precompile-out-<pid>-*`` in the temporary folder, the descriptor
    holding its owner lock). First the folders of builds that died are removed, as a local build removes
    its temporaries: those whose owner ``flock`` no process holds (any process on this kernel, whatever its
    pid namespace: containers sharing ``/tmp`` see each other's locks; a pid in the name would not do):
    :func:`~.owned.owned_folder`."""
    return owned_folder(STAGE_PREFIX)


class UrlFolder:
    """The objects under ``url`` whose names start with ``<name>.`` (see the module docstring). Use as a context
    manager: it owns a local staging folder (copies of objects, files before their upload)."""

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None, name: Optional[str] = None):
        refuse_userinfo(url)
        self.root = url.rstrip("/")
        self.options = with_endpoint(url, dict(storage_options or {}))
        # a fresh filesystem: credentials are read from the environment now, not from an earlier build's
        self.fs = filesystem(self.root, {**self.options, "skip_instance_cache": True}, what="--storage-option",
                             error=OutputError)
        self.name = name
        self.stage, self._stage_fd = staging_folder()
        self._listing: Optional[dict[str, int]] = None
        self._copies: dict[str, Optional[str]] = {}
        self._folders = 0

    def __enter__(self) -> "UrlFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)
        os.close(self._stage_fd)

    def fault(self, e: BaseException, doing: str, kept: Optional[str] = None) -> Optional[OutputError]:
        """The OutputError for ``e``: of the local staging folder (a full disk there), else of the store
        (``kept``: what the message says is kept; default: the previous build and finished shards)."""
        if isinstance(e, OSError) and os.path.isdir(self.stage) and is_output_fault(e, self.stage):
            return output_error(e, self.stage, f"{doing} (in the local staging folder: TMPDIR moves it)")
        return url_fault(e, self.root, self.options, doing, kept or KEPT)

    def listing(self) -> dict[str, int]:
        """{URL: size} of the objects under the root whose names start with ``<name>.`` (one listing, kept;
        updated by what this folder writes and removes)."""
        if self._listing is None:
            self.fs.invalidate_cache(self.root)
            prefix = f"{self.name}." if self.name else ""
            try:
                found = self.fs.find(self.root, detail=True, prefix=prefix)
            except TypeError:  # a filesystem without server-side prefixes: filtered below
                found = self.fs.find(self.root, detail=True)
            base = self.fs._strip_protocol(self.root).rstrip("/") + "/"
            self._listing = {f"{self.root}/{k[len(base):]}": int(v.get("size") or 0) for k, v in found.items()
                             if k.startswith(base + prefix) and v.get("type", "file") == "file"}
        return self._listing

    def forget(self) -> None:
        """Drop the listing and the copies (read again on next use: another writer may have written)."""
        self._listing = None
        self._copies = {}

    def copy_of(self, url: str) -> Optional[str]:
        """A local copy of the object at ``url`` (fetched once), or None when there is none."""
        if url not in self._copies:
            local = None
            if url in self.listing():
                local = self.local_path(url)
                self.fs.get_file(url, local)
            self._copies[url] = local
        return self._copies[url]

    def local_path(self, url: str) -> str:
        """A new local path for a copy of the object at ``url`` (same base name) in the staging folder."""
        self._folders += 1
        folder = os.path.join(self.stage, f"copy-{self._folders}")
        os.makedirs(folder)
        return os.path.join(folder, os.path.basename(url))

    def exists(self, url: str) -> bool:
        return url in self.listing()

    def size(self, url: str) -> Optional[int]:
        return self.listing().get(url)

    def read_json(self, url: str) -> Any:
        """The JSON object at ``url`` (None when it is not listed or not JSON)."""
        if url not in self.listing():
            return None
        try:
            return json.loads(self.fs.cat_file(url))
        except (ValueError, FileNotFoundError):
            return None

    def write_json(self, url: str, obj: Any, indent: Optional[int] = None) -> None:
        data = json_bytes(obj, indent)
        self.fs.pipe_file(url, data)
        self.listing()[url] = len(data)

    def put(self, local: str, url: str) -> None:
        """Upload the local file ``local`` to ``url`` (one PUT: the object appears whole or not at all); the
        file is then this folder's copy of it."""
        self.fs.put_file(local, url)
        self._copies[url] = local
        self.listing()[url] = os.path.getsize(local)

    def remove(self, urls: list[str]) -> None:
        """Remove the objects at ``urls``."""
        if urls:
            self.fs.rm(urls)
            for u in urls:
                self.listing().pop(u, None)
