"""Tables: CSV, TSV, JSON Lines, Parquet (one file, or several by a list or a glob) whose cells name their file
and row; images that show their row; label, target and text columns; splits by hash, group or column.

The truth is the rows the case lists. Each written file is read back with Python's csv / json (Parquet: the
rows were given to pyarrow as they are) and must give those rows, so the truth is what the file says; the build
must store, per row, exactly those cells."""
from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
from typing import Any, Optional

import numpy as np

from .oracles import Report
from .truth import ODD_TEXT, caption, rng_of, save_image

CLASSES = ["cat", "a,b", 'q"x', "\u00fcn\u00ef", "0012", "2020-01-01", "dog"]
MAP = {"-1": "nan", "positive": 1, "": 0}


# -- drawing ------------------------------------------------------------------------------------------------------
def draw_table(seed: int) -> dict:
    from .draw import _choice

    r = rng_of(seed, "table")
    fmt = _choice(r, ["csv", "tsv", "tab", "jsonl", "parquet"], [4, 2, 1, 3, 2])
    big = fmt == "csv" and r.random() < 0.04
    n = 2500 if big else int(r.integers(3, 12))
    text_only = big or r.random() < 0.3
    odd = [t for t in ODD_TEXT if fmt not in ("tsv", "tab") or ("\t" not in t and "\n" not in t)]
    if fmt in ("tsv", "tab") and r.random() < 0.7:
        odd = [t for t in odd if not t.startswith('"')]
    if fmt == "jsonl" and r.random() < 0.6:
        odd = [t for t in odd if not re.match(r"^\d{4}-\d{2}-\d{2}", t)]
    dates = any(re.match(r"^\d{4}-\d{2}-\d{2}", t) for t in odd)
    quotes = any(t.startswith('"') for t in odd)
    classes = [c for c in CLASSES if (dates or fmt != "jsonl" or not re.match(r"^\d{4}-", c))
               and (quotes or fmt not in ("tsv", "tab") or not c.startswith('"'))]
    rows = []
    nfiles = int(_choice(r, [1, 1, 1, 2])) if not big else 1
    for i in range(0 if big else n):
        file = f"f{i:04d}.png"
        part = i % nfiles
        tname = f"meta{part}"
        row: dict[str, Any] = {"id": f"r{i:04d}", "file": file,
                               "label": str(_choice(r, classes)),
                               "caption": caption(r, f"{tname}", i, odd) + "".join(
                                   f"\nline {j} of a caption that spans lines, long enough for 1 MiB in all" for j in range(2, 9)
                                   if big),
                               "when": f"2020-{1 + i // 28:02d}-{1 + i % 28:02d}" if not big else "",
                               "t1": _choice(r, ["1.5", "-1", "", "0", "positive", "2e3"]),
                               "t2": _choice(r, ["0.25", "", "-1", "7"]),
                               "grp": f"g{int(r.integers(0, 4))}", "split": _choice(r, ["train", "val"]),
                               "ex": _choice(r, ["true", "false"]), "_file": part}
        if big:
            row["caption"] = row["caption"].replace('"', "'")
        rows.append(row)
    mixed = fmt == "jsonl" and r.random() < 0.1
    recipe_inputs: dict[str, Any] = {"root": "$IN"}
    files = [f"$IN/meta{p}.{fmt}" + (".gz" if fmt in ("csv", "jsonl") and r.random() < 0.2 and not big else "")
             for p in range(nfiles)]
    if nfiles == 1:
        recipe_inputs["table"] = files[0]
    elif r.random() < 0.5:
        recipe_inputs["table"] = files[::-1]
    else:
        recipe_inputs["table"] = f"$IN/meta*.{fmt}" + (".gz" if files[0].endswith(".gz") else "")
        files = [f.replace(".gz", "") + (".gz" if files[0].endswith(".gz") else "") for f in files]
    gz = files[0].endswith(".gz")
    if text_only:
        recipe_inputs["key"] = "id"
    else:
        recipe_inputs["path"] = "images/{file}"
        if r.random() < 0.3:
            recipe_inputs["key"] = "id"
        dec: dict[str, Any] = {"decoder": "image"}
        if r.random() < 0.3:
            dec["exif_transpose"] = {"column": "ex"}
        if r.random() < 0.3:
            dec["mode"] = "gray8"
        recipe_inputs["fields"] = {"image": dec}
    cols: dict[str, Any] = {"cap": {"column": "caption", "kind": "text"}}
    if not big:
        lab: dict[str, Any] = {"column": "label", "kind": "label"}
        if r.random() < 0.3:
            lab["classes"] = sorted(set(classes))[::-1]
        cols["cls"] = lab
        if r.random() < 0.7:
            cols["tgt"] = {"columns": ["t1", "t2"], "kind": "target", "map": dict(MAP)}
        if r.random() < 0.4:
            cols["one"] = {"column": "t2", "kind": "target", "map": {"-1": "nan"}}
        if r.random() < 0.3:
            cols["when"] = {"column": "when", "kind": "text"}   # every cell looks like a date
    recipe_inputs["columns"] = cols
    recipe: dict[str, Any] = {"name": "fz", "seed": int(r.integers(0, 100)), "inputs": recipe_inputs}
    if not text_only and r.random() < 0.5:
        recipe["steps"] = [{"resize": {"size": [8, 10]}}]
    fmt_out = _choice(r, ["hdf5", "png"], [3, 1]) if not text_only else "hdf5"
    recipe["output"] = {"format": fmt_out, "samples_per_shard": int(r.integers(2, 6)) if not big else 500}
    if not big and r.random() < 0.35:
        how = _choice(r, ["hash", "group", "column", "column_group"])
        if how == "hash":
            recipe["split"] = {"by": "hash", "fractions": {"train": 0.6, "val": 0.4}}
        elif how == "group":
            recipe["split"] = {"by": "hash", "fractions": {"train": 0.5, "val": 0.5}, "group": "grp"}
        elif how == "column":
            recipe["split"] = {"by": "column", "column": "split"}
        else:
            for row in rows:   # a group keeps one split: the column follows the group
                row["split"] = "train" if row["grp"] in ("g0", "g2") else "val"
            recipe["split"] = {"by": "column", "column": "split", "group": {"column": "caption",
                                                                             "pattern": r"row (\d)"}}
            for row in rows:
                row["split"] = "train" if int(re.search(r"row (\d)", row["caption"]).group(1)) % 2 == 0 else "val"
    if mixed:
        rows[min(3, n - 1)]["label"] = 17     # a number among strings
    loader = None
    if not big and recipe["output"]["format"] == "hdf5" and "split" not in recipe and r.random() < 0.4 \
            and (text_only or recipe.get("steps")):
        from .draw import draw_loader

        loader = draw_loader(r, (8, 10), False, n)
        if text_only:
            loader["gpu_steps"] = []
    return {"seed": seed, "family": "table",
            "inputs": {"format": fmt, "rows": rows, **({"big_rows": n} if big else {}), "files": [f.replace("$IN/", "") for f in files], "gz": gz,
                       "big": big, "mixed": mixed, "images": not text_only},
            "recipe": recipe, "loader": loader, "j2": bool(r.random() < 0.05)}


# -- writing ------------------------------------------------------------------------------------------------------
COLUMNS = ["id", "file", "label", "caption", "t1", "t2", "grp", "split", "ex", "when"]


def _open_w(path: str):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.GzipFile(path, "wb", mtime=0), encoding="utf-8", newline="")
    return open(path, "w", encoding="utf-8", newline="")


def _read_back(path: str, fmt: str) -> list[dict]:
    """The file read with Python's own csv / json."""
    op = gzip.open(path, "rt", encoding="utf-8", newline="") if path.endswith(".gz") else open(path, encoding="utf-8", newline="")
    with op as f:
        if fmt == "csv":
            return list(csv.DictReader(f))
        if fmt in ("tsv", "tab"):   # TSV has no quoting (text/tab-separated-values): split on tabs, lines on newlines
            lines = f.read().split("\n")
            head = lines[0].split("\t")
            return [dict(zip(head, ln.split("\t"))) for ln in lines[1:] if ln != ""]
        return [json.loads(ln) for ln in f if ln.strip()]


def big_rows(n: int) -> list[dict]:
    """The rows of a CSV past 1 MiB: captions of 8 lines (quoted cells spanning lines), each naming its row."""
    tail = "".join(f"\nline {j} of a caption that spans lines, long enough for 1 MiB in all" for j in range(2, 9))
    return [{"id": f"r{i:04d}", "file": f"f{i:04d}.png", "label": "cat", "caption": f"meta0 row {i}, a caption" + tail,
             "t1": "1", "t2": "", "grp": f"g{i % 4}", "split": "train", "ex": "true", "when": "", "_file": 0}
            for i in range(n)]


def rows_of(case: dict) -> list[dict]:
    inp = case["inputs"]
    return big_rows(inp["big_rows"]) if inp.get("big_rows") else inp["rows"]


def write(case: dict, root: str) -> dict:
    inp = case["inputs"]
    fmt = inp["format"]
    rows = rows_of(case)
    for part, fname in enumerate(inp["files"]):
        path = os.path.join(root, fname)
        mine = [{k: v for k, v in row.items() if k != "_file"} for row in rows if row["_file"] == part]
        if fmt == "csv":
            with _open_w(path) as f:
                w = csv.DictWriter(f, COLUMNS, lineterminator="\n")
                w.writeheader()
                w.writerows(mine)
        elif fmt in ("tsv", "tab"):
            with _open_w(path) as f:
                f.write("\t".join(COLUMNS) + "\n")
                for row in mine:
                    f.write("\t".join(str(row[c]) for c in COLUMNS) + "\n")
        elif fmt == "jsonl":
            with _open_w(path) as f:
                for row in mine:
                    f.write(json.dumps({c: row[c] for c in COLUMNS}, ensure_ascii=False) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            t = pa.table({c: [row[c] for row in mine] for c in COLUMNS})
            if case["seed"] % 2:
                t = t.set_column(t.schema.get_field_index("grp"), "grp", t.column("grp").dictionary_encode())
            pq.write_table(t, path)
        if fmt != "parquet":
            back = _read_back(path, fmt)
            assert [{c: str(v) for c, v in b.items()} for b in back] == \
                [{c: str(row[c]) for c in COLUMNS} for row in mine], f"{path} does not read back as written"
    if inp.get("images"):
        for i, row in enumerate(rows):
            a = np.zeros((6, 7, 3), np.uint8)
            a[..., 0] = i % 251
            a[..., 1] = i // 251
            a[..., 2] = 200
            save_image(a, os.path.join(root, "images", row["file"]), "png")
    return {row_key(case, row): (i, row) for i, row in enumerate(rows)}


def row_key(case: dict, row: dict) -> str:
    inp = case["recipe"]["inputs"]
    return str(row["id"]) if "key" in inp else "images/" + row["file"]


# -- oracles ------------------------------------------------------------------------------------------------------
def _target(v: Any, mp: Optional[dict]) -> float:
    s = "" if v is None else str(v)
    if mp is not None:
        for k, m in mp.items():
            try:
                hit = float(k) == float(s)
            except ValueError:
                hit = str(k) == s
            if hit:
                return float("nan") if m in ("nan", None) else float(m)
    if s == "":
        return float("nan")
    return float(s)


def input_keys(case: dict, truth: dict) -> list[str]:
    return list(truth)


def check_sample(case: dict, truth: dict, key: str, s: dict, meta: dict, R: Report, copy: int) -> None:
    got = truth.get(key)
    if not R.check("table_rows", got is not None, f"stored key {key!r} is no row's", key):
        return
    i, row = got
    cols = case["recipe"]["inputs"]["columns"]
    R.check("table_cells", s["cap"] == row["caption"], lambda: f"text {s['cap']!r} != cell {row['caption']!r}", key)
    if "tgt" in cols:
        want = np.array([_target(row["t1"], cols["tgt"].get("map")), _target(row["t2"], cols["tgt"].get("map"))], np.float32)
        R.check("table_cells", np.array_equal(s["tgt"], want, equal_nan=True), f"target {s['tgt']} != {want}", key)
    if "when" in cols:
        R.check("table_cells", s["when"] == row["when"], lambda: f"text {s['when']!r} != cell {row['when']!r}", key)
    if "one" in cols:
        want1 = np.float32(_target(row["t2"], cols["one"].get("map")))
        R.check("table_cells", np.array_equal(s["one"], want1, equal_nan=True), f"target {s['one']} != {want1}", key)
    if "image" in s:
        img = s["image"]
        v0, v1 = int(img[0, 0, 0]), int(img[0, 0, 1] if img.shape[-1] > 1 else -1)
        if img.shape[-1] == 3:
            R.check("table_image", (v0, v1) == (i % 251, i // 251), f"image shows row {v0 + 251 * v1}, not {i}", key)


def check_dataset(case: dict, truth: dict, ds: Any, R: Report, split: str) -> None:
    cols = case["recipe"]["inputs"]["columns"]
    if "cls" in cols:
        names = ds.label_names
        classes = cols["cls"].get("classes") or sorted({str(row["label"]) for _, row in truth.values()})
        R.check("labels", list(names) == list(classes), lambda: f"label_names {names} != {classes}")
        for j in range(len(ds)):
            key = ds.key(j)
            if key in truth:
                lab = int(ds[j]["cls"])
                want = str(truth[key][1]["label"])
                R.check("labels", 0 <= lab < len(names) and names[lab] == want,
                        lambda: f"label {lab} ({names[lab] if 0 <= lab < len(names) else '?'}) for cell {want!r}", key)


def check_splits(case: dict, truth: dict, out: str, recipe: dict, R: Report) -> None:
    import precompile

    from .runner import outputs

    where: dict[str, str] = {}
    for split, path in outputs(out, recipe).items():
        if not os.path.exists(path):
            continue
        ds = precompile.open(path)
        for k in ds.keys:
            R.check("split_rows", k not in where, f"in splits {where.get(k)} and {split}", k)
            where[k] = split
        ds.close()
    R.check("split_rows", set(where) == set(truth), f"splits hold {len(where)} of {len(truth)} rows")
    sp = recipe["split"]
    if sp["by"] == "column":
        for k, s in where.items():
            if k in truth:
                R.check("split_rows", truth[k][1]["split"] == s, f"row says {truth[k][1]['split']}, stored in {s}", k)
    grp = sp.get("group")
    if grp:
        col = grp if isinstance(grp, str) else grp["column"]
        pat = None if isinstance(grp, str) else grp.get("pattern")
        seen: dict[str, str] = {}
        for k, s in where.items():
            if k not in truth:
                continue
            v = str(truth[k][1][col])
            if pat:
                m = re.search(pat, v)
                v = m.group(1) if m and m.groups() else (m.group(0) if m else v)
            R.check("split_groups", seen.setdefault(v, s) == s, f"group {v!r} in splits {seen[v]} and {s}", k)


def check_error(case: dict, e: Any, truth: dict, R: Report) -> None:
    """A mixed-type JSON Lines column must be a plan error naming its data row (1-based) and column
    (docs/tables.md); any other table builds."""
    if not case["inputs"].get("mixed"):
        if e is not None:
            R.check("build_error", False, f"{type(e).__name__}: {str(e)[:800]}")
        return
    if not R.check("error_message", e is not None, "a column of numbers and strings built without an error"):
        return
    rows = rows_of(case)
    bad = next(i for i, row in enumerate(rows) if not isinstance(row["label"], str))
    # a row is named by its data row in its own file (docs/tables.md): rows are dealt to the files in turn
    # (seeds 94582, 94695: row 4 of the whole table is row 2 of meta1.jsonl)
    own = sum(1 for row in rows[:bad + 1] if row.get("_file", 0) == rows[bad].get("_file", 0))
    R.check("error_message", f"data row {own}" in str(e) and "'label'" in str(e),
            f"the error does not name data row {own}, column 'label': {str(e)[:300]}")


def expected_failure(case: dict, f: dict, truth: dict) -> bool:
    return False
