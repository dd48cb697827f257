"""The build's worker processes (compiler/backends.py): none outlives its build, whatever ends the build.

A real ``precompile build -j 2`` runs in a subprocess on inputs made slow by a test-only decoder (a
plugin module that sleeps per input), so it is mid-build when it is stopped. Its process tree (children
and grandchildren, read from /proc before the stop) is then watched: every process of it must be gone
within 2 s (3 s for loky's), whether the build was killed with SIGKILL, with SIGTERM, or interrupted with Ctrl-C (SIGINT to
its process group), which must also say what was kept and how to finish.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")

N_INPUTS, PER_SHARD = 48, 4
N_SHARDS = N_INPUTS // PER_SHARD
PLUGIN_MOD = "pcplug_workers_slow"
PLUGIN = f'''"""Test-only decoder: the image decoder, 40 ms slower per input."""
import time

from precompile.decoders.image import ImageDecoder
from precompile.registry import DECODERS


@DECODERS.register()
class SlowImage(ImageDecoder):
    name = "{PLUGIN_MOD}"

    def read(self, path):
        time.sleep(0.04)
        return super().read(path)
'''


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """(recipe writer, environment): 48 tiny PNGs decoded 40 ms each, 4 per shard."""
    from PIL import Image

    base = tmp_path_factory.mktemp("workers")
    (base / "plug").mkdir()
    (base / "plug" / f"{PLUGIN_MOD}.py").write_text(PLUGIN)
    root = base / "in"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(N_INPUTS):
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(root / f"img_{i:04d}.png")

    def recipe(name: str = "r.yaml", **top) -> str:
        data = {"name": "wk", "seed": 3, "inputs": {"root": str(root), "match": "{name}.png",
                                                     "fields": {"image": {"decoder": PLUGIN_MOD}}},
                "steps": [{"resize": {"size": [6, 6]}}], "output": {"samples_per_shard": PER_SHARD}, **top}
        (base / name).write_text(yaml.safe_dump(data))
        return str(base / name)

    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(base / "plug"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return recipe, env


def _cmd(recipe: str, out, *extra: str) -> list[str]:
    run = f"import {PLUGIN_MOD}, runpy; runpy.run_module('precompile', run_name='__main__')"
    return [sys.executable, "-c", run, "build", recipe, "-o", str(out), *extra]


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(f) as fh:
                kids.extend(int(x) for x in fh.read().split())
        except OSError:
            pass
    return kids


def _tree(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children, grandchildren, ...)."""
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: nothing reaps an orphan's zombie in some containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _finished(out) -> list[str]:
    return sorted(glob.glob(os.path.join(str(out), "wk.shards", "shard-*.h5")))


def _tmps(out) -> list[str]:
    return glob.glob(os.path.join(str(out), "wk.shards", "*.tmp-*"))


def _start(cmd: list[str], env: dict, out, grandchildren: bool = False, workers: int = 2,
           forced: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """Start the build in its own session, its output to files (an orphan holding a pipe open would hang the
    read); return it and its process tree once it is mid-build: ``workers`` workers (and with ``grandchildren``,
    their helpers) running and at least one shard finished, not the last (``forced``: one being written)."""
    logs = os.path.dirname(str(out))
    with open(os.path.join(logs, "stdout"), "w") as o, open(os.path.join(logs, "stderr"), "w") as e:
        proc = subprocess.Popen(cmd, env=env, stdout=o, stderr=e, start_new_session=True)
    deadline = time.monotonic() + 120
    tree: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        tree = _tree(proc.pid)
        helpers = [p for p in tree if p not in kids]
        if len(kids) >= workers and (helpers or not grandchildren) and (_tmps(out) if forced else _finished(out)):
            break
        time.sleep(0.005)
    if proc.poll() is not None or (not forced and len(_finished(out)) >= N_SHARDS):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the build ended before it could be stopped mid-build: {_stderr(out)[-2000:]}")
    return proc, tree


def _stderr(out) -> str:
    with open(os.path.join(os.path.dirname(str(out)), "stderr")) as f:
        return f.read()


def _gone_within(tree: list[int], seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in tree if _alive(p)]
        if not left:
            return []
        time.sleep(0.02)
    return [f"{p}: {_cmdline(p)}" for p in tree if _alive(p)]


@pytest.mark.parametrize("sig,extra,workers", [(signal.SIGKILL, (), "fork"), (signal.SIGTERM, (), "fork"),
                                               (signal.SIGKILL, ("--timeout", "60"), "fork"),
                                               (signal.SIGKILL, (), "loky")],
                         ids=["sigkill", "sigterm", "sigkill-isolated-decoding", "sigkill-loky"])
def test_no_process_outlives_a_killed_build(slow, tmp_path, sig, extra, workers):
    """Workers (and, with --timeout, the decoding helpers each worker starts; with loky, its helpers and the
    progress bar's queue manager) exit when the build dies."""
    recipe, env = slow
    out = tmp_path / "out"
    env = dict(env, PRECOMPILE_WORKERS=workers)
    proc, tree = _start(_cmd(recipe(), out, "-j", "2", *extra), env, out, grandchildren=bool(extra))
    try:
        assert len(tree) >= 2 + (2 if extra else 0), [_cmdline(p) for p in tree]
        os.kill(proc.pid, sig)   # the build's own process only: its workers are not told
        proc.wait(timeout=30)
        limit = 2.0 if workers == "fork" else 3.0   # loky's helpers check their parent every 0.5 s
        left = _gone_within(tree, limit)
        assert not left, f"still running {limit} s after the build died by {sig.name}: {left}"
        if sig == signal.SIGTERM:   # the CLI stops as for Ctrl-C: what was kept, exit 143
            kept = len(_finished(out))
            assert proc.returncode == 143, _stderr(out)[-2000:]
            assert f"terminated (SIGTERM): {kept} of {N_SHARDS} shards written and kept; run the same command " \
                   f"again to finish" in _stderr(out)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_says_what_was_kept_and_a_rerun_finishes(slow, tmp_path, jobs):
    recipe, env = slow
    out = tmp_path / "out"
    r = recipe()
    proc, tree = _start(_cmd(r, out, "-j", jobs), env, out, workers=int(jobs) if jobs != "1" else 0)
    try:
        os.killpg(proc.pid, signal.SIGINT)   # what a terminal's Ctrl-C does
        proc.wait(timeout=60)
        left = _gone_within(tree, 3.0)
        err = _stderr(out)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kept = len(_finished(out))
    assert 0 < kept < N_SHARDS
    assert proc.returncode == 130, err[-2000:]
    assert (f"interrupted: {kept} of {N_SHARDS} shards written and kept; run the same command again to finish"
            in err), err
    assert "Aborted!" not in err and "Traceback" not in err, err[-2000:]
    assert not left, f"still running 3 s after Ctrl-C: {left}"
    assert not _tmps(out)   # the half-written shards are removed
    again = subprocess.run(_cmd(r, out, "-j", "2", "--no-progress"), env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    rep = json.loads((out / "wk.report.json").read_text())
    assert rep["shards"]["skipped"] == kept and rep["shards"]["built"] == N_SHARDS - kept


_CV2_USED = """
import sys
import cv2
import numpy as np
from precompile import build
cv2.setNumThreads(2)
a = np.random.default_rng(0).random((1500, 1500), dtype=np.float32)
for _ in range(3):   # OpenCV's thread pool is now running in this process
    cv2.GaussianBlur(cv2.resize(a, (2500, 2500)), (9, 9), 0)
rep = build(sys.argv[1], sys.argv[2], n_jobs=2)
print(rep["shards"]["built"], cv2.getNumThreads())
"""


def test_workers_forked_after_opencv_used_its_threads_do_not_hang(tmp_path):
    """A process that used OpenCV's thread pool forks workers that change their thread count (one each):
    that hangs in the child unless the parent drops to one thread around the fork (and back after)."""
    from conftest import image_recipe, make_image_tree, write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", image_recipe(make_image_tree(tmp_path / "in", per_class=3)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _CV2_USED, str(recipe), str(tmp_path / "out")], capture_output=True,
                       text=True, env=env, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["2", "2"]   # both shards built; this process keeps its two OpenCV threads


def test_ctrl_c_of_a_forced_rebuild_says_to_run_without_force(slow, tmp_path):
    """--force rebuilds shards whose files (same key, same name) are there already: a rerun without --force
    keeps all of them, and that is what the message says."""
    recipe, env = slow
    out = tmp_path / "out"
    r = recipe()
    first = subprocess.run(_cmd(r, out, "-j", "2", "--no-progress"), env=env, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    proc, tree = _start(_cmd(r, out, "-j", "2", "--force"), env, out, forced=True)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 130 and not _tmps(out)
    assert (f"interrupted: {N_SHARDS} of {N_SHARDS} shards written and kept; run the same command again without "
            f"--force to finish") in _stderr(out)


# --- the pool itself (compiler/forkpool.py), in this process ---------------------------------------------

def _pool_run(serve, tasks: int, n: int = 2, progress=None):
    from precompile.compiler.forkpool import ForkPool

    pool = ForkPool(n, serve, progress)
    out: dict[int, tuple] = {}
    try:
        pool.start()
        pending = list(range(tasks))
        while pending or pool.running():
            while pending and (w := pool.idle()) is not None:
                assert pool.send(w, pending.pop(0), False)
            for tid, kind, payload in pool.events():
                out[tid] = (kind, payload)
    finally:
        pool.close()
    return out


def _worker_facts(tid, isolate, sink):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(sig), 0, 0, 0)   # PR_GET_PDEATHSIG
    return os.getpid(), os.getppid(), sig.value, signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_a_forked_worker_asks_to_die_with_the_build_and_leaves_ctrl_c_to_it():
    out = _pool_run(_worker_facts, 2)
    assert {k for k, _ in out.values()} == {"ok"}
    for pid, ppid, deathsig, ignores_int in (p for _, p in out.values()):
        assert pid != os.getpid() and ppid == os.getpid()
        assert deathsig == signal.SIGKILL and ignores_int


def _crash_one(tid, isolate, sink):
    if sink is not None:
        sink(tid, 1)
    if tid == 1:
        import faulthandler

        faulthandler.disable()   # pytest's, inherited: no stack printed for this crash
        os.kill(os.getpid(), signal.SIGSEGV)
    if tid == 2:
        raise ValueError(f"task {tid} refuses")
    return tid * 10


def test_a_dead_worker_names_its_task_and_an_exception_comes_back_with_its_traceback():
    seen: list[tuple[int, int]] = []
    out = _pool_run(_crash_one, 5, progress=lambda shard, n: seen.append((shard, n)))
    assert out[0] == ("ok", 0) and out[3] == ("ok", 30) and out[4] == ("ok", 40)
    assert out[1] == ("died", "exit SIGSEGV(-11)")   # as loky words it; the other tasks went on
    kind, (exc, tb) = out[2]
    assert kind == "err" and isinstance(exc, ValueError) and str(exc) == "task 2 refuses"
    assert "_crash_one" in tb and "ValueError: task 2 refuses" in tb
    assert sorted(seen) == [(i, 1) for i in range(5)]


_NEW_MODULES = """
import json, shutil, sys
from precompile import build
from precompile.compiler import backends

real = backends.run_fork


def run_fork(todo, task, *a, **k):   # each task reports the packages its worker imported while it ran
    def watched(s, path, in_worker=True, isolate=False, sink=None, ship=True):
        fn, args = task(s, path, in_worker, isolate, sink, ship)

        def run(*args):
            before = {m.split(".")[0] for m in sys.modules}
            res = fn(*args)
            res.events = sorted({m.split(".")[0] for m in sys.modules} - before)   # whole packages, not submodules
            return res
        return run, args
    for res in real(todo, watched, *a, **k):
        print(json.dumps(res.events))
        yield res


backends.run_fork = run_fork
shutil.rmtree(sys.argv[2], ignore_errors=True)
build(sys.argv[1], sys.argv[2], n_jobs=2)
"""


@pytest.mark.parametrize("recipe", ["images.yaml", "video.yaml"])
def test_forked_workers_import_nothing_on_their_first_task(tmp_path, recipe):
    """The build imports, before it forks, what the recipe's decoders, steps and writer import lazily (Pillow,
    OpenCV, PyAV, ...): a worker's first task imports no package of its own (it would in every worker)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _NEW_MODULES, str(REPO / "recipes" / recipe), str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    per_task = [json.loads(line) for line in r.stdout.split()]
    assert len(per_task) >= 2 and all(new == [] for new in per_task), per_task


def test_a_local_parallel_build_never_imports_the_url_packages(tmp_path):
    """What only a URL needs (fsspec: 20-50 ms of a build's start) is not preloaded for the workers of a build
    that read and writes local files: neither its process nor its workers import it (the test above: a
    worker's first task imports nothing), and its shards are the same bytes as at -j1."""
    code = ("import sys; from precompile import build; build(sys.argv[1], sys.argv[2], n_jobs=int(sys.argv[3])); "
            "print(sorted(m for m in ('fsspec', 'h5py', 'cv2') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    digests = []
    for j in (2, 1):
        out = tmp_path / f"j{j}"
        r = subprocess.run([sys.executable, "-c", code, str(REPO / "recipes" / "images.yaml"), str(out), str(j)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split("\n")[-2] == "['cv2', 'h5py']", r.stdout
        digests.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in (out / "images.shards").glob("*.h5")})
    assert len(digests[0]) == 3 and digests[0] == digests[1]


def test_lazy_imports_are_read_from_the_source_of_the_recipes_code():
    from precompile.compiler.backends import lazy_imports
    from precompile.registry import load_builtins

    load_builtins()
    dicom = lazy_imports("precompile.decoders.dicom")
    assert {"pydicom", "scipy.ndimage"} <= set(dicom)               # `from scipy import ndimage` in a function
    assert "scipy.ndimage" in lazy_imports("precompile.transforms.volume")   # through its kernels module
    assert "av" in lazy_imports("precompile.decoders.video")
    assert not [m for m in dicom if m.split(".")[0] in ("precompile", "os", "warnings")]   # own and stdlib: no
    image = {m.split(".")[0] for mod in ("precompile.decoders.image", "precompile.transforms.geometry",
                                         "precompile.formats.hdf5") for m in lazy_imports(mod)}
    assert {"PIL", "cv2", "h5py"} <= image and not image & {"soundfile", "av", "pydicom", "scipy"}   # only theirs


def test_a_helper_whose_build_died_while_it_started_exits_at_once(tmp_path):
    """A loky worker (or the progress queue's manager) calls ``watch_parent`` only once it has started; a build
    killed before that has already handed the helper to init (or a subreaper). Given the build's process id, the
    helper sees it is orphaned and exits there; read from ``os.getppid()`` then, the "parent" would be the
    adopter, watched forever."""
    err = tmp_path / "helper.err"
    helper = ("import sys, time\n"
              "time.sleep(1.0)\n"                       # still starting when its build dies
              "from precompile.compiler.forkpool import watch_parent\n"
              "watch_parent(int(sys.argv[1]), period=0.1)\n"
              "open(sys.argv[2], 'w').write('watching')\n"
              "time.sleep(60)\n")
    build = ("import os, subprocess, sys\n"
             "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), sys.argv[2]],\n"
             "                     stdout=subprocess.DEVNULL, stderr=open(sys.argv[3], 'w'))\n"
             "print(p.pid, flush=True)\n"
             "os._exit(0)\n")                           # the build dies before its helper watches it
    marker = tmp_path / "watching"
    out = subprocess.run([sys.executable, "-c", build, helper, str(marker), str(err)], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    pid = int(out.stdout.split()[0])
    try:
        assert _alive(pid)   # still starting
        left = _gone_within([pid], 5.0)
        assert not left, f"the helper outlived its build: {left}"
        assert not marker.exists(), "watch_parent returned in a helper whose build had died"
        assert err.read_text() == "", err.read_text()[-2000:]   # it exited in watch_parent, not on an error
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # (the dropped one, on purpose)
def test_a_ctrl_c_python_drops_in_a_weakref_callback_still_stops_the_build(tmp_path, monkeypatch):
    """Python runs a signal handler between bytecodes of whatever runs: inside a weakref callback (h5py and numpy
    run many while a shard is written) the KeyboardInterrupt it raises is printed as "Exception ignored" and
    dropped. A Ctrl-C that landed there was lost: the build ran to its end and exited 0 (seen once in six Ctrl-Cs
    of a clips build). The CLI's handler also records the stop, and the build raises it at its next safe point:
    here before the next input."""
    import weakref

    from PIL import Image

    from precompile import build
    from precompile.cli import _interruptible
    from precompile.decoders.image import ImageDecoder

    root = tmp_path / "in"
    root.mkdir()
    for i in range(8):
        Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(root / f"{i}.png")
    calls = []
    read = ImageDecoder.read

    def read_and_drop_a_ctrl_c(self, path):
        calls.append(path)
        if len(calls) == 3:
            class Held:
                pass

            def callback():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10000):   # the handler runs in here: its KeyboardInterrupt is dropped
                    pass

            held = Held()
            weakref.finalize(held, callback)
            del held
        return read(self, path)

    monkeypatch.setattr(ImageDecoder, "read", read_and_drop_a_ctrl_c)
    recipe = {"name": "c", "inputs": {"root": str(root), "match": "{n}.png", "fields": {"image": {"decoder": "image"}}},
              "output": {"samples_per_shard": 2}}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with _interruptible():
        with pytest.raises(KeyboardInterrupt):
            build(recipe, str(tmp_path / "out"), n_jobs=1, progress=False)
    assert len(calls) == 3   # stopped before the fourth input
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler is given back
