"""Defects being fixed elsewhere (issue 32): each id has a narrow predicate on the case and the oracles its
failures show in. A finding is excused only when a defect's predicate matches the case *and* the finding's
oracle is one of that defect's; anything else is a new finding. Remove an entry when its fix merges: the
cases it excused must then pass."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .oracles import Finding


@dataclass(frozen=True)
class Known:
    title: str
    oracles: frozenset
    applies: Callable[[dict], bool]
    #: why no kept case shows it every time (the entry still excuses it where it shows), or None
    flaky: str | None = None


KNOWN: dict[str, Known] = {
    # empty: every defect of issue 32 the fuzzer was built to catch is fixed (their kept cases in regressions.json
    # pass); add an entry here only for a defect that is being fixed elsewhere
}


# -- new findings of this fuzzer (not yet fixed): the same narrow predicates, reported as "new finding" --------------
NEW: dict[str, Known] = {
}
KNOWN.update(NEW)


def excuse(case: dict, findings: list[Finding], with_new: bool = True) -> tuple[list[Finding], list[str]]:
    """(the findings no known defect excuses, the ids of those that excused some); ``with_new=False``: only the
    issue's defects excuse (a kept case of a new finding must still show it)."""
    live = {k: v for k, v in KNOWN.items() if _safe(v, case) and (with_new or k not in NEW)}
    new, used = [], set()
    for f in findings:
        hit = [k for k, v in live.items() if f.oracle in v.oracles]
        if hit:
            used.update(hit)
        else:
            new.append(f)
    return new, sorted(used)


def _safe(k: Known, case: dict) -> bool:
    try:
        return bool(k.applies(case))
    except (KeyError, TypeError, IndexError):
        return False
