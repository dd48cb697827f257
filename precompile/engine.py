"""Shard tasks on a joblib backend: decode -> steps -> copies -> write.

Each task writes its own shard file and returns a small dict (counts, bytes,
checksums, stage timings, failures). The parent only gathers these. The same
task function runs in-process (``-j1``), on loky workers, or on a dask cluster.
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any, Iterator

from .errors import DecodeError, InputError, StepError
from .plan import Item, ShardPlan
from .recipe import Recipe
from .sample import FieldSpec, Sample
from .seeding import rng_for


def _err_dict(e: InputError) -> dict[str, Any]:
    return {"message": str(e), "detail": e.detail, "path": e.path, "stage": e.stage, "field": e.field, "key": e.key,
            "type": type(e).__name__}


def decode_item(recipe: Recipe, item: Item, timings: dict[str, float]) -> Sample:
    t0 = time.perf_counter()
    fields, kinds, meta = {}, {}, {}
    for fname, dec in recipe.decoders.items():
        path = item.paths[fname]
        try:
            if not os.path.exists(path):
                raise DecodeError("input file is missing (the recipe's path for this field points to nothing)")
            arrays, m = dec.decode(path, fname)
        except InputError as e:
            raise e.with_context(path=path, stage="decode", field=fname, key=item.key) from e.__cause__
        except MemoryError:
            raise
        except Exception as e:  # a codec's own exception type: report it, do not crash the build
            raise DecodeError(f"{type(e).__name__}: {e}", path=path, stage="decode", field=fname, key=item.key) from e
        specs = dec.output_specs(fname)
        for name, arr in arrays.items():
            fields[name] = arr
            kinds[name] = specs[name].kind
        if m:
            meta[fname] = m
    timings["decode"] += time.perf_counter() - t0
    lab = recipe.model.inputs.label
    if lab is not None:
        import numpy as np

        fields[lab.field] = np.asarray(item.label, dtype=np.int64)
        kinds[lab.field] = "label"
    return Sample(key=item.key, fields=fields, kinds=kinds, meta=meta)


def copy_indices(recipe: Recipe) -> list[int]:
    """The copy indices written per input. ``copies: 0``: one sample, copy 0, that goes through
    every step (random ones included, drawn with copy index 0). ``copies: K``: copies 1..K
    augmented, preceded by copy 0, the un-augmented original, when ``keep_original``."""
    m = recipe.model
    if m.copies == 0:
        return [0]
    return ([0] if m.keep_original else []) + list(range(1, m.copies + 1))


def run_steps(recipe: Recipe, sample: Sample, copy: int, item: Item, timings: dict[str, float]) -> list[Sample]:
    t0 = time.perf_counter()
    rng = rng_for(recipe.seed, item.key, copy)
    samples = [Sample(sample.key, dict(sample.fields), dict(sample.kinds), dict(sample.meta), copy)]
    original = copy == 0 and recipe.model.copies > 0  # the un-augmented original
    for i, step in enumerate(recipe.steps):
        run_original = getattr(step, "run_original", None) if original and step.random else None
        if original and step.random and run_original is None:
            continue  # a random step without a neutral form is skipped for the original
        out = []
        for s in samples:
            try:
                # random steps run with neutral parameters (no flip, centred crop) so shapes match
                out.extend(run_original(s) if run_original is not None else step.run(s, rng))
            except InputError as e:
                raise e.with_context(path=item.paths.get(e.field or "", next(iter(item.paths.values()))),
                                     stage=f"steps[{i}] {step.name}", key=item.key) from e.__cause__
            except MemoryError:
                raise
            except Exception as e:
                raise StepError(f"{step.name}: {type(e).__name__}: {e}", path=next(iter(item.paths.values())),
                                stage=f"steps[{i}] {step.name}", key=item.key) from e
        samples = out
    timings["steps"] += time.perf_counter() - t0
    return samples


def iter_samples(recipe: Recipe, item: Item, timings: dict[str, float]) -> Iterator[Sample]:
    sample = decode_item(recipe, item, timings)
    for c in copy_indices(recipe):
        yield from run_steps(recipe, sample, c, item, timings)


def run_shard(recipe: Recipe, shard: ShardPlan, path: str, key: str, specs: dict[str, FieldSpec],
              chunking: dict[str, int], in_worker: bool = False) -> dict[str, Any]:
    """Build one shard file at ``path``; never raises for bad inputs (they are reported)."""
    if in_worker:
        try:
            import cv2

            cv2.setNumThreads(1)  # parallelism is across shards; avoid oversubscribing the cores
        except ImportError:
            pass
    from .registry import WRITERS, load_builtins

    load_builtins()
    t_start = time.perf_counter()
    timings = {"decode": 0.0, "steps": 0.0, "write": 0.0}
    failures: list[dict[str, Any]] = []
    writer_cls = WRITERS.get(recipe.model.output.format)()
    options = writer_cls.Options.model_validate(recipe.model.output.options)
    writer = writer_cls.open_shard(path, specs, key, options, chunking)
    policy = recipe.model.on_error
    try:
        for item in shard.items:
            try:
                for s in iter_samples(recipe, item, timings):
                    t0 = time.perf_counter()
                    try:
                        writer.add(s)
                    except ValueError as e:
                        raise StepError(str(e), path=next(iter(item.paths.values())), stage="write",
                                        key=item.key) from e
                    timings["write"] += time.perf_counter() - t0
            except InputError as e:
                failures.append(_err_dict(e))
                if policy == "fail":
                    writer.abort()
                    return {"index": shard.index, "status": "failed", "failures": failures, "timings": timings,
                            "num_samples": 0, "wall": time.perf_counter() - t_start}
        t0 = time.perf_counter()
        info = writer.close()
        timings["write"] += time.perf_counter() - t0
    except BaseException as e:
        writer.abort()
        if isinstance(e, Exception):
            return {"index": shard.index, "status": "failed", "timings": timings, "num_samples": 0,
                    "failures": failures + [{"message": f"shard {shard.index}: {type(e).__name__}: {e}",
                                             "detail": traceback.format_exc(limit=5), "path": path,
                                             "stage": "write", "field": None, "key": None, "type": type(e).__name__}],
                    "wall": time.perf_counter() - t_start}
        raise
    return {"index": shard.index, "status": "built", "failures": failures, "timings": timings,
            "wall": time.perf_counter() - t_start, **info}
