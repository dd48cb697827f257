"""precompile.Mix against one Loader over the same bytes (issue 35).

The same ``--samples`` 32x32x3 uint8 samples (default 20,000: 59 MiB) are written, through the project's
HDF5 writer, once as one build and once cut in two builds of half each. Contenders, measured in this run,
warm page cache, batches of ``--batch`` (default 256), full shuffle, CPU, ``--threads`` gather threads each:

- ``Loader``: one build (the baseline);
- ``Mix, 1 source``: the same build alone (what the mixing machinery costs over the Loader's sampler);
- ``Mix, 2 sources``: the two halves, weights proportional to their sizes (``stop="first_exhausted"``:
  every sample once per epoch), so an epoch reads the same samples as the baseline's.

Each contender runs whole epochs (a fresh epoch per repeat; the contenders take turns, one epoch each per
repeat, so a load that drifts falls on all of them alike); the table gives the median samples/s over
``--repeats`` and the ratio to the Loader's, and the same per CPU-second of this process (all its threads:
``time.process_time``), which other jobs on a shared machine move less than the wall time.

    PYTHONPATH=. python benchmarks/bench_mix.py [--samples 20000] [--batch 256] [--threads 1] [--repeats 5]

``--size S``: S x S x 3 samples instead of 32 x 32 x 3 (e.g. ``--size 224 --samples 2048``).
``--before PATH``: also the Mix of another checkout's ``precompile/reader/mix.py`` (e.g.
``../main/precompile/reader/mix.py``, the code before a change), loaded as a module of this
checkout's ``precompile.reader`` package (its feed, gather and conversion: only the Mix differs), as
contenders ``Mix before, 1 source`` and ``Mix before, 2 sources`` in the same turns.

``--convert``: every contender also converts the images (``dtype="float32"``, ImageNet ``mean``/``std``, the
Loader's conversion, which a Mix runs through the same code); ``--steps``: and runs ``gpu_steps`` (a random
flip and a random crop to 28 with padding 2) on the CPU. Either way the comparison stays converted Mix
against converted Loader, in the same run.

``--passes K`` measures instead what a Mix made afresh (a resumed run) pays to remake a build's passes before
its epoch (a pass depends on the one before back to the last that follows from the seeded permutations
alone: ``Mix._pass``): a build of ``--rows`` (default 1,000,000) read ``--per-epoch`` rows per epoch
(default 30% + 1), pass K made from scratch against every pass made in order from pass 0 (the baseline, as
a Mix did before) and the next pass made from the cache (medians of ``--repeats``).

    PYTHONPATH=. python benchmarks/bench_mix.py --passes 100 [--rows 1000000] [--per-epoch 999999]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import median_time  # noqa: E402

from bench_loader import write_store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--passes", type=int, default=0)
    ap.add_argument("--per-epoch", type=int, default=0)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--convert", action="store_true", help="dtype float32 + mean/std for every contender")
    ap.add_argument("--steps", action="store_true", help="gpu_steps (flip, crop) for every contender")
    ap.add_argument("--size", type=int, default=32, help="samples of size x size x 3 uint8")
    ap.add_argument("--before", default=None, help="another checkout's precompile/reader/mix.py, as contenders too")
    a = ap.parse_args()
    if a.passes:
        passes(a)
        return

    import torch

    import precompile

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (a.samples, a.size, a.size, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, a.samples)
    half = a.samples // 2
    with tempfile.TemporaryDirectory() as tmp:
        whole = write_store(tmp, "whole", images, labels, samples_per_shard=4096)
        left = write_store(tmp, "left", images[:half], labels[:half], samples_per_shard=4096)
        right = write_store(tmp, "right", images[half:], labels[half:], samples_per_shard=4096)
        common: dict = dict(batch_size=a.batch, seed=0, device="cpu", num_threads=a.threads)
        if a.convert:
            common.update(dtype="float32", mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        if a.steps:
            common.update(gpu_steps=[{"random_flip": {"horizontal": 0.5}},
                                     {"random_crop": {"size": 28, "padding": 2}}])
        readers = {
            "Loader": precompile.Loader(whole, shuffle=True, **common),
            "Mix, 1 source": precompile.Mix([whole], **common),
            "Mix, 2 sources": precompile.Mix([left, right], **common),
        }
        if a.before:
            old = load_mix(a.before)
            readers["Mix before, 1 source"] = old.Mix([whole], **common)
            readers["Mix before, 2 sources"] = old.Mix([left, right], **common)
        epoch = {name: 0 for name in readers}

        def run(name: str) -> None:
            r = readers[name]
            r.set_epoch(epoch[name])
            epoch[name] += 1
            n = 0
            for b in r:
                n += len(b["label"])
            assert n == a.samples, (name, n)

        for name in readers:   # warm the page cache and the maps
            run(name)
        # round robin: each repeat times every contender once, so a load that drifts (a shared machine) falls
        # on all of them alike
        per: dict[str, list[float]] = {name: [] for name in readers}
        cpu: dict[str, list[float]] = {name: [] for name in readers}
        for _ in range(a.repeats):
            for name in readers:
                c0 = time.process_time()
                per[name].append(median_time(lambda name=name: run(name), 1))
                cpu[name].append(time.process_time() - c0)
        times = {name: statistics.median(ts) for name, ts in per.items()}
        cpus = {name: statistics.median(ts) for name, ts in cpu.items()}
        base = a.samples / times["Loader"]
        base_cpu = a.samples / cpus["Loader"]
        what = ", ".join(w for w, on in (("converted to float32 + mean/std", a.convert),
                                          ("gpu_steps flip + crop", a.steps)) if on) or "raw uint8"
        print(f"{a.samples} samples of {a.size}x{a.size}x3 uint8 ({what}), batches of {a.batch}, full shuffle, CPU, "
              f"{a.threads} gather thread(s), torch threads {torch.get_num_threads()}, "
              f"median of {a.repeats} epochs")
        print(f"{'reader':<22} {'samples/s':>12} {'vs Loader':>10} {'per CPU-s':>12} {'vs Loader':>10}")
        for name, t in times.items():
            rate, rate_cpu = a.samples / t, a.samples / cpus[name]
            print(f"{name:<22} {rate:>12,.0f} {rate / base:>9.2f}x {rate_cpu:>12,.0f} {rate_cpu / base_cpu:>9.2f}x")
        for r in readers.values():
            r.close()


def load_mix(path: str):
    """``path`` (a ``mix.py``) as a module of this checkout's ``precompile.reader`` package: its relative imports
    (feed, gather, conversion) are this checkout's, so only the Mix's own code differs."""
    import importlib.util

    import precompile.reader

    spec = importlib.util.spec_from_file_location("precompile.reader._mix_before", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = precompile.reader.__name__
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def passes(a: argparse.Namespace) -> None:
    from precompile.reader.mix import Mix

    per_epoch = a.per_epoch or int(a.rows * 0.3) + 1

    def fresh() -> Mix:   # the pass logic alone: no builds needed
        m = Mix.__new__(Mix)
        m.sizes, m.counts, m.seed, m.shuffle, m._pass_cache = [a.rows], [per_epoch], 0, True, {}
        return m

    def scratch() -> None:
        fresh()._pass(0, a.passes)

    def in_order() -> None:   # the baseline: every pass made from pass 0, as a Mix did before
        m = fresh()
        for q in range(a.passes + 1):
            m._pass(0, q)

    warm = fresh()
    warm._pass(0, a.passes)
    k = [a.passes]

    def following() -> None:
        k[0] += 1
        warm._pass(0, k[0])

    t_scratch, t_next = median_time(scratch, a.repeats), median_time(following, a.repeats)
    t_order = median_time(in_order, a.repeats)
    chain = a.passes - Mix._start_of_chain(a.rows, per_epoch, a.passes) + 1
    print(f"a build of {a.rows:,} rows, {per_epoch:,} per epoch; median of {a.repeats}")
    print(f"pass {a.passes} from scratch: {t_scratch:.3f} s ({chain} passes made); every pass from 0 (the "
          f"baseline): {t_order:.3f} s ({t_order / t_scratch:.1f}x); the next pass from the cache: "
          f"{1e3 * t_next:.1f} ms")


if __name__ == "__main__":
    main()
