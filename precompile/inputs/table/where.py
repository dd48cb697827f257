"""``inputs.where`` for tables: which rows are kept, by an expression over the row's columns, in a small
language parsed here (a recursive-descent parser with a length and a nesting limit; never ``eval``) and
evaluated a column at a time with pyarrow.compute.

The language (docs/tables.md, "Selecting rows: where"):

- values: a column (a bare name, ``Age``, running on as a Python identifier does, or any name in backquotes, ```Frontal/Lateral```, a backquote
  written twice inside), a string (``"Male"`` or ``'Male'``; escapes ``\\\\ \\" \\' \\n \\t \\r``), a number
  (``3``, ``-2.5``, ``1e3``), ``true``, ``false``, ``null``;
- comparisons ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=`` of a column with a literal (either side; two
  columns are not compared: in a CSV both would be text), ``x in [v, ...]``,
  ``x not in [v, ...]``, ``x is null``, ``x is not null`` (``x == null`` and ``x != null`` too); a bare
  column of booleans is a condition;
- ``not``, ``and``, ``or`` (in that order of precedence) and parentheses; keywords in any case.

Values: a blank cell (empty, only whitespace, NaN, null) is null. A text column compared with a number is read
as numbers (each non-blank cell as Python's ``float`` reads it; a cell that is not one is an error naming the
row); text compares with text by code point, numbers with numbers, booleans with booleans (``==``, ``!=``);
any other pairing is an error naming the column and its type. Nulls follow SQL: a comparison with a null is
unknown, ``not`` unknown is unknown, ``false and`` unknown is false, ``true or`` unknown is true, and a row
whose condition is unknown is left out, as SQL's ``WHERE`` leaves it out.

Parsing (:func:`parse_where`) needs nothing but this module (the recipe checks the expression when it is
loaded); evaluating (:func:`evaluate_where`) needs pyarrow and the table's columns.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, Optional, Union

import numpy as np

from ...errors import RecipeError, echo

#: the longest expression accepted (characters)
MAX_CHARS = 4096
#: the deepest nesting of parentheses and ``not`` accepted
MAX_DEPTH = 64
#: the longest list after ``in``
MAX_LIST = 1000

KEYWORDS = {"and", "or", "not", "in", "is", "null", "true", "false"}
OPS = ("==", "!=", "<=", ">=", "<", ">")
FLIP = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[^\W\d]\w*)
  | (?P<op>==|!=|<=|>=|<|>|\(|\)|\[|\]|,|-)
""", re.X)


class WhereSyntaxError(ValueError):
    """An expression that does not parse: says where (the character, from 1) and what was expected."""


# -- the tree -----------------------------------------------------------------------------------------------------
# ("col", name, pos) | ("lit", value, pos) | ("cmp", op, left, right, pos) | ("in", operand, values, negated, pos)
# | ("null", operand, negated, pos) | ("truth", col, pos) | ("not", arg) | ("and", [args]) | ("or", [args])
Node = tuple


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = self._tokens(text)
        self.i = 0
        self.depth = 0

    def fail(self, pos: int, what: str) -> WhereSyntaxError:
        near = self.text[pos:pos + 40]
        here = f" ({echo(near)})" if near.strip() else " (the end of the expression)"
        return WhereSyntaxError(f"at character {pos + 1}{here}: {what}")

    def _tokens(self, text: str) -> list[tuple[str, Any, int]]:
        out: list[tuple[str, Any, int]] = []
        pos = 0
        while pos < len(text):
            c = text[pos]
            if c in "\"'":
                value, end = self._string(text, pos)
                out.append(("str", value, pos))
                pos = end
                continue
            if c == "`":
                end, name = pos + 1, []
                while True:
                    k = text.find("`", end)
                    if k < 0:
                        raise self.fail(pos, "a backquoted column name is never closed (write ` twice inside one)")
                    name.append(text[end:k])
                    if text.startswith("``", k):
                        name.append("`")
                        end = k + 2
                        continue
                    break
                if not "".join(name):
                    raise self.fail(pos, "an empty column name (``)")
                out.append(("col", "".join(name), pos))
                pos = k + 1
                continue
            m = _TOKEN.match(text, pos)
            if m is None:
                if c == "=":
                    raise self.fail(pos, "'=' is no operator: compare with ==")
                if c == "!":
                    raise self.fail(pos, "'!' is no operator: write != or not")
                if text.startswith(("&&", "||"), pos):
                    raise self.fail(pos, f"{text[pos:pos + 2]!r} is no operator: write and, or")
                hint = ""
                if out and out[-1][0] in ("col", "kw") and text[out[-1][2]:pos].isidentifier():   # a name's neighbour
                    end = pos
                    while end < len(text) and not text[end].isspace() and text[end] not in "()[],=<>!\"'`":
                        end += 1
                    name = text[out[-1][2]:end]
                    if len(name) <= 60:
                        hint = f" (a column name holding it goes in backquotes: `{name}`)"
                raise self.fail(pos, f"unexpected character {c!r}{hint}")
            kind = m.lastgroup
            if kind == "num":
                out.append(("num", _number(m.group(), lambda what: self.fail(m.start(), what)), pos))
            elif kind == "name":
                end = m.end()   # a name runs on as a Python identifier does (combining marks: NFD, Devanagari)
                while end < len(text) and ("a" + text[end]).isidentifier():
                    end += 1
                word = text[pos:end]
                out.append(("kw", word.lower(), pos) if word.lower() in KEYWORDS else ("col", word, pos))
            elif kind == "op":
                out.append(("op", m.group(), pos))
            pos = end if kind == "name" else m.end()
        out.append(("end", None, len(text)))
        return out

    def _string(self, text: str, pos: int) -> tuple[str, int]:
        """The string literal at ``pos`` and the position after it."""
        quote, k, out = text[pos], pos + 1, []
        esc = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "r": "\r"}
        while True:
            if k >= len(text):
                raise self.fail(pos, "a string is never closed")
            c = text[k]
            if c == quote:
                return "".join(out), k + 1
            if c == "\\":
                if k + 1 >= len(text) or text[k + 1] not in esc:
                    raise self.fail(k, "an unknown escape in a string (use \\\\ \\\" \\' \\n \\t \\r)")
                out.append(esc[text[k + 1]])
                k += 2
                continue
            out.append(c)
            k += 1

    # -- grammar: or := and ("or" and)* ; and := not ("and" not)* ; not := "not" not | primary ------------------
    def peek(self) -> tuple[str, Any, int]:
        return self.toks[self.i]

    def take(self) -> tuple[str, Any, int]:
        t = self.toks[self.i]
        self.i += 1
        return t

    def at(self, kind: str, value: Any = None) -> bool:
        t = self.peek()
        return t[0] == kind and (value is None or t[1] == value)

    def parse(self) -> Node:
        if self.at("end"):
            raise self.fail(0, "an empty expression")
        node = self.or_()
        if not self.at("end"):
            t = self.peek()
            raise self.fail(t[2], "expected and, or, or the end of the expression")
        return node

    def deeper(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(pos, f"nested deeper than {MAX_DEPTH} levels (parentheses and not)")

    def or_(self) -> Node:
        args = [self.and_()]
        while self.at("kw", "or"):
            self.take()
            args.append(self.and_())
        return args[0] if len(args) == 1 else ("or", args)

    def and_(self) -> Node:
        args = [self.not_()]
        while self.at("kw", "and"):
            self.take()
            args.append(self.not_())
        return args[0] if len(args) == 1 else ("and", args)

    def not_(self) -> Node:
        if self.at("kw", "not"):
            t = self.take()
            self.deeper(t[2])
            node = ("not", self.not_())
            self.depth -= 1
            return node
        return self.primary()

    def primary(self) -> Node:
        t = self.peek()
        if t[0] == "op" and t[1] == "(":
            self.take()
            self.deeper(t[2])
            node = self.or_()
            self.depth -= 1
            if not self.at("op", ")"):
                raise self.fail(self.peek()[2], f"expected ) to close the ( at character {t[2] + 1}")
            self.take()
            return node
        left = self.value()
        nxt = self.peek()
        if nxt[0] == "op" and nxt[1] in OPS:
            self.take()
            right = self.value()
            return self.comparison(nxt[1], left, right, nxt[2])
        if nxt[0] == "kw" and nxt[1] == "is":
            self.take()
            neg = self.at("kw", "not")
            if neg:
                self.take()
            if not self.at("kw", "null"):
                raise self.fail(self.peek()[2], "expected null after is" + (" not" if neg else ""))
            self.take()
            return ("null", self.operand(left, nxt[2]), neg, nxt[2])
        if nxt[0] == "kw" and nxt[1] in ("in", "not"):
            self.take()
            if nxt[1] == "not":
                if not self.at("kw", "in"):
                    raise self.fail(self.peek()[2], "expected in after not (x not in [...])")
                self.take()
            return ("in", self.operand(left, nxt[2]), self.values(), nxt[1] == "not", nxt[2])
        if left[0] == "col":
            return ("truth", left, left[2])
        raise self.fail(nxt[2], "expected a comparison (==, !=, <, <=, >, >=, in, not in, is null) after the value")

    def operand(self, node: Node, pos: int) -> Node:
        if node[0] != "col":
            raise self.fail(node[2], "in, not in and is null test a column, not a literal")
        return node

    def comparison(self, op: str, left: Node, right: Node, pos: int) -> Node:
        if left[0] == "lit" and right[0] == "lit":
            raise self.fail(left[2], "a comparison needs a column on one side (both sides are literals)")
        if left[0] == "col" and right[0] == "col":
            raise self.fail(left[2], "a comparison is between a column and a literal (a string, a number, true, "
                                     "false or null); two columns are not compared")
        if left[0] == "lit":
            op, left, right = FLIP[op], right, left
        if right[0] == "lit" and right[1] is None:
            if op not in ("==", "!="):
                raise self.fail(pos, f"null compares with == and != only (it means is null, is not null), not {op}")
            return ("null", left, op == "!=", pos)
        return ("cmp", op, left, right, pos)

    def value(self) -> Node:
        t = self.take()
        kind, v, pos = t
        if kind == "col":
            return ("col", v, pos)
        if kind == "str":
            return ("lit", v, pos)
        if kind == "num":
            return ("lit", v, pos)
        if kind == "op" and v == "-" and self.at("num"):
            n = self.take()[1]
            return ("lit", -n, pos)
        if kind == "kw" and v in ("true", "false", "null"):
            return ("lit", {"true": True, "false": False, "null": None}[v], pos)
        if kind == "end":
            raise self.fail(pos, "expected a value (a column, a string, a number, true, false or null)")
        found = f"the keyword {v} (a column of that name goes in backquotes: `{v}`)" if kind == "kw" else repr(v)
        raise self.fail(pos, f"expected a value (a column, a string, a number, true, false or null), found {found}")

    def values(self) -> tuple:
        t = self.peek()
        if not self.at("op", "["):
            raise self.fail(t[2], "expected a list after in: [value, ...]")
        self.take()
        out: list[Any] = []
        while not self.at("op", "]"):
            if out:
                if not self.at("op", ","):
                    raise self.fail(self.peek()[2], "expected , or ] in the list")
                self.take()
            v = self.value()
            if v[0] != "lit":
                raise self.fail(v[2], "a list after in holds literals (strings, numbers, true, false), not columns")
            if v[1] is None:
                raise self.fail(v[2], "null in a list after in matches nothing (test it with is null)")
            out.append(v[1])
            if len(out) > MAX_LIST:
                raise self.fail(v[2], f"a list after in holds at most {MAX_LIST} values")
        self.take()
        kinds = {_kind_of(v) for v in out}
        if len(kinds) > 1:
            raise self.fail(t[2], f"a list after in holds values of one type, not {' and '.join(sorted(kinds))}")
        return tuple(out)


def python_only(text: str) -> bool:
    """Whether Python's int()/float() would read ``text`` as a number where pandas and Arrow see text: an
    underscore ('1_000' is 1000, '12_3' is 123: more likely an id than a number). (Unicode digits, '١٢' or
    '１２', read as numbers, as docs/tables.md says float() reads a cell.)"""
    return "_" in text


def _kind_of(v: Any) -> str:
    return "boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else "text"


def _number(text: str, fail: Callable[[str], Exception]) -> Union[int, float]:
    if re.fullmatch(r"\d+", text):
        v = int(text)
        if v >= 2 ** 63:
            raise fail("an integer beyond 64 bits")
        return v
    f = float(text)
    if math.isinf(f):
        raise fail("a number too large for a 64-bit float")
    return f


@functools.lru_cache(maxsize=64)
def parse_where(text: str) -> Node:
    """The tree of an ``inputs.where`` expression; a :class:`WhereSyntaxError` saying at which character
    (from 1) and what was expected."""
    if not isinstance(text, str):
        raise WhereSyntaxError("must be a string: an expression over the table's columns")
    if len(text) > MAX_CHARS:
        raise WhereSyntaxError(f"the expression has {len(text)} characters; at most {MAX_CHARS}")
    return _Parser(text).parse()


def where_columns(text: str) -> list[str]:
    """The columns an expression reads, in the order they appear, each once."""
    out: dict[str, None] = {}
    todo = [parse_where(text)]
    while todo:
        n = todo.pop()
        if n[0] == "col":
            out[n[1]] = None
        elif n[0] in ("and", "or"):
            todo.extend(reversed(n[1]))
        elif n[0] == "not":
            todo.append(n[1])
        elif n[0] == "cmp":
            todo.extend([n[3], n[2]])
        elif n[0] in ("in", "null", "truth"):
            todo.append(n[1])
    return list(out)


def number_columns(text: str) -> list[str]:
    """The columns an expression compares with numbers (``x < 3``, ``x in [1, 2]``), in the order they appear,
    each once."""
    out: dict[str, None] = {}
    todo = [parse_where(text)]
    while todo:
        n = todo.pop()
        if n[0] in ("and", "or"):
            todo.extend(reversed(n[1]))
        elif n[0] == "not":
            todo.append(n[1])
        elif (n[0] == "cmp" and _kind_of(n[3][1]) == "number") or (n[0] == "in" and n[2] and
                                                                     _kind_of(n[2][0]) == "number"):
            out[n[2 if n[0] == "cmp" else 1][1]] = None
    return list(out)


# -- evaluating ---------------------------------------------------------------------------------------------------
#: text cells that pyarrow's cast to float64 reads exactly as Python's float does (others go through float())
_PLAIN_NUMBER = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"


def _type_name(pa: Any, t: Any) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    return str(t)


def _kind(pa: Any, t: Any) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_null(t):
        return "null"
    return "other"


class _Evaluator:
    """One expression over one table's columns (``cols``: ``pa``, ``n``, ``files``, ``source``, ``col(name)``,
    ``blank(name)`` (a numpy mask), ``error(row, column, what, loc)`` (the TableError of a row))."""

    def __init__(self, text: str, cols: Any):
        import pyarrow.compute as pc

        self.text, self.cols, self.pa, self.pc = text, cols, cols.pa, pc
        self.ops = {"==": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater,
                    ">=": pc.greater_equal}
        self._values: dict[str, Any] = {}
        self._numbers: dict[str, Any] = {}
        self.as_numbers: dict[str, int] = {}   # text columns compared with numbers -> where (first) in the text

    # -- the columns as the language sees them --------------------------------------------------------------------
    def kind(self, name: str) -> str:
        return _kind(self.pa, self.cols.col(name).type)

    def type_error(self, name: str, what: str, pos: int) -> RecipeError:
        t = _type_name(self.pa, self.cols.col(name).type)
        files = self.cols.files
        of = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more table file(s)"
        return RecipeError(f"at character {pos + 1}: column {echo(name)} of {of} holds {t} values; {what}",
                           source=self.cols.source, loc="inputs.where")

    def values(self, name: str) -> Any:
        """The column with its blank cells null (text: empty or only whitespace; numbers: NaN)."""
        if name not in self._values:
            pa, pc = self.pa, self.pc
            arr = self.cols.col(name)
            k = self.kind(name)
            if k == "text":
                blank = self.cols.blank(name)
                arr = pc.if_else(pa.array(blank), pa.scalar(None, arr.type), arr) if blank.any() else arr
            elif pa.types.is_decimal(arr.type):
                arr = arr.cast(pa.float64())
            elif pa.types.is_integer(arr.type):   # every integer as int64 or uint64: compared exactly
                arr = arr.cast(pa.int64() if pa.types.is_signed_integer(arr.type) else pa.uint64())
            if pa.types.is_floating(arr.type):
                arr = pc.if_else(pc.is_nan(arr), pa.scalar(None, arr.type), arr)
            self._values[name] = arr
        return self._values[name]

    def numbers(self, name: str) -> Any:
        """A column compared with numbers: its numbers (text read as Python's float reads it), blanks null."""
        if self.kind(name) != "text":
            return self.values(name)
        if name not in self._numbers:
            self._numbers[name], _ = self._parse(name)
        return self._numbers[name]

    def _parse(self, name: str) -> tuple[Any, Optional[int]]:
        """A text column as float64 (blank and NaN cells null) and the first row holding a cell that is not a
        number (None when every cell is)."""
        pa, pc = self.pa, self.pc
        arr = self.cols.col(name)
        blank = self.cols.blank(name)
        plain = pc.match_substring_regex(arr, _PLAIN_NUMBER).fill_null(False).to_numpy(zero_copy_only=False)
        out = np.full(len(arr), np.nan)
        fast = np.flatnonzero(plain & ~blank)
        if len(fast):
            out[fast] = arr.take(pa.array(fast)).cast(pa.float64()).to_numpy(zero_copy_only=False)
        rest = np.flatnonzero(~plain & ~blank)
        first_bad = None
        if len(rest):
            enc = pc.dictionary_encode(arr.take(pa.array(rest)))
            conv = []
            for cell in enc.dictionary.to_pylist():
                try:
                    if python_only(cell):
                        raise ValueError
                    conv.append(float(cell))
                except ValueError:
                    conv.append(None)
            bad = np.array([v is None for v in conv], bool)
            codes = enc.indices.to_numpy(zero_copy_only=False)
            hit = bad[codes]
            if hit.any():
                first_bad = int(rest[np.argmax(hit)])
            out[rest] = np.array([np.nan if v is None else v for v in conv], np.float64)[codes]
        return pa.array(out, pa.float64(), mask=np.isnan(out)), first_bad

    # -- checking types, before any value is compared -----------------------------------------------------------
    def check(self, node: Node) -> None:
        """Raise the first type error of the tree (in the order of the text); note the text columns compared
        with numbers."""
        todo = [node]
        while todo:
            n = todo.pop()
            tag = n[0]
            if tag in ("and", "or"):
                todo.extend(reversed(n[1]))
            elif tag == "not":
                todo.append(n[1])
            elif tag == "cmp":
                self._check_cmp(n)
            elif tag == "in":
                self._check_in(n)
            elif tag == "truth":
                col = n[1][1]
                if self.kind(col) not in ("boolean", "null"):
                    quoted = "`" + col.replace("`", "``") + "`" if len(col) <= 60 else "`...`"
                    raise self.type_error(col, f"a column alone is a condition only when it holds booleans; compare "
                                               f"it ({quoted} == ...)", n[2])

    def _number_use(self, name: str, pos: int) -> None:
        if self.kind(name) == "text":
            self.as_numbers.setdefault(name, pos)

    def _check_cmp(self, n: Node) -> None:
        _, op, left, right, pos = n
        name, lk = left[1], self.kind(left[1])
        if lk == "null":
            return
        rk = _kind_of(right[1])
        if lk == "other":
            raise self.type_error(name, "inputs.where compares text, numbers and booleans", left[2])
        if rk == "number" and lk in ("text", "number"):
            self._number_use(name, left[2])
            return
        if rk == lk:
            if rk == "boolean" and op not in ("==", "!="):
                raise self.type_error(name, f"booleans compare with == and != only, not {op}", pos)
            return
        lit = str(right[1]).lower() if rk == "boolean" else echo(right[1])
        want = {"text": "text (a quoted string)", "number": "a number", "boolean": "true or false"}[lk]
        raise self.type_error(name, f"it cannot be compared with the {rk} {lit}; compare it with {want}", right[2])

    def _check_in(self, n: Node) -> None:
        _, col, vals, _, pos = n
        name, k = col[1], self.kind(col[1])
        if k == "null" or not vals:
            return
        vk = _kind_of(vals[0])
        if k == "other":
            raise self.type_error(name, "inputs.where compares text, numbers and booleans", col[2])
        if vk == "number" and k in ("text", "number"):
            self._number_use(name, col[2])
            return
        if vk == k:
            return
        want = {"text": "text (quoted strings)", "number": "numbers", "boolean": "true or false"}[k]
        raise self.type_error(name, f"it cannot be looked up in a list of {vk} values; list {want}", pos)

    def first_bad_number(self) -> None:
        """Raise the error of the first row (any column) whose text cell is compared with a number and is not
        one."""
        firsts = []
        for name, pos in self.as_numbers.items():
            arr, bad = self._parse(name)
            self._numbers[name] = arr
            if bad is not None:
                firsts.append((bad, pos, name))
        if firsts:
            row, pos, name = min(firsts)
            cell = self.cols.col(name)[row].as_py()
            raise self.cols.error(row, name, f"{echo(cell)} is not a number, and inputs.where compares the column "
                                             f"with numbers (at character {pos + 1}): such a text column holds "
                                             f"numbers or blank cells", "inputs.where")

    # -- evaluating: Kleene logic over arrow booleans (null: unknown) --------------------------------------------
    def unknown(self) -> Any:
        return self.pa.nulls(self.cols.n, self.pa.bool_())

    def known(self, arr: Any, res: Any) -> Any:
        """``res`` with null wherever ``arr`` is null."""
        if not arr.null_count:
            return res
        return self.pc.if_else(self.pc.is_valid(arr), res, self.pa.scalar(None, self.pa.bool_()))

    def eval(self, n: Node) -> Any:
        pa, pc = self.pa, self.pc
        tag = n[0]
        if tag in ("and", "or"):
            parts = [self.eval(a) for a in n[1]]
            fn = pc.and_kleene if tag == "and" else pc.or_kleene
            out = parts[0]
            for p in parts[1:]:
                out = fn(out, p)
            return out
        if tag == "not":
            return pc.invert(self.eval(n[1]))
        if tag == "null":
            name = n[1][1]
            k = self.kind(name)
            isnull = pc.is_null(self.values(name)) if k != "other" else pc.is_null(self.cols.col(name))
            return pc.invert(isnull) if n[2] else isnull
        if tag == "truth":
            name = n[1][1]
            return self.unknown() if self.kind(name) == "null" else self.values(name)
        if tag == "in":
            _, col, vals, neg, _ = n
            name, k = col[1], self.kind(col[1])
            if k == "null":
                return self.unknown()
            arr, vset = self._pair(name, list(vals)) if vals else (self.values(name), None)
            if vset is None or not len(vset):   # (an empty list, or no value any cell can equal)
                res = self.known(arr, pa.repeat(pa.scalar(False), self.cols.n))
            else:
                res = self.known(arr, pc.is_in(arr, value_set=vset))
            return pc.invert(res) if neg else res
        _, op, left, right, _ = n   # cmp
        name = left[1]
        if self.kind(name) == "null":
            return self.unknown()
        lit = right[1]
        if _kind_of(lit) != "number":
            arr = self.values(name)
            return self.ops[op](arr, pa.scalar(lit, arr.type if isinstance(lit, str) else pa.bool_()))
        arr = self._number_array(name)
        exact = exact_comparison(op, lit, self._range(arr))
        if isinstance(exact, bool):   # the same for every number: only nulls differ
            return self.known(arr, pa.repeat(pa.scalar(exact), self.cols.n))
        op, lit = exact
        return self.ops[op](arr, pa.scalar(lit, arr.type))

    def _number_array(self, name: str) -> Any:
        """A column compared with numbers as int64 or uint64 (an integer column) or float64 (any other)."""
        pa = self.pa
        arr = self.numbers(name)
        typ = arr.type if arr.type in (pa.int64(), pa.uint64()) else pa.float64()
        return arr if arr.type == typ else arr.cast(typ)

    def _range(self, arr: Any) -> Optional[tuple[int, int]]:
        """The integers the column's type holds (None: floats)."""
        return UINT64 if arr.type == self.pa.uint64() else INT64 if arr.type == self.pa.int64() else None

    def _pair(self, name: str, many: list) -> tuple[Any, Any]:
        """The column and the list after ``in`` in the column's type, keeping the values some cell can equal
        exactly (an integer no float holds never equals a float, 2.5 never an integer)."""
        pa = self.pa
        if _kind_of(many[0]) == "number":
            arr = self._number_array(name)
            ints = self._range(arr)
            keep = [e[1] for e in (exact_comparison("==", v, ints) for v in many) if not isinstance(e, bool)]
            if ints is None and 0.0 in keep:
                keep += [0.0, -0.0]   # (is_in hashes -0.0 apart from 0.0; == does not, nor does Python)
            return arr, pa.array(keep, arr.type)
        arr = self.values(name)
        return arr, pa.array(many, arr.type if isinstance(many[0], str) else pa.bool_())


INT64 = (-2 ** 63, 2 ** 63 - 1)
UINT64 = (0, 2 ** 64 - 1)


def exact_comparison(op: str, lit: Union[int, float],
                     ints: Optional[tuple[int, int]]) -> Union[bool, tuple[str, Union[int, float]]]:
    """``x op lit`` for every number ``x`` of an integer column holding ``ints`` (its type's range: int64 or
    uint64) or, ``ints`` None, of a float64 column, compared exactly as Python compares an int with a float,
    rewritten as a comparison with a literal of the column's type (``(op, value)``), or its answer for every
    number (a bool) when the column's type cannot hold the literal: an integer column against 2.5 (``x < 2.5``
    is ``x <= 2``) or against -1 when unsigned (``x > -1`` is true), a float column against an integer no float
    holds (2**53 + 1: ``x == lit`` is never true, ``x < lit`` is ``x <= 2**53``)."""
    if ints is not None:
        if isinstance(lit, float) and lit.is_integer() and ints[0] <= lit <= ints[1]:
            return op, int(lit)
        if isinstance(lit, int) and ints[0] <= lit <= ints[1]:
            return op, lit
        if op in ("==", "!="):
            return op == "!="
        if isinstance(lit, float):   # (not an integer, or out of range: then clamped below)
            op, bound = ("<=", math.floor(lit)) if op in ("<", "<=") else (">=", math.ceil(lit))
        else:
            op, bound = {"<": ("<=", lit - 1), "<=": ("<=", lit), ">": (">=", lit + 1), ">=": (">=", lit)}[op]
        if bound < ints[0]:   # every value of the type is above it
            return op == ">="
        if bound > ints[1]:
            return op == "<="
        return op, bound
    if isinstance(lit, float):
        return op, lit
    f = float(lit)   # (the parser keeps integers within 64 bits: finite)
    if int(f) == lit:
        return op, f
    if op in ("==", "!="):
        return op == "!="
    if op in ("<", "<="):
        return "<=", f if f < lit else math.nextafter(f, -math.inf)
    return ">=", f if f > lit else math.nextafter(f, math.inf)


def evaluate_where(text: str, cols: Any) -> np.ndarray:
    """Per row of ``cols`` (see :class:`_Evaluator`): whether ``inputs.where`` keeps it (its condition is
    true: false and unknown leave it out). A RecipeError names a column whose type the expression cannot
    compare; a :class:`~.read.TableError` the first row whose text cell is compared with a number and is not one."""
    tree = parse_where(text)
    ev = _Evaluator(text, cols)
    ev.check(tree)
    ev.first_bad_number()
    if not cols.n:
        return np.zeros(0, bool)
    res = ev.eval(tree)
    if isinstance(res, ev.pa.ChunkedArray):
        res = res.combine_chunks()
    return res.fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
