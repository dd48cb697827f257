"""YAML recipe -> validated, typed :class:`Recipe` with a canonical hash.

The recipe is parsed with ``yaml.safe_load`` and checked with pydantic. Every
error names the recipe file, the key path (``steps[2].size``) and what was
expected; unknown decoder and step names list the close matches. Decoder and
step parameters are validated by the registered class's own ``Params`` model,
so a new decoder or step needs no change here.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .formats import names as fmt
from .errors import RecipeError
from .registry import DECODERS, STEPS, WRITERS, UnknownName, load_builtins

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
CAPTURE_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def pattern_regex(pattern: str, where: dict[str, str]) -> re.Pattern:
    """The regular expression of an ``inputs.match`` pattern: ``{name}`` captures (a repeat must match the
    same text), each ``[^/]+`` or its ``where`` expression; everything else literal."""
    out, pos, seen = [], 0, set()
    for m in CAPTURE_RE.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        if name in seen:
            out.append(f"(?P={name})")
        else:
            seen.add(name)
            out.append(f"(?P<{name}>{where[name]})" if name in where else f"(?P<{name}>[^/]+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LabelSpec(_Model):
    capture: str = Field(description="the capture in `match` whose value is the class name")
    field: str = "label"
    classes: Optional[list[str]] = Field(None, description="class names in id order; default: sorted unique values")


class FieldDecl(BaseModel):
    """One field of a sample: where its file is and how to decode it (extra keys are decoder options)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    path: Optional[str] = None
    decoder: str


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
        if not NAME_RE.match(v) or v.startswith("__"):
            raise ValueError(f"field name {v!r} must be letters, digits, '_', '.', '-' and not start with '__'")
        return v


def _also_a_string(schema: dict) -> None:
    """``inputs.coco`` in the JSON Schema: the file name alone is accepted too (the parser turns it into {file})."""
    schema["anyOf"] = [{"type": "string", "description": "the annotation file, every option at its default"},
                       *schema.get("anyOf", [])]


#: the captures a field's ``path`` template may use with ``inputs.coco`` (there is no ``match``)
COCO_CAPTURES = ("file_name", "stem", "image_id")


class Inputs(_Model):
    root: str
    storage_options: dict[str, Any] = Field(default_factory=dict,
                                            description="fsspec options for a remote root (s3://, gs://, https://)")
    match: Optional[str] = Field(None, description="the input files: a pattern with {captures}, relative to root "
                                                   "(required unless inputs.coco lists the inputs)")
    coco: Optional[CocoSpec] = Field(None, description="a COCO annotation file (or {file: ..., options}) listing "
                                                       "the images under root and their annotations",
                                     json_schema_extra=_also_a_string)
    where: dict[str, str] = Field(default_factory=dict)
    kind: Literal["file", "dir"] = "file"
    fields: dict[str, FieldDecl] = Field(default_factory=dict, description="the fields of a sample and their "
                                         "decoders (required with match; with coco, default {image: {decoder: image}})")
    label: Optional[LabelSpec] = None

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

    @field_validator("match")
    @classmethod
    def _match(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if v.startswith("/") or ".." in Path(v).parts:
            raise ValueError("must be a relative pattern inside root (no leading '/' or '..')")
        return v

    @field_validator("storage_options")
    @classmethod
    def _storage_options(cls, v: dict) -> dict:
        from .remote import check_storage_options

        bad = check_storage_options(v)
        if bad is not None:
            raise ValueError(f"{bad!r} looks like a credential; credentials do not belong in a recipe (it is stored "
                             f"in the output): use the store's environment variables or config files")
        return v

    @field_validator("fields")
    @classmethod
    def _fields(cls, v: dict) -> dict:
        if not v:
            raise ValueError("needs at least one field")
        for name in v:
            if not NAME_RE.match(name) or name.startswith("__"):
                raise ValueError(f"field name {name!r} must be letters, digits, '_', '.', '-' and not start with '__'")
        return v


class Output(_Model):
    format: str = "hdf5"
    name: Optional[str] = None
    samples_per_shard: int = Field(256, ge=1)
    chunk_samples: Optional[int] = Field(None, ge=1)
    chunk_bytes: int = Field(2 * 1024 * 1024, ge=4096)
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
        return v


class RecipeModel(_Model):
    name: str
    seed: int = Field(0, ge=0)
    imports: list[str] = Field(default_factory=list,
                               description="Python modules that register custom decoders and steps")
    inputs: Inputs
    steps: list[dict[str, Any]] = Field(default_factory=list)
    copies: int = Field(0, ge=0)
    keep_original: bool = True
    output: Output = Field(default_factory=Output)
    on_error: Literal["fail", "skip"] = "fail"
    max_failures: Optional[int] = Field(None, ge=0)
    timeout_s: Optional[float] = Field(None, gt=0)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be letters, digits, '_', '.', '-' (it names the output file)")
        return v


def format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _pydantic_to_recipe_error(err: ValidationError, source: str | None, prefix: tuple = ()) -> RecipeError:
    first = err.errors()[0]
    loc = tuple(p for p in first["loc"] if p not in ("function-after",))
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "required key is missing"
    elif first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and first["type"] not in ("value_error",):
        msg = f"{msg}, got {first['input']!r}"
    msg = msg.removeprefix("Value error, ")
    more = len(err.errors()) - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return RecipeError(msg, source=source, loc=format_loc(prefix + loc))


def parse_params(cls_params: type[BaseModel], raw: Any, source: str | None, loc: tuple) -> BaseModel:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"expected a mapping of options, got {raw!r}", source=source, loc=format_loc(loc))
    try:
        return cls_params.model_validate(raw)
    except ValidationError as e:
        raise _pydantic_to_recipe_error(e, source, loc) from None


class Recipe:
    """A validated recipe: the typed model, instantiated decoders and steps, and paths.

    ``base_dir`` is the recipe file's folder; ``inputs.root`` is relative to it.
    """

    def __init__(self, model: RecipeModel, source: str | None = None, base_dir: str | None = None):
        from . import plugins
        from .decoders.base import Decoder
        from .transforms.base import Step

        load_builtins()
        self.model = model
        self.source = source
        self.base_dir = os.path.abspath(base_dir or (os.path.dirname(source) if source else "."))
        plugins.load_entry_points(source)
        plugins.import_modules(list(model.imports), source, self.base_dir)
        self.decoders = {}
        for fname, decl in model.inputs.fields.items():
            loc = ("inputs", "fields", fname)
            try:
                dcls = plugins.refresh_class(DECODERS.get(decl.decoder), DECODERS, decl.decoder)
            except UnknownName as e:
                raise RecipeError(str(e), source=source, loc=format_loc(loc + ("decoder",))) from None
            if not (isinstance(dcls, type) and issubclass(dcls, Decoder)):
                raise RecipeError(f"decoder {decl.decoder!r} is registered as {dcls!r}, not a Decoder subclass",
                                  source=source, loc=format_loc(loc + ("decoder",)))
            params = parse_params(dcls.Params, dict(decl.model_extra or {}), source, loc)
            self.decoders[fname] = dcls(params)
        self.steps = []
        for i, entry in enumerate(model.steps):
            loc = ("steps", i)
            if not isinstance(entry, dict) or len(entry) != 1:
                raise RecipeError("expected a mapping with one step name, e.g. {resize: {size: [64, 64]}}",
                                  source=source, loc=format_loc(loc))
            (sname, raw), = entry.items()
            try:
                scls = plugins.refresh_class(STEPS.get(sname), STEPS, sname)
            except UnknownName as e:
                raise RecipeError(str(e), source=source, loc=format_loc(loc)) from None
            if not (isinstance(scls, type) and issubclass(scls, Step)):
                raise RecipeError(f"step {sname!r} is registered as {scls!r}, not a Step subclass",
                                  source=source, loc=format_loc(loc))
            params = parse_params(scls.Params, raw, source, loc + (sname,))
            self.steps.append(scls(params))
        from .remote import is_url

        if model.inputs.storage_options and not is_url(model.inputs.root):
            raise RecipeError("storage_options apply only to a remote root (s3://, gs://, https://, ...)",
                              source=source, loc="inputs.storage_options")
        if model.output.format not in WRITERS:
            e = UnknownName("output format", model.output.format, list(WRITERS))
            raise RecipeError(str(e), source=source, loc="output.format")
        _check_inputs(model.inputs, source)
        from .decoders.jpeg_reduce import configure

        configure(self)  # reduce: auto: which JPEG decode scale the steps allow (read by the image decoder)

        self.code = plugins.code_fingerprint(self.decoders, self.steps)

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
        from .remote import is_url

        if is_url(self.model.inputs.root):
            return self.model.inputs.root.rstrip("/")
        return os.path.normpath(os.path.join(self.base_dir, self.model.inputs.root))

    def resolved(self) -> dict:
        """The recipe with defaults filled, as plain JSON data (stored in the output)."""
        d = self.model.model_dump(mode="json")
        # recipes without user code or remote options keep the hashes they had before these keys existed
        if not d["imports"]:
            del d["imports"]
        if not d["inputs"]["storage_options"]:
            del d["inputs"]["storage_options"]
        for key in ("match", "coco"):   # one of them is None: recipes with `match` keep their hashes
            if d["inputs"][key] is None:
                del d["inputs"][key]
        return d

    def content_dict(self) -> dict:
        """The parts that decide output bytes: everything but the output's name and the error policy."""
        d = self.resolved()
        d["output"].pop("name", None)
        d.pop("on_error", None)
        d.pop("max_failures", None)
        d.pop("timeout_s", None)
        d.pop("imports", None)  # which modules were imported does not matter; the code used does (below)
        if self.code:  # user decoders/steps: their code decides the bytes too
            d["code"] = self.code
        from .decoders.jpeg_reduce import key_parts

        scales = key_parts(self)
        if scales:
            d["decode_scale"] = scales  # the rule picking each JPEG's decode scale decides bytes too
        return d

    def content_hash(self) -> str:
        return hashlib.sha256(fmt.dumps(self.content_dict()).encode()).hexdigest()


def _check_inputs(inp: Inputs, source: str | None) -> None:
    """``match`` (with ``where`` and ``label``) or ``coco``, and the captures the fields' paths use."""
    if inp.coco is not None:
        caps = set(COCO_CAPTURES)
        for key, bad in (("match", inp.match is not None), ("where", bool(inp.where)), ("label", inp.label is not None),
                         ("kind", inp.kind != "file")):
            if bad:
                raise RecipeError(f"does not apply with inputs.coco (the annotation file lists the images and their "
                                  f"labels)", source=source, loc=f"inputs.{key}")
        if inp.coco.image not in inp.fields:
            raise RecipeError(f"{inp.coco.image!r} is not a field in inputs.fields", source=source,
                              loc="inputs.coco.image")
        where = "inputs.coco"
    elif inp.match is None:
        raise RecipeError("required key is missing (or list the inputs with inputs.coco)", source=source,
                          loc="inputs.match")
    elif not inp.fields:
        raise RecipeError("required key is missing", source=source, loc="inputs.fields")
    else:
        caps = _check_match(inp, source)
        where = f"match {inp.match!r}"
    for fname, decl in inp.fields.items():
        if decl.path is not None:
            bad = set(CAPTURE_RE.findall(decl.path)) - caps
            if bad:
                raise RecipeError(f"uses capture(s) {sorted(bad)} that {where} does not define",
                                  source=source, loc=f"inputs.fields.{fname}.path")


def _check_match(inp: Inputs, source: str | None) -> set[str]:
    """Check ``where`` and ``label`` against the captures of ``match``; returns the captures."""
    caps = set(CAPTURE_RE.findall(inp.match))
    for c in inp.where:
        if c not in caps:
            raise RecipeError(f"{c!r} is not a capture in match {inp.match!r}", source=source,
                              loc=f"inputs.where.{c}")
        try:
            re.compile(inp.where[c])
        except re.error as e:
            raise RecipeError(f"not a valid regular expression: {e}", source=source, loc=f"inputs.where.{c}") from None
    try:
        pattern_regex(inp.match, inp.where)
    except re.error as e:
        raise RecipeError(f"match and where do not make a valid pattern together: {e}", source=source,
                          loc="inputs.where") from None
    if inp.label is not None:
        lab = inp.label
        if lab.capture not in caps:
            raise RecipeError(f"{lab.capture!r} is not a capture in match {inp.match!r}",
                              source=source, loc="inputs.label.capture")
        if lab.field in inp.fields:
            raise RecipeError(f"label field {lab.field!r} clashes with an input field", source=source,
                              loc="inputs.label.field")
    return caps


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
    if not isinstance(data, dict):
        raise RecipeError(f"expected a mapping at the top level, got {type(data).__name__}", source=source)
    try:
        model = RecipeModel.model_validate(data)
    except ValidationError as e:
        raise _pydantic_to_recipe_error(e, source) from None
    return Recipe(model, source=source, base_dir=base_dir)


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
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecipeError(f"{where}not valid YAML: {getattr(e, 'problem', None) or e}", source=path) from None
    return parse_recipe(data, source=path)
