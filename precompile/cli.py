"""The ``precompile`` command line: click parses, one library call does the work,
and a :class:`PrecompileError` becomes one clean line on stderr and an exit code.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Mapping

import click

from .errors import PrecompileError
from .optschema import MAX_TIMEOUT_S


def _fail(e: PrecompileError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(e.exit_code)


def _human(n: int | None) -> str:
    from .storage.files import human_bytes as h

    return "unknown (shapes known only after decoding)" if n is None else h(n)


class _Cli(click.Group):
    """Turns an OS error that escaped the library (a folder that cannot be created, a disk
    that is full) into one line naming the path, like any other error."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as e:
            where = f"{e.filename}: " if getattr(e, "filename", None) else ""
            click.echo(f"error: {where}{e.strerror or e}", err=True)
            sys.exit(1)


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and value != value:   # nan: no range comparison holds, so FloatRange lets it through
        raise click.BadParameter("not a number (nan)")
    return value


def _jobs(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is None:
        return value
    if value == 0 or value < -1:
        raise click.BadParameter("use a positive number of jobs, or -1 for all cores")
    return value


def _storage_options(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` (repeatable) as a dict; values are YAML scalars (safe loader): ``anon=true``
    is True, ``max_concurrency=8`` is 8; text that is not YAML stays text. Messages never echo a value."""
    import yaml

    out: dict[str, Any] = {}
    for item in values:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter("use KEY=VALUE, e.g. --storage-option endpoint_url=http://127.0.0.1:9000")
        try:
            value = yaml.safe_load(text) if text.strip() else text
        except yaml.YAMLError:
            value = text
        if isinstance(value, (dict, list)):
            raise click.BadParameter(f"{key.strip()}: the value must be a scalar (text, a number, true/false)")
        out[key.strip()] = value
    return out or None


_STORAGE_HELP = ("an option of the output URL's fsspec filesystem, KEY=VALUE (repeatable; e.g. endpoint_url=..., "
                 "anon=true); credentials are better left in the store's environment")


@click.group(cls=_Cli)
@click.version_option(package_name="precompile")
def main() -> None:
    """Compile datasets into uncompressed shards that feed training at full speed."""
    _no_final_collection()


_exit_hooked = False


def _no_final_collection() -> None:
    """Leave the objects alive when this process exits out of the interpreter's final garbage collections.

    A command's process ends when it returns; CPython's shutdown then runs full collections over every object
    its imports made (numpy's, h5py's, pydantic's schemas: some 100,000), 0.1-0.2 s of CPU after the command's
    last line (``benchmarks/bench_serial.py``: the ``cli+exit`` row). Frozen (:func:`gc.freeze`, at exit) they
    are skipped; modules are still torn down and their objects freed by their reference counts, and the other
    exit handlers still run. Hooked once per process, at its first command: a process that runs commands
    in-process (a test's CliRunner) is only changed at its own exit."""
    global _exit_hooked
    if not _exit_hooked:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _exit_hooked = True


def _echo_plan_splits(p: Any) -> None:
    """``splits    train 80 (80.0%), val 10 (10.0%), ...``: inputs per split of a ``split:`` recipe."""
    counts = p.split_counts()
    if counts:
        n = max(1, len(p.items))
        click.echo("splits    " + ", ".join(f"{s} {c} ({c / n:.1%})" for s, c in counts.items()))


def _echo_splits(rep: "Mapping") -> None:
    """One line per split of a ``split:`` build: its index, inputs, realised fraction and samples."""
    for name, sp in (rep.get("splits") or {}).items():
        click.echo(f"split {name}: {sp['output']}: {sp['inputs']} input(s) ({sp['fraction']:.1%} of inputs), "
                   f"{sp['samples']} samples")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def validate(recipe: str) -> None:
    """Check RECIPE as plan does, without listing inputs, decoding or writing anything."""
    from .compiler import check_recipe
    from .recipe import load_recipe

    try:
        r = load_recipe(recipe)
        check_recipe(r)
    except PrecompileError as e:
        _fail(e)
    click.echo(f"{recipe}: ok ({len(r.decoders)} field(s), {len(r.steps)} step(s), output {r.model.output.format}; "
               f"kinds, fields and output checked; inputs not listed: `precompile plan` lists them)")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def plan(recipe: str) -> None:
    """Print what RECIPE would build: samples, shards, shapes, size."""
    from .compiler import check_plan
    from .compiler.plan import make_plan
    from .recipe import load_recipe

    try:
        r = load_recipe(recipe)
        p = make_plan(r)
        check_plan(p)
    except PrecompileError as e:
        _fail(e)
    more = " (at least: a step expands samples)" if p.expands else ""
    click.echo(f"recipe    {r.name} ({recipe}), seed {r.seed}")
    click.echo(f"inputs    {len(p.items)} under {r.input_root}")
    click.echo(f"samples   {p.num_samples}{more} ({p.copies_per_item} per input)")
    click.echo(f"shards    {len(p.shards)} of up to {r.model.output.samples_per_shard} inputs, format {r.model.output.format}")
    if p.label_names:
        click.echo(f"labels    {len(p.label_names)}: {', '.join(p.label_names)}")
    _echo_plan_splits(p)
    click.echo("fields")
    for f, s in p.specs.items():
        click.echo(f"  {f:<12} {s.describe()}")
    est, data = p.estimated_bytes(), p.data_bytes()
    extra = f" ({_human(data)} of sample data)" if est is not None and est != data else ""
    click.echo(f"size      {_human(est)}{extra}{more}")
    from .decoders.jpeg_reduce import explain

    for f, how in explain(r).items():
        click.echo(f"decode    {f}: {how}")
    from .compiler.plan import video_reads

    for line in video_reads(p):
        click.echo(f"video     {line}")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("-j", "--jobs", type=int, default=None, callback=_jobs,
              help="parallel shard tasks (-1: all cores; a small build runs in one process)  [default: 1; with "
                   "--scheduler local, all cores]")
@click.option("-o", "--out-dir", default="build", show_default=True,
              help="output folder, or a URL (s3://bucket/prefix: the same layout, written by the workers)")
@click.option("--force", is_flag=True, help="rebuild every shard, even up-to-date ones")
@click.option("--scheduler", default=None, help="run on a dask cluster: its address, or 'local'")
@click.option("--content-hash", is_flag=True, help="fingerprint inputs by content, not size and mtime")
@click.option("--on-error", type=click.Choice(["fail", "skip"]), default=None,
              help="override the recipe's on_error: stop at the first bad input, or skip it and go on")
@click.option("--max-failures", type=click.IntRange(min=0), default=None,
              help="override the recipe's max_failures: stop once more inputs than this have failed")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True, max=MAX_TIMEOUT_S), default=None,
              callback=_finite,
              help="override the recipe's timeout_s: seconds one input may take to decode")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--force-space", is_flag=True,
              help="build even when the plan's size estimate exceeds the output folder's free space")
@click.option("--repair", is_flag=True,
              help="verify the existing output first (every byte) and rebuild exactly the damaged shards and index")
@click.option("--stats", "with_stats", is_flag=True,
              help="also store the output's statistics (as `precompile stats`), as the recipe's stats: true")
@click.option("--storage-option", "storage_options", multiple=True, callback=_storage_options,
              metavar="KEY=VALUE", help=_STORAGE_HELP)
def build(recipe: str, jobs: int | None, out_dir: str, force: bool, scheduler: str | None, content_hash: bool,
          on_error: str | None, max_failures: int | None, timeout_s: float | None, progress: bool,
          force_space: bool = False, repair: bool = False, with_stats: bool = False,
          storage_options: dict[str, Any] | None = None) -> None:
    """Build RECIPE into OUT_DIR/<name>.h5 (shards under OUT_DIR/<name>.shards/); OUT_DIR may be a URL.

    Exit codes: 0 built (or up to date), 2 recipe or plan error, 3 inputs failed (shards failed, or
    more than max_failures), 4 a missing optional dependency, 5 a damaged output, 6 the output failed
    (out of space, read-only, vanished, I/O error; a URL's store: no credentials, unreachable, no bucket,
    access denied), 7 a worker was killed (SIGKILL: memory), 130 interrupted (Ctrl-C), 143 terminated
    (SIGTERM); the last two say how many shards were kept. See docs/faults.md."""
    if jobs == -1:
        import os

        jobs = os.cpu_count() or 1
    with _build_path_frozen() as run_build, _interruptible() as stopped:
        try:
            rep = run_build(recipe, out_dir=out_dir, n_jobs=jobs, force=force, progress=progress,
                            scheduler=scheduler, content_hash=content_hash, on_error=on_error,
                            max_failures=max_failures, timeout_s=timeout_s, force_space=force_space, repair=repair,
                            stats=with_stats or None, storage_options=storage_options)
        except PrecompileError as e:
            _fail(e)
        except KeyboardInterrupt as e:
            _interrupted(e, stopped)
    sh = rep["shards"]
    st = rep["stage_seconds"]
    reused = f", {sh['reused']} reused from a sibling output" if sh.get("reused") else ""
    verb = "up to date, nothing written:" if rep.get("up_to_date") else "wrote"
    what = rep["output"] if not rep.get("splits") else f"{len(rep['splits'])} splits (below)"
    click.echo(f"{verb} {what}: {rep['num_samples']} samples, {_human(rep['bytes'])}, "
               f"{sh['built']} shard(s) built, {sh['skipped']} up to date{reused}, in {rep['wall_seconds']:.2f} s"
               + ("" if rep.get("up_to_date") else _rate_note(rep)))
    click.echo(f"stage time (summed over workers): decode {st['decode']:.2f} s, steps {st['steps']:.2f} s, "
               f"write {st['write']:.2f} s, finalize {st['finalize']:.2f} s"
               + (f", stats {st['stats']:.2f} s" if "stats" in st else ""))
    _echo_splits(rep)
    for ev in rep.get("events", []):
        click.echo(f"note: {ev}", err=True)
    if rep["failures"]:
        click.echo(f"skipped {len(rep['failures'])} input(s) (on_error: skip; listed in the build report):", err=True)
        for f in rep["failures"]:
            old = " [skipped in an earlier build; shard up to date]" if f.get("previous_build") else ""
            click.echo(f"  {f['message']}{old}", err=True)


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--quick", is_flag=True, help="check files, sizes, keys and sample counts, not the data checksums "
              "(at a URL: presence and sizes)")
@click.option("--storage-option", "storage_options", multiple=True, callback=_storage_options,
              metavar="KEY=VALUE", help=_STORAGE_HELP)
def verify(output: str, quick: bool, storage_options: dict[str, Any] | None = None) -> None:
    """Re-read a built OUTPUT (an index file, or its URL) and check every shard against its index."""
    from .tools.verify import verify as run_verify

    try:
        res = run_verify(output, checksums=not quick, storage_options=storage_options)
    except PrecompileError as e:
        _fail(e)
    for p in res.problems:
        click.echo(f"{output}: {p}", err=True)
    if res.problems:
        if res.bad_shards:
            click.echo(f"error: {len(res.bad_shards)} of {res.num_shards} shard(s) failed verification: "
                       f"{', '.join(res.bad_shards)}", err=True)
        if res.index_damaged:
            click.echo(f"error: the index is damaged{'' if res.bad_shards else ' (every shard is intact)'}",
                       err=True)
        click.echo("rebuild what is damaged with: precompile build RECIPE --repair", err=True)
        sys.exit(res.exit_code)
    click.echo(f"{output}: ok ({res.num_shards} shard(s), {res.num_samples} samples, "
               f"{res.bytes_checked} {res.counted} checked)")


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
def inspect(output: str) -> None:
    """Describe a built OUTPUT: fields, shapes, chunking, labels, provenance."""
    from .tools.inspect import describe

    try:
        click.echo(describe(output))
    except PrecompileError as e:
        _fail(e)


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("-o", "--out", default=None, help="PNG to write (default: <output>.preview.png next to the index)")
@click.option("--n", "n", type=click.IntRange(min=1), default=6, show_default=True, help="sample keys to show")
@click.option("--field", "fields", multiple=True, help="show only this field (repeat for several)")
@click.option("--window", type=click.Choice(["lung", "soft", "auto"]), default="lung", show_default=True,
              help="HU window for CT volumes (auto: every volume through its own percentile window)")
@click.option("--html", "html_path", default=None, help="also write an HTML page with each sample's metadata")
def preview(output: str, out: str | None, n: int, fields: tuple[str, ...], window: str, html_path: str | None) -> None:
    """Draw a PNG contact sheet of a built OUTPUT: each kind as its users look at it."""
    from .tools.preview import preview as run_preview

    try:
        path = run_preview(output, out=out, n=n, fields=list(fields) or None, html_path=html_path, window=window)
    except PrecompileError as e:
        _fail(e)
    click.echo(f"wrote {path}" + (f" and {html_path}" if html_path else ""))


@main.command()
@click.option("-o", "--out", default=None, help="write the schema to this file instead of printing it")
@click.option("--draft", type=click.Choice(["2020-12", "7"]), default="2020-12", show_default=True,
              help="JSON Schema dialect (7: for editors whose validator knows draft 7 only)")
@click.option("--import", "modules", multiple=True, metavar="MODULE",
              help="import this module first, so the decoders/steps it registers are in the schema (repeatable)")
def schema(out: str | None, draft: str, modules: tuple[str, ...]) -> None:
    """Print the JSON Schema (draft 2020-12) of recipes: every decoder, step and format with its options."""
    from .tools.schema import import_plugins, schema_text

    try:
        import_plugins(list(modules))
    except PrecompileError as e:
        _fail(e)
    text = schema_text(draft=draft)
    if out is None:
        click.echo(text, nl=False)
        return
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    click.echo(f"wrote {out}")


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--field", "fields", multiple=True, help="only this field (repeat for several; default all)")
@click.option("--no-write", is_flag=True, help="print the stats without storing them in the output's index")
@click.option("--json", "as_json", is_flag=True, help="print the stats as JSON")
def stats(output: str, fields: tuple[str, ...], no_write: bool, as_json: bool) -> None:
    """Per-channel mean/std/min/max (and class counts) of a built OUTPUT, stored in its index for
    the Loader's mean="stats", std="stats"."""
    import json

    from .tools.stats import describe as describe_stats
    from .tools.stats import stats as run_stats

    try:
        res = run_stats(output, fields=list(fields) or None, write=not no_write)
    except PrecompileError as e:
        _fail(e)
    click.echo(json.dumps(res, indent=2) if as_json else describe_stats(res))
    if not no_write:
        click.echo(f"stored in {output}", err=True)


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--all", "drop_previous", is_flag=True,
              help="also remove the snapshot the last build replaced (readers still open on it lose the shards "
                   "they have not opened yet)")
@click.option("--dry-run", is_flag=True, help="list what would be removed, remove nothing")
@click.option("--storage-option", "storage_options", multiple=True, callback=_storage_options,
              metavar="KEY=VALUE", help=_STORAGE_HELP)
def gc(output: str, drop_previous: bool, dry_run: bool, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the files under OUTPUT's shard folder that no index refers to (a build does this itself).

    Safe with readers open: a file a reader has open or mapped survives its removal. The snapshot the
    last build replaced is kept unless --all. Refused while a build of OUTPUT runs."""
    from .compiler.driver import collect_garbage
    from .storage.files import human_bytes

    try:
        removed, freed = collect_garbage(output, keep_previous=not drop_previous, dry_run=dry_run,
                                         storage_options=storage_options)
    except PrecompileError as e:
        _fail(e)
    verb = "would remove" if dry_run else "removed"
    for n in removed:
        click.echo(f"{verb} {n}")
    click.echo(f"{output}: {verb} {len(removed)} unreferenced file(s), {human_bytes(freed)}")


@contextlib.contextmanager
def _build_path_frozen() -> Iterator[Any]:
    """Import the build path with the garbage collector paused, then leave what the imports made (some 100,000
    modules', classes' and functions' objects, alive until the process ends) out of the collections for the
    command's length (:func:`gc.freeze`); yields :func:`precompile.compiler.build`.

    Collections over the imports' objects were 0.05-0.1 s of CPU of a small build: during the imports (each
    generation's collections tracing the new objects again as they age) and during the build (every full
    collection tracing them all); forked workers start with them frozen anyway (:mod:`.compiler.forkpool`).
    The objects are unfrozen when the command ends (a process that runs commands in-process, a test's CliRunner,
    gets its collections back), and what the command makes is collected as before."""
    import gc

    paused = gc.isenabled()
    gc.disable()
    try:
        from .compiler import build as run_build
        gc.freeze()
    finally:
        if paused:
            gc.enable()
    try:
        yield run_build
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _interruptible() -> Iterator[list[int]]:
    """While a build runs: SIGTERM stops it as Ctrl-C does (a KeyboardInterrupt: the workers are stopped, the
    half-written shards removed, what was kept is said); the SIGTERM that stopped it is appended to the list. Both
    are also recorded (:mod:`precompile.compiler.stop`), so that a KeyboardInterrupt Python drops (raised inside a
    weakref callback) is raised again at the build's next safe point."""
    import signal

    from .compiler import stop

    stopped: list[int] = []

    def on_term(signum: int, frame: Any) -> None:
        stopped.append(signum)
        stop.request(signum)
        raise KeyboardInterrupt

    def on_int(signum: int, frame: Any) -> None:
        stop.request(signum)
        raise KeyboardInterrupt

    old = {}
    for sig, handler in ((signal.SIGTERM, on_term), (signal.SIGINT, on_int)):
        if sig == signal.SIGINT and signal.getsignal(sig) is not signal.default_int_handler:
            continue   # Ctrl-C ignored (a background job) or handled by the caller: left as it is
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:   # not the main thread (a test runner's): the signals keep their handlers
            pass
    try:
        yield stopped
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        stop.clear()


def _interrupted(e: KeyboardInterrupt, stopped: list[int]) -> None:
    """Say what a stopped build kept and how to finish it; exit 130 (Ctrl-C) or 143 (SIGTERM)."""
    from .compiler.driver import BuildInterrupted

    what = "terminated (SIGTERM)" if stopped else "interrupted"
    if isinstance(e, BuildInterrupted):
        click.echo(f"\n{what}: {e}", err=True)
    else:
        click.echo(f"\n{what} before any shard was built: nothing new was written; run the same command again "
                   f"to build", err=True)
    sys.exit(143 if stopped else 130)


def _rate_note(rep: dict) -> str:
    """`` (N samples/s)`` of the samples the build wrote, naming them when up-to-date shards were kept."""
    built = rep.get("samples_built", rep["num_samples"])
    if built == rep["num_samples"]:
        return f" ({rep['samples_per_second']:.0f} samples/s)"
    return f" ({rep['samples_per_second']:.0f} samples/s over the {built} samples built)"


if __name__ == "__main__":
    main()

