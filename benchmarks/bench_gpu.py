"""The Loader feeding a GPU: bandwidth against a plain pinned copy (a thread x prefetch sweep and the GPU-resident
mode), and the data-wait share under ResNet-18 and ResNet-50.

Without CUDA it says so and stops (exit 0), unless ``--quick``: a CPU smoke run of every part on a small
store (the resident mode through its CPU test hook), to check the script before an unattended GPU run.
On a GPU node the defaults run in about 5 minutes (H100-class).

1. Bandwidth. A store of ``--size`` x ``--size`` x 3 uint8 samples (``--samples``, default 4,096 of 224: 588
   MiB) written through the project's HDF5 writer (256 samples per shard, page cache warm), batches of
   ``--batch-size``, full shuffle, uint8 delivered, medians of ``--repeats`` passes, contenders taking turns:

   - ``pinned .to(cuda, non_blocking=True)`` (the limit): one pinned batch copied ``samples / batch`` times;
     beside it the same from a ring of pinned batches as large as the set (at most 64), which the host's caches
     cannot hold: a fairer bar for gathers that read the whole set;
   - ``Loader`` from mapped files and with ``in_memory=True``, for every ``--threads`` x ``--prefetch`` pair;
   - ``Loader(in_memory="gpu")``: the set uploaded once, every batch gathered on the GPU (its ``x limit``
     can pass 1: no bus per batch);
   - ``Loader(in_memory="pinned")`` (CUDA only): the set copied once into page-locked host memory that the GPU
     reads itself, every batch gathered there by the GPU over the bus (no gather thread, no staging copy).

2. Training. ResNet-18 and ResNet-50 (plain ``torch.nn``, no torchvision), channels_last, bf16 autocast,
   SGD, on the Loader's batches (uint8 -> float16 normalised on the device, NCHW view, a ``random_flip``
   gpu step): images/s, the share of wall time spent waiting in ``next(loader)``, and the same steps on
   one batch kept on the device (the compute bound), so ``x bound`` is what the data path costs. A light
   model is where the data path shows.

3. The contender users have: ``--jpegs`` photo-like 500x375 JPEGs (default 4,096) read by a ``DataLoader``
   (``cpu_count - 1`` workers, pinned, ``non_blocking`` copies) through torchvision's ``RandomResizedCrop(size)``,
   ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize``, trained the same way; where torchvision is absent
   (this project does not depend on it) the same four transforms written by hand with PIL, and the row says so.

    PYTHONPATH=. python benchmarks/bench_gpu.py [--samples 4096] [--size 224] [--threads 1,2,4,8]
        [--prefetch 1,2,4,8] [--repeats 3] [--steps 60] [--batch-size 256] [--jpegs 4096] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)   # ImageNet's, for every contender


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1):
    import torch.nn as nn

    return [nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)]


def resnet(depth: int, num_classes: int = 1000):
    """ResNet-18 (basic blocks [2, 2, 2, 2]) or ResNet-50 (v1.5 bottlenecks [3, 4, 6, 3]) from plain torch.nn."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin: int, width: int, stride: int, bottleneck: bool):
            super().__init__()
            cout = width * 4 if bottleneck else width
            if bottleneck:
                body = [*_conv_bn(cin, width, 1), nn.ReLU(inplace=True), *_conv_bn(width, width, 3, stride),
                        nn.ReLU(inplace=True), *_conv_bn(width, cout, 1)]
            else:
                body = [*_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3)]
            self.body = nn.Sequential(*body)
            self.skip = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()
            self.relu, self.cout = nn.ReLU(inplace=True), cout

        def forward(self, x):
            return self.relu(self.body(x) + self.skip(x))

    plan = {18: ((2, 2, 2, 2), False), 50: ((3, 4, 6, 3), True)}[depth]
    layers, cin = [], 64
    for width, blocks, stride in zip((64, 128, 256, 512), plan[0], (1, 2, 2, 2)):
        for b in range(blocks):
            layers.append(Block(cin, width, stride if b == 0 else 1, plan[1]))
            cin = layers[-1].cout
    return nn.Sequential(*_conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))


def sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_loader(index: str, dev: Any, mode: str, **kw: Any):
    """A Loader on ``dev`` reading from ``mode``: mapped, in_memory or gpu (on CPU: the resident test hook)."""
    from precompile.reader.loader import Loader
    from precompile.reader.resident import ResidentFeeder

    if mode == "gpu" and dev.type != "cuda":
        loader = Loader(index, device="cpu", **kw)
        loader.feeder = ResidentFeeder.for_loader(loader, dev)
        return loader
    return Loader(index, device=str(dev), in_memory={"mapped": False, "in_memory": True, "gpu": "gpu",
                                                     "pinned": "pinned"}[mode], **kw)


def timed_pass(loader: Any, epoch: int, dev: Any) -> tuple[float, int]:
    loader.set_epoch(epoch)
    sync(dev)
    t0, seen = time.perf_counter(), 0
    for b in loader:
        seen += b["image"].shape[0]
    sync(dev)
    return time.perf_counter() - t0, seen


def bandwidth(index: str, dev: Any, args: argparse.Namespace, row: int) -> None:
    """Part 1: the sweep, printed as a table of GB/s, samples/s and the ratio to the pinned copy."""
    import torch

    bs, nb = args.batch_size, args.samples // args.batch_size
    host = torch.empty((bs, row), dtype=torch.uint8)
    host = host.pin_memory() if dev.type == "cuda" else host
    # the same copy from a ring of pinned batches with as many bytes as the set (at most 64 batches): no batch is
    # copied twice in a row, so the host's caches cannot serve the DMA (the one-buffer row may be served from them)
    ring = [torch.full((bs, row), i % 251, dtype=torch.uint8) for i in range(max(2, min(nb, 64)))]
    ring = [b.pin_memory() for b in ring] if dev.type == "cuda" else ring
    kw = dict(batch_size=bs, shuffle=True, fields=["image"], drop_last=True)
    loaders = {f"Loader {m}, {t} threads, prefetch {p}":
               make_loader(args.index, dev, m, num_threads=t, prefetch=p, **kw)
               for m in ("mapped", "in_memory") for t in args.threads for p in args.prefetch}
    loaders["Loader in_memory='gpu' (resident)"] = make_loader(args.index, dev, "gpu", **kw)
    if dev.type == "cuda":
        loaders["Loader in_memory='pinned' (device reads host memory)"] = make_loader(args.index, dev, "pinned", **kw)
    ringed = f"pinned copy from a ring of {len(ring)} batches"
    rows: dict[str, list[float]] = {"pinned copy (limit)": [], ringed: [], **{k: [] for k in loaders}}
    for r in range(args.repeats):   # contenders take turns pass by pass
        for name, source in (("pinned copy (limit)", lambda i: host), (ringed, lambda i: ring[i % len(ring)])):
            sync(dev)
            t0 = time.perf_counter()
            for i in range(nb):
                b = source(i)
                x = b.to(dev, non_blocking=True) if dev.type == "cuda" else b.clone()
            sync(dev)
            rows[name].append(nb * bs * row / (time.perf_counter() - t0))
            del x
        for k, loader in loaders.items():
            s, seen = timed_pass(loader, r, dev)
            rows[k].append(seen * row / s)
    lim = statistics.median(rows["pinned copy (limit)"])
    print(f"\n| host -> {dev.type}, batches of {bs} | GB/s | samples/s | x limit |\n|---|---:|---:|---:|")
    for k, v in rows.items():
        m = statistics.median(v)
        print(f"| {k} | {m / 1e9:.2f} | {m / row:,.0f} | {m / lim:.2f} |")
    for loader in loaders.values():
        loader.close()


def train_rate(step: Callable, next_batch: Callable, steps: int, dev: Any, warmup: int) -> tuple[float, float]:
    """Steps per second over ``steps`` steps after ``warmup`` steps, and the share spent in ``next_batch``."""
    for _ in range(warmup):
        step(*next_batch())
    sync(dev)
    waited, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        tw = time.perf_counter()
        b = next_batch()
        waited += time.perf_counter() - tw
        step(*b)
    sync(dev)
    wall = time.perf_counter() - t0
    return steps / wall, waited / wall


def endless(loader: Any):
    e = 0
    while True:
        loader.set_epoch(e)
        for b in loader:
            yield b["image"], b["label"]
        e += 1


def training(index: str, dev: Any, args: argparse.Namespace) -> None:
    """Part 2: ResNet-18 and ResNet-50 on the Loader's batches from each source, against a kept batch."""
    import torch

    torch.backends.cudnn.benchmark = True
    bs, s = args.batch_size, args.size
    kw = dict(batch_size=bs, shuffle=True, dtype="float16", mean=list(MEAN), std=list(STD),
              channels_first=True, drop_last=True, gpu_steps=[{"random_flip": {}}])
    jpegs = None
    if args.jpegs:
        from benchmarks.bench_scale import make_photos

        jpegs = os.path.join(args.work, f"jpegs-{args.jpegs}")
        t0 = time.perf_counter()
        make_photos(jpegs, args.jpegs)
        print(f"\n{args.jpegs} photo-like 500x375 JPEGs written in {time.perf_counter() - t0:.1f} s")
    print(f"\nbf16 autocast, channels_last, batch {bs}, {args.steps} steps, {s}x{s} images on {dev}")
    print("| model | contender | images/s | x bound | data wait share |\n|---|---|---:|---:|---:|")
    for depth in (18, 50):
        model = resnet(depth).to(dev, memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-5)
        lossf = torch.nn.CrossEntropyLoss()

        def step(x, y):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = lossf(model(x.contiguous(memory_format=torch.channels_last)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        fixed = (torch.randn(bs, 3, s, s, device=dev, dtype=torch.float16), torch.randint(0, 1000, (bs,), device=dev))
        bound = train_rate(step, lambda: fixed, args.steps, dev, args.warmup)[0] * bs
        print(f"| ResNet-{depth} | one batch kept on the device (bound) | {bound:,.0f} | 1.00 | - |")
        for mode in ("mapped", "in_memory", "gpu") + (("pinned",) if dev.type == "cuda" else ()):
            loader = make_loader(index, dev, mode, **kw)
            it = endless(loader)
            rate, share = train_rate(step, lambda: next(it), args.steps, dev, args.warmup)
            it.close()
            loader.close()
            ips = rate * bs
            print(f"| ResNet-{depth} | Loader {mode} | {ips:,.0f} | {ips / bound:.2f} | {100 * share:.1f}% |", flush=True)
        if jpegs:
            try:
                next_batch, close, what = jpeg_batches(jpegs, dev, args)
                rate, share = train_rate(step, next_batch, args.steps, dev, args.warmup)
                close()
                ips = rate * bs
                print(f"| ResNet-{depth} | {what} | {ips:,.0f} | {ips / bound:.2f} | {100 * share:.1f}% |", flush=True)
            except Exception as e:   # the contender's failure must not cost the rest of an unattended GPU run
                print(f"| ResNet-{depth} | JPEG pipeline failed: {type(e).__name__}: {e} | - | - | - |", flush=True)


def jpeg_transform(size: int) -> tuple[Callable, str]:
    """torchvision's ImageNet training transform, or the same four steps by hand where torchvision is absent."""
    try:
        import torchvision.transforms as T

        return (T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]),
                "torchvision RandomResizedCrop + flip + ToTensor + Normalize")
    except ImportError:
        pass
    import math
    import random

    import torch
    from PIL import Image

    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)

    def by_hand(img: Any) -> Any:
        w, h = img.size   # RandomResizedCrop(scale=(0.08, 1), ratio=(3/4, 4/3)), as torchvision draws it
        for _ in range(10):
            area = w * h * random.uniform(0.08, 1.0)
            ar = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(area * ar))), int(round(math.sqrt(area / ar)))
            if 0 < cw <= w and 0 < ch <= h:
                x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
                break
        else:   # torchvision's fallback: the centre crop of the whole image, its ratio clamped to [3/4, 4/3]
            if w / h < 3 / 4:
                cw, ch = w, int(round(w / (3 / 4)))
            elif w / h > 4 / 3:
                ch, cw = h, int(round(h * (4 / 3)))
            else:
                cw, ch = w, h
            x0, y0 = (w - cw) // 2, (h - ch) // 2
        img = img.resize((size, size), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)
        return (t.float().div_(255) - mean) / std

    return by_hand, "hand-written RandomResizedCrop + flip + ToTensor + Normalize (no torchvision here)"


class JpegFolder:
    """A list of (path, label) read as PIL RGB images through ``transform``: an ImageFolder without torchvision."""

    def __init__(self, root: str, transform: Callable):
        self.items = [(os.path.join(root, c, f), int(c[1:])) for c in sorted(os.listdir(root)) if c.startswith("c")
                      for f in sorted(os.listdir(os.path.join(root, c)))]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as im:
            return self.transform(im.convert("RGB")), label


def jpeg_batches(root: str, dev: Any, args: argparse.Namespace) -> tuple[Callable, Callable, str]:
    """An endless source of (images, labels) on ``dev`` from the JPEG pipeline, a closer, and its name."""
    import torch
    from torch.utils.data import DataLoader

    # workers pass one collated tensor per batch; file_system sharing avoids the fd passing that hung once
    torch.multiprocessing.set_sharing_strategy("file_system")
    transform, what = jpeg_transform(args.size)
    workers = max(1, (os.cpu_count() or 2) - 1)
    dl = DataLoader(JpegFolder(root, transform), batch_size=args.batch_size, shuffle=True, drop_last=True,
                    num_workers=workers, pin_memory=dev.type == "cuda", persistent_workers=True, prefetch_factor=4)

    def gen():
        while True:
            for x, y in dl:
                yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    it = gen()
    pinned = "pinned" if dev.type == "cuda" else "no pinning on CPU"

    def close() -> None:   # persistent workers outlive the generator: stop them before the next model's rows
        it.close()
        if getattr(dl, "_iterator", None) is not None:
            dl._iterator._shutdown_workers()
            dl._iterator = None

    return (lambda: next(it)), close, f"DataLoader, {workers} workers, {pinned}: {what}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small store and few steps; on CPU when CUDA is absent")
    ap.add_argument("--samples", type=int, default=None, help="default 4096 (quick 256)")
    ap.add_argument("--size", type=int, default=None, help="image side, default 224 (quick 32)")
    ap.add_argument("--threads", default=None, help="gather threads to sweep, default 1,2,4,8 (quick 1,2)")
    ap.add_argument("--prefetch", default=None, help="prefetch values to sweep, default 1,2,4,8 (quick 1,2)")
    ap.add_argument("--repeats", type=int, default=None, help="passes per contender, default 3 (quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="training steps measured, default 60 (quick 1)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 256 (quick 16)")
    ap.add_argument("--jpegs", type=int, default=None, help="JPEGs for the torchvision-style contender, default "
                    "4096 (quick 64); 0 leaves it out")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    q = a.quick
    a.samples = a.samples or (256 if q else 4096)
    a.size = a.size or (32 if q else 224)
    a.threads = [int(x) for x in (a.threads or ("1,2" if q else "1,2,4,8")).split(",")]
    a.prefetch = [int(x) for x in (a.prefetch or ("1,2" if q else "1,2,4,8")).split(",")]
    a.repeats, a.steps, a.warmup = a.repeats or (1 if q else 3), a.steps or (1 if q else 60), 1 if q else 5
    a.batch_size = a.batch_size or (16 if q else 256)
    a.jpegs = (64 if q else 4096) if a.jpegs is None else a.jpegs
    if 0 < a.jpegs < a.batch_size:   # drop_last would leave no batch, and the endless source would spin forever
        ap.error(f"--jpegs {a.jpegs} is less than one batch ({a.batch_size}); give at least that many, or 0")
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available() and not args.quick:
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); skipped (--quick: a CPU smoke run)")
        return
    from benchmarks.bench_loader import write_store

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    n, s = args.samples, args.size
    row = s * s * 3
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke run)"
    print(f"{name}; torch {torch.__version__}; {os.cpu_count()} cpus; {n} x {s}x{s}x3 uint8 "
          f"({n * row / 2**20:.0f} MiB), batch {args.batch_size}")
    rng = np.random.default_rng(0)
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    args.work = tmp.name
    args.index = write_store(tmp.name, "gpu", rng.integers(0, 256, (n, s, s, 3), dtype=np.uint8),
                             rng.integers(0, 1000, n), samples_per_shard=256, chunk_samples=8)
    for fname in sorted(os.listdir(os.path.join(tmp.name, "gpu.shards"))):   # warm the page cache
        with open(os.path.join(tmp.name, "gpu.shards", fname), "rb") as f:
            while f.read(1 << 24):
                pass
    bandwidth(args.index, dev, args, row)
    training(args.index, dev, args)
    tmp.cleanup()


if __name__ == "__main__":
    main()
