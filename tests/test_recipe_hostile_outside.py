"""The recipe attacked with hostile values, key by key, from the outside.

The keys come from the exported JSON Schema (``precompile schema``: what docs/reference-*.md list, held to the
registries by tests/test_docs.py), not from the checks the code makes: every top-level, ``inputs``, ``output``,
``split``, ``limits``, ``label``, ``columns``, ``coco`` key, every decoder's and step's options and every output
format's ``options``. Each gets every value of :data:`HOSTILE` (wrong types, NaN and infinities, negatives, zero,
huge numbers, non-integral floats, empty and very long strings, control characters and NUL, path-like strings)
through the validation entry point (what ``precompile validate`` and ``build`` run before any input is read), and
the outcome is classified:

* refused with a :class:`RecipeError` naming the key: good;
* any other exception (a TypeError, OverflowError, ... out of the validators): a defect;
* accepted with another meaning than the one written (a boolean taken as a number, a string as a number, 32.5
  cut to 32, NaN or an infinity kept, a NUL in a path): a defect.

A few CLI runs confirm that the message and exit code 2 reach the user; whole builds check the values that are
accepted mean what the docs say.
"""
from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from PIL import Image

import step_cases_planar
import step_cases_random
import step_cases_temporal_audio_volume
from conftest import REPO
from precompile.errors import RecipeError
from precompile.recipe import load_recipe, parse_params, parse_recipe
from precompile.registry import WRITERS, load_builtins
from precompile.tools.schema import recipe_schema

NUL = "a\x00b"
HOSTILE: list[Any] = [
    True, False, None, "32", "abc", 32.5, 32.0, -1, 0, -1e30, float("nan"), float("inf"), float("-inf"), 1e30, 2**70,
    [], [1], [True, True], [32.5, 32.5], [float("nan")] * 2, [2**70] * 3, {}, {"a": 1}, "", "x" * 5000,
    "é\u202e\u200b", "\x1b[31m", NUL, "../x", "/etc", "~", "C:\\x",
    [[1, 2], [3, 4]], [None], {"column": 3}, 10**6,
]
#: keys naming files or folders: a NUL there is a path no system call takes
PATH_KEYS = ("inputs.root", "inputs.match", "inputs.path", "inputs.table", "inputs.coco.file",
             "inputs.fields.image.path")


def _cases() -> dict[str, list]:
    out: dict[str, list] = {}
    for mod in (step_cases_planar, step_cases_random, step_cases_temporal_audio_volume):
        for name, cases in mod.CASES.items():
            out.setdefault(name, [p for p, _f in cases])
    return out


def _ints(v: Any) -> list:
    """Every int (not bool) in ``v``, nested lists and tuples opened."""
    if isinstance(v, (list, tuple)):
        return [x for y in v for x in _ints(y)]
    return [v] if isinstance(v, int) and not isinstance(v, bool) else []


def _flat(v: Any) -> list:
    if isinstance(v, (list, tuple)):
        return [x for y in v for x in _flat(y)]
    if isinstance(v, dict):
        return [x for y in v.values() for x in _flat(y)]
    return [v]


def wrong_meaning(value: Any, got: Any, key: str) -> str | None:
    """Why ``got`` (what the recipe holds after validation) is not what ``value`` (what the user wrote) says, or
    None when it is."""
    flat_v, flat_g = _flat(value), _flat(got)
    if any(isinstance(x, bool) for x in flat_v) and not any(isinstance(x, bool) for x in flat_g) \
            and not (isinstance(got, str) and value in (True, False)):
        return f"a boolean taken as {got!r}"
    if isinstance(value, str) and isinstance(got, (bool, int, float)):
        return f"the string {value[:20]!r} taken as {got!r}"
    if any(isinstance(x, float) and not x.is_integer() and math.isfinite(x) for x in flat_v) \
            and any(x == 32 for x in _ints(got)):
        return f"32.5 cut to {got!r}"
    if any(isinstance(x, float) and not math.isfinite(x) for x in flat_g) and not key.endswith(".map"):
        return f"a non-finite number kept: {got!r}"
    if key in PATH_KEYS and any(isinstance(x, str) and "\x00" in x for x in flat_g):
        return "a NUL kept in a path"
    return None


class Target:
    """One key of the recipe: where to put a value in a base recipe and where to read it back after validation."""

    def __init__(self, key: str, base: dict, put: Callable[[dict, Any], None], get: Callable[[Any], Any]):
        self.key, self.base, self.put, self.get = key, base, put, get

    def recipe(self, value: Any) -> dict:
        d = copy.deepcopy(self.base)
        self.put(d, copy.deepcopy(value))
        return d


def _setter(*path: Any) -> Callable[[dict, Any], None]:
    def put(d: dict, v: Any) -> None:
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = v
    return put


def targets(folder: Path) -> list[Target]:
    """Every key the schema lists, each with a base recipe that validates (a step's options: its first case in
    the step-contract cases)."""
    load_builtins()
    schema = recipe_schema()
    defs = schema["$defs"]
    img = {"decoder": "image"}
    base = {"name": "t", "inputs": {"root": ".", "match": "{n}.png", "fields": {"image": dict(img)}}}
    table = {"name": "t", "inputs": {"root": ".", "table": "t.csv", "path": "{p}", "fields": {"image": dict(img)}}}
    coco = {"name": "t", "inputs": {"root": ".", "coco": {"file": "c.json"}}}
    out: list[Target] = []

    def model_get(*path: str) -> Callable[[Any], Any]:
        def get(r: Any) -> Any:
            o = r.model
            for p in path:
                o = o.get(p) if isinstance(o, dict) else getattr(o, p)
            return o
        return get

    for k in schema["properties"]:
        if k not in ("inputs", "steps", "output", "split", "limits"):
            out.append(Target(k, base, _setter(k), model_get(k)))
    output_keys = {p for v in defs["output"]["oneOf"] for p in v.get("properties", {})} - {"options"}
    for k in sorted(output_keys):
        out.append(Target(f"output.{k}", {**base, "output": {}}, _setter("output", k), model_get("output", k)))
    for k in defs["Limits"]["properties"]:
        out.append(Target(f"limits.{k}", {**base, "limits": {}}, _setter("limits", k), model_get("limits", k)))
    for k in defs["SplitSpec"]["properties"]:
        out.append(Target(f"split.{k}", {**base, "split": {"fractions": {"a": 0.5, "b": 0.5}}}, _setter("split", k),
                          model_get("split", k)))
    for k in defs["GroupSpec"]["properties"]:
        b = {**base, "split": {"fractions": {"a": 0.5, "b": 0.5}, "group": {"column": "n"}}}
        out.append(Target(f"split.group.{k}", b, _setter("split", "group", k), model_get("split", "group", k)))
    for k in defs["Inputs"]["properties"]:
        b = table if k in ("table", "path", "key", "columns", "quoting") else coco if k == "coco" else base
        out.append(Target(f"inputs.{k}", b, _setter("inputs", k), model_get("inputs", k)))
    for k in defs["LabelSpec"]["properties"]:
        b = copy.deepcopy(base)
        b["inputs"]["label"] = {"capture": "n"}
        out.append(Target(f"inputs.label.{k}", b, _setter("inputs", "label", k), model_get("inputs", "label", k)))
    for k in defs["ColumnDecl"]["properties"]:
        b = copy.deepcopy(table)
        b["inputs"]["columns"] = {"y": {"column": "c", "kind": "target"}}
        out.append(Target(f"inputs.columns.y.{k}", b, _setter("inputs", "columns", "y", k),
                          model_get("inputs", "columns", "y", k)))
    for k in defs["CocoSpec"]["properties"]:
        out.append(Target(f"inputs.coco.{k}", coco, _setter("inputs", "coco", k), model_get("inputs", "coco", k)))
    for v in defs["field"]["oneOf"]:
        dname = v["title"].removeprefix("decoder ")
        for k in v["properties"]:
            if k == "decoder":
                continue
            b = copy.deepcopy(base)
            b["inputs"]["fields"]["image"] = {"decoder": dname}
            b["inputs"]["kind"] = "dir" if dname == "dicom_series" else "file"
            if k == "path":
                get = lambda r: r.model.inputs.fields["image"].path   # noqa: E731
            else:
                get = (lambda k: lambda r: getattr(r.decoders["image"].params, k))(k)
            out.append(Target(f"inputs.fields.image.{k}" if k == "path" else f"decoders.{dname}.{k}", b,
                              _setter("inputs", "fields", "image", k), get))
    cases = _cases()
    for v in defs["step"]["oneOf"]:
        sname = v["title"].removeprefix("step ")
        opts = v["properties"][sname]
        opts = next((a for a in opts.get("anyOf", [opts]) if "properties" in a), {"properties": {}})
        good = cases.get(sname, [{}])[0]
        for k in opts["properties"]:
            b = {**base, "steps": [{sname: dict(good)}]}
            out.append(Target(f"steps[0].{sname}.{k}", b, lambda d, x, s=sname, k=k: d["steps"][0][s].__setitem__(k, x),
                              (lambda k: lambda r: getattr(r.steps[0].params, k))(k)))
    for v in defs["output"]["oneOf"]:
        fmt = v["title"].removeprefix("output ")
        for k in v.get("properties", {}).get("options", {}).get("properties", {}):
            b = {**base, "output": {"format": fmt, "options": {}}}
            out.append(Target(f"output.options.{k}", b, _setter("output", "options", k),
                              (lambda k: lambda r: getattr(r.writer_options, k))(k)))
    seen: set[str] = set()
    return [t for t in out if not (t.key in seen or seen.add(t.key))]


def validate(data: dict, base_dir: Path) -> Any:
    """What ``precompile validate`` checks before any input is read: the recipe and its format's options."""
    r = parse_recipe(data, source="r.yaml", base_dir=str(base_dir))
    out = r.model.output
    r.writer_options = parse_params(WRITERS.get(out.format).Options, out.options, "r.yaml", ("output", "options"))
    return r


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    for i in range(3):
        Image.fromarray(np.full((12, 16, 3), 40 * i, np.uint8)).save(d / f"{i}.png")
    (d / "t.csv").write_text("p,c\n0.png,1\n1.png,2\n")
    (d / "c.json").write_text('{"images": [{"id": 1, "file_name": "0.png", "width": 16, "height": 12}], '
                              '"annotations": [], "categories": [{"id": 1, "name": "a"}]}')
    return d


def classify(t: Target, value: Any, folder: Path) -> str | None:
    """None when the outcome is good; else what is wrong."""
    try:
        r = validate(t.recipe(value), folder)
    except RecipeError as e:
        msg = str(e)
        leaf = t.key.rsplit(".", 1)[-1]
        if leaf not in msg and t.key.split(".")[0] not in msg:
            return f"refused without naming the key: {msg[:200]}"
        if len(msg) > 2500:
            return f"a message of {len(msg)} characters"
        return None
    except Exception as e:   # noqa: BLE001 - any other exception is the defect this test looks for
        return f"{type(e).__name__}: {str(e)[:200]}"
    return wrong_meaning(value, t.get(r), t.key)


def test_every_base_recipe_validates(folder):
    """The attack starts from recipes that are good without the attacked key (else a refusal proves nothing)."""
    ts = targets(folder)
    assert len(ts) > 150
    for t in ts:
        validate(copy.deepcopy(t.base), folder)


#: defects found and not fixed yet, as (key, value) pairs: each must still occur (the list cannot go stale)
KNOWN: set[tuple[str, str]] = set()   # all fixed: see the commits of tests/test_recipe_hostile_outside.py


def test_every_key_refuses_or_keeps_the_meaning_of_every_hostile_value(folder):
    ts = targets(folder)
    found = {(t.key, repr(v)[:40]): why for t in ts for v in HOSTILE if (why := classify(t, v, folder)) is not None}
    print(f"{len(ts)} keys x {len(HOSTILE)} values = {len(ts) * len(HOSTILE)} recipes")
    new = {k: w for k, w in found.items() if k not in KNOWN}
    assert not new, f"{len(new)} defects:\n" + "\n".join(f"{k} = {v}: {w}" for (k, v), w in new.items())
    assert not KNOWN - set(found), f"fixed, to take off KNOWN: {sorted(KNOWN - set(found))}"


HEAD = 'name: t\ninputs: {root: ., match: "{n}.png", fields: {image: {decoder: image%s}}}\n'


def load_yaml(tmp_path: Path, text: str, decoder_options: str = "") -> Any:
    p = tmp_path / "r.yaml"
    p.write_text(text if text.startswith("name:") else HEAD % decoder_options + text)   # a whole recipe, or HEAD + text
    return load_recipe(p)


@pytest.mark.parametrize("text,options,msg", [
    ("copies: true", "", "copies: expected an integer, got True (a boolean is not taken as a number)"),
    ("output: {samples_per_shard: '64'}", "", "output.samples_per_shard: expected an integer, got the string '64' "
     "(a quoted value is not taken as a number or boolean: write it unquoted)"),
    ("keep_original: 1", "", "keep_original: expected true or false, got 1 (a number is not taken as a boolean)"),
    ("stats: 'yes'", "", "stats: expected true or false, got the string 'yes'"),
    ("steps: [{random_flip: {horizontal: true}}]", "",
     "steps[0].random_flip.horizontal: expected a number, got True (a boolean is not taken as a number)"),
    ("steps: [{fix_length: {length: '16000'}}]", "", "steps[0].fix_length.length: expected an integer, got the string"),
    ("limits: {input_bytes: true}", "", "limits.input_bytes: expected an integer, got True"),
    ("", ", exif_transpose: 0", "inputs.fields.image.exif_transpose: expected true or false, got 0"),
])
def test_a_value_of_another_type_is_refused_not_converted(tmp_path, text, options, msg):
    """pydantic's lax mode took `copies: true` as 1 copy, `samples_per_shard: "64"` as 64 and `keep_original: 1`
    as true: one rule (recipe.refuse_coercion) now refuses them at every level, naming the key."""
    with pytest.raises(RecipeError) as e:
        load_yaml(tmp_path, text, options)
    assert msg in str(e.value)


def test_exponent_numbers_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `1e3` (no '.') as a string: `std: 1e-2` was refused as "got '1e-2'" and
    `timeout_s: 1e3` taken from the string; the recipe loader reads them as YAML 1.2 does, as numbers."""
    r = load_yaml(tmp_path, "timeout_s: 1e3\nsteps: [{gaussian_noise: {std: 1e-2}}]\n")
    assert r.model.timeout_s == 1000.0 and type(r.model.timeout_s) is float
    assert r.steps[0].params.std == (0.0, 0.01) or 0.01 in _flat(r.steps[0].params.std)
    # quoted, it is a string still (a class name, a split name)
    r = load_yaml(tmp_path, "name: t\ninputs: {root: ., match: '{n}.png', fields: {image: {decoder: image}}, "
                            "label: {capture: n, classes: ['1e3', 1e3x]}}\n")
    assert r.model.inputs.label.classes == ["1e3", "1e3x"]


@pytest.mark.parametrize("step,msg", [
    ({"patches3d": {"size": [16.5, 16, 16]}}, "steps[0].patches3d.size: sizes must be whole numbers, got 16.5"),
    ({"patches3d": {"size": 8, "stride": 2.5}}, "steps[0].patches3d.stride: sizes must be whole numbers, got 2.5"),
    ({"resample_volume": {"shape": [8, 8, True]}}, "steps[0].resample_volume.shape: sizes must be whole numbers, got True"),
    ({"crop_pad_volume": {"shape": float("inf")}}, "steps[0].crop_pad_volume.shape: sizes must be whole numbers, got inf"),
])
def test_volume_sizes_are_whole_numbers(step, msg):
    """[16.5, 16, 16] was cut to [16, 16, 16] without a word, True was 1, and .inf raised OverflowError out of
    the validator (a traceback, not a recipe error)."""
    with pytest.raises(RecipeError) as e:
        parse_recipe({"name": "t", "inputs": {"root": ".", "match": "{n}.nii", "fields": {"ct": {"decoder": "nifti"}}},
                      "steps": [step]}, source="r.yaml")
    assert msg in str(e.value)


@pytest.mark.parametrize("where", [
    "output: {format: LONG}", "name: t\ninputs: {root: ., match: '{n}.png', fields: {image: {decoder: image}}, label: {capture: LONG}}",
    "steps: [{resize: {size: LONG}}]", "steps: [{gaussian_noise: {std: LONG}}]", "steps: [{random_affine: {degrees: LONG}}]",
])
def test_a_long_value_is_echoed_cut(tmp_path, where):
    """A 100,000-character value was quoted whole in the message (an unknown format name, a capture, a step
    validator's "got ..."); the message is cut, saying how long the value was."""
    with pytest.raises(RecipeError) as e:
        load_yaml(tmp_path, where.replace("LONG", "x" * 100_000) + "\n")
    msg = str(e.value)
    assert len(msg) < 2500 and ("(100002 characters)" in msg or "(100000 characters)" in msg), msg[:3000]


@pytest.mark.parametrize("inputs,loc", [
    ({"root": "im\x00gs", "match": "{n}.png", "fields": {"image": {"decoder": "image"}}}, "inputs.root"),
    ({"root": ".", "match": "{n}\x00.png", "fields": {"image": {"decoder": "image"}}}, "inputs.match"),
    ({"root": ".", "match": "{n}.png", "fields": {"image": {"decoder": "image", "path": "{n}\x00.png"}}},
     "inputs.fields.image.path"),
    ({"root": ".", "table": "t.csv", "path": "{p}\x00", "fields": {"image": {"decoder": "image"}}}, "inputs.path"),
    ({"root": ".", "coco": {"file": "c\x00.json"}}, "inputs.coco.file"),
])
def test_a_nul_in_a_path_is_refused_by_validation(folder, inputs, loc):
    """A NUL in a field's path template was accepted and failed every input at decode time ("ValueError:
    embedded null byte", exit 3, blamed on the inputs); in match it read as "no inputs match". No file name
    holds a NUL: the key is refused before any input is read."""
    with pytest.raises(RecipeError, match=re.escape(f"r.yaml: {loc}: holds a NUL character")):
        validate({"name": "t", "inputs": inputs}, folder)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precompile.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("text,msg", [
    ("seed: 1180591620717411303424", "seed: Input should be less than or equal to 9223372036854775807"),
    ("split: {fractions: {a: 1.0}, seed: 1180591620717411303424}",
     "split.seed: Input should be less than or equal to 9223372036854775807"),
    ("timeout_s: .inf", "timeout_s: Input should be less than or equal to 604800"),
    ("timeout_s: 1.0e+9", "timeout_s: Input should be less than or equal to 604800"),
    ("output: {chunk_bytes: 1099511627776}", "output.chunk_bytes: Input should be less than or equal to 1073741824"),
])
def test_numbers_past_what_the_build_can_use_are_refused_by_validation(tmp_path, text, msg):
    """Each was accepted and then failed the build: seed 2^70 with a TypeError traceback writing the index (exit 1),
    timeout_s .inf or 1e9 with an OverflowError in every shard blamed on the inputs (exit 3), chunk_bytes 1 TiB by
    asking the output folder for 1.1 TiB for 3 small images (exit 6)."""
    with pytest.raises(RecipeError) as e:
        load_yaml(tmp_path, text + "\n")
    assert msg in str(e.value)


def test_cli_timeout_over_the_bound_is_a_usage_error(folder, tmp_path):
    (tmp_path / "r.yaml").write_text(f"name: t\ninputs: {{root: {folder}, match: '{{n}}.png', "
                                     f"fields: {{image: {{decoder: image}}}}}}\n")
    for bad in ("inf", "1e9", "nan"):   # nan passed click's range (no comparison holds) to a pydantic dump
        out = run_cli("build", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "out"), "--timeout", bad, cwd=tmp_path)
        assert out.returncode == 2 and "Invalid value for '--timeout'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "pydantic" not in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,line", [
    ("name: t\nname: u\ninputs: {root: ., match: '{n}.png', fields: {image: {decoder: image}}}\n", "line 2: key 'name'"),
    ("name: t\ninputs: {root: ., match: '{n}.png', fields: {image: {decoder: image}, image: {decoder: mask}}}\n",
     "line 2: key 'image'"),
    ("name: t\ninputs: {root: ., match: '{n}.png', fields: {image: {decoder: image}}}\n"
     "steps:\n- resize: {size: 8, size: 16}\n", "line 4: key 'size'"),
])
def test_a_key_given_twice_is_refused(tmp_path, text, line):
    """PyYAML keeps the last of two equal keys without a word: `name: t` then `name: u` built 'u', and a second
    `image` field replaced the first. The loader refuses it, with the line."""
    with pytest.raises(RecipeError, match=re.escape(line) + r" is given twice \(first on line \d+\)"):
        load_yaml(tmp_path, text)


def test_merge_keys_still_override(tmp_path):
    r = load_yaml(tmp_path, "name: t\ninputs: {root: ., match: '{n}.png', fields: {image: {decoder: image}}}\n"
                  "steps:\n- resize: &r {size: 8, interpolation: area}\n- resize: {<<: *r, size: 16}\n")
    assert [list(s.params.size) for s in r.steps] == [[8, 8], [16, 16]]


@pytest.mark.parametrize("over,msg", [
    ({"name": "n" * 300}, "r.yaml: name: is 300 characters long; at most 100 (it names the output's files)"),
    ({"output": {"name": "o" * 300}}, "r.yaml: output.name: is 300 characters long; at most 100"),
    ({"split": {"fractions": {"s" * 300: 1.0}}}, "r.yaml: split: split name 'sss"),
])
def test_a_name_too_long_for_a_file_name_is_refused_by_validation(folder, over, msg):
    """A 300-character name was accepted: the build then failed creating its files, an output name with exit 6
    ('cannot create the output folder ... File name too long', the output blamed), a split name after building
    every shard with h5py's raw 'Unable to synchronously create file' (exit 1)."""
    with pytest.raises(RecipeError) as e:
        validate({"name": "t", "inputs": {"root": ".", "match": "{n}.png", "fields": {"image": {"decoder": "image"}}},
                  **over}, folder)
    assert msg in str(e.value) and "at most 100" in str(e.value)


def test_cli_refuses_a_long_split_name_before_building(folder, tmp_path):
    (tmp_path / "r.yaml").write_text(f"name: t\ninputs: {{root: {folder}, match: '{{n}}.png', fields: {{image: "
                                     f"{{decoder: image}}}}}}\nsplit: {{fractions: {{{'s' * 300}: 1.0}}}}\n")
    out = run_cli("build", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "out"), "--no-progress", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {tmp_path / 'r.yaml'}: split: split name 'sss") and "at most 100" in out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("over,msg", [
    ({"split": {"fractions": {"a": 1.0}, "group": {"column": "n", "pattern": "(("}}},
     "r.yaml: split.group.pattern: not a valid regular expression: missing ), unterminated subpattern"),
    ({"split": {"fractions": {"a": 1.0}, "group": {"column": 3}}},
     "r.yaml: split.group.column: Input should be a valid string, got 3"),
    ({"inputs": {"root": ".", "table": "t.csv", "path": "{p}", "where": 3, "fields": {"image": {"decoder": "image"}}}},
     "r.yaml: inputs.where: Input should be a valid dictionary, got 3"),
])
def test_an_error_inside_a_union_names_the_key_not_pydantic_s_member_name(folder, over, msg):
    """A key that takes a string or a mapping (split.group, inputs.where) reported the first union member's type
    error, with pydantic's member name in the key path: 'split.group.str: Input should be a valid string, got
    {'column': 'n', 'pattern': '(('}' for a bad regular expression in the mapping."""
    base = {"name": "t", "inputs": {"root": ".", "match": "{n}.png", "fields": {"image": {"decoder": "image"}}}}
    with pytest.raises(RecipeError) as e:
        validate({**base, **over}, folder)
    assert str(e.value).startswith(msg), str(e.value)


@pytest.mark.parametrize("inputs,loc", [
    ({"root": ".", "match": "{n}.png", "fields": {"image": {"decoder": "image"}},
      "label": {"capture": "n", "classes": ["0", "1", "0", "2"]}}, "inputs.label.classes"),
    ({"root": ".", "table": "t.csv", "path": "{p}", "fields": {"image": {"decoder": "image"}},
      "columns": {"y": {"column": "c", "kind": "label", "classes": ["1", "2", "2"]}}}, "inputs.columns.y.classes"),
])
def test_a_class_named_twice_is_refused(folder, inputs, loc):
    """classes: [0, 1, 0, 2] was accepted: class '0' got one of two ids and the stored list of class names held
    it twice (ids and names no longer one to one)."""
    with pytest.raises(RecipeError, match=re.escape(f"r.yaml: {loc}: class ") + r"'[02]' is named twice"):
        validate({"name": "t", "inputs": inputs}, folder)


def _nifti_folder(d: Path) -> Path:
    nib = pytest.importorskip("nibabel", reason="nibabel is not installed (the volume extra)")
    d.mkdir()
    nib.save(nib.Nifti1Image(np.arange(6 * 5 * 4, dtype=np.int16).reshape(6, 5, 4), np.eye(4)), str(d / "a.nii.gz"))
    return d


def test_a_step_output_over_the_sample_budget_is_refused_before_it_is_made(tmp_path):
    """resample_volume with spacing 1e-9 mm asked numpy for a (6e9, 5e9, 4e9) volume: 'array is too big;
    `arr.size * arr.dtype.itemsize` is larger than the maximum possible size' (numpy's words, blamed on the input);
    a smaller factor allocates gigabytes first. The step checks the output it would make against
    limits.sample_bytes (the plan cannot: the output shape depends on each input's spacing)."""
    from precompile import build

    root = _nifti_folder(tmp_path / "nii")
    recipe = {"name": "t", "inputs": {"root": str(root), "match": "{n}.nii.gz", "fields": {"ct": {"decoder": "nifti"}}},
              "steps": [{"resample_volume": {"spacing": 1e-3}}], "limits": {"sample_bytes": 1 << 20}}
    with pytest.raises(Exception) as e:
        build(recipe, str(tmp_path / "out"), progress=False)
    assert "resample_volume: its output (4000, 5000, 6000) float32 would take 480000000000 bytes (447.0 GiB), over " \
           "the per-sample budget of 1048576 bytes (1.0 MiB) (limits.sample_bytes)" in str(e.value), str(e.value)
    assert e.value.exit_code == 3 and "a.nii.gz" in str(e.value)



def _four_frames(av, path) -> None:
    """A 4-frame 32x24 mpeg4 video (frames of one grey each) at ``path``."""
    c = av.open(str(path), "w")
    s = c.add_stream("mpeg4", rate=10)
    s.width, s.height, s.pix_fmt = 32, 24, "yuv420p"
    for t in range(4):
        for p in s.encode(av.VideoFrame.from_ndarray(np.full((24, 32, 3), 30 * t, np.uint8), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()


def test_temporal_jitter_length_over_the_sample_budget_is_refused_before_it_is_made(tmp_path):
    """temporal_jitter with length 2^70 failed in numpy ('Maximum allowed size exceeded'); length 10^7 on a 24x32
    video asked for 21.5 GiB (a MemoryError, or the OOM killer): the plan cannot know a video's frame size."""
    av = pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
    from precompile import build

    (tmp_path / "v").mkdir()
    _four_frames(av, tmp_path / "v" / "a.mp4")
    for length, nbytes in ((2**70, 2**70 * 24 * 32 * 3), (10**7, 10**7 * 24 * 32 * 3)):
        recipe = {"name": "t", "inputs": {"root": str(tmp_path / "v"), "match": "{n}.mp4",
                                          "fields": {"video": {"decoder": "video"}}},
                  "steps": [{"temporal_jitter": {"length": length}}]}
        with pytest.raises(Exception) as e:
            build(recipe, str(tmp_path / f"out{length}"), progress=False)
        assert f"temporal_jitter: its output ({length}, 24, 32, 3) uint8 would take {nbytes} bytes" in str(e.value)
        assert "(limits.sample_bytes)" in str(e.value) and e.value.exit_code == 3


@pytest.mark.parametrize("options,msg", [
    ({"decoder": "audio", "channels": 2}, "inputs.fields.sound: channels: 2 asks for 2 channels, but mono: true "
                                          "(the default) mixes to one: set mono: false to keep 2"),
    ({"decoder": "mask", "max_label": 300}, "inputs.fields.sound: max_label: label 300 does not fit uint8"),
    ({"decoder": "mask", "classes": [0, 1, 700]}, "inputs.fields.sound: classes: label 700 does not fit uint8"),
])
def test_decoder_options_that_cannot_mean_what_they_say_are_refused_naming_the_key(folder, options, msg):
    """audio channels: 2 with mono left true was accepted and ignored (one channel stored); a mask's label over its
    dtype was refused without naming the option (`inputs.fields.x: label 300 does not fit uint8`)."""
    with pytest.raises(RecipeError) as e:
        validate({"name": "t", "inputs": {"root": ".", "match": "{n}.wav", "fields": {"sound": options}}}, folder)
    assert msg in str(e.value), str(e.value)


CLI_CASES = {
    "a boolean as a count": (b"copies: true\n", "copies: expected an integer, got True"),
    "a key given twice": (b"name: u\n", "refused: line 3: key 'name' is given twice (first on line 1)"),
    "a python tag": (b"seed: !!python/object/apply:os.system ['echo pwned']\n",
                     "not valid YAML: could not determine a constructor for the tag"),
    "an empty file": (None, "the recipe is empty: expected a mapping of keys (name, inputs, ...)"),
    "a list": (b"- name: t\n", "expected a mapping at the top level, got list"),
    "binary bytes": (bytes(range(256)), "not valid YAML"),
}


@pytest.mark.parametrize("why", sorted(CLI_CASES))
def test_cli_build_refuses_a_hostile_recipe_with_exit_2_and_one_line(folder, tmp_path, why):
    """What reaches the user: `precompile build` exits 2 with one `error: FILE: ...` line, no traceback, and makes
    no output folder (the empty file said 'got NoneType')."""
    extra, msg = CLI_CASES[why]
    head = f"name: t\ninputs: {{root: {folder}, match: '{{n}}.png', fields: {{image: {{decoder: image}}}}}}\n".encode()
    rf = tmp_path / "r.yaml"
    rf.write_bytes(b"" if extra is None else extra if extra[:1] in (b"-", b"\x00") else head + extra)
    out = run_cli("build", str(rf), "-o", str(tmp_path / "out"), "--no-progress", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {rf}: ") and msg in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "pwned").exists()


def test_whole_numbers_written_as_floats_and_ints_for_probabilities_build_what_the_docs_say(folder, tmp_path):
    """The values the rule keeps: `samples_per_shard: 2.0`, `copies: 1.0`, `seed: 3.0` are the integers (never 1 or
    cut), and `horizontal: 1` is the probability 1.0: the build's bytes are those of the plain spelling, and every
    augmented copy is the source mirrored (pixels carry their own truth: a left-right ramp)."""
    from precompile import build, open as open_build

    src = tmp_path / "src"
    src.mkdir()
    ramp = np.broadcast_to(np.arange(16, dtype=np.uint8)[None, :, None] * 10, (12, 16, 3)).copy()
    for i in range(3):
        Image.fromarray(ramp + i).save(src / f"{i}.png")

    def run(out: str, **over: Any) -> Any:
        r = {"name": "t", "inputs": {"root": str(src), "match": "{n}.png", "fields": {"image": {"decoder": "image"}}},
             "output": {"samples_per_shard": over["sps"]}, "copies": over["copies"], "seed": over["seed"],
             "steps": [{"random_flip": {"horizontal": over["h"], "vertical": over["v"]}}]}
        build(r, str(tmp_path / out), progress=False)
        return open_build(str(tmp_path / out / "t.h5"))

    a = run("a", sps=2.0, copies=1.0, seed=3.0, h=1, v=0)
    b = run("b", sps=2, copies=1, seed=3, h=1.0, v=0.0)
    assert [s["num_samples"] for s in a.shards] == [s["num_samples"] for s in b.shards]
    # (the shard keys differ: a step's options enter the key as written, so `1` and `1.0` are two spellings)
    copies = [int(c) for c in a.copies]
    assert len(a) == 6 and copies == [0, 1] * 3
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i]["image"], b[i]["image"])
        want = ramp + i // 2
        np.testing.assert_array_equal(a[i]["image"], want[:, ::-1] if copies[i] else want)


def test_seeded_combinations_of_two_hostile_keys_raise_only_recipe_errors(folder):
    """Two keys of one base recipe attacked at once (a seeded draw, the same every run): validation either accepts
    or raises RecipeError, never another exception (one check's input is another's garbage)."""
    import random

    ts = targets(folder)
    rng = random.Random(20261129)   # the test's own draw of cases, not build randomness
    other: list[str] = []
    for _ in range(400):
        t1 = rng.choice(ts)
        t2 = rng.choice([t for t in ts if t.base is t1.base])
        data = t1.recipe(rng.choice(HOSTILE))
        try:
            t2.put(data, copy.deepcopy(rng.choice(HOSTILE)))
        except (TypeError, KeyError, AttributeError):
            continue   # the first value replaced the mapping the second key lives in
        try:
            validate(data, folder)
        except RecipeError:
            pass
        except Exception as e:   # noqa: BLE001 - any other exception is the defect this test looks for
            other.append(f"{t1.key} + {t2.key}: {type(e).__name__}: {str(e)[:150]}")
    assert not other, "\n".join(other)


@pytest.mark.parametrize("shape,opts,msg", [
    ((1, 400), {"shorter": 4000}, "resize: shorter: 4000 on a 1x400 input makes 4000x1600000; a side is at most 32768"),
    ((8, 16), {"shorter": 2000}, "resize: its output (2000, 4000, 3) uint8 would take 24000000 bytes (22.9 MiB), over "
                                 "the per-sample budget of 1048576 bytes (1.0 MiB) (limits.sample_bytes)"),
])
def test_resize_to_a_side_keeps_the_output_within_the_bounds(tmp_path, shape, opts, msg):
    """resize shorter: 4000 on a 1x400 image asked OpenCV for a 4000x1600000 image (19.2 GB: 'Insufficient memory',
    or the memory itself), past the 32768-pixel side every other 2D step keeps to; the output size depends on each
    input's aspect, so the plan cannot check it: the step does, before resizing."""
    from precompile import build

    (tmp_path / "i").mkdir()
    Image.fromarray(np.zeros((*shape, 3), np.uint8)).save(tmp_path / "i" / "a.png")
    recipe = {"name": "t", "inputs": {"root": str(tmp_path / "i"), "match": "{n}.png",
                                      "fields": {"image": {"decoder": "image"}}},
              "steps": [{"resize": opts}], "limits": {"sample_bytes": 1 << 20}}
    with pytest.raises(Exception) as e:
        build(recipe, str(tmp_path / "out"), progress=False)
    assert msg in str(e.value) and e.value.exit_code == 3, str(e.value)


def test_padding_steps_keep_within_the_sample_budget(tmp_path):
    """fix_length length 2*10^9 on audio of unknown channel count (mono: false) allocated 7.45 GiB (so did windows
    with short: pad), and clips
    length 10^7 with short: pad on a 4-frame video stacked 21.5 GiB of repeated frames (the plan knows neither
    size): each input now fails alone, naming the step, the shape and limits.sample_bytes."""
    import wave

    av = pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
    from precompile import build

    (tmp_path / "w").mkdir()
    with wave.open(str(tmp_path / "w" / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes(np.zeros(100, np.int16).tobytes())
    (tmp_path / "v").mkdir()
    _four_frames(av, tmp_path / "v" / "a.mp4")
    cases = [("w", "a.wav", {"decoder": "audio", "mono": False}, {"fix_length": {"length": 2 * 10**9}},
              "fix_length: its output (1, 2000000000) float32 would take 8000000000 bytes (7.5 GiB)"),
             ("w", "a.wav", {"decoder": "audio", "mono": False}, {"windows": {"length": 2 * 10**9, "hop": 1,
                                                                           "short": "pad"}},
              "windows: its output (1, 2000000000) float32 would take 8000000000 bytes (7.5 GiB)"),
             ("v", "a.mp4", {"decoder": "video"}, {"clips": {"length": 10**7, "short": "pad"}},
              "clips: its output (10000000, 24, 32, 3) uint8 would take 23040000000 bytes (21.5 GiB)")]
    for folder_name, file, field, step, msg in cases:
        recipe = {"name": "t", "inputs": {"root": str(tmp_path / folder_name), "match": file,
                                          "fields": {"x": field}}, "steps": [step]}
        with pytest.raises(Exception) as e:
            build(recipe, str(tmp_path / f"out-{folder_name}"), progress=False)
        assert msg in str(e.value) and "(limits.sample_bytes)" in str(e.value), str(e.value)


def _peak_build(recipe: dict, out: Path, spill_limit: int, monkeypatch) -> int:
    """Build ``recipe`` in this process (-j1) with samples spilled past ``spill_limit`` bytes; the peak of traced
    memory (numpy's arrays are traced) over the build."""
    import tracemalloc

    import precompile.spill
    from precompile import build

    monkeypatch.setattr(precompile.spill, "DEFAULT_LIMIT", spill_limit)
    tracemalloc.start()
    try:
        build(recipe, str(out), progress=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_windows_of_one_input_are_spilled_not_held(tmp_path, monkeypatch):
    """windows held every window of one recording at once (copies, until the shard writes them): a 160 KB,
    10-second WAV cut with `{length: 40000, hop: 1}` took 6 GB, so the step refused a total over
    limits.input_bytes, which refused one hour at 48 kHz cut every half second. The windows now come one at a
    time and wait for the shard in a SampleSpill (memory up to a bound, then a temporary file): 1,001 windows of
    40 KB (38 MiB, 38 times the input budget) build under a 256 KiB spill bound in well under their total, each
    equal to the recording's samples sliced by numpy, and the same whatever the bound."""
    import wave

    import precompile

    (tmp_path / "w").mkdir()
    pcm = (np.arange(40000) * 7 % 65536 - 32768).astype(np.int16)
    with wave.open(str(tmp_path / "w" / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes(pcm.tobytes())
    recipe = {"name": "t", "inputs": {"root": str(tmp_path / "w"), "match": "a.wav",
                                      "fields": {"x": {"decoder": "audio", "dtype": "int16"}}},
              "steps": [{"windows": {"length": 20000, "hop": 20}}], "limits": {"input_bytes": 1 << 20},
              "output": {"samples_per_shard": 4096}}
    total = 1001 * 20000 * 2
    peak = _peak_build(recipe, tmp_path / "small", 256 << 10, monkeypatch)
    assert peak < total / 2, (peak, total)
    _peak_build(recipe, tmp_path / "large", 1 << 30, monkeypatch)
    small, large = precompile.open(tmp_path / "small" / "t.h5"), precompile.open(tmp_path / "large" / "t.h5")
    assert len(small) == len(large) == 1001
    for i in range(1001):
        assert small.key(i) == large.key(i)
    got = {small.key(i): small[i]["x"] for i in range(1001)}
    base = small.key(0).split("#")[0]
    for k in range(1001):
        assert np.array_equal(got[f"{base}#w{k}"], pcm[None, 20 * k:20 * k + 20000]), k


def test_the_patches_of_one_volume_are_spilled_not_held(tmp_path, monkeypatch):
    """patches3d held every patch of a volume at once: a 48^3 float32 volume cut into 16^3 patches at stride 1
    (35,937 patches, 576 MiB) peaked at 797 MB whatever limits.input_bytes said (4 MiB), and a CT cut into
    overlapping 64^3 patches holds gigabytes. The patches now wait in a SampleSpill: here 13^3 = 2,197 patches of
    16^3 (34 MiB) under a 256 KiB bound peak well under their total, each the volume's voxels sliced by numpy."""
    import nibabel as nib

    import precompile

    (tmp_path / "v").mkdir()
    vol = np.arange(28 ** 3, dtype=np.float32).reshape(28, 28, 28)
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(tmp_path / "v" / "a.nii"))
    recipe = {"name": "p", "inputs": {"root": str(tmp_path / "v"), "match": "a.nii",
                                      "fields": {"v": {"decoder": "nifti"}}},
              "steps": [{"patches3d": {"size": 16, "stride": 1}}], "output": {"samples_per_shard": 8192}}
    total = 13 ** 3 * 16 ** 3 * 4
    peak = _peak_build(recipe, tmp_path / "small", 256 << 10, monkeypatch)
    assert peak < total / 2, (peak, total)
    ds = precompile.open(tmp_path / "small" / "p.h5")
    assert len(ds) == 13 ** 3
    zyx = vol.T   # nibabel's (x, y, z) stored as (z, y, x)
    for i in range(0, len(ds), 97):
        z, y, x = ds.meta(i)["patch"]["corner"]
        assert np.array_equal(np.squeeze(ds[i]["v"]), zyx[z:z + 16, y:y + 16, x:x + 16]), i
