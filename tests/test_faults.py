"""Faults a real machine produces, told as they are, with nothing built before lost (issue 23).

Disk full (a real tmpfs where ``mount`` works, else ``RLIMIT_FSIZE``), the plan's size against the free
space, a worker killed by SIGKILL (the OOM killer's signal, sent by a test step to its own worker), readers
looping during rebuilds that move every row, a reader opened before a rebuild, truncated and bit-flipped
shards, inputs and the output folder vanishing mid-build, a read-only output folder, output URLs that cannot be
written (a URL output itself: tests/test_remote_output.py), an
old-format build, and ``precompile gc``. Each asserts the message, the exit code and that the previous build
still reads back correctly.

Every image's pixels encode its key (``img_1234`` -> channel 0 = 1234 % 256, channel 1 = 1234 // 256), so a
reader can tell a sample whose data is not its key's.
"""
from __future__ import annotations

import contextlib
import json
import os
import importlib.util
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import precompile
from conftest import REPO, index_shards, shard_file
from precompile.storage import faults
from precompile.errors import BuildError, FormatError, MissingDependencyError, OutputError
from precompile.tools.verify import verify

PLUGIN = "pcfault_plug"
PLUGIN_SRC = '''"""Test-only faults: a step that SIGKILLs its own worker, a decoder that removes a file as it decodes."""
import os
import shutil
import signal

from precompile.decoders.image import ImageDecoder
from precompile.registry import DECODERS, STEPS
from precompile.transforms import Step


@STEPS.register()
class SigkillTest(Step):
    """Identity, except in a worker process (not the build's own) when PCFAULT_KILL is set: SIGKILL itself."""

    name = "sigkill_test"
    kinds = frozenset({"image"})

    def output_spec(self, spec):
        return spec

    def apply(self, array, kind, **params):
        if os.environ.get("PCFAULT_KILL") and str(os.getpid()) != os.environ.get("PCFAULT_MAIN"):
            os.kill(os.getpid(), signal.SIGKILL)
        return array


@DECODERS.register()
class VanishTest(ImageDecoder):
    """The image decoder; the first read removes the path in PCFAULT_VANISH (a file or a folder)."""

    name = "vanish_test"

    def read(self, path):
        victim = os.environ.get("PCFAULT_VANISH")
        if victim and os.path.exists(victim):
            shutil.rmtree(victim) if os.path.isdir(victim) else os.remove(victim)
        return super().read(path)
'''


def _img(path: Path, n: int) -> None:
    from PIL import Image

    a = np.zeros((8, 8, 3), np.uint8)
    a[..., 0], a[..., 1], a[..., 2] = n % 256, n // 256, 77
    Image.fromarray(a).save(path)


def _matches(key: str, a: np.ndarray) -> bool:
    n = int(key.rsplit("_", 1)[1].split(".")[0])
    return a.shape == (8, 8, 3) and bool((a[..., 0] == n % 256).all() and (a[..., 1] == n // 256).all()
                                        and (a[..., 2] == 77).all())


def _check_all(index) -> int:
    """Open the build at ``index`` and check every sample's pixels against its key; returns the count."""
    ds = precompile.open(index)
    try:
        for i in range(len(ds)):
            assert _matches(ds.key(i), ds[i]["image"]), ds.key(i)
        return len(ds)
    finally:
        ds.close()


@pytest.fixture
def proj(tmp_path):
    """40 keyed images (img_1000..img_1039), a recipe folder with the fault plugin, and a recipe writer."""
    root = tmp_path / "in"
    root.mkdir()
    for n in range(1000, 1040):
        _img(root / f"img_{n:04d}.png", n)
    (tmp_path / f"{PLUGIN}.py").write_text(PLUGIN_SRC)

    def recipe(fmt: str = "hdf5", decoder: str = "image", steps=(), per: int = 8, name: str = "r.yaml",
               size: int = 8) -> str:
        plugin = decoder != "image" or bool(steps)   # only then: the plugin's names stay out of this process
        data = {"name": "flt", "seed": 1, "imports": [PLUGIN] if plugin else [],
                "inputs": {"root": str(root), "match": "{name}.png", "fields": {"image": {"decoder": decoder}}},
                "steps": [{"resize": {"size": [size, size]}}] + list(steps), "output": {"format": fmt, "samples_per_shard": per}}
        p = tmp_path / name
        p.write_text(yaml.safe_dump(data))
        return str(p)

    return tmp_path, root, recipe


def _cli(*args: str, env_extra: dict | None = None, preexec=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``precompile`` in a fresh process; PCFAULT_MAIN is that process's own pid (the plugin's kill spares it)."""
    run = "import os, runpy; os.environ['PCFAULT_MAIN'] = str(os.getpid()); runpy.run_module('precompile', run_name='__main__')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", run, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, preexec_fn=preexec)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, ro: bool = False):
    """A tmpfs of ``size`` mounted at ``path`` (CI runs as root); skips when mounting is not allowed."""
    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _can_mount(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True)
    if r.returncode == 0:
        subprocess.run(["umount", "-l", str(probe)], capture_output=True)
    return r.returncode == 0


def _no_crash(r: subprocess.CompletedProcess) -> None:
    assert r.returncode >= 0, f"killed by signal {-r.returncode}: {r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and "Segmentation" not in r.stderr, r.stderr[-2000:]
    assert "on_error: skip" not in r.stderr and "fix the input" not in r.stderr, r.stderr


# --- disk full -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("jobs", ["1", "2"])
def test_disk_full_is_an_output_error_and_keeps_the_previous_build(proj, jobs):
    tmp, root, recipe = proj
    small = recipe()
    big = recipe(size=240, name="big.yaml")   # ~6.9 MB of pixels
    if _can_mount(tmp):
        ctx, preexec, want = _tmpfs(tmp / "mnt", "4m"), None, "is out of space"
    else:  # no mount: a file size limit instead (SIGXFSZ ignored, so a write past it is EFBIG)
        def preexec():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        ctx, want = contextlib.nullcontext(tmp / "mnt"), "over the file size limit"
    with ctx as mnt:
        out = mnt / "out"
        r = _cli("build", small, "-o", str(out), "-j", jobs, "--no-progress")
        assert r.returncode == 0, r.stderr
        assert _check_all(out / "flt.h5") == 40
        before = {n: p.read_bytes() for n, p in index_shards(out / "flt.h5").items()}
        index_bytes = (out / "flt.h5").read_bytes()
        # the plan's estimate against the free space: refused before anything is written, with both numbers
        if preexec is None:
            r = _cli("build", big, "-o", str(out), "-j", jobs, "--no-progress")
            assert r.returncode == OutputError.exit_code, r.stderr
            assert f"error: not enough space in {out}: the build needs about " in r.stderr
            assert "bytes for 5 shard(s) to write)" in r.stderr and "free; free some space" in r.stderr
            assert "--force-space" in r.stderr
            _no_crash(r)
        # forced past the estimate: the disk fills while shards are written; an exception, not a crash
        r = _cli("build", big, "-o", str(out), "-j", jobs, "--no-progress", "--force-space", preexec=preexec)
        _no_crash(r)
        assert r.returncode == OutputError.exit_code, r.stderr
        assert f"error: output folder {out} {want}: " in r.stderr
        assert "the inputs are fine: nothing built before is lost" in r.stderr
        # nothing lost: the old index and shards are untouched and read back correctly; no temporaries left
        assert (out / "flt.h5").read_bytes() == index_bytes
        assert {n: p.read_bytes() for n, p in index_shards(out / "flt.h5").items()} == before
        assert _check_all(out / "flt.h5") == 40 and verify(out / "flt.h5").ok
        assert not list((out / "flt.shards").glob("*.tmp-*"))


def test_space_check_in_process_and_force_space(proj, monkeypatch):
    tmp, root, recipe = proj
    monkeypatch.setattr(faults, "free_bytes", lambda folder: 1000)
    with pytest.raises(OutputError, match=r"not enough space in .*: the build needs about .* \(\d+ bytes for 5 "
                                          r"shard\(s\) to write\), 1000 B \(1000 bytes\) free"):
        precompile.build(recipe(), tmp / "out")
    assert not (tmp / "out" / "flt.h5").exists()
    rep = precompile.build(recipe(), tmp / "out", force_space=True)
    assert rep["shards"]["built"] == 5 and _check_all(tmp / "out" / "flt.h5") == 40


# --- worker killed ---------------------------------------------------------------------------------------

def test_worker_sigkilled_is_told_as_memory_not_an_input(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    assert _cli("build", recipe(), "-o", str(out), "--no-progress").returncode == 0
    index_bytes = (out / "flt.h5").read_bytes()
    r = _cli("build", recipe(steps=[{"sigkill_test": {}}], name="kill.yaml"), "-o", str(out), "-j", "2", "--no-progress",
             env_extra={"PCFAULT_KILL": "1"})
    _no_crash(r)
    assert r.returncode == 7, r.stderr
    assert "its worker process was killed (exit" in r.stderr and "SIGKILL" in r.stderr
    assert "out-of-memory killer" in r.stderr and "Use fewer jobs (-j) or a smaller output.samples_per_shard" in r.stderr
    assert (out / "flt.h5").read_bytes() == index_bytes and _check_all(out / "flt.h5") == 40


# --- readers during rebuilds -----------------------------------------------------------------------------

READER = r'''
import json, os, sys
import numpy as np
import precompile
index, stop, report = sys.argv[1:4]

def matches(key, a):
    n = int(key.rsplit("_", 1)[1].split(".")[0])
    return a.shape == (8, 8, 3) and bool((a[..., 0] == n % 256).all() and (a[..., 1] == n // 256).all())

opens = reads = errors = wrong = 0
sizes, msgs = set(), []
while not os.path.exists(stop):
    try:
        ds = precompile.open(index)
        opens += 1
        sizes.add(len(ds))
        for i in range(len(ds)):
            key = ds.key(i)
            reads += 1
            if not matches(key, ds[i]["image"]):
                wrong += 1
                msgs.append(f"row {i} key {key}: pixels of another key")
        b = ds.batch(list(range(len(ds)))[::-1])["image"]
        for j, i in enumerate(range(len(ds) - 1, -1, -1)):
            if not matches(ds.key(i), b[j]):
                wrong += 1
        ds.close()
    except Exception as e:
        errors += 1
        msgs.append(f"{type(e).__name__}: {e}")
with open(report, "w") as f:
    json.dump({"opens": opens, "reads": reads, "errors": errors, "wrong": wrong, "sizes": sorted(sizes),
               "msgs": msgs[:5]}, f)
'''


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_reader_looping_during_rebuilds_that_move_every_row(proj, fmt):
    tmp, root, recipe = proj
    rec = recipe(fmt=fmt)
    out = tmp / "out"
    index = out / ("flt.h5" if fmt == "hdf5" else "flt.json")
    precompile.build(rec, out)
    (tmp / "reader.py").write_text(READER)
    stop, report = tmp / "stop", tmp / "reader.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(tmp / "reader.py"), str(index), str(stop), str(report)], env=env)
    try:
        time.sleep(1.0)
        for k in range(4):   # each rebuild adds an input that sorts first: every row moves, every shard changes
            _img(root / f"img_{999 - k:04d}.png", 999 - k)
            rep = precompile.build(rec, out)
            assert rep["shards"]["skipped"] == 0 and rep["shards"]["built"] == 6
            time.sleep(0.3)
        time.sleep(0.5)
    finally:
        stop.write_text("")
        proc.wait(timeout=120)
    res = json.loads(report.read_text())
    assert res["errors"] == 0 and res["wrong"] == 0, res
    assert res["opens"] >= 5 and len(res["sizes"]) >= 2, res   # it did read across snapshots
    assert _check_all(index) == 44


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_reader_opened_before_a_rebuild_keeps_the_old_samples(proj, fmt):
    tmp, root, recipe = proj
    rec = recipe(fmt=fmt)
    out = tmp / "out"
    index = out / ("flt.h5" if fmt == "hdf5" else "flt.json")
    precompile.build(rec, out)
    old = precompile.open(index)        # no shard opened yet
    _img(root / "img_0999.png", 999)    # sorts first: every row of the new build moves by one
    assert precompile.build(rec, out)["shards"]["skipped"] == 0
    new = precompile.open(index)
    assert len(old) == 40 and len(new) == 41 and new.key(0) == "img_0999.png" and old.key(0) == "img_1000.png"
    for i in range(len(old)):
        assert _matches(old.key(i), old[i]["image"]), old.key(i)
        assert _matches(new.key(i), new[i]["image"]), new.key(i)
    # a second rebuild removes the first snapshot when it starts: a reader still on it is told to reopen
    stale = precompile.open(index)      # on the second snapshot, no shard opened
    _img(root / "img_0998.png", 998)
    precompile.build(rec, out)
    _img(root / "img_0997.png", 997)
    precompile.build(rec, out)
    with pytest.raises(FormatError, match=r"the shard file is gone: the output was rebuilt since .* was opened.*"
                                          r"open the output again"):
        stale[0]
    for ds in (old, new, stale):
        ds.close()
    assert _check_all(index) == 43


def test_hdf5_reader_with_its_shards_open_survives_gc_all(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    precompile.build(recipe(), out)
    ds = precompile.open(out / "flt.h5")
    first = [ds[i]["image"].copy() for i in range(len(ds))]        # every shard opened
    _img(root / "img_0999.png", 999)
    precompile.build(recipe(), out)
    old_files = json.loads((out / "flt.shards" / "previous.json").read_text())["files"]
    assert len(old_files) == 5 and all((out / "flt.shards" / n).exists() for n in old_files)
    r = _cli("gc", str(out / "flt.h5"), "--dry-run")
    assert r.returncode == 0 and "would remove 0 unreferenced file(s)" in r.stdout, r.stdout + r.stderr
    (out / "flt.shards" / "stray-file").write_bytes(b"x" * 10)
    r = _cli("gc", str(out / "flt.h5"))
    assert r.returncode == 0 and "removed stray-file" in r.stdout and "removed 1 unreferenced file(s)" in r.stdout
    r = _cli("gc", str(out / "flt.h5"), "--all")
    assert r.returncode == 0 and "removed 5 unreferenced file(s)" in r.stdout, r.stdout + r.stderr
    assert not any((out / "flt.shards" / n).exists() for n in old_files)
    for i in range(len(ds)):   # unlinked, still open: the old samples, unchanged
        assert np.array_equal(ds[i]["image"], first[i]) and _matches(ds.key(i), first[i])
    ds.close()
    assert _check_all(out / "flt.h5") == 41 and verify(out / "flt.h5").ok


# --- damaged shards --------------------------------------------------------------------------------------

def test_truncated_shard_is_named_and_rebuilt_alone(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    precompile.build(recipe(), out)
    victim = shard_file(out / "flt.h5", 2)
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2])
    r = _cli("verify", str(out / "flt.h5"))
    assert r.returncode == FormatError.exit_code and f"flt.shards/{victim.name}: size" in r.stderr
    rep = precompile.build(recipe(), out)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 4
    assert victim.read_bytes() == good and _check_all(out / "flt.h5") == 40 and verify(out / "flt.h5").ok


def test_bit_flipped_shard_is_named_and_force_rewrites_it(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    precompile.build(recipe(), out)
    victim = shard_file(out / "flt.h5", 1)
    good = victim.read_bytes()
    import h5py

    with h5py.File(victim, "r") as f:
        off = f["image"].id.get_chunk_info(0).byte_offset
    raw = bytearray(good)
    raw[off + 5] ^= 0x10
    victim.write_bytes(bytes(raw))
    r = _cli("verify", str(out / "flt.h5"))
    assert r.returncode == FormatError.exit_code
    assert f"flt.shards/{victim.name}: field 'image': data checksum mismatch" in r.stderr
    assert "1 of 5 shard(s) failed verification" in r.stderr
    rep = precompile.build(recipe(), out, force=True)
    assert rep["shards"]["built"] == 5 and victim.read_bytes() == good and verify(out / "flt.h5").ok


# --- vanishing inputs and output folder, read-only folder, URLs, old layout ----------------------------

def test_input_vanishing_mid_build_names_the_input_and_keeps_the_previous_build(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    rec = recipe(decoder="vanish_test")
    assert _cli("build", rec, "-o", str(out), "--no-progress").returncode == 0
    index_bytes = (out / "flt.h5").read_bytes()
    _img(root / "img_1020.png", 1020)        # touched: shard 2 must be rebuilt
    os.utime(root / "img_1020.png", ns=(1, 10**18))
    victim = root / "img_1021.png"           # in the same shard: removed while the first input is decoded
    r = _cli("build", rec, "-o", str(out), "--no-progress", env_extra={"PCFAULT_VANISH": str(victim)})
    assert r.returncode == BuildError.exit_code, r.stderr
    assert str(victim) in r.stderr and "stage decode" in r.stderr and "Traceback" not in r.stderr
    assert (out / "flt.h5").read_bytes() == index_bytes and _check_all(out / "flt.h5") == 40


def test_output_folder_vanishing_mid_build_is_an_output_error(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    r = _cli("build", recipe(decoder="vanish_test"), "-o", str(out), "--no-progress",
             env_extra={"PCFAULT_VANISH": str(out)})
    _no_crash(r)
    assert r.returncode == OutputError.exit_code, r.stderr
    assert f"error: output folder {out} no longer exists (removed during the build)" in r.stderr


def test_read_only_output_folder_is_an_output_error(proj):
    tmp, root, recipe = proj
    with _tmpfs(tmp / "mnt", "4m") as mnt:
        out = mnt / "out"
        assert _cli("build", recipe(), "-o", str(out), "--no-progress").returncode == 0
        index_bytes = (out / "flt.h5").read_bytes()
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        _img(root / "img_0999.png", 999)
        r = _cli("build", recipe(), "-o", str(out), "--no-progress")
        _no_crash(r)
        assert r.returncode == OutputError.exit_code, r.stderr
        assert f"error: output folder {out} is read-only: " in r.stderr
        assert (out / "flt.h5").read_bytes() == index_bytes and _check_all(out / "flt.h5") == 40


@pytest.mark.parametrize("url,code,msg", [
    ("file:///tmp/x", OutputError.exit_code, "output 'file:///tmp/x': give a local output folder as a path, not a "
                                             "file:// URL"),
    ("gs://b/x", MissingDependencyError.exit_code, "reading gs:// needs gcsfs: pip install 'precompile[gcs]'")])
def test_output_urls_that_cannot_be_written(proj, url, code, msg, monkeypatch):
    """A URL output (tests/test_remote_output.py) needs its protocol's package; file:// is a folder's path."""
    if url.startswith("gs://"):
        pytest.importorskip("fsspec", reason="fsspec is not installed (extra 's3')")
        if importlib.util.find_spec("gcsfs") is not None:
            pytest.skip("gcsfs is installed: gs:// outputs are possible here")
    tmp, root, recipe = proj
    monkeypatch.chdir(tmp)
    r = _cli("build", recipe(), "-o", url, "--no-progress")
    assert r.returncode == code and f"error: {'' if code == OutputError.exit_code else url + ': '}{msg}" in r.stderr
    assert not any(p.name.endswith(":") for p in tmp.iterdir())


def test_an_older_format_version_is_refused_by_the_reader_and_rebuilt(proj):
    import h5py

    tmp, root, recipe = proj
    out = tmp / "out"
    precompile.build(recipe(), out)
    with h5py.File(out / "flt.h5", "r+") as f:
        f.attrs["format_version"] = 1
    with pytest.raises(FormatError, match=r"format version 1, this precompile reads 2: build the recipe again"):
        precompile.open(out / "flt.h5")
    rep = precompile.build(recipe(), out)
    assert not rep.get("up_to_date") and _check_all(out / "flt.h5") == 40


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_index_records_each_shards_size_and_whole_sha256(proj, fmt):
    import hashlib

    from precompile.formats import snapshot

    tmp, root, recipe = proj
    out = tmp / "out"
    index = out / ("flt.h5" if fmt == "hdf5" else "flt.json")

    def entries():
        return json.loads(snapshot.read_index_attrs(str(index))["shards"])

    def digest(p: Path) -> str:   # independent of shard_digest: the file, or a folder's sorted manifest
        if p.is_file():
            return hashlib.sha256(p.read_bytes()).hexdigest()
        lines = sorted(f"{q.relative_to(p).as_posix()}\t{hashlib.sha256(q.read_bytes()).hexdigest()}\n"
                       for q in p.rglob("*") if q.is_file())
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    def size(p: Path) -> int:
        return p.stat().st_size if p.is_file() else sum(q.stat().st_size for q in p.rglob("*")
                                                        if q.is_file() and q.name != "info.json")

    precompile.build(recipe(fmt=fmt), out)
    first = entries()
    for e in first:
        p = out / e["file"]
        assert e["sha256"] == digest(p) and e["bytes"] == size(p) and e["key"][:16] in p.name
    _img(root / "img_1039.png", 1039)               # the last shard only
    os.utime(root / "img_1039.png", ns=(1, 10**18))
    rep = precompile.build(recipe(fmt=fmt), out)
    assert rep["shards"]["built"] == 1
    second = entries()
    assert second[:4] == first[:4] and second[4]["file"] != first[4]["file"]   # kept shards: the same entries
    assert second[4]["sha256"] == digest(out / second[4]["file"])


def test_loader_made_before_rebuilds_and_gc_keeps_reading_the_old_snapshot(proj):
    pytest.importorskip("torch", reason="the Loader needs torch")
    from precompile import Loader
    from precompile.compiler.driver import collect_garbage

    tmp, root, recipe = proj
    out = tmp / "out"
    precompile.build(recipe(), out)
    loader = Loader(str(out / "flt.h5"), batch_size=8, shuffle=False, device="cpu")
    keys = list(loader.ds.keys)
    for n in (999, 998):          # two rebuilds that move every row; the first snapshot goes when the second starts
        _img(root / f"img_{n:04d}.png", n)
        precompile.build(recipe(), out)
    removed, _ = collect_garbage(out / "flt.h5", keep_previous=False)
    assert len(removed) == 6      # the second snapshot's six shards; the first one's five were gone already
    rows = np.concatenate([b["image"].numpy() for b in loader])
    assert len(rows) == 40 == len(keys)
    assert all(_matches(k, a) for k, a in zip(keys, rows))      # mapped shards survive their unlink
    assert _check_all(out / "flt.h5") == 42


def test_disk_full_while_writing_the_index_keeps_the_old_index(proj, monkeypatch):
    import errno

    from precompile.formats import hdf5

    tmp, root, recipe = proj
    out = tmp / "out"
    precompile.build(recipe(), out)
    index_bytes = (out / "flt.h5").read_bytes()
    real = hdf5._Claim.grow

    def full_for_the_index(self, nbytes):
        if os.path.dirname(self.path) == str(out):   # the index's temporary, not a shard's
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return real(self, nbytes)

    monkeypatch.setattr(hdf5._Claim, "grow", full_for_the_index)
    _img(root / "img_0999.png", 999)
    with pytest.raises(OutputError, match=rf"output folder {out} is out of space: No space left on device.*"
                                          r"the inputs are fine: nothing built before is lost"):
        precompile.build(recipe(), out)
    assert (out / "flt.h5").read_bytes() == index_bytes and _check_all(out / "flt.h5") == 40
    assert not list(out.glob("*.tmp-*"))
    monkeypatch.undo()
    rep = precompile.build(recipe(), out)          # space back: the finished shards are kept, the index written
    assert rep["shards"]["built"] == 0 and rep["shards"]["skipped"] == 6 and _check_all(out / "flt.h5") == 41
