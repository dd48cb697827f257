"""Schema-only bounds for options whose own validator checks them, and :func:`refuse_coercion`: a raw value
against the type its key asks for (the recipe's keys and options, and the Loader's device steps' options).

``Field(ge=...)`` would make pydantic check a bound before the option's validator runs and
replace its message; where a validator already checks a bound with its own words, the bound is
given to the JSON Schema alone (``Field(json_schema_extra=checked(ge=0))``), so the editor
refuses what the build refuses and the build's message stays the same.
"""
from __future__ import annotations

import types
from typing import Annotated, Any, Callable, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from .errors import clip

#: the longest ``timeout_s`` (recipe key and ``build --timeout``): a week; the worker's waits take no more
#: (1e9 s raised OverflowError in every shard)
MAX_TIMEOUT_S = 7 * 24 * 3600.0

_KEYS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def checked(item: dict[str, float] | None = None, **bounds: float) -> Callable[[dict[str, Any]], None]:
    """JSON Schema bounds for a number option (``ge``/``le``/``gt``/``lt``), and with ``item`` bounds
    for the numbers of its list form, merged into the ``items`` of each array alternative."""
    num = {_KEYS[k]: v for k, v in bounds.items()}
    per_item = {_KEYS[k]: v for k, v in (item or {}).items()}

    def apply(schema: dict[str, Any]) -> None:
        schema.update(num)   # numeric keywords constrain numbers only: arrays and null are untouched
        for alt in schema.get("anyOf", [schema]):
            if alt.get("type") == "array" and per_item:
                alt["items"] = {**alt.get("items", {}), **per_item}
    return apply


BOUND_KEYS = frozenset(_KEYS.values())


def one_of_required(*names: str) -> dict[str, Any]:
    """A model-level schema hint: exactly one of ``names`` must be given.

    Written as ``if``/``then`` (none given: the first is required) and ``dependentSchemas`` (one
    given: no other), not as ``oneOf``, so that a misspelt option is still the error an editor
    shows first (``oneOf`` failures outrank ``additionalProperties`` in jsonschema's best match)."""
    req = [{"required": [n]} for n in names]
    return {"if": {"not": {"anyOf": req}}, "then": {"required": [names[0]]},
            "dependentSchemas": {n: {"not": {"anyOf": [r for r in req if r["required"] != [n]]}} for n in names}}


# -- a raw value against the type its key asks for (the recipe's and the device steps' options) -----------------
def _members(tp: Any) -> list[Any]:
    """The types a value annotated ``tp`` may be (``Optional``, unions and ``Annotated`` unwrapped)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [m for a in get_args(tp) for m in _members(a)]
    return [tp]


def _literal_values(members: list[Any]) -> list[Any]:
    return [x for m in members if get_origin(m) is Literal for x in get_args(m)]


def _describe(members: list[Any]) -> str:
    """What a value of one of ``members`` may be, in the recipe's words ("an integer or a list")."""
    words: list[str] = []
    for m in members:
        o = get_origin(m)
        w = ("true or false" if m is bool else "an integer" if m is int else "a number" if m is float
             else "a string" if m is str else "a list" if o in (list, tuple, set, frozenset) or m in (list, tuple)
             else "a mapping" if o is dict or m is dict or isinstance(m, type) and issubclass(m, BaseModel)
             else "one of " + ", ".join(repr(x) for x in get_args(m)) if o is Literal else None)
        if w and w not in words:
            words.append(w)
    return " or ".join(words) or "another value"


def _before_validated(model: type[BaseModel]) -> set[str]:
    """The fields of ``model`` whose own ``before``/``wrap``/``plain`` validator reads the raw value first
    (``reduce: off`` for a literal, ``spacing: 2`` for a list): they judge their input themselves."""
    return {f for dec in model.__pydantic_decorators__.field_validators.values()
            if dec.info.mode in ("before", "wrap", "plain") for f in dec.info.fields}


def refuse_coercion(tp: Any, value: Any, loc: tuple = ()) -> tuple[tuple, str] | None:
    """The first place in ``value`` (a recipe's raw YAML data, validated as type ``tp``) where pydantic's lax mode
    would take a value of another type with a meaning the user did not write: a boolean as a number (``true`` ->
    1) or a number as a boolean (``1`` -> true), a string as a number or boolean (``"32"`` -> 32, ``"yes"`` ->
    true). ``(loc, message)`` of it, or None. A field with its own ``before`` validator judges its input itself;
    ``Any`` takes anything (step and decoder options are checked by their own models, through parse_params)."""
    members = _members(tp)
    if any(m is Any or not (isinstance(m, type) or get_origin(m) is not None) for m in members):
        return None
    lits = _literal_values(members)
    if any(lit is value for lit in lits) or (type(value) in (str, int, float) and not isinstance(value, bool)
                                             and any(type(lit) is type(value) and lit == value for lit in lits)):
        return None
    numeric = int in members or float in members
    if isinstance(value, bool):
        if bool not in members and (numeric or any(not isinstance(x, bool) for x in lits)):
            return loc, f"expected {_describe(members)}, got {value!r} (a boolean is not taken as a number)"
        return None
    if isinstance(value, (int, float)):
        if bool in members and not numeric and not any(type(x) in (int, float) for x in lits):
            return loc, f"expected {_describe(members)}, got {clip(repr(value))} (a number is not taken as a boolean)"
        return None
    if isinstance(value, str):
        if str not in members and (numeric or bool in members):
            return loc, (f"expected {_describe(members)}, got the string {clip(repr(value))} (a quoted value is not "
                         f"taken as a number or boolean: write it unquoted)")
        return None
    if isinstance(value, (list, tuple)):
        per_item: dict[int, list[Any]] = {}
        for m in members:
            o, args = get_origin(m), get_args(m)
            if o in (list, set, frozenset) or (o is tuple and len(args) == 2 and args[1] is Ellipsis):
                for i in range(len(value)):
                    per_item.setdefault(i, []).append(args[0] if args else Any)
            elif o is tuple:
                for i in range(min(len(value), len(args))):
                    per_item.setdefault(i, []).append(args[i])
        for i, x in enumerate(value):
            if i in per_item:
                got = refuse_coercion(Union[tuple(per_item[i])], x, loc + (i,))
                if got:
                    return got
        return None
    if isinstance(value, dict):
        for k, x in value.items():
            types_k = []
            for m in members:
                if isinstance(m, type) and issubclass(m, BaseModel):
                    own = _before_validated(m)
                    for name, f in m.model_fields.items():
                        if k in (name, f.alias):
                            types_k.append(Any if name in own else f.annotation)
                elif get_origin(m) is dict:
                    types_k.append(get_args(m)[1] if get_args(m) else Any)
            if types_k:
                got = refuse_coercion(Union[tuple(types_k)], x, loc + (k,))
                if got:
                    return got
    return None


def flag(value: Any, name: str) -> bool:
    """``value`` as a flag: True or False (a numpy bool too); anything else is a ``ValueError`` naming ``name``:
    ``bool()`` made ``include_original="no"`` and ``sort_batches="false"`` true without a word (the reader's
    flags, ``to_source``'s ``clip``)."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    from .errors import echo

    raise ValueError(f"{name} must be True or False, got {echo(value, 80)}")
