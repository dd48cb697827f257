"""A build written to a URL (``-o s3://bucket/prefix``, any fsspec URL): :class:`UrlOutput`.

The remote layout is the local one under the URL: ``<url>/<name>.h5`` (the index),
``<url>/<name>.report.json``, ``<url>/<name>.shards/shard-00003-<key16>.h5`` (+ sidecars, ``previous.json``,
``.lock``). What differs is how each rule is kept:

- shards: each shard task builds its shard in a local folder and uploads it (:mod:`.upload`); the parent
  never reads a shard's bytes (finalize takes each shard's parts from its task, the replaced index or the
  shard's ``.entry.json`` sidecar, :mod:`precompile.formats.hdf5_parts`);
- the index is written locally from those parts, then uploaded in one PUT after every shard: an object
  appears whole or not at all, so a reader sees the old build or the new one;
- what is stored is known from one listing of the objects under ``<url>/<name>.`` (names and sizes) and the
  index (fetched once): a no-change rebuild makes those two requests and writes nothing;
- resume: a shard already uploaded under its planned name is kept when the replaced index names it with
  its key and size, or when its ``.entry.json`` sidecar (uploaded after the shard: a commit marker) does;
- the lock is an object created with a conditional PUT (:mod:`.url_lock`).

Storage options (``--storage-option``, ``build(storage_options=...)``) go to the fsspec filesystem here
and travel with each shard task; the endpoint from ``AWS_ENDPOINT_URL(_S3)`` is added to them so that a
worker on another machine writes to the same store. None of them is ever written to the index or the
report. Errors of the store become :class:`~precompile.errors.OutputError` naming the URL and what to set
(:func:`url_fault`).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

from ..errors import BuildError, OutputError, RecipeError
from ..formats import names as fmt
from ..formats import snapshot
from ..formats.base import json_bytes
from ..remote import CREDENTIALS_HINT, filesystem, is_credentials_error, protocol
from .faults import KEPT, is_output_fault, output_error
from .keys import read_skipped, skipped_path
from .results import Failure

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
    return str(options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
               or "the store's default endpoint")


def url_fault(e: BaseException, url: str, options: dict[str, Any], doing: str, kept: str = KEPT
              ) -> Optional[OutputError]:
    """The OutputError for an error of the store at ``url`` met while ``doing``, or None when ``e`` is none."""
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
        head = f"cannot reach the endpoint {_endpoint(options)}"
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


def _refuse_userinfo(url: str) -> None:
    parts = urlsplit(url)
    if parts.username is not None:
        shown = parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]).geturl()
        raise OutputError(f"output {shown!r}: credentials in the URL are refused (the URL is "
                          f"written to the build report); set them in the store's environment or pass "
                          f"--storage-option")


STAGE_PREFIX = "precompile-out-"
#: the file in a staging folder that its build holds an ``flock`` on while it runs
STAGE_OWNER = ".owner"


def _abandoned(folder: str) -> bool:
    """True when no running build holds ``folder``'s owner lock: its build died (the kernel released the
    ``flock``). A folder without an owner file (one being created) is never abandoned."""
    import fcntl

    try:
        fd = os.open(os.path.join(folder, STAGE_OWNER), os.O_RDONLY)
    except OSError:   # being created, or another user's
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return os.fstat(fd).st_size > 0   # empty: its build has not yet taken the lock it is about to take
    except OSError:
        return False   # held: its build runs
    finally:
        os.close(fd)


def _staging_folder() -> tuple[str, int]:
    """(a new local staging folder ``precompile-out-<pid>-*`` in the temporary folder, the descriptor
    holding its owner lock). First the folders of builds that died are removed, as a local build removes
    its temporaries: those whose owner ``flock`` no process holds (any process on this kernel, whatever its
    pid namespace: containers sharing ``/tmp`` see each other's locks; a pid in the name would not do)."""
    import fcntl

    for p in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), STAGE_PREFIX + "*-*")):
        if _abandoned(p):
            shutil.rmtree(p, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-")
    fd = os.open(os.path.join(folder, STAGE_OWNER), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)   # waits only while a cleaner looks at the new, still empty file
    os.write(fd, f"{os.getpid()}\n".encode())
    return folder, fd


class UrlOutput:
    """An output at a URL (see the module docstring). Use as a context manager: it owns a local staging
    folder (index copies, and the shards of local workers before their upload)."""

    remote = True

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None, name: Optional[str] = None):
        _refuse_userinfo(url)
        self.root = url.rstrip("/")
        self.options = with_endpoint(url, dict(storage_options or {}))
        # a fresh filesystem: credentials are read from the environment now, not from an earlier build's
        self.fs = filesystem(self.root, {**self.options, "skip_instance_cache": True}, what="--storage-option",
                             error=OutputError)
        self.name = name
        self.stage, self._stage_fd = _staging_folder()
        self.notes: list[str] = []
        self.shard_dir: Optional[str] = None
        self._listing: Optional[dict[str, int]] = None
        self._copies: dict[str, Optional[str]] = {}
        self._folders = 0
        self._lock: Any = None

    def __enter__(self) -> "UrlOutput":
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)
        os.close(self._stage_fd)

    def check_recipe(self, recipe: Any) -> None:
        """Refuse what a URL output cannot take, before any work: formats other than HDF5, stored stats."""
        form = recipe.model.output.format
        if form != "hdf5":
            raise RecipeError(f"format {form!r} cannot be written to a URL ({self.root}): it writes one object "
                              f"per sample and field (thousands of small PUTs, and no shard that appears whole); "
                              f"use format hdf5, or build into a local folder and copy it", source=recipe.source,
                              loc="output.format")
        if recipe.model.stats:
            raise RecipeError(f"stats cannot be stored in an output at a URL ({self.root}): computing them reads "
                              f"every shard back; build without stats (or into a local folder and run precompile "
                              f"stats there)", source=recipe.source, loc="stats")

    def prepare(self, shard_dir: str) -> None:
        """Nothing to create remotely (object stores have no folders); the local staging folder of the shards."""
        self.shard_dir = shard_dir
        os.makedirs(os.path.join(self.stage, os.path.basename(shard_dir)), exist_ok=True)

    @contextlib.contextmanager
    def lock(self, shard_dir: str, name: str) -> Iterator[None]:
        """Hold ``<shard folder>/.lock`` (:class:`~.url_lock.UrlLock`); a stale one is taken over (noted)."""
        from .url_lock import UrlLock, conditional_puts

        conditional = protocol(self.root) in CONDITIONAL and conditional_puts(self.fs)
        lk = UrlLock(self.fs, f"{shard_dir}/{fmt.LOCK_FILE}", f"{name!r} into {self.root}", conditional)
        if not conditional:
            self.notes.append(f"the build lock {lk.url} is best effort: this store or its client does not do "
                              f"conditional PUTs (s3:// with s3fs >= 2024.12 does); run one build of an output at "
                              f"a time")
        with lk:
            if lk.took_over:
                self.notes.append(lk.took_over)
            self._lock = lk
            try:
                yield
            finally:
                self._lock = None

    def fault(self, e: BaseException, doing: str, kept: Optional[str] = None) -> Optional[OutputError]:
        """The OutputError for ``e``: of the local staging folder (a full disk there), else of the store
        (``kept``: what the message says is kept; default: the previous build and finished shards)."""
        if isinstance(e, OSError) and os.path.isdir(self.stage) and is_output_fault(e, self.stage):
            return output_error(e, self.stage, f"{doing} (in the local staging folder: TMPDIR moves it)")
        return url_fault(e, self.root, self.options, doing, kept or KEPT)

    # -- reading the stored build ---------------------------------------------------------------
    def listing(self) -> dict[str, int]:
        """{URL: size} of the objects under the output whose names start with ``<name>.`` (one listing, kept
        for the build; updated by what this output writes and removes)."""
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
        """Drop the listing and the index copies (read again on next use: another build may have written)."""
        self._listing = None
        self._copies = {}

    def index_copy(self, index_url: str) -> Optional[str]:
        """A local copy of the index at ``index_url`` (fetched once), or None when there is none."""
        if index_url not in self._copies:
            local = None
            if index_url in self.listing():
                local = self._local(index_url)
                self.fs.get_file(index_url, local)
            self._copies[index_url] = local
        return self._copies[index_url]

    def _local(self, url: str) -> str:
        """A new local path for a copy of the object at ``url`` (same base name) in the staging folder."""
        self._folders += 1
        folder = os.path.join(self.stage, f"copy-{self._folders}")
        os.makedirs(folder)
        return os.path.join(folder, os.path.basename(url))

    def index_attrs(self, index_url: str) -> Optional[dict[str, str]]:
        local = self.index_copy(index_url)
        return snapshot.read_index_attrs(local) if local else None

    def exists(self, url: str) -> bool:
        return url in self.listing()

    def size(self, url: str) -> Optional[int]:
        return self.listing().get(url)

    def read_skipped(self, url: str, key: str) -> list[Failure]:
        """The skipped inputs of the shard at ``url`` (its ``.skipped.json``: fetched only when listed)."""
        if skipped_path(url) not in self.listing():
            return []
        local = self._local(url)
        self.fs.get_file(skipped_path(url), skipped_path(local))
        return read_skipped(local, key)

    def finished_shard(self, writer: Any, url: str, key: str, entry: Optional[dict[str, Any]], parts: Any = None
                       ) -> tuple[Optional[dict[str, Any]], Any]:
        """(info, parts) of the uploaded shard at ``url`` built with ``key``, or (None, None). The replaced
        index's ``entry`` (with its ``parts``) vouches for it when key and size agree; else its
        ``.entry.json`` sidecar does (then its parts come from there)."""
        size = self.size(url)
        if size is None:
            return None, None
        if entry is not None and parts is not None and entry.get("key") == key and entry.get("bytes") == size:
            return {k: entry[k] for k in ("key", "num_samples", "checksums", "bytes", "sha256")}, None
        side = url + fmt.ENTRY_SIDECAR
        if side not in self.listing():
            return None, None
        from ..formats.hdf5_parts import ShardParts

        try:
            d = json.loads(self.fs.cat_file(side))
            info, own = dict(d["entry"]), ShardParts.from_json(d["parts"])
        except (ValueError, KeyError, TypeError, FileNotFoundError):
            return None, None
        if info.get("key") != key or info.get("bytes") != size or len(own.keys) != info.get("num_samples"):
            return None, None
        return info, own

    def read_json(self, url: str) -> Any:
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

    # -- the snapshot ---------------------------------------------------------------------------
    def _indexes(self) -> list[str]:
        """The index objects beside the shard folder (``<name>.h5``, ``<name>.<split>.h5``)."""
        return sorted(u for u in self.listing() if os.path.dirname(u) == self.root and u.endswith(".h5"))

    def referenced(self, shard_dir: str) -> set[str]:
        keep: set[str] = set()
        for index in self._indexes():
            local = self.index_copy(index)
            if local:
                keep |= snapshot.names_in(shard_dir, snapshot.index_files(local))
        return keep

    def previous(self, shard_dir: str) -> set[str]:
        d = self.read_json(f"{shard_dir}/{fmt.PREVIOUS_SNAPSHOT}")
        try:
            return {str(n) for n in d["files"]}
        except (KeyError, TypeError):
            return set()

    def remember_previous(self, shard_dir: str, files: list[str]) -> None:
        self.write_json(f"{shard_dir}/{fmt.PREVIOUS_SNAPSHOT}", {"files": sorted(snapshot.names_in(shard_dir, files))})

    def collect(self, shard_dir: str, keep: set[str], dry_run: bool = False) -> tuple[list[str], int]:
        """Remove the objects of the shard folder no index refers to (as :func:`snapshot.collect`)."""
        if self._lock is not None:
            self._lock.check()
        entries: dict[str, list[str]] = {}
        for u in self.listing():
            if u.startswith(shard_dir + "/"):
                entries.setdefault(u[len(shard_dir) + 1:].split("/", 1)[0], []).append(u)
        removed = [n for n in sorted(entries) if snapshot.removable(n, keep)]
        urls = [u for n in removed for u in entries[n]]
        freed = sum(self.listing()[u] for u in urls)
        if urls and not dry_run:
            self.fs.rm(urls)
            for u in urls:
                self.listing().pop(u, None)
        return removed, freed

    # -- writing --------------------------------------------------------------------------------
    def task_path(self, url: str) -> str:
        """Where a local shard task builds the shard that belongs at ``url``: the staging folder."""
        return os.path.join(self.stage, os.path.basename(os.path.dirname(url)), os.path.basename(url))

    def shard_target(self, private: bool) -> Any:
        """What each shard task needs to upload its shard (``private``: build it in the worker's own folder,
        as on a cluster, not in this process's staging folder)."""
        from .upload import ShardTarget

        assert self.shard_dir is not None
        return ShardTarget(self.shard_dir, self.options, private)

    def finalize(self, writer: Any, index_url: str, shards: list[dict[str, Any]], specs: Any,
                 attrs: dict[str, Any], parts: list[Any]) -> None:
        """Write the index locally from the shards' parts, then upload it in one PUT (the build's last shard
        object is already in place)."""
        missing = [s["file"] for s, p in zip(shards, parts) if p is None and s["num_samples"]]
        if missing:  # every kept or built shard of a URL build has parts: a bug, not a fault of the store
            raise BuildError(f"internal error: no index parts for {', '.join(missing)}; run build again")
        local = self._local(index_url)
        writer.finalize(local, shards, specs, attrs, parts)
        if self._lock is not None:
            self._lock.check()
        self.fs.put_file(local, index_url)
        self._copies[index_url] = local
        self.listing()[index_url] = os.path.getsize(local)
