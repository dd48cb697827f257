"""``precompile verify``: an intact build passes; a flipped byte, a missing or truncated shard is named."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import yaml

from conftest import shard_file
from precompile import build
from precompile.errors import FormatError
from precompile.tools.verify import verify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def built(tmp_path):
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    for i in range(12):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(root / f"img_{i:02d}.png")
    data = {"name": "v", "inputs": {"root": str(root), "match": "{name}.png", "fields": {"image": {"decoder": "image"}}},
            "steps": [{"resize": {"size": [8, 8]}}], "output": {"samples_per_shard": 4}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    build(str(tmp_path / "r.yaml"), tmp_path / "out")
    return tmp_path / "out" / "v.h5"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "precompile", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _data_offset(shard: str, field: str, sample: int) -> int:
    """File offset of one sample's first byte, from HDF5's own chunk index (uncompressed chunks)."""
    with h5py.File(shard, "r") as f:
        d = f[field]
        rows = d.chunks[0]
        info = d.id.get_chunk_info_by_coord((sample // rows * rows,) + (0,) * (d.ndim - 1))
        per = int(np.prod(d.shape[1:])) * d.dtype.itemsize
        return info.byte_offset + (sample % rows) * per


def test_intact_build_verifies(built):
    res = verify(built)
    assert res.ok and res.num_shards == 3 and res.num_samples == 12
    shards = sorted(built.parent.glob("v.shards/*.h5"))
    assert len(shards) == 3 and res.bytes_checked == sum(p.stat().st_size for p in shards)   # every byte once
    r = _cli("verify", str(built))
    assert r.returncode == 0 and "ok (3 shard(s), 12 samples" in r.stdout


def test_flipped_byte_is_caught(built):
    shard = str(shard_file(built, 1))
    rel = "v.shards/" + os.path.basename(shard)
    off = _data_offset(shard, "image", 2) + 17
    with open(shard, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    with h5py.File(shard, "r") as f:  # the file is still perfectly readable HDF5: only verify can tell
        assert f["image"].shape == (4, 8, 8, 3)
    res = verify(built)
    assert res.bad_shards == [rel]
    assert any("field 'image': data checksum mismatch" in p for p in res.problems)
    r = _cli("verify", str(built))
    assert r.returncode == FormatError.exit_code
    assert f"{rel}: field 'image': data checksum mismatch" in r.stderr
    assert f"1 of 3 shard(s) failed verification: {rel}" in r.stderr
    assert "shard-00000" not in r.stderr and "shard-00002" not in r.stderr
    # --quick checks structure only and does not read the data
    assert _cli("verify", "--quick", str(built)).returncode == 0


def test_missing_and_truncated_shards_are_named(built):
    s0, s2 = shard_file(built, 0), shard_file(built, 2)
    os.remove(s0)
    with open(s2, "r+b") as f:
        f.truncate(os.path.getsize(s2) // 2)
    res = verify(built)
    r0, r2 = "v.shards/" + s0.name, "v.shards/" + s2.name
    assert res.bad_shards == [r0, r2]
    assert f"{r0}: file is missing" in res.problems
    assert any(p.startswith(f"{r2}: size") for p in res.problems)


def test_not_an_output(tmp_path):
    p = tmp_path / "x.h5"
    p.write_bytes(b"nope")
    with pytest.raises(FormatError, match="cannot read the index"):
        verify(p)
    r = _cli("verify", str(tmp_path / "absent.h5"))
    assert r.returncode == FormatError.exit_code and "no such output" in r.stderr and "Traceback" not in r.stderr


def test_verify_variable_shape_output_and_catches_a_flipped_byte(tmp_path):
    """Native-size images are stored as flat data + offsets; verify hashes the flat data."""
    from conftest import REPO

    out = tmp_path / "out"
    assert subprocess.run([sys.executable, "-m", "precompile", "build", str(REPO / "recipes" / "images_native.yaml"),
                           "-o", str(out), "--no-progress"], capture_output=True).returncode == 0
    ok = subprocess.run([sys.executable, "-m", "precompile", "verify", str(out / "images_native.h5")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shard = shard_file(out / "images_native.h5", 1)
    with h5py.File(shard, "r") as f:
        d = f["image"]["data"]
        off = d.id.get_chunk_info(0).byte_offset if d.chunks else d.id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[off + 100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    bad = subprocess.run([sys.executable, "-m", "precompile", "verify", str(out / "images_native.h5")],
                         capture_output=True, text=True)
    assert bad.returncode == 5
    assert shard.name in bad.stdout + bad.stderr and "'image'" in bad.stdout + bad.stderr


@pytest.mark.parametrize("output", ["png", "bmp", "wav"])
def test_folder_outputs_verify_and_name_the_changed_file(tmp_path, output):
    """PNG/BMP/WAV outputs: intact passes; a flipped byte in one sample file names the shard and the file;
    a missing file is caught; the CLI exits 5 on a problem."""
    import soundfile as sf
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        if output == "wav":
            sf.write(root / f"s{i}.wav", rng.uniform(-0.5, 0.5, 800).astype(np.float32), 8000, subtype="FLOAT")
        else:
            Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(root / f"s{i}.png")
    dec = {"decoder": "audio"} if output == "wav" else {"decoder": "image"}
    data = {"name": "v", "inputs": {"root": str(root), "match": "{name}." + ("wav" if output == "wav" else "png"),
                                    "fields": {"x": dec}},
            "steps": [], "output": {"format": output, "samples_per_shard": 3}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    build(str(tmp_path / "r.yaml"), tmp_path / "out")
    index = tmp_path / "out" / "v.json"
    res = verify(index)
    files = sorted((tmp_path / "out" / "v.shards").glob("shard-*/*." + output))
    assert res.ok and res.num_shards == 2 and res.num_samples == 6, res.problems
    assert res.bytes_checked == sum(f.stat().st_size for f in files)   # each file once: hashed and decoded
    r = _cli("verify", str(index))
    assert r.returncode == 0 and f"{res.bytes_checked} bytes of sample files and .npy data checked" in r.stdout
    victim = files[4]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF                      # a sample byte near the end (pixel or PCM data)
    victim.write_bytes(bytes(raw))
    res = verify(index)
    rel = f"{victim.parent.name}/{victim.name}"
    assert not res.ok and res.bad_shards == [f"v.shards/{victim.parent.name}"]
    assert any(rel in p and "bytes changed" in p for p in res.problems), res.problems
    r = _cli("verify", str(index))
    assert r.returncode == 5 and rel in r.stdout + r.stderr
    victim.unlink()
    assert any(f"{rel}: file is missing" in p for p in verify(index).problems)


def test_folder_verify_counts_sample_files_and_npy_data_once(tmp_path):
    """A BMP output with a field BMP does not hold (a flow: a companion .npy): the count is the BMP
    files' bytes on disk plus the .npy field's sample bytes, each once; --quick reads no sample data."""
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    rng = np.random.default_rng(3)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (9, 11, 3), dtype=np.uint8)).save(root / f"s{i}.png")
        flo = rng.normal(0, 2, (9, 11, 2)).astype("<f4")
        (root / f"s{i}.flo").write_bytes(np.float32(202021.25).tobytes() + np.array([11, 9], "<i4").tobytes()
                                         + flo.tobytes())
    data = {"name": "v", "inputs": {"root": str(root), "match": "{name}.png",
                                    "fields": {"x": {"decoder": "image", "mode": "rgb8"},
                                               "g": {"decoder": "flo", "path": "{name}.flo"}}},
            "output": {"format": "bmp", "samples_per_shard": 2}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    build(str(tmp_path / "r.yaml"), tmp_path / "out")
    shards = tmp_path / "out" / "v.shards"
    bmps = sorted(shards.glob("shard-*/*.bmp"))
    npys = sorted(shards.glob("shard-*/*.npy"))
    assert len(bmps) == 5 and len(npys) == 3
    npy_data = sum(np.load(p).nbytes for p in npys)
    assert npy_data == 5 * 9 * 11 * 2 * 4
    res = verify(tmp_path / "out" / "v.json")
    assert res.ok, res.problems
    assert res.bytes_checked == sum(p.stat().st_size for p in bmps) + npy_data
    assert res.counted == "bytes of sample files and .npy data"
    quick = verify(tmp_path / "out" / "v.json", checksums=False)
    assert quick.ok and quick.bytes_checked == sum(p.stat().st_size for p in bmps)  # hashed against the index
