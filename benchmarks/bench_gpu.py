"""The Loader on CUDA: host-to-device bandwidth against a plain pinned copy, and the data-wait share under a ResNet-50.

Skips cleanly (exit 0, one line) when torch has no CUDA device.

1. Bandwidth. A store of 224x224x3 uint8 samples (``--samples``, default 4,096 =
   588 MiB) written through the project's HDF5 writer (256 samples per shard,
   page cache warm). Contenders, batches of 256 (37 MiB), medians of
   ``--repeats`` passes, all in this run:

   - ``pinned .to(cuda, non_blocking=True)`` (the limit): one pinned host
     tensor of a batch's bytes, copied ``samples / 256`` times, synchronised
     at the end: what the bus gives a plain copy.
   - ``Loader`` on ``cuda`` (uint8 delivered, full shuffle): mapped files and
     ``in_memory=True``, default threads. Its figure includes the CPU gather
     into the pinned ring; the copies run on the Loader's side stream.

2. Training. A ResNet-50-sized network (bottleneck blocks [3, 4, 6, 3],
   25.6 M parameters, written with plain ``torch.nn``; no torchvision),
   channels_last, bf16 autocast, SGD, on batches of ``--batch-size`` 224x224
   images that the Loader converts on the GPU (uint8 -> float16, normalised,
   NCHW view). Reported: images/s, the Loader's own wait share
   (``loader.stats``), and the same steps on one batch kept on the GPU (the
   compute bound), so ``x bound`` is the data pipeline's cost.

    PYTHONPATH=. python benchmarks/bench_gpu.py [--samples 4096] [--repeats 5] [--steps 60] [--batch-size 256]
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


def resnet50(num_classes: int = 1000):
    """ResNet-50 (v1.5: stride on the 3x3 conv) from plain torch.nn."""
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.body(x) + self.skip(x))

    layers, cin = [], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(cin, num_classes))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="training steps measured (after 10 warm-up steps)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); skipped")
        return

    from benchmarks.bench_loader import write_store
    from precompile.reader.loader import Loader

    n, bs, reps = args.samples, args.batch_size, args.repeats
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {os.cpu_count()} cpus; "
          f"{n} x 224x224x3 uint8 ({n * 150528 / 2**20:.0f} MiB), batch {bs}")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)
    labels = rng.integers(0, 1000, n)
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    index = write_store(tmp.name, "gpu224", images, labels, samples_per_shard=256, chunk_samples=8)
    del images
    for name in sorted(os.listdir(os.path.join(tmp.name, "gpu224.shards"))):  # warm the page cache
        with open(os.path.join(tmp.name, "gpu224.shards", name), "rb") as f:
            while f.read(1 << 24):
                pass
    batch_bytes = bs * 150528
    nbatches = n // bs

    # -- 1. bandwidth -------------------------------------------------------------------------------
    rows: dict[str, list[float]] = {"pinned .to(cuda, non_blocking=True) (limit)": []}
    host = torch.empty((bs, 224, 224, 3), dtype=torch.uint8).pin_memory()
    host.numpy()[:] = 7
    loaders = {"Loader cuda uint8, mapped files": Loader(index, batch_size=bs, shuffle=True, device="cuda",
                                                        fields=["image"], drop_last=True),
               "Loader cuda uint8, in_memory=True": Loader(index, batch_size=bs, shuffle=True, device="cuda",
                                                          fields=["image"], drop_last=True, in_memory=True)}
    for k in loaders:
        rows[k] = []
    for r in range(reps):  # contenders take turns pass by pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(nbatches):
            x = host.to(dev, non_blocking=True)
        torch.cuda.synchronize()
        rows["pinned .to(cuda, non_blocking=True) (limit)"].append(nbatches * batch_bytes / (time.perf_counter() - t0))
        del x
        for k, loader in loaders.items():
            loader.set_epoch(r)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            seen = 0
            for b in loader:
                seen += b["image"].shape[0]
            torch.cuda.synchronize()
            rows[k].append(seen * 150528 / (time.perf_counter() - t0))
    lim = statistics.median(rows["pinned .to(cuda, non_blocking=True) (limit)"])
    print()
    print(f"| {'host -> device, batches of %d' % bs:<44} | {'GB/s (median)':>13} | {'samples/s':>10} | {'x limit':>7} |")
    print(f"|{'-' * 46}|{'-' * 15}|{'-' * 12}|{'-' * 9}|")
    for k, v in rows.items():
        m = statistics.median(v)
        print(f"| {k:<44} | {m / 1e9:>13.2f} | {m / 150528:>10,.0f} | {m / lim:>7.2f} |")
    for loader in loaders.values():
        loader.close()

    # -- 2. training ---------------------------------------------------------------------------------
    torch.backends.cudnn.benchmark = True
    model = resnet50().to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-5)
    lossf = torch.nn.CrossEntropyLoss()
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    results = {}
    for mem in (False, True):
        loader = Loader(index, batch_size=bs, shuffle=True, device="cuda", dtype="float16", mean=mean, std=std,
                        channels_first=True, drop_last=True, in_memory=mem)

        def batches():
            e = 0
            while True:
                loader.set_epoch(e)
                yield from loader
                e += 1
        it = batches()
        for _ in range(10):
            b = next(it)
            step(b["image"], b["label"])
        torch.cuda.synchronize()
        waited, t0 = 0.0, time.perf_counter()
        for _ in range(args.steps):
            tw = time.perf_counter()
            b = next(it)
            waited += time.perf_counter() - tw
            step(b["image"], b["label"])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        results[f"Loader ({'in_memory' if mem else 'mapped files'})"] = (args.steps * bs / wall, waited / wall)
        it.close()
        loader.close()
    fixed_x = torch.randn(bs, 3, 224, 224, device=dev, dtype=torch.float16)
    fixed_y = torch.randint(0, 1000, (bs,), device=dev)
    for _ in range(10):
        step(fixed_x, fixed_y)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(fixed_x, fixed_y)
    torch.cuda.synchronize()
    bound = args.steps * bs / (time.perf_counter() - t0)
    print()
    print(f"ResNet-50 (25.6 M parameters), bf16 autocast, channels_last, batch {bs}, {args.steps} steps")
    print(f"| {'contender':<34} | {'images/s':>9} | {'x bound':>7} | {'data wait share':>15} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 9}|{'-' * 17}|")
    print(f"| {'one batch kept on the GPU (bound)':<34} | {bound:>9,.0f} | {1.0:>7.2f} | {'-':>15} |")
    for k, (ips, share) in results.items():
        print(f"| {k:<34} | {ips:>9,.0f} | {ips / bound:>7.2f} | {100 * share:>14.1f}% |")
    tmp.cleanup()


if __name__ == "__main__":
    main()
