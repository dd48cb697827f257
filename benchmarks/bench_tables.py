"""Planning a table input: `make_plan` on a CheXpert-scale CSV against a hand-written csv-module loop, same run.

Writes a CheXpert-style train.csv of N rows (Path with the patient id, Sex, Age, 14 findings holding
1.0 / 0.0 / -1.0 / blank; no image files: planning does not open them) and times, with medians of
--repeats runs:
  csv loop     csv.DictReader, the 14 findings and Age to float32 (blank and -1 -> NaN), a key
               set for duplicates, the patient id by regex and a blake2b split per patient
               (what a user's conversion script does before it can start decoding)
  make_plan    precompile: pyarrow read, per-row checks (numbers, duplicate keys, columns),
               targets with map: {-1: nan}, the patient-grouped hash split, shards
and prints rows/s and the ratio against the loop; then make_plan again with an ``inputs.where`` that reads
three columns and keeps every row (`Frontal/Lateral` == "Frontal" and Age >= 0 and Sex in [...]: the cost
of evaluating it) and with ``split.stratify: Sex`` on the grouped split, each as a ratio against the plain
make_plan of the same run (the three interleaved, run by run, so the machine's load falls on each alike).

--format csv-quoted writes every cell in quotes (csv.QUOTE_ALL: the reader's quote checks run, and
pyarrow is told cells may hold line breaks); --format jsonl writes the rows as JSON Lines (numbers as
numbers, blanks as null) and the loop reads them with json.loads.

    python benchmarks/bench_tables.py [--n 20000 100000] [--repeats 3] [--format csv|csv-quoted|jsonl]
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sample_data"))


def write_table(path: Path, n: int, fmt: str = "csv") -> list[str]:
    from make_sample_data import FINDINGS

    rng = np.random.default_rng(0)
    cells = rng.choice(["1.0", "0.0", "-1.0", ""], size=(n, len(FINDINGS)), p=[0.2, 0.3, 0.1, 0.4])
    header = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", *FINDINGS]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL if fmt == "csv-quoted" else csv.QUOTE_MINIMAL)
        if fmt != "jsonl":
            w.writerow(header)
        for i in range(n):
            p = i // 3
            row = [f"CheXpert-v1.0/train/patient{p:05d}/study{i % 3 + 1}/view1_frontal.jpg",
                   ["Female", "Male"][p % 2], 20 + p % 70, "Frontal", "AP", *cells[i]]
            if fmt == "jsonl":
                f.write(json.dumps(dict(zip(header, row[:5] + [float(c) if c else None for c in cells[i]]))) + "\n")
            else:
                w.writerow(row)
    return list(FINDINGS)


def _rows(path: Path) -> Any:
    """The table's rows as dicts: csv.DictReader, or json.loads per line."""
    with open(path, newline="") as f:
        if path.suffix == ".jsonl":
            yield from (json.loads(line) for line in f)
        else:
            yield from csv.DictReader(f)


def csv_loop(path: Path, findings: list[str]) -> float:
    t0 = time.perf_counter()
    seen, out, splits = set(), [], {}
    for row in _rows(path):
        key = row["Path"]
        if key in seen:
            raise ValueError(key)
        seen.add(key)
        y = [math.nan if row[c] in ("", "-1.0", None, -1.0) else float(row[c]) for c in findings]
        out.append((key, np.asarray(y + [float(row["Age"])], np.float32)))
        pid = re.search(r"patient(\d+)", key).group(1)
        if pid not in splits:
            u = int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "little") / 2.0 ** 64
            splits[pid] = "train" if u < 0.8 else "val" if u < 0.9 else "test"
    return time.perf_counter() - t0


WHERE = '`Frontal/Lateral` == "Frontal" and Age >= 0 and Sex in ["Female", "Male"]'


def plan_time(path: Path, findings: list[str], where: str | None = None, stratify: str | None = None) -> float:
    from precompile.compiler.plan import make_plan
    from precompile.recipe import load_recipe

    r = {"name": "cx", "inputs": {"root": str(path.parent), "table": str(path), "path": "{Path}",
                                  "fields": {"image": {"decoder": "image"}},
                                  "columns": {"findings": {"columns": findings, "kind": "target", "map": {-1: "nan"}},
                                              "age": {"column": "Age", "kind": "target"},
                                              "sex": {"column": "Sex", "kind": "label"}}},
         "split": {"group": {"column": "Path", "pattern": r"patient(\d+)"},
                   "fractions": {"train": 0.8, "val": 0.1, "test": 0.1}}}
    if where is not None:
        r["inputs"]["where"] = where
    if stratify is not None:
        r["split"]["stratify"] = stratify
    t0 = time.perf_counter()
    make_plan(load_recipe(r))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[20000, 100000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format", choices=["csv", "csv-quoted", "jsonl"], default="csv")
    a = ap.parse_args()
    print(f"{'rows':>8} {'csv loop s':>11} {'make_plan s':>12} {'loop rows/s':>12} {'plan rows/s':>12} {'plan/loop':>10}"
          f" {'where s':>8} {'where/plan':>10} {'stratify s':>10} {'strat/plan':>10}")
    with tempfile.TemporaryDirectory() as d:
        for n in a.n:
            path = Path(d) / f"train_{n}.{'jsonl' if a.format == 'jsonl' else 'csv'}"
            findings = write_table(path, n, a.format)
            loop = statistics.median(csv_loop(path, findings) for _ in range(a.repeats))
            runs = [(plan_time(path, findings), plan_time(path, findings, where=WHERE),   # interleaved: the
                     plan_time(path, findings, stratify="Sex")) for _ in range(a.repeats)]   # load hits all three
            plan, where, strat = (statistics.median(r[i] for r in runs) for i in range(3))
            print(f"{n:>8} {loop:>11.3f} {plan:>12.3f} {n / loop:>12.0f} {n / plan:>12.0f} {plan / loop:>10.2f}"
                  f" {where:>8.3f} {where / plan:>10.2f} {strat:>10.3f} {strat / plan:>10.2f}")


if __name__ == "__main__":
    main()
