"""Schema-only bounds for options whose own validator checks them.

``Field(ge=...)`` would make pydantic check a bound before the option's validator runs and
replace its message; where a validator already checks a bound with its own words, the bound is
given to the JSON Schema alone (``Field(json_schema_extra=checked(ge=0))``), so the editor
refuses what the build refuses and the build's message stays the same.
"""
from __future__ import annotations

from typing import Any, Callable

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
