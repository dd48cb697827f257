"""The ``precompile`` command line: click parses, one library call does the work,
and a :class:`PrecompileError` becomes one clean line on stderr and an exit code.
"""
from __future__ import annotations

import sys

import click

from .errors import PrecompileError


def _fail(e: PrecompileError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(e.exit_code)


def _human(n: int | None) -> str:
    from .tools.inspect import _human as h

    return "unknown (shapes known only after decoding)" if n is None else h(n)


@click.group()
@click.version_option(package_name="precompile")
def main() -> None:
    """Compile datasets into uncompressed shards that feed training at full speed."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def validate(recipe: str) -> None:
    """Check RECIPE without decoding or writing anything."""
    from .recipe import load_recipe

    try:
        r = load_recipe(recipe)
    except PrecompileError as e:
        _fail(e)
    click.echo(f"{recipe}: ok ({len(r.decoders)} field(s), {len(r.steps)} step(s), output {r.model.output.format})")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def plan(recipe: str) -> None:
    """Print what RECIPE would build: samples, shards, shapes, size."""
    from .build import check_plan
    from .plan import make_plan
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
    click.echo("fields")
    for f, s in p.specs.items():
        click.echo(f"  {f:<12} {s.describe()}")
    click.echo(f"size      {_human(p.estimated_bytes())}{more}")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("-j", "--jobs", default=1, show_default=True, help="parallel shard tasks (-1: all cores)")
@click.option("-o", "--out-dir", default="build", show_default=True, help="output folder")
@click.option("--force", is_flag=True, help="rebuild every shard, even up-to-date ones")
@click.option("--scheduler", default=None, help="run on a dask cluster: its address, or 'local'")
@click.option("--content-hash", is_flag=True, help="fingerprint inputs by content, not size and mtime")
@click.option("--progress/--no-progress", default=True, show_default=True)
def build(recipe: str, jobs: int, out_dir: str, force: bool, scheduler: str | None, content_hash: bool,
          progress: bool) -> None:
    """Build RECIPE into OUT_DIR/<name>.h5 (shards under OUT_DIR/<name>.shards/)."""
    from .build import build as run_build

    if jobs == -1:
        import os

        jobs = os.cpu_count() or 1
    try:
        rep = run_build(recipe, out_dir=out_dir, n_jobs=jobs, force=force, progress=progress,
                        scheduler=scheduler, content_hash=content_hash)
    except PrecompileError as e:
        _fail(e)
    sh = rep["shards"]
    st = rep["stage_seconds"]
    click.echo(f"wrote {rep['output']}: {rep['num_samples']} samples, {_human(rep['bytes'])}, "
               f"{sh['built']} shard(s) built, {sh['skipped']} up to date, in {rep['wall_seconds']:.2f} s "
               f"({rep['samples_per_second']:.0f} samples/s)")
    click.echo(f"stage time (summed over workers): decode {st['decode']:.2f} s, steps {st['steps']:.2f} s, "
               f"write {st['write']:.2f} s, finalize {st['finalize']:.2f} s")
    if rep["failures"]:
        click.echo(f"skipped {len(rep['failures'])} input(s):", err=True)
        for f in rep["failures"]:
            click.echo(f"  {f['message']}", err=True)


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
def inspect(output: str) -> None:
    """Describe a built OUTPUT: fields, shapes, chunking, labels, provenance."""
    from .tools.inspect import describe

    try:
        click.echo(describe(output))
    except PrecompileError as e:
        _fail(e)


if __name__ == "__main__":
    main()
