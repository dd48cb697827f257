"""The index records its build date, from ``SOURCE_DATE_EPOCH`` when set (issue 35: the README's "same bytes"
says so now): two builds with the same SOURCE_DATE_EPOCH write byte-identical indexes, whatever the worker
count or the wall clock; a malformed SOURCE_DATE_EPOCH stops the build before anything is written, naming the
variable (it was a ValueError traceback after every shard had been built)."""
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import h5py
import pytest

import precompile
from precompile.errors import PrecompileError

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "images.yaml"


@pytest.mark.parametrize("fmt, index", [("hdf5", "images.h5"), ("png", "images.json")])
def test_the_same_source_date_epoch_gives_the_same_index_bytes(tmp_path, monkeypatch, fmt, index):
    import yaml

    r = yaml.safe_load(RECIPE.read_text())
    r["inputs"]["root"] = str(REPO / "sample_data" / "images")
    r["output"]["format"] = fmt
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    precompile.build(r, out_dir=tmp_path / "a")
    precompile.build(r, out_dir=tmp_path / "b", n_jobs=2)
    a, b = (tmp_path / "a" / index).read_bytes(), (tmp_path / "b" / index).read_bytes()
    assert a == b
    date = precompile.open(tmp_path / "a" / index).attrs["build_date"]
    assert date == dt.datetime.fromtimestamp(1700000000, dt.timezone.utc).isoformat() == "2023-11-14T22:13:20+00:00"


def test_without_it_the_index_records_the_time_of_the_build(tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    precompile.build(RECIPE, out_dir=tmp_path)
    with h5py.File(tmp_path / "images.h5") as f:
        got = dt.datetime.fromisoformat(f.attrs["build_date"])
    assert before <= got <= dt.datetime.now(dt.timezone.utc)


@pytest.mark.parametrize("value", ["abc", "1.5", "17e8", "-1", "99999999999999999999", "1_700_000_000", ""])
def test_a_malformed_source_date_epoch_stops_the_build_before_it_writes(tmp_path, monkeypatch, value):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", value)
    if value == "":     # set but empty: as unset (what reproducible-builds tools do with an empty variable)
        precompile.build(RECIPE, out_dir=tmp_path)
        assert (tmp_path / "images.h5").exists()
        return
    with pytest.raises(PrecompileError) as e:
        precompile.build(RECIPE, out_dir=tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"SOURCE_DATE_EPOCH={value!r}: ") and "whole number of seconds" in msg, msg
    assert not os.path.exists(tmp_path / "images.shards") or not any(
        p.name.startswith("shard-") for p in (tmp_path / "images.shards").iterdir())
    assert not (tmp_path / "images.h5").exists()


def test_the_readme_says_it():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    same = text[text.index("give the same bytes"):][:400]
    assert "SOURCE_DATE_EPOCH" in same, same
