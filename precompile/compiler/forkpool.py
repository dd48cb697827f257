"""Worker processes forked from the build's own process (Linux): they start in milliseconds, run shard
tasks by number, and never outlive the build.

Why fork is safe here: the build path never imports torch, and the parent forks from the thread that runs
the build, after planning, when its other threads (a progress bar's monitor, OpenBLAS's pool, which
re-forms itself after a fork) hold nothing a worker uses; a worker runs only shard tasks and the pipe
protocol below. OpenCV's thread pool, the one library state known to break in a child, is set to one thread
around each fork (:func:`_cv2_one_thread`). A worker inherits the parent's imported modules (the shard
task, every decoder, step and writer, user code from ``imports:``) and the task table itself, so a task is
sent as its number, never pickled: only results (and progress events) travel, over one pipe per worker.

Lifetime: each worker asks Linux to SIGKILL it when the thread that forked it (the build's) ends
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a build killed by any signal leaves no worker behind; it checks
its parent is still the build's process after the request (the parent may have died in between). The
decoding helper a worker starts (:class:`~precompile.compiler.shard.IsolatedDecoder`) asks the same of
its worker, so the chain ends with the build. Workers ignore SIGINT: a Ctrl-C to the process group is the
parent's to handle (it stops the workers, removes their half-written shards and says what was kept); the
parent holds SIGINT and SIGTERM back while it forks and registers a worker, so none is left unknown.

Deaths: a worker that dies while running a task is reported with that task's number and how it ended
(``exit SIGKILL(-9)``, ``exit 7``); the other workers go on. :func:`.backends.run_fork` decides what to do.
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Optional

#: prctl option: the signal sent to this process when the thread that forked it ends
PR_SET_PDEATHSIG = 1

#: signals held back while a worker is forked and registered
_STOPS = {signal.SIGINT, signal.SIGTERM}


_prctl: Any = None


def _load_prctl() -> Any:
    """libc's prctl (loaded once, in the parent: a forked worker inherits it), or False where there is none."""
    global _prctl
    if _prctl is None:
        try:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl


def die_with_parent(parent_pid: int) -> bool:
    """In a child: ask Linux to SIGKILL this process when its parent (the forking thread) ends; exit at once
    when the parent is already gone (it died before the request took effect). False where prctl is missing."""
    prctl = _load_prctl()
    ok = bool(prctl) and prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != parent_pid:
        os._exit(0)
    return ok


def _cv2_one_thread() -> Optional[int]:
    """OpenCV's thread pool, once used, is not fork-safe: a child that changes its thread count hangs. When
    OpenCV is loaded, set one thread (what a worker uses, :func:`.shard._one_thread_per_worker`) before a
    fork, so the child inherits a pool it never has to change; returns the count to restore here after."""
    cv2 = sys.modules.get("cv2")
    if cv2 is None or not hasattr(cv2, "setNumThreads"):
        return None
    n = cv2.getNumThreads()
    if n != 1:
        cv2.setNumThreads(1)
    return n


def describe_exit(status: int) -> str:
    """How a worker ended, as loky words it: ``exit SIGKILL(-9)``, ``exit 7``."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"exit {signal.Signals(-code).name}({code})"
        except ValueError:
            return f"exit signal {-code}({code})"
    return f"exit {code}"


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the ``__cause__`` of the one raised here)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb}\"\"\""


class Worker:
    """One forked worker: its pid, the pipe its tasks go down, the pipe its messages come up."""

    def __init__(self, pid: int, tasks: Connection, results: Connection):
        self.pid = pid
        self.tasks = tasks
        self.results = results
        self.task: Optional[int] = None   # the task it runs, None when idle

    def fds(self) -> list[int]:
        return [self.tasks.fileno(), self.results.fileno()]


#: a worker's message: ("p", shard, n) progress, ("ok", result), ("err", exception or None, traceback text)
Event = tuple[Worker, str, Any]


class ForkPool:
    """Up to ``n`` forked workers that run ``serve(task number, isolate, sink)`` (inherited, never pickled).

    ``progress(shard, n)``, if given, is called here for each progress event a task sends (``sink`` in the
    worker is then a callable that sends them; None otherwise). ``cleanup()`` runs in a worker before it exits.
    """

    def __init__(self, n: int, serve: Callable[[int, bool, Any], Any],
                 progress: Optional[Callable[[int, int], None]] = None,
                 cleanup: Optional[Callable[[], None]] = None):
        self.n = max(1, n)
        self.serve = serve
        self.progress = progress
        self.cleanup = cleanup
        self.workers: list[Worker] = []
        self.parent = os.getpid()

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Fork every worker now (each a few milliseconds)."""
        _load_prctl()
        while len(self.workers) < self.n:
            self._fork()

    def _fork(self) -> Worker:
        task_r, task_w = os.pipe()
        res_r, res_w = os.pipe()
        inherited = [fd for w in self.workers for fd in w.fds()]
        for s in (sys.stdout, sys.stderr):   # nothing buffered here may be written twice
            try:
                s.flush()
            except (OSError, ValueError, AttributeError):
                pass
        # a Ctrl-C waits until the worker is forked and known here (it would be left running otherwise)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            cv2_threads = _cv2_one_thread()
            gc.freeze()   # the parent's objects stay out of the child's collections (fewer copied pages)
            try:
                with warnings.catch_warnings():
                    # Python 3.12+ warns on fork with threads; the build's threads hold nothing a worker uses
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            except OSError as e:
                for fd in (task_r, task_w, res_r, res_w):
                    os.close(fd)
                from ..errors import BuildError

                raise BuildError(f"cannot start a worker process: {e.strerror or e}; try fewer jobs (-j)") from None
            finally:
                if os.getpid() == self.parent:
                    gc.unfreeze()
                    if cv2_threads is not None:
                        import cv2

                        cv2.setNumThreads(cv2_threads)
            if pid == 0:   # the worker: never returns
                self._worker(mask, Connection(task_r, writable=False), Connection(res_w, readable=False),
                             [task_w, res_r, *inherited])
            os.close(task_r)
            os.close(res_w)
            w = Worker(pid, Connection(task_w, readable=False), Connection(res_r, writable=False))
            self.workers.append(w)
            return w
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _worker(self, mask: Any, tasks: Connection, results: Connection, close: list[int]) -> None:
        """The worker process, from the fork to its exit (never returns)."""
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the parent's to handle
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)             # whatever handlers the parent set
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fd in close:   # the parent's ends of this worker's pipes and of the workers forked before it
                os.close(fd)
            die_with_parent(self.parent)
            code = self._child(tasks, results)
        except SystemExit as e:   # a task that calls sys.exit ends the worker, as a crash would
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                if self.cleanup is not None:
                    self.cleanup()
                for s in (sys.stdout, sys.stderr):
                    s.flush()
            finally:
                os._exit(code)

    def _child(self, tasks: Connection, results: Connection) -> int:
        """The worker's loop: a task number in, its result (or exception) out, until the task pipe ends."""
        sink = None
        if self.progress is not None:
            def sink(shard: int, n: int = 1) -> None:
                results.send_bytes(pickle.dumps(("p", shard, n)))
        while True:
            try:
                tid, isolate = pickle.loads(tasks.recv_bytes())
            except EOFError:
                return 0
            try:
                msg = pickle.dumps(("ok", self.serve(tid, isolate, sink)))
            except Exception as e:
                tb = traceback.format_exc()
                try:
                    msg = pickle.dumps(("err", e, tb))
                except Exception:   # an exception that cannot travel: its traceback does
                    msg = pickle.dumps(("err", None, tb))
            results.send_bytes(msg)

    # -- running ----------------------------------------------------------------------------------
    def idle(self) -> Optional[Worker]:
        """An idle worker (forked now if fewer than ``n`` are alive), or None when all ``n`` are busy."""
        for w in self.workers:
            if w.task is None:
                return w
        return self._fork() if len(self.workers) < self.n else None

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.task is not None]

    def send(self, w: Worker, tid: int, isolate: bool) -> bool:
        """Give task ``tid`` to idle worker ``w``; False (and ``w`` is dropped) when it is already gone."""
        try:
            w.tasks.send_bytes(pickle.dumps((tid, isolate)))
        except OSError:
            self._reap(w)
            return False
        w.task = tid
        return True

    def events(self, timeout: Optional[float] = None) -> Iterator[tuple[int, str, Any]]:
        """Wait for the workers: yield ``(task, "ok", result)``, ``(task, "err", (exception, traceback))``
        and ``(task, "died", how)`` for each task that ended; progress events go to ``progress``. A worker
        that dies idle is dropped (a later :meth:`idle` forks another)."""
        conns = {w.results: w for w in self.workers}
        for c in wait(list(conns), timeout):
            w = conns[c]
            while True:
                try:
                    kind, *rest = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    tid, how = w.task, self._reap(w)
                    if tid is not None:
                        yield tid, "died", how
                    break
                if kind == "p":
                    if self.progress is not None:
                        self.progress(*rest)
                    if c.poll():
                        continue
                    break
                tid, w.task = w.task, None
                yield tid, kind, rest[0] if kind == "ok" else tuple(rest)
                break

    def _reap(self, w: Worker) -> str:
        """Close a dead (or dying) worker's pipes and collect its exit status; how it ended."""
        for c in (w.tasks, w.results):
            c.close()
        if w in self.workers:
            self.workers.remove(w)
        _, status = os.waitpid(w.pid, 0)
        return describe_exit(status)

    # -- stopping ---------------------------------------------------------------------------------
    def close(self, kill: bool = False) -> list[int]:
        """Stop every worker: idle ones are told to exit (end of their task pipe); busy ones, and with
        ``kill`` every one, are SIGKILLed. Returns the tasks that were running (their work is lost)."""
        lost = [w.task for w in self.workers if w.task is not None]
        for w in self.workers:
            w.tasks.close()
            if kill or w.task is not None:
                _kill(w.pid)
        deadline = time.monotonic() + 5.0
        for w in list(self.workers):
            while os.waitpid(w.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    _kill(w.pid)
                    os.waitpid(w.pid, 0)
                    break
                if wait([w.results], 0.05):   # its end of the pipe closed: it is exiting
                    time.sleep(0.001)
            w.results.close()
        self.workers.clear()
        return lost


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


#: whether :func:`watch_parent` runs in this process
_watching = False


def watch_parent(parent: int | None = None, period: float = 0.5) -> None:
    """In a helper process started some other way (a loky worker, the progress queue's manager): exit within
    ``period`` seconds of the parent process's death, by a daemon thread that polls :func:`os.getppid`.
    (PR_SET_PDEATHSIG would fire when the *thread* that started the process ends, and loky starts workers
    from threads of its own.) ``parent``: the process id of the build that started this one, passed in by the
    build; a helper whose parent is already gone when it gets here (killed while the helper was still starting:
    it was adopted by init or a subreaper) exits at once, where the parent read from ``os.getppid()`` now would
    be the adopter, watched forever. Once per process."""
    global _watching
    if parent is not None and os.getppid() != parent:
        os._exit(1)
    if _watching:
        return
    _watching = True
    import threading

    if parent is None:
        parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="precompile-watch-parent", daemon=True).start()
