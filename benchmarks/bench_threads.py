"""Gather threads with one batch in flight: the Loader's thread speed-up against a native copy of the same rows.

With ``prefetch=1`` one gather task is in flight, and its rows are split across the gather threads
(``RowSplitter``). Issue 33 made each range one ``np.take`` per field, which numpy runs without the interpreter
lock from its first row to its last (``DirectReader.PIECE_TAKE``); before, a range was one take per view of the
mapped range it touched, with Python (and the lock) between them. Contenders, all on the same store and the same
shuffled batches (warm page cache), CPU device, uint8 out, taking turns pass by pass:

- ``native take`` (the bound): the whole set in private memory, each batch's rows sorted and cut into as many
  ranges as threads, each range ONE ``np.take(images, rows, axis=0, out=..., mode="clip")`` in its own thread
  (``mode="raise"`` would buffer ``out``): what threads can add to a copy of these rows on this machine, with no
  reader and no Python between rows;
- ``native take 2 bufs``: the same, writing batches into two buffers in turn, as any reader must with one batch
  ahead (the consumer holds batch k while k + 1 is gathered; the plain native take rewrites one buffer that
  can stay in the cache);
- ``row copy loop``: ``out[j] = images[idx[j]]`` over the batch's shuffled rows, cut into ranges copied by
  Python threads (the interpreter lock taken between rows; the bar before issue 33);
- ``Loader`` with ``prefetch=1``, mapped files (default) and ``in_memory=True``, with the one-take gather
  (``one take``), with the views as before issue 33 (``views (before)``: ``PIECE_TAKE`` off) and with a task
  waiting for its parts queued behind another task's on a busy split thread (``one take, waits (before)``:
  ``feed.STEAL_PARTS`` off), at each ``--threads`` count.

The table gives the median samples/s over ``--repeats`` passes, the ratio to the same contender with 1 thread
(the median of the ratios of passes in the same turn, so load that comes and goes cancels) and to the native
take with 1 thread. The summary then gives the goal's figure: the Loader's 2-thread speed-up over the native
take's (issue 33: >= 0.9 on 2 cores). 64x64x3 (12 KiB) and 256x256x3 (192 KiB) samples by default
(``--sides``; 224 gives 147 KiB rows in 1 KiB pieces, 227 odd rows that keep the views), batches of 256.

    PYTHONPATH=. python benchmarks/bench_threads.py [--quick] [--threads 1,2] [--repeats R] [--sides 64,256]

``--per-thread``: instead, what the pieces cost or gain per thread, with no Loader and no threads:
``DirectReader.gather`` of the same sorted batches, one take against the views, at 8x8x3 to 256x256x3.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loader import write_store  # noqa: E402

#: samples per store side (full run, --quick)
SAMPLES = {64: (32768, 4096), 224: (4096, 512), 227: (4096, 512), 256: (4096, 512)}


def one_pass(batches, n: int) -> float:
    """samples/s of one pass over an iterable of batches."""
    t0 = time.perf_counter()
    seen = 0
    for b in batches:
        x = b["image"] if isinstance(b, dict) else b
        seen += int(x.shape[0])
    dt = time.perf_counter() - t0
    assert seen == n, (seen, n)
    return n / dt


def per_thread(reps: int, bs: int, quick: bool) -> None:
    """One thread, no Loader: ``DirectReader.gather`` of every gather-ordered shuffled batch of a mapped store,
    pieces (one take) against the views (``PIECE_TAKE`` off), the two readers taking turns pass by pass."""
    import precompile
    from precompile.reader import direct, feed
    from precompile.reader.mapping import page_aligned_empty

    print(f"one thread, DirectReader.gather of sorted batches of {bs} into one page-aligned buffer, mapped, "
          f"{reps} passes each; load average {os.getloadavg()[0]:.1f} at the start")
    print()
    print("| rows | pieces | views | one take samples/s | views samples/s | one take / views | "
          "bare take, private memory: pieces / whole rows |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape, n, chunk in (((8, 8, 3), 65536, 256), ((16, 16, 3), 32768, 256), ((64, 64, 3), 16384, 170),
                            ((224, 224, 3), 2048, 13), ((256, 256, 3), 2048, 10)):
        n = n // 8 if quick else n
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_store(tmp, "s", images, rng.integers(0, 10, n), samples_per_shard=max(1, n // 4),
                               chunk_samples=chunk)
            ds = precompile.open(path)
            readers = {}
            old = direct.PIECE_TAKE
            try:
                for pieces in (True, False):
                    direct.PIECE_TAKE = pieces
                    readers[pieces] = direct.DirectReader(ds, ["image"])
            finally:
                direct.PIECE_TAKE = old
            p = readers[True]._pieces["image"]
            cut = f"{p.count} x {p.view.shape[1]} B" if p is not None else "none (views)"
            out = page_aligned_empty((bs, *shape), np.uint8)
            perm = np.random.default_rng(1).permutation(n)
            batches = [readers[True].order_batch(perm[i:i + bs]) for i in range(0, n - bs + 1, bs)]
            rates: dict[bool, list[float]] = {True: [], False: []}
            # the same cut with no reader: np.take of whole rows against np.take of their pieces, private memory
            rows = images.reshape(n, -1)
            g = p.view.shape[1] if p is not None else rows.shape[1]
            cells, steps = rows.reshape(-1, g), np.arange(rows.shape[1] // g)
            flat, sorted_rows = out.reshape(bs, -1), [np.sort(perm[i:i + bs]) for i in range(0, n - bs + 1, bs)]
            bare: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(reps):
                for pieces, r in readers.items():
                    t0 = time.perf_counter()
                    for b in batches:
                        with r.plan(b) as plan:
                            r.gather("image", plan, out)
                    rates[pieces].append(len(batches) * bs / (time.perf_counter() - t0))
                for pieces in (True, False):
                    t0 = time.perf_counter()
                    for b in sorted_rows:
                        if pieces:
                            np.take(cells, np.add.outer(b * len(steps), steps), axis=0, mode="clip",
                                    out=flat.reshape(bs, len(steps), g))
                        else:
                            np.take(rows, b, axis=0, out=flat, mode="clip")
                    bare[pieces].append(time.perf_counter() - t0)
            one = statistics.median(rates[True])
            ratio = statistics.median(a / b for a, b in zip(rates[True], rates[False]))
            bare_ratio = statistics.median(b / a for a, b in zip(bare[True], bare[False]))
            print(f"| {'x'.join(map(str, shape))} | {cut} | {len(readers[False]._views['image'])} | {one:,.0f} | "
                  f"{statistics.median(rates[False]):,.0f} | {ratio:.2f} | {bare_ratio:.2f} |")
            for r in readers.values():
                r.close()
            ds.close()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small stores, few repeats (a smoke run)")
    ap.add_argument("--threads", default="1,2", help="gather thread counts, comma-separated (default 1,2)")
    ap.add_argument("--repeats", type=int, default=None, help="passes per contender (default 7, quick 2)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--sides", default="64,256", help="store image sides, comma-separated (64, 224, 227, 256)")
    ap.add_argument("--no-before", action="store_true", help="leave out the views (before) contenders")
    ap.add_argument("--per-thread", action="store_true",
                    help="only the reader's own gather, one thread: one take against the views, per row size")
    args = ap.parse_args(argv)
    if args.per_thread:
        per_thread(args.repeats or (2 if args.quick else 5), args.batch_size, args.quick)
        return
    reps = args.repeats or (2 if args.quick else 7)
    threads = sorted({int(t) for t in args.threads.split(",")} | {1})
    bs = args.batch_size

    import torch

    from precompile.reader import direct, feed
    from precompile.reader.loader import Loader

    print(f"batch {bs}, prefetch 1, {reps} passes each; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the start")
    summary = []
    for side in (int(s) for s in args.sides.split(",")):
        n = SAMPLES[side][1 if args.quick else 0]
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_store(tmp, f"s{side}", images, rng.integers(0, 10, n), samples_per_shard=max(1, n // 8),
                               chunk_samples=min(256, max(1, (2 << 20) // images[0].nbytes)))
            outs = [np.empty((bs, side, side, 3), np.uint8) for _ in range(2)]
            out = outs[0]
            pool = ThreadPoolExecutor(max_workers=max(1, max(threads) - 1))

            def cut(k: int, m: int) -> list[int]:
                return [m * q // k for q in range(k + 1)]

            def take_rows(idx, lo, hi, out):
                np.take(images, idx[lo:hi], axis=0, out=out[lo:hi], mode="clip")

            def copy_rows(idx, lo, hi, out):
                for j in range(lo, hi):
                    out[j] = images[idx[j]]

            def threaded(r, k, fn, sort, bufs=1):
                perm = np.random.default_rng(r).permutation(n)
                for j, i in enumerate(range(0, n, bs)):
                    out = outs[j % bufs]
                    idx = np.sort(perm[i:i + bs]) if sort else perm[i:i + bs]
                    b = cut(k, len(idx))
                    futs = [pool.submit(fn, idx, b[q], b[q + 1], out) for q in range(1, k)]
                    fn(idx, b[0], b[1], out)
                    for f in futs:
                        f.result()
                    yield out[:len(idx)]

            makers = {}
            for t in threads:
                makers[f"native take, {t} thr"] = lambda r, t=t: threaded(r, t, take_rows, True)
            for t in threads:   # a consumer holds batch k while k + 1 is gathered: two buffers at least
                makers[f"native take 2 bufs, {t} thr"] = lambda r, t=t: threaded(r, t, take_rows, True, 2)
            for t in threads:
                makers[f"row copy loop, {t} thr"] = lambda r, t=t: threaded(r, t, copy_rows, False)
            kept = []
            for mem in (False, True):
                hows = [(True, True)] + ([] if args.no_before else [(True, False), (False, True)])
                for pieces, steal in hows:
                    for t in threads:
                        old = direct.PIECE_TAKE
                        direct.PIECE_TAKE = pieces          # read when the reader is made
                        try:
                            loader = Loader(path, batch_size=bs, shuffle="full", seed=0, device="cpu",
                                            fields=["image"], in_memory=mem, num_threads=t, prefetch=1)
                        finally:
                            direct.PIECE_TAKE = old
                        kept.append(loader)
                        how = "views (before)" if not pieces else "one take" if steal else "one take, waits (before)"
                        name = f"{'in_memory' if mem else 'mapped'}, {how}, {t} thr"

                        def ld(r, loader=loader, steal=steal):
                            loader.set_epoch(r)
                            feed.STEAL_PARTS = steal     # read per task: set for this pass only
                            try:
                                yield from loader
                            finally:
                                feed.STEAL_PARTS = True
                        makers[name] = ld
            rows: dict[str, list[float]] = {name: [] for name in makers}
            for r in range(reps):  # contenders take turns, so load from other jobs spreads over all of them
                for name, make in makers.items():
                    rows[name].append(one_pass(make(r), n))
            pool.shutdown()
            for loader in kept:
                loader.close()
            lim = statistics.median(rows["native take, 1 thr"])
            store = f"{side}x{side}x3, {n} samples"
            print()
            print(f"{store}; load average {os.getloadavg()[0]:.1f} after it")
            print()
            print(f"| {'contender':<36} | {'samples/s':>10} | {'GB/s':>5} | {'x 1 thread':>10} | "
                  f"{'x native 1 thr':>14} |")
            print(f"|{'-' * 38}|{'-' * 12}|{'-' * 7}|{'-' * 12}|{'-' * 16}|")
            ups: dict[str, dict[int, float]] = {}
            for name, v in rows.items():
                base_name, t = name.rsplit(", ", 1)
                t = int(t.split()[0])
                one = rows[f"{base_name}, 1 thr"]
                up = statistics.median(a / b for a, b in zip(v, one))    # paired: the same turn
                ups.setdefault(base_name, {})[t] = up
                m = statistics.median(v)
                print(f"| {name:<36} | {m:>10,.0f} | {m * images[0].nbytes / 1e9:>5.2f} | {up:>10.2f} | "
                      f"{m / lim:>14.2f} |")
            for t in threads[1:]:
                nat, nat2 = ups["native take"][t], ups["native take 2 bufs"][t]
                parts = [f"native take {nat:.2f}x (2 bufs {nat2:.2f}x)", f"row copy loop {ups['row copy loop'][t]:.2f}x"]
                for base_name in ups:
                    if base_name.startswith(("mapped", "in_memory")):
                        up = ups[base_name][t]
                        parts.append(f"{base_name} {up:.2f}x (**{up / nat:.2f}** of native, {up / nat2:.2f} of "
                                     f"2 bufs)")
                summary.append(f"- {store}, {t} threads over 1: " + "; ".join(parts))
    print()
    print("Speed-up with more threads (the Loader's against the native take's; issue 33's goal on 2 cores: >= 0.9):")
    for line in summary:
        print(line)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
