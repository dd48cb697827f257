"""Splits (``split:``): which output each input goes to, whatever its kind (a folder listing, a table, a COCO file).

By a stable hash (:func:`precompile.seeding.stable_hash`) of the seed and the key, or of the group value
(``split.group``: a column or capture, optionally cut by a pattern), so an input's split depends on nothing
else and adding inputs never moves an old one; or by a column naming each input's split (``by: column``).

With ``split.stratify`` (a column or capture holding each input's class) the hash orders, and the fractions
cut (:func:`stratified_splits`): each class's inputs (or groups) in the order of their hashes are cut at the
fractions, so every split holds each class in the fractions' proportions, within one input per class and
split (with groups of one class each, within the largest group of the class); each class's line starts at
a phase drawn from the seed and the class, so small classes spread over the splits at the fractions' odds.
An input's split then depends
on the other inputs of its class: adding one input moves at most one old input of its class across each cut;
adding a group moves only groups of its class, across each cut fewer rows than the new group and the class's
largest group hold together.
The values a split reads come as factors (each distinct value once: :data:`~precompile.inputs.items.Factors`),
so each is checked and hashed once; an error names the first input, in key order, at fault.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

from ..errors import RecipeError, echo
from ..formats.names import NAME_RE
from ..seeding import stable_hash
from .table.cells import blank, close_columns
from .templates import CAPTURE_RE

def split_group(spec: Any, captures: dict[str, Any]) -> Optional[str]:
    """An item's group value under ``split.group`` (None without one); the pattern's first group when given."""
    g = spec.group
    if g is None:
        return None
    col = g if isinstance(g, str) else g.column
    v = str(captures[col])
    if isinstance(g, str) or g.pattern is None:
        return v
    m = re.search(g.pattern, v)
    if m is None:
        raise ValueError(f"split.group pattern {g.pattern!r} does not match {echo(v)}")
    return m.group(1) if m.groups() else m.group(0)


def hash_split(fractions: dict[str, float], seed: int, name: str) -> str:
    """The split of ``name`` (a key or a group): a stable 64-bit hash of seed and name, as a point in [0, 1),
    falls in one split's share of the line (the fractions in their given order). Nothing else decides it."""
    u = stable_hash(f"split:{int(seed)}:{name}") / 2.0 ** 64
    acc = 0.0
    last = next(reversed(fractions))
    for split, f in fractions.items():
        acc += f
        if u < acc:
            return split
    return last


def assign_splits(recipe: Any, table: Any, factors: dict[str, tuple[np.ndarray, list]]) -> Any:
    """``table`` (an :class:`~precompile.inputs.items.ItemTable`) with each item's split set (see the
    module docstring), from the factors of the columns or captures the split reads (code per item, distinct
    values: :data:`~precompile.inputs.items.Factors`); each distinct value is checked and hashed once.
    A RecipeError names the first input (in key order) whose group or split value is unusable, or whose
    group is in two splits of a ``by: column`` split."""
    sp, source = recipe.model.split, recipe.source
    seed = recipe.seed if sp.seed is None else sp.seed
    gcol = sp.group if isinstance(sp.group, str) else getattr(sp.group, "column", None)
    for col in (sp.column, gcol, sp.stratify):
        if col is not None and col not in factors:
            inp = recipe.model.inputs
            names = list(factors) + ([m.group(1) for m in CAPTURE_RE.finditer(inp.match)] if getattr(inp, "match", None)
                                     else [])
            close = close_columns(col, list(dict.fromkeys(names)))
            hint = f"; did you mean {', '.join(echo(c, 60) for c in close)}?" if close else ""
            raise RecipeError(f"{echo(col)} is neither a table column nor a capture of match{hint}", source=source,
                              loc="split")
    at = _where(table)
    groups = (_Groups(sp, gcol, factors[gcol], at, "column" if table.row is not None else "capture")
              if gcol is not None else None)
    checks = [groups.check] if groups is not None else []
    if sp.by == "column":
        codes, names = _column_splits(recipe, factors[sp.column], groups, checks, at)
    else:
        _raise_first(recipe, checks)
        names = list(sp.fractions)
        pos = {s: i for i, s in enumerate(names)}
        if sp.stratify is not None:
            units = table.keys.to_list() if groups is None else groups.values
            unit = np.arange(len(table), dtype=np.int64) if groups is None else groups.ids
            classes, phases = _classes(factors[sp.stratify], seed)
            codes = stratified_splits(list(sp.fractions.values()), seed, units, unit, classes, phases)
        elif groups is None:
            codes = np.fromiter((pos[hash_split(sp.fractions, seed, k)] for k in table.keys.to_list()),
                                np.int64, len(table))
        else:
            codes = np.array([pos[hash_split(sp.fractions, seed, g)] for g in groups.values], np.int64)[groups.ids]
    table.split, table.split_names = codes.astype(np.int16), tuple(names)
    return table


def _classes(factor: tuple[np.ndarray, list], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per item: its class under ``split.stratify``, as the rank of the class's text among the distinct ones
    (every blank cell one class, ranked first), so ties and orders never depend on the order rows came in; and
    per class, its phase in [0, 1): a stable hash of the seed and the class's text."""
    codes, cells = factor
    texts = [None if blank(v) else str(v) for v in cells]
    distinct = sorted(set(texts), key=lambda t: (t is not None, t or ""))
    ranks = {t: i for i, t in enumerate(distinct)}
    phases = np.array([stable_hash(f"split:{int(seed)}:" + ("blank" if t is None else f"class:{t}")) / 2.0 ** 64
                       for t in distinct] or [0.0], np.float64)
    return (np.array([ranks[t] for t in texts], np.int64)[codes] if cells else np.zeros(len(codes), np.int64)), phases


def stratified_splits(fractions: list[float], seed: int, units: list[str], unit: np.ndarray,
                      classes: np.ndarray, phases: np.ndarray) -> np.ndarray:
    """Each item's split (an index into ``fractions``) such that every split holds each class in the
    fractions' proportions. ``units``: the names hashed (each item's key, or each group's value), ``unit``:
    each item's unit, ``classes``: each item's class, ``phases``: each class's phase in [0, 1). A unit's
    stratum is its most frequent class (ties: the first); each stratum's units, in the order of
    ``stable_hash(seed, name)`` (the hash ``by: hash`` uses), are laid end to end from 0, each as long as its
    items, and a unit goes to the split whose share of the stratum holds its point: the place at the stratum's
    phase along the unit (single items: ``k + phase``). A split's items of a stratum are then within one
    unit's length of the fraction (for single items: strictly within one item), and, the phase being the
    class's, a stratum of one unit goes to each split at the odds of its fraction: small classes spread
    over the splits as the fractions say, where a point at each unit's middle sent every class of one or two
    items to the same split. Adding a unit of ``w`` items shifts the stratum's cuts and the units after it
    by at most ``w`` relative to each other, so it moves only units of its stratum whose points lie within
    ``w`` of a cut: for single items at most one per cut, else fewer items per cut than ``w`` plus the
    stratum's widest unit."""
    n = len(units)
    out = np.zeros(len(unit), np.int64)
    if not n or not len(unit):
        return out
    width = np.bincount(unit, minlength=n).astype(np.float64)
    ncls = int(classes.max()) + 1
    pairs, counts = np.unique(unit * ncls + classes, return_counts=True)   # sorted: by unit, then class
    pu, pc = pairs // ncls, pairs % ncls
    best = np.lexsort((pc, -counts, pu))   # per unit: the most items first, then the first class
    first = np.r_[0, np.flatnonzero(np.diff(pu[best])) + 1]
    stratum = np.zeros(n, np.int64)
    stratum[pu[best][first]] = pc[best][first]
    hashes = np.array([stable_hash(f"split:{int(seed)}:{name}") for name in units], np.uint64)
    order = np.lexsort((hashes, stratum))   # by stratum, then hash (ties: the unit's index, a stable sort)
    srt, w = stratum[order], width[order]
    start = np.r_[0, np.flatnonzero(np.diff(srt)) + 1]                     # each stratum's first unit
    before = np.cumsum(w) - w                                              # items before each unit, overall
    base = np.repeat(before[start], np.diff(np.r_[start, n]))             # ... before its stratum
    total = np.repeat(np.add.reduceat(w, start), np.diff(np.r_[start, n]))
    phase = phases[srt]
    point = before - base + phase * w                                      # each unit's point on its line
    cuts = np.cumsum(np.asarray(fractions, np.float64))[:-1]
    split = (point[:, None] >= cuts[None, :] * total[:, None]).sum(axis=1)
    per_unit = np.empty(n, np.int64)
    per_unit[order] = split
    return per_unit[unit]


def _where(table: Any) -> Any:
    """``i -> "table.csv: data row 7 (...)"`` or ``"input 'a/b.png'"``: how a message names item ``i``."""
    def at(i: int) -> str:
        if table.row is None:
            return f"input {echo(table.keys[i])}"
        return f"{table.row_files[int(table.row_file[i])]}: data row {int(table.row[i])} (1-based, header not counted)"
    return at


class _Groups:
    """The ``split.group`` of every item: each distinct cell through :func:`split_group` once; ``ids`` (per
    item, -1 where the cell is unusable) index ``values``; ``check`` flags and names the unusable ones: a
    blank cell (empty, only whitespace, null, NaN), which would make every row without a group one group
    (``''``; a null's ``'None'`` that of any row holding the text), and a pattern that does not match."""

    def __init__(self, sp: Any, col: str, factor: tuple[np.ndarray, list], at: Any, what: str = "column"):
        codes, cells = factor
        found: dict[str, int] = {}
        per = np.full(len(cells), -1, np.int64)
        msgs = [""] * len(cells)
        for u, v in enumerate(cells):
            if blank(v):
                msgs[u] = (f", {what} {echo(col)}: the group is blank ({echo(v)}): a row without a group could "
                           f"belong with any other row, so it cannot be kept apart from them; give every row its "
                           f"group (or leave split.group out)")
                continue
            try:
                per[u] = found.setdefault(split_group(sp, {col: v}), len(found))
            except ValueError as e:
                msgs[u] = f": {e}"
        self.ids, self.values = per[codes], list(found)
        self.check = (self.ids < 0, lambda i: (f"{at(i)}{msgs[codes[i]]}", "split.group"))


def _column_splits(recipe: Any, factor: tuple[np.ndarray, list], groups: Optional[_Groups], checks: list,
                   at: Any) -> tuple[np.ndarray, list[str]]:
    """``by: column``: each item's split code and the split names (sorted); raises the first input's error
    among ``checks`` and these: a split name that is not one, a group in two splits."""
    sp = recipe.model.split
    codes, cells = factor
    valid = [not blank(v) and NAME_RE.match(str(v)) is not None for v in cells]
    names = sorted({str(v) for v, ok in zip(cells, valid) if ok})
    pos = {s: i for i, s in enumerate(names)}
    split = np.array([pos[str(v)] if ok else -1 for v, ok in zip(cells, valid)], np.int64)[codes]
    checks.append((split < 0, lambda i: (f"{at(i)}, column {sp.column!r}: split name {echo(cells[codes[i]])} must be "
                                         f"letters, digits, '_', '.', '-'", "split.column")))
    if groups is not None and len(split):
        g = groups.ids
        ok = (g >= 0) & (split >= 0)
        first = np.full(len(groups.values), -1, np.int64)   # each group's first usable item
        gids, at_first = np.unique(g[ok], return_index=True)
        first[gids] = np.flatnonzero(ok)[at_first]
        f = np.where(g >= 0, first[np.maximum(g, 0)], -1)
        clash = ok & (f >= 0) & (split != split[np.maximum(f, 0)])
        checks.append((clash, lambda i: (f"{at(i)}: group {echo(groups.values[g[i]])} is in split {names[split[i]]!r} "
                                         f"here and in {names[split[f[i]]]!r} at {at(int(f[i]))} (a group must not "
                                         f"be in two splits)", "split.group")))
    _raise_first(recipe, checks)
    return split, names


def _raise_first(recipe: Any, checks: list[tuple[np.ndarray, Any]]) -> None:
    """The error of the first input any check flags (``checks``: (flag per input, ``i -> (message, loc)``),
    in the order one input is checked); nothing when none does."""
    firsts = [int(np.argmax(flags)) for flags, _ in checks if flags.any()]
    if not firsts:
        return
    i = min(firsts)
    for flags, message in checks:
        if flags[i]:
            msg, loc = message(i)
            raise RecipeError(msg, source=recipe.source, loc=loc)
