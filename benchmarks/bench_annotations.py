"""What boxes and keypoints cost: build steps and the Loader, with and without annotation fields, same run.

Makes N samples (default 2000): a 64x64 RGB image with 0-12 boxes, their labels and 17 COCO-style
keypoints per box, and times, medians of --repeats:

  build steps   resize + random_resized_crop + random_flip + random_affine per sample, on the image
                alone and on image + boxes + box_labels + keypoints (ms per sample)
  Loader epoch  batch 64, CPU, gather in the caller: the image alone, image + the padded annotation
                fields, and both again with the device steps random_flip + random_crop; then with a
                64x64 uint16 instance mask too (the boxes' ids painted), tied to the boxes (a crop that
                drops a box renumbers it) and, from a second store, the same mask untied (moved only):
                their difference is what the renumbering costs
and prints the ratios against the image-only baseline of the same run.

    python benchmarks/bench_annotations.py [--n 2000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 17
PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
STEPS = [{"resize": {"size": [72, 72]}},
         {"random_resized_crop": {"size": [64, 64], "scale": [0.4, 1.0], "min_visibility": 0.2}},
         {"random_flip": {"horizontal": 0.5, "flip_pairs": PAIRS}},
         {"random_affine": {"degrees": 10, "min_visibility": 0.2}}]


def _register() -> None:
    from precompile.decoders.base import Decoder
    from precompile.registry import DECODERS
    from precompile.sample import FieldSpec

    class _Npz(Decoder):
        name = "_bench_annotations"
        kind = "image"
        tie: str | None = "boxes"   # the instance mask's tie

        def output_specs(self, field):
            return {field: FieldSpec("image", (None, None, 3), "uint8"),
                    "instances": FieldSpec("mask", (None, None, 1), "uint16", of=self.tie),
                    "boxes": FieldSpec("boxes", (None, 4), "float32"),
                    "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                    "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

        def decode(self, path, field):
            with np.load(path, allow_pickle=False) as z:
                return {f: z[f] for f in ("image", "instances", "boxes", "box_labels", "keypoints")}, {}

    class _NpzUntied(_Npz):
        name = "_bench_annotations_untied"
        tie = None

    for cls in (_Npz, _NpzUntied):
        if cls.name not in DECODERS:
            DECODERS.register()(cls)


def sample_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    m = int(rng.integers(0, 13))
    x1, y1 = rng.uniform(0, 56, m), rng.uniform(0, 56, m)
    x2, y2 = x1 + rng.uniform(2, 64 - x1), y1 + rng.uniform(2, 64 - y1)
    kp = np.concatenate([rng.uniform(0, 64, (m, K, 2)), rng.integers(0, 3, (m, K, 1))], -1)
    inst = np.zeros((64, 64, 1), np.uint16)
    for i in range(m):   # box i's pixels hold id i + 1 (later boxes on top)
        inst[int(y1[i]):int(np.ceil(y2[i])), int(x1[i]):int(np.ceil(x2[i]))] = i + 1
    return {"image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "instances": inst,
            "boxes": np.stack([x1, y1, x2, y2], 1).astype(np.float32).reshape(-1, 4),
            "box_labels": rng.integers(0, 80, m).astype(np.int64), "keypoints": kp.astype(np.float32)}


def time_steps(samples: list[dict[str, np.ndarray]], with_notes: bool) -> float:
    """ms per sample through the 4 build steps."""
    from precompile.registry import STEPS as REG, load_builtins
    from precompile.sample import Sample
    from precompile.seeding import rng_for

    load_builtins()
    steps = [REG.get(n)(REG.get(n).Params.model_validate(p)) for d in STEPS for n, p in d.items()]
    names = ("image", "boxes", "box_labels", "keypoints") if with_notes else ("image",)
    t0 = time.perf_counter()
    for i, a in enumerate(samples):
        s = Sample(f"s{i}", {f: a[f] for f in names}, {f: f for f in names})
        for st in steps:
            (s,) = st.run(s, rng_for(0, s.key, 1))
    return (time.perf_counter() - t0) * 1000 / len(samples)


def time_epoch(path: str, fields: list[str], gpu_steps: list | None) -> float:
    from precompile import Loader

    loader = Loader(path, batch_size=64, shuffle=True, seed=1, device="cpu", fields=fields, num_threads=0,
                    gpu_steps=gpu_steps)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import yaml

    from precompile import build

    _register()
    rng = np.random.default_rng(0)
    samples = [sample_arrays(rng) for _ in range(args.n)]
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "in", "a"))
        for i, a in enumerate(samples):
            np.savez(os.path.join(tmp, "in", "a", f"{i:06d}.npz"), **a)
        recipe = {"name": "det", "inputs": {"root": os.path.join(tmp, "in"), "match": "{label}/{name}.npz",
                                            "fields": {"image": {"decoder": "_bench_annotations"}}},
                  "steps": [{"resize": {"size": [64, 64]}}], "output": {"format": "hdf5", "samples_per_shard": 500}}
        rp = os.path.join(tmp, "det.yaml")
        with open(rp, "w") as fh:
            yaml.safe_dump(recipe, fh)
        out = build(rp, out_dir=os.path.join(tmp, "out"))["output"]
        recipe["name"], recipe["inputs"]["fields"]["image"]["decoder"] = "untied", "_bench_annotations_untied"
        with open(rp, "w") as fh:
            yaml.safe_dump(recipe, fh)
        untied = build(rp, out_dir=os.path.join(tmp, "out2"))["output"]
        nboxes = sum(len(a["boxes"]) for a in samples)
        sub = samples[: min(len(samples), 500)]
        flip_crop = [{"random_flip": {"horizontal": 0.5, "flip_pairs": PAIRS}},
                     {"random_crop": {"size": [56, 56], "min_visibility": 0.2}}]
        img_steps = [{"random_flip": {"horizontal": 0.5}}, {"random_crop": {"size": [56, 56]}}]
        everything = ["image", "boxes", "box_labels", "keypoints"]
        contenders = [("build steps, image only", "ms/sample", lambda: time_steps(sub, False)),
                      ("build steps, + boxes/labels/keypoints", "ms/sample", lambda: time_steps(sub, True)),
                      ("Loader epoch, image only", "s/epoch", lambda: time_epoch(out, ["image"], None)),
                      ("Loader epoch, + annotations (padded)", "s/epoch", lambda: time_epoch(out, everything, None)),
                      ("Loader epoch, image only, flip + crop", "s/epoch",
                       lambda: time_epoch(out, ["image"], img_steps)),
                      ("Loader epoch, + annotations, flip + crop", "s/epoch",
                       lambda: time_epoch(out, everything, flip_crop)),
                      ("Loader epoch, + annotations + untied mask, flip + crop", "s/epoch",
                       lambda: time_epoch(untied, everything + ["instances"], flip_crop)),
                      ("Loader epoch, + annotations + instance mask, flip + crop", "s/epoch",
                       lambda: time_epoch(out, everything + ["instances"], flip_crop))]
        scale = {"ms/sample": 1000 / len(sub), "s/epoch": 1.0}
        times: dict[str, list[tuple[float, float]]] = {c[0]: [] for c in contenders}
        for _ in range(args.repeats):   # contenders take turns: load from other jobs hits them alike
            for label, unit, fn in contenders:
                c0 = time.process_time()
                wall = fn()
                times[label].append((wall, (time.process_time() - c0) * scale[unit]))
    print(f"{args.n} samples, {nboxes} boxes ({nboxes / args.n:.1f} a sample), {K} keypoints a box; "
          f"medians of {args.repeats} (contenders take turns); cpu = process CPU time in the same unit")
    print(f"| {'contender':<56} | {'wall':>8} | {'cpu':>8} | {'unit':<9} | {'wall vs base':>12} "
          f"| {'cpu vs base':>11} |")
    print(f"|{'-' * 58}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 14}|{'-' * 13}|")
    med = {label: (statistics.median(w for w, _ in times[label]), statistics.median(c for _, c in times[label]))
           for label, _, _ in contenders}
    # each pair against its own baseline; the tied instance mask against the same mask untied (the renumbering)
    base_of = {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 6}
    for i, (label, unit, _) in enumerate(contenders):
        (w, c), (bw, bc) = med[label], med[contenders[base_of[i]][0]]
        print(f"| {label:<56} | {w:>8.3f} | {c:>8.3f} | {unit:<9} | {w / bw:>11.2f}x | {c / bc:>10.2f}x |")


if __name__ == "__main__":
    main()
