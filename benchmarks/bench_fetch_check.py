"""The cost of checking a fetched remote input against the plan's listing (``storage/remote.py``
``local_copy``): one ``info`` (a HEAD) after each file's GET, and one LIST after a folder's GETs, against the
same fetches with no check, measured in the same run.

The store is moto's S3 server in its own process on 127.0.0.1 (``python -m moto.server``): a loopback
network and moto's in-memory store, so the numbers are precompile's request pattern plus moto's CPU; a real
store's latency adds to both sides (a HEAD costs about one round trip, a GET of a small object about one more).

    PYTHONPATH=. python benchmarks/bench_fetch_check.py [--files 60] [--size 20000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_remote_build import start_moto  # noqa: E402
from timing import median_time  # noqa: E402

BUCKET = "bench-fetch"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=60)
    p.add_argument("--size", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    proc, endpoint = start_moto()
    try:
        import boto3

        from precompile.storage.remote import LISTED, list_tree, local_copy

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        prefix = uuid.uuid4().hex[:8]
        body = os.urandom(a.size)
        for i in range(a.files):
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/d/{i // 10}/{i:04d}.bin", Body=body)
        opts = {"endpoint_url": endpoint}
        root = f"s3://{BUCKET}/{prefix}"
        files = list_tree(root, False, opts)
        folders = list_tree(root, True, opts)

        def fetch_files(check: bool) -> None:
            for rel in files:
                url = f"{root}/{rel}"
                fp = LISTED[url] if check else ["remote", None, a.size, None]   # size only: no request
                with local_copy(url, opts, listed=fp):
                    pass

        def fetch_folders(check: bool) -> None:
            for rel in [f for f in folders if f.count("/") == 1]:
                url = f"{root}/{rel}"
                if check:
                    with local_copy(url, opts, folder=True):
                        pass
                else:
                    saved = LISTED.pop(url)   # unlisted: one LIST, then the GETs, no LIST after
                    try:
                        with local_copy(url, opts, folder=True):
                            pass
                    finally:
                        LISTED[url] = saved

        print(f"{a.files} objects of {a.size} bytes, medians of {a.repeats}")
        for name, fn in (("files", fetch_files), ("folders of 10", fetch_folders)):
            fn(True)   # warm the client
            off = median_time(lambda: fn(False), a.repeats)
            on = median_time(lambda: fn(True), a.repeats)
            print(f"{name:>14}: unchecked {off * 1e3:8.1f} ms, checked {on * 1e3:8.1f} ms, ratio {on / off:.2f}")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
