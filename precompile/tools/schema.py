"""``precompile schema``: a JSON Schema (draft 2020-12) of the recipe language, built from the registries.

The recipe's own pydantic model (:class:`~precompile.recipe.RecipeModel`) gives
the top level; three places that the model keeps free-form are replaced by
discriminated unions over what is registered, each variant carrying the
class's typed ``Params`` / ``Options`` model and its docstring as description:

- a field of ``inputs.fields``: one variant per decoder, told apart by ``decoder``;
- an entry of ``steps``: one variant per step, a mapping with that one key;
- ``output``: one variant per output format, told apart by ``format`` (``hdf5``
  when absent), whose ``options`` are that writer's options.

A decoder, step or writer registered later appears without any change here.
Editors use it through the YAML language server (``# yaml-language-server:
$schema=recipe.schema.json`` as a recipe's first line) to complete and check
recipes; ``jsonschema`` validates recipes against it.
"""
from __future__ import annotations

import copy
import inspect
import io
import json
import re
import textwrap
import tokenize
from typing import Any

from pydantic import BaseModel

from ..errors import PrecompileError
from ..optschema import BOUND_KEYS

DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID = "https://precompile.invalid/recipe.schema.json"


def _doc(obj: Any) -> str:
    """The docstring of ``obj`` as one paragraph-preserving text (RST double backticks made single)."""
    d = inspect.getdoc(obj) or ""
    return d.replace("``", "`").strip()


def _field_accepts(model: type[BaseModel], name: str, value: Any) -> bool:
    """Whether ``model`` takes ``value`` for field ``name`` (errors about other fields do not count)."""
    from pydantic import ValidationError

    try:
        model.model_validate({name: value})
    except ValidationError as e:
        return not any(err["loc"][:1] == (name,) for err in e.errors())
    except (TypeError, ValueError):
        return False
    return True


def _accepts_empty(model: type[BaseModel]) -> bool:
    """Whether the step runs with no options at all (``- random_flip:``): asked of the model itself,
    so a step whose options need one of several keys (``resize``) is not offered ``null``."""
    from pydantic import ValidationError

    try:
        model.model_validate({})
    except (ValidationError, TypeError, ValueError):
        return False
    return True


def _shorthands(model: type[BaseModel], s: dict[str, Any]) -> None:
    """Widen list options whose ``before`` validator also takes one number (``spacing: 2`` for [2, 2, 2]).

    The typed schema says ``list``; the parser says more. What a field takes is asked of the
    model itself, so the schema never refuses a recipe that the parser accepts."""
    props = s.get("properties", {})
    before = {f for dec in model.__pydantic_decorators__.field_validators.values()
              if dec.info.mode in ("before", "wrap", "plain") for f in dec.info.fields}
    for name in sorted(before):
        prop = props.get(name)
        if prop is None:
            continue
        meta = {k: prop[k] for k in ("title", "description", "default") if k in prop}
        core = {k: v for k, v in prop.items() if k not in meta}
        outer = {k: core.pop(k) for k in BOUND_KEYS & set(core)}   # checked() bounds: for every number form
        alts = core["anyOf"] if "anyOf" in core else [core]
        types = {a.get("type") for a in alts}
        for value, jtype in ((1.5, "number"), (1, "integer")):
            if "number" in types or jtype in types:
                break
            if _field_accepts(model, name, value):
                props[name] = {"anyOf": [*alts, {"type": jtype}], **outer, **meta}
                break


def _line_comments(cls: type) -> dict[str, str]:
    """``{option: comment}`` from ``name: type = default  # comment`` lines in ``cls``'s own source."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    own = set(getattr(cls, "__annotations__", {}))
    out: dict[str, str] = {}
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(src)).readline))
    except (tokenize.TokenError, IndentationError):
        return {}
    first: dict[int, str] = {}
    for t in toks:
        if t.type == tokenize.NAME and t.start[0] not in first:
            first[t.start[0]] = t.string
        elif t.type == tokenize.COMMENT:
            name = first.get(t.start[0])
            if name in own and name not in out:
                out[name] = t.string.lstrip("#").strip()
    return out


def _option_descriptions(model: type[BaseModel], s: dict[str, Any]) -> None:
    """Options without a pydantic ``description`` take the comment on their line in the source."""
    props = s.get("properties", {})
    for klass in model.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        for name, text in _line_comments(klass).items():
            if name in props and text and "description" not in props[name]:
                props[name]["description"] = text


def _model_schema(model: type[BaseModel], defs: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``model``'s JSON schema; its ``$defs`` go into ``defs`` under names starting with ``prefix``."""
    s = model.model_json_schema(ref_template="#/$defs/" + prefix + "{model}", mode="validation")
    for k, v in s.pop("$defs", {}).items():
        defs[prefix + k] = v
    s.pop("title", None)
    _shorthands(model, s)
    _option_descriptions(model, s)
    return s


def _name_ref(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def decoder_variants(defs: dict[str, Any], field_decl: dict[str, Any]) -> list[dict[str, Any]]:
    """One object schema per registered decoder: ``decoder: <name>``, ``path`` and the decoder's options."""
    from ..registry import DECODERS

    out = []
    base_props = {k: v for k, v in field_decl.get("properties", {}).items() if k != "decoder"}
    if "path" in base_props and "description" not in base_props["path"]:
        base_props["path"] = {**base_props["path"], "description": "the input file: a pattern using the captures "
                              "of inputs.match (table inputs: the row's {column}s), relative to inputs.root "
                              "(default: the matched file itself, or the row's inputs.path)"}
    for name, cls in DECODERS.items():
        s = _model_schema(cls.Params, defs, f"decoder.{_name_ref(name)}.")
        desc = _doc(cls)
        options = {k: {"anyOf": [v, {"$ref": "#/$defs/row_value"}], **({"description": v["description"]}
                                                                     if "description" in v else {})}
                   for k, v in s.get("properties", {}).items()}   # table inputs: an option may come from a column
        props = {"decoder": {"const": name, "description": desc}, **copy.deepcopy(base_props), **options}
        out.append({"type": "object", "title": f"decoder {name}", "description": desc, "properties": props,
                    "required": ["decoder", *s.get("required", [])], "additionalProperties": False})
    return out


def step_variants(defs: dict[str, Any]) -> list[dict[str, Any]]:
    """One schema per registered step: a mapping ``{<name>: {options}}`` with exactly that key."""
    from ..registry import STEPS

    out = []
    for name, cls in STEPS.items():
        s = _model_schema(cls.Params, defs, f"step.{_name_ref(name)}.")
        desc = _doc(cls)
        s["description"] = desc
        params: dict[str, Any] = s
        if _accepts_empty(cls.Params):
            params = {"anyOf": [s, {"type": "null"}], "description": desc}  # `- random_flip:` means defaults
        out.append({"type": "object", "title": f"step {name}", "description": desc,
                    "properties": {name: params}, "required": [name], "additionalProperties": False})
    return out


def output_variants(defs: dict[str, Any], output: dict[str, Any]) -> list[dict[str, Any]]:
    """One schema per output format: ``format: <name>`` and that writer's ``options``."""
    from ..registry import WRITERS

    default = output.get("properties", {}).get("format", {}).get("default", "hdf5")
    out = []
    for name, cls in WRITERS.items():
        s = _model_schema(cls.Options, defs, f"output.{_name_ref(name)}.")
        desc = _doc(cls)
        props = copy.deepcopy(output.get("properties", {}))
        props["format"] = {"const": name, "description": desc, **({"default": name} if name == default else {})}
        props["options"] = {**s, "description": f"options of the {name} writer"}
        out.append({"type": "object", "title": f"output {name}", "description": desc, "properties": props,
                    "required": [] if name == default else ["format"], "additionalProperties": False})
    return out


def recipe_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a recipe file, with every registered decoder, step and format."""
    from ..recipe import RecipeModel
    from ..registry import DECODERS, STEPS, WRITERS, load_builtins

    load_builtins()
    top = RecipeModel.model_json_schema(ref_template="#/$defs/{model}", mode="validation")
    defs: dict[str, Any] = top.pop("$defs", {})
    field_decl = defs.pop("FieldDecl")
    defs["field"] = {
        "type": "object",
        "description": field_decl.get("description", "one field of a sample and its decoder"),
        "required": ["decoder"],
        "properties": {"decoder": {"enum": list(DECODERS), "description": "the decoder's name"}},
        "oneOf": decoder_variants(defs, field_decl),
        "discriminator": {"propertyName": "decoder"},
    }
    inputs = defs["Inputs"]
    inputs["properties"]["fields"]["additionalProperties"] = {"$ref": "#/$defs/field"}
    defs["row_value"] = {"type": "object", "properties": {"column": {"type": "string"}}, "required": ["column"],
                         "additionalProperties": False,
                         "description": "table inputs (inputs.table): this decoder option is the row's value "
                                        "of the column"}
    defs["step"] = {
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "description": "one step: a mapping from the step's name to its options",
        "propertyNames": {"enum": list(STEPS)},
        "oneOf": step_variants(defs),
    }
    top["properties"]["steps"] = {**{k: v for k, v in top["properties"]["steps"].items() if k != "items"},
                                  "items": {"$ref": "#/$defs/step"},
                                  "description": "steps applied in order to every sample"}
    output = defs.pop("Output")
    defs["output"] = {"type": "object", "description": "where and how the output is written",
                      "properties": {"format": {"enum": list(WRITERS)}},
                      "oneOf": output_variants(defs, output),
                      "discriminator": {"propertyName": "format"}}
    top["properties"]["output"] = {k: v for k, v in top["properties"]["output"].items()
                                   if k not in ("$ref", "allOf")}
    top["properties"]["output"]["$ref"] = "#/$defs/output"
    top["properties"]["output"].pop("default", None)
    schema = {"$schema": DIALECT, "$id": SCHEMA_ID, "title": "precompile recipe",
              "description": "A precompile recipe: inputs and their decoders, steps, copies and the output.",
              **top, "$defs": dict(sorted(defs.items()))}
    schema.pop("title", None)
    schema["title"] = "precompile recipe"
    return schema


DRAFT7 = "http://json-schema.org/draft-07/schema#"


class SchemaError(PrecompileError):
    """The schema cannot be made (a module to import for its registrations is missing or broken)."""

    exit_code = 2


def import_plugins(modules: list[str]) -> None:
    """Import ``modules`` (dotted names) so the decoders, steps and output formats they register are in the schema.

    The current folder is searched first, as ``python -m`` does, so ``schema --import mysteps``
    finds ``./mysteps.py`` beside the recipe without a PYTHONPATH."""
    import importlib
    import os
    import sys

    cwd = os.getcwd()
    if modules and cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise SchemaError(f"cannot import {m!r} for its registrations: {e}") from None
        except Exception as e:  # a plugin that fails while registering: name it, no traceback
            raise SchemaError(f"importing {m!r} failed: {type(e).__name__}: {e}") from None


def as_draft7(schema: dict[str, Any]) -> dict[str, Any]:
    """The same schema for draft-07 tools (the YAML language server validates with draft 7):
    ``$defs`` renamed ``definitions``, every reference rewritten and ``dependentSchemas`` spelt
    ``dependencies``; the schema uses no other keyword that draft 7 lacks."""
    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            out = {}
            for k, v in o.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#/$defs/"):
                    out[k] = "#/definitions/" + v[len("#/$defs/"):]
                elif k == "dependentSchemas":   # draft 7 spells it `dependencies` (one_of_required)
                    out["dependencies"] = walk(v)
                else:
                    out["definitions" if k == "$defs" and o is schema else k] = walk(v)
            return out
        if isinstance(o, list):
            return [walk(x) for x in o]
        return o

    out = walk(schema)
    out["$schema"] = DRAFT7
    return out


def schema_text(indent: int = 2, draft: str = "2020-12") -> str:
    """:func:`recipe_schema` as JSON text (keys in a stable order, newline at the end);
    ``draft="7"`` gives :func:`as_draft7`."""
    s = recipe_schema()
    if draft in ("7", "07", "draft-07"):
        s = as_draft7(s)
    elif draft != "2020-12":
        raise ValueError(f"draft must be '2020-12' or '7', got {draft!r}")
    return json.dumps(s, indent=indent, ensure_ascii=False) + "\n"
