"""Shard keys (not a cache): fingerprints and the keys that decide incremental rebuilds, sibling reuse and
the skipped-inputs sidecar.

A shard's key hashes the recipe parts that decide its bytes
(:func:`recipe_key`), the shard's index and items (keys, labels) with their
inputs' fingerprints, and the format version. A finished shard whose stored
key matches is skipped; one whose key matches a shard of a sibling output in
the same folder (the same recipe built under another output name) is linked
instead of rebuilt (:func:`find_reusable`).

Items are assigned to shards in key order, so adding or removing an input
shifts the items of every later shard and rebuilds them; adding inputs whose
keys sort after all existing ones rebuilds only the last shard.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any, Optional


from .. import __version__
from ..formats import names as fmt
from ..inputs.items import ItemTable, Rows, row_index
from ..storage.files import fingerprint
from .plan import Plan, ShardPlan
from .results import Failure
from ..recipe import Recipe


def recipe_key(recipe: Recipe) -> str:
    """Hash of the recipe parts that decide shard bytes.

    Leaves out what cannot change a shard's bytes: the recipe's ``name`` and
    output name (they only name files), the error policy (``on_error``,
    ``max_failures``, ``timeout_s``), and of course the output folder and the
    job count, which are not part of the recipe at all.
    """
    d = recipe.content_dict()
    d.pop("name", None)
    return hashlib.sha256(fmt.dumps(d).encode()).hexdigest()


#: the encoder behind fmt.dumps (same options), made once
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_STR = json.encoder.encode_basestring  # a JSON string literal, non-ASCII kept (ensure_ascii=False)


def shard_key(plan: Plan, shard: ShardPlan, recipe_hash: str, content: bool = False) -> str:
    h = hashlib.sha256()
    # the package version too: new code may write other bytes, and a compiler does not reuse stale objects
    h.update(fmt.dumps({"format_version": fmt.FORMAT_VERSION, "precompile": __version__, "recipe": recipe_hash,
                        "labels": plan.label_names, "shard": shard.index}).encode())
    h.update(items_text(shard.table, shard.rows, content).encode())
    if shard.split is not None:
        h.update(fmt.dumps({"split": shard.split}).encode())
    return h.hexdigest()


def items_text(table: ItemTable, rows: Rows, content: bool = False) -> str:
    """What a shard key hashes of each item of ``rows``, concatenated: :func:`item_text` (key, label and
    each field's fingerprint), then a table row's values and decoder options and a COCO image's
    annotations digest where it has them. Fingerprints the listing gave (size, mtime) are formatted from
    the table's arrays; other paths are fingerprinted here (:func:`fingerprint`)."""
    n = len(rows)
    keys = table.keys.to_list(rows)
    idx = row_index(rows)
    labels = [None] * n if table.label is None else table.label[idx].tolist()
    listed = {f for f in table.paths if f in table.listed and table.size is not None and not content}
    if listed == set(table.paths) and listed:   # every fingerprint from the listing: formatted at once
        texts = _listed_texts(table, idx, keys, labels)
    else:
        fps = {}
        for f in sorted(table.paths):
            if f in listed:
                fps[f] = [[s, m] if s >= 0 else ["missing"] for s, m in zip(table.size[idx].tolist(),
                                                                             table.mtime[idx].tolist())]
            else:
                fps[f] = [fingerprint(table.prefix + p, content) for p in table.paths[f].to_list(rows)]
        texts = [item_text(keys[j], labels[j], [(f, col[j]) for f, col in fps.items()]) for j in range(n)]
    if table.values or table.options is not None or table.annotations is not None:
        extra = zip(table.column_values(rows), table.objects("options", rows, {}),
                    table.objects("annotations", rows, None))
        texts = [t + (_ENCODER.encode([v, o]) if v or o else "") + (a.digest if a is not None else "")
                 for t, (v, o, a) in zip(texts, extra)]   # _ENCODER.encode: fmt.dumps without a new encoder
    return "".join(texts)


def _listed_texts(table: ItemTable, idx: Any, keys: list[str], labels: list) -> list[str]:
    """:func:`item_text` of items whose every field's fingerprint is the listing's (size, mtime), each
    formatted with one ``%``: ``[key,label,{"field":[size,mtime],...}]`` (field names need no escaping)."""
    size, mtime = table.size[idx].tolist(), table.mtime[idx].tolist()
    fields = sorted(table.paths)
    form = "[%s,%s,{" + ",".join(f"{_STR(f)}:[%d,%d]" for f in fields) + "}]"
    labs = ["null" if lab is None else lab for lab in labels]
    texts = list(map(form.__mod__, zip(map(_STR, keys), labs, *([size, mtime] * len(fields)))))
    for j in [j for j, s in enumerate(size) if s < 0]:   # not stat-able at listing time: ["missing"]
        texts[j] = item_text(keys[j], labels[j], [(f, ["missing"]) for f in fields])
    return texts


def item_text(key: str, label: Optional[int], fps: list[tuple[str, list]]) -> str:
    """``fmt.dumps([key, label, dict(fps)])`` (``fps`` sorted by field), written directly for the
    common case of (size, mtime) fingerprints: a no-change rebuild formats one per input."""
    if type(label) is int or label is None:
        parts = []
        for f, fp in fps:
            if len(fp) != 2 or type(fp[0]) is not int or type(fp[1]) is not int:
                break
            parts.append(f"{_STR(f)}:[{fp[0]},{fp[1]}]")
        else:
            lab = "null" if label is None else str(label)
            return f"[{_STR(key)},{lab},{{{','.join(parts)}}}]"
    return _ENCODER.encode([key, label, dict(fps)])


def find_reusable(out_dir: str, shard_dir: str, file_name: str, key: str, writer: Any) -> Optional[str]:
    """A finished shard with ``key`` under the same file name in a sibling ``*.shards`` folder, or None (a
    file, or a file-folder format's shard folder)."""
    for other in sorted(glob.glob(os.path.join(glob.escape(out_dir), "*" + fmt.SHARD_DIR_SUFFIX))):
        if os.path.abspath(other) == os.path.abspath(shard_dir):
            continue
        cand = os.path.join(other, file_name)
        if os.path.isfile(cand) or os.path.isdir(cand):
            info = writer.read_shard_info(cand)
            if info is not None and info["key"] == key:
                return cand
    return None


def skipped_path(shard_path: str) -> str:
    """The sidecar that lists a finished shard's skipped inputs (absent when none were skipped)."""
    return shard_path + fmt.SKIPPED_SIDECAR


def read_skipped(shard_path: str, key: str) -> list[Failure]:
    """The skipped inputs recorded for a finished shard built with ``key`` ([] when none or stale)."""
    try:
        with open(skipped_path(shard_path)) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return []
    return [Failure.from_json(f) for f in d.get("failures", [])] if d.get("key") == key else []
