"""The Loader's random device steps (issue 35) against the libraries users have, on the same batches.

1. Per step, on one uint8 batch (``--batch`` x ``--src`` x 3, random pixels) already on ``--device``: the median
   time of the device step (its per-sample draws on the host included) against Kornia's augmentation of the same
   name on the same batch (float NCHW in [0, 1], what Kornia takes; the uint8 -> float conversion is in Kornia's
   time, as a user pays it); where Kornia is absent, a plain-torch reference of the same op (``F.interpolate`` /
   ``F.grid_sample`` per batch, the colour formulas in float) and the row says so. ``ratio`` = the contender's
   time / ours (above 1: ours is faster).
2. The CPU contender: albumentations (``RandomResizedCrop`` + ``HorizontalFlip`` + ``ColorJitter``) per sample in
   a ``DataLoader`` with ``--workers`` workers, against the same three device steps on whole batches, images/s.
   Skipped (said so) without albumentations.
3. ``--resnet``, on CUDA: ResNet-18 (plain torch.nn, ``bench_gpu.resnet``), channels_last, bf16 autocast, SGD,
   batch ``--batch`` at ``--size``: the compute bound (one float batch kept on the device) against the same
   training steps fed by ``random_resized_crop`` + ``random_flip`` + ``color_jitter`` on the device from a uint8
   batch of ``--src`` kept there, then normalised: ``x bound`` (the issue asks >= 0.95). With ``--fused`` also
   fed by the fused kernels (``precompile/reader/fused.py``) from the same draws.
4. ``--fused``: ``random_resized_crop`` + ``random_flip`` + ``color_jitter`` (without and with hue) + the float32
   conversion (ImageNet mean/std, NCHW view) on one batch: the eager steps (the reference, the baseline) against
   the fused kernels and Kornia (the same three augmentations, then the same normalisation), medians of rounds
   taking turns, ``ratio`` = their time / the fused time; and how far the fused batch is from the eager one on
   the same draws (the fraction of values that differ, the largest difference in uint8 levels). Needs CUDA, or
   the CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter: a smoke run, not a speed).

    PYTHONPATH=. python benchmarks/bench_device_augment.py [--device auto] [--batch 256] [--src 256x320]
        [--size 224] [--repeats 15] [--workers 4] [--resnet] [--fused] [--quick]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_device_augment.py --quick --fused --device cpu
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn: Callable[[], Any], dev, repeats: int) -> float:
    fn()
    _sync(dev)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def ours(spec: dict, x, epoch: list[int]) -> Callable[[], Any]:
    from precompile.reader import augment, gpu

    steps = augment.parse_steps([spec] if isinstance(spec, dict) else spec)
    gpu.bind_steps(steps, {"image": {"kind": "image", "dtype": "uint8"}}, {"image": tuple(x.shape[1:])})

    def run():
        epoch[0] += 1
        params = gpu.step_params(steps, 0, epoch[0], 0, 0, x.shape[0])
        return gpu.run_steps({"image": x}, steps, params)["image"]
    return run


def kornia_ops(size: int) -> dict[str, Any] | None:
    try:
        import kornia.augmentation as K
    except ImportError:
        return None
    return {"random_resized_crop": K.RandomResizedCrop((size, size), p=1.0),
            "color_jitter": K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0),
            "random_grayscale": K.RandomGrayscale(p=0.2),
            "gaussian_blur": K.RandomGaussianBlur((9, 9), (0.1, 2.0), p=1.0),
            "random_erasing": K.RandomErasing(p=0.5),
            "random_affine": K.RandomAffine(15, translate=(0.1, 0.1), scale=(0.9, 1.1), p=1.0)}


def torch_reference(name: str, size: int) -> Callable[[Any], Any]:
    """The same op in plain torch on a float NCHW batch (one draw for the batch where a per-sample one needs
    a loop): the floor a user's own torch code would reach."""
    import torch
    import torch.nn.functional as F

    def rrc(x):
        n, _, H, W = x.shape
        th = torch.empty(n, 2, 3, device=x.device)
        s = torch.empty(n, device=x.device).uniform_(0.3, 1.0).sqrt()
        th[:, 0, 0], th[:, 1, 1], th[:, 0, 1], th[:, 1, 0] = s, s, 0, 0
        th[:, :, 2] = (1 - s)[:, None] * torch.empty(n, 2, device=x.device).uniform_(-1, 1)
        grid = F.affine_grid(th, (n, x.shape[1], size, size), align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", align_corners=False)

    def jitter(x):
        n = x.shape[0]
        b = torch.empty(n, 1, 1, 1, device=x.device).uniform_(0.6, 1.4)
        x = (x * b).clamp(0, 1)
        g = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]
        c = torch.empty(n, 1, 1, 1, device=x.device).uniform_(0.6, 1.4)
        x = (x * c + g.mean((2, 3), keepdim=True) * (1 - c)).clamp(0, 1)
        s = torch.empty(n, 1, 1, 1, device=x.device).uniform_(0.6, 1.4)
        g = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]
        return (x * s + g * (1 - s)).clamp(0, 1)

    def gray(x):
        g = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None].expand_as(x)
        return torch.where(torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.2, g, x)

    def blur(x):
        k = torch.exp(-0.5 * (torch.arange(9, device=x.device) - 4.0) ** 2)
        k = (k / k.sum()).view(1, 1, 9, 1).repeat(x.shape[1], 1, 1, 1)
        x = F.conv2d(F.pad(x, (0, 0, 4, 4), mode="reflect"), k, groups=x.shape[1])
        return F.conv2d(F.pad(x, (4, 4, 0, 0), mode="reflect"), k.transpose(2, 3), groups=x.shape[1])

    def erase(x):
        n, _, H, W = x.shape
        t = torch.randint(0, H // 2, (n, 1, 1, 1), device=x.device)
        l_ = torch.randint(0, W // 2, (n, 1, 1, 1), device=x.device)
        ys = torch.arange(H, device=x.device).view(1, 1, H, 1)
        xs = torch.arange(W, device=x.device).view(1, 1, 1, W)
        return torch.where((ys >= t) & (ys < t + H // 4) & (xs >= l_) & (xs < l_ + W // 4), 0.0, x)

    def affine(x):
        n = x.shape[0]
        a = torch.empty(n, device=x.device).uniform_(-math.radians(15), math.radians(15))
        th = torch.stack([torch.stack([a.cos(), -a.sin(), torch.zeros_like(a)], 1),
                          torch.stack([a.sin(), a.cos(), torch.zeros_like(a)], 1)], 1)
        return F.grid_sample(x, F.affine_grid(th, x.shape, align_corners=False), align_corners=False)

    return {"random_resized_crop": rrc, "color_jitter": jitter, "random_grayscale": gray, "gaussian_blur": blur,
            "random_erasing": erase, "random_affine": affine}[name]


def part_steps(dev, x, size: int, repeats: int) -> None:
    specs = {"random_resized_crop": {"size": size, "interpolation": "linear"},
             "color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1},
             "random_grayscale": {"p": 0.2},
             "gaussian_blur": {"kernel_size": 9, "sigma": [0.1, 2.0]},
             "random_erasing": {"p": 0.5},
             "random_affine": {"degrees": 15, "translate": 0.1, "scale": [0.9, 1.1]}}
    korn = kornia_ops(size)
    who = "kornia" if korn is not None else "plain torch (kornia absent)"
    print(f"\n1. device steps on {tuple(x.shape)} uint8 on {dev}; contender: {who}")
    print(f"{'step':22s} {'ours ms':>9s} {'theirs ms':>10s} {'ratio':>7s}")
    epoch = [0]
    for name, spec in specs.items():
        t_ours = median_ms(ours({name: spec}, x, epoch), dev, repeats)
        if korn is not None:
            op = korn[name].to(dev)

            def theirs():
                return op(x.permute(0, 3, 1, 2).float().div_(255))
        else:
            ref = torch_reference(name, size)

            def theirs():
                return ref(x.permute(0, 3, 1, 2).float().div_(255))
        t_theirs = median_ms(theirs, dev, repeats)
        print(f"{name:22s} {t_ours:9.2f} {t_theirs:10.2f} {t_theirs / t_ours:7.2f}")


def part_albumentations(dev, x_host: np.ndarray, size: int, workers: int, repeats: int) -> None:
    import torch

    try:
        import albumentations as A
    except ImportError:
        print("\n2. albumentations is not installed here: skipped")
        return
    aug = A.Compose([A.RandomResizedCrop(size=(size, size), scale=(0.08, 1.0)), A.HorizontalFlip(),
                     A.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0)])

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(x_host)

        def __getitem__(self, i):
            return torch.from_numpy(aug(image=x_host[i])["image"])

    n = len(x_host)
    dl = torch.utils.data.DataLoader(DS(), batch_size=n, num_workers=workers, persistent_workers=workers > 0)
    it = [0]

    def theirs():
        for b in dl:
            b.to(dev, non_blocking=True)
        it[0] += 1
    chain = [{"random_resized_crop": {"size": size}}, {"random_flip": {}},
             {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}}]
    x = torch.from_numpy(x_host).to(dev)
    t_ours = median_ms(ours(chain, x, [0]), dev, repeats)
    t_theirs = median_ms(theirs, dev, max(3, repeats // 3))
    print(f"\n2. RandomResizedCrop + flip + ColorJitter, {n} images of {x_host.shape[1:3]}: albumentations in "
          f"{workers} DataLoader workers {n / t_theirs * 1e3:9.0f} img/s; device steps on {dev} "
          f"{n / t_ours * 1e3:9.0f} img/s; ratio (ours / theirs, img/s) {t_theirs / t_ours:.2f}")


def fused_chain(size: int, hue: float) -> list[dict]:
    """The chain the fused kernels take, as the ImageNet recipe writes it (hue: 0, or a shift)."""
    return [{"random_resized_crop": {"size": size}}, {"random_flip": {}},
            {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": hue}}]


def eager_and_fused(spec: list[dict], x, conv) -> tuple[Callable[[], Any], Callable[[], Any] | None, Any, Any]:
    """Two feeders of the same draws (batch b: stream (0, 0, 0, b), b counted per call): the eager steps then
    ``conv``, and the fused kernels (None where this batch cannot take them); and the steps and the chain."""
    from precompile.reader import augment, fused, gpu

    steps = augment.parse_steps(spec)
    gpu.bind_steps(steps, {"image": {"kind": "image", "dtype": "uint8"}}, {"image": tuple(x.shape[1:])})
    chain = fused.FusedChain.of(steps, {"image": conv})
    b = [0]

    def eager():
        b[0] += 1
        return conv(gpu.run_steps({"image": x}, steps, gpu.step_params(steps, 0, 0, 0, b[0], x.shape[0]))["image"])

    def fast():
        b[0] += 1
        return chain.run(x, gpu.step_params(steps, 0, 0, 0, b[0], x.shape[0]))

    return eager, (fast if chain is not None and chain.usable({"image": x}) else None), steps, chain


def part_fused(dev, x, size: int, repeats: int) -> None:
    import torch

    from bench_gpu import MEAN, STD
    from precompile.reader import gpu

    conv = gpu.Convert(torch.float32, MEAN, STD, channels_first=True, scale=1 / 255)
    try:
        import kornia.augmentation as K
    except ImportError:
        K = None
    print(f"\n4. random_resized_crop + random_flip + color_jitter + float32 conversion on {tuple(x.shape)} uint8 on "
          f"{dev}: the eager steps (baseline) against the fused kernels" + ("" if K is None else " and Kornia"))
    print(f"{'chain':30s} {'eager ms':>9s} {'fused ms':>9s} {'kornia ms':>10s} {'eager/fused':>12s} "
          f"{'kornia/fused':>13s} {'differ':>8s} {'levels':>7s}")
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)
    level = (1 / 255 / std).float()
    for hue in (0.0, 0.1):
        eager, fast, steps, chain = eager_and_fused(fused_chain(size, hue), x, conv)
        name = "rrc + flip + jitter" + (f" + hue {hue}" if hue else "")
        if fast is None:
            print(f"{name:30s} the fused kernels are unavailable here (triton missing, or a CPU batch without "
                  f"TRITON_INTERPRET=1): skipped")
            continue
        params = gpu.step_params(steps, 0, 0, 0, 10 ** 6, x.shape[0])   # the same draws for both: how far apart
        a = conv(gpu.run_steps({"image": x}, steps, params)["image"])
        f = chain.run(x, params)
        differ = float((a != f).float().mean())
        levels = float(((a - f).abs() / level).max())
        contenders = {"eager": eager, "fused": fast}
        if K is not None:
            ops = [K.RandomResizedCrop((size, size), p=1.0).to(dev), K.RandomHorizontalFlip().to(dev),
                   K.ColorJitter(0.4, 0.4, 0.4, hue, p=1.0).to(dev)]

            def kornia_run():
                y = x.permute(0, 3, 1, 2).float().div_(255)
                for op in ops:
                    y = op(y)
                return (y - mean) / std
            contenders["kornia"] = kornia_run
        rounds: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(5):   # they take turns: clocks and caches drift alike for all
            for k, fn in contenders.items():
                rounds[k].append(median_ms(fn, dev, max(1, repeats // 3)))
        t = {k: statistics.median(v) for k, v in rounds.items()}
        tk = t.get("kornia", float("nan"))
        print(f"{name:30s} {t['eager']:9.2f} {t['fused']:9.2f} {tk:10.2f} {t['eager'] / t['fused']:12.2f} "
              f"{tk / t['fused']:13.2f} {differ:8.1e} {levels:7.2f}")


def part_resnet(dev, x, size: int, repeats: int, with_fused: bool = False) -> None:
    import torch

    from bench_gpu import MEAN, STD, resnet
    from precompile.reader import augment, gpu

    model = resnet(18).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    n = x.shape[0]
    labels = torch.randint(0, 1000, (n,), device=dev)
    conv = gpu.Convert(torch.float32, MEAN, STD, channels_first=True, scale=1 / 255)
    steps = augment.parse_steps([{"random_resized_crop": {"size": size}}, {"random_flip": {}},
                                 {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}}])
    gpu.bind_steps(steps, {"image": {"kind": "image", "dtype": "uint8"}}, {"image": tuple(x.shape[1:])})
    fixed = conv(x[:, :size, :size].contiguous())

    def train(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(batch), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    b = [0]

    def augmented():
        b[0] += 1
        params = gpu.step_params(steps, 0, 0, 0, b[0], n)
        train(conv(gpu.run_steps({"image": x}, steps, params)["image"]))

    for _ in range(3):
        train(fixed)
        augmented()
    def per_step_ms(fn) -> float:
        """``repeats`` steps back to back, one sync at the end (as training runs: the host prepares the next
        batch's draws while the device still trains on the last), per step."""
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(dev)
        return (time.perf_counter() - t0) / repeats * 1e3

    side = torch.cuda.Stream(dev)

    def aug_batch():
        b[0] += 1
        params = gpu.step_params(steps, 0, 0, 0, b[0], n)
        return conv(gpu.run_steps({"image": x}, steps, params)["image"])

    def side_stream_ms(make=aug_batch) -> float:
        """The steps for batch k + 1 on a side stream while batch k trains (as the Loader's CUDA feeder runs
        them), per step; ``make`` makes a batch (the eager steps, or the fused kernels)."""
        main = torch.cuda.current_stream(dev)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            nxt = make()
            ev = side.record_event()
        for _ in range(repeats):
            main.wait_event(ev)
            cur = nxt
            cur.record_stream(main)
            with torch.cuda.stream(side):   # reads x only; what it makes is handed over with record_stream
                nxt = make()
                ev = side.record_event()
            train(cur)
        _sync(dev)
        return (time.perf_counter() - t0) / repeats * 1e3

    fast = None
    if with_fused:
        _, fast, _, _ = eager_and_fused(fused_chain(size, 0.0), x, conv)
        if fast is None:
            print("\n3. --fused: the fused kernels are unavailable here (triton missing): eager only")
        else:
            for _ in range(3):
                train(fast())

    bound, aug, over, fused_aug, fused_over = [], [], [], [], []
    for _ in range(5):   # they take turns: clocks and caches drift alike for all
        bound.append(per_step_ms(lambda: train(fixed)))
        aug.append(per_step_ms(augmented))
        over.append(side_stream_ms())
        if fast is not None:
            fused_aug.append(per_step_ms(lambda: train(fast())))
            fused_over.append(side_stream_ms(fast))
    tb, ta, to = statistics.median(bound), statistics.median(aug), statistics.median(over)
    print(f"\n3. ResNet-18 bf16 batch {n} at {size}: compute bound {n / tb * 1e3:8.0f} img/s; with random_resized_crop"
          f" + random_flip + color_jitter on the device, on the training stream {n / ta * 1e3:8.0f} img/s, x bound "
          f"{tb / ta:.3f}; one batch ahead on a side stream {n / to * 1e3:8.0f} img/s, x bound {tb / to:.3f} "
          f"(medians of 5 rounds of {repeats} steps; rounds: bound {[round(t, 1) for t in bound]} ms, same stream "
          f"{[round(t, 1) for t in aug]} ms, side stream {[round(t, 1) for t in over]} ms)")
    if fused_aug:
        tf, tfo = statistics.median(fused_aug), statistics.median(fused_over)
        print(f"   fed by the fused kernels (the same chain and draws): on the training stream {n / tf * 1e3:8.0f} "
              f"img/s, x bound {tb / tf:.3f}; one batch ahead on a side stream {n / tfo * 1e3:8.0f} img/s, x bound "
              f"{tb / tfo:.3f} (rounds: same stream {[round(t, 1) for t in fused_aug]} ms, side stream "
              f"{[round(t, 1) for t in fused_over]} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--src", default="256x320")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--resnet", action="store_true")
    ap.add_argument("--fused", action="store_true", help="part 4 (and, with --resnet, training fed by the fused "
                    "kernels too)")
    ap.add_argument("--quick", action="store_true", help="a small CPU smoke run of parts 1 and 2 (and 4)")
    a = ap.parse_args()
    import torch

    from precompile.reader.gpu import resolve_device

    if a.quick:
        a.batch, a.src, a.size, a.repeats, a.workers = 8, "48x64", 32, 3, 1
    dev = resolve_device(a.device)
    H, W = (int(v) for v in a.src.split("x"))
    x_host = np.random.default_rng(0).integers(0, 256, (a.batch, H, W, 3), dtype=np.uint8)
    x = torch.from_numpy(x_host).to(dev)
    print(f"torch {torch.__version__}, device {dev}" + (f" ({torch.cuda.get_device_name(dev)})"
                                                         if dev.type == "cuda" else ""))
    part_steps(dev, x, a.size, a.repeats)
    part_albumentations(dev, x_host, a.size, a.workers, a.repeats)
    if a.resnet:
        if dev.type != "cuda":
            print("\n3. --resnet needs CUDA: skipped")
        else:
            part_resnet(dev, x, a.size, a.repeats, a.fused)
    if a.fused:
        part_fused(dev, x, a.size, a.repeats)


if __name__ == "__main__":
    main()
