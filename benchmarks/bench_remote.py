"""Reading a build from object storage: the Loader over a moto S3 server on loopback against the same build read
locally, and LitData's StreamingDataset from the same server.

Two builds made by ``precompile.build`` from generated PNGs: ``--small`` (5,000) samples of 64x64x3 in shards of 128
(about 1.5 MiB each) and ``--large`` (300) samples of 256x256x3 in shards of 16 (3 MiB each), uploaded to a moto
server started in its own process on 127.0.0.1 (so its Python does not share this process's GIL).

Per build and shuffle (``shard``: shards in random order, ``block_window`` of them mixed; ``full``), epochs of
batches of 256 (64 px) or 32 (256 px), CPU, default threads:

- ``local`` (the baseline): ``Loader(index)`` over the local build, warm page cache;
- ``url cold``: ``Loader(url, cache_dir=<empty folder>)``, the first epoch (every shard fetched while reading),
  with prefetch (default ``fetch_ahead``) and without (``fetch_ahead=0``: each shard fetched by the gather that
  needs it);
- ``url warm``: the next epochs of the same Loader (every shard in the cache: mapped files, as local).

Then the cache against ``cache_limit`` over two epochs with a limit of half the build: the bytes in the
cache folder plus those of unlinked files still mapped by this process (``/proc/self/maps``: blocks the limit
could not see), sampled after every batch; and how many shard downloads an epoch took (``shard`` order reads
each shard in one stretch; ``block`` visits a shard's chunks at random places of the epoch).

LitData 0.2.76 (optional: ``pip install litdata``; skipped when absent): the same samples written with
``litdata.optimize`` to a local folder (chunks of about the shard size), uploaded to the same server and
streamed with ``StreamingDataset(s3://..., shuffle=True)`` in a ``DataLoader(batch_size, num_workers=0)`` with
its own cache: cold (a fresh cache folder) and warm (the next epoch); and the local folder itself.

Medians of ``--repeats`` cold epochs (each from a fresh cache folder) and of 5 warm epochs per repeat
(``local``, ``url warm``), the contenders taking turns; samples/s and the ratio to the local Loader measured in
the same run.

    PYTHONPATH=. python benchmarks/bench_remote.py [--quick] [--small 5000] [--large 300] [--repeats 5] [--step-ms 20]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import precompile  # noqa: E402
from precompile.errors import CacheError  # noqa: E402
from precompile.storage.shard_cache import ShardCache  # noqa: E402

BUCKET = "bench-remote"
#: warm epochs (local, and from the cache) per repeat: they are short, so several
WARM = 5


def make_build(root: Path, name: str, n: int, size: int, per_shard: int) -> tuple[Path, np.ndarray]:
    """``n`` random RGB PNGs of ``size`` px built into ``per_shard``-sample shards; (index, the build's images)."""
    from PIL import Image

    rng = np.random.default_rng(size)
    for i in range(n):
        d = root / "in" / name / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f"{i:06d}.png",
                                                                                      compress_level=0)
    recipe = {"name": name, "seed": 0,
              "inputs": {"root": str(root / "in" / name), "match": "{label}/{name}.png",
                         "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
              "steps": [{"resize": {"size": [size, size]}}],
              "output": {"format": "hdf5", "samples_per_shard": per_shard}}
    precompile.build(recipe, out_dir=str(root / "out" / name), n_jobs=2)
    index = root / "out" / name / f"{name}.h5"
    return index, precompile.open(index).batch(range(n))["image"]


class Moto:
    """A moto S3 server in its own process on 127.0.0.1, a bucket, and a boto3 client."""

    def __enter__(self) -> "Moto":
        import boto3

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        self.client = boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test",
                                   aws_secret_access_key="test", region_name="us-east-1")
        for _ in range(200):
            try:
                self.client.create_bucket(Bucket=BUCKET)
                break
            except Exception:  # noqa: BLE001  (not listening yet)
                time.sleep(0.05)
        return self

    def upload(self, local: Path, prefix: str) -> None:
        for p in sorted(local.rglob("*")):
            if p.is_file():
                self.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{p.relative_to(local).as_posix()}",
                                       Body=p.read_bytes())

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.wait()


def epoch_rate(loader: Any, epoch: int, on_batch: Callable[[], None] | None = None) -> float:
    """samples/s of one epoch of ``loader``."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    t0, n = time.perf_counter(), 0
    for b in loader:
        n += int((b["image"] if isinstance(b, dict) else b[0]).shape[0])
        if on_batch is not None:
            on_batch()
    return n / (time.perf_counter() - t0)


def loader_rows(index: Path, url: str, so: dict, tmp: Path, shuffle: str, bs: int, repeats: int,
                step_s: float = 0.0) -> list[tuple[str, float]]:
    """(contender, median samples/s) for the local Loader and the URL Loader cold (with and without prefetch)
    and warm; ``step_s``: a training step per batch (a sleep: the GIL is free, as while a GPU works)."""
    from precompile.reader.loader import Loader

    kw = dict(batch_size=bs, shuffle=shuffle, device="cpu", block_window=2 if shuffle == "shard" else 8)
    step = (lambda: time.sleep(step_s)) if step_s else None
    local = Loader(str(index), **kw)
    epoch_rate(local, 0)   # page cache warm
    rates: dict[str, list[float]] = {"local": [], "url cold, prefetch": [], "url cold, fetch_ahead=0": [],
                                     "url warm": []}
    for r in range(repeats):   # in turns, so that load changes hit every contender alike
        loaders = {}
        for name, ahead in (("url cold, fetch_ahead=0", 0), ("url cold, prefetch", None)):
            cache = tmp / f"cache-{index.stem}-{shuffle}-{r}-{ahead}"
            loaders[name] = Loader(url, cache_dir=cache, storage_options=so, fetch_ahead=ahead, **kw)
            rates[name].append(epoch_rate(loaders[name], WARM * r, step))
        warm = loaders["url cold, prefetch"]
        for e in range(1, WARM + 1):   # local and warm epochs alternate
            rates["local"].append(epoch_rate(local, WARM * r + e, step))
            rates["url warm"].append(epoch_rate(warm, WARM * r + e, step))
        for name, ld in loaders.items():
            ld.close()
            shutil.rmtree(ld.ds.remote.cache.root)
    local.close()
    return [(k, statistics.median(v)) for k, v in rates.items()]


def server_limit(moto: "Moto", prefix: str, n: int, repeats: int) -> float:
    """samples/s at which the server hands out the build's shard objects to 4 threads of boto3 GETs (the most
    any reader gets from it)."""
    from concurrent.futures import ThreadPoolExecutor

    keys = [o["Key"] for o in moto.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]
            if ".shards/" in o["Key"]]

    def get(k: str) -> int:
        return len(moto.client.get_object(Bucket=BUCKET, Key=k)["Body"].read())

    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(get, keys))
        ts.append(time.perf_counter() - t0)
    return n / statistics.median(ts)


def mapped_deleted_bytes(cache: Path) -> int:
    """Bytes of this process's maps of cache files that were unlinked (the kernel keeps their blocks)."""
    total = 0
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    for ln in lines:
        if str(cache) in ln and ln.endswith("(deleted)"):
            lo, hi = (int(x, 16) for x in ln.split()[0].split("-"))
            total += hi - lo
    return total


def cache_rows(index: Path, url: str, so: dict, tmp: Path, bs: int) -> list[tuple[str, ...]]:
    """Peak cache bytes (folder + unlinked-but-mapped) over two epochs with a limit of half the build, and
    the shard downloads per epoch, for shard and block order."""
    from precompile.reader.loader import Loader

    build = sum(e["bytes"] for e in precompile.open(index).shards)
    limit = build // 2
    rows = []
    for shuffle in ("shard", "block"):
        cache = tmp / f"cache-limit-{index.stem}-{shuffle}"
        try:
            ld = Loader(url, batch_size=bs, shuffle=shuffle, block_window=2, device="cpu", cache_dir=cache,
                        cache_limit=limit, storage_options=so)
        except CacheError as e:   # the batches in flight need more than the limit: say how much
            need = str(e).split(" read ", 1)[1].split(" of shards", 1)[0]
            rows.append((shuffle, _mib(build), _mib(limit), f"refused: the batches in flight read {need}",
                         "", "", "", ""))
            continue
        c, peak, hidden = ShardCache(cache), [0], [0]

        def sample() -> None:
            hidden[0] = max(hidden[0], mapped_deleted_bytes(cache))
            peak[0] = max(peak[0], c.usage() + mapped_deleted_bytes(cache))

        stats, before = ld.ds.remote.cache.stats, ld.ds.remote.cache.stats.downloads
        rate = [epoch_rate(ld, e, sample) for e in range(2)]
        per_epoch = (stats.downloads - before) / 2
        rows.append((shuffle, _mib(build), _mib(limit), _mib(peak[0]), f"{peak[0] / limit:.2f}", _mib(hidden[0]),
                     f"{per_epoch:.0f} / {len(ld.ds.shards)}", f"{statistics.median(rate):,.0f}"))
        ld.close()
        shutil.rmtree(cache)
    return rows


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.1f}"


def litdata_rows(images: np.ndarray, moto: Moto, so: dict, tmp: Path, name: str, chunk_bytes: int, bs: int,
                 repeats: int) -> list[tuple[str, float]]:
    """(contender, median samples/s) of LitData's StreamingDataset: from the server cold and warm, and local."""
    try:
        import litdata
    except ImportError:
        print("(litdata is not installed: pip install litdata; its rows are skipped)")
        return []
    import torch

    out = tmp / f"litdata-{name}"
    if not out.exists():
        litdata.optimize(fn=_litdata_item, inputs=[(images, i) for i in range(len(images))], output_dir=str(out),
                         chunk_bytes=chunk_bytes, num_workers=1, mode="overwrite")
        moto.upload(out, f"litdata-{name}")
    lso = {"endpoint_url": so["endpoint_url"], "aws_access_key_id": "test", "aws_secret_access_key": "test"}
    try:   # LitData's default downloader (obstore) refuses http:// endpoints: allow it, for the loopback server only
        import litdata.streaming.downloader as dl

        dl._OBSTORE_CLIENT_OPTIONS = {**dl._OBSTORE_CLIENT_OPTIONS, "allow_http": True}
    except (ImportError, AttributeError):
        pass

    def loader(src: str, cache: Path | None) -> Any:
        ds = litdata.StreamingDataset(src, cache_dir=str(cache) if cache else None, shuffle=True,
                                      storage_options=lso if src.startswith("s3://") else None)
        return torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=0)

    rates: dict[str, list[float]] = {"litdata url cold": [], "litdata url warm": [], "litdata local": []}
    for r in range(repeats):
        cache = tmp / f"litcache-{name}-{r}"
        dl = loader(f"s3://{BUCKET}/litdata-{name}", cache)
        rates["litdata url cold"].append(epoch_rate(dl, r))
        rates["litdata url warm"].append(epoch_rate(dl, r + 1))
        shutil.rmtree(cache, ignore_errors=True)
        rates["litdata local"].append(epoch_rate(loader(str(out), None), r))
    return [(k, statistics.median(v)) for k, v in rates.items()]


def _litdata_item(item: tuple[np.ndarray, int]) -> dict:
    images, i = item
    return {"image": images[i], "label": i % 4}


def table(title: str, head: Iterable[str], rows: Iterable[Iterable[Any]]) -> None:
    head = list(head)
    print(f"\n{title}\n\n| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=5000, help="64x64x3 samples")
    ap.add_argument("--large", type=int, default=300, help="256x256x3 samples")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the training step of the prefetch table")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.small, a.large, a.repeats = 1500, 96, 1
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as t, Moto() as moto:
        tmp = Path(t)
        so = {"endpoint_url": moto.url, "key": "test", "secret": "test"}
        for name, n, size, per, bs in (("small", a.small, 64, 128, 256), ("large", a.large, 256, 16, 32)):
            index, images = make_build(tmp, name, n, size, per)
            moto.upload(index.parent, name)
            url = f"s3://{BUCKET}/{name}/{name}.h5"
            ds = precompile.open(index)
            nbytes = sum(e["bytes"] for e in ds.shards)
            desc = f"{n} samples of {size}x{size}x3 in {len(ds.shards)} shards ({_mib(nbytes)} MiB), batches of {bs}"
            for shuffle in ("shard", "full"):
                rows = loader_rows(index, url, so, tmp, shuffle, bs, a.repeats)
                base = rows[0][1]
                rows.insert(1, ("server: GET every shard, 4 threads", server_limit(moto, name, n, a.repeats)))
                if shuffle == "full":
                    rows += litdata_rows(images, moto, so, tmp, name, nbytes // len(ds.shards), bs, a.repeats)
                table(f"{desc}, shuffle={shuffle!r}: median samples/s", ["contender", "samples/s", "x local"],
                      [(k, f"{v:,.0f}", f"{v / base:.2f}") for k, v in rows])
            step = a.step_ms / 1000
            rows = loader_rows(index, url, so, tmp, "shard", bs, a.repeats, step)
            table(f"{desc}, shuffle='shard', a training step of {a.step_ms:g} ms per batch: median epoch seconds "
                  f"(the step alone: {step * -(-n // bs):.2f} s)", ["contender", "epoch s", "x local"],
                  [(k, f"{n / v:.2f}", f"{rows[0][1] / v:.2f}") for k, v in rows])
            table(f"{desc}: the cache over two epochs, cache_limit half the build",
                  ["shuffle", "build MiB", "limit MiB", "peak MiB (folder + unlinked maps)", "peak / limit",
                   "unlinked but mapped, MiB", "downloads per epoch / shards", "samples/s"],
                  cache_rows(index, url, so, tmp, bs))


if __name__ == "__main__":
    main()
