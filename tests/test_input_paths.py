"""The input path rule (issue 34.4; docs/reference-recipe.md, "Paths and symlinks"): every path a folder
listing, a table row, a COCO file_name or a template over a COCO image id produces must stay under
``inputs.root``, as written and once symbolic links are resolved, unless the recipe says
``inputs.follow_links: outside`` (links only; '..' and absolute paths never). A refusal fails that input
only, naming the path and the root, and obeys ``on_error``. A root that is itself a link, and links that stay
inside the root, keep working."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import precompile
from precompile.errors import BuildError, DecodeError, RecipeError


def _png(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 6, 3), value, np.uint8)).save(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/{a,b}.png and root/sub/c.png inside; secret/s.png outside; links out of the root (a file and a
    folder) and links that stay inside (a file and a folder)."""
    root = tmp_path / "root"
    _png(root / "a.png", 10)
    _png(root / "b.png", 20)
    _png(root / "sub" / "c.png", 30)
    _png(tmp_path / "secret" / "s.png", 250)
    os.symlink(tmp_path / "secret" / "s.png", root / "link.png")          # a file link leading out
    os.symlink(tmp_path / "secret", root / "outdir")                      # a folder link leading out
    os.symlink(root / "a.png", root / "alias.png")                        # links that stay inside
    os.symlink("sub", root / "subalias")
    return tmp_path


def _open(out: Path, name: str = "p"):
    ds = precompile.open(str(out / f"{name}.h5"))
    return {ds.key(i): ds[i] for i in range(len(ds))}


def _refused(f, tmp: Path, path: str) -> None:
    """A failure naming the path, the resolved target outside and the root."""
    assert f.stage == "decode" and f.path == str(tmp / "root" / path)
    assert f"outside inputs.root {str(tmp / 'root')!r}" in f.message and "secret" in f.message
    assert "inputs.follow_links: outside" in f.message


def _listing(root: Path, **inputs) -> dict:
    return {"name": "p", "inputs": {"root": str(root), "match": "{n}.png", "fields": {"image": {"decoder": "image"}},
                                    **inputs}, "on_error": "skip"}


def test_a_listed_link_out_of_the_root_fails_that_input(tree):
    rep = precompile.build(_listing(tree / "root"), tree / "out", n_jobs=1)
    (f,) = rep.failures
    assert f.key == "link.png"
    _refused(f, tree, "link.png")
    got = _open(tree / "out")
    assert sorted(got) == ["a.png", "alias.png", "b.png"]                 # a link inside still reads
    assert all(s["image"].max() < 250 for s in got.values())             # nothing of secret/ was stored
    r = _listing(tree / "root")
    r["on_error"] = "fail"
    with pytest.raises(BuildError, match="resolves to '.*secret/s.png', outside inputs.root"):
        precompile.build(r, tree / "fail", n_jobs=1)


def test_follow_links_outside_reads_them_and_is_part_of_the_key(tree):
    rep = precompile.build(_listing(tree / "root"), tree / "out", n_jobs=1)
    assert len(rep.failures) == 1
    trusted = precompile.build(_listing(tree / "root", follow_links="outside"), tree / "out", n_jobs=1)
    assert not trusted.failures and trusted["shards"]["built"] == 1        # the changed rule rebuilt the shard
    assert _open(tree / "out")["link.png"]["image"].max() == 250
    assert trusted["recipe_hash"] != rep["recipe_hash"]


def test_a_root_that_is_itself_a_link_works(tree):
    os.symlink(tree / "root", tree / "rootlink")
    rep = precompile.build(_listing(tree / "rootlink"), tree / "out", n_jobs=1)
    assert [f.key for f in rep.failures] == ["link.png"]
    assert sorted(_open(tree / "out")) == ["a.png", "alias.png", "b.png"]


def _table(tmp: Path, rows: list[str], **inputs) -> dict:
    (tmp / "t.csv").write_text("p\n" + "".join(f"{r}\n" for r in rows))
    return {"name": "p", "inputs": {"root": str(tmp / "root"), "table": str(tmp / "t.csv"), "path": "{p}",
                                    "fields": {"image": {"decoder": "image"}}, **inputs}, "on_error": "skip"}


def test_table_rows_through_links_out_are_refused_and_links_inside_read(tree):
    r = _table(tree, ["a.png", "link.png", "outdir/s.png", "alias.png", "subalias/c.png", "sub/c.png"])
    rep = precompile.build(r, tree / "out", n_jobs=1)
    assert sorted(f.key for f in rep.failures) == ["link.png", "outdir/s.png"]
    for f in rep.failures:
        _refused(f, tree, f.key)
    got = _open(tree / "out")
    assert sorted(got) == ["a.png", "alias.png", "sub/c.png", "subalias/c.png"]
    assert got["subalias/c.png"]["image"].max() == 30


@pytest.mark.parametrize("row", ["../secret/s.png", "/{tmp}/secret/s.png", "sub/../../secret/s.png"])
def test_table_rows_with_dotdot_or_absolute_paths_are_refused(tree, row):
    """(The table reader refused these before the path rule, as an error of the table naming the row; the
    worker's check refuses them again as written.)"""
    from precompile.inputs.paths import InputRoot
    from precompile.recipe import load_recipe

    row = row.format(tmp=str(tree).lstrip("/"))
    r = _table(tree, ["a.png", row])
    with pytest.raises(RecipeError, match=r"data row 2 .*leaves inputs.root"):
        precompile.build(r, tree / "out", n_jobs=1)
    with pytest.raises(DecodeError, match=f"leaves inputs.root {str(tree / 'root')!r}"):
        InputRoot(load_recipe(r)).check(os.path.join(str(tree / "root"), row))


def _coco(tmp: Path, images: list[tuple], fields=None, **inputs) -> dict:
    ann = tmp / "ann.json"
    ann.write_text(json.dumps({"images": [{"id": i, "file_name": fn, "height": 4, "width": 6} for i, fn in images],
                               "annotations": [], "categories": [{"id": 1, "name": "t"}]}))
    inp = {"root": str(tmp / "root"), "coco": {"file": str(ann)}, **inputs}
    if fields is not None:
        inp["fields"] = fields
    return {"name": "p", "inputs": inp, "on_error": "skip"}


def test_coco_file_names_through_links_out_are_refused(tree):
    r = _coco(tree, [(1, "a.png"), (2, "link.png"), (3, "outdir/s.png"), (4, "subalias/c.png")])
    rep = precompile.build(r, tree / "out", n_jobs=1)
    assert sorted(f.key for f in rep.failures) == ["link.png", "outdir/s.png"]
    for f in rep.failures:
        _refused(f, tree, f.key)
    assert sorted(_open(tree / "out")) == ["a.png", "subalias/c.png"]


@pytest.mark.parametrize("name", ["../secret/s.png", "/x/secret/s.png", "sub/../../secret/s.png"])
def test_coco_file_names_leaving_the_root_as_written_fail_their_image(tree, name):
    r = _coco(tree, [(1, "a.png"), (2, name)])
    rep = precompile.build(r, tree / "out", n_jobs=1)
    (f,) = rep.failures
    assert f.key == name and f.stage == "annotations"
    assert f"images[1]: image id 2: file_name {name!r} must be a relative path inside inputs.root" in f.message
    r["on_error"] = "fail"
    with pytest.raises(RecipeError) as e:
        precompile.build(r, tree / "fail", n_jobs=1)
    assert e.value.loc == "images[1]"


def test_a_coco_image_id_cannot_choose_the_path(tree):
    """A string image id '../secret/s' in a field template '{image_id}.png' read root/../secret/s.png: the
    annotation file chose the path. Now that image fails (its path and the root named), the others build."""
    fields = {"image": {"decoder": "image", "path": "{image_id}.png"}}
    r = _coco(tree, [("a", "first.png"), ("../secret/s", "second.png"), ("/abs", "third.png")], fields)
    rep = precompile.build(r, tree / "out", n_jobs=1)
    fails = {f.key: f for f in rep.failures}
    assert sorted(fails) == ["second.png", "third.png"]
    assert ("images[1]: image id '../secret/s' ('second.png'): the path '../secret/s.png' of field 'image' "
            f"(template '{{image_id}}.png') leaves inputs.root {str(tree / 'root')!r}") in fails["second.png"].message
    assert fails["second.png"].stage == "annotations" and "'/abs.png'" in fails["third.png"].message
    got = _open(tree / "out")
    assert sorted(got) == ["first.png"] and got["first.png"]["image"].max() == 10
    r["on_error"] = "fail"
    with pytest.raises(RecipeError) as e:
        precompile.build(r, tree / "fail", n_jobs=1)
    assert e.value.loc == "images[1]" and "leaves inputs.root" in e.value.detail


def test_a_coco_image_id_through_a_link_inside_is_read(tree):
    fields = {"image": {"decoder": "image", "path": "{image_id}.png"}}
    r = _coco(tree, [("subalias/c", "x.png"), ("alias", "y.png")], fields)
    rep = precompile.build(r, tree / "out", n_jobs=1)
    assert not rep.failures
    assert [s["image"].max() for _, s in sorted(_open(tree / "out").items())] == [30, 10]


def test_remote_roots_are_checked_as_written():
    """A URL root has no links to resolve: the rule is the text (a '..' part or another place fails)."""
    from precompile.inputs.paths import InputRoot
    from precompile.recipe import load_recipe

    rec = load_recipe({"name": "p", "inputs": {"root": "s3://bucket/data", "match": "{n}.png",
                                               "fields": {"image": {"decoder": "image"}}}})
    rule = InputRoot(rec)
    rule.check("s3://bucket/data/a/b.png")
    for bad in ("s3://bucket/data/../secret.png", "s3://bucket/other/x.png", "s3://bucket/data-x/y.png"):
        with pytest.raises(DecodeError, match="leaves inputs.root 's3://bucket/data'"):
            rule.check(bad)


def _series_tree(tmp: Path) -> Path:
    """root/s1 and root/s2: copies of the sample CT series chest_a; secret/: a copy outside the root."""
    import shutil

    src = Path(__file__).resolve().parents[1] / "sample_data" / "dicom" / "chest_a"
    for d in ("root/s1", "root/s2", "secret"):
        shutil.copytree(src, tmp / d)
    return tmp


def _series_recipe(root: Path, **inputs) -> dict:
    return {"name": "p", "inputs": {"root": str(root), "match": "{series}", "kind": "dir",
                                    "fields": {"ct": {"decoder": "dicom_series"}}, **inputs}, "on_error": "skip"}


def test_a_file_linked_out_of_the_root_inside_a_series_folder_fails_that_series(tmp_path):
    # the folder itself is inside the root; one of its files is a link to a DICOM file outside it: the series
    # decoder used to open it (the path rule looked at the folder only)
    tree = _series_tree(tmp_path)
    victim = tree / "root" / "s1" / "IM0003"
    victim.unlink()
    os.symlink(tree / "secret" / "IM0003", victim)
    (tree / "root" / "s2" / "sub").mkdir()    # a link that stays inside the root is still read
    (tree / "root" / "s2" / "IM0004").rename(tree / "root" / "s2" / "sub" / "IM0004")
    os.symlink("sub/IM0004", tree / "root" / "s2" / "IM0004")
    rep = precompile.build(_series_recipe(tree / "root"), tree / "out", n_jobs=1)
    (f,) = rep.failures
    assert f.key == "s1" and f.stage == "decode" and f.path == str(victim)
    assert f"outside inputs.root {str(tree / 'root')!r}" in f.message and "secret" in f.message
    got = _open(tree / "out")
    assert sorted(got) == ["s2"]
    ref = precompile.build(_series_recipe(tree / "root", follow_links="outside"), tree / "trusted", n_jobs=1)
    assert not ref.failures
    both = _open(tree / "trusted")
    np.testing.assert_array_equal(both["s1"]["ct"], both["s2"]["ct"])   # the linked file is the same slice
    np.testing.assert_array_equal(got["s2"]["ct"], both["s2"]["ct"])


def test_a_home_folder_path_in_root_and_table_is_the_users_home(tmp_path, monkeypatch):
    """inputs.coco.file expanded '~' and inputs.root and inputs.table did not: root: ~/imgs was looked for under
    the recipe's folder ('<dir>/~/imgs is not a folder'). Now all three name the user's home, as a shell would."""
    import numpy as np
    from PIL import Image

    import precompile

    home = tmp_path / "home"
    (home / "imgs").mkdir(parents=True)
    for n in "ab":
        Image.fromarray(np.full((4, 4, 3), ord(n), np.uint8)).save(home / "imgs" / f"{n}.png")
    (home / "t.csv").write_text("path\na.png\nb.png\n")
    monkeypatch.setenv("HOME", str(home))
    folder = {"name": "f", "inputs": {"root": "~/imgs", "match": "{name}.png", "fields": {"image": {"decoder": "image"}}}}
    table = {"name": "t", "inputs": {"root": "~/imgs", "table": "~/t.csv", "path": "{path}",
                                     "fields": {"image": {"decoder": "image"}}}}
    for r in (folder, table):
        rep = precompile.build(r, tmp_path / "out")
        assert rep["num_samples"] == 2
        assert sorted(precompile.open(rep["output"]).keys) == ["a.png", "b.png"]
