"""Fingerprints and shard keys for incremental rebuilds.

A shard's key hashes the recipe parts that decide its bytes, the shard's
items (keys, labels) with their inputs' fingerprints, and the format version.
A finished shard whose stored key matches is skipped.
"""
from __future__ import annotations

import hashlib
import os

from . import format as fmt
from .plan import Plan, ShardPlan


def fingerprint(path: str, content: bool = False) -> list:
    """(size, mtime_ns) of a file, or a content hash; for a folder, of every file in it."""
    if os.path.isdir(path):
        out = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for n in sorted(filenames):
                p = os.path.join(dirpath, n)
                out.append([os.path.relpath(p, path), fingerprint(p, content)])
        return out
    try:
        st = os.stat(path)
    except OSError:
        return ["missing"]
    if content:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return [st.st_size, h.hexdigest()]
    return [st.st_size, st.st_mtime_ns]


def shard_key(plan: Plan, shard: ShardPlan, recipe_hash: str, content: bool = False) -> str:
    h = hashlib.sha256()
    h.update(fmt.dumps({"format_version": fmt.FORMAT_VERSION, "recipe": recipe_hash,
                        "labels": plan.label_names, "shard": shard.index}).encode())
    for it in shard.items:
        h.update(fmt.dumps([it.key, it.label, {f: fingerprint(p, content) for f, p in sorted(it.paths.items())}]).encode())
    return h.hexdigest()
