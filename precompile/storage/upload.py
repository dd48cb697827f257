"""Uploads: local files and bytes put at URLs in a given order, the store's errors as one OutputError.

A build's shard task (:mod:`precompile.compiler.upload`) decides what goes where and in which order (a
shard's sidecars around it: the order is its commit protocol); this module only puts them, each in one
request (an object appears whole or not at all), with a fresh filesystem made from the options the task
carries.
"""
from __future__ import annotations

from typing import Any

from .objects import url_fault
from .remote import filesystem


def put_objects(url: str, storage_options: dict[str, Any], files: list[tuple[str, str]],
                blobs: list[tuple[str, bytes]], doing: str, kept: str) -> None:
    """Upload ``files`` ((local path, URL), in order), then ``blobs`` ((URL, bytes), in order). A failure of the
    store is an :class:`~precompile.errors.OutputError` naming ``url``, what was being done (``doing``) and what
    is kept (``kept``); any other error passes through."""
    try:
        fs = filesystem(url, storage_options, what="--storage-option")
        for local, dest in files:
            fs.put_file(local, dest)
        for dest, data in blobs:
            fs.pipe_file(dest, data)
    except Exception as e:
        err = url_fault(e, url, storage_options, doing, kept)
        if err is None:
            raise
        raise err from None
