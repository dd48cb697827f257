"""``precompile stats``: per-channel mean, std, min and max (and class counts) of a built output.

Computed in one streaming pass: fixed-shape fields are read in blocks of
whole samples (at most ``block_bytes`` of float64 at a time), variable-shape
fields sample by sample; each block's count, mean and sum of squared
deviations are merged into float64 accumulators (Chan et al.'s pairwise
update), so outputs larger than memory work and the result matches numpy on
the whole array to rounding. ``std`` is the population standard deviation
(ddof 0); non-finite values (a flow's unknown vectors) are counted apart and
left out.

Channels follow the kind: the last axis of image, video, flow and mask fields
and of a vector ``target`` (one channel per table column, named in
``columns``; a blank cell is NaN and counted in ``nonfinite``), the first axis
of an audio sample (C, N), one channel for everything else (volumes, labels,
scalars). A ``text`` field gets its lengths in characters instead
(:func:`text_stats`). Label, mask and volume-mask fields also get
``classes``: every value seen with its count (and its name where the output
names it: :func:`class_names`, labels and box labels by ``label_names``, a COCO
semantic mask by its categories), and every declared class never seen with
count 0 (a label's class names, a named mask class, a mask's declared
``classes`` ids, or ``0 .. max_label``); nothing else.

The result is stored in the output's index under ``stats`` (HDF5: an
attribute of the index file holding JSON text; file folders: a key of the JSON
index's ``attrs``), replacing the file atomically (a temporary copy, then a
rename) while holding the output's build lock. It records the shard keys it
was computed from: :func:`loader_norm` (the Loader's ``mean="stats"``) refuses
stats that do not match the output's shards. The build keeps them current
(:func:`stats_after_build`): a rebuild that writes a new index computes again
the stats the old index held (the same fields), and a recipe's ``stats: true``
(``build --stats``) computes them for every field. Shard files are never touched,
so ``precompile verify`` is unaffected. Nothing here imports torch.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import numpy as np

from ..formats import Dataset, find_format, open_dataset
from ..formats import names as fmt
from ..errors import FormatError, PrecompileError

A_STATS = "stats"
STATS_VERSION = 1
BLOCK_BYTES = 32 << 20

# target: one channel per column; annotations: x1, y1, x2, y2 / x, y, visibility
CHANNELS_LAST = frozenset({"image", "video", "flow", "flow_valid", "mask", "target", "boxes", "keypoints"})
CHANNELS_FIRST = frozenset({"audio"})
CLASS_KINDS = frozenset({"label", "mask", "volume_mask", "flow_valid",
                         "box_labels"})   # one count per box: boxes per class
NAMED_KINDS = frozenset({"label", "box_labels"})   # class ids whose names are the output's label_names
MAX_CLASSES = 4096   # a "mask" with more distinct values than this gets no class table


class StatsError(PrecompileError):
    """Stats cannot be computed, written or used (an unknown field, missing or stale stats)."""

    exit_code = 2


def channel_axis(kind: str, ndim: int) -> int | None:
    """Axis of a sample (not a batch) that holds channels for ``kind``, or None for one channel."""
    if ndim == 0:
        return None
    if kind in CHANNELS_LAST:
        return ndim - 1
    if kind in CHANNELS_FIRST:
        return 0
    return None


class Accumulator:
    """Per-channel count, mean, M2, min, max and non-finite count, merged block by block in float64."""

    def __init__(self, channels: int, classes: bool = False):
        self.n = np.zeros(channels, np.int64)
        self.mean = np.zeros(channels, np.float64)
        self.m2 = np.zeros(channels, np.float64)
        self.lo = np.full(channels, np.inf)
        self.hi = np.full(channels, -np.inf)
        self.nonfinite = np.zeros(channels, np.int64)
        self.classes: dict[Any, int] | None = {} if classes else None

    def add(self, x: np.ndarray) -> None:
        """Merge ``x`` of shape (M, channels)."""
        if x.shape[0] == 0:
            return
        if self.classes is not None:
            vals, counts = np.unique(x, return_counts=True)
            for v, c in zip(vals.tolist(), counts.tolist()):
                self.classes[v] = self.classes.get(v, 0) + int(c)
            if len(self.classes) > MAX_CLASSES:
                self.classes = None
        x = x.astype(np.float64, copy=False)
        fin = np.isfinite(x)
        allfin = bool(fin.all())
        cnt = fin.sum(axis=0).astype(np.int64) if not allfin else np.full(x.shape[1], x.shape[0], np.int64)
        self.nonfinite += x.shape[0] - cnt
        xs = x if allfin else np.where(fin, x, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            m = np.where(cnt > 0, xs.sum(axis=0) / np.maximum(cnt, 1), 0.0)
        d = xs - m
        if not allfin:
            d = np.where(fin, d, 0.0)
        m2 = np.einsum("ij,ij->j", d, d)
        n = self.n + cnt
        with np.errstate(invalid="ignore", divide="ignore"):
            delta = m - self.mean
            w = np.where(n > 0, cnt / np.maximum(n, 1), 0.0)
            self.mean = self.mean + delta * w
            self.m2 = self.m2 + m2 + delta * delta * np.where(n > 0, self.n * cnt / np.maximum(n, 1), 0.0)
        self.n = n
        if allfin:
            self.lo = np.minimum(self.lo, x.min(axis=0))
            self.hi = np.maximum(self.hi, x.max(axis=0))
        else:
            self.lo = np.minimum(self.lo, np.where(fin, x, np.inf).min(axis=0))
            self.hi = np.maximum(self.hi, np.where(fin, x, -np.inf).max(axis=0))

    def result(self) -> dict[str, Any]:
        def f(a: np.ndarray) -> list[float | None]:
            return [float(v) if np.isfinite(v) else None for v in a]

        with np.errstate(invalid="ignore", divide="ignore"):
            std = np.sqrt(np.where(self.n > 0, self.m2 / np.maximum(self.n, 1), np.nan))
        mean = np.where(self.n > 0, self.mean, np.nan)
        return {"count": [int(v) for v in self.n], "mean": f(mean), "std": f(std), "min": f(self.lo),
                "max": f(self.hi), "nonfinite": [int(v) for v in self.nonfinite]}


def _blocks(ds: Dataset, field: str, block_bytes: int) -> Iterator[np.ndarray]:
    """The field's samples in order: stacked blocks for fixed shapes, one sample at a time otherwise."""
    spec = ds.field_specs[field]
    n = len(ds)
    if ds.variable(field):
        for i in range(n):
            yield ds[i][field][None]
        return
    per = max(1, int(np.prod(spec["shape"], dtype=np.int64)) * 8)  # as float64
    step = max(1, block_bytes // per)
    for lo in range(0, n, step):
        yield ds.batch(range(lo, min(n, lo + step)))[field]


def declared_classes(spec: dict[str, Any], names: Sequence[str] | None = None) -> list[int]:
    """Every class a field declares, seen or not: a label's class names (ids 0 .. n - 1), a mask's
    ``class_ids`` (the recipe's ``classes``) or else ``0 .. classes - 1``; [] when nothing is declared."""
    if names:
        return list(range(len(names)))
    ids = spec.get("class_ids")
    if ids is None and isinstance(spec.get("classes"), int):
        ids = range(spec["classes"])
    return [int(v) for v in ids] if ids is not None and len(ids) <= MAX_CLASSES else []


def class_names(ds: Dataset, field: str) -> dict[int, str]:
    """{class id: name} of ``field`` where the output names its classes: a label's and a box label's ids are
    ``label_names``; a COCO semantic mask (``inputs.coco.mask: semantic``) holds category (box label) + 1, so
    id k is ``label_names[k - 1]`` (0, the background, has no name); {} for any other field."""
    kind = ds.field_specs.get(field, {}).get("kind")
    if kind in NAMED_KINDS:
        return dict(enumerate(ds.label_names))
    coco = getattr(ds, "coco", None)
    if kind == "mask" and field == "mask" and coco and coco.get("mask") == "semantic":
        return {k + 1: str(n) for k, n in enumerate(ds.label_names)}
    return {}


def text_stats(ds: Dataset, field: str) -> dict[str, Any]:
    """A ``text`` field's lengths in characters (one channel: count, mean, std, min, max) and ``empty``
    (how many samples hold the empty string)."""
    lengths = np.asarray([len(ds[i][field]) for i in range(len(ds))], np.float64)
    acc = Accumulator(1)
    acc.add(lengths.reshape(-1, 1))
    return {"kind": "text", "dtype": "str", "channel_axis": None, "channels": 1, "of": "length in characters",
            **acc.result(), "empty": int((lengths == 0).sum())}


def target_columns(ds: Dataset, field: str) -> list[str] | None:
    """The table columns of a vector ``target`` field, in order (None when the recipe does not say)."""
    try:
        cols = ds.recipe["inputs"]["columns"][field].get("columns")
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    return list(cols) if cols else None


def field_stats(ds: Dataset, field: str, block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Stats of one field of an opened output (see the module docstring)."""
    spec = ds.field_specs[field]
    kind = str(spec.get("kind", ""))
    if kind == "text":
        return text_stats(ds, field)
    ndim = len(spec["shape"])
    axis = channel_axis(kind, ndim)
    channels = 1 if axis is None else spec["shape"][axis]
    if channels is None:
        raise StatsError(f"field {field!r}: its channel count varies between samples; cannot sum per channel")
    integer = np.dtype(spec["dtype"]).kind in "biu"
    acc = Accumulator(int(channels), classes=kind in CLASS_KINDS and integer)
    for b in _blocks(ds, field, block_bytes):
        if axis is not None:
            b = np.moveaxis(b, axis + 1, -1)
        acc.add(b.reshape(-1, int(channels)))
    out: dict[str, Any] = {"kind": kind, "dtype": spec["dtype"], "channel_axis": axis, "channels": int(channels),
                           **acc.result()}
    if kind == "target" and axis is not None:
        cols = target_columns(ds, field)
        if cols is not None and len(cols) == channels:
            out["columns"] = cols
    if acc.classes is not None:
        names = class_names(ds, field)
        counts = dict(acc.classes)
        for v in declared_classes(spec, ds.label_names if kind in NAMED_KINDS else None):
            counts.setdefault(v, 0)
        for v in names:                      # every named class, seen or not
            counts.setdefault(v, 0)
        out["classes"] = [{"id": int(v), "count": c, **({"name": names[int(v)]} if int(v) in names else {})}
                          for v, c in sorted(counts.items())]
    return out


def compute_stats(path: str | os.PathLike, fields: Sequence[str] | None = None,
                  block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Stats of ``fields`` (default all) of the output at ``path``."""
    ds = open_dataset(path)
    names = list(dict.fromkeys(fields)) if fields else list(ds.field_specs)
    for f in names:
        if f not in ds.field_specs:
            raise StatsError(f"{path}: no field {f!r} (fields: {', '.join(ds.field_specs)})")
    res: dict[str, Any] = {"version": STATS_VERSION, "num_samples": len(ds),
                           "shard_keys": [s.get("key") for s in ds.shards], "ddof": 0, "fields": {}}
    for f in names:
        res["fields"][f] = field_stats(open_dataset(path, fields=[f]), f, block_bytes)
    return res


# --- storing ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _lock(index_path: str) -> Iterator[None]:
    """The output's build lock (``<name>.shards/.lock``, as ``precompile build`` takes it): no build meanwhile."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    name = os.path.splitext(os.path.basename(index_path))[0]
    shard_dir = os.path.join(os.path.dirname(index_path), fmt.shard_dir_name(name))
    if not os.path.isdir(shard_dir):
        yield
        return
    fd = os.open(os.path.join(shard_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StatsError(f"{index_path}: a build of this output is running; run stats when it has finished") from None
        yield
    finally:
        os.close(fd)


def read_stats(ds_or_path: Dataset | str | os.PathLike) -> dict[str, Any] | None:
    """The stats stored in an output's index, or None when there are none."""
    ds = ds_or_path if isinstance(ds_or_path, Dataset) else open_dataset(ds_or_path)
    raw = ds.attrs.get(A_STATS)
    if raw is None:
        return None
    try:
        return fmt.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError as e:
        raise FormatError(f"{ds.path}: the stored stats are not valid JSON ({e})") from None


def write_stats(path: str | os.PathLike, stats: dict[str, Any], lock: bool = True) -> None:
    """Store ``stats`` in the index of the output at ``path`` (atomically; other fields' stats are kept
    when they were computed from the same shards). ``lock=False``: the caller holds the build lock."""
    path = os.path.abspath(str(path))
    with _lock(path) if lock else contextlib.nullcontext():
        ds = open_dataset(path)
        old = read_stats(ds)
        if old and old.get("shard_keys") == stats.get("shard_keys") and old.get("version") == stats.get("version"):
            stats = {**stats, "fields": {**old.get("fields", {}), **stats["fields"]}}
        text = fmt.dumps(stats)
        form = find_format(path)
        assert form is not None   # open_dataset found it
        form.set_index_attr(path, A_STATS, text)


def stats(path: str | os.PathLike, fields: Sequence[str] | None = None, write: bool = True,
          block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Compute the stats of ``path`` and (by default) store them in its index; returns them."""
    res = compute_stats(path, fields, block_bytes)
    if write:
        write_stats(path, res)
    return res


def stored_stats_fields(index_path: str) -> list[str] | None:
    """The fields whose stats the index at ``index_path`` holds (None: no index, or no stats in it)."""
    from ..formats import snapshot

    raw = (snapshot.read_index_attrs(index_path) or {}).get(A_STATS)
    try:
        while isinstance(raw, (str, bytes)):   # JSON text (a JSON index holds it as a string value)
            raw = fmt.loads(raw)
    except ValueError:
        return None
    fields = raw.get("fields") if isinstance(raw, dict) else None
    return list(fields) if isinstance(fields, dict) and fields else None


def stats_after_build(index_path: str, wanted: bool, previous: Sequence[str] | None) -> dict[str, Any] | None:
    """After a build wrote a new index: every field's stats when ``wanted`` (``stats: true``), else the
    fields the replaced index held stats for (``previous``) that the output still has; None when none.
    Called by the build, which holds the output's lock."""
    if not wanted and not previous:
        return None
    fields = None
    if not wanted:
        have = open_dataset(index_path).field_specs
        fields = [f for f in previous or () if f in have]
        if not fields:
            return None
    res = compute_stats(index_path, fields)
    write_stats(index_path, res, lock=False)
    return res


def ensure_stats(index_path: str) -> dict[str, Any] | None:
    """A build with nothing to write but ``stats: true``: compute every field's stats unless the index
    already holds them for its current shards; returns what was computed (None: they were current)."""
    ds = open_dataset(index_path)
    old = read_stats(ds)
    if (old and old.get("version") == STATS_VERSION and set(old.get("fields", {})) >= set(ds.field_specs)
            and old.get("shard_keys") == [s.get("key") for s in ds.shards]):
        return None
    res = compute_stats(index_path)
    write_stats(index_path, res, lock=False)
    return res


def describe(res: dict[str, Any], max_classes: int = 12) -> str:
    """The stats as a text table (``precompile stats`` prints it)."""
    lines = [f"{res['num_samples']} samples"]
    for f, s in res["fields"].items():
        ax = {None: "one channel", 0: "channels first"}.get(s["channel_axis"], "channels last")
        if s["kind"] == "text":
            ax = f"{s['of']}, {s['empty']} empty"
        elif s["kind"] == "target" and s["channel_axis"] is not None:
            ax = "one channel per column"
        lines.append(f"{f} ({s['kind']}, {s['dtype']}, {s['channels']} channel(s), {ax})")
        nan = "nan" if s["kind"] == "target" else "nonfinite"
        lines.append(f"  {'ch':>3} {'mean':>12} {'std':>12} {'min':>12} {'max':>12} {'count':>12} {nan:>9}")
        for c in range(s["channels"]):
            vals = [s[k][c] for k in ("mean", "std", "min", "max")]
            txt = " ".join(f"{'-' if v is None else format(v, '.6g'):>12}" for v in vals)
            name = f"  {s['columns'][c]}" if "columns" in s else ""
            lines.append(f"  {c:>3} {txt} {s['count'][c]:>12} {s['nonfinite'][c]:>9}{name}")
        if "classes" in s:
            cl = s["classes"]
            parts = [f"{c['id']}{'=' + c['name'] if 'name' in c else ''}: {c['count']}" for c in cl[:max_classes]]
            more = f" (+{len(cl) - max_classes} more)" if len(cl) > max_classes else ""
            lines.append(f"  classes {', '.join(parts)}{more}")
    return "\n".join(lines)


def box_counts(res: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Boxes per class of every ``box_labels`` field of computed stats: ``{field: {class name (or id): count}}``,
    every class of ``label_names`` listed (0 when no box has it)."""
    out: dict[str, dict[str, int]] = {}
    for f, s in res["fields"].items():
        if s.get("kind") == "box_labels" and "classes" in s:
            out[f] = {str(c.get("name", c["id"])): int(c["count"]) for c in s["classes"]}
    return out


# --- use in the Loader -----------------------------------------------------------------------

def loader_norm(ds: Dataset, field: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of ``field`` from the stored stats, times ``scale`` (the Loader's 1/255
    for uint8), for ``(x * scale - mean) / std``. Raises :class:`StatsError` when the stats are missing,
    stale (computed from other shards) or lack the field."""
    st = read_stats(ds)
    where = getattr(ds, "path", "the output")
    if st is None:
        raise StatsError(f"{where}: has no stats; run `precompile stats {where}` first, or build with `stats: true` "
                         f"(`build --stats`) (mean/std='stats')")
    if st.get("shard_keys") != [s.get("key") for s in ds.shards]:
        raise StatsError(f"{where}: its stats were computed before the output was rebuilt; "
                         f"run `precompile stats {where}` again")
    fs = st.get("fields", {}).get(field)
    if fs is None:
        raise StatsError(f"{where}: the stats have no field {field!r}; run `precompile stats {where} --field {field}`")
    mean, std = fs["mean"], fs["std"]
    if any(v is None for v in mean + std) or any(float(v) == 0 for v in std):
        raise StatsError(f"{where}: field {field!r} has an undefined or zero std in its stats; "
                         f"give mean and std explicitly")
    return [float(m) * scale for m in mean], [float(s) * scale for s in std]


def mixture_norm(parts: Sequence[tuple[Sequence[float], Sequence[float]]],
                 shares: Sequence[Any]) -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) of a stream that mixes sources of per-channel ``parts`` (each a (mean, std), the
    population std, as :func:`loader_norm` gives them) in ``shares`` (each source's share of the stream's
    samples, summing to 1; the samples of equal size): the mixture's mean ``sum(w m)`` and population std
    ``sqrt(sum(w (s^2 + (m - mean)^2)))``, in float64."""
    w = np.asarray([float(x) for x in shares], np.float64)[:, None]
    m = np.asarray([p[0] for p in parts], np.float64)
    s = np.asarray([p[1] for p in parts], np.float64)
    mean = (w * m).sum(axis=0)
    std = np.sqrt((w * (s * s + (m - mean) ** 2)).sum(axis=0))
    return [float(v) for v in mean], [float(v) for v in std]
