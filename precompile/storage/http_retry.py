"""Retries of an HTTP server's transient errors for ``http(s)://`` inputs, tables, indexes and shards.

s3fs and gcsfs retry a store's 5xx answers themselves; fsspec's HTTP filesystem does not: one ``503`` from a
busy server failed the input (or the read of a shard). :func:`client_kwargs` adds :func:`retry_5xx`, an aiohttp
client middleware (aiohttp >= 3.12), to the filesystem's ``aiohttp.ClientSession``: a ``GET`` or ``HEAD``
answered 500, 502, 503 or 504 is asked again up to :data:`RETRIES` more times, after :data:`BACKOFF_S`,
doubled at each try (1.5 s in all by default; a ``Retry-After`` of a few seconds is honoured, up to
:data:`MAX_WAIT_S`); the last answer is an :class:`HTTPServerError` naming the URL, the status and the tries.
Other methods (a PUT) and other statuses are not retried. Waits are fixed, not drawn: nothing here is random.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

log = logging.getLogger("precompile.remote")

#: tries after the first one
RETRIES = 4
#: the first wait (s), doubled at each further try
BACKOFF_S = 0.1
#: the longest wait (s), a server's Retry-After included
MAX_WAIT_S = 5.0
#: the answers retried: a server's transient errors
STATUSES = frozenset({500, 502, 503, 504})
METHODS = frozenset({"GET", "HEAD"})


class HTTPServerError(Exception):
    """An HTTP server answered a transient error (5xx) to every try (not an OSError, which aiohttp would
    rename ClientOSError)."""


def _wait(attempt: int, retry_after: Any) -> float:
    try:
        asked = float(retry_after) if retry_after is not None else 0.0
    except ValueError:   # an HTTP date: the fixed backoff
        asked = 0.0
    return min(MAX_WAIT_S, max(asked, BACKOFF_S * (2 ** attempt)))


async def retry_5xx(request: Any, handler: Any) -> Any:
    """An aiohttp client middleware: ``request`` sent again while its answer is a transient 5xx (see the module
    docstring)."""
    if request.method not in METHODS:
        return await handler(request)
    start = time.monotonic()
    for attempt in range(RETRIES + 1):
        resp = await handler(request)
        if resp.status not in STATUSES:
            return resp
        status, reason, retry_after = resp.status, resp.reason, resp.headers.get("Retry-After")
        resp.release()
        if attempt == RETRIES:
            break
        wait = _wait(attempt, retry_after)
        log.info("%s %s: HTTP %d %s, try %d of %d: asking again in %.2f s", request.method, request.url, status,
                 reason, attempt + 1, RETRIES + 1, wait)
        await asyncio.sleep(wait)
    raise HTTPServerError(f"{request.method} {request.url}: the server answered HTTP {status} {reason} "
                          f"{RETRIES + 1} times over {time.monotonic() - start:.1f} s (a server error, asked again "
                          f"with backoff); try again later, or check the server")


def server_error(e: BaseException) -> Optional[HTTPServerError]:
    """The :class:`HTTPServerError` behind ``e``: itself, or the cause of a FileNotFoundError that fsspec's
    HTTP ``info`` raises for any failure of its HEAD and GET (a server that keeps answering 503 is not an
    object that does not exist); else None."""
    if isinstance(e, HTTPServerError):
        return e
    cause = e.__cause__
    return cause if isinstance(e, FileNotFoundError) and isinstance(cause, HTTPServerError) else None


def client_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for fsspec's HTTP filesystem with :func:`retry_5xx` added to its ``client_kwargs``'
    ``middlewares`` (left as they are where aiohttp has no middlewares: before 3.12)."""
    import inspect

    import aiohttp

    if "middlewares" not in inspect.signature(aiohttp.ClientSession.__init__).parameters:
        return options
    ck = dict(options.get("client_kwargs") or {})
    mine = tuple(ck.get("middlewares") or ())
    if retry_5xx not in mine:
        ck["middlewares"] = (*mine, retry_5xx)
    return {**options, "client_kwargs": ck}
