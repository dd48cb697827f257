"""The seeds' MNIST experiment, replicated: how long 5 epochs of a small MLP take with each way of feeding it.

Model and training: 784-128-64-10 MLP (ReLU), Adam lr 1e-3, cross-entropy,
batch 64, shuffled every epoch, 5 epochs (``--epochs``), CPU. Data: 60,000
synthetic 28x28 uint8 digit-like images (digits drawn with OpenCV's Hershey
fonts, random scale/rotation/shift/stroke/blur/noise), written as PNG files in
class folders and built by ``precompile build`` (gray8, one field + label).
No downloads.

Contenders, all in this run, same model initialisation:

- ``DataLoader(MNIST-style)``: a hand-written torchvision-MNIST-style Dataset
  (the uint8 set in memory; per sample a PIL image -> to_tensor -> normalise)
  with ``num_workers=0``, ``2`` and ``2 + pin_memory``.
- ``precompile Loader``: CPU, float32 with mean/std on the fly.
- ``pure compute``: the whole set pre-normalised in one float tensor,
  permuted once per epoch before the clock starts and sliced per batch (the
  lower bound: only the training steps are timed).

The table gives total seconds, the median epoch and the ratio to the bound
(median epoch / bound's median epoch). The target is the Loader within 1.1x.
Every step reads ``loss.item()``, as the seeds' training loop does.

``--device cuda`` runs the same on a GPU, as the seeds' published run did: the model, the bound's
set and the Loader's batches on the device; the DataLoader's batches copied there
(``non_blocking`` where pinned); ``--workers`` sets the DataLoader's worker count (default 2).

    PYTHONPATH=. python benchmarks/bench_mnist.py [--quick] [--epochs 5] [--cache DIR] [--device cuda]
        [--workers 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MEAN, STD = 0.1307, 0.3081


def digit(rng: np.random.Generator, d: int) -> np.ndarray:
    """One 28x28 uint8 digit-like image of class ``d``."""
    import cv2

    img = np.zeros((56, 56), np.uint8)  # drawn at 2x, then reduced (anti-aliased strokes)
    font = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX,
            cv2.FONT_HERSHEY_SCRIPT_SIMPLEX)[rng.integers(0, 4)]
    scale = 1.4 + 0.5 * rng.random()
    thick = int(rng.integers(3, 7))
    (w, h), _ = cv2.getTextSize(str(d), font, scale, thick)
    org = (int((56 - w) / 2 + rng.integers(-4, 5)), int((56 + h) / 2 + rng.integers(-4, 5)))
    cv2.putText(img, str(d), org, font, scale, 255, thick, cv2.LINE_AA)
    m = cv2.getRotationMatrix2D((28, 28), float(rng.normal(0, 10)), 1.0 + 0.1 * rng.normal())
    img = cv2.warpAffine(img, m, (56, 56))
    img = cv2.resize(img, (28, 28), interpolation=cv2.INTER_AREA)
    img = cv2.GaussianBlur(img, (3, 3), 0.3 + 0.5 * rng.random())
    noise = rng.normal(0, 6, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def make_inputs(root: str, n: int) -> None:
    import cv2

    done = os.path.join(root, f".complete-{n}")
    if os.path.exists(done):
        return
    rng = np.random.default_rng(2024)
    for d in range(10):
        os.makedirs(os.path.join(root, str(d)), exist_ok=True)
    for i in range(n):
        d = int(i % 10)
        cv2.imwrite(os.path.join(root, str(d), f"{i:05d}.png"), digit(rng, d))
    open(done, "w").close()


def build_set(cache: str, n: int) -> str:
    from precompile import build
    from precompile.recipe import parse_recipe

    inputs = os.path.join(cache, f"digits-{n}")
    t0 = time.perf_counter()
    make_inputs(inputs, n)
    t1 = time.perf_counter()
    recipe = parse_recipe({
        "name": f"digits{n}", "seed": 0,
        "inputs": {"root": inputs, "match": "{label}/{name}.png",
                   "fields": {"image": {"decoder": "image", "mode": "gray8"}}, "label": {"capture": "label"}},
        "steps": [{"center_crop": {"size": [28, 28]}}],
        "output": {"format": "hdf5", "samples_per_shard": 10000},
    }, base_dir=cache)
    rep = build(recipe, out_dir=os.path.join(cache, "build"), n_jobs=2)
    print(f"inputs: {n} PNGs ({t1 - t0:.1f} s to generate or find); build: {rep['wall_seconds']:.1f} s "
          f"({rep['shards']['built']} shards built, {rep['shards']['skipped']} up to date)")
    return rep["output"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12,000 images and 2 epochs (a smoke run)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per contender (default 5, quick 2)")
    ap.add_argument("--samples", type=int, default=None, help="images (default 60000, quick 12000)")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "precompile-bench-mnist"),
                    help="folder for the generated PNGs and the build (reused between runs)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for training (default 1: a 64-sample MLP step gains nothing from "
                         "more, and OpenMP spinning makes timings erratic on a shared 2-core machine)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers of the multi-worker rows (default 2)")
    ap.add_argument("--only", default=None, help="comma-separated contender prefixes to run (bound always runs)")
    args = ap.parse_args(argv)
    n = args.samples or (12000 if args.quick else 60000)
    epochs = args.epochs or (2 if args.quick else 5)

    import torch
    from PIL import Image
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import precompile
    from benchmarks.bench_gpu import sync
    from precompile.reader.loader import Loader

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_mnist: --device cuda but torch.cuda.is_available() is False")
    dv, nw = dev.type, args.workers
    if dv == "cuda":   # on the H100 node a DataLoader once hung passing workers' tensors by file descriptor
        torch.multiprocessing.set_sharing_strategy("file_system")

    index = build_set(args.cache, n)
    ds = precompile.open(index)
    allx = ds.batch(range(len(ds)))
    data = torch.from_numpy(allx["image"][..., 0].copy())   # (N, 28, 28) uint8, as torchvision's MNIST.data
    targets = torch.from_numpy(allx["label"].copy())
    ds.close()

    class MNISTStyle(Dataset):
        """torchvision.datasets.MNIST's __getitem__ with ToTensor + Normalize, written out by hand."""

        def __init__(self, data, targets):
            self.data, self.targets = data, targets

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            img, target = self.data[i], int(self.targets[i])
            img = Image.fromarray(img.numpy(), mode="L")
            # ToTensor: bytes -> (1, H, W) float in [0, 1]
            t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(1, img.size[1], img.size[0])
            t = t.float().div(255)
            # Normalize
            t = t.sub_(MEAN).div_(STD)
            return t, target

    def model_and_opt():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
        m = m.to(dev)
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    loss_fn = nn.CrossEntropyLoss()

    def run_epoch(state, batches_for_epoch, e) -> float:
        model, opt = state[0], state[1]
        batches = batches_for_epoch(e)  # generators do their work inside the timed loop; the bound's is done here
        sync(dev)
        t0 = time.perf_counter()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            last = loss.item()
        sync(dev)
        dt = time.perf_counter() - t0
        state[2:] = [last]
        return dt

    results: dict[str, tuple[list[float], float, str]] = {}

    xall = ((data.float() / 255 - MEAN) / STD).view(-1, 784).to(dev)
    tall = targets.to(dev)

    def bound(e):
        # not a generator: the epoch's permuted copy is made before the clock starts, so only slicing is timed
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(e)).to(dev)
        xs, ys = xall[perm], tall[perm]
        return [(xs[i:i + 64], ys[i:i + 64]) for i in range(0, n, 64)]

    def bound_shuffled(e):
        # the same, with the epoch's shuffled copy of the in-memory set made inside the timed loop
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(e)).to(dev)
        xs, ys = xall[perm], tall[perm]
        for i in range(0, n, 64):
            yield xs[i:i + 64], ys[i:i + 64]

    def dataloader(workers, pin):
        dset = MNISTStyle(data, targets)

        def epoch_iter(e):
            g = torch.Generator().manual_seed(e)
            for x, y in DataLoader(dset, batch_size=64, shuffle=True, num_workers=workers, pin_memory=pin, generator=g):
                yield x.to(dev, non_blocking=pin), y.to(dev, non_blocking=pin)
        return epoch_iter

    loader = Loader(index, batch_size=64, shuffle=True, seed=0, device=dv, dtype="float32", mean=MEAN, std=STD)
    waits = []

    def precompiled(e):
        loader.set_epoch(e)
        for b in loader:
            yield b["image"].view(-1, 784), b["label"]
        waits.append(loader.stats.wait_share)

    threaded = Loader(index, batch_size=64, shuffle=True, seed=0, device=dv, dtype="float32", mean=MEAN, std=STD,
                      num_threads=0)

    def precompiled_threaded(e):
        threaded.set_epoch(e)
        for b in threaded:
            yield b["image"].view(-1, 784), b["label"]

    contenders = [
        ("pure compute (lower bound)", bound),
        ("pure compute + in-memory shuffle per epoch", bound_shuffled),
        (f"precompile Loader ({dv}, default: {loader.num_threads} threads)", precompiled),
        (f"precompile Loader ({dv}, num_threads=0)", precompiled_threaded),
        ("DataLoader(MNIST-style), 0 workers", dataloader(0, False)),
        (f"DataLoader(MNIST-style), {nw} workers", dataloader(nw, False)),
        (f"DataLoader(MNIST-style), {nw} workers + pin_memory", dataloader(nw, True)),
    ]
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    contenders = [(name, fn) for name, fn in contenders
                  if not only or name.startswith("pure") or any(name.startswith(o) for o in only)]
    print(f"{n} images, batch 64, {epochs} epochs, on {dev}, torch threads {torch.get_num_threads()}, {os.cpu_count()} cpus; "
          f"contenders take turns epoch by epoch (the machine is shared: noise spreads evenly)")
    states = {name: [*model_and_opt()] for name, _ in contenders}
    times: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for e in range(epochs):
        for name, fn in contenders:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator: pinning is a no-op
                times[name].append(run_epoch(states[name], fn, e))
        print(f"  epoch {e}: " + ", ".join(f"{name.split(' (')[0].split(',')[-1].strip() or name}="
                                             f"{times[name][-1]:.2f}s" for name, _ in contenders), flush=True)
    for name, _ in contenders:
        note = "(no CUDA: pinning is a no-op)" if "pin_memory" in name and not torch.cuda.is_available() else ""
        results[name] = (times[name], states[name][2], note)

    ref = statistics.median(results["pure compute (lower bound)"][0])
    print()
    print(f"| {'contender':<48} | {'total s':>8} | {'median epoch s':>14} | {'x bound':>7} | last loss")
    print(f"|{'-' * 50}|{'-' * 10}|{'-' * 16}|{'-' * 9}|-----------")
    for name, (times, loss, note) in results.items():
        med = statistics.median(times)
        print(f"| {name:<48} | {sum(times):>8.2f} | {med:>14.3f} | {med / ref:>7.2f} | {loss:.2e} {note}")
    default_name = f"precompile Loader ({dv}, default: {loader.num_threads} threads)"
    if default_name in results:
        r = statistics.median(results[default_name][0]) / ref
        print()
        print(f"Loader's own measure: waited for data {100 * statistics.median(waits):.1f}% of each epoch (median)")
        print(f"Loader / bound = {r:.2f} (target <= 1.1): {'PASS' if r <= 1.1 else 'FAIL'}")


if __name__ == "__main__":
    main()
