"""Gather threads with one batch in flight: a task's rows split across threads (RowSplitter) against one thread.

With ``prefetch=1`` only one gather task is in flight, so before the split a second thread had nothing to do.
Contenders, all on the same store and the same shuffled batches (warm page cache), CPU device, uint8 out:

- ``np.take(..., out=, mode="clip")`` (the limit; ``mode="raise"`` would buffer ``out``): the whole set in private memory, each batch's rows sorted,
  gathered into one preallocated buffer (1 thread);
- ``Loader`` with ``prefetch=1``, mapped files (default) and ``in_memory=True``, at 1 and 2 (and more,
  ``--threads``) gather threads; the same with the split switched off (``SPLIT_BYTES`` huge), to show what the
  split itself adds;
- a bare row copy loop (``out[j] = images[idx[j]]`` over the batch's shuffled rows, from private memory, cut
  into ranges copied by 1 and 2 (``--threads``) Python threads, as the split does): what threads can add to a
  gather of scattered rows on this machine, with no reader in the way. (A contiguous ``np.copyto`` of 256 MiB
  in two halves scales by 1.56x on the 2-core machine; scattered 192 KiB rows by much less.)

The table gives the median samples/s over ``--repeats`` passes, the ratio to the same path with 1 thread and to
the limit. 64x64x3 (12 KiB) and 256x256x3 (192 KiB) samples, batches of 256.

    PYTHONPATH=. python benchmarks/bench_threads.py [--quick] [--threads 1,2] [--repeats R]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loader import timed_passes, write_store  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small stores, few repeats (a smoke run)")
    ap.add_argument("--threads", default="1,2", help="gather thread counts, comma-separated (default 1,2)")
    ap.add_argument("--repeats", type=int, default=None, help="passes per contender (default 5, quick 2)")
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)
    reps = args.repeats or (2 if args.quick else 5)
    threads = [int(t) for t in args.threads.split(",")]
    bs = args.batch_size

    import torch

    from precompile.reader import feed
    from precompile.reader.loader import Loader

    print(f"batch {bs}, prefetch 1, {reps} passes each; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    print()
    print(f"| {'store':<22} | {'contender':<34} | {'samples/s':>10} | {'x 1 thread':>10} | {'x limit':>7} |")
    print(f"|{'-' * 24}|{'-' * 36}|{'-' * 12}|{'-' * 12}|{'-' * 9}|")
    for side, n in ((64, 4096 if args.quick else 32768), (256, 512 if args.quick else 4096)):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_store(tmp, f"s{side}", images, rng.integers(0, 10, n), samples_per_shard=max(1, n // 8),
                               chunk_samples=min(256, max(1, (2 << 20) // images[0].nbytes)))
            out = np.empty((bs, side, side, 3), np.uint8)

            def limit(r):
                perm = np.random.default_rng(r).permutation(n)
                for i in range(0, n, bs):
                    idx = np.sort(perm[i:i + bs])
                    yield np.take(images, idx, axis=0, out=out[:len(idx)], mode="clip")  # "raise" buffers out

            rows: dict[str, list[float]] = {"np.take sorted, out= (limit)": []}
            makers = {"np.take sorted, out= (limit)": (limit, None)}
            pool = ThreadPoolExecutor(max_workers=max(1, max(threads) - 1))

            def copy_rows(idx, lo, hi):
                for j in range(lo, hi):
                    out[j] = images[idx[j]]

            def row_copy(r, k):
                perm = np.random.default_rng(r).permutation(n)
                for i in range(0, n, bs):
                    idx = perm[i:i + bs]
                    b = [len(idx) * q // k for q in range(k + 1)]
                    futs = [pool.submit(copy_rows, idx, b[q], b[q + 1]) for q in range(1, k)]
                    copy_rows(idx, b[0], b[1])
                    for f in futs:
                        f.result()
                    yield out[:len(idx)]

            for t in threads:
                rows[f"row copy loop, {t} thr"] = []
                makers[f"row copy loop, {t} thr"] = (lambda r, t=t: row_copy(r, t), None)
            for mem in (False, True):
                for t in threads:
                    for split in ((True, False) if t > 1 else (True,)):
                        loader = Loader(path, batch_size=bs, shuffle="full", seed=0, device="cpu", fields=["image"],
                                        in_memory=mem, num_threads=t, prefetch=1)
                        name = f"{'in_memory' if mem else 'mapped'}, {t} thr{'' if split else ', no split'}"
                        rows[name] = []

                        def ld(r, loader=loader):
                            loader.set_epoch(r)
                            return loader
                        makers[name] = (ld, split)
            for r in range(reps):  # contenders take turns, so load from other jobs spreads over all of them
                for name, (make, split) in makers.items():
                    old = feed.SPLIT_BYTES
                    if split is False:
                        feed.SPLIT_BYTES = 1 << 60
                    try:
                        rows[name].extend(timed_passes(lambda _r, make=make, r=r: make(r), n, 1))
                    finally:
                        feed.SPLIT_BYTES = old
            lim = statistics.median(rows["np.take sorted, out= (limit)"])
            pool.shutdown()
            one = {m: statistics.median(rows[f"{m}, 1 thr"]) for m in ("mapped", "in_memory", "row copy loop")
                   if 1 in threads}
            store = f"{side}x{side}x3, {n} samples"
            for name, v in rows.items():
                m = statistics.median(v)
                base = one.get(name.split(",")[0])
                rel = f"{m / base:.2f}" if base and "limit" not in name else "-"
                print(f"| {store:<22} | {name:<34} | {m:>10,.0f} | {rel:>10} | {m / lim:>7.2f} |")
    print()


if __name__ == "__main__":
    main()
