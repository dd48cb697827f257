"""The shard task (run by every backend): decode -> steps -> copies -> write, the error policy, and the
isolated decoder.

Each task writes its own shard file and returns a small result (counts, bytes,
checksums, stage timings, failures): a :class:`~precompile.compiler.results.ShardResult`. The parent only gathers these. The same
task function runs in-process (``-j1``), on loky workers, or on a dask cluster.

Error policy: a bad input raises an :class:`InputError` (naming the file, the
field and the stage); ``on_error: fail`` stops the shard at the first one,
``on_error: skip`` drops that input's samples, records the failure (also in a
``<shard>.skipped.json`` sidecar written before the shard is renamed into
place, so a later incremental build still reports it) and goes on, until a
shard has more than ``max_failures`` failures.

Isolated decoding: a hang inside a codec cannot be interrupted from Python
(a C loop never returns to the interpreter, and a thread cannot be killed),
and a segfault takes its whole process down. When the recipe sets
``timeout_s``, or when the build retries a shard whose worker died, the shard
task decodes its inputs in a helper process (:class:`IsolatedDecoder`) and
waits for each answer at most ``timeout_s``; on a timeout it kills the helper
(SIGKILL), reports the input as failed and starts a fresh helper for the rest.
A helper that dies reports its input as failed the same way. The helper gets
the resolved recipe as JSON and returns raw array bytes with a JSON header
(no pickle); it is kept for the life of the worker process.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from ..storage.faults import is_output_fault, output_error
from .keys import skipped_path
from ..errors import BuildError, DecodeError, InputError, MissingDependencyError, PrecompileError, SampleError, StepError, echo
from ..kinds import Kind
from ..inputs.items import Item
from ..inputs.paths import InputRoot
from .plan import ShardPlan
from .results import Failure, ShardResult, zero_timings
from ..recipe import Recipe
from ..storage.remote import is_url
from ..sample import FieldSpec, Sample
from ..seeding import LazyRng
from ..transforms import source_map
from ..storage.files import write_json_atomic
from . import stop


#: how many characters of a codec's or a step's own words about an input a failure keeps (a parser may put
#: what it read in its message: the report, the .skipped.json sidecar and the terminal get this much)
CODEC_CHARS = 500


def said(e: BaseException) -> str:
    """``TypeName: message`` of a codec's or a step's exception, its message cut to :data:`CODEC_CHARS`."""
    from ..errors import clip

    return f"{type(e).__name__}: {clip(str(e), CODEC_CHARS)}"


#: what a codec's or a step's own code may raise that is the input's error (the stage and the input are
#: named, ``on_error`` decides): any ``Exception``, and ``SystemExit``, from a library that calls ``sys.exit()``
#: on input it does not like (in the build's own process it would end the build without a word; in a worker,
#: kill it). Not KeyboardInterrupt (a Ctrl-C is the build's) nor MemoryError (caught before: not the input's)
CODE_ERRORS = (Exception, SystemExit)


def _where(e: BaseException, **where: Any) -> BaseException:
    """``e`` (a MemoryError) with where it happened (path, stage, field, key) attached once, for
    :func:`out_of_memory`; the innermost place wins."""
    if not hasattr(e, "precompile_where"):
        try:
            e.precompile_where = where   # type: ignore[attr-defined]
        except AttributeError:   # a MemoryError subclass with __slots__: said without the input
            pass
    return e


def out_of_memory(e: BaseException, shard: ShardPlan, item: Optional[Item], shard_path: str) -> Failure:
    """The failure a MemoryError makes of its shard: naming the input being built (its path, field and stage,
    where the decode or a step said so; else the input's first file, and ``write`` when it came from the
    writer), and why the input is not skipped. ``type`` MemoryError."""
    from ..errors import clip

    where = dict(getattr(e, "precompile_where", None) or {})
    if not where and item is not None:
        where = dict(path=next(iter(item.paths.values()), None), stage="write", key=item.key)
    path, stage, field = where.get("path") or shard_path, where.get("stage") or "write", where.get("field")
    text = clip(str(e), 200)
    detail = (f"out of memory (MemoryError{': ' + text if text else ''}) while building shard {shard.index}: not "
              f"the input's fault, so on_error: skip does not drop it; use fewer jobs (-j) or give the machine "
              f"more memory")
    head = f"{path}, stage {stage}" + (f", field {field!r}" if field else "")
    return Failure(f"{head}: {detail}", detail, path, stage, field, where.get("key") or (item.key if item else None),
                   "MemoryError", shard.index)


def _dangling(path: str) -> str:
    """What a path that does not exist as a file is when it is a symbolic link (': it is a symbolic link loop
    ...', ': it is a symbolic link to X, which does not exist'), else ''."""
    import errno

    try:
        if not os.path.islink(path):
            return ""
        target = os.readlink(path)
    except OSError:
        return ""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return ": it is a symbolic link loop (too many levels of symbolic links)"
        if e.errno == errno.ENOENT:
            return f": it is a symbolic link to {echo(target)}, which does not exist"
    return ""


def _annotations(recipe: Recipe, item: Item, fields: dict, kinds: dict, meta: dict) -> None:
    """inputs.coco: the annotation fields beside the decoded image (inputs/coco/); whatever goes wrong is
    this input's error (stage annotations), naming the image."""
    from ..inputs.coco.annotations import STAGE, _id

    spec = recipe.model.inputs.coco
    try:
        item.annotations.add_fields(fields, kinds, meta, spec, item, recipe.model.limits.input_bytes)
    except InputError:
        raise
    except (MemoryError, MissingDependencyError):
        raise  # not the input's fault
    except CODE_ERRORS as e:
        raise DecodeError(f"image id {_id(item.annotations.image_id)}: {said(e)}",
                          path=item.paths.get(spec.image), stage=STAGE, field=spec.image, key=item.key) from e


def decode_item(recipe: Recipe, item: Item, timings: dict[str, float], stream: Any = None) -> Sample:
    """Decode every field of ``item``. With ``stream`` (a StreamPlan), its field is opened for
    streaming instead: a placeholder array, and ``stream.source`` is set to the frame generator;
    with a FrameSteps plan, its field is decoded through the plan's per-frame steps (``stream.source``
    set when they ran). See transforms.temporal. Every path is checked against the path rule
    (:class:`InputRoot`) before it is opened."""
    t0 = time.perf_counter()
    fields, kinds, meta, links = {}, {}, {}, {}
    if item.annotations is not None:   # inputs.coco: an image refused at plan time fails before any decoding
        from ..inputs.coco.annotations import check_item

        check_item(recipe, item)
    rule = InputRoot.of(recipe)
    for fname in recipe.decoders:
        dec = recipe.decoder_for(fname, item.options.get(fname))
        path = item.paths[fname]
        try:
            found = rule.check(path)   # (a local file it found exists needs no os.path.exists)
            if dec.reads_dirs:   # a folder's files are checked one by one as the decoder finds them
                dec.inner_check = None if "://" in path and is_url(path) else rule.check
            if "://" in path and is_url(path):
                arrays, m = _decode_remote(recipe, dec, path, fname, stream if stream is not None and
                                           stream.clips is None and fname == stream.field else None)
            elif not (found or os.path.exists(path)):
                row = f", from data row {item.row} of {item.row_file}" if item.row else ""
                raise DecodeError(f"input file is missing{_dangling(path)} (the recipe's path for this field points "
                                  f"to nothing{row})")
            elif stream is not None and fname == stream.field:
                arrays, m, stream.source = stream.open(dec, path, fname)
            else:
                arrays, m = dec.decode(path, fname)
        except InputError as e:
            raise e.with_context(path=path, stage="decode", field=fname, key=item.key) from e.__cause__
        except MemoryError as e:   # not the input's fault: on_error: skip must not quietly drop every such input
            raise _where(e, path=path, stage="decode", field=fname, key=item.key)
        except MissingDependencyError:
            raise
        except CODE_ERRORS as e:  # a codec's own exception type: report it, do not crash the build
            raise DecodeError(said(e), path=path, stage="decode", field=fname, key=item.key) from e
        specs = dec.output_specs(fname)
        for name, arr in arrays.items():
            fields[name] = arr
            kinds[name] = specs[name].kind
            if specs[name].of is not None:
                links[name] = specs[name].of
        if m:
            meta[fname] = m
    if item.annotations is not None:  # inputs.coco: boxes, labels, keypoints, mask (inputs/coco/)
        _annotations(recipe, item, fields, kinds, meta)
    timings["decode"] += time.perf_counter() - t0
    lab = recipe.model.inputs.label
    if lab is not None:
        import numpy as np

        fields[lab.field] = np.asarray(item.label, dtype=np.int64)
        kinds[lab.field] = Kind.LABEL
    if item.values:
        from ..inputs.table.cells import column_arrays

        for name, (arr, kind) in column_arrays(recipe.model.inputs.columns, item.values).items():
            fields[name], kinds[name] = arr, kind
    return Sample(key=item.key, fields=fields, kinds=kinds, meta=meta, links=links)


def _decode_remote(recipe: Recipe, dec: Any, url: str, fname: str, frames: Any = None) -> tuple[dict, dict]:
    """Decode a local copy of a remote input (through ``frames``' per-frame steps: a FrameSteps plan);
    errors name the URL, not the temporary copy."""
    from ..storage.remote import local_copy

    with local_copy(url, recipe.model.inputs.storage_options, folder=dec.reads_dirs) as local:
        try:
            if frames is not None:
                arrays, m, frames.source = frames.open(dec, local, fname)
                return arrays, m
            return dec.decode(local, fname)
        except InputError as e:
            err = type(e)(e.detail.replace(local, url), path=url, stage=e.stage, field=e.field, key=e.key)
            raise err from e.__cause__


def copy_indices(recipe: Recipe) -> list[int]:
    """The copy indices written per input. ``copies: 0``: one sample, copy 0, that goes through
    every step (random ones included, drawn with copy index 0). ``copies: K``: copies 1..K
    augmented, preceded by copy 0, the un-augmented original, when ``keep_original``."""
    m = recipe.model
    if m.copies == 0:
        return [0]
    return ([0] if m.keep_original else []) + list(range(1, m.copies + 1))


def run_steps(recipe: Recipe, sample: Any, copy: int, item: Item, timings: dict[str, float],
              first: int = 0, buffer: Optional[Callable[[], Any]] = None) -> Any:
    """Steps ``first``.. on one sample (or on the samples the steps before ``first`` made of one
    input, in order: a list or a SampleSpill). ``buffer`` makes the container each step's output
    goes to (default a list; the streamed path passes SampleSpill, so a step's output over all the
    clips of a long video need not fit in memory). Steps run one after the other over all samples
    either way, so random steps draw the same numbers."""
    t0 = time.perf_counter()
    rng = LazyRng(recipe.seed, item.key, copy)
    # every image field starts its map back to the source (the decode's; each step composes its own)
    fresh = (Sample(s.key, dict(s.fields), dict(s.kinds), dict(source_map.start(s)), copy, dict(s.links))
             for s in ([sample] if isinstance(sample, Sample) else sample))
    samples: Any = list(fresh) if buffer is None else fresh
    original = copy == 0 and recipe.model.copies > 0  # the un-augmented original
    for i, step in enumerate(recipe.steps):
        if i < first:
            continue
        run_original = getattr(step, "run_original", None) if original and step.random else None
        if original and step.random and run_original is None:
            continue  # a random step without a neutral form is skipped for the original
        out = [] if buffer is None else buffer()
        try:
            for s in samples:
                try:
                    # random steps run with neutral parameters (no flip, centred crop) so shapes match
                    out.extend(run_original(s) if run_original is not None else step.outputs(s, rng))
                except InputError as e:
                    raise e.with_context(path=item.paths.get(e.field or "", next(iter(item.paths.values()))),
                                         stage=f"steps[{i}] {step.name}", key=item.key) from e.__cause__
                except MemoryError as e:
                    raise _where(e, path=next(iter(item.paths.values())), stage=f"steps[{i}] {step.name}",
                                 key=item.key)
                except CODE_ERRORS as e:
                    raise StepError(f"{step.name}: {said(e)}", path=next(iter(item.paths.values())),
                                    stage=f"steps[{i}] {step.name}", key=item.key) from e
        except BaseException:
            if buffer is not None:   # a failing input: its buffers go now, not at garbage collection
                out.close()
                samples.close()
            raise
        if buffer is not None:
            samples.close()   # the previous step's buffer (or the generator above), now consumed
        samples = out
    if buffer is None:   # an extent a reduced decode left for a resample that did not take it (never expected)
        samples = [source_map.compact(source_map.settle(s)) for s in samples]
    timings["steps"] += time.perf_counter() - t0
    return samples




class _DecodeErrors:
    """Inside: an input error gets ``where`` (path, stage, field, key); a codec's own exception becomes a
    DecodeError naming it; out-of-memory and a missing extra pass as they are (not the input's fault)."""

    def __init__(self, where: dict[str, Any]):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, e: Any, tb: Any) -> bool:
        if e is None or isinstance(e, (StopIteration, MemoryError, MissingDependencyError)) or \
                not isinstance(e, CODE_ERRORS):
            return False
        if isinstance(e, InputError):
            raise e.with_context(**self.where) from e.__cause__
        raise DecodeError(said(e), **self.where) from e


def stream_item(recipe: Recipe, stream: Any, item: Item, timings: dict[str, float],
                check: Callable[[Sample], None], spill_dir: Optional[str]) -> Any:
    """All samples of one input whose video streams through ``clips`` (see transforms.temporal):
    frames are decoded, put through the per-frame steps before ``clips`` (and a fused ``resize``
    after it), cut and passed on one clip at a time; the finished
    samples are checked and kept in a :class:`~precompile.spill.SampleSpill` (bounded memory)
    until the input is done, so a failing input is still dropped whole. When a later step is
    random, the clips are gathered first (in a spill too) and the steps run over all of them in
    order, as without streaming, so the draws are the same. Returns the spills, chained."""
    from ..spill import SampleSpill

    sample = decode_item(recipe, item, timings, stream)
    fname, path = stream.field, item.paths[stream.field]
    where = dict(path=path, stage="decode", field=fname, key=item.key)
    copies = copy_indices(recipe)
    spills = [SampleSpill(spill_dir) for _ in copies]
    clips = stream.clips.cut(sample, [fname], stream.frames(_stream_frames(stream.source, where, timings)),
                             seek=getattr(stream.source, "want", None))
    try:
        cut = _clip_errors(clips, f"steps[{stream.at}] {stream.clips.name}", path, item.key)
        _fill_spills(recipe, cut, stream, item, copies, spills, timings, check, spill_dir)
    except BaseException:
        clips.close()
        for spill in spills:
            spill.close()
        raise
    return _Chained(spills)


def _stream_frames(src: Any, where: dict[str, Any], timings: dict[str, float]) -> Any:
    """The decoder's frames ``(pos, t, get)``, each read (and each ``get``) naming the input on an
    error; the read time counts as decode time; the source is closed at the end."""
    def guard(get: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with _DecodeErrors(where):
                return get()
        return run

    try:
        while True:
            t0 = time.perf_counter()
            try:
                with _DecodeErrors(where):
                    pos, t, get = next(src)
            except StopIteration:
                return
            finally:
                timings["decode"] += time.perf_counter() - t0
            yield pos, t, guard(get)
    finally:
        src.close()


def _clip_errors(clips: Any, stage: str, path: str, key: str) -> Any:
    """The clips as ``clips`` cuts them; an error while cutting names the input and the clips step."""
    name = stage.split(" ", 1)[1]
    while True:
        try:
            clip = next(clips)
        except StopIteration:
            return
        except InputError as e:
            raise e.with_context(path=path, stage=stage, key=key) from e.__cause__
        except MemoryError:
            raise
        except CODE_ERRORS as e:
            raise StepError(f"{name}: {said(e)}", path=path, stage=stage, key=key) from e
        yield clip


def _fill_spills(recipe: Recipe, clips: Any, stream: Any, item: Item, copies: list[int], spills: list[Any],
                 timings: dict[str, float], check: Callable[[Sample], None], spill_dir: Optional[str]) -> None:
    """Run the steps after ``clips`` on every clip for every copy; the checked samples go to ``spills``
    (one per copy). With a random step among them, all clips are gathered first (in a spill) and the
    steps run over them in order, so the draws are those of a build without streaming."""
    from ..spill import SampleSpill

    if not any(s.random for s in recipe.steps[stream.first:]):
        for clip in clips:
            stop.check()   # (a long video's clips: a dropped Ctrl-C stops it here, not after the whole file)
            for spill, c in zip(spills, copies):
                for s in run_steps(recipe, clip, c, item, timings, stream.first):
                    check(s)
                    spill.add(s)
        return
    pending = SampleSpill(spill_dir)
    try:
        for clip in clips:
            stop.check()
            pending.add(clip)
        for spill, c in zip(spills, copies):
            done = run_steps(recipe, pending, c, item, timings, stream.first, lambda: SampleSpill(spill_dir))
            try:
                for s in done:
                    check(s)
                    spill.add(s)
            finally:
                done.close()
    finally:
        pending.close()


class _Settled:
    """The samples of ``inner`` as the list path stores them (:func:`source_map.settle`, then ``compact``), each
    time they are iterated; ``close`` closes ``inner``."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __iter__(self) -> Any:
        for s in self.inner:
            yield source_map.compact(source_map.settle(s))

    def close(self) -> None:
        self.inner.close()


class _Chained:
    """Iterate several spills in order; ``close`` closes them all."""

    def __init__(self, spills: list[Any]):
        self.spills = spills

    def __iter__(self) -> Any:
        for s in self.spills:
            yield from s

    def close(self) -> None:
        for s in self.spills:
            s.close()


def run_shard(recipe: Recipe, shard: ShardPlan, path: str, key: str, specs: dict[str, FieldSpec],
              chunking: dict[str, int], in_worker: bool = False, isolate: bool = False,
              progress: Optional[Callable[[int, int], None]] = None) -> ShardResult:
    """Build one shard file at ``path``; never raises for bad inputs (they are reported).

    ``isolate`` (or a recipe ``timeout_s``) decodes inputs in a helper process. ``progress(shard index, 1)``
    is called after each input (see :mod:`precompile.compiler.progress`).
    """
    if in_worker:
        _one_thread_per_worker()
    from ..registry import WRITERS, load_builtins

    load_builtins()
    task = _ShardTask(recipe, shard, path, time.perf_counter())
    writer_cls = WRITERS.get(recipe.model.output.format)()
    options = writer_cls.Options.model_validate(recipe.model.output.options)
    decode, stream = _decoder(recipe, isolate, task.timings)
    out_dir = os.path.dirname(os.path.dirname(path))
    try:
        task.writer = writer_cls.open_shard(path, specs, key, options, chunking)
    except OSError as e:
        if is_output_fault(e, out_dir):
            raise output_error(e, out_dir, f"creating shard {shard.index}") from None
        return task.failed(Failure(f"shard {shard.index}: cannot create {path}: {e.strerror or e}", path=path,
                                   stage="write", type="OSError", shard=shard.index), abort=False)
    try:
        for item in shard.items:
            stop.check()   # a Ctrl-C Python dropped (raised in a weakref callback) stops the build here
            ended = task.add_input(item, decode, stream)
            if ended is not None:
                return ended
            if progress is not None:
                progress(shard.index, 1)
        return task.close(key)
    except BaseException as e:
        if isinstance(e, PrecompileError) and not isinstance(e, InputError):
            task.writer.abort()
            raise  # not about one input (a missing codec extra, say): the build stops with it
        if is_output_fault(e, out_dir):  # a full disk, a read-only or vanished folder: never the input's fault
            task.writer.abort()
            raise output_error(e, out_dir, f"writing shard {shard.index}") from None
        if isinstance(e, MemoryError):
            return task.failed(out_of_memory(e, shard, task.current, path))
        if isinstance(e, Exception):
            return task.failed(Failure(f"shard {shard.index}: {said(e)}", traceback.format_exc(limit=5),
                                       path, "write", type=type(e).__name__, shard=shard.index))
        task.writer.abort()
        raise


def _one_thread_per_worker() -> None:
    """Parallelism is across shards: codecs in a worker use one thread (no oversubscribed cores)."""
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass
    from ..decoders.video import set_decode_threads

    set_decode_threads(1)


def _decoder(recipe: Recipe, isolate: bool, timings: dict[str, float]) -> tuple[Callable[[Item], Sample], Any]:
    """(decode one item, the stream plan or None): in this process, or in the isolated helper (``isolate`` or a
    ``timeout_s``; it returns whole arrays, so clips do not stream, but a video's leading per-frame steps
    run in the helper as each frame is decoded: transforms.temporal.FrameSteps)."""
    from ..transforms.temporal import frame_steps_plan, stream_plan

    timeout = recipe.model.timeout_s
    frames = frame_steps_plan(recipe.decoders, recipe.steps)
    if isolate or timeout is not None:
        iso = isolated_decoder(recipe)
        return (lambda item: iso.decode(item, timeout, timings, frames)), frames
    stream = stream_plan(recipe.decoders, recipe.steps) or frames
    if stream is not None and stream.clips is None:
        return (lambda item: decode_item(recipe, item, timings, stream)), stream
    return (lambda item: decode_item(recipe, item, timings)), stream


class _ShardTask:
    """One shard being written: its writer, timings and failures, and the error policy."""

    def __init__(self, recipe: Recipe, shard: ShardPlan, path: str, t_start: float):
        self.recipe, self.shard, self.path, self.t_start = recipe, shard, path, t_start
        self.timings = zero_timings()
        self.failures: list[Failure] = []
        self.writer: Any = None
        self.current: Optional[Item] = None   # the input being built (named when memory runs out)

    def failed(self, extra: Optional[Failure] = None, abort: bool = True) -> ShardResult:
        if abort:
            self.writer.abort()
        return ShardResult(self.shard.index, "failed", self.failures + ([extra] if extra else []), self.timings,
                           time.perf_counter() - self.t_start)

    def add_input(self, item: Item, decode: Callable[[Item], Sample], stream: Any) -> Optional[ShardResult]:
        """Make, check and write every sample of one input; a failing input is dropped whole, never
        half-written. Returns the shard's failed result when the error policy stops the shard."""
        samples: Any = None
        self.current = item
        try:
            samples = self.samples(item, decode, stream)
            t0 = time.perf_counter()
            for s in samples:
                self.writer.add(s)
            self.timings["write"] += time.perf_counter() - t0
        except InputError as e:
            return self.input_failed(e)
        finally:
            if samples is not None and hasattr(samples, "close"):
                samples.close()
        return None

    def samples(self, item: Item, decode: Callable[[Item], Sample], stream: Any) -> Any:
        """Every sample of the input (all copies), made and checked before any is written."""
        recipe, writer = self.recipe, self.writer

        def check(s: Sample) -> None:
            try:
                writer.check(s)
            except SampleError as e:
                raise StepError(str(e), path=item.paths.get(e.field or "", next(iter(item.paths.values()))),
                                stage="write", field=e.field, key=item.key) from e

        clips = stream is not None and stream.clips is not None
        if clips and not is_url(item.paths[stream.field]):   # a video streamed through clips: checked as
            return stream_item(recipe, stream, item, self.timings, check, os.path.dirname(self.path))  # made, spilled
        # (a remote video is fetched to a temporary copy for the decode alone: it is decoded whole)
        frames = stream if stream is not None and not clips else None
        if frames is not None:   # FrameSteps: the decode may run the leading per-frame steps (then sets source)
            frames.source = None
        sample = decode(item)
        first = frames.first if frames is not None and frames.source is not None else 0
        if any(step.expands for step in recipe.steps[first:]):   # windows, patches, clips of a whole video: spilled
            return self.spilled(sample, item, first, check)
        samples = [s for c in copy_indices(recipe) for s in run_steps(recipe, sample, c, item, self.timings, first)]
        for s in samples:
            check(s)
        return samples

    def spilled(self, sample: Sample, item: Item, first: int, check: Callable[[Sample], None]) -> Any:
        """Every sample of one input that a step expands into many (thousands of audio windows or 3D patches),
        kept in :class:`~precompile.spill.SampleSpill` s (memory up to a bound, then a temporary file beside the
        shard) and checked, in the same order and with the same draws and bytes as the list path above."""
        from ..spill import SampleSpill

        spill_dir = os.path.dirname(self.path)
        made: list[Any] = []
        try:
            for c in copy_indices(self.recipe):
                out = run_steps(self.recipe, sample, c, item, self.timings, first, lambda: SampleSpill(spill_dir))
                if not isinstance(out, SampleSpill):   # (no step ran for this copy: the decoded sample itself)
                    kept = SampleSpill(spill_dir)
                    kept.extend(out)
                    out = kept
                made.append(out)
            samples = _Settled(_Chained(made))
            for s in samples:
                check(s)
        except BaseException:
            for out in made:
                out.close()
            raise
        return samples

    def input_failed(self, e: InputError) -> Optional[ShardResult]:
        """Record a failed input; the shard's failed result if ``on_error: fail`` or ``max_failures`` stops it."""
        index, max_failures = self.shard.index, self.recipe.model.max_failures
        self.failures.append(Failure.from_error(e, shard=index))
        if self.recipe.model.on_error == "fail":
            return self.failed()
        if max_failures is not None and len(self.failures) > max_failures:
            return self.failed(Failure(f"shard {index}: stopped after {len(self.failures)} failed inputs, "
                                       f"more than max_failures={max_failures}", path=self.path, stage="policy",
                                       type="BuildError", shard=index, policy=True))
        return None

    def close(self, key: str) -> ShardResult:
        """Write the skipped-inputs sidecar, then finish the shard (renamed into place)."""
        t0 = time.perf_counter()
        _write_skipped(self.path, key, self.failures)
        info = self.writer.close()
        self.timings["write"] += time.perf_counter() - t0
        return ShardResult(self.shard.index, "built", self.failures, self.timings, time.perf_counter() - self.t_start,
                           info["num_samples"], info["bytes"], info["checksums"], info.get("sha256"),
                           info.get("parts"))


def _write_skipped(shard_path: str, key: str, failures: list[Failure]) -> None:
    """Write (or remove) the skipped-inputs sidecar; called before the shard is renamed into place."""
    side = skipped_path(shard_path)
    if not failures:
        if os.path.exists(side):
            os.remove(side)
        return
    write_json_atomic(side, {"key": key, "failures": [f.to_json() for f in failures]})


# -- isolated decoding ---------------------------------------------------------------------------

_SERVER_CODE = "from precompile.compiler.shard import _decode_server; _decode_server()"
_STARTUP_TIMEOUT_S = 120.0
#: seconds a helper whose reply pipe closed may take to end by itself before it is killed (IsolatedDecoder._reap)
_EXIT_GRACE_S = 5.0


def _describe_exit(rc: Optional[int]) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class IsolatedDecoder:
    """Decodes items in a helper process so a hang can be timed out and a crash costs one input."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.ident = _recipe_ident(recipe)
        self.proc: Optional[subprocess.Popen] = None
        self.r = self.w = None
        self.errf = None

    def _start(self) -> None:
        import tempfile
        from multiprocessing.connection import Connection

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p and os.path.isdir(p))
        env["PRECOMPILE_PARENT_PID"] = str(os.getpid())
        env["PRECOMPILE_DIE_WITH_PARENT"] = "1" if threading.current_thread() is threading.main_thread() else "0"
        self.errf = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER_CODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.errf, env=env, close_fds=True)
        self.w = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.r = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        r = self.recipe
        modules = sorted({type(d).__module__ for d in r.decoders.values()} | {type(s).__module__ for s in r.steps})
        self.w.send_bytes(json.dumps({"recipe": r.resolved(), "source": r.source, "base_dir": r.base_dir,
                                      "modules": [m for m in modules if m != "__main__"]}).encode())
        if not self.r.poll(_STARTUP_TIMEOUT_S):
            self.close()
            raise BuildError(f"the decoder helper process did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            hello = json.loads(self.r.recv_bytes())
        except (EOFError, OSError):
            why = self._reap(grace=_EXIT_GRACE_S)
            raise BuildError(f"the decoder helper process failed to start ({why})") from None
        if "error" in hello:
            self.close()
            raise BuildError(f"the decoder helper process failed to start: {hello['error']}")

    def _stderr_tail(self) -> str:
        if self.errf is None:
            return ""
        self.errf.seek(0, os.SEEK_END)
        n = self.errf.tell()
        self.errf.seek(max(0, n - 600))
        text = self.errf.read().decode("utf-8", "replace").strip()
        return text.splitlines()[-1] if text else ""

    def _reap(self, grace: float = 0.0) -> str:
        """Kill and wait for the helper; describe how it ended. ``grace``: seconds it may take to end by
        itself first (its reply pipe closed: it is exiting, and how it ends is the news; killed at once, a
        helper that exits with a code of its own would read as killed by SIGKILL, what the kernel's
        out-of-memory killer sends)."""
        proc, self.proc = self.proc, None
        for c in (self.r, self.w):
            if c is not None:
                c.close()
        self.r = self.w = None
        if proc is None:
            return "not running"
        if grace > 0 and proc.poll() is None:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        tail = self._stderr_tail()
        if self.errf is not None:
            self.errf.close()
            self.errf = None
        return _describe_exit(rc) + (f"; last stderr line: {tail}" if tail else "")

    def close(self) -> None:
        if self.proc is not None:
            self._reap()

    def decode(self, item: Item, timeout: Optional[float], timings: dict[str, float], frames: Any = None) -> Sample:
        """The helper's decode of ``item``; with ``frames`` (the recipe's FrameSteps), ``frames.source`` tells
        whether the helper ran its per-frame steps (it computes the same plan from the same recipe)."""
        import numpy as np

        if item.annotations is not None:   # inputs.coco: refused at plan time, nothing to decode
            from ..inputs.coco.annotations import check_item

            check_item(self.recipe, item)
        if self.proc is None:
            self._start()
        names = list(item.paths)
        field = names[0] if len(names) == 1 else None
        path = item.paths[names[0]]
        where = dict(path=path, stage="decode", field=field, key=item.key)
        t0 = time.perf_counter()
        try:
            self.w.send_bytes(json.dumps({"key": item.key, "paths": item.paths, "label": item.label,
                                          "captures": item.captures, "values": item.values,
                                          "options": item.options}, default=str).encode())
            ready = self.r.poll(timeout)
        except (EOFError, OSError):
            ready = True  # the helper is gone; the read below reports how it ended
        try:
            if not ready:
                self._reap()
                raise DecodeError(f"timed out after {timeout:g} s (timeout_s); the decoding process was killed",
                                  **where)
            try:
                hdr = json.loads(self.r.recv_bytes())
                if "error" in hdr:
                    e = hdr["error"]
                    if e["type"] == "MemoryError":   # out of memory in the helper: not the input's fault
                        raise _where(MemoryError(e["detail"]), path=e.get("path"), stage=e.get("stage"),
                                     field=e.get("field"), key=e.get("key"))
                    cls = {"DecodeError": DecodeError, "StepError": StepError}.get(e.get("base", e["type"]), InputError)
                    err = cls(e["detail"], path=e["path"], stage=e["stage"], field=e["field"], key=e["key"])
                    if e["type"] != cls.__name__:
                        err.type_name = e["type"]   # a plugin's own error class, reported by its name as in-process
                    raise err
                fields, kinds = {}, {}
                for f in hdr["fields"]:
                    buf = bytearray(f["nbytes"])
                    if f["nbytes"]:
                        self.r.recv_bytes_into(buf)
                    else:
                        self.r.recv_bytes()
                    fields[f["name"]] = np.frombuffer(buf, dtype=np.dtype(f["dtype"])).reshape(tuple(f["shape"]))
                    kinds[f["name"]] = f["kind"]
            except (EOFError, OSError):
                why = self._reap(grace=_EXIT_GRACE_S)
                raise DecodeError(f"the decoding process died while decoding this input ({why})", **where) from None
        finally:
            timings["decode"] += time.perf_counter() - t0
        if item.annotations is not None:  # the helper decodes the files; the annotations are here
            _annotations(self.recipe, item, fields, kinds, hdr["meta"])
        if frames is not None:
            frames.source = True if hdr.get("frame_steps") else None
        return Sample(key=item.key, fields=fields, kinds=kinds, meta=hdr["meta"], links=hdr.get("links", {}))


def _recipe_ident(recipe: Recipe) -> str:
    return json.dumps([recipe.resolved(), recipe.source, recipe.base_dir], sort_keys=True)


_ISOLATED: dict[str, IsolatedDecoder] = {}


def isolated_decoder(recipe: Recipe) -> IsolatedDecoder:
    """This process's helper for ``recipe`` (one at a time; a new recipe replaces the old helper)."""
    ident = _recipe_ident(recipe)
    iso = _ISOLATED.get(ident)
    if iso is None:
        shutdown_isolated()
        iso = _ISOLATED[ident] = IsolatedDecoder(recipe)
    return iso


def shutdown_isolated() -> None:
    """Stop this process's decoder helper, if any."""
    while _ISOLATED:
        _, iso = _ISOLATED.popitem()
        iso.close()


atexit.register(shutdown_isolated)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this helper when the process that started it dies (a hung codec never reads EOF)."""
    if os.environ.get("PRECOMPILE_DIE_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != os.environ.get("PRECOMPILE_PARENT_PID"):
        os._exit(0)  # the parent died before the request took effect


def _decode_server() -> None:
    """Helper process main loop: JSON requests on stdin, JSON headers + raw array bytes on stdout."""
    import importlib

    import numpy as np
    from multiprocessing.connection import Connection

    _die_with_parent()
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from codecs must not corrupt the reply stream
    sys.stdout = sys.stderr
    r, w = Connection(os.dup(0), writable=False), Connection(out_fd, readable=False)
    try:
        hdr = json.loads(r.recv_bytes())
        for m in hdr["modules"]:
            importlib.import_module(m)
        from ..recipe import parse_recipe

        recipe = parse_recipe(hdr["recipe"], source=hdr["source"], base_dir=hdr["base_dir"])
    except EOFError:
        return
    except Exception as e:  # reported to the parent, which fails the shard with this message
        w.send_bytes(json.dumps({"error": said(e)}).encode())
        return
    from ..transforms.temporal import frame_steps_plan

    frames = frame_steps_plan(recipe.decoders, recipe.steps)   # the parent's plan: the same recipe
    w.send_bytes(b'{"ready": true}')
    while True:
        try:
            req = json.loads(r.recv_bytes())
        except EOFError:
            return
        item = Item(key=req["key"], paths=req["paths"], label=req["label"], captures=req["captures"],
                    values=req.get("values", {}), options=req.get("options", {}))
        if frames is not None:
            frames.source = None
        try:
            s = decode_item(recipe, item, {"decode": 0.0}, frames)
        except InputError as e:   # "base": the built-in class the parent raises again (a plugin's own is not there)
            base = next(c.__name__ for c in (DecodeError, StepError, InputError) if isinstance(e, c))
            w.send_bytes(json.dumps({"error": {**Failure.from_error(e).to_json(), "base": base}}).encode())
            continue
        except MemoryError as e:   # not the input's fault: the parent raises it again (out_of_memory)
            where = dict(getattr(e, "precompile_where", None) or {})
            w.send_bytes(json.dumps({"error": {"type": "MemoryError", "detail": str(e)[:200], **where}}).encode())
            continue
        arrays = [(n, np.asarray(a).copy(order="C")) for n, a in s.fields.items()]  # keeps 0-d shapes
        w.send_bytes(json.dumps({"fields": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape),
                                             "nbytes": a.nbytes, "kind": s.kinds[n]} for n, a in arrays],
                                 "meta": s.meta, "links": s.links,
                                 "frame_steps": frames is not None and frames.source is not None}).encode())
        for _, a in arrays:
            w.send_bytes(a.data.cast("B") if a.nbytes else b"")
