"""Backends that run shard tasks and yield their results as they complete: inline (one job, this
process), local worker processes (forked from this process on Linux, :mod:`.forkpool`; loky elsewhere,
or with ``PRECOMPILE_WORKERS=loky``), each with the dead-worker retry, and dask (a local or remote cluster).

Owns the choice of backend and the retry: a worker that dies has its shards retried once, alone, with
decoding isolated in a helper process, so a crashing codec fails only its input, and a second death fails
the shard with a message that names it and its inputs, unless both deaths were SIGKILL (on Linux, the
kernel's out-of-memory killer): that stops the build with a :class:`~precompile.errors.WorkerKilledError`
that says so. No local worker outlives the build (docs/reference-build.md#worker-processes). Imported only
when a shard must be built (a no-op rebuild never imports this module's task, :mod:`precompile.compiler.shard`,
nor joblib).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import sys
import warnings
from typing import Any, Callable, Iterator, Optional

from ..errors import BuildError, WorkerKilledError
from ..recipe import Recipe
from .plan import Plan
from .results import Failure, ShardResult, zero_timings
from . import stop


def remove_path(path: str) -> None:
    """Remove a file, or a folder (a shard of a folder-per-shard format) with everything in it."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _inputs(shard) -> str:
    keys = [it.key for it in shard.items]
    return ", ".join(keys) if len(keys) <= 4 else f"{keys[0]}, {keys[1]}, ... {keys[-1]} ({len(keys)} inputs)"


def _dead_worker_result(shard: Any, why: str) -> ShardResult:
    msg = (f"shard {shard.index} (inputs {_inputs(shard)}): its worker process died ({why}) twice, the second "
           f"time with decoding isolated in a helper process, so the crash is in a step or the writer")
    return ShardResult(shard.index, "failed", [Failure(msg, stage="worker", type="TerminatedWorkerError",
                                                       shard=shard.index)], zero_timings(), 0.0)


#: ``PRECOMPILE_WORKERS``: how local workers start (``fork`` or ``loky``; unset: fork where it can)
WORKERS_ENV = "PRECOMPILE_WORKERS"


def worker_start() -> str:
    """How this build's local workers start: ``"fork"`` (Linux: forked from this process when the shards
    run, in milliseconds, :mod:`.forkpool`) or ``"loky"`` (fresh interpreters that import the build path,
    started warm while the parent plans: other systems, or ``PRECOMPILE_WORKERS=loky``)."""
    want = os.environ.get(WORKERS_ENV, "").strip().lower()
    if want not in ("", "fork", "loky"):
        raise BuildError(f"{WORKERS_ENV}={want[:40]!r}: use fork or loky (or leave it unset)")
    can_fork = sys.platform.startswith("linux") and hasattr(os, "fork")
    return "fork" if want != "loky" and can_fork else "loky"


def n_workers(n_jobs: Optional[int]) -> int:
    """Worker processes for ``n_jobs`` (joblib's convention: -1 all cores, -2 all but one, ...)."""
    n = n_jobs or 1
    return max(1, (os.cpu_count() or 1) + 1 + n) if n < 0 else n


#: the warm-up of the loky workers started by :func:`start_pool` (a joblib result generator), or None
_warm: Any = None


def start_pool(n_jobs: Optional[int], scheduler: Optional[str], index_path: str, recipe_hash: str,
               force: bool = False) -> None:
    """Loky workers only: start them now, in the background, and import the shard task with every
    decoder and step in each, so that their start overlaps planning (:func:`run_loky` then reuses the
    warm pool; joblib keeps one loky pool per process). Nothing for one job or a dask scheduler, nor when
    an index of this output (``index_path``, or a split's beside it) records ``recipe_hash`` and the build
    is not forced: most likely a rebuild with little or nothing to do, whose workers would only cost time.
    Forked workers need no warm-up: they start when the shards run, with the build path imported."""
    global _warm, _exit_hook
    if scheduler is not None or (n_jobs or 1) == 1 or worker_start() == "fork" \
            or (not force and _same_recipe(index_path, recipe_hash)):
        return
    import joblib

    _settle_warm()
    n = joblib.effective_n_jobs(n_jobs)
    if n > 1:
        _warm = joblib.Parallel(n_jobs=n_jobs, backend="loky", return_as="generator_unordered")(
            joblib.delayed(warm_worker)(os.getpid()) for _ in range(n))
        if not _exit_hook:   # a warm-up no build used (the plan failed, nothing to build): collected at exit
            import atexit   # (waiting for it, not cancelling it: loky's executor can fail on a cancel in flight)

            atexit.register(_settle_warm)
            _exit_hook = True


#: whether :func:`_settle_warm` is registered to run at exit (once per process)
_exit_hook = False


def _same_recipe(index_path: str, recipe_hash: str) -> bool:
    """True when an index of this output (or of one of its splits) records ``recipe_hash``."""
    from ..formats import names as fmt, snapshot

    stem, ext = os.path.splitext(index_path)
    for p in [index_path, *glob.glob(glob.escape(stem) + ".*" + glob.escape(ext))]:
        attrs = snapshot.read_index_attrs(p) if os.path.isfile(p) else None
        if attrs is not None and attrs.get(fmt.A_RECIPE_HASH) in (recipe_hash, fmt.dumps(recipe_hash)):
            return True
    return False


def warm_worker(parent: int | None = None) -> int:
    """In a loky worker: import what a shard task needs (the task, the decoders, the steps, the writers);
    ``parent``: the build's process id (:func:`~.forkpool.watch_parent`)."""
    from .forkpool import watch_parent

    watch_parent(parent)   # first: a build killed while this worker started is not outlived by the imports
    from . import shard  # noqa: F401
    from ..registry import load_builtins

    load_builtins()
    return os.getpid()


def loky_task(parent: int, fn: Callable[..., ShardResult], *args: Any) -> ShardResult:
    """A shard task in a loky worker: the worker first makes sure it exits with the build (watch_parent, given
    the build's process id ``parent``)."""
    from .forkpool import watch_parent

    watch_parent(parent)
    return fn(*args)


def _settle_warm() -> list[int]:
    """Wait for the warm-up started by :func:`start_pool`, if any: the process ids of the workers that ran
    a warm-up task (its failures are the real run's to report)."""
    global _warm
    warm, _warm = _warm, None
    pids: list[int] = []
    if warm is not None:
        try:
            pids.extend(warm)
        except Exception:   # a worker that cannot start fails the real tasks too, with their own message
            pass
    return pids


def run_shards(recipe: Recipe, todo: list[tuple[Any, str]], keys: dict[int, str], plan: Plan,
               chunking: dict[int, dict[str, int]], n_jobs: Optional[int], scheduler: Optional[str],
               events: Optional[list[str]] = None, progress: Any = None, dest: Any = None) -> Iterator[ShardResult]:
    """Yield shard results as they complete (``progress``: a :class:`precompile.compiler.progress.Progress` or None):
    inline for one job and no scheduler, on dask with a scheduler, else on loky. ``dest``: for a build
    written to a URL, the :class:`~.upload.ShardTarget` each task uploads its shard to (None: in place)."""
    if not todo:
        return
    events = [] if events is None else events
    from .shard import run_shard

    shipped = RecipeOnce(recipe)

    def task(s: Any, path: str, in_worker: bool = True, isolate: bool = False, sink: Any = None,
             ship: bool = True) -> tuple:
        """A shard task's function and arguments; ``ship``: to be pickled for another process (which then
        rebuilds the recipe once, not once per task); a forked worker has the recipe itself."""
        r = shipped if in_worker and ship else recipe
        args = (r, s, path, keys[s.index], plan.specs, chunking[s.index], in_worker, isolate, sink)
        if dest is None:
            return run_shard, args
        from .upload import run_shard_to_url

        return run_shard_to_url, (dest, *args)

    if (n_jobs or 1) == 1 and scheduler is None:
        yield from run_inline(todo, task, progress)
    elif scheduler is None and worker_start() == "fork" and (why := small_build(todo, plan, n_jobs)) is not None:
        yield from run_small(todo, task, n_jobs, events, progress, recipe, plan, why)
    elif scheduler is not None:
        yield from run_dask(todo, task, n_jobs, scheduler, events, progress)
    elif worker_start() == "fork":
        yield from run_fork(todo, task, n_jobs, events, progress, recipe)
    else:
        yield from run_loky(todo, task, n_jobs, events, progress)


#: ``PRECOMPILE_SMALL_BUILD``: the small-build rule's bounds, ``INPUTS,BYTES[,SECONDS]`` (inputs and bytes per
#: worker, :data:`SMALL_SECONDS`), or ``0`` (off: every ``-j N`` build gets its workers; what the test suite sets,
#: so that its tiny builds get real workers)
SMALL_ENV = "PRECOMPILE_SMALL_BUILD"

#: a ``-j N`` build runs in its own process when the shards to build hold fewer inputs than this per worker...
SMALL_INPUTS = 32
#: ... and fewer input bytes than this per worker (docs/reference-build.md#small-builds)
SMALL_BYTES = 512 * 1024
#: a video's input bytes count this many times: compressed frames cost more per byte than other inputs (the
#: tour's and bench_scale --videos' videos 1.3-3.7 s of work per MiB against 0.2-0.55 for images, DICOM,
#: audio, flow on this machine)
SMALL_VIDEO_WEIGHT = 4
#: ... until the work left, estimated from the shards built so far, exceeds this many seconds: the workers
#: then build the shards left (at least two)
SMALL_SECONDS = 0.3


def small_bounds() -> Optional[tuple[int, int, float]]:
    """The small-build rule's (inputs, bytes per worker, seconds) from :data:`SMALL_ENV`, or None when
    it is off."""
    raw = os.environ.get(SMALL_ENV, "").strip()
    if not raw:
        return SMALL_INPUTS, SMALL_BYTES, SMALL_SECONDS
    if raw in ("0", "off"):
        return None
    try:
        parts = raw.split(",")
        if len(parts) not in (2, 3):
            raise ValueError
        inputs, nbytes = int(parts[0]), int(parts[1])
        seconds = float(parts[2]) if len(parts) == 3 else SMALL_SECONDS
        if inputs < 0 or nbytes < 0 or not seconds >= 0:
            raise ValueError
    except ValueError:
        raise BuildError(f"{SMALL_ENV}={raw[:40]!r}: use INPUTS,BYTES[,SECONDS] (per worker; e.g. "
                         f"{SMALL_INPUTS},{SMALL_BYTES},{SMALL_SECONDS}) or 0 (off)") from None
    return inputs, nbytes, seconds


def _input_bytes(path: str, limit: int) -> int:
    """An input's size in bytes (a folder's: its files', summed until past ``limit``); a URL's is not known
    here: ``limit + 1`` (so it counts as a large input); a path that cannot be read: 0 (its task says why)."""
    if "://" in path:
        return limit + 1
    try:
        st = os.stat(path)
    except OSError:
        return 0
    if not os.path.isdir(path):
        return st.st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
            if total > limit:
                return total
    return total


def small_build(todo: list[tuple[Any, str]], plan: Plan, n_jobs: Optional[int]) -> Optional[str]:
    """Why a ``-j N`` build on forked workers builds its shards in this process instead (the note the report
    and the CLI give), or None (loky's workers, started while the build plans, are always used: a build killed
    while its parent built a shard inline would leave them starting, before they watch their parent).
    Workers cannot pay for themselves when the shards to build hold fewer than :data:`SMALL_INPUTS` inputs
    and fewer than :data:`SMALL_BYTES` bytes of input per worker (the workers being as many as ``-j`` asks,
    at most one per shard). Forking them, their first tasks' copy-on-write
    faults, the imports made for them and the pool's close cost 0.1-0.2 s, as much as the whole work of
    such a build on two cores (benchmarks/README.md). The sizes are the inputs' files' (a folder's: its
    files'; a video's times :data:`SMALL_VIDEO_WEIGHT`); a URL input counts as large. Off with
    ``PRECOMPILE_SMALL_BUILD=0``."""
    bounds = small_bounds()
    workers = min(n_workers(n_jobs), len(todo))
    if bounds is None:
        return None
    max_inputs, max_bytes = bounds[0] * workers, bounds[1] * workers
    inputs = sum(len(s) for s, _ in todo)   # not samples: a recipe's copies are measured (run_small)
    if inputs >= max_inputs:
        return None
    weight = {f: SMALL_VIDEO_WEIGHT if getattr(d, "name", None) == "video" else 1
              for f, d in plan.recipe.decoders.items()}
    nbytes, videos = 0, False
    for s, _ in todo:
        for it in s.items:
            for field, path in it.paths.items():
                w = weight.get(field, 1)
                videos |= w > 1
                nbytes += w * _input_bytes(path, (max_bytes - nbytes) // w)
                if nbytes >= max_bytes:
                    return None
    from ..storage.files import human_bytes

    counted = f" (videos counted {SMALL_VIDEO_WEIGHT}x)" if videos else ""
    return (f"built in one process although -j {n_jobs} was asked: {inputs} input(s) and {human_bytes(nbytes)} "
            f"to build{counted}, under {bounds[0]} inputs and {human_bytes(bounds[1])} per worker: too little "
            f"work to pay for starting workers (docs/reference-build.md#small-builds)")


def run_small(todo: list[tuple[Any, str]], task: Callable[..., tuple], n_jobs: Optional[int], events: list[str],
              progress: Any, recipe: Recipe, plan: Plan, why: str) -> Iterator[ShardResult]:
    """A small build's shards (:func:`small_build`: ``why``) in this process, one after the other, measured:
    once the work left, estimated from the seconds per sample so far, is past :data:`SMALL_SECONDS` and at
    least two shards are left (inputs smaller than their work: long low-motion videos, heavy steps), the
    forked workers build the rest. The note in ``events`` says which. The imports the workers would get
    (:func:`preload`) are made first, so the first shard's seconds are its work, not its imports."""
    import time

    budget = (small_bounds() or (0, 0, SMALL_SECONDS))[2]
    if len(todo) > 2:   # else nothing is left to hand over after a first shard: nothing to time
        preload(recipe)   # what the first shard would import inside its timing (0.05-0.1 s: cv2, Pillow's plugins)
    t0, done, samples = time.perf_counter(), 0, 0
    inline = run_inline(todo, task, progress)
    try:
        for res in inline:
            yield res
            done += 1
            samples += plan.shard_samples(todo[done - 1][0])
            left = todo[done:]
            if len(left) < 2:
                continue
            spent = time.perf_counter() - t0
            estimate = spent / max(1, samples) * sum(plan.shard_samples(s) for s, _ in left)
            if estimate > budget:
                break
        else:
            events.append(why)
            return
    finally:
        inline.close()   # its isolated decoding helper, if any, is shut before the workers fork
    events.append(f"built {done} of {len(todo)} shard(s) in one process (a small build), then started workers "
                  f"for the other {len(left)}: {spent:.2f} s so far, about {estimate:.2f} s of work left "
                  f"(docs/reference-build.md#small-builds)")
    yield from run_fork(left, task, n_jobs, events, progress, recipe)


class RecipeOnce:
    """A recipe as a shard task ships it: pickled once in the parent, rebuilt once per worker process.

    Rebuilding a :class:`Recipe` (its decoders, steps and the user-code check) takes about 0.1 s; a
    worker keeps the recipes it rebuilt by the digest of their pickled bytes, so its later tasks of the
    same build get the same object."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self._blob: Optional[tuple[str, bytes]] = None

    def __reduce__(self) -> tuple:
        if self._blob is None:
            import hashlib
            import pickle

            blob = pickle.dumps(self.recipe)
            self._blob = (hashlib.sha256(blob).hexdigest(), blob)
        return _worker_recipe, self._blob


#: digest of a pickled recipe -> the recipe rebuilt from it in this (worker) process
_RECIPES: dict[str, Recipe] = {}


def _worker_recipe(digest: str, blob: bytes) -> Recipe:
    if digest not in _RECIPES:
        import pickle

        if len(_RECIPES) >= 4:
            _RECIPES.clear()
        _RECIPES[digest] = pickle.loads(blob)
    return _RECIPES[digest]


def run_inline(todo: list[tuple[Any, str]], task: Callable[..., tuple], progress: Any) -> Iterator[ShardResult]:
    """One shard after the other in this process."""
    from .shard import shutdown_isolated

    sink = progress.local_sink() if progress is not None else None
    try:
        for s, path in todo:
            stop.check()
            fn, args = task(s, path, False, False, sink)
            yield fn(*args)
    finally:
        shutdown_isolated()


def run_dask(todo: list[tuple[Any, str]], task: Callable[..., tuple], n_jobs: Optional[int], scheduler: str,
             events: list[str], progress: Any) -> Iterator[ShardResult]:
    """Shards on a dask cluster: a local one (``scheduler="local"``) or the scheduler at that address."""
    import joblib

    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        from ..errors import MissingDependencyError

        raise MissingDependencyError("--scheduler needs dask.distributed: pip install 'precompile[dask]'") from None
    if scheduler == "local":
        # one single-threaded worker process per core unless -j says otherwise; everything on 127.0.0.1
        workers = n_jobs if n_jobs is not None else (os.cpu_count() or 1)
        cluster = LocalCluster(n_workers=max(1, workers), threads_per_worker=1, processes=True,
                               host="127.0.0.1", dashboard_address="127.0.0.1:0")
        client = Client(cluster)
        _dashboard_note(client, workers, events, progress is not None)
    else:
        try:
            cluster, client = None, Client(scheduler, timeout="10s")
        except (OSError, TimeoutError) as e:
            raise BuildError(f"cannot reach the dask scheduler at {scheduler!r}: {e}") from None
    sink = progress.dask_sink(client) if progress is not None else None
    tasks = (joblib.delayed(fn)(*args) for fn, args in (task(s, path, sink=sink) for s, path in todo))
    try:
        with joblib.parallel_config(backend="dask"):
            yield from joblib.Parallel(n_jobs=-1, return_as="generator_unordered")(tasks)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def run_fork(todo: list[tuple[Any, str]], task: Callable[..., tuple], n_jobs: Optional[int], events: list[str],
             progress: Any, recipe: Optional[Recipe] = None) -> Iterator[ShardResult]:
    """Shards on worker processes forked from this one (:class:`.forkpool.ForkPool`), with the dead-worker retry.

    Each task goes to the next idle worker by its number in ``todo`` (the workers inherit the table). A
    worker that dies names the shard it was building: that shard is retried once with decoding isolated,
    alone (nothing else runs beside it, so memory is all its own), while the others go on; a second death
    fails it (:func:`_dead_shard`). Stopped early (an exception, the consumer closing this generator, a
    Ctrl-C), the workers still running are killed and their half-written shards removed.
    """
    from collections import deque

    from .forkpool import ForkPool, RemoteTraceback
    from .shard import shutdown_isolated

    def serve(tid: int, isolate: bool, sink: Any) -> ShardResult:
        s, path = todo[tid]
        fn, args = task(s, path, True, isolate, sink, ship=False)
        return fn(*args)

    preload(recipe)
    pool = ForkPool(min(n_workers(n_jobs), len(todo)), serve, progress.add if progress is not None else None,
                    shutdown_isolated)
    pending, suspects, isolated = deque(range(len(todo))), deque(), set()   # suspects: tids to retry alone
    finished = False
    try:
        pool.start()
        while pending or suspects or pool.running():
            _dispatch(pool, pending, suspects)
            if not pool.running():
                raise BuildError("the worker processes exit as soon as they start; run build again with -j 1 "
                                 "to see why")
            stop.check()
            for tid, kind, payload in pool.events(timeout=0.5):   # (a stop is checked at least every 0.5 s)
                stop.check()
                s, path = todo[tid]
                if kind == "ok":
                    yield payload
                elif kind == "err":
                    exc, tb = payload
                    if exc is None:
                        raise BuildError(f"shard {s.index} failed in a worker process: "
                                         f"{tb.strip().splitlines()[-1]}") from RemoteTraceback(tb)
                    raise exc from RemoteTraceback(tb)
                else:   # died
                    for t in glob.glob(glob.escape(path) + ".tmp-*"):
                        remove_path(t)
                    events.append(f"a worker process died again ({payload}) while shard {s.index} was being built "
                                  f"alone with decoding isolated" if s.index in isolated else
                                  f"a worker process died ({payload}) while shard {s.index} was being built; "
                                  f"retrying it alone with decoding isolated")
                    res = _dead_shard(s, payload, isolated)
                    if res is None:
                        suspects.append(tid)
                    else:
                        yield res
        finished = True
    finally:
        for tid in pool.close(kill=not finished):   # killed mid-task: their temporaries are ours to remove
            for t in glob.glob(glob.escape(todo[tid][1]) + ".tmp-*"):
                remove_path(t)


def preload(recipe: Optional[Recipe] = None) -> list[str]:
    """Import in this process what every forked worker would otherwise import on its first task: the shard
    task with every decoder, step and writer, OpenCV, and the modules the ``recipe``'s decoders, steps and
    writer import inside their functions (:func:`lazy_imports`: Pillow (with its common formats) for images,
    pydicom and scipy for DICOM series, PyAV for video, ...; without a recipe, Pillow). Imported once here,
    they are shared by the workers' pages instead of imported again in each. Returns the modules imported.

    Not the packages only a URL needs (:data:`URL_ONLY`): a build that reads or writes a URL has imported them
    by now (listing, fingerprinting or the output's store); a local build's workers never do (fsspec alone
    is 20-50 ms of the build's start)."""
    import importlib

    from ..registry import WRITERS, load_builtins

    load_builtins()
    want = ["cv2"]   # every worker sets OpenCV's threads to one (shard._one_thread_per_worker)
    if recipe is None:
        want.append("PIL.Image")
    else:
        classes = {type(d) for d in recipe.decoders.values()} | {type(s) for s in recipe.steps}
        classes.add(WRITERS.get(recipe.model.output.format))
        for mod in sorted({c.__module__ for c in classes}):
            want.extend(lazy_imports(mod))
    done = []
    for name in dict.fromkeys(want):
        if name in sys.modules or name.split(".")[0] in URL_ONLY:
            continue
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:   # an optional codec that is not installed: the task says so if it needs it
            pass
    if "PIL.Image" in sys.modules:
        sys.modules["PIL.Image"].preinit()   # Pillow's common format plugins, else loaded on the first open
    return done


#: packages imported only for a URL (:mod:`precompile.storage.remote`): :func:`preload` leaves them to a build
#: that has imported them already
URL_ONLY = frozenset({"fsspec"})

#: module -> the modules it imports inside its functions (and those of the precompile modules it imports)
_LAZY: dict[str, tuple[str, ...]] = {}

#: an import statement: indented (inside a function or block) or at the top of a module
_IMPORT = re.compile(r"^([ \t]*)(?:import[ \t]+([\w.]+)|from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+\(?([\w, \t]*))",
                     re.MULTILINE)


def lazy_imports(module: str, _seen: Optional[set[str]] = None) -> tuple[str, ...]:
    """The modules ``module`` imports in indented code (inside its functions; read from its source), and those
    of the precompile modules it imports (not packages), and theirs (a step's kernels, a decoder's helpers):
    what its code will import when it first runs. Other packages' modules only, not precompile's own nor the
    standard library's (cheap). ``from scipy import ndimage`` gives ``scipy`` and ``scipy.ndimage``."""
    if module in _LAZY:
        return _LAZY[module]
    seen = _seen if _seen is not None else set()
    seen.add(module)
    mod = sys.modules.get(module)
    try:
        with open(getattr(mod, "__file__", None) or "", encoding="utf-8") as f:
            source = f.read()
    except (OSError, ValueError):
        source = ""
    package = getattr(mod, "__package__", None) or ""
    found: list[str] = []
    for m in _IMPORT.finditer(source):
        indent, plain, base, names = m.groups()
        if plain:
            mods = [plain]
        else:
            base = _absolute(base, package)
            mods = [base] + [f"{base}.{n.strip()}" for n in (names or "").split(",") if n.strip()] if base else []
        for name in mods:
            top = name.split(".")[0]
            if top != "precompile":
                if indent and top not in sys.stdlib_module_names:
                    found.append(name)
            elif name not in seen and not hasattr(sys.modules.get(name), "__path__"):
                # a module of precompile's (a package's __init__ would lead everywhere): what it imports lazily
                found.extend(lazy_imports(name, seen))
    out = tuple(dict.fromkeys(found))
    if _seen is None:   # a module reached inside a cycle may miss what its cycle's first module adds
        _LAZY[module] = out
    return out


def _absolute(name: str, package: str) -> Optional[str]:
    """The absolute module name of ``from NAME import ...`` (NAME may be relative) in a module of ``package``."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    base = package.split(".")
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(base + ([name[level:]] if name[level:] else [])) or None


def _dispatch(pool: Any, pending: Any, suspects: Any) -> None:
    """Give idle workers tasks: a suspect alone once nothing runs, else the pending tasks in order."""
    for _ in range(4 * pool.n + 4):   # each try forks at most one worker (one that is gone is dropped)
        if suspects:
            if pool.running():
                return
            queue, isolate = suspects, True
        elif pending:
            queue, isolate = pending, False
        else:
            return
        w = pool.idle()
        if w is None:
            return
        if pool.send(w, queue[0], isolate):
            queue.popleft()
            if isolate:
                return


def worker_killed(shard_index: int, inputs: str, why: str) -> WorkerKilledError:
    """A shard's worker killed by SIGKILL twice, the second time alone: memory, not an input."""
    return WorkerKilledError(
        f"shard {shard_index} (inputs {inputs}): its worker process was killed ({why}) twice, the second time "
        f"building it alone; SIGKILL is what the kernel's out-of-memory killer sends (see dmesg), not a bad input. "
        f"Use fewer jobs (-j) or a smaller output.samples_per_shard, or give the machine more memory; "
        f"finished shards are kept, run build again")


def _dead_shard(s: Any, why: str, isolated: set[int]) -> Optional[ShardResult]:
    """A shard whose worker died: the first time it is marked for isolated decoding (None: retry it); the
    second time it fails (its result), or, when that death was SIGKILL, the build stops (memory, not input)."""
    if s.index not in isolated:
        isolated.add(s.index)
        return None
    if "SIGKILL" in why:  # killed from outside twice, the second time alone: memory, not an input
        raise worker_killed(s.index, _inputs(s), why)
    return _dead_worker_result(s, why)


def run_loky(todo: list[tuple[Any, str]], task: Callable[..., tuple], n_jobs: Optional[int], events: list[str],
             progress: Any) -> Iterator[ShardResult]:
    """Shards on local loky worker processes, with the dead-worker retry.

    A dead loky worker breaks the whole pool and loky does not say which task it ran. The shards it
    (and the workers loky stopped with it) were building are those with a temporary file left behind;
    they become suspects and are retried once with decoding isolated, one at a time (so a second death
    names exactly its shard, never one that was only stopped beside it); the rest run again in a fresh pool.
    """
    import joblib
    from joblib.externals.loky.process_executor import BrokenProcessPool, TerminatedWorkerError

    _settle_warm()
    remaining, isolated = list(todo), set()
    sink = progress.queue_sink() if progress is not None else None
    while remaining:
        done: set[int] = set()
        batch = [(s, p) for s, p in remaining if s.index in isolated][:1] or remaining  # a suspect runs alone
        tasks = (joblib.delayed(loky_task)(os.getpid(), fn, *args)
                 for fn, args in (task(s, path, True, s.index in isolated, sink) for s, path in batch))
        try:
            with warnings.catch_warnings():
                # stopping early (on_error: fail) cancels queued tasks on purpose; joblib warns about it
                warnings.filterwarnings("ignore", message=r".*tasks which were still being processed", category=UserWarning)
                # a lone suspect still runs in a worker (n_jobs=1 would run it in this very process)
                for res in joblib.Parallel(n_jobs=n_jobs, backend="loky", return_as="generator_unordered")(tasks):
                    done.add(res.index)
                    yield res
        except TerminatedWorkerError as e:
            yield from _after_dead_worker(e, batch, done, isolated, events)
        except BrokenProcessPool as e:  # e.g. a task that cannot be unpickled in a worker (a plugin it cannot import)
            raise BuildError(f"the worker processes failed: {e}; finished shards are kept, run build again "
                             f"(with -j 1 to see the cause)") from None
        remaining = [(s, p) for s, p in remaining if s.index not in done]


def _after_dead_worker(e: Exception, remaining: list[tuple[Any, str]], done: set[int], isolated: set[int],
                       events: list[str]) -> Iterator[ShardResult]:
    """The shards a dead worker was building: their temporaries go; a second death fails them (yielded, and
    added to ``done``), a first marks them for isolated decoding."""
    m = re.search(r"exit codes of the workers are \{(.*?)\}", str(e))
    why = f"exit {m.group(1)}" if m else "terminated"
    left = [(s, p) for s, p in remaining if s.index not in done]
    hit = [(s, p) for s, p in left if glob.glob(glob.escape(p) + ".tmp-*")] or left
    for s, p in hit:
        for t in glob.glob(glob.escape(p) + ".tmp-*"):
            remove_path(t)
    events.append(f"a worker process died ({why}) while shard(s) {', '.join(str(s.index) for s, _ in hit)} "
                  f"were being built; retrying them with decoding isolated")
    for s, _ in hit:
        res = _dead_shard(s, why, isolated)
        if res is not None:
            done.add(s.index)
            yield res


def _dashboard_note(client: Any, workers: int, events: list[str], show: bool) -> None:
    """Say where the local cluster's dashboard is (it needs bokeh; without it there is none to show)."""
    import importlib.util

    if importlib.util.find_spec("bokeh") is not None:
        note = f"dask: local cluster of {workers} worker(s); dashboard at {client.dashboard_link}"
    else:
        note = f"dask: local cluster of {workers} worker(s); no dashboard (pip install bokeh to get one)"
    events.append(note)
    if show:
        print(note, file=sys.stderr, flush=True)
