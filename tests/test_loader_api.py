"""The Loader's construction and lifecycle: arguments checked up front, non-HDF5 builds refused with a
pointer, close, the wait statistics, and the reader's import hygiene (no torch).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import precompile
from precompile.errors import FormatError, PrecompileError
from precompile.reader.loader import Loader

from conftest import image_recipe, write_recipe
from loader_cases import REPO, built, small_build  # noqa: F401


def test_arguments_checked_up_front(small_build):
    with pytest.raises(ValueError, match="block_window must be >= 1 chunk, got 0"):
        Loader(small_build, batch_size=2, shuffle="block", device="cpu", block_window=0)
    # a crop that covers no field: refused at construction, not a TypeError at the first batch
    with pytest.raises(ValueError, match="random_crop: matches no field"):
        Loader(small_build, batch_size=2, device="cpu", fields=["label"], gpu_steps=[{"random_crop": {"size": 4}}])
    # fields: [] says it on purpose, as in a recipe: the step does nothing
    kept = Loader(small_build, batch_size=2, device="cpu", shuffle=False, gpu_steps=[{"random_flip": {"fields": []}}])
    plain = Loader(small_build, batch_size=2, device="cpu", shuffle=False)
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(kept, plain))


def test_close_stops_the_pass_and_later_use_is_a_clear_error(small_build):
    loader = Loader(small_build, batch_size=2, shuffle=True, device="cpu", num_threads=2, prefetch=3)
    it = iter(loader)
    first = next(it)
    loader.close()
    with pytest.raises(StopIteration):   # the pass ended with close (its threads joined)
        next(it)
    assert first["image"].shape == (2, 32, 32, 3)
    with pytest.raises(PrecompileError, match="reader is closed"):
        iter(loader)
    with pytest.raises(PrecompileError, match="reader is closed"):
        loader.reader.read([0])


def test_file_build_is_refused_with_a_pointer_to_the_dataset(tmp_path, image_tree):
    r = image_recipe(image_tree, output={"format": "png", "samples_per_shard": 4})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    index = tmp_path / "out" / "imgs.json"
    ds = precompile.open(index)
    assert ds.output_format == "png" and len(ds) == 10   # the build itself is fine
    for src in (index, ds):
        with pytest.raises(FormatError, match="a png build .*HDF5 builds only.*precompile.open\\(path\\) inside a "
                                              "torch DataLoader"):
            Loader(src, batch_size=2, device="cpu")


def test_stats_measure_the_wait(built):
    loader = Loader(built, batch_size=16, shuffle=True, device="cpu")
    n = sum(1 for _ in loader)
    st = loader.stats
    assert st.batches == n == len(st.waits) == 8
    assert 0 <= st.wait_s <= st.elapsed_s and abs(sum(st.waits) - st.wait_s) < 1e-9
    assert 0 <= st.wait_share <= 1
    assert f"{n} batches, waited" in st.summary()


def test_reader_does_not_import_torch():
    code = ("import sys, precompile, precompile.reader.direct, precompile.reader.sampler; "
            "precompile.open; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_keywords_are_grouped_into_frozen_options(built):
    import dataclasses

    from precompile.reader.cpu_feeder import CpuFeeder
    from precompile.reader.options import Conversion, Distribution, Order

    loader = Loader(built, batch_size=4, shuffle=True, seed=3, device="cpu", rank=1, world_size=2, uneven="drop",
                    block_window=2, sort_batches=False, drop_last=True, dtype="float16", mean=0.5, std=0.25,
                    channels_first=True)
    assert loader.order == Order("full", 3, 2, False, True)
    assert loader.distribution == Distribution(1, 2, "drop")
    assert loader.conversion == Conversion("float16", 0.5, 0.25, True, None)
    assert (loader.mode, loader.seed, loader.rank, loader.world_size, loader.uneven) == ("full", 3, 1, 2, "drop")
    assert isinstance(loader.feeder, CpuFeeder) and loader.dtype == torch.float16
    with pytest.raises(dataclasses.FrozenInstanceError):
        loader.order.seed = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="uneven must be 'pad' or 'drop', got 'wrap'"):
        Distribution(0, 1, "wrap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shuffle must be"):
        Order("random")


DDP_SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
from precompile.reader.loader import Loader

dist.init_process_group("gloo")
rank = dist.get_rank()
loader = Loader(sys.argv[1], batch_size=4, shuffle=True, seed=5, device="cpu")
labels = [int(x) for b in loader for x in b["label"]]
rows = [int(x) for b in loader.batch_indices(0) for x in b]
try:
    Loader(sys.argv[1], batch_size=4, device="cpu", rank=1 - rank, world_size=2)
    contradiction = "accepted"
except ValueError as e:
    contradiction = str(e)
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"repr": repr(loader), "rows": rows, "labels": labels, "contradiction": contradiction,
               "single": [loader.rank, loader.world_size]}, f)
dist.destroy_process_group()
"""


def test_ddp_ranks_take_their_share_from_the_process_group(built, tmp_path):
    # two processes under torchrun (gloo): Loaders made without rank/world_size read disjoint shares that
    # cover the build, say where their rank came from, and refuse a rank that contradicts the group
    import json

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), built, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    n = len(precompile.open(built))
    assert [g["single"] for g in got] == [[0, 2], [1, 2]]
    assert all("rank=%d/2 (from torch.distributed)" % r in g["repr"] for r, g in enumerate(got))
    assert not set(got[0]["rows"]) & set(got[1]["rows"])
    assert sorted(got[0]["rows"] + got[1]["rows"]) == list(range(n))
    assert len(got[0]["labels"]) == len(got[1]["labels"]) == n // 2
    for g in got:
        assert "contradict the initialised torch.distributed process group" in g["contradiction"]
    # outside a process group nothing changes: one process reads everything
    single = Loader(built, batch_size=4, device="cpu")
    assert (single.rank, single.world_size, single.distribution.source) == (0, 1, "default")
    assert "torch.distributed" not in repr(single)


def test_one_field_name_given_as_a_string_is_that_field_not_its_letters(small_build):
    """fields="image" (or convert_fields="image") was iterated letter by letter: "no field 'i'" from the Loader,
    precompile.open and Mix alike. Now one name is a list of it; anything but names is a ValueError saying so."""
    ds = precompile.open(small_build)
    names = ds.fields
    pic = next(f for f in names if ds.field_specs[f]["kind"] == "image")
    assert precompile.open(small_build, fields=pic).fields == [pic]
    one = Loader(small_build, batch_size=2, device="cpu", shuffle=False, fields=pic)
    listed = Loader(small_build, batch_size=2, device="cpu", shuffle=False, fields=[pic])
    assert all(a.keys() == b.keys() == {pic} and torch.equal(a[pic], b[pic]) for a, b in zip(one, listed))
    conv = Loader(small_build, batch_size=2, device="cpu", shuffle=False, dtype="float32", convert_fields=pic)
    assert next(iter(conv))[pic].dtype == torch.float32
    mix = precompile.Mix([small_build, small_build], batch_size=2, device="cpu", fields=pic)
    assert mix.fields == [pic]
    for x in (one, listed, conv, mix):
        x.close()
    with pytest.raises(ValueError, match=r"^fields must be a list of field names, got 3$"):
        Loader(small_build, batch_size=2, device="cpu", fields=3)
    with pytest.raises(ValueError, match=r"^fields: field names are strings, got 3 in \['image', 3\]$"):
        precompile.open(small_build, fields=["image", 3])


def test_convert_fields_refuses_ids_and_a_conversion_that_converts_nothing(small_build):
    """convert_fields=["label"] with a dtype made class ids floats: a label 0 became -2.0 with mean 0.5, std 0.25
    (and a 0/1 mask 1/255), without a word; convert_fields without a dtype, mean/std or channels_first converted
    nothing, also without a word. Both are ValueErrors now, when the Loader is made."""
    ds = precompile.open(small_build)
    label = next(f for f in ds.fields if ds.field_specs[f]["kind"] == "label")
    with pytest.raises(ValueError, match=rf"^convert_fields: '{label}' is a label field \(class ids\), which the "
                                         r"conversion \(uint8 / 255, then \(x - mean\) / std, as floats\) would make "
                                         r"into other numbers; it converts image, video, volume, audio, flow, target "
                                         rf"fields: leave '{label}' out$"):
        Loader(small_build, batch_size=2, device="cpu", dtype="float32", mean=0.5, std=0.25, convert_fields=[label])
    with pytest.raises(ValueError, match=r"^convert_fields=\['image'\] without a dtype, mean/std or channels_first "
                                         r"converts nothing; give dtype='float32' \(or mean and std\)$"):
        Loader(small_build, batch_size=2, device="cpu", convert_fields=["image"])
    with pytest.raises(ValueError, match="is a label field"):
        precompile.Mix([small_build, small_build], batch_size=2, device="cpu", dtype="float32", convert_fields=[label])


def test_device_step_options_take_the_type_their_key_asks_for(small_build):
    """The recipe refuses a value of another type (true as 1, "0.5" as 0.5: recipe.refuse_coercion); the Loader's
    gpu_steps, the same steps' options, took them (pydantic's lax mode): horizontal: True flipped every sample.
    Now the same rule, the same words; a size pair holding a non-integer names it (it said "got 2 values")."""
    for opts, why in [({"horizontal": True}, "horizontal: expected a number, got True (a boolean is not taken as a "
                                             "number)"),
                      ({"horizontal": "0.5"}, "horizontal: expected a number, got the string '0.5' (a quoted value "
                                              "is not taken as a number or boolean: write it unquoted)")]:
        with pytest.raises(ValueError, match="^random_flip: " + why.replace("(", r"\(").replace(")", r"\)") + "$"):
            Loader(small_build, batch_size=2, device="cpu", gpu_steps=[{"random_flip": opts}])
    with pytest.raises(ValueError, match=r"expected an integer or 2 integers \[height, width\], got \[16, 16\.5\]"):
        Loader(small_build, batch_size=2, device="cpu", gpu_steps=[{"random_crop": {"size": [16, 16.5]}}])
    ok = Loader(small_build, batch_size=2, device="cpu", gpu_steps=[{"random_flip": {"horizontal": 1}}])
    ok.close()


def test_a_sample_index_is_an_integer_as_a_list_takes_it(small_build):
    """precompile.open(...)[i] took int(i): ds[1.5] was row 1, ds.batch([1.5]) too, ds.meta(2.0) row 2, ds["x"] said
    "invalid literal for int()", and ds[-n - 1] named index -1. Now an index is what a list takes (an int, a numpy
    integer, a one-element integer tensor, negative from the end); anything else is a TypeError saying so, and an
    index out of range is named as given."""
    ds = precompile.open(small_build)
    n = len(ds)
    assert ds.key(-1) == ds.key(n - 1) and ds.key(np.int64(1)) == ds.key(torch.tensor(1)) == ds.key(1)
    for bad in (1.5, 2.0, "x", torch.tensor(1.0)):
        with pytest.raises(TypeError, match=r"^sample index must be an integer, got "):
            ds[bad]
        with pytest.raises(TypeError, match=r"^sample index must be an integer, got "):
            ds.meta(bad)
    with pytest.raises(TypeError, match=r"^sample indices must be integers, got float64 values such as"):
        ds.batch([0, 1.5])
    with pytest.raises(IndexError, match=rf"^sample index {-n - 1} out of range for {n} samples$"):
        ds[-n - 1]
    np.testing.assert_array_equal(ds.batch(np.array([1, -1]))["image"], ds.batch([1, n - 1])["image"])


def test_flags_are_true_or_false_and_a_world_size_needs_a_rank(small_build):
    """bool() took include_original="no", sort_batches="false", verify="no" and channels_first="no" as True (the
    originals read, the batches sorted, the bytes verified, NCHW views) without a word; world_size=2 without rank
    and without a process group read rank 0's share in every process. Now each is a ValueError saying so, in the
    Loader, Mix and precompile.open alike; True, False and numpy bools are taken."""
    for key in ("include_original", "sort_batches", "verify", "drop_last"):
        with pytest.raises(ValueError, match=rf"^{key} must be True or False, got 'no'$"):
            Loader(small_build, batch_size=2, device="cpu", **{key: "no"})
    with pytest.raises(ValueError, match=r"^channels_first must be True or False, got 'no'$"):
        Loader(small_build, batch_size=2, device="cpu", dtype="float32", channels_first="no")
    with pytest.raises(ValueError, match=r"^sort_batches must be True or False, got 'false'$"):
        precompile.Mix([small_build, small_build], batch_size=2, device="cpu", sort_batches="false")
    with pytest.raises(ValueError, match=r"^verify must be True or False, got 'no'$"):
        precompile.open(small_build, verify="no")
    with pytest.raises(ValueError, match=r"^world_size=2 without rank \(and no initialised torch.distributed "
                                         r"process group\): give this process's rank, or leave both out$"):
        Loader(small_build, batch_size=2, device="cpu", world_size=2)
    ok = Loader(small_build, batch_size=2, device="cpu", drop_last=np.bool_(True), sort_batches=False, world_size=1)
    ok.close()
