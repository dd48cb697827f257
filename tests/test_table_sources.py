"""inputs.table from several files (a glob or a list: rows in sorted file order, each error naming its own file
and row) and from object storage (a moto S3 server; the fixture is test_remote's): the same samples and the
same per-item key texts as one local file, only the shards whose rows changed rebuilt, the store's refusals
as PlanErrors naming the URL."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.compiler.keys import items_text
from precompile.compiler.plan import make_plan
from precompile.errors import PlanError, RecipeError
from precompile.recipe import load_recipe
from test_remote import BUCKET, s3, upload_tree  # noqa: F401  (s3: the fixture; skips without s3fs/moto)
from test_tables import _check_output, _images, _plan_error, _recipe, _rows, _write_csv

pa = pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")


@pytest.fixture()
def tree(tmp_path: Path, monkeypatch) -> tuple[Path, list[dict], list[np.ndarray]]:
    """7 images under tmp_path (the current folder), their rows, and meta/part-0.csv (rows 0-3) and
    meta/part-1.csv (rows 4-6), written in the other order; t.csv holds all the rows."""
    monkeypatch.chdir(tmp_path)
    imgs = _images(tmp_path, 7)
    rows = _rows()
    (tmp_path / "meta").mkdir()
    _write_csv(tmp_path / "meta" / "part-1.csv", rows[4:])
    _write_csv(tmp_path / "meta" / "part-0.csv", rows[:4])
    _write_csv(tmp_path / "t.csv", rows)
    return tmp_path, rows, imgs


def _texts(recipe: dict) -> list[str]:
    """What each shard's key hashes of its items (keys, labels, fingerprints, column values)."""
    plan = make_plan(load_recipe(recipe))
    return [items_text(s.table, s.rows) for s in plan.shards]


def _rows_of(recipe: dict) -> dict[str, tuple[str, int]]:
    return {it.key: (it.row_file, it.row) for it in make_plan(load_recipe(recipe)).items}


def test_glob_and_list_read_the_files_in_sorted_order(tree):
    root, rows, imgs = tree
    rep = precompile.build(_recipe("meta/part-*.csv"), "out")
    assert rep["num_samples"] == 7
    _check_output(precompile.open(rep["output"]), rows, imgs)
    assert _texts(_recipe("meta/part-*.csv")) == _texts(_recipe("t.csv"))   # the same items as one file
    part = {n: str(root / "meta" / f"part-{n}.csv") for n in (0, 1)}
    where = _rows_of(_recipe("meta/part-*.csv"))
    assert where["p0/s0.png"] == (part[0], 1) and where["p0/s3.png"] == (part[0], 4)
    assert where["p1/s4.png"] == (part[1], 1) and where["p0/s6.png"] == (part[1], 3)
    assert _rows_of(_recipe(["meta/part-1.csv", str(root / "meta" / "part-0.csv")])) == where
    assert _rows_of(_recipe(["meta/part-*.csv", "meta/part-1.csv"])) == where   # a file named twice: read once


def test_errors_name_the_file_and_its_own_row(tree):
    root, rows, _ = tree
    part1 = root / "meta" / "part-1.csv"
    _write_csv(part1, rows[4:5] + [dict(rows[5], Age="forty")] + rows[6:])
    e = _plan_error(_recipe("meta/part-*.csv"))
    assert f"{part1}: data row 2 (1-based, header not counted), column 'Age': 'forty' is not a number" in str(e)

    _write_csv(part1, rows[4:] + [rows[1]])   # a key already in part-0
    e = _plan_error(_recipe("meta/part-*.csv"))
    assert str(e).endswith(f"{part1}: data row 4 (1-based, header not counted), column 'Path': key 'p1/s1.png' "
                           f"repeats data row 2 of {root / 'meta' / 'part-0.csv'} (give inputs.key a column whose "
                           f"values are unique when paths repeat)")

    _write_csv(part1, [{k: v for k, v in r.items() if k != "Caption"} for r in rows[4:]])
    e = _plan_error(_recipe("meta/part-*.csv"))
    assert f"{part1}: no column 'Caption' (columns: Path, Finding, Age, Label, Patient)" in str(e)

    with pytest.raises(RecipeError, match=r"inputs.table: table 'meta/none-\*.csv' matches no file"):
        make_plan(load_recipe(_recipe("meta/none-*.csv")))
    with pytest.raises(RecipeError, match=r"inputs.table: .*an empty list of table files"):
        load_recipe(_recipe([]))
    with pytest.raises(RecipeError, match=r"inputs.table: .*unknown table extension '.xlsx'"):
        load_recipe(_recipe(["t.csv", "u.xlsx"]))

    _write_csv(part1, rows[4:])
    os.remove(root / rows[5]["Path"])   # a row whose input is missing: a per-input failure naming its file
    rep = precompile.build(_recipe("meta/part-*.csv"), "out", on_error="skip")
    (f,) = rep["failures"]
    assert f["message"].endswith(f"from data row 2 of {part1})")


def test_parquet_parts_whose_types_differ(tree):
    import pyarrow.parquet as pq

    root, rows, imgs = tree
    for n, part in enumerate((rows[:4], rows[4:])):
        cols = {k: [r[k] for r in part] for k in rows[0]}
        cols["Age"] = [int(v) for v in cols["Age"]]   # int64 in both files
        pq.write_table(pa.table(cols), root / "meta" / f"part-{n}.parquet")
    rep = precompile.build(_recipe("meta/*.parquet"), "out")
    _check_output(precompile.open(rep["output"]), rows, imgs)
    cols = {k: [r[k] for r in rows[4:]] for k in rows[0]}   # Age as text in part-1
    pq.write_table(pa.table(cols), root / "meta" / "part-1.parquet")
    e = _plan_error(_recipe("meta/*.parquet"))
    assert f"column 'Age' is int64 in {root / 'meta' / 'part-0.parquet'} but string in " \
           f"{root / 'meta' / 'part-1.parquet'}: the table files must agree" in str(e)


def test_a_file_added_or_changed_rebuilds_only_the_shards_of_its_rows(tree):
    root, rows, _ = tree
    _write_csv(root / "meta" / "part-1.csv", rows[4:6])   # 6 rows: shards of 3, 3
    first = precompile.build(_recipe("meta/part-*.csv"), "out")
    assert first["shards"]["built"] == 2 and precompile.build(_recipe("meta/part-*.csv"), "out")["up_to_date"]
    (root / "q").mkdir()
    (root / "q" / "s7.png").write_bytes((root / rows[0]["Path"]).read_bytes())
    _write_csv(root / "meta" / "part-2.csv", [dict(rows[0], Path="q/s7.png")])   # its key sorts last
    added = precompile.build(_recipe("meta/part-*.csv"), "out")
    assert added["num_samples"] == 7 and added["shards"] == {"total": 3, "built": 1, "skipped": 2, "reused": 0,
                                                             "failed": 0}
    _write_csv(root / "meta" / "part-0.csv", [dict(rows[0], Caption="changed")] + rows[1:4])   # p0/s0: shard 0
    changed = precompile.build(_recipe("meta/part-*.csv"), "out")
    assert changed["shards"]["built"] == 1 and changed["shards"]["skipped"] == 2
    ds = precompile.open(changed["output"])
    assert ds[ds.keys.index("p0/s0.png")]["caption"] == "changed"


# ---- tables in object storage --------------------------------------------------------------------------------

def _remote(recipe: dict, endpoint: str, root: str | None = None, anon: bool = True) -> dict:
    recipe["inputs"]["storage_options"] = {"endpoint_url": endpoint, **({"anon": True} if anon else {})}
    if root is not None:
        recipe["inputs"]["root"] = root
    return recipe


def test_remote_table_builds_like_the_local_one(tree, s3):  # noqa: F811
    endpoint, client = s3
    root, rows, imgs = tree
    upload_tree(client, root, "tables1")   # the images, t.csv and meta/ side by side, as datasets ship them
    url = f"s3://{BUCKET}/tables1"
    remote = _remote(_recipe(f"{url}/t.csv"), endpoint, root=url)
    rep = precompile.build(remote, "remote")
    assert rep["num_samples"] == 7 and rep["shards"]["built"] == 3
    _check_output(precompile.open(rep["output"]), rows, imgs)
    # a table read from the store over the local images: exactly what the local table's keys hash
    assert _texts(_remote(_recipe(f"{url}/t.csv"), endpoint)) == _texts(_recipe("t.csv"))
    assert _rows_of(_remote(_recipe(f"{url}/meta/part-*.csv"), endpoint))["p1/s4.png"] == (
        f"{url}/meta/part-1.csv", 1)
    assert precompile.build(remote, "remote")["up_to_date"]

    rows[6]["Caption"] = "changed"   # p0/s6.png: the last key -> the last shard
    _write_csv(root / "t.csv", rows)
    client.put_object(Bucket=BUCKET, Key="tables1/t.csv", Body=(root / "t.csv").read_bytes(), ACL="public-read")
    again = precompile.build(remote, "remote")
    assert again["shards"]["built"] == 1 and again["shards"]["skipped"] == 2
    ds = precompile.open(again["output"])
    assert ds[ds.keys.index("p0/s6.png")]["caption"] == "changed"


def test_remote_parquet_parts_by_glob(tree, s3):  # noqa: F811
    import pyarrow.parquet as pq

    endpoint, client = s3
    root, rows, imgs = tree
    for n, part in enumerate((rows[:4], rows[4:])):
        pq.write_table(pa.table({k: [r[k] for r in part] for k in rows[0]}), root / "meta" / f"part-{n}.parquet")
    upload_tree(client, root, "tables2")
    rep = precompile.build(_remote(_recipe(f"s3://{BUCKET}/tables2/meta/part-*.parquet"), endpoint), "out")
    _check_output(precompile.open(rep["output"]), rows, imgs)
    assert _texts(_remote(_recipe(f"s3://{BUCKET}/tables2/meta/part-*.parquet"), endpoint)) == \
        _texts(_recipe("t.csv"))


def test_remote_table_errors_name_the_url(tree, s3, monkeypatch):  # noqa: F811
    endpoint, client = s3
    root, rows, _ = tree
    client.put_object(Bucket=BUCKET, Key="tables3/t.csv", Body=(root / "t.csv").read_bytes(), ACL="public-read")
    client.put_object(Bucket=BUCKET, Key="tables3/bad.parquet", Body=b"not parquet", ACL="public-read")
    url = f"s3://{BUCKET}/tables3"
    with pytest.raises(PlanError, match=rf"^table '{url}/nope.csv' does not exist$"):
        precompile.build(_remote(_recipe(f"{url}/nope.csv"), endpoint), "out")
    with pytest.raises(PlanError, match=rf"^table '{url}/part-\*.csv' matches no object$"):
        precompile.build(_remote(_recipe(f"{url}/part-*.csv"), endpoint), "out")
    with pytest.raises(RecipeError, match=rf"table file '{url}/bad.parquet' cannot be read as parquet: "):
        precompile.build(_remote(_recipe(f"{url}/bad.parquet"), endpoint), "out")
    with pytest.raises(RecipeError, match="storage_options apply only to a remote root .*, table or coco file"):
        load_recipe(_remote(_recipe("t.csv"), endpoint))
    # no credentials anywhere and no `anon`: what to set, not botocore's error
    for k in [k for k in os.environ if k.startswith("AWS_") and k != "AWS_EC2_METADATA_DISABLED"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(root / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(root / "none"))
    with pytest.raises(PlanError, match=rf"^table '{url}/t.csv': no credentials for s3:// \(NoCredentialsError: "
                                        rf".*\); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        precompile.build(_remote(_recipe(f"{url}/t.csv"), endpoint, anon=False), "out")
    assert not (root / "out").exists()
