"""An outside attack on the build's promises where its parts meet: the shard task in the build's own
process (-j 1, the small-build rule's parent run) against forked workers and the isolated decoding helper.
Each test here failed before the fix named in its docstring.

A plugin decoder (written to tmp_path, imported by the build, its workers and helpers) misbehaves on the
inputs whose names say how."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

import precompile
from precompile.errors import BuildError

from conftest import REPO

PLUGIN = '''"""Test-only decoder that misbehaves on chosen inputs (names unique to this module)."""
import os
import sys
import time

import numpy as np

from precompile.decoders.base import Decoder, DecoderParams
from precompile.errors import DecodeError
from precompile.registry import DECODERS
from precompile.sample import FieldSpec


class BadMagic(DecodeError):
    """A plugin's own DecodeError, with a constructor of its own (as the plugin API allows)."""

    def __init__(self, magic, offset):
        super().__init__(f"bad magic {magic!r} at byte {offset}")
        self.magic, self.offset = magic, offset


@DECODERS.register()
class Odd(Decoder):
    name = "MOD_raw"
    kind = "image"

    class Params(DecoderParams):
        pass

    def spec(self):
        return FieldSpec("image", (4, 4, 1), "uint8")

    def read(self, path):
        base = os.path.basename(path)
        if "slowexit" in base:   # a process that takes a while to end after its pipes closed (a codec's
            os.closerange(3, 4096)   # exit() running atexit handlers, a core being written): exit code 5
            time.sleep(0.5)
            os._exit(5)
        if "sysexit" in base:    # a library that calls sys.exit() on input it does not like
            sys.exit(3)
        if "nomem" in base:
            raise MemoryError()
        if "slow" in base:
            time.sleep(0.6)
        if "bad" in base:
            raise ValueError("not this one")
        if "magic" in base:
            raise BadMagic(b"XY", 0)
        if "huge" in base:       # a parser that puts what it read in its message
            raise ValueError("bad header: " + "A" * 100000)
        return np.full((4, 4, 1), len(base), np.uint8)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A fresh plugin module in tmp_path, importable by the build, its forked workers and its helpers."""
    mod = f"pcjoin_{uuid.uuid4().hex[:10]}"
    d = tmp_path / "plug"
    d.mkdir()
    (d / f"{mod}.py").write_text(PLUGIN.replace("MOD", mod))
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), str(REPO), os.environ.get("PYTHONPATH", "")]))
    __import__(mod)
    return mod


def _inputs(root: Path, names: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for n in names:
        (root / n).write_bytes(b"x")
    return root


def _recipe(root: Path, plugin: str, **top) -> dict:
    return {"name": "j", "imports": [plugin], "on_error": "skip",
            "inputs": {"root": str(root), "match": "{name}.raw", "fields": {"image": {"decoder": f"{plugin}_raw"}}},
            "output": {"samples_per_shard": 2}, **top}


def test_a_helper_that_exits_on_its_own_is_not_reported_as_killed_by_sigkill(tmp_path, plugin):
    """The isolated decoding helper (timeout_s, or a dead worker's retry) that exits with a code of its own
    after its reply pipe closed was killed at once by the parent, and the input's failure said `killed by
    signal SIGKILL`: the signal the kernel's out-of-memory killer sends, not what happened. The parent now
    gives a helper whose pipe closed a moment to end by itself before it kills it."""
    root = _inputs(tmp_path / "in", ["a.raw", "b_slowexit.raw", "c.raw"])
    rep = precompile.build(_recipe(root, plugin, timeout_s=30), tmp_path / "out")
    f, = rep["failures"]
    assert f["path"] == str(root / "b_slowexit.raw") and f["stage"] == "decode" and f["field"] == "image"
    assert f["detail"] == "the decoding process died while decoding this input (exit code 5)", f["detail"]
    assert precompile.open(rep["output"]).keys == ["a.raw", "c.raw"]


@pytest.mark.parametrize("how", ["-j1", "small build", "workers"])
def test_a_decoder_that_calls_sys_exit_fails_its_input_alike_in_the_build_and_in_a_worker(tmp_path, plugin,
                                                                                         monkeypatch, how):
    """A decoder that calls sys.exit() (SystemExit is no Exception) ended a -j 1 build, and a small build run
    in the parent, at once with exit code 3 and no message at all (nothing named the input, its shard was
    left half-written), while in a forked worker it killed the worker, whose retry then blamed SIGKILL. Now
    it is the input's error as any other exception of a codec's: the same message wherever it runs."""
    root = _inputs(tmp_path / "in", ["a.raw", "b.raw", "c_sysexit.raw", "d.raw", "e.raw"])
    if how == "small build":
        monkeypatch.delenv("PRECOMPILE_SMALL_BUILD", raising=False)   # conftest turns the rule off
    monkeypatch.setenv("PRECOMPILE_WORKERS", "fork")
    rep = precompile.build(_recipe(root, plugin), tmp_path / "out", n_jobs=1 if how == "-j1" else 2)
    assert bool(rep["events"]) is (how == "small build")
    f, = rep["failures"]
    assert f["message"] == f"{root / 'c_sysexit.raw'}, stage decode, field 'image': SystemExit: 3"
    assert precompile.open(rep["output"]).keys == ["a.raw", "b.raw", "d.raw", "e.raw"]


def test_a_decoder_that_calls_sys_exit_under_on_error_fail_is_named_by_the_cli(tmp_path, plugin):
    root = _inputs(tmp_path / "in", ["a.raw", "b_sysexit.raw"])
    rp = tmp_path / "r.yaml"
    rp.write_text(yaml.safe_dump(_recipe(root, plugin, on_error="fail")))
    r = subprocess.run([sys.executable, "-m", "precompile", "build", str(rp), "-o", str(tmp_path / "out"),
                        "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert f"{root / 'b_sysexit.raw'}, stage decode, field 'image': SystemExit: 3" in r.stderr
    assert not [p for p in (tmp_path / "out" / "j.shards").iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("jobs, top", [(1, {}), (2, {}), (1, {"timeout_s": 30})])
def test_out_of_memory_while_decoding_names_the_input_and_the_stage(tmp_path, plugin, jobs, top):
    """A MemoryError is not the input's fault, so on_error: skip rightly does not drop the input; but the
    build stopped with `first error: shard 1: MemoryError: .`, its failure recorded at stage `write` with
    the shard's own file as its path: nothing said which input was being decoded. Now the failure names
    the input, the field and the stage, and says why the input was not skipped. In the isolated decoding
    helper (timeout_s) the MemoryError killed the helper and the input was skipped as if it were bad; now it
    is told to the shard task as the same MemoryError."""
    root = _inputs(tmp_path / "in", ["a.raw", "b.raw", "c_nomem.raw", "d.raw"])
    with pytest.raises(BuildError) as ei:
        precompile.build(_recipe(root, plugin, **top), tmp_path / "out", n_jobs=jobs)
    bad = str(root / "c_nomem.raw")
    want = (f"{bad}, stage decode, field 'image': out of memory (MemoryError) while building shard 1: not the "
            f"input's fault, so on_error: skip does not drop it; use fewer jobs (-j) or give the machine more "
            f"memory")
    assert want in str(ei.value)
    rep = json.loads((tmp_path / "out" / "j.report.json").read_text())
    f, = rep["failures"]
    assert (f["path"], f["stage"], f["field"], f["key"], f["type"]) == (bad, "decode", "image", "c_nomem.raw",
                                                                        "MemoryError")


def test_a_symlink_loop_or_a_broken_link_is_told_as_such_not_as_a_missing_file(tmp_path):
    """A listed input that is a symbolic link loop (or a link to nothing) failed with `input file is missing
    (the recipe's path for this field points to nothing)`: the file is there, as a link, and the user was
    sent looking for a file that was never deleted. Now the message says what the link is."""
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "a.png")
    os.symlink(root / "loop2.png", root / "loop1.png")
    os.symlink(root / "loop1.png", root / "loop2.png")
    os.symlink(root / "gone.png", root / "broken.png")
    r = {"name": "l", "on_error": "skip",
         "inputs": {"root": str(root), "match": "{n}.png", "fields": {"image": {"decoder": "image"}}}}
    rep = precompile.build(r, tmp_path / "out")
    got = {f["key"]: f["detail"] for f in rep["failures"]}
    assert got == {
        "broken.png": f"input file is missing: it is a symbolic link to {str(root / 'gone.png')!r}, which does "
                      f"not exist (the recipe's path for this field points to nothing)",
        "loop1.png": "input file is missing: it is a symbolic link loop (too many levels of symbolic links) (the "
                     "recipe's path for this field points to nothing)",
        "loop2.png": "input file is missing: it is a symbolic link loop (too many levels of symbolic links) (the "
                     "recipe's path for this field points to nothing)"}
    assert precompile.open(rep["output"]).keys == ["a.png"]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_codecs_long_message_is_cut_to_a_bounded_length(tmp_path, plugin, jobs):
    """A decoder whose exception carries what it read (100,000 characters here) had all of it copied into the
    failure's message and detail: into the report, the shard's .skipped.json, and the terminal. The standard:
    echoed input is cut to a bounded length. Now a codec's words are cut (errors.clip), saying how long they were."""
    root = _inputs(tmp_path / "in", ["a.raw", "b_huge.raw", "c.raw"])
    rep = precompile.build(_recipe(root, plugin), tmp_path / "out", n_jobs=jobs)
    f, = rep["failures"]
    assert f["detail"] == "ValueError: bad header: " + "A" * 488 + "... (100012 characters)"
    assert f["message"] == f"{root / 'b_huge.raw'}, stage decode, field 'image': {f['detail']}"
    sidecar, = (tmp_path / "out" / "j.shards").glob("*.skipped.json")
    assert sidecar.stat().st_size < 4000


@pytest.mark.parametrize("jobs, top", [(1, {}), (2, {}), (1, {"timeout_s": 30})])
def test_a_plugins_decode_error_subclass_with_its_own_constructor_fails_only_its_input(tmp_path, plugin, jobs,
                                                                                        top):
    """A plugin raising its own DecodeError subclass whose constructor takes other arguments (BadMagic(magic,
    offset)) broke the context the build adds (path, stage, field): with_context called the subclass's
    constructor with path=..., so the TypeError failed the whole shard under on_error: skip, naming no file
    (`shard 1: TypeError: BadMagic.__init__() got an unexpected keyword argument 'path'`), and in the decoding
    helper it killed the helper for each such input. Now the error keeps its type and attributes and gets
    its context without calling the plugin's constructor."""
    root = _inputs(tmp_path / "in", ["a.raw", "b_magic.raw", "c.raw", "d_magic.raw"])
    rep = precompile.build(_recipe(root, plugin, **top), tmp_path / "out", n_jobs=jobs)
    assert [(f["key"], f["message"], f["type"]) for f in rep["failures"]] == [
        (n, f"{root / n}, stage decode, field 'image': bad magic b'XY' at byte 0", "BadMagic")
        for n in ("b_magic.raw", "d_magic.raw")]
    assert precompile.open(rep["output"]).keys == ["a.raw", "c.raw"]


def test_the_reports_failures_are_in_input_order_whatever_the_workers(tmp_path, plugin):
    """The report's failures (and the CLI's list of skipped inputs, and so the report of a -j 3 build against
    a -j 1 build's) came in the order the workers finished their shards: shard 0, slow here, listed last at
    -j 3, first at -j 1. Now they are in input order (shard by shard, each shard's in its inputs' order)."""
    root = _inputs(tmp_path / "in", ["a_bad.raw", "a_slow.raw", "b.raw", "c_bad.raw", "d.raw", "e_bad.raw"])
    want = ["a_bad.raw", "c_bad.raw", "e_bad.raw"]
    one = precompile.build(_recipe(root, plugin), tmp_path / "one", n_jobs=1)
    assert [f["key"] for f in one["failures"]] == want
    three = precompile.build(_recipe(root, plugin), tmp_path / "three", n_jobs=3)
    assert [f["key"] for f in three["failures"]] == want
    written = json.loads((tmp_path / "three" / "j.report.json").read_text())
    assert [f["key"] for f in written["failures"]] == want


def test_each_splits_report_holds_its_own_failures_and_shards(tmp_path):
    """A build with splits writes one report per split (<name>.<split>.report.json). Each listed every split's
    failures (a val input skipped showed in the train report too, skipped_inputs counted them all) and the whole
    build's shard counts, while its `inputs` were the split's; a no-change rebuild that rewrote a missing split
    report gave only the split's own. Now a fresh build's split reports are the split's: failures, skipped
    inputs and shards."""
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    for n in ["a", "c", "d", "e"]:
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / f"{n}.png")
    (root / "b.png").write_bytes(b"not a png")
    (root / "t.csv").write_text("path,sp\na.png,train\nb.png,train\nc.png,val\nd.png,val\ne.png,val\n")
    r = {"name": "s", "on_error": "skip", "split": {"by": "column", "column": "sp"},
         "inputs": {"root": str(root), "table": str(root / "t.csv"), "path": "{path}",
                    "fields": {"image": {"decoder": "image"}}}, "output": {"samples_per_shard": 1}}
    rep = precompile.build(r, tmp_path / "out")
    assert [f["key"] for f in rep["failures"]] == ["b.png"]
    out = tmp_path / "out"
    train = json.loads((out / "s.train.report.json").read_text())
    val = json.loads((out / "s.val.report.json").read_text())
    assert ([f["key"] for f in train["failures"]], train["skipped_inputs"], train["inputs"]) == (["b.png"], 1, 2)
    assert ([f["key"] for f in val["failures"]], val["skipped_inputs"], val["inputs"]) == ([], 0, 3)
    assert train["shards"] == {"total": 2, "built": 2, "skipped": 0, "reused": 0, "failed": 0}
    assert val["shards"] == {"total": 3, "built": 3, "skipped": 0, "reused": 0, "failed": 0}
    # the same split reports a no-change rebuild writes when they are missing (failures then from the sidecars)
    (out / "s.train.report.json").unlink()
    (out / "s.val.report.json").unlink()
    precompile.build(r, out)
    again = {s: json.loads((out / f"s.{s}.report.json").read_text()) for s in ("train", "val")}
    assert [f["key"] for f in again["train"]["failures"]] == ["b.png"] and again["val"]["failures"] == []


def test_a_split_whose_every_input_failed_stops_the_build_naming_the_split(tmp_path):
    """Every input of one split skipped (on_error: skip) while the others built: before, the split's index was
    written with 0 samples and the build exited 0, so training went on against an empty validation set (the
    whole build's 'every input failed' rule did not look at splits). Now the build stops with exit 3 naming the
    split, before any split index is written; finished shards are kept, and a build once the inputs are fixed
    writes every split."""
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    for n in ["a", "b", "c"]:
        Image.fromarray(np.full((4, 4, 3), ord(n), np.uint8)).save(root / f"{n}.png")
    for n in ["d", "e"]:
        (root / f"{n}.png").write_bytes(b"not a png")
    (root / "t.csv").write_text("path,sp\na.png,train\nb.png,train\nc.png,train\nd.png,val\ne.png,val\n")
    r = {"name": "s", "on_error": "skip", "split": {"by": "column", "column": "sp"},
         "inputs": {"root": str(root), "table": str(root / "t.csv"), "path": "{path}",
                    "fields": {"image": {"decoder": "image"}}}, "output": {"samples_per_shard": 1}}
    out = tmp_path / "out"
    out.mkdir()
    (out / "r.yaml").write_text(yaml.safe_dump(r))
    p = subprocess.run([sys.executable, "-m", "precompile.cli", "build", str(out / "r.yaml"), "-o", str(out)],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 3, p.stderr
    assert (f"error: build of 's': every input of split 'val' failed (2 skipped), its output would be empty; no "
            f"split's index was written, finished shards are kept; first error: {root / 'd.png'}, stage decode, "
            f"field 'image': not an image Pillow can identify") in p.stderr
    assert not list(out.glob("s.*.h5"))
    assert json.loads((out / "s.report.json").read_text())["status"] == "failed"
    kept = sorted(p.name for p in (out / "s.shards").glob("*.h5"))
    assert len(kept) == 5   # train's three, and val's two (empty, their inputs' failures beside them)
    for n in ["d", "e"]:
        Image.fromarray(np.full((4, 4, 3), ord(n), np.uint8)).save(root / f"{n}.png")
    rep = precompile.build(r, out)
    assert rep["shards"]["built"] == 2 and {k: v["samples"] for k, v in rep["splits"].items()} == {"train": 3, "val": 2}
    assert set(kept[:3]) <= {p.name for p in (out / "s.shards").glob("*.h5")}   # (shard-0000[0-2]: train's)
