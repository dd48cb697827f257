"""Unknown recipe keys get a "did you mean" (issue 35), as unknown decoder and step names do: at the top
level, in inputs, output, a step's options, a decoder's options, a format's options and the nested
mappings (inputs.label, split.group, ...); with no close match the message lists the keys that exist."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from precompile.compiler import check_recipe
from precompile.errors import RecipeError
from precompile.recipe import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((REPO / "recipes" / "images.yaml").read_text(encoding="utf-8"))


def error_of(change) -> str:
    d = copy.deepcopy(BASE)
    change(d)
    with pytest.raises(RecipeError) as e:
        check_recipe(parse_recipe(d, source="r.yaml", base_dir=str(REPO / "recipes")))
    return str(e.value)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["output"].update(sampels_per_shard=4),
     "r.yaml: output.sampels_per_shard: unknown key; did you mean 'samples_per_shard'?"),
    (lambda d: d.update(sede=3), "r.yaml: sede: unknown key; did you mean 'seed'?"),
    (lambda d: d["inputs"].update(mtach="{name}.png"), "r.yaml: inputs.mtach: unknown key; did you mean 'match'?"),
    (lambda d: d["steps"][0]["resize"].update(shortr=3),
     "r.yaml: steps[0].resize.shortr: unknown key; did you mean 'shorter'?"),
    (lambda d: d["inputs"]["fields"]["image"].update(mdoe="rgb8"),
     "r.yaml: inputs.fields.image.mdoe: unknown key; did you mean 'mode'?"),
    (lambda d: d["inputs"]["label"].update(captur="x"),
     "r.yaml: inputs.label.captur: unknown key; did you mean 'capture'?"),
    (lambda d: d.update(limits={"input_byte": 1 << 30}),
     "r.yaml: limits.input_byte: unknown key; did you mean 'input_bytes'?"),
    (lambda d: d.update(split={"group": {"colum": "x"}, "fractions": {"a": 0.5, "b": 0.5}}),
     # the first reported of its three errors (not a string; a GroupSpec without `column`, with `colum`)
     "r.yaml: split.group.colum: unknown key; did you mean 'column'? (and 2 more errors)"),
    (lambda d: d["output"].update(format="png", options={"extra_field": "refuse"}),
     "r.yaml: output.options.extra_field: unknown key; did you mean 'extra_fields'?"),
])
def test_an_unknown_key_names_the_key_it_resembles(change, message):
    assert error_of(change) == message


def test_an_unknown_key_like_none_lists_the_keys_there_are():
    assert error_of(lambda d: d["output"].update(zzz=1)) == (
        "r.yaml: output.zzz: unknown key (known: chunk_bytes, chunk_samples, format, name, options, "
        "samples_per_shard)")
    assert error_of(lambda d: d["steps"][1]["center_crop"].update(qqq=1)).startswith(
        "r.yaml: steps[1].center_crop.qqq: unknown key (known: ")
    # a decoder option: the decoder's own options and the field's path
    msg = error_of(lambda d: d["inputs"]["fields"]["image"].update(pth="x.png"))
    assert msg.startswith("r.yaml: inputs.fields.image.pth: unknown key; did you mean 'path'?"), msg


def test_a_long_unknown_key_is_cut_in_the_message(tmp_path):
    key = "k" * 5000
    d = copy.deepcopy(BASE)
    d["output"][key] = 1
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert len(str(e.value)) < 600 and "(5000 characters)" in str(e.value)


def test_a_table_rows_decoder_option_that_is_unknown_names_the_close_one(tmp_path):
    (tmp_path / "t.csv").write_text("file,s\na.mp4,1\n")
    d = {"name": "t", "inputs": {"root": str(tmp_path), "table": str(tmp_path / "t.csv"), "path": "{file}",
                                 "fields": {"v": {"decoder": "video", "start_sec": {"column": "s"}}}}}
    with pytest.raises(RecipeError, match=r"inputs.fields.v.start_sec: unknown option\(s\) \['start_sec'\] of "
                                          r"decoder 'video'; did you mean 'start_s'\?"):
        parse_recipe(d)
