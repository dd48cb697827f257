"""Where the Loader's device steps spend their time on CUDA: the host's time to queue a batch's work against the
device's busy time, per step chain (issue 35). A chain whose host time is above its device time starves the GPU
however fast its kernels are; one whose device time is large costs training steps directly.

For each chain on one uint8 batch of ``--batch`` x 256x320x3 already on the device, medians of ``--repeats``:
``host ms`` (the draws and the queueing of every kernel and copy, no sync inside), ``device ms`` (the same work
queued behind a long sleep kernel, so the host's time is hidden: the GPU's own time), ``wall ms`` (queue and
wait), and the kernels and copies one call launches (torch.profiler). ``--tables`` adds the profiler's tables.
The last two rows add the float32 conversion (ImageNet mean/std, NCHW view) to resized crop + flip + jitter:
the eager steps, then the same draws through the fused kernels (``precompile/reader/fused.py``; said so when
triton is missing). Needs CUDA (says so and exits 0 without it).

    PYTHONPATH=. python benchmarks/profile_device_steps.py [--batch 256] [--repeats 10] [--tables]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHAINS = {
    "random_resized_crop 224": [{"random_resized_crop": {"size": 224}}],
    "random_flip": [{"random_flip": {}}],
    "color_jitter 0.4 x3 (224x224)": [{"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}}],
    "color_jitter + hue 0.1 (224x224)": [{"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4,
                                                           "hue": 0.1}}],
    "gaussian_blur 9": [{"gaussian_blur": {"kernel_size": 9}}],
    "random_affine 15 deg": [{"random_affine": {"degrees": 15, "translate": 0.1, "scale": [0.9, 1.1]}}],
    "rrc + flip + jitter": [{"random_resized_crop": {"size": 224}}, {"random_flip": {}},
                            {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}}],
}
#: the same chain and the float32 conversion: eager, then fused (the same draws)
CONVERTED = ["rrc + flip + jitter + float32 (eager)", "rrc + flip + jitter + float32 (fused)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tables", action="store_true")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile (this script measures the GPU's time against the host's)")
        return
    from torch.profiler import ProfilerActivity, profile

    from precompile.reader import augment, fused, gpu

    dev = torch.device("cuda")
    x = torch.randint(0, 255, (a.batch, 256, 320, 3), dtype=torch.uint8, device=dev)
    small = x[:, :224, :224].contiguous()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, batch {a.batch} uint8")
    print("| chain | host ms | device ms | wall ms | kernels + copies |\n|---|---:|---:|---:|---:|")
    conv = gpu.Convert(torch.float32, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), channels_first=True,
                       scale=1 / 255)
    for name in list(CHAINS) + CONVERTED:
        spec = CHAINS[name] if name in CHAINS else CHAINS["rrc + flip + jitter"]
        xin = small if "224x224" in name else x
        steps = augment.parse_steps(spec)
        gpu.bind_steps(steps, {"image": {"kind": "image", "dtype": "uint8"}}, {"image": tuple(xin.shape[1:])})
        chain = fused.FusedChain.of(steps, {"image": conv})
        if name.endswith("(fused)") and not (chain is not None and chain.usable({"image": xin})):
            print(f"| {name} | the fused kernels are unavailable here (triton missing) | | | |")
            continue
        b = [0]

        def run():
            b[0] += 1
            params = gpu.step_params(steps, 0, 0, 0, b[0], a.batch)
            if name.endswith("(fused)"):
                return chain.run(xin, params)
            out = gpu.run_steps({"image": xin}, steps, params)["image"]
            return conv(out) if name in CONVERTED else out

        for _ in range(3):
            run()
        host, wall, busy = [], [], []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append((t1 - t0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
            torch.cuda._sleep(int(2e8))   # the GPU busy for ~0.1 s: everything below queues behind it
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            run()
            e1.record()
            torch.cuda.synchronize()
            busy.append(e0.elapsed_time(e1))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA") / 3
        print(f"| {name} | {statistics.median(host):.2f} | {statistics.median(busy):.2f} | "
              f"{statistics.median(wall):.2f} | {kernels:.0f} |", flush=True)
        if a.tables:
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
