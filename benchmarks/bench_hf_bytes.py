"""``to_hf``'s bytes against the build's (issue 35): a build of N images as a ``datasets.Dataset``, its image
column as ``Image`` (lossless PNG, what ``to_hf`` writes) and, as the baseline measured in the same run from
the same rows, as the ``Array3D`` feature ``to_hf`` wrote before (an int32 offset beside every pixel).

For gray8, rgb8 and gray16 builds of noise (what no compression shrinks: the worst case) and of smooth images
(photographs compress better still), prints:

  build files        the index plus the shard files on disk
  pixel bytes        the image field's stored bytes (N x H x W x C x itemsize)
  Image column       the Arrow column's bytes; and / pixel bytes
  Array3D column     the same for the old feature
  Arrow files        the Arrow cache files datasets wrote for to_hf; and / build files
  to_hf s, read s    medians of --repeats: to_hf into a fresh cache; reading every row with_format("numpy")
                     (Image: PNG decode; Array3D: the baseline)

Then fixed-shape arrays (flow and its valid mask, RGB video clips, CT volumes, audio windows): each field's column
as ``to_hf`` writes it (one flat fixed-size ``List`` of the values, the shape in ``info.description``), and as
baselines from the same rows in the same run the ``ArrayND`` feature ``to_hf`` wrote before (nested variable
lists: an int32 offset per innermost list) and a fixed-size ``List`` per dimension (no offsets and the shape kept,
but ``datasets`` reads it back element by element). Prints, per field:

  build bytes        the field's stored bytes (N x its shape x itemsize)
  to_hf, ArrayND, nested    each column's Arrow bytes; and / build bytes
  to_hf s            median of --repeats: to_hf into a fresh cache (the whole build, every field)
  read ms/row        medians: every row's field with_format("numpy", dtype=None) (to_hf's reshaped), per row

Then variable-shape arrays (flow files of three sizes and videos of three sizes, built without a resize: the
plan's shape (None, None, 2), (8, None, None, 3)): each field as ``to_hf`` writes it (one variable-length ``List``
of the values plus ``<field>__shape``, a fixed-size ``List`` of int32), and as the baseline from the same rows in
the same run the nested variable lists ``to_hf`` wrote before (an int32 offset per innermost list). Prints, per
field: build bytes; to_hf (values + shape columns) and nested bytes, and / build bytes; the shape column's bytes
a row as written (int32, every dimension) and as the alternatives measured from the same shapes (int64; int32 in
a variable-length list; int32 of the varying dimensions only); to_hf s; read ms/row (to_hf's by
``precompile.hf.array``, and by hand ``row[c].reshape(row[c + "__shape"])``; nested).

    PYTHONPATH=. python benchmarks/bench_hf_bytes.py [--quick] [--repeats 3] [--only images|arrays|variable]

Needs ``datasets`` (the hf extra); exits 0 with a line saying so without it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_time  # noqa: E402


def images(root: Path, n: int, size: tuple[int, int], smooth: bool) -> None:
    import cv2
    from PIL import Image

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        if smooth:
            small = rng.integers(0, 256, (size[0] // 16, size[1] // 16, 3)).astype(np.float32)
            a = np.clip(cv2.resize(small, (size[1], size[0]), interpolation=cv2.INTER_CUBIC), 0, 255).astype(np.uint8)
        else:
            a = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        Image.fromarray(a).save(root / f"{i:05d}.png")


def folder_bytes(index: str) -> int:
    shards = Path(index[:-3] + ".shards")
    return os.path.getsize(index) + sum(p.stat().st_size for p in shards.glob("*.h5"))


def image_rows(tmp_p: Path, n: int, size: tuple[int, int], repeats: int) -> None:
    import datasets

    import precompile
    from precompile.hf import to_hf

    rows = []
    for content in ("noise", "smooth"):
        images(tmp_p / content / "x", n, size, content == "smooth")
        for mode in ("gray8", "rgb8", "gray16"):
            r = {"name": f"{content}-{mode}", "inputs": {"root": str(tmp_p / content), "match": "{label}/{name}.png",
                                                        "fields": {"image": {"decoder": "image", "mode": mode}}},
                 "steps": [{"resize": {"size": list(size)}}],   # the same size: a fixed shape (Array3D's)
                 "output": {"format": "hdf5", "samples_per_shard": 50}}
            index = precompile.build(r, out_dir=str(tmp_p / "out"))["output"]
            ds = precompile.open(index)
            pixels = sum(ds[i]["image"].nbytes for i in range(len(ds)))
            k = [0]

            def export() -> None:
                k[0] += 1
                export.hf = to_hf(index, cache_dir=str(tmp_p / f"cache-{content}-{mode}-{k[0]}"))

            t_hf = median_time(export, repeats)
            hf = export.hf
            spec = ds.field_specs["image"]
            old = datasets.Dataset.from_dict(
                {"image": [ds[i]["image"] for i in range(len(ds))]},
                features=datasets.Features({"image": datasets.Array3D(shape=tuple(spec["shape"]),
                                                                      dtype=spec["dtype"])}))
            arrow = sum(os.path.getsize(f["filename"]) for f in hf.cache_files)
            new_np, old_np = hf.with_format("numpy"), old.with_format("numpy")
            t_new = median_time(lambda: [new_np[i]["image"] for i in range(len(ds))], repeats)
            t_old = median_time(lambda: [old_np[i]["image"] for i in range(len(ds))], repeats)
            col, old_col = hf.data.column("image").nbytes, old.data.column("image").nbytes
            rows.append((f"{content} {mode}", folder_bytes(index), pixels, col, col / pixels, old_col,
                         old_col / pixels, arrow, arrow / folder_bytes(index), t_hf, t_new, t_old))
    print(f"{n} images of {size[0]}x{size[1]}; medians of {repeats}")
    print("| build | build files | pixel bytes | Image column | x pixels | Array3D column | x pixels | Arrow files "
          "| x build files | to_hf s | read s (Image) | read s (Array3D) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:,} | {r[2]:,} | {r[3]:,} | {r[4]:.2f} | {r[5]:,} | {r[6]:.2f} | {r[7]:,} | "
              f"{r[8]:.2f} | {r[9]:.3f} | {r[10]:.3f} | {r[11]:.3f} |")


def array_inputs(root: Path, quick: bool) -> dict[str, dict]:
    """Flow files, videos, NIfTI volumes and WAV files of random content, and the recipe of each (its field
    names): ``{name: recipe}``."""
    import wave

    import av
    import nibabel as nib

    from precompile.decoders.flo import write_flo

    rng = np.random.default_rng(0)
    n_flow, (fh, fw) = (8, (32, 48)) if quick else (48, (128, 192))
    n_vid, vsize, n_frames = (3, 32, 16) if quick else (12, 64, 32)
    n_vol, vshape = (4, (16, 32, 32)) if quick else (16, (32, 64, 64))
    n_wav, seconds = (2, 2) if quick else (8, 10)
    for d in ("flow", "video", "volume", "audio"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for i in range(n_flow):
        f = rng.normal(0, 3, (fh, fw, 2)).astype(np.float32)
        f[fh // 4:fh // 2, fw // 4:fw // 2] = np.nan      # unknown vectors: flow_valid 0 there
        write_flo(str(root / "flow" / f"{i:03d}.flo"), f)
    for i in range(n_vid):
        with av.open(str(root / "video" / f"{i:03d}.mp4"), "w") as c:
            s = c.add_stream("libx264", rate=25)
            s.width = s.height = vsize
            s.pix_fmt = "yuv420p"
            for _ in range(n_frames):
                frame = rng.integers(0, 256, (vsize, vsize, 3), dtype=np.uint8)
                for pkt in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
    for i in range(n_vol):
        vol = rng.normal(-500, 400, vshape).astype(np.float32)
        nib.save(nib.Nifti1Image(vol, np.eye(4)), str(root / "volume" / f"{i:03d}.nii"))
    for i in range(n_wav):
        pcm = (rng.normal(0, 0.2, 16000 * seconds).clip(-1, 1) * 32767).astype("<i2")
        with wave.open(str(root / "audio" / f"{i:03d}.wav"), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(pcm.tobytes())
    return {
        "flow": {"name": "flow", "inputs": {"root": str(root / "flow"), "match": "{name}.flo",
                                            "fields": {"flow": {"decoder": "flo", "valid_mask": True}}},
                 "steps": [{"resize": {"size": [fh, fw]}}],      # the files' size, now known to the plan
                 "output": {"format": "hdf5", "samples_per_shard": 16}},
        "video clips": {"name": "video", "inputs": {"root": str(root / "video"), "match": "{name}.mp4",
                                                    "fields": {"video": {"decoder": "video", "mode": "rgb8"}}},
                        "steps": [{"clips": {"length": 8, "stride": 8}}, {"resize": {"size": [vsize, vsize]}}],
                        "output": {"format": "hdf5", "samples_per_shard": 16}},
        "volume": {"name": "volume", "inputs": {"root": str(root / "volume"), "match": "{name}.nii",
                                                "fields": {"ct": {"decoder": "nifti"}}},
                   "steps": [{"resample_volume": {"shape": list(vshape)}}],
                   "output": {"format": "hdf5", "samples_per_shard": 4}},
        "audio windows": {"name": "audio", "inputs": {"root": str(root / "audio"), "match": "{name}.wav",
                                                      "fields": {"audio": {"decoder": "audio", "dtype": "float32"}}},
                          "steps": [{"windows": {"length": 16000, "hop": 16000}}],
                          "output": {"format": "hdf5", "samples_per_shard": 16}},
    }


def nested_fixed(shape: tuple[int, ...], dtype: str) -> object:
    """A fixed-size ``List`` per dimension: the bytes alone, the shape kept (the alternative not taken)."""
    import datasets

    feat: object = datasets.Value(dtype)
    for n in reversed(shape):
        feat = datasets.List(feat, length=n)
    return feat


def built_and_exported(recipe: dict, tmp_p: Path, out: str, repeats: int) -> tuple:
    """``recipe`` built into ``tmp_p / out``, then ``to_hf`` of it timed (median of ``repeats``, each export into
    its own cache): (the build's dataset, the last export as numpy rows with stored dtypes, seconds)."""
    import precompile
    from precompile.hf import to_hf

    index = precompile.build(recipe, out_dir=str(tmp_p / out))["output"]
    k = [0]

    def export() -> None:
        k[0] += 1
        export.hf = to_hf(index, cache_dir=str(tmp_p / f"cache-{recipe['name']}-{k[0]}"))

    t_hf = median_time(export, repeats)
    return precompile.open(index), export.hf.with_format("numpy", dtype=None), t_hf


def array_rows(tmp_p: Path, quick: bool, repeats: int) -> None:
    import datasets

    from precompile.hf import shapes

    rows = []
    for name, recipe in array_inputs(tmp_p / "arrays", quick).items():
        ds, hf, t_hf = built_and_exported(recipe, tmp_p, "out-arrays", repeats)
        for f, shape in shapes(hf).items():
            dtype = ds.field_specs[f]["dtype"]
            values = [ds[i][f] for i in range(len(ds))]
            stored = sum(v.nbytes for v in values)
            assert all(hf[i][f].reshape(shape).tobytes() == values[i].tobytes() and hf[i][f].dtype == values[i].dtype
                       for i in range(len(ds)))
            arr = getattr(datasets, f"Array{len(shape)}D")(shape=shape, dtype=dtype)
            old = datasets.Dataset.from_dict({f: values}, features=datasets.Features({f: arr}))
            nested = datasets.Dataset.from_dict({f: values}, features=datasets.Features({f: nested_fixed(shape, dtype)}))
            old_np = old.with_format("numpy", dtype=None)
            nested_np = nested.with_format("numpy", dtype=None)
            t_new = median_time(lambda: [hf[i][f].reshape(shape) for i in range(len(ds))], repeats)
            t_old = median_time(lambda: [old_np[i][f] for i in range(len(ds))], repeats)
            t_nested = median_time(lambda: [nested_np[i][f] for i in range(len(ds))], repeats)
            col = hf.data.column(f).nbytes
            old_col, nested_col = old.data.column(f).nbytes, nested.data.column(f).nbytes
            rows.append((f"{name}: {f} {'x'.join(map(str, shape))} {dtype}", len(ds), stored, col, col / stored,
                         old_col, old_col / stored, nested_col, nested_col / stored, t_hf,
                         t_new / len(ds) * 1e3, t_old / len(ds) * 1e3, t_nested / len(ds) * 1e3))
    print(f"fixed-shape arrays; medians of {repeats}")
    print("| field | samples | build bytes | to_hf (flat List) | x build | ArrayND (before) | x build "
          "| nested fixed Lists | x build | to_hf s | read ms/row: to_hf | ArrayND | nested |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]:,} | {r[4]:.2f} | {r[5]:,} | {r[6]:.2f} | {r[7]:,} | {r[8]:.2f} "
              f"| {r[9]:.3f} | {r[10]:.2f} | {r[11]:.2f} | {r[12]:.2f} |")


def variable_inputs(root: Path, quick: bool) -> dict[str, dict]:
    """Flow files and videos of three sizes each, random content, and their recipes without a resize."""
    import av

    from precompile.decoders.flo import write_flo

    rng = np.random.default_rng(1)
    n_flow, flow_sizes = (8, [(32, 48), (40, 56), (24, 64)]) if quick else (48, [(128, 192), (96, 160), (144, 208)])
    n_vid, vid_sizes, n_frames = (3, [(32, 32), (24, 40), (40, 24)], 16) if quick else \
        (12, [(64, 64), (48, 80), (80, 48)], 32)
    for d in ("flow", "video"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for i in range(n_flow):
        fh, fw = flow_sizes[i % len(flow_sizes)]
        f = rng.normal(0, 3, (fh, fw, 2)).astype(np.float32)
        f[fh // 4:fh // 2, fw // 4:fw // 2] = np.nan
        write_flo(str(root / "flow" / f"{i:03d}.flo"), f)
    for i in range(n_vid):
        vh, vw = vid_sizes[i % len(vid_sizes)]
        with av.open(str(root / "video" / f"{i:03d}.mp4"), "w") as c:
            s = c.add_stream("libx264", rate=25)
            s.width, s.height, s.pix_fmt = vw, vh, "yuv420p"
            for _ in range(n_frames):
                frame = rng.integers(0, 256, (vh, vw, 3), dtype=np.uint8)
                for pkt in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
    return {
        "variable flow": {"name": "vflow", "inputs": {"root": str(root / "flow"), "match": "{name}.flo",
                                                      "fields": {"flow": {"decoder": "flo", "valid_mask": True}}},
                          "output": {"format": "hdf5", "samples_per_shard": 16}},
        "variable clips": {"name": "vvideo", "inputs": {"root": str(root / "video"), "match": "{name}.mp4",
                                                        "fields": {"video": {"decoder": "video", "mode": "rgb8"}}},
                           "steps": [{"clips": {"length": 8, "stride": 8}}],
                           "output": {"format": "hdf5", "samples_per_shard": 16}},
    }


def shape_column_bytes(shapes_: list[tuple[int, ...]], plan: list) -> dict[str, float]:
    """Bytes a row of a shape column in each layout, from the same shapes."""
    import datasets

    rank, varying = len(plan), [k for k, n in enumerate(plan) if n is None]
    layouts = {
        "int32 fixed (written)": (datasets.List(datasets.Value("int32"), length=rank), shapes_),
        "int64 fixed": (datasets.List(datasets.Value("int64"), length=rank), shapes_),
        "int32 list": (datasets.List(datasets.Value("int32")), shapes_),
        "int32 varying dims": (datasets.List(datasets.Value("int32"), length=len(varying)),
                               [tuple(s[k] for k in varying) for s in shapes_]),
    }
    out = {}
    for name, (feat, rows) in layouts.items():
        t = datasets.Dataset.from_dict({"s": [list(r) for r in rows]}, features=datasets.Features({"s": feat}))
        out[name] = t.data.column("s").nbytes / len(rows)
    return out


def variable_rows(tmp_p: Path, quick: bool, repeats: int) -> None:
    import datasets

    from precompile.hf import array, shapes

    rows, alts = [], []
    for name, recipe in variable_inputs(tmp_p / "variable", quick).items():
        ds, hf, t_hf = built_and_exported(recipe, tmp_p, "out-variable", repeats)
        for f, plan in shapes(hf).items():
            dtype = ds.field_specs[f]["dtype"]
            values = [ds[i][f] for i in range(len(ds))]
            stored = sum(v.nbytes for v in values)
            assert all(array(hf, hf[i], f).tobytes() == values[i].tobytes() and array(hf, hf[i], f).shape ==
                       values[i].shape and hf[i][f].dtype == values[i].dtype for i in range(len(ds)))
            feat: object = datasets.Value(dtype)
            for _ in plan:
                feat = datasets.List(feat)      # what to_hf wrote before: nested variable lists
            old = datasets.Dataset.from_dict({f: values}, features=datasets.Features({f: feat}))
            old_np = old.with_format("numpy", dtype=None)
            sc = f + "__shape"
            t_new = median_time(lambda: [array(hf, hf[i], f) for i in range(len(ds))], repeats)
            t_hand = median_time(lambda: [(r := hf[i])[f].reshape(r[sc]) for i in range(len(ds))], repeats)
            t_old = median_time(lambda: [old_np[i][f] for i in range(len(ds))], repeats)
            col = hf.data.column(f).nbytes + hf.data.column(sc).nbytes
            old_col = old.data.column(f).nbytes
            sizes = sorted({"x".join(map(str, v.shape)) for v in values})
            label = f"{name}: {f} {'x'.join('?' if n is None else str(n) for n in plan)} {dtype} ({', '.join(sizes)})"
            rows.append((label, len(ds), stored, col, col / stored, old_col, old_col / stored, t_hf,
                         t_new / len(ds) * 1e3, t_hand / len(ds) * 1e3, t_old / len(ds) * 1e3))
            alts.append((f"{name}: {f}", shape_column_bytes([v.shape for v in values], list(plan))))
    print(f"variable-shape arrays; medians of {repeats}")
    print("| field | samples | build bytes | to_hf (List + shape) | x build | nested Lists (before) | x build "
          "| to_hf s | read ms/row: to_hf (array) | to_hf (by hand) | nested |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]:,} | {r[4]:.3f} | {r[5]:,} | {r[6]:.2f} | {r[7]:.3f} "
              f"| {r[8]:.2f} | {r[9]:.2f} | {r[10]:.2f} |")
    names = list(alts[0][1])
    print("\nshape column, bytes a row (Arrow column bytes / rows)")
    print("| field | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, b in alts:
        print(f"| {label} | " + " | ".join(f"{b[n]:.2f}" for n in names) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["images", "arrays", "variable"])
    a = ap.parse_args()
    if importlib.util.find_spec("datasets") is None:
        print("datasets is not installed (pip install 'precompile[hf]'): nothing to measure")
        return
    warnings.simplefilter("ignore")
    import datasets

    datasets.disable_progress_bars()
    n, size = (24, (64, 64)) if a.quick else (200, (128, 128))
    with tempfile.TemporaryDirectory() as tmp:
        if a.only in (None, "images"):
            image_rows(Path(tmp), n, size, a.repeats)
        if a.only in (None, "arrays"):
            array_rows(Path(tmp), a.quick, a.repeats)
        if a.only in (None, "variable"):
            variable_rows(Path(tmp), a.quick, a.repeats)


if __name__ == "__main__":
    main()
