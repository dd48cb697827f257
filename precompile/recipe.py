"""YAML recipe -> validated, typed :class:`Recipe` with a canonical hash.

The recipe is parsed with the safe YAML loader (refusing alias bombs and deep nesting before anything is
built: :func:`safe_yaml`) and checked with pydantic. Every
error names the recipe file, the key path (``steps[2].size``) and what was
expected; unknown decoder and step names and unknown keys (at any level: the
models' fields, :func:`accepted_keys`) name the close matches. Decoder and
step parameters are validated by the registered class's own ``Params`` model,
so a new decoder or step needs no change here.

Inputs come from a folder (``inputs.match``: a pattern of paths) or a table
(``inputs.table``: one sample per row; ``path``, ``key``, ``columns`` and decoder
options given as ``{column: NAME}``; read at plan time by
:mod:`precompile.inputs`). ``split:`` asks for one output per split.
``Recipe.__init__`` is a sequence of short stages: decoders, steps, the output,
the inputs' own rules (:func:`precompile.inputs.listing.check_inputs`, :func:`precompile.inputs.coco.check_inputs`).
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .formats import names as fmt
from .formats.names import NAME_RE, check_field_name, check_name_length
from .errors import ECHO_CHARS, MAX_MESSAGE_CHARS, RecipeError, clip, did_you_mean, echo
from .optschema import MAX_TIMEOUT_S, _members, refuse_coercion
from .registry import DECODERS, STEPS, WRITERS, UnknownName, load_builtins

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: the largest seed (and split seed): an int64, as the index stores it (2^70 failed writing the index)
MAX_SEED = 2**63 - 1
#: the largest chunk_bytes: a variable-shape field's chunk is this many bytes on disk however few samples it holds
MAX_CHUNK_BYTES = 1 << 30


def check_classes(v: Optional[list[str]]) -> Optional[list[str]]:
    """A list of class names in id order names each class once (a name given twice would get one of two ids)."""
    seen: set[str] = set()
    for name in v or []:
        if name in seen:
            raise ValueError(f"class {echo(name, 80)} is named twice (each class once, in id order)")
        seen.add(name)
    return v


class LabelSpec(_Model):
    capture: str = Field(description="the capture in `match` whose value is the class name")
    field: str = Field("label", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                       description="the output field holding the class id (letters, digits, '_', '.', '-')")
    classes: Optional[list[str]] = Field(None, description="class names in id order; default: sorted unique values")

    _classes = field_validator("classes")(check_classes)


#: the widest a path template may pad or cut one cell (``{n:>WIDTH}``, ``{x:.PRECISION}``): no path is longer
MAX_TEMPLATE_WIDTH = 4096


def check_template(v: Optional[str]) -> Optional[str]:
    """A path template whose format specs ask for no width or precision over :data:`MAX_TEMPLATE_WIDTH`
    (``{p:>100000000}`` would make a 100-million-character path of every row); a ValueError naming the slot."""
    for m in re.finditer(r"\{([^{}:]+):([^{}]*)\}", v or ""):
        if any(len(d.lstrip("0")) > len(str(MAX_TEMPLATE_WIDTH)) or int(d) > MAX_TEMPLATE_WIDTH
               for d in re.findall(r"\d+", m.group(2))):
            raise ValueError(f"{clip(m.group(0), 60)} asks for a width or precision over {MAX_TEMPLATE_WIDTH} "
                             f"characters (no path is longer)")
    return v


def check_path_text(v: Optional[str]) -> Optional[str]:
    """A recipe string that names files or folders (a root, a pattern, a template, a file) with no NUL character:
    no file name holds one, and the system calls refuse it (``embedded null byte``) only when an input is read."""
    if isinstance(v, str) and "\x00" in v:
        raise ValueError(f"holds a NUL character (\\x00) at position {v.index(chr(0))}: no file or folder name can")
    return v


class FieldDecl(BaseModel):
    """One field of a sample: where its file is and how to decode it (extra keys are decoder options)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    path: Optional[str] = None
    decoder: str

    @field_validator("path")
    @classmethod
    def _path(cls, v: Optional[str]) -> Optional[str]:
        check_path_text(v)
        if v is not None and (v.startswith("/") or ".." in v.split("/")):
            raise ValueError("must stay inside inputs.root (no leading '/' or '..'): make root the folder that "
                             "holds every field's files and name their folders in the templates (docs/"
                             "reference-recipe.md, Paths and symlinks)")
        return check_template(v)


class ColumnDecl(_Model):
    """A field made of table columns (``inputs.columns``): a class label, a float32 target or a text."""

    column: Optional[str] = Field(None, description="the column holding the value")
    columns: Optional[list[str]] = Field(None, description="target only: several columns -> a (n,) vector")
    kind: Literal["label", "target", "text"]
    classes: Optional[list[str]] = Field(None, description="label only: class names in id order "
                                                           "(default: sorted unique values)")
    map: dict[Union[float, str], Union[float, str, None]] = Field(
        default_factory=dict, description="target only: cell value -> number ('nan' or null: NaN; key '': a blank cell)")

    _classes = field_validator("classes")(check_classes)

    @model_validator(mode="after")
    def _check(self) -> "ColumnDecl":
        if (self.column is None) == (self.columns is None):
            raise ValueError("give exactly one of column (one value) or columns (a vector of targets)")
        if self.columns is not None and (self.kind != "target" or not self.columns):
            raise ValueError("columns (a list) is for kind target only, and needs at least one column")
        if self.classes is not None and self.kind != "label":
            raise ValueError("classes is for kind label only")
        if self.map and self.kind != "target":
            raise ValueError("map is for kind target only")
        for k, v in self.map.items():
            if isinstance(v, str) and v.lower() != "nan":
                raise ValueError(f"map value for {k!r} must be a number, nan or null, got {v!r}")
        return self


class GroupSpec(_Model):
    column: str = Field(description="the column (or match capture) holding the group")
    pattern: Optional[str] = Field(None, description="a regular expression searched in the value; its first "
                                                     "group (or whole match) is the group")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v


class SplitSpec(_Model):
    """``split:``: one output per split, assigned by a stable hash of the key (or group) or by a column."""

    by: Literal["hash", "column"] = "hash"
    column: Optional[str] = Field(None, description="by: column: the column (or capture) naming each row's split")
    group: Optional[Union[str, GroupSpec]] = Field(None, description="rows with the same group share a split")
    fractions: Optional[dict[str, float]] = Field(None, description="by: hash: split name -> fraction (sum 1)")
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED, description="default: the recipe's seed")
    stratify: Optional[str] = Field(
        None,   # absent: left out of Recipe.resolved(), so the recipe's key is as before the option existed
        description="by: hash: the column (or capture) whose classes every split holds in the fractions' "
                    "proportions (within one row per class and split; with group, within its largest group)")

    @model_validator(mode="after")
    def _check(self) -> "SplitSpec":
        if self.by == "column":
            if self.column is None:
                raise ValueError("by: column needs column (the column naming each row's split)")
            if self.fractions is not None:
                raise ValueError("fractions are for by: hash (by: column takes the split from the column)")
            if self.stratify is not None:
                raise ValueError("stratify is for by: hash (by: column takes the split from the column)")
        else:
            if self.column is not None:
                raise ValueError("column is for by: column (by: hash assigns by key or group)")
            if not self.fractions:
                raise ValueError("by: hash needs fractions, e.g. {train: 0.8, val: 0.1, test: 0.1}")
            for name, f in self.fractions.items():
                if not NAME_RE.match(name):
                    raise ValueError(f"split name {echo(name)} must be letters, digits, '_', '.', '-'")
                check_name_length(name, f"split name {echo(name, 20)} ")
                if not 0 < f <= 1:
                    raise ValueError(f"fraction of {name!r} must be in (0, 1], got {f}")
            if abs(sum(self.fractions.values()) - 1) > 1e-6:
                raise ValueError(f"fractions must sum to 1, got {sum(self.fractions.values()):g}")
        return self


class CocoSpec(_Model):
    """``inputs.coco``: a COCO annotation file (instances or person keypoints) lists the samples: one per image,
    with its boxes, box labels and, on request, keypoints and masks (see docs/coco.md)."""

    file: str = Field(description="the annotation JSON (instances_*.json, person_keypoints_*.json), relative to "
                                  "the recipe's folder; images are found under inputs.root by their file_name")
    image: str = Field("image", description="the field holding the image the annotations refer to (declared in "
                                            "inputs.fields; default: `image` with the image decoder)")
    mask: Literal["none", "semantic", "instance"] = Field(
        "none", description="a `mask` field rasterised from the segmentations: `semantic` (H, W, 1) class map "
                            "(box label + 1, 0 = background) or `instance` (H, W, 1) uint16 map (box index + 1)")
    keypoints: bool = Field(False, description="add a `keypoints` field (N, K, 3): x, y, visibility per box")
    crowd: Literal["drop", "keep", "ignore"] = Field(
        "drop", description="iscrowd: 1 annotations: `drop` (default) leaves them out; `keep` makes them boxes "
                            "like any other; `ignore` gives no box but marks their pixels in the mask with "
                            "the mask dtype's largest value")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return check_field_name(v)

    @field_validator("file")
    @classmethod
    def _file(cls, v: str) -> str:
        return check_path_text(v)


def _also_a_string(schema: dict) -> None:
    """``inputs.coco`` in the JSON Schema: the file name alone is accepted too (the parser turns it into {file})."""
    schema["anyOf"] = [{"type": "string", "description": "the annotation file, every option at its default"},
                       *schema.get("anyOf", [])]



class Inputs(_Model):
    root: str
    storage_options: dict[str, Any] = Field(default_factory=dict,
                                            description="fsspec options for a remote root (s3://, gs://, https://)")
    table: Optional[Union[str, list[str]]] = Field(
        None, description="a CSV, TSV, JSON Lines or Parquet file (a path, a URL or a glob, or a list of them: "
                          "their rows in sorted file order): one sample per row")
    coco: Optional[CocoSpec] = Field(None, description="a COCO annotation file (or {file: ..., options}) listing "
                                                       "the images under root and their annotations",
                                     json_schema_extra=_also_a_string)
    match: Optional[str] = Field(None, validate_default=True,
                                 description="a pattern of input paths under root (not with table)")
    where: Union[dict[str, str], str] = Field(
        default_factory=dict, description="folder: {capture: regex} narrowing what a capture may match; table: an "
                                          "expression over the row's columns keeping the rows it holds for, e.g. "
                                          "'Sex == \"Female\" and Age >= 18' (docs/tables.md)")
    kind: Literal["file", "dir"] = "file"
    fields: dict[str, FieldDecl] = Field(default_factory=dict, description="the fields of a sample and their "
                                         "decoders (required with match; with coco, default {image: {decoder: image}})")
    label: Optional[LabelSpec] = None
    path: Optional[str] = Field(None, description="table: a template over the row's columns giving the input "
                                                  "under root, e.g. '{patient}/{study}.jpg'")
    key: Optional[str] = Field(None, description="table: the column whose value is the sample key "
                                                 "(default: the row's path)")
    columns: dict[str, ColumnDecl] = Field(default_factory=dict, description="table: fields made of columns")
    follow_links: Literal["inside", "outside"] = Field(
        "inside", description="symbolic links under a local root: `inside` (default) reads an input only when its "
                              "path, links resolved, stays under root; `outside` also follows links that lead out "
                              "of it (a trusted layout). '..' and absolute paths are refused either way")
    quoting: Optional[Literal["csv", "none"]] = Field(
        None, description="table: how a CSV or TSV file quotes its cells: `csv` (RFC 4180: a quoted cell may hold "
                          "separators, doubled quotes and line breaks) or `none` (a quote is plain text); default "
                          "csv for .csv files, none for .tsv/.tab files (TSV has no quoting)")

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        return check_path_text(v)

    @field_validator("table")
    @classmethod
    def _table(cls, v: Optional[str | list[str]]) -> Optional[str | list[str]]:
        if isinstance(v, list) and not v:
            raise ValueError("an empty list of table files")
        from .inputs.table.files import table_format

        for entry in [v] if isinstance(v, str) else v or []:
            check_path_text(entry)
            table_format(entry)  # a ValueError naming the known extensions
        return v

    @field_validator("where")
    @classmethod
    def _where(cls, v: Union[dict[str, str], str]) -> Union[dict[str, str], str]:
        if isinstance(v, str):
            from .inputs.table.where import parse_where

            parse_where(v)   # a WhereSyntaxError (a ValueError) saying at which character
        return v

    @field_validator("quoting")
    @classmethod
    def _quoting(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        from .inputs.table.files import table_format

        t = info.data.get("table")
        if v is not None and not any(table_format(x) in ("csv", "tsv") for x in ([t] if isinstance(t, str) else t or [])):
            raise ValueError("applies to CSV and TSV tables (inputs.table names none)")
        return v

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict) -> dict:
        for name in v:
            check_field_name(name)
        if sum(1 for c in v.values() if c.kind == "label") > 1:
            raise ValueError("at most one column of kind label (the output has one list of label names)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _coco_fields(cls, data: Any) -> Any:
        """``coco: FILE`` is ``coco: {file: FILE}``; with ``coco`` and no ``fields``: one image field decoded
        by the image decoder."""
        if isinstance(data, dict) and isinstance(data.get("coco"), str):
            data = {**data, "coco": {"file": data["coco"]}}
        if isinstance(data, dict) and data.get("coco") is not None and "fields" not in data:
            coco = data["coco"]
            name = coco.get("image", "image") if isinstance(coco, dict) else "image"
            data = {**data, "fields": {name: {"decoder": "image"}} if isinstance(name, str) else {}}
        return data

    @model_validator(mode="after")
    def _source(self) -> "Inputs":
        if self.coco is not None:
            if self.table is not None:
                raise ValueError("inputs.coco and inputs.table each list the inputs: give one of them")
            for k in ("path", "key"):
                if getattr(self, k) is not None:
                    raise ValueError(f"{k} is for table inputs (inputs.table)")
            if self.columns:
                raise ValueError("columns is for table inputs (inputs.table)")
        elif self.table is None:
            for k in ("path", "key"):
                if getattr(self, k) is not None:
                    raise ValueError(f"{k} is for table inputs (inputs.table)")
            if self.columns:
                raise ValueError("columns is for table inputs (inputs.table)")
            if isinstance(self.where, str):
                raise ValueError("where as an expression is for table inputs (inputs.table); a folder's where is "
                                 "{capture: regex}")
            if self.match is None:
                raise ValueError("needs match (a pattern of input paths), table (a file with one row per sample) or "
                                 "coco (an annotation file)")
            if not self.fields:
                raise ValueError("fields: needs at least one field")
        else:
            if self.match is not None or isinstance(self.where, dict) and self.where or self.label is not None:
                raise ValueError("table inputs take no match, label or where: {capture: regex} (use path and "
                                 "columns; where takes an expression over the columns, e.g. where: 'Age >= 18')")
            if not self.fields and not self.columns:
                raise ValueError("a table needs at least one field or column")
            if self.path is None and self.key is None:
                raise ValueError("a table needs path (a template giving each row's input) or key (a column)")
        return self

    @field_validator("match", "path")
    @classmethod
    def _match(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        if v is None and info.field_name == "match" and info.data.get("table") is None and info.data.get("coco") is None:
            raise ValueError("required key is missing (or give table: a file with one row per sample, or coco: an "
                             "annotation file)")
        check_path_text(v)
        if v is not None and (v.startswith("/") or ".." in Path(v).parts):
            raise ValueError("must be a relative pattern inside root (no leading '/' or '..')")
        return check_template(v) if info.field_name == "path" else v

    @field_validator("storage_options")
    @classmethod
    def _storage_options(cls, v: dict) -> dict:
        from .storage.remote import check_storage_options

        bad = check_storage_options(v)
        if bad is not None:
            raise ValueError(f"{bad!r} looks like a credential; credentials do not belong in a recipe (it is stored "
                             f"in the output): use the store's environment variables or config files")
        return v

    @field_validator("fields")
    @classmethod
    def _fields(cls, v: dict) -> dict:
        for name in v:
            check_field_name(name)
        return v


class Output(_Model):
    format: str = "hdf5"
    name: Optional[str] = None
    samples_per_shard: int = Field(256, ge=1)
    chunk_samples: Optional[int] = Field(None, ge=1)
    chunk_bytes: int = Field(2 * 1024 * 1024, ge=4096, le=MAX_CHUNK_BYTES)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if os.path.isabs(v) or ".." in Path(v).parts or "/" in v or "\\" in v:
            raise ValueError("must be a plain file name inside the output folder (no '/', '..' or absolute path)")
        if not NAME_RE.match(v):
            raise ValueError("must be letters, digits, '_', '.', '-'")
        return check_name_length(v)


MAX_COPIES = 10_000   # augmented copies of one input (a larger count is a typo or a different job)


class Limits(_Model):
    """Memory budgets checked before work starts (see docs/limits.md)."""
    input_bytes: int = Field(1 << 30, ge=1 << 20, le=1 << 40,
                             description="memory one input may take while it is decoded (declared size checked "
                                         "before anything is allocated); default 1 GiB")
    sample_bytes: int = Field(1 << 30, ge=1 << 10, le=1 << 40,
                              description="largest stored sample (all its fields) the plan accepts; default 1 GiB")


class RecipeModel(_Model):
    name: str
    seed: int = Field(0, ge=0, le=MAX_SEED)
    imports: list[str] = Field(default_factory=list,
                               description="Python modules that register custom decoders and steps")
    inputs: Inputs
    steps: list[dict[str, Any]] = Field(default_factory=list)
    copies: int = Field(0, ge=0, le=MAX_COPIES)
    keep_original: bool = True
    output: Output = Field(default_factory=Output)
    on_error: Literal["fail", "skip"] = "fail"
    max_failures: Optional[int] = Field(None, ge=0)
    timeout_s: Optional[float] = Field(None, gt=0, le=MAX_TIMEOUT_S)
    split: Optional[SplitSpec] = None
    limits: Limits = Field(default_factory=Limits)
    stats: bool = Field(False, description="compute the output's statistics (precompile stats) as part of "
                                           "the build, and again after every rebuild that writes the index")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be letters, digits, '_', '.', '-' (it names the output file)")
        return check_name_length(v)


def format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + clip(str(part), 80)   # a key is the recipe's text: bounded
    return out


def _tag(m: Any) -> str:
    """The name pydantic gives union member ``m`` in an error's path (``str``, ``GroupSpec``, ``dict[str,str]``,
    ``literal['a','b']``), lowercased."""
    name = getattr(m, "__name__", None) if isinstance(m, type) else None
    return (name or str(m).replace("typing.", "")).replace(" ", "").lower()


def _step_into(tp: Any, part: Any) -> tuple[Any, bool]:
    """(the type at ``part`` of a value of type ``tp``, whether ``part`` is the name pydantic gives a union's
    member rather than a key); (None, False) when the path leaves what the annotations say."""
    members = _members(tp)
    for m in members:
        if len(members) > 1 and isinstance(part, str) and part.lower() == _tag(m):
            return m, True
    for m in members:
        if isinstance(m, type) and issubclass(m, BaseModel):
            for name, f in m.model_fields.items():
                if part in (name, f.alias):
                    return f.annotation, False
        elif get_origin(m) in (list, tuple) and isinstance(part, int):
            return get_args(m)[0], False
        elif get_origin(m) is dict and isinstance(part, str):
            return get_args(m)[1], False
    return None, False


def accepted_keys(model: Any, loc: tuple) -> tuple[list[str] | None, tuple]:
    """The keys the mapping at ``loc`` (a pydantic error's, up to the key at fault) of a value of ``model``
    accepts, from the models' fields (None when the annotations do not say), and ``loc`` without the union
    member names pydantic puts in it."""
    tp, keep = model, []
    for part in loc:
        tp, tag = _step_into(tp, part)
        if tp is None:
            return None, tuple(loc)
        if not tag:
            keep.append(part)
    keys = [f.alias or n for m in _members(tp) if isinstance(m, type) and issubclass(m, BaseModel)
            for n, f in m.model_fields.items()]
    return (sorted(set(keys)) if keys else None), tuple(keep)


def _check_coercion(tp: Any, value: Any, source: str | None, prefix: tuple) -> None:
    got = refuse_coercion(tp, value)
    if got is not None:
        loc, msg = got
        raise RecipeError(msg, source=source, loc=format_loc(prefix + loc))


def _unknown_key(key: Any, known: list[str] | None) -> str:
    """What an unknown key's message adds: the close keys ("did you mean"), else the keys there are."""
    if not known:
        return ""
    return did_you_mean(str(key), known) or f" (known: {', '.join(known)})"


def pydantic_to_recipe_error(err: ValidationError, source: str | None, prefix: tuple = (), model: Any = None,
                              also: tuple[str, ...] = ()) -> RecipeError:
    """The first error of ``err`` (an unknown key first: a misspelt key is why a required one is missing) as a
    RecipeError naming the key path; an unknown key gets the keys of ``model`` (the class validated, plus
    ``also``) close to it."""
    errors = err.errors()
    if model is not None:   # paths without pydantic's names of union members (split.group.str -> split.group)
        errors = [{**e, "loc": accepted_keys(model, tuple(p for p in e["loc"] if p != "function-after"))[1]}
                  for e in errors]
    # an unknown key first (a misspelt key is why a required one is missing); then an error of the union member
    # the value is (a mapping's bad regex, not the string member's "should be a string"), the deepest path first
    first = next((e for e in errors if e["type"] == "extra_forbidden"), None) or min(
        errors, key=lambda e: (e["type"].endswith("_type"), -len(e["loc"])))
    loc = tuple(p for p in first["loc"] if p not in ("function-after",))
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "required key is missing"
    elif first["type"] == "extra_forbidden":
        known, parent = accepted_keys(model, loc[:-1]) if model is not None else (None, loc[:-1])
        loc = parent + loc[-1:]
        msg = "unknown key" + _unknown_key(loc[-1], sorted(set(known or []) | set(also)) if known else None)
    elif "input" in first and first["type"] not in ("value_error",):
        msg = f"{msg}, got {clip(repr(first['input']))}"
    msg = msg.removeprefix("Value error, ")
    if "input" in first and len(repr(first["input"])) > ECHO_CHARS:   # a validator's message quoting it whole
        msg = msg.replace(repr(first["input"]), echo(first["input"]))
    msg = clip(msg, MAX_MESSAGE_CHARS - 40)   # room for the count below
    more = len(errors) - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return RecipeError(msg, source=source, loc=format_loc(prefix + loc))


def parse_params(cls_params: type[BaseModel], raw: Any, source: str | None, loc: tuple,
                 also: tuple[str, ...] = ()) -> BaseModel:
    """``raw`` validated by ``cls_params``; an error names ``loc`` (an unknown key: the options close to it, or
    among ``also``, the keys beside these options)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"expected a mapping of options, got {raw!r}", source=source, loc=format_loc(loc))
    _check_coercion(cls_params, raw, source, loc)
    try:
        return cls_params.model_validate(raw)
    except ValidationError as e:
        raise pydantic_to_recipe_error(e, source, loc, cls_params, also) from None


class Recipe:
    """A validated recipe: the typed model, instantiated decoders and steps, and paths.

    ``base_dir`` is the recipe file's folder; ``inputs.root`` is relative to it.
    """

    def __init__(self, model: RecipeModel, source: str | None = None, base_dir: str | None = None):
        from . import plugins

        load_builtins()
        self.model = model
        self.source = source
        self.base_dir = os.path.abspath(base_dir or (os.path.dirname(source) if source else "."))
        plugins.load_entry_points(source)
        plugins.import_modules(list(model.imports), source, self.base_dir)
        self.row_options: dict[str, dict[str, str]] = {}   # field -> {decoder option: table column}
        self._static_options: dict[str, dict[str, Any]] = {}
        self._row_decoders: dict[tuple, Any] = {}
        self.decoders = {f: self._make_decoder(f, decl) for f, decl in model.inputs.fields.items()}
        for dec in self.decoders.values():
            dec.max_bytes = model.limits.input_bytes   # each decoder checks declared sizes against it
        self.steps = [self._make_step(i, entry) for i, entry in enumerate(model.steps)]
        for step in self.steps:
            step.max_bytes = model.limits.sample_bytes   # a step whose output size depends on the input checks it
            step.input_bytes = model.limits.input_bytes
        self._check_output()
        self._check_inputs()
        from .decoders.jpeg_reduce import configure

        configure(self)  # reduce: auto: which JPEG decode scale the steps allow (read by the image decoder)

        self.code = plugins.code_fingerprint(self.decoders, self.steps)

    # -- the stages of __init__ ------------------------------------------------------------
    def _make_decoder(self, fname: str, decl: FieldDecl) -> Any:
        """The decoder of field ``fname`` with its options checked; options given as ``{column: NAME}``
        (table inputs only) are taken from each row (``row_options``) and checked per row at plan time."""
        from . import plugins
        from .decoders.base import Decoder

        loc = ("inputs", "fields", fname)
        try:
            dcls = plugins.refresh_class(DECODERS.get(decl.decoder), DECODERS, decl.decoder)
        except UnknownName as e:
            raise RecipeError(str(e), source=self.source, loc=format_loc(loc + ("decoder",))) from None
        if not (isinstance(dcls, type) and issubclass(dcls, Decoder)):
            raise RecipeError(f"decoder {decl.decoder!r} is registered as {dcls!r}, not a Decoder subclass",
                              source=self.source, loc=format_loc(loc + ("decoder",)))
        static, from_rows = {}, {}
        for opt, v in dict(decl.model_extra or {}).items():
            if isinstance(v, dict) and set(v) == {"column"} and isinstance(v["column"], str):
                if self.model.inputs.table is None:
                    raise RecipeError("an option taken from a column ({column: NAME}) needs table inputs",
                                      source=self.source, loc=format_loc(loc + (opt,)))
                from_rows[opt] = v["column"]
            else:
                static[opt] = v
        self._static_options[fname] = static
        if not from_rows:
            return dcls(parse_params(dcls.Params, static, self.source, loc, also=tuple(FieldDecl.model_fields)))
        self.row_options[fname] = from_rows
        unknown = sorted(set(from_rows) - set(dcls.Params.model_fields))
        if unknown:
            raise RecipeError(f"unknown option(s) {unknown} of decoder {decl.decoder!r}"
                              f"{did_you_mean(unknown[0], sorted(dcls.Params.model_fields))}", source=self.source,
                              loc=format_loc(loc + (unknown[0],)))
        _check_coercion(dcls.Params, static, self.source, loc)
        try:   # the options given here are checked now; those from the rows with each row at plan time
            dcls.Params.model_validate(static)
        except ValidationError as e:
            mine = [er for er in e.errors() if er["loc"] and er["loc"][0] in static]
            if mine:
                msg = mine[0]["msg"].removeprefix("Value error, ")
                raise RecipeError(f"{msg}, got {mine[0]['input']!r}", source=self.source,
                                  loc=format_loc(loc + tuple(mine[0]["loc"]))) from None
        return dcls(dcls.Params.model_construct(**static))

    def row_params(self, fname: str, values: dict[str, Any]) -> Any:
        """The decoder options of field ``fname`` with a table row's ``values`` (a pydantic ValidationError
        when they do not fit)."""
        return type(self.decoders[fname]).Params.model_validate({**self._static_options[fname], **values})

    def _make_step(self, i: int, entry: Any) -> Any:
        from . import plugins
        from .transforms.base import Step

        loc = ("steps", i)
        if not isinstance(entry, dict) or len(entry) != 1:
            raise RecipeError("expected a mapping with one step name, e.g. {resize: {size: [64, 64]}}",
                              source=self.source, loc=format_loc(loc))
        (sname, raw), = entry.items()
        try:
            scls = plugins.refresh_class(STEPS.get(sname), STEPS, sname)
        except UnknownName as e:
            raise RecipeError(str(e), source=self.source, loc=format_loc(loc)) from None
        if not (isinstance(scls, type) and issubclass(scls, Step)):
            raise RecipeError(f"step {sname!r} is registered as {scls!r}, not a Step subclass",
                              source=self.source, loc=format_loc(loc))
        return scls(parse_params(scls.Params, raw, self.source, loc + (sname,)))

    def _check_output(self) -> None:
        from .storage.remote import is_url

        model = self.model
        inp = model.inputs
        table = [inp.table] if isinstance(inp.table, str) else inp.table or []
        urls = [inp.root, *table, inp.coco.file if inp.coco is not None else None]
        if inp.storage_options and not any(is_url(u) for u in urls):
            raise RecipeError("storage_options apply only to a remote root (s3://, gs://, https://, ...), table or "
                              "coco file", source=self.source, loc="inputs.storage_options")
        if model.output.format not in WRITERS:
            e = UnknownName("output format", model.output.format, list(WRITERS))
            raise RecipeError(str(e), source=self.source, loc="output.format")

    def _check_inputs(self) -> None:
        """The inputs' own rules: a COCO file's or a folder listing's (a table's are checked as it is read)."""
        inp = self.model.inputs
        if inp.coco is not None:
            from .inputs.coco import check_inputs
        elif inp.table is None:
            from .inputs.listing import check_inputs
        else:
            return
        check_inputs(inp, self.source)

    def decoder_for(self, fname: str, options: Optional[dict[str, Any]] = None) -> Any:
        """The decoder of ``fname`` for one input: with a table row's decoder options (already checked at
        plan time) a decoder made with them, kept for the next row with the same values."""
        if not options:
            return self.decoders[fname]
        k = (fname, fmt.dumps(options))
        dec = self._row_decoders.get(k)
        if dec is None:
            base = self.decoders[fname]
            dec = self._row_decoders[k] = type(base)(self.row_params(fname, options))
            # what the recipe configured on its decoder (e.g. the JPEG decode scale rule) holds for every row
            dec.__dict__.update({a: v for a, v in base.__dict__.items() if a != "params"})
        return dec

    def __reduce__(self):
        # rebuilt from the plain model in a worker: the recipe's imports run there, no user class is pickled,
        # and the worker checks it runs the same user code as the parent planned with
        # (modules that registered classes from Python rather than through `imports` are imported first)
        mods = sorted({type(o).__module__ for o in [*self.decoders.values(), *self.steps]} - {"__main__"})
        return (_restore_recipe, (self.model, self.source, self.base_dir, self.code, mods))

    # -- convenience -----------------------------------------------------------
    @property
    def name(self) -> str:
        return self.model.name

    @property
    def seed(self) -> int:
        return self.model.seed

    @property
    def output_name(self) -> str:
        return self.model.output.name or self.model.name

    @property
    def input_root(self) -> str:
        from .storage.remote import is_url

        if is_url(self.model.inputs.root):
            return self.model.inputs.root.rstrip("/")
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(self.model.inputs.root)))

    def resolved(self) -> dict:
        """The recipe with defaults filled, as plain JSON data (stored in the output)."""
        d = self.model.model_dump(mode="json")
        # recipes without user code or remote options keep the hashes they had before these keys existed
        if not d["imports"]:
            del d["imports"]
        if not d["inputs"]["storage_options"]:
            del d["inputs"]["storage_options"]
        # absent keys: hashes as before they existed
        for k in ("table", "path", "key", "columns", "match", "coco", "quoting"):
            if not d["inputs"][k]:
                del d["inputs"][k]
        if d["inputs"]["follow_links"] == "inside":
            del d["inputs"]["follow_links"]   # the default: hashes as before the key existed
        if d["split"] is None:
            del d["split"]
        elif d["split"]["stratify"] is None:
            del d["split"]["stratify"]   # (pydantic's exclude_if would do this, but only from 2.11; the floor is 2.5)
        if d["limits"] == Limits().model_dump(mode="json"):
            del d["limits"]   # the default budgets: hashes as before the key existed
        if not d["stats"]:
            del d["stats"]
        return d

    def content_dict(self) -> dict:
        """The parts that decide output bytes: everything but the output's name and the error policy."""
        d = self.resolved()
        d["output"].pop("name", None)
        d.pop("on_error", None)
        d.pop("max_failures", None)
        d.pop("timeout_s", None)
        d.pop("limits", None)   # budgets decide which inputs fail, never the bytes of those stored
        d.pop("stats", None)    # statistics are read from the shards after they are written
        d.pop("imports", None)  # which modules were imported does not matter; the code used does (below)
        if self.code:  # user decoders/steps: their code decides the bytes too
            d["code"] = self.code
        from .decoders.jpeg_reduce import key_parts

        scales = key_parts(self)
        if scales:
            d["decode_scale"] = scales  # the rule picking each JPEG's decode scale decides bytes too
        versions = output_versions(self.decoders, self.steps)
        if self.model.inputs.coco is not None:
            from .inputs.coco.annotations import OUTPUT_VERSION

            versions["inputs.coco"] = OUTPUT_VERSION   # how the annotation fields are made from the file
        if versions:
            d["output_versions"] = versions  # a decoder or step whose bytes changed for the same params
        return d

    def content_hash(self) -> str:
        return hashlib.sha256(fmt.dumps(self.content_dict()).encode()).hexdigest()


def output_versions(decoders: dict[str, Any], steps: list[Any]) -> dict[str, int]:
    """``output_version`` of every decoder and step whose class sets one above 1 (bumped when the
    same parameters come to give other bytes: shards built before then are stale)."""
    out = {f"decoders.{f}": int(getattr(d, "output_version", 1)) for f, d in decoders.items()}
    out.update({f"steps[{i}]": int(getattr(s, "output_version", 1)) for i, s in enumerate(steps)})
    return {k: v for k, v in out.items() if v != 1}


def _restore_recipe(model: RecipeModel, source: str | None, base_dir: str | None, code: dict,
                    modules: tuple = ()) -> Recipe:
    import importlib
    import sys

    from .plugins import check_same_code, import_modules

    import_modules(list(model.imports), source, os.path.abspath(base_dir or "."))  # may add the recipe's folder
    for m in modules:
        if m not in sys.modules:
            importlib.import_module(m)
    r = Recipe(model, source=source, base_dir=base_dir)
    check_same_code(code, r.code)
    return r


def parse_recipe(data: Any, source: str | None = None, base_dir: str | None = None) -> Recipe:
    if data is None:   # an empty file, or comments only
        raise RecipeError("the recipe is empty: expected a mapping of keys (name, inputs, ...)", source=source)
    if not isinstance(data, dict):
        raise RecipeError(f"expected a mapping at the top level, got {type(data).__name__}", source=source)
    _check_coercion(RecipeModel, data, source, ())
    try:
        model = RecipeModel.model_validate(data)
    except ValidationError as e:
        raise pydantic_to_recipe_error(e, source, model=RecipeModel) from None
    return Recipe(model, source=source, base_dir=base_dir)


#: a recipe nested deeper than this (mappings and lists) is refused while parsing, before Python's recursion limit
MAX_YAML_DEPTH = 64
#: a recipe whose aliases would expand to more values than this is refused before anything is expanded
MAX_YAML_NODES = 100_000


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses deep nesting while composing (each level is one Python frame)."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise _YamlLimit(f"line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _YamlLimit(Exception):
    pass


# YAML 1.1 (PyYAML) reads `1e30` and `1e-3`, with no '.', as strings; YAML 1.2 and every user read them as numbers
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))


def _no_key_twice(node: yaml.MappingNode) -> None:
    """A mapping gives each key once: PyYAML keeps the last of two equal keys without a word (a second `name:`
    renamed the output, a second field of the same name replaced the first). Merge keys (`<<`) may repeat."""
    first: dict[tuple[str, str], int] = {}
    for k, _v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
            if (k.tag, k.value) in first:
                raise _YamlLimit(f"line {k.start_mark.line + 1}: key {clip(repr(k.value), 80)} is given twice "
                                 f"(first on line {first[k.tag, k.value]})")
            first[k.tag, k.value] = k.start_mark.line + 1


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Values ``node`` holds once every alias is expanded, counted over the shared node graph (no expansion)."""
    k = id(node)
    got = memo.get(k)
    if got is not None:
        if got < 0:
            raise _YamlLimit("an alias refers to the list or mapping that contains it (a recursive structure)")
        return got
    memo[k] = -1
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_size(c, memo) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        _no_key_twice(node)
        n = 1 + sum(_expanded_size(a, memo) + _expanded_size(b, memo) for a, b in node.value)
    else:
        n = 1
    if n > MAX_YAML_NODES:
        raise _YamlLimit(f"its aliases expand to more than {MAX_YAML_NODES:,} values (an alias bomb?)")
    memo[k] = n
    return n


def safe_yaml(text: bytes | str) -> Any:
    """The YAML document in ``text`` through the safe loader, refused (``_YamlLimit``) when nested deeper than
    ``MAX_YAML_DEPTH`` or when its aliases expand past ``MAX_YAML_NODES`` values: both are checked on the
    composed node graph, before any value is built, so a bomb costs milliseconds, not gigabytes."""
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            _expanded_size(node, {})
        except RecursionError:
            raise _YamlLimit(f"its aliases nest deeper than {MAX_YAML_DEPTH} levels") from None
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_recipe(path: str | os.PathLike | dict, base_dir: Optional[str] = None) -> Recipe:
    """Read, safe-load and validate a recipe file; or validate a recipe given as a dict (relative paths in
    it resolve against ``base_dir``, default the current folder). This is ``precompile.load_recipe``."""
    if isinstance(path, dict):
        return parse_recipe(path, base_dir=base_dir)
    if not isinstance(path, (str, os.PathLike)):
        raise RecipeError(f"expected a recipe file's path or a dict, got {type(path).__name__}")
    path = str(path)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise RecipeError(f"cannot read recipe: {e.strerror}", source=path) from None
    try:
        data = safe_yaml(text)
    except _YamlLimit as e:
        raise RecipeError(f"refused: {e}", source=path) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecipeError(f"{where}not valid YAML: {getattr(e, 'problem', None) or e}", source=path) from None
    return parse_recipe(data, source=path)
