"""The stage sequence of a build and its entry point :func:`build`:
lock -> plan -> keys -> run -> finalize -> report.

:func:`build` makes the plan and the shard keys and takes the output's lock (a URL output with nothing
to do answers first, without it); :func:`_stages` runs the rest, one short function each: clean
temporaries, the no-op check (:func:`_unchanged`), sort shards
(up to date or to do), reuse siblings' shards, run (:mod:`.backends`), check the outcome,
finalize (index, then report). Everything that reads or writes the stored build goes through the output
(:mod:`.output`: a local folder, or a URL). Shards whose stored key matches are skipped (incremental,
resumable); the rest run as shard tasks (in-process for one job, worker processes forked from this one
locally, or a dask cluster). The index and the build report are written last. A Ctrl-C once the shards
run stops the workers and raises :class:`BuildInterrupted`.

Guarantees kept here:

- snapshots: shards are named by their key, so a rebuild writes its shards beside
  the ones the current index points to and never over them; the new index replaces
  the old one in one atomic rename (the old one is never removed first), so a reader
  that opens the output at any moment gets the whole old build or the whole new one.
  Afterwards the files no index refers to are removed, but the snapshot just replaced
  (``previous.json``) is kept until the next build starts, for readers still open on it.
- resume: stray ``*.tmp-*`` files of a killed build are removed, shards are renamed
  into place only when complete, and the index is written last; a rerun redoes only
  the shards that are missing or whose key changed.
- reuse: a shard whose key matches one in a sibling output folder (same recipe,
  other output name) is hard-linked (or copied) instead of rebuilt.
- error policy: failed inputs (and those skipped by earlier incremental builds,
  read from each shard's ``.skipped.json`` sidecar) are listed in the report;
  ``max_failures`` stops the build; a loky worker that dies has its shards
  retried once with decoding isolated in a helper process, so a crashing codec
  fails only its input, and a second death fails the shard with a message that
  names it and its inputs.
- lifetime: no worker process outlives the build, however it ends
  (:mod:`.forkpool`); a Ctrl-C says how many shards were kept.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import glob
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from .. import __version__
from ..formats import names as fmt
from ..optschema import flag
from ..errors import BuildError, FormatError, PrecompileError, RecipeError, echo
from ..recipe import Recipe, load_recipe
from ..registry import WRITERS
from ..sample import FieldSpec
from ..tools.stats import ensure_stats, stats_after_build, stored_stats_fields
from ..formats.base import shard_digest
from ..formats import snapshot
from .backends import remove_path, run_shards, start_pool
from ..storage.faults import check_space
from .keys import find_reusable, recipe_key, shard_key, skipped_path
from .output import output_for
from .plan import Plan, make_plan, plan_specs
from .results import BuildReport, Failure, count_inputs, zero_timings


def check_plan(plan: Plan) -> None:
    """Checks that need the plan: the output format can hold the fields; copies make sense."""
    check_output(plan.recipe, plan.specs)


def check_output(r: Recipe, specs: dict[str, FieldSpec]) -> None:
    """The writer's options and its check of the planned field specs; copies need a random step."""
    wcls = WRITERS.get(r.model.output.format)
    from ..recipe import parse_params

    options = parse_params(wcls.Options, r.model.output.options, r.source, ("output", "options"))
    try:
        wcls().check_specs(specs, options)
    except ValueError as e:
        raise RecipeError(str(e), source=r.source, loc="output.format") from None
    has_random = any(s.random for s in r.steps)
    if r.model.copies > 0 and not has_random:
        raise RecipeError("copies > 0 needs at least one random step (e.g. random_crop)", source=r.source, loc="copies")


def check_recipe(recipe: Recipe) -> dict[str, FieldSpec]:
    """Every check of :func:`build`'s planning that needs neither listing the inputs nor decoding one
    (``precompile validate``): the decoders' specs, every step's kind rules and field matching, the
    writer's options and spec checks. With ``inputs.coco`` the annotation file is read (its categories and
    keypoints decide the specs, and its errors are the recipe's); the image folder is not listed. Raises the
    same RecipeError the plan would; returns the specs."""
    extra = None
    if recipe.model.inputs.coco is not None:
        from ..inputs.coco.parse import parse_coco

        extra = parse_coco(recipe).specs(recipe.model.inputs.coco)
    specs, _ = plan_specs(recipe, extra)
    check_output(recipe, specs)
    return specs


def _build_date() -> str:
    """The build date the index records (ISO 8601, UTC, whole seconds): :func:`source_date`."""
    return source_date().replace(microsecond=0).isoformat()


def source_date() -> _dt.datetime:
    """``SOURCE_DATE_EPOCH`` (seconds since 1970-01-01 UTC, as reproducible builds set it) when it is set and
    not empty, else now: what makes two builds' indexes the same bytes. A malformed value (not ASCII digits,
    past the year 9999) is a PrecompileError naming it; :func:`build` checks it before anything is written."""
    sde = os.environ.get("SOURCE_DATE_EPOCH", "")
    if not sde:
        return _dt.datetime.now(_dt.timezone.utc)
    try:
        if sde.isascii() and sde.isdigit():
            return _dt.datetime.fromtimestamp(int(sde), _dt.timezone.utc)
    except (OverflowError, OSError, ValueError):
        pass
    raise PrecompileError(f"SOURCE_DATE_EPOCH={echo(sde, 40)}: the build date the index records must be a whole "
                          f"number of seconds since 1970-01-01 00:00 UTC, up to the year 9999 (e.g. "
                          f"SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)); unset it to record the time of the build")


def output_paths(recipe: Recipe, out_dir: str) -> tuple[str, str]:
    """(index file, shard folder) for a recipe under ``out_dir``."""
    index = os.path.join(out_dir, recipe.output_name + WRITERS.get(recipe.model.output.format).index_ext)
    return index, os.path.join(out_dir, fmt.shard_dir_name(recipe.output_name))


def build(recipe: Recipe | dict | str | os.PathLike, out_dir: str | os.PathLike = "build",
          n_jobs: Optional[int] = None,
          force: bool = False, progress: bool = False, scheduler: Optional[str] = None,
          content_hash: bool = False, on_error: Optional[str] = None,
          max_failures: Optional[int] = None, timeout_s: Optional[float] = None,
          force_space: bool = False, repair: bool = False, stats: Optional[bool] = None,
          storage_options: Optional[dict[str, Any]] = None) -> BuildReport:
    """Build a recipe into ``out_dir``; returns the build report (also written as JSON).

    ``out_dir`` may be a URL (``s3://bucket/prefix``): the same layout, uploaded by the workers; credentials
    from the store's environment or ``storage_options`` (fsspec's), never stored (docs/reference-build.md).

    ``repair=True`` first verifies the existing output (every byte, as ``precompile verify``) and rebuilds
    exactly the shards it finds damaged, and the index when the index is damaged (docs/limits.md).

    ``recipe`` is a recipe file's path, a :class:`Recipe`, or the recipe as a dict (the same keys as the
    YAML; a relative ``inputs.root`` and the ``imports`` search are then relative to the current folder).

    ``n_jobs``: parallel shard tasks; None means 1 in-process, or with ``scheduler="local"`` one dask worker
    per core. ``on_error``, ``max_failures`` and ``timeout_s`` override the recipe's keys of
    the same names (they do not change any shard's key). One build of an output at a
    time: a second one started meanwhile stops with a BuildError.

    Before any shard is built, the plan's estimated size of the shards to write is compared with the
    free space of ``out_dir``; a build that cannot fit is refused with both numbers (``force_space=True``
    skips the check; a URL output has no free space to check). The output's faults (out of space,
    read-only, vanished, I/O errors; for a URL: no credentials, an unreachable endpoint, a missing bucket,
    access denied) stop the build with an :class:`~precompile.errors.OutputError` (exit code 6);
    a worker killed by SIGKILL twice with a :class:`~precompile.errors.WorkerKilledError` (exit code 7).
    Either way the previous build stays readable and finished shards are kept.

    ``stats=True`` (or the recipe's ``stats: true``) stores the output's statistics (``precompile
    stats``) in the index after the build; stats stored before are computed again, for the same
    fields, whenever a rebuild writes a new index, so a Loader's ``mean="stats"`` keeps working.

    The report is a :class:`~precompile.compiler.results.BuildReport`; it reads like the JSON
    report (``rep["shards"]["built"]``), and ``rep.to_json()`` is that dict.
    """
    n_jobs = _check_call(n_jobs, force=force, progress=progress, content_hash=content_hash,
                         force_space=force_space, repair=repair, stats=stats)
    if n_jobs is None and scheduler != "local":
        n_jobs = 1
    source_date()   # a malformed SOURCE_DATE_EPOCH stops the build here, not after its shards are built
    recipe = with_policy(as_recipe(recipe), on_error=on_error, max_failures=max_failures, timeout_s=timeout_s,
                         stats=stats)
    t_start = time.perf_counter()
    run = (force, progress, scheduler, force_space, repair)
    doing = f"building {recipe.output_name!r}"
    with output_for(out_dir, storage_options, recipe.output_name) as out, contextlib.ExitStack() as held:
        if out.remote:
            out.check_recipe(recipe)
            with _faults(out, doing, NOTHING_WRITTEN):
                out.listing()  # the first request: no credentials, no endpoint, no bucket stop the build here
        else:   # loky workers start (and import the decoders) while the parent plans; a URL output's no-op
            #     check needs the store's index first, so its workers start when its shards run
            start_pool(n_jobs, scheduler, output_paths(recipe, out.root)[0], recipe.content_hash(), force or repair)
        cache = None if out.remote else os.path.join(output_paths(recipe, out.root)[1], fmt.COCO_PLAN_CACHE)
        plan = make_plan(recipe, coco_cache=cache, content_hash=content_hash)  # errors before anything is written
        check_plan(plan)
        with _faults(out, doing):
            b = _Build.start(recipe, plan, out, n_jobs, t_start)
            keys = _keys(b, content_hash)
            if out.remote:   # nothing to do and nothing to write: one listing and the index read, no lock
                report = None if force or repair else _settled(b, keys)
                if report is not None:
                    return report
            with _faults(out, doing, NOTHING_WRITTEN):  # a store's first write: access denied stops it here
                held.enter_context(out.lock(b.shard_dir, recipe.output_name))
            out.forget()   # what was listed before the lock may have changed since
            return _stages(b, keys, *run)


NOTHING_WRITTEN = "nothing was written; run build again once that is fixed"


@contextlib.contextmanager
def _faults(out: Any, doing: str, kept: Optional[str] = None) -> Iterator[None]:
    """The output's errors (a full disk, a store that refuses) as its OutputError; others unchanged."""
    try:
        yield
    except PrecompileError:
        raise
    except Exception as e:
        err = out.fault(e, doing, kept)
        if err is None:
            raise
        raise err from None


def as_recipe(recipe: Recipe | dict | str | os.PathLike) -> Recipe:
    """A :class:`Recipe` from what :func:`build` accepts."""
    if isinstance(recipe, dict):
        from ..recipe import parse_recipe

        return parse_recipe(recipe)
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, (str, os.PathLike)):
        raise RecipeError(f"expected a recipe file's path, a dict or a Recipe, got {type(recipe).__name__}")
    return load_recipe(recipe)


def _check_call(n_jobs: Any, **flags: Any) -> Optional[int]:
    """``build()``'s own arguments as the CLI gives them: ``n_jobs`` None, a whole number >= 1, or -1 (every
    core, as ``-j -1``); each flag True or False (``stats`` None too). bool() took ``force="no"`` as a forced
    rebuild, ``n_jobs=2.5`` reached the pool, ``n_jobs="2"`` failed comparing a string."""
    for name, v in flags.items():
        if not (name == "stats" and v is None):
            try:
                flag(v, name)
            except ValueError as e:
                raise ValueError(f"build(): {e}") from None
    if n_jobs is None:
        return None
    import numbers

    if isinstance(n_jobs, bool) or not isinstance(n_jobs, numbers.Integral) or not (n_jobs >= 1 or n_jobs == -1):
        raise ValueError(f"build(): n_jobs must be a whole number of jobs >= 1, or -1 for every core, got "
                         f"{str(n_jobs)[:80]!r}")
    return (os.cpu_count() or 1) if n_jobs == -1 else int(n_jobs)


@dataclass
class _Build:
    """One build's fixed facts (what the stages share): the recipe, its plan, where it goes."""

    recipe: Recipe
    plan: Plan
    out_dir: str
    index_path: str
    shard_dir: str
    writer: Any
    n_jobs: Optional[int]
    t_start: float
    rhash: str
    out: Any          # where it goes: output.LocalOutput or url_output.UrlOutput

    @classmethod
    def start(cls, recipe: Recipe, plan: Plan, out: Any, n_jobs: Optional[int], t_start: float) -> "_Build":
        index_path, shard_dir = output_paths(recipe, out.root)
        out.prepare(shard_dir)
        return cls(recipe, plan, out.root, index_path, shard_dir, WRITERS.get(recipe.model.output.format)(), n_jobs,
                   t_start, recipe.content_hash(), out)

    def shard_name(self, s: Any, key: str) -> str:
        """The shard's file name: its index and content key (a changed shard gets a new name)."""
        return fmt.shard_file_name(s.index, self.writer.shard_ext, key)

    def shard_path(self, s: Any, key: str) -> str:
        return os.path.join(self.shard_dir, self.shard_name(s, key))

    def shard_entry_file(self, s: Any, key: str) -> str:
        """The shard's file as the index names it (relative to the index's folder)."""
        return f"{fmt.shard_dir_name(self.recipe.output_name)}/{self.shard_name(s, key)}"


@dataclass
class _State:
    """What the stages learn as they go: finished shards' infos, failures, the shards still to build."""

    infos: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    todo: list[tuple[Any, str]] = field(default_factory=list)
    reused: int = 0
    reused_shards: set[int] = field(default_factory=set)   # their indexes (a split's report counts its own)
    failed_shards: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=zero_timings)
    events: list[str] = field(default_factory=list)

    known: dict[str, str] = field(default_factory=dict)   # shard file name -> whole-shard sha256 (stored index)
    parts: dict[int, Any] = field(default_factory=dict)   # shard index -> its share of the index (hdf5_parts)

    def keep(self, index: int, info: dict[str, Any], path: str, skipped: list[Failure]) -> None:
        """A finished shard with the right key: its info (with the whole-shard sha256 the index or its sidecar
        recorded for it, else computed), and the inputs it ``skipped`` when it was built."""
        info["sha256"] = info.get("sha256") or self.known.get(os.path.basename(path)) or shard_digest(path)
        self.infos[index] = info
        self.failures.extend(f.from_previous_build() for f in skipped)


def _keys(b: _Build, content_hash: bool) -> dict[int, str]:
    """Every shard's key (:func:`.keys.shard_key`), by shard index."""
    skey = recipe_key(b.recipe)
    return {s.index: shard_key(b.plan, s, skey, content=content_hash) for s in b.plan.shards}


def _stages(b: _Build, keys: dict[int, str], force: bool, progress: bool, scheduler: Optional[str],
            force_space: bool = False, repair: bool = False) -> BuildReport:
    """The stages after the lock: clean -> (nothing to do?) -> sort -> reuse -> run -> finalize.
    With ``split:``, the no-op check and finalize run once per split output (:func:`split_views`)."""
    if not b.out.remote:
        _clean_temporaries(b)
        if b.plan.pending is not None:
            b.plan.pending.write()   # the parsed annotation file, for the next build (coco_cache)
    named = split_views(b)
    views = [v for _, v in named]
    damaged = _damaged(views) if repair and not force else None
    if not force and damaged is None:
        report = _noop(b, keys, named)
        if report is not None:
            return report
    # the snapshot the current index replaced goes now (frees its space); the current one and the
    # shards this plan names (finished by a killed build) stay
    planned = {b.shard_name(s, keys[s.index]) for s in b.plan.shards}
    b.out.collect(b.shard_dir, b.out.referenced(b.shard_dir) | planned)
    st = _sort_shards(b, keys, force, damaged)
    st.events.extend(b.out.notes)
    if not force and not b.out.remote:   # siblings are local folders
        _reuse_siblings(b, keys, st)
    if not force_space and not b.out.remote:   # a store has no free space to check
        _check_space(b, st)
    # shard files to do that are there already (damaged, for --repair): a Ctrl-C's count leaves them out (a
    # rerun rebuilds them), unless --force (a rerun without it keeps them)
    stale = set() if b.out.remote or force else {p for _, p in st.todo if os.path.exists(p)}
    try:
        try:
            _run_stage(b, keys, st, progress, scheduler)
        except (OSError, PrecompileError):
            if not b.out.remote:
                _clean_temporaries(b)  # a full disk: the half-written shards' space back (finished shards are kept)
            raise
        return _conclude(b, st, views, named)
    except KeyboardInterrupt:   # Ctrl-C: the workers are stopped by now; say what is kept
        kept = {s.index for s in b.plan.shards if s.index in st.infos}
        if not b.out.remote:
            _clean_temporaries(b)
            # and those renamed into place whose results had not come back yet (a rerun keeps them too)
            kept |= {s.index for s, p in st.todo if p not in stale and os.path.exists(p)}
        raise BuildInterrupted(len(kept), len(b.plan.shards), force) from None


class BuildInterrupted(KeyboardInterrupt):
    """A build stopped by Ctrl-C (a KeyboardInterrupt, as any other) once its shards had started: ``kept``
    of ``total`` shards are written and kept (a rerun skips them); the half-written ones were removed."""

    def __init__(self, kept: int, total: int, force: bool = False):
        self.kept, self.total = kept, total
        again = "run the same command again without --force" if force else "run the same command again"
        super().__init__(f"{kept} of {total} shards written and kept; {again} to finish")


def _conclude(b: _Build, st: _State, views: list[_Build], named: list[tuple[Optional[str], _Build]]) -> BuildReport:
    """After the run: check the outcome, finalize (each split's index), retire the replaced snapshot."""
    report = _report(b, st)
    _check_outcome(b, st, report, named)
    replaced = [f for v in views for f in _index_files(b.out, v.index_path)]
    if views[0] is b:
        report = _finalize(b, st, report)
    else:
        done = [_finalize(v, st, _split_report(report, v, st)) for v in views]
        report = _merge_splits(b, named, done, report)
        _write_report(b.out, b.index_path, report)
    for index in _orphan_indexes(b, views):
        replaced.extend(_index_files(b.out, index))
        report_path = os.path.splitext(index)[0] + fmt.REPORT_SUFFIX
        for p in (index, report_path) if report_path != os.path.splitext(b.index_path)[0] + fmt.REPORT_SUFFIX \
                else (index,):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
    _retire(b, replaced)
    return report


def _orphan_indexes(b: _Build, views: list[_Build]) -> list[str]:
    """The indexes of this output that this build did not write: ``<name>.h5`` after ``split:`` was added,
    ``<name>.<split>.h5`` of a split no longer there, ``<name>.h5`` after the format became ``png`` (its
    ``<name>.json`` written instead). A clean build has none of them; left in place they would serve the old
    recipe's samples and keep its shards forever (every index in the folder is asked which to keep). An index
    is this output's when its name is ``<name>.<...>`` and the recipe it records has this output name (so an
    output named ``<name>.v2`` is another's). Local outputs only."""
    if b.out.remote:
        return []
    name = b.recipe.output_name
    written = {os.path.abspath(v.index_path) for v in views}
    found = []
    for index in snapshot.indexes_in(b.out_dir):
        if os.path.abspath(index) in written or not os.path.basename(index).startswith(name + "."):
            continue
        attrs = snapshot.read_index_attrs(index)
        try:
            recorded = fmt.loads(attrs[fmt.A_RECIPE]) if attrs else None
            owner = (recorded.get("output") or {}).get("name") or recorded.get("name")
        except (KeyError, ValueError, TypeError, AttributeError):
            continue
        if owner == name:
            found.append(index)
    return found


def _split_report(report: BuildReport, v: _Build, st: _State) -> BuildReport:
    """The build's report as one split's (``v``): its inputs, its shards' failures and counts (as the report a
    no-change rebuild makes of the split, :func:`_unchanged`); its own stage_seconds (finalize sets it)."""
    mine = {s.index for s in v.plan.shards}
    todo = {s.index for s, _ in st.todo} & mine
    failed = sum(1 for i in st.failed_shards if i in mine)
    return dataclasses.replace(
        report, output=v.index_path, inputs=len(v.plan.items),
        failures=[f for f in report.failures if f.shard is None or f.shard in mine],
        shards={"total": len(mine), "built": len(todo) - failed, "skipped": len(mine) - len(todo),
                "reused": len(st.reused_shards & mine), "failed": failed},
        stage_seconds=dict(report.stage_seconds))


def _index_files(out: Any, index_path: str) -> list[str]:
    """The shard files the stored index at ``index_path`` names ([] when there is none)."""
    local = out.index_copy(index_path)
    return snapshot.index_files(local) if local else []


def _noop(b: _Build, keys: dict[int, str], named: list[tuple[Optional[str], _Build]]) -> Optional[BuildReport]:
    """The report of a build with nothing to do (every split output unchanged), or None. Writes only a
    missing or damaged report (and stats the recipe asks for that are not current)."""
    views = [v for _, v in named]
    reports = [_unchanged(v, keys) for v in views]
    if not all(r is not None for r in reports):
        return None
    for v, r in zip(views, reports):
        _ensure_report(b.out, v.index_path, r)
        if b.recipe.model.stats:
            ensure_stats(v.index_path)
    if views[0] is b:
        return reports[0]
    report = _merge_splits(b, named, reports, reports[0])
    _ensure_report(b.out, b.index_path, report)
    return report


def _settled(b: _Build, keys: dict[int, str]) -> Optional[BuildReport]:
    """A URL output with nothing to do and nothing to write (every report there): its report, without the
    lock (the index is replaced in one PUT, so what one listing and the index say is one snapshot)."""
    named = split_views(b)
    paths = [v.index_path for _, v in named] + ([b.index_path] if named[0][1] is not b else [])
    if not all(b.out.exists(os.path.splitext(p)[0] + fmt.REPORT_SUFFIX) for p in paths):
        return None
    return _noop(b, keys, named)


def split_views(b: _Build) -> list[tuple[Optional[str], _Build]]:
    """The build itself, or with ``split:`` one view per split: the split's items and shards, and its
    index ``<name>.<split><ext>`` (its report ``<name>.<split>.report.json``) beside the build's."""
    from .plan import split_names

    names = split_names(b.recipe, b.plan.items)
    if not names:
        return [(None, b)]
    stem, ext = b.index_path[:-len(b.writer.index_ext)], b.writer.index_ext
    return [(name, dataclasses.replace(b, index_path=f"{stem}.{name}{ext}", plan=b.plan.split_view(name)))
            for name in names]


def _merge_splits(b: _Build, named: list[tuple[Optional[str], _Build]], reports: list[BuildReport],
                  base: BuildReport) -> BuildReport:
    """The build's report over its split outputs: totals, and per split the inputs, their realised
    fraction of all inputs, the samples written and the output."""
    n_in = max(1, len(b.plan.items))
    splits = {name: {"inputs": len(v.plan.items), "fraction": round(len(v.plan.items) / n_in, 4),
                     "samples": r.num_samples, "output": v.index_path} for (name, v), r in zip(named, reports)}
    num = sum(r.num_samples or 0 for r in reports)
    wall = round(time.perf_counter() - b.t_start, 4)
    return dataclasses.replace(
        base, output=b.index_path, inputs=len(b.plan.items), num_samples=num,
        bytes=sum(r.bytes or 0 for r in reports), wall_seconds=wall, splits=splits,
        samples_built=sum(r.samples_built or 0 for r in reports),
        samples_per_second=_rate(sum(r.samples_built or 0 for r in reports), wall),
        failures=base.failures if not base.up_to_date else [f for r in reports for f in r.failures],
        shards=base.shards if not base.up_to_date else dict(base.shards, total=len(b.plan.shards),
                                                           skipped=len(b.plan.shards)),
        stage_seconds=dict(base.stage_seconds, finalize=round(sum(r.stage_seconds["finalize"] for r in reports), 4)))


def _retire(b: _Build, replaced: list[str]) -> None:
    """After the new index is in place: remember the snapshot it replaced, remove what no index refers to."""
    b.out.remember_previous(b.shard_dir, replaced)
    b.out.collect(b.shard_dir, b.out.referenced(b.shard_dir) | b.out.previous(b.shard_dir))


def _check_space(b: _Build, st: _State) -> None:
    """Refuse a build whose shards to write (the plan's estimate, pro rata) do not fit in the free space."""
    est = b.plan.estimated_bytes() if st.todo else None
    if est is None:
        return
    total = sum(len(s.items) for s in b.plan.shards) or 1
    need = est * sum(len(s.items) for s, _ in st.todo) // total
    check_space(b.out_dir, need, len(st.todo))


def _clean_temporaries(b: _Build) -> None:
    """Remove a killed build's stray temporaries (shards, the index, the report): the lock is ours, so no
    other build is writing them."""
    for p in (glob.glob(os.path.join(glob.escape(b.shard_dir), "*.tmp-*"))
              + glob.glob(os.path.join(glob.escape(b.out_dir), glob.escape(b.recipe.output_name) + ".*.tmp-*"))):
        remove_path(p)  # a file, or a shard folder


def _sort_shards(b: _Build, keys: dict[int, str], force: bool, damaged: Optional[frozenset[str]] = None) -> _State:
    """Shards whose stored key matches are kept; the rest (and those ``verify`` found ``damaged``) are to do.
    A kept shard's parts (its share of the index) come from the index it is in, or from the output (a URL
    output's sidecar); a repair trusts neither the sha256s nor the rows of an index that may be damaged."""
    known, stored = _stored(b, keys) if damaged is None else ({}, {})
    st = _State(known=known)
    for s in b.plan.shards:
        path = b.shard_path(s, keys[s.index])
        name = os.path.basename(path)
        entry, parts = stored.get(name, (None, None))
        info, own = (None, None) if force or name in (damaged or ()) else \
            b.out.finished_shard(b.writer, path, keys[s.index], entry, parts)
        if info is not None and entry is not None and entry.get("bytes") is not None \
                and info.get("bytes") != entry["bytes"]:
            # not the size the index recorded: truncated or replaced by hand (HDF5 may have read its key from a
            # copy of the file this process still holds open, from before the change)
            info = None
        if info is None:
            st.todo.append((s, b.out.task_path(path)))
            continue
        st.keep(s.index, info, path, b.out.read_skipped(path, keys[s.index]))
        chosen = own if own is not None else parts
        if chosen is not None:
            st.parts[s.index] = chosen
    return st


def _stored(b: _Build, keys: dict[int, str]) -> tuple[dict[str, str], dict[str, tuple[dict[str, Any], Any]]]:
    """What the current index (every split's index, with ``split:``: the build's own index name is then never
    written) says of its shards: {file name: sha256} of every entry (each name carries its key), and
    {file name: (entry, parts)} of the entries this plan names with the same key (HDF5: parts from the
    index's rows, :func:`precompile.formats.hdf5_parts.parts_from_index`; None when it has no chunk tables)."""
    digests: dict[str, str] = {}
    stored: dict[str, tuple[dict[str, Any], Any]] = {}
    for _, v in split_views(b):
        attrs = b.out.index_attrs(v.index_path)
        try:
            shards = fmt.loads(attrs[fmt.A_SHARDS]) if attrs and fmt.A_SHARDS in attrs else []
            digests.update({os.path.basename(e["file"]): e["sha256"] for e in shards
                            if isinstance(e.get("sha256"), str)})
            planned = {v.shard_entry_file(s, keys[s.index]): keys[s.index] for s in v.plan.shards}
            mine = [e for e in shards if planned.get(e.get("file")) == e.get("key")]
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        parts = {}
        if mine and b.writer.name == "hdf5":
            from ..formats.hdf5_parts import parts_from_index

            try:
                parts = parts_from_index(b.out.index_copy(v.index_path), shards, {e["file"] for e in mine})
            except (OSError, KeyError, ValueError, TypeError):  # an unreadable index: the shards' own parts
                parts = {}
        stored.update({os.path.basename(e["file"]): (e, parts.get(e["file"])) for e in mine})
    return digests, stored


def _reuse_siblings(b: _Build, keys: dict[int, str], st: _State) -> None:
    """Link the shards to do that a sibling output already has (same key, same file name)."""
    todo = []
    for s, path in st.todo:
        src = find_reusable(b.out_dir, b.shard_dir, os.path.basename(path), keys[s.index], b.writer)
        if src is not None and _link_shard(src, path):
            info = b.writer.read_shard_info(path)
            if info is not None and info["key"] == keys[s.index]:
                st.reused += 1
                st.reused_shards.add(s.index)
                st.keep(s.index, info, path, b.out.read_skipped(path, keys[s.index]))
                continue
        todo.append((s, path))
    st.todo = todo


def _run_stage(b: _Build, keys: dict[int, str], st: _State, progress: bool, scheduler: Optional[str]) -> None:
    """Build the shards to do on the chosen backend, gathering results until done or the policy stops it."""
    r, plan = b.recipe, b.plan
    mf = r.model.max_failures
    chunking = {s.index: plan.chunking(s) for s in plan.shards}
    bar = None
    if progress:
        from .progress import Progress

        # up-to-date shards are the bar's initial count: tqdm leaves them out of the rate
        bar = Progress(len(plan.items), sum(len(s.items) for s in plan.shards if s.index in st.infos), r.name,
                       {s.index: len(s.items) for s, _ in st.todo})
    try:
        # a cluster's workers build in their own folders (the ones of another machine are not this one's)
        dest = b.out.shard_target(private=scheduler is not None)
        for res in run_shards(r, st.todo, keys, plan, chunking, b.n_jobs, scheduler, st.events, bar, dest):
            for k in st.timings:
                st.timings[k] += res.timings[k]
            st.failures.extend(res.failures)
            if bar is not None:
                bar.shard_done(res.index)
            if res.failed:
                st.failed_shards.append(res.index)
                if r.model.on_error == "fail" or any(f.policy for f in res.failures):
                    break
            else:
                st.infos[res.index] = res.info(keys[res.index])
                if res.parts is not None:
                    st.parts[res.index] = res.parts
            if mf is not None and count_inputs(st.failures) > mf:
                break
    finally:
        # in input order, whatever order the workers finished in: shard by shard (a stable sort keeps each
        # shard's in its inputs' order), so the report and the list of skipped inputs do not depend on -j
        st.failures.sort(key=lambda f: -1 if f.shard is None else f.shard)
        if bar is not None:
            bar.close()


def _report(b: _Build, st: _State) -> BuildReport:
    """The report of the shards run so far (finalize adds the totals)."""
    r, plan = b.recipe, b.plan
    return BuildReport(
        name=r.output_name, recipe=r.source, recipe_hash=b.rhash, output=b.index_path,
        format=r.model.output.format, jobs=b.n_jobs if b.n_jobs is not None else (os.cpu_count() or 1),
        inputs=len(plan.items),
        shards={"total": len(plan.shards), "built": len(st.todo) - len(st.failed_shards),
                "skipped": len(plan.shards) - len(st.todo), "reused": st.reused, "failed": len(st.failed_shards)},
        failures=st.failures, events=st.events, on_error=r.model.on_error,
        stage_seconds={k: round(v, 4) for k, v in st.timings.items()},
        wall_seconds=round(time.perf_counter() - b.t_start, 4), precompile_version=__version__)


def _check_outcome(b: _Build, st: _State, report: BuildReport,
                   named: Sequence[tuple[Optional[str], _Build]] = ()) -> None:
    """Stop with a BuildError (the report written, status failed) when shards failed, more inputs failed than
    ``max_failures``, or every input failed, of the build or of one of its splits (``named``)."""
    r, plan, failures = b.recipe, b.plan, st.failures
    mf = r.model.max_failures
    n_bad = count_inputs(failures)
    too_many = mf is not None and n_bad > mf
    if st.failed_shards or too_many:
        report.status = "failed"
        report.shards["built"] = sum(1 for s in plan.shards if s.index in st.infos) - report.shards["skipped"]
        _write_report(b.out, b.index_path, report)
        inputs = [f for f in failures if not f.policy]
        first = (inputs or failures)[0].message if failures else "unknown error"
        if too_many:
            why = f"{n_bad} input(s) failed, more than max_failures={mf}"
            hint = "fix the inputs or raise max_failures"
        else:
            why = f"{len(st.failed_shards)} shard(s) failed"
            hint = "fix the input (or set on_error: skip)"
            if inputs and inputs[0].type == "MemoryError":   # not the input's fault (compiler/shard.py out_of_memory)
                hint = "free memory (or use fewer jobs)"
        raise BuildError(f"build of {r.name!r} stopped: {why}; first error: {first}. "
                         f"Finished shards are kept; {hint} and run build again.")
    if failures and not sum(st.infos[s.index]["num_samples"] for s in plan.shards):
        report.status = "failed"
        _write_report(b.out, b.index_path, report)
        raise BuildError(f"build of {r.name!r}: every input failed ({n_bad} skipped), nothing to write; "
                         f"first error: {failures[0].message}")
    for name, v in named:   # a split whose every input failed: its output would be empty (no index is written)
        mine = {s.index for s in v.plan.shards}
        bad = [f for f in failures if f.shard in mine]
        if name is not None and bad and not sum(st.infos[i]["num_samples"] for i in mine):
            report.status = "failed"
            _write_report(b.out, b.index_path, report)
            raise BuildError(f"build of {r.name!r}: every input of split {name!r} failed ({count_inputs(bad)} "
                             f"skipped), its output would be empty; no split's index was written, finished shards "
                             f"are kept; first error: {bad[0].message}")


def _finalize(b: _Build, st: _State, report: BuildReport) -> BuildReport:
    """Write the index (the build's last file but the report), then the report with the totals."""
    r, plan = b.recipe, b.plan
    shards = []
    for s in plan.shards:
        info = st.infos[s.index]
        shards.append({"file": b.shard_entry_file(s, info["key"]),
                       "num_samples": info["num_samples"], "key": info["key"], "checksums": info["checksums"],
                       "bytes": info["bytes"], "sha256": info["sha256"]})
    attrs = _index_attrs(r, plan, b.rhash) | {fmt.A_BUILD_DATE: _build_date(), fmt.A_SHARDS: shards}
    t0 = time.perf_counter()
    # the stats of the index about to be replaced (a URL output never holds any: check_recipe)
    previous = None if b.out.remote else stored_stats_fields(b.index_path)
    b.out.finalize(b.writer, b.index_path, shards, plan.specs, attrs, [st.parts.get(s.index) for s in plan.shards])
    report.stage_seconds["finalize"] = round(time.perf_counter() - t0, 4)
    t0 = time.perf_counter()
    if not b.out.remote and stats_after_build(b.index_path, r.model.stats, previous) is not None:
        report.stage_seconds["stats"] = round(time.perf_counter() - t0, 4)
    report.num_samples = sum(s["num_samples"] for s in shards)
    report.bytes = sum(s["bytes"] for s in shards)
    report.wall_seconds = round(time.perf_counter() - b.t_start, 4)
    built = {s.index for s, _ in st.todo}    # not the up-to-date or reused shards: the rate is of work done
    report.samples_built = sum(st.infos[s.index]["num_samples"] for s in plan.shards
                               if s.index in built and s.index in st.infos)
    report.samples_per_second = _rate(report.samples_built, report.wall_seconds)
    _write_report(b.out, b.index_path, report)
    return report


def _rate(samples: int, seconds: float) -> float:
    return round(samples / max(seconds, 1e-9), 1)


def _index_attrs(recipe: Recipe, plan: Plan, rhash: str) -> dict[str, Any]:
    """The index attributes that follow from the recipe and plan (all but the build date and shards)."""
    return {
        fmt.A_FORMAT: fmt.FORMAT_NAME, fmt.A_VERSION: fmt.FORMAT_VERSION, fmt.A_OUTPUT: recipe.model.output.format,
        fmt.A_FIELDS: {f: s.to_json() for f, s in plan.specs.items()}, fmt.A_LABELS: plan.label_names,
        fmt.A_RECIPE: recipe.resolved(), fmt.A_RECIPE_HASH: rhash, fmt.A_PKG_VERSION: __version__,
        fmt.A_SEED: recipe.seed, fmt.A_COPIES: recipe.model.copies, fmt.A_MAPS: fmt.MAPS_VERSION, **plan.attrs,
    }


def _canonical(v: Any, json_index: bool) -> str:
    """``v`` as :func:`snapshot.read_index_attrs` reads it back from an index of that kind."""
    if json_index or not isinstance(v, str):
        return fmt.dumps(v)
    return v


def _unchanged(b: _Build, keys: dict[int, str]) -> Optional[BuildReport]:
    """The report of a build with nothing to do, or None when anything must be (re)written.

    Nothing to do: the index exists; its shard list names exactly the plan's shards with the keys
    computed now; every shard file is there (with the size the index recorded: a shard folder's files
    counted and summed); and every other attribute the index would get (recipe, fields, labels, format
    and package versions, seed, copies) is the same. Then no file is opened for writing: not the index, not the report.
    """
    shards = _stored_shards(b)
    if shards is None:
        return None
    failures: list[Failure] = []
    for s, info in zip(b.plan.shards, shards):
        path = _intact_shard(b, s, info, keys[s.index])
        if path is None:
            return None
        failures.extend(f.from_previous_build() for f in b.out.read_skipped(path, keys[s.index]))
    recipe, plan = b.recipe, b.plan
    wall = round(time.perf_counter() - b.t_start, 4)
    n = sum(int(s["num_samples"]) for s in shards)
    return BuildReport(
        name=recipe.output_name, recipe=recipe.source, recipe_hash=b.rhash, output=b.index_path,
        format=recipe.model.output.format, jobs=b.n_jobs, inputs=len(plan.items),
        shards={"total": len(plan.shards), "built": 0, "skipped": len(plan.shards), "reused": 0, "failed": 0},
        failures=failures, events=[], on_error=recipe.model.on_error,
        stage_seconds={"decode": 0.0, "steps": 0.0, "write": 0.0, "finalize": 0.0},
        wall_seconds=wall, precompile_version=__version__, status="ok", up_to_date=True,
        num_samples=n, bytes=sum(int(s.get("bytes") or 0) for s in shards),
        samples_built=0, samples_per_second=0.0)


def _stored_shards(b: _Build) -> Optional[list[dict[str, Any]]]:
    """The stored index's shard list when every other attribute is what this build would write and it
    has the plan's shard count; else None."""
    stored = b.out.index_attrs(b.index_path)
    if stored is None or fmt.A_SHARDS not in stored:
        return None
    json_index = b.index_path.endswith(fmt.INDEX_JSON_EXT)
    for k, v in _index_attrs(b.recipe, b.plan, b.rhash).items():
        if stored.get(k) != _canonical(v, json_index):
            return None
    try:
        shards = fmt.loads(stored[fmt.A_SHARDS])
    except ValueError:
        return None
    return shards if len(shards) == len(b.plan.shards) else None


def _intact_shard(b: _Build, s: Any, info: dict[str, Any], key: str) -> Optional[str]:
    """The shard's path if the index's entry names it with ``key`` and its file is there (HDF5: with the
    recorded size); else None."""
    if info.get("file") != b.shard_entry_file(s, key) or info.get("key") != key:
        return None
    path = b.shard_path(s, key)
    if not b.writer.shard_ext:   # a shard folder: its files' count and sizes against its info.json's
        on_disk = b.writer.read_shard_info(path)
        return path if on_disk is not None and on_disk["bytes"] == info.get("bytes") else None
    size = b.out.size(path)
    if size is None or size != info.get("bytes"):
        return None
    return path


def with_policy(recipe: Recipe, on_error: Optional[str] = None, max_failures: Optional[int] = None,
                timeout_s: Optional[float] = None, stats: Optional[bool] = None) -> Recipe:
    """``recipe`` with its error policy keys (and ``stats``) overridden (None keeps the recipe's value)."""
    upd = {k: v for k, v in (("on_error", on_error), ("max_failures", max_failures), ("timeout_s", timeout_s),
                             ("stats", stats or None)) if v is not None}
    if not upd:
        return recipe
    from pydantic import ValidationError

    from ..recipe import pydantic_to_recipe_error

    try:
        model = type(recipe.model).model_validate(recipe.model.model_dump() | upd)
    except ValidationError as e:  # an option value out of range: one line naming the key, as in a recipe
        raise pydantic_to_recipe_error(e, recipe.source, model=type(recipe.model)) from None
    return Recipe(model, source=recipe.source, base_dir=recipe.base_dir)


def _link_file(a: str, b: str) -> None:
    try:
        os.link(a, b)
    except OSError:
        shutil.copyfile(a, b)


def _link_shard(src: str, dst: str) -> bool:
    """Put a finished shard (and its sidecar) at ``dst`` atomically: hard link, or copy. A shard folder (the
    file-folder formats) is made as a temporary folder of links to its files, then renamed into place (a
    damaged folder already there moved aside first, as the writer does)."""
    ok = False
    for a, b in ((skipped_path(src), skipped_path(dst)), (src, dst)):  # sidecar first, shard last
        if not os.path.exists(a):
            if a == src:
                return False
            continue
        tmp = f"{b}.tmp-{os.getpid()}"
        if os.path.isdir(a):
            if os.path.lexists(tmp):
                remove_path(tmp)
            shutil.copytree(a, tmp, copy_function=_link_file)
            old = None
            if os.path.isdir(b):
                old = f"{b}.tmp-old-{os.getpid()}"   # a "*.tmp-*" name: the next build removes it if we die
                os.replace(b, old)
            os.replace(tmp, b)
            if old is not None:
                remove_path(old)
        else:
            _link_file(a, tmp)
            os.replace(tmp, b)
        ok = True
    return ok


def _damaged(views: list[_Build]) -> Optional[frozenset[str]]:
    """``--repair``: the file names of the shards ``verify`` finds damaged in the outputs of ``views``; an
    empty set when only an index is damaged or unusable (finalize rewrites it); None when all is intact."""
    from ..tools.verify import verify

    names: set[str] = set()
    index_bad = False
    for v in views:
        if not v.out.exists(v.index_path):
            continue
        try:
            res = verify(v.index_path, storage_options=v.out.options if v.out.remote else None)
        except FormatError:
            index_bad = True
            continue
        names.update(os.path.basename(n) for n in res.bad_shards)
        index_bad = index_bad or res.index_damaged
    return frozenset(names) if names or index_bad else None


def _ensure_report(out: Any, index_path: str, report: BuildReport) -> None:
    """A build with nothing to do writes nothing, unless its report is missing or damaged (e.g. truncated):
    then it is written again, whole (atomically, as every report is). An object at a URL is never partial:
    a listed report is kept without reading it (the no-op build reads only the index and one listing)."""
    path = os.path.splitext(index_path)[0] + fmt.REPORT_SUFFIX
    if out.remote and out.exists(path):
        return
    old = out.read_json(path)
    if isinstance(old, dict) and old.get("recipe_hash") == report.recipe_hash and "status" in old:
        return
    _write_report(out, index_path, report)


def _write_report(out: Any, index_path: str, report: BuildReport) -> None:
    out.write_json(os.path.splitext(index_path)[0] + fmt.REPORT_SUFFIX, report.to_json(), indent=2)


__all__ = ["BuildInterrupted", "as_recipe", "build", "check_plan", "collect_garbage", "output_paths", "with_policy"]


def collect_garbage(index_path: str | os.PathLike, keep_previous: bool = True, dry_run: bool = False,
                    storage_options: Optional[dict[str, Any]] = None) -> tuple[list[str], int]:
    """``precompile gc``: remove the files of ``index_path``'s shard folder that no index beside it refers
    to (and, unless ``keep_previous``, the snapshot the last build replaced); returns (names, bytes freed).
    ``index_path`` may be a URL (``storage_options`` as for :func:`build`).

    Takes the build lock, so it never runs beside a build of the same output. Safe with readers open: an open
    or mapped file survives its unlink on POSIX; a reader still holding the replaced snapshot that has not
    opened a shard yet gets a FormatError that says to open the output again."""
    index_path = str(index_path)
    name = os.path.splitext(os.path.basename(index_path))[0]
    with output_for(os.path.dirname(index_path) or ".", storage_options, name.split(".")[0]) as out, \
            _faults(out, f"collecting the garbage of {index_path}"):
        if not out.remote:
            index_path = os.path.abspath(index_path)
        if not out.exists(index_path):
            raise FormatError(f"{index_path}: no such output (build it first)")
        shard_dir = os.path.join(out.root, fmt.shard_dir_name(name))
        if not (any(u.startswith(shard_dir + "/") for u in out.listing()) if out.remote else os.path.isdir(shard_dir)):
            return [], 0
        with out.lock(shard_dir, name):
            keep = out.referenced(shard_dir)
            if not keep:
                raise FormatError(f"{index_path}: the index names no shard in {shard_dir} (unreadable or of another "
                                  f"layout); nothing removed")
            if keep_previous:
                keep |= out.previous(shard_dir)
            removed = out.collect(shard_dir, keep, dry_run)  # a killed build's temporaries too: the lock is ours
            if not keep_previous and not dry_run:
                out.remember_previous(shard_dir, [])
            return removed
