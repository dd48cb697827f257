"""recipe -> plan -> engine -> finalize: the ``build`` entry point.

Shards whose stored key matches are skipped (incremental, resumable); the rest
run as joblib tasks (in-process for one job, loky workers locally, or a dask
cluster). The index and the build report are written last.
"""
from __future__ import annotations

import datetime as _dt
import glob
import json
import os
import sys
import time
import types
from typing import Any, Optional

from . import __version__
from . import format as fmt
from .cache import shard_key
from .engine import run_shard
from .errors import BuildError, PlanError, RecipeError
from .plan import Plan, make_plan
from .recipe import Recipe, load_recipe
from .registry import WRITERS


def chunking_for(plan: Plan) -> dict[str, int]:
    """Samples per chunk for each fixed-shape field; for a variable-shape field, the number of
    elements per chunk of its flat data array (``chunk_bytes`` worth)."""
    out = plan.recipe.model.output
    res = {}
    for f, s in plan.specs.items():
        if not s.fixed:
            res[f] = max(1, out.chunk_bytes // s.itemsize)
        elif out.chunk_samples:
            res[f] = out.chunk_samples
        else:
            nb = s.nbytes() or out.chunk_bytes
            res[f] = max(1, min(out.samples_per_shard, out.chunk_bytes // max(1, nb)))
    return res


def check_plan(plan: Plan) -> None:
    """Checks that need the plan: the output format can hold the fields; copies make sense."""
    r = plan.recipe
    wcls = WRITERS.get(r.model.output.format)
    from .recipe import parse_params

    options = parse_params(wcls.Options, r.model.output.options, r.source, ("output", "options"))
    try:
        wcls().check_specs(plan.specs, options)
    except ValueError as e:
        raise RecipeError(str(e), source=r.source, loc="output.format") from None
    has_random = any(s.random for s in r.steps)
    if r.model.copies > 0 and not has_random:
        raise RecipeError("copies > 0 needs at least one random step (e.g. random_crop)", source=r.source, loc="copies")


def _build_date() -> str:
    sde = os.environ.get("SOURCE_DATE_EPOCH")
    t = _dt.datetime.fromtimestamp(int(sde), _dt.timezone.utc) if sde else _dt.datetime.now(_dt.timezone.utc)
    return t.replace(microsecond=0).isoformat()


def output_paths(recipe: Recipe, out_dir: str) -> tuple[str, str]:
    """(index file, shard folder) for a recipe under ``out_dir``."""
    index = os.path.join(out_dir, recipe.output_name + WRITERS.get(recipe.model.output.format).index_ext)
    return index, os.path.join(out_dir, fmt.shard_dir_name(recipe.output_name))


def build(recipe: Recipe | str | os.PathLike, out_dir: str | os.PathLike = "build", n_jobs: int = 1,
          force: bool = False, progress: bool = False, scheduler: Optional[str] = None,
          content_hash: bool = False, log=print) -> dict[str, Any]:
    """Build a recipe into ``out_dir``; returns the build report (also written as JSON)."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    t_start = time.perf_counter()
    plan = make_plan(recipe)
    check_plan(plan)
    out_dir = os.path.abspath(str(out_dir))
    index_path, shard_dir = output_paths(recipe, out_dir)
    os.makedirs(shard_dir, exist_ok=True)
    writer = WRITERS.get(recipe.model.output.format)()
    rhash = recipe.content_hash()
    chunking = chunking_for(plan)

    # stray temporaries from a killed build, and shards beyond the plan's count
    for p in glob.glob(os.path.join(shard_dir, "*.tmp-*")):
        _remove(p)  # a file, or a shard folder
    names = {fmt.shard_file_name(s.index, writer.shard_ext) for s in plan.shards}
    for p in glob.glob(os.path.join(shard_dir, "shard-*")):
        if os.path.basename(p) not in names:
            _remove(p)

    keys, todo, infos = {}, [], {}
    for s in plan.shards:
        keys[s.index] = shard_key(plan, s, rhash, content=content_hash)
        path = os.path.join(shard_dir, fmt.shard_file_name(s.index, writer.shard_ext))
        info = None if force else writer.read_shard_info(path)
        if info is not None and info["key"] == keys[s.index]:
            infos[s.index] = info
        else:
            todo.append((s, path))
    if todo and os.path.exists(index_path):
        os.remove(index_path)  # never leave an index that points at shards being rebuilt

    timings = {"decode": 0.0, "steps": 0.0, "write": 0.0}
    failures: list[dict[str, Any]] = []
    failed_shards: list[int] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan.items), unit="input", desc=recipe.name, dynamic_ncols=True)
        bar.update(sum(len(s.items) for s in plan.shards if s.index in infos))
    try:
        for res in _run(recipe, todo, keys, plan, chunking, n_jobs, scheduler):
            for k in timings:
                timings[k] += res["timings"][k]
            failures.extend(res["failures"])
            if bar is not None:
                bar.update(len(plan.shards[res["index"]].items))
            if res["status"] == "failed":
                failed_shards.append(res["index"])
                if recipe.model.on_error == "fail":
                    break
            else:
                infos[res["index"]] = {k: res[k] for k in ("num_samples", "bytes", "checksums")} | {"key": keys[res["index"]]}
            mf = recipe.model.max_failures
            if mf is not None and len(failures) > mf:
                break
    finally:
        if bar is not None:
            bar.close()

    wall = time.perf_counter() - t_start
    report: dict[str, Any] = {
        "name": recipe.output_name, "recipe": recipe.source, "recipe_hash": rhash, "output": index_path,
        "format": recipe.model.output.format, "jobs": n_jobs, "inputs": len(plan.items),
        "shards": {"total": len(plan.shards), "built": len(todo) - len(failed_shards), "skipped": len(plan.shards) - len(todo),
                   "failed": len(failed_shards)},
        "failures": failures, "stage_seconds": {k: round(v, 4) for k, v in timings.items()},
        "wall_seconds": round(wall, 4), "precompile_version": __version__, "status": "ok",
    }
    mf = recipe.model.max_failures
    too_many = mf is not None and len(failures) > mf
    if failed_shards or too_many:
        report["status"] = "failed"
        report["shards"]["built"] = sum(1 for s in plan.shards if s.index in infos) - report["shards"]["skipped"]
        _write_report(index_path, report)
        first = failures[0]["message"] if failures else "unknown error"
        why = (f"{len(failures)} inputs failed, more than max_failures={mf}" if too_many and not failed_shards
               else f"{len(failed_shards)} shard(s) failed")
        raise BuildError(f"build of {recipe.name!r} stopped: {why}; first error: {first}. "
                         f"Finished shards are kept; fix the input (or set on_error: skip) and run build again.")

    shards = []
    for s in plan.shards:
        info = infos[s.index]
        shards.append({"file": f"{fmt.shard_dir_name(recipe.output_name)}/{fmt.shard_file_name(s.index, writer.shard_ext)}",
                       "num_samples": info["num_samples"], "key": info["key"], "checksums": info["checksums"],
                       "bytes": info["bytes"]})
    attrs = {
        fmt.A_FORMAT: fmt.FORMAT_NAME, fmt.A_VERSION: fmt.FORMAT_VERSION, fmt.A_OUTPUT: recipe.model.output.format,
        fmt.A_FIELDS: {f: s.to_json() for f, s in plan.specs.items()}, fmt.A_LABELS: plan.label_names,
        fmt.A_RECIPE: recipe.resolved(), fmt.A_RECIPE_HASH: rhash, fmt.A_PKG_VERSION: __version__,
        fmt.A_BUILD_DATE: _build_date(), fmt.A_SEED: recipe.seed, fmt.A_COPIES: recipe.model.copies,
        fmt.A_SHARDS: shards,
    }
    t0 = time.perf_counter()
    writer.finalize(index_path, shards, plan.specs, attrs)
    report["stage_seconds"]["finalize"] = round(time.perf_counter() - t0, 4)
    report["num_samples"] = sum(s["num_samples"] for s in shards)
    report["bytes"] = sum(s["bytes"] for s in shards)
    report["wall_seconds"] = round(time.perf_counter() - t_start, 4)
    report["samples_per_second"] = round(report["num_samples"] / max(report["wall_seconds"], 1e-9), 1)
    _write_report(index_path, report)
    return report


def _remove(path: str) -> None:
    if os.path.isdir(path):
        import shutil

        shutil.rmtree(path)
    else:
        os.remove(path)


def _write_report(index_path: str, report: dict) -> None:
    path = os.path.splitext(index_path)[0] + fmt.REPORT_SUFFIX
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _run(recipe: Recipe, todo, keys, plan: Plan, chunking, n_jobs: int, scheduler: Optional[str]):
    """Yield shard results as they complete."""
    if not todo:
        return
    specs = plan.specs
    if n_jobs == 1 and scheduler is None:
        for s, path in todo:
            yield run_shard(recipe, s, path, keys[s.index], specs, chunking)
        return
    import joblib

    tasks = (joblib.delayed(run_shard)(recipe, s, path, keys[s.index], specs, chunking, True) for s, path in todo)
    if scheduler is not None:
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:
            from .errors import MissingDependencyError

            raise MissingDependencyError("--scheduler needs dask.distributed: pip install 'precompile[dask]'") from None
        if scheduler == "local":
            cluster = LocalCluster(n_workers=max(1, n_jobs), threads_per_worker=1, processes=True,
                                   dashboard_address=None)
            client = Client(cluster)
        else:
            cluster, client = None, Client(scheduler)
        try:
            with joblib.parallel_config(backend="dask"):
                yield from joblib.Parallel(n_jobs=-1, return_as="generator_unordered")(tasks)
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
        return
    try:
        yield from joblib.Parallel(n_jobs=n_jobs, backend="loky", return_as="generator_unordered")(tasks)
    except Exception as e:
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        if isinstance(e, TerminatedWorkerError):
            raise BuildError(f"a worker process died while building shards ({e}); "
                             f"finished shards are kept, run build again to resume") from None
        raise


__all__ = ["build", "output_paths", "PlanError"]


class _CallableModule(types.ModuleType):
    """Lets ``precompile.build(...)`` call :func:`build` although ``precompile.build``
    is also this submodule (importing a submodule sets the package attribute)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return build(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
