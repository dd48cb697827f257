"""A folder as an input: listing ``inputs.root`` and matching ``inputs.match``, streamed folder by folder into
the plan's columns.

The local walk (:func:`walk`) reads one folder at a time with ``os.scandir`` and yields its names as a
:class:`Listed` batch, in the sorted order of the relative paths (a folder's entries are visited in the
order of ``name`` for files and ``name + "/"`` for folders, which is exactly the order of the full
paths), so no global sort is needed; the matches of a batch are ``stat``-ed once, there, for their
fingerprint (size, mtime_ns). A listing can be given in the walk's place (:func:`match_listing`'s
``batches``): a remote store's listing, or a benchmark's synthetic one. A listing that is not in
sorted order is sorted once at the end.

:func:`match_listing` matches each batch's names at once and appends the matches to the columns of an
:class:`~precompile.inputs.items.ItemTable` (keys, template paths, label codes, fingerprints); the
captures a ``split:`` needs are kept as codes into their distinct values
(:data:`~precompile.inputs.items.Factors`). :func:`read_folder` is this input kind's entry.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from ..errors import PlanError, RecipeError, echo
from ..storage.remote import is_url, list_tree
from .items import Inputs, ItemTable, Strings, StringsBuilder
from .paths import local_prefix
from .templates import CAPTURE_RE, fill_template, pattern_regex

@dataclass
class Listed:
    """One folder's names in sorted order: relative '/'-separated paths, and where the listing knows
    them, their fingerprints: ``entries`` (a local walk's ``os.DirEntry`` objects, ``stat``-ed only for the
    names that match) or ``size``/``mtime`` arrays (a listing that carries them)."""

    rels: list[str]
    entries: Optional[list] = None
    size: Optional[np.ndarray] = None
    mtime: Optional[np.ndarray] = None

    def fingerprints(self, idx: list[int]) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(size, mtime_ns) of the names at ``idx`` (size -1 where the file cannot be stat'ed), or None."""
        if self.size is not None and self.mtime is not None:
            return np.asarray(self.size)[idx], np.asarray(self.mtime)[idx]
        if self.entries is None:
            return None
        size, mtime = np.full(len(idx), -1, np.int64), np.zeros(len(idx), np.int64)
        for j, i in enumerate(idx):
            try:
                st = self.entries[i].stat()
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                size[j], mtime[j] = st.st_size, st.st_mtime_ns
        return size, mtime


def walk(root: str, dirs: bool, follow_outside: bool = False) -> Iterator[Listed]:
    """The files (or with ``dirs`` the folders) under ``root`` as :class:`Listed` batches, one per run of
    a folder's names; names starting with '.' are left out (hidden folders are still walked into); folders
    that cannot be read are skipped. A symlinked folder is listed (``dirs``) but not walked into, as
    ``os.walk`` does, unless ``follow_outside`` (``inputs.follow_links: outside``, a layout assembled from
    folder links): then it is walked into wherever it leads, but never into a folder the walk is already in
    (a loop). Files come in sorted order of their relative paths; folders in walk order
    (:func:`match_listing` sorts them)."""
    real = os.path.realpath(root)
    yield from _walk_dir(root, "", dirs, _Links(real, follow_outside), (real,))


@dataclass(frozen=True)
class _Links:
    """What the walk needs to decide on a symlinked folder: the root's real path and the recipe's rule."""

    root: str
    follow_outside: bool   # inputs.follow_links: outside

    def walk_into(self, path: str, chain: tuple[str, ...]) -> Optional[str]:
        """The real path of the linked folder ``path`` when the walk goes into it (``chain``: the real paths
        of the folders it is in), else None: only with ``follow_links: outside``, and never into a folder the
        walk is already in (a loop)."""
        if not self.follow_outside:
            return None
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):
            return None
        return None if real in chain else real


def _walk_dir(path: str, rel: str, dirs: bool, links: _Links, chain: tuple[str, ...]) -> Iterator[Listed]:
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return
    keyed = []
    for e in entries:
        try:
            is_dir = e.is_dir()
        except OSError:
            is_dir = False
        keyed.append((e.name + "/" if is_dir else e.name, is_dir, e))
    keyed.sort(key=lambda t: t[0])
    names: list[str] = []
    ents: list[Any] = []
    for _, is_dir, e in keyed:
        if not is_dir:
            if not dirs and not e.name.startswith("."):
                names.append(rel + e.name)
                ents.append(e)
            continue
        if dirs and not e.name.startswith("."):
            names.append(rel + e.name)
        if names and not dirs:
            yield Listed(names, ents)
            names, ents = [], []
        try:
            link = e.is_symlink()
        except OSError:
            link = True
        if not link:
            yield from _walk_dir(e.path, f"{rel}{e.name}/", dirs, links, chain + (os.path.join(chain[-1], e.name),))
        elif (real := links.walk_into(e.path, chain)) is not None:
            yield from _walk_dir(e.path, f"{rel}{e.name}/", dirs, links, chain + (real,))
    if names:
        yield Listed(names, None if dirs else ents)


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_inputs(inp: Any, source: Optional[str]) -> None:
    """The recipe's ``inputs`` (``inp``, from the recipe file ``source``) for a folder: ``match``, ``where``, the
    fields' path templates and ``label`` agree on the captures; a RecipeError naming the key otherwise."""
    caps = set(CAPTURE_RE.findall(inp.match))
    for c in inp.where:
        if c not in caps:
            raise RecipeError(f"{echo(c)} is not a capture in match {echo(inp.match)}", source=source,
                              loc=f"inputs.where.{c}")
        try:
            re.compile(inp.where[c])
        except re.error as e:
            raise RecipeError(f"not a valid regular expression: {e}", source=source, loc=f"inputs.where.{c}") from None
    try:
        pattern_regex(inp.match, inp.where)
    except re.error as e:
        raise RecipeError(f"match and where do not make a valid pattern together: {e}", source=source,
                          loc="inputs.where") from None
    for fname, decl in inp.fields.items():
        if decl.path is not None:
            bad = set(CAPTURE_RE.findall(decl.path)) - caps
            if bad:
                raise RecipeError(f"uses capture(s) {sorted(bad)} that match {inp.match!r} does not define",
                                  source=source, loc=f"inputs.fields.{fname}.path")
    if inp.label is not None:
        if inp.label.capture not in caps:
            raise RecipeError(f"{echo(inp.label.capture)} is not a capture in match {echo(inp.match)}",
                              source=source, loc="inputs.label.capture")
        if inp.label.field in inp.fields:
            raise RecipeError(f"label field {inp.label.field!r} clashes with an input field", source=source,
                              loc="inputs.label.field")


def read_folder(recipe: Any, listing: Optional[Iterable[Listed]] = None) -> Inputs:
    """The files (or folders) under ``inputs.root`` that ``match`` finds, as the plan's items (``listing``:
    batches to match in place of walking the root, e.g. a synthetic listing; a URL's root is listed once,
    fingerprints kept)."""
    inp = recipe.model.inputs
    root = recipe.input_root
    remote = is_url(root)
    if listing is None and remote:
        listing = [Listed(list_tree(root, inp.kind == "dir", inp.storage_options))]  # fingerprints kept
    elif listing is None:
        if not os.path.isdir(root):
            raise RecipeError(f"input root {root!r} is not a folder", source=recipe.source, loc="inputs.root")
        listing = walk(root, inp.kind == "dir", inp.follow_links == "outside")
    return match_listing(recipe, listing, remote)


def match_listing(recipe: Any, batches: Iterable[Listed], remote: bool) -> Inputs:
    """Match every listed name against ``inputs.match`` (with ``where``): the table of the matches in key
    order, with each field's path (the listed one, or its template over the captures), the label id and the
    listing's fingerprint of the listed fields."""
    inp = recipe.model.inputs
    root = recipe.input_root
    acc = _Accumulator(recipe, pattern_regex(inp.match, inp.where), local_prefix(root, remote), remote)
    for b in batches:
        acc.add(b)
    return acc.finish()


class _Accumulator:
    """The growing columns of :func:`match_listing`."""

    def __init__(self, recipe: Any, rx: Any, prefix: str, remote: bool):
        inp = recipe.model.inputs
        self.recipe, self.rx, self.prefix, self.remote = recipe, rx, prefix, remote
        self.keys = StringsBuilder()
        self.templates = {f: d.path for f, d in inp.fields.items() if d.path is not None}
        self.tpaths = {f: StringsBuilder() for f in self.templates}
        self.label = inp.label
        self.label_group = rx.groupindex.get(inp.label.capture) if inp.label is not None else None
        self.label_codes: dict[str, int] = {}
        self.labels: list[np.ndarray] = []
        sp = recipe.model.split
        wanted = [] if sp is None else [sp.column, sp.group if isinstance(sp.group, str) else
                                        getattr(sp.group, "column", None), sp.stratify]
        self.factor_cols = {c: {} for c in wanted if c is not None and c in rx.groupindex}
        self.factor_codes: dict[str, list[np.ndarray]] = {c: [] for c in self.factor_cols}
        self.fps: list[tuple[np.ndarray, np.ndarray]] = []
        self.fp_known = inp.kind == "file" and not remote
        self.last: Optional[str] = None
        self.in_order = True

    def add(self, b: Listed) -> None:
        rels = b.rels
        ms = list(map(self.rx.fullmatch, rels))
        idx = [i for i, m in enumerate(ms) if m is not None]
        if not idx:
            return
        if len(idx) < len(rels):
            rels, ms = [rels[i] for i in idx], [ms[i] for i in idx]
        if self.in_order:
            self.in_order = (self.last is None or self.last < rels[0]) and all(a < b for a, b in zip(rels, rels[1:]))
        self.last = rels[-1]
        try:
            self.keys.add(rels)
        except UnicodeEncodeError:
            raise self._not_utf8(rels) from None
        if self.label_group is not None:
            codes, g = self.label_codes, self.label_group
            self.labels.append(np.fromiter((codes.setdefault(m.group(g), len(codes)) for m in ms), np.int64, len(ms)))
        for c, seen in self.factor_cols.items():
            self.factor_codes[c].append(np.fromiter((seen.setdefault(m.group(c), len(seen)) for m in ms),
                                                    np.int64, len(ms)))
        for f, t in self.templates.items():
            self.tpaths[f].add([self._template_path(t, m.groupdict()) for m in ms])
        if self.fp_known:
            fp = b.fingerprints(idx)
            if fp is None:
                self.fp_known = False
            else:
                self.fps.append(fp)

    def _not_utf8(self, rels: list[str]) -> PlanError:
        """The error for the first of ``rels`` that is not valid UTF-8: a local name whose bytes are not,
        which ``os.scandir`` gives with surrogate escapes (keys and paths are stored as UTF-8)."""
        rel = next(r for r in rels if not _encodes(r))
        name = os.fsencode(self.prefix + rel)
        return PlanError(f"input file {name!r} has a name that is not valid UTF-8 (sample keys and paths are stored "
                         f"as UTF-8): rename it, or leave it out with inputs.where (a capture's pattern that does not "
                         f"match it)")

    def _template_path(self, template: str, caps: dict[str, str]) -> str:
        """A field's ``path`` template filled with the captures, after the prefix (as the plan joined it)."""
        rp = fill_template(template, caps)
        if self.remote:
            return rp
        full = os.path.join(self.prefix, *rp.split("/"))
        if not full.startswith(self.prefix):
            raise PlanError(f"{template!r} filled with {caps} gives {rp!r}, which leaves inputs.root")
        return full[len(self.prefix):]

    def finish(self) -> Inputs:
        recipe, inp = self.recipe, self.recipe.model.inputs
        keys = self.keys.build()
        listed = keys if self.remote or os.sep == "/" else Strings.from_list(
            [k.replace("/", os.sep) for k in keys.to_list()])
        paths = {f: (self.tpaths[f].build() if f in self.templates else listed) for f in inp.fields}
        label_names, label = self._labels()
        table = ItemTable(keys=keys, prefix=self.prefix, paths=paths, label=label)
        if self.fp_known and len(keys):
            table.size = np.concatenate([s for s, _ in self.fps])
            table.mtime = np.concatenate([m for _, m in self.fps])
            table.listed = tuple(f for f in inp.fields if f not in self.templates)
        factors = {c: (np.concatenate(self.factor_codes[c]) if self.factor_codes[c] else np.zeros(0, np.int64),
                       list(self.factor_cols[c])) for c in self.factor_cols}
        if not self.in_order:
            order = keys.argsort()
            table = table.take(order)
            factors = {c: (codes[order], vals) for c, (codes, vals) in factors.items()}
        return Inputs(table, label_names, factors)

    def _labels(self) -> tuple[list[str], Optional[np.ndarray]]:
        """The label names in id order and each item's id (``inputs.label``), or ([], None)."""
        lab = self.label
        if lab is None:
            return [], None
        values = sorted(self.label_codes)
        if lab.classes is not None:
            unknown = [v for v in values if v not in lab.classes]
            if unknown:
                raise RecipeError(f"inputs have classes not in the list: {unknown}", source=self.recipe.source,
                                  loc="inputs.label.classes")
            names = list(lab.classes)
        else:
            names = values
        ids = {n: i for i, n in enumerate(names)}
        lookup = np.array([ids[v] for v in self.label_codes], np.int64)
        codes = np.concatenate(self.labels) if self.labels else np.zeros(0, np.int64)
        return names, lookup[codes]
