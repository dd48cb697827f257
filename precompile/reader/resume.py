"""Where a consumer is in an epoch, and resuming there: what the Loader and Mix share.

:class:`Resumable` holds ``epoch``, ``_pos`` (the batches of the epoch already handed out) and ``_resume`` (the
position came from :meth:`~Resumable.load_state_dict` and no pass has started since), and gives ``set_epoch``
and ``load_state_dict`` one meaning for both. Each class keeps its own ``state_dict`` (what its order depends
on) and names in ``STATE_CHECKS`` the keys a restored state must agree on.
"""
from __future__ import annotations

from typing import Any, ClassVar

from .options import whole


class Resumable:
    """``set_epoch`` / ``load_state_dict`` over ``state_dict()`` and ``batch_indices(epoch)`` (the subclass's)."""

    #: the keys of a state that must equal this reader's (a state taken with others is a ``ValueError``)
    STATE_CHECKS: ClassVar[tuple[str, ...]] = ()
    #: keys checked as those, but only where the state has them: added after states without them were written
    STATE_ADDED: ClassVar[tuple[str, ...]] = ()
    #: the message for a checked key whose value is no words (a digest): ``{theirs}``, ``{mine}`` filled in
    STATE_HINTS: ClassVar[dict[str, str]] = {}
    #: the reader's name in messages
    KIND: ClassVar[str] = "reader"

    epoch: int
    _pos: int
    _resume: bool

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def batch_indices(self, epoch: int | None = None) -> list[Any]:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch on the next iteration (a pass being consumed ends here).

        Right after :meth:`load_state_dict` (before a pass starts: before the first ``next`` of an iterator,
        which may have been made already), setting the restored epoch keeps the restored position, so the usual
        ``for e in range(start, n): set_epoch(e); for b in loader`` loop resumes mid-epoch instead of replaying
        it, and so does Lightning's order (``iter(loader)``, then ``set_epoch``, then ``next``).
        """
        epoch = whole(epoch, "epoch")
        if not 0 <= int(epoch) < 2 ** 63:   # an int64: the orders and copies are numpy arithmetic on it
            raise ValueError(f"epoch must be in [0, 2**63), got {epoch}")
        if self._resume and int(epoch) == self.epoch:
            return
        self._end_started_pass()
        self.epoch, self._pos, self._resume = int(epoch), 0, False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken: the next iteration yields the remaining batches.

        A pass being consumed (its first batch handed out) ends here: its iterator yields no more batches and
        writes no position over the restored one.

        ``state`` is what :meth:`state_dict` returned (through a checkpoint: JSON, torch.save, ...). One that is not
        a dict, lacks ``epoch``, ``batch`` or a key of ``STATE_CHECKS``, holds another value for one of those (or for
        a key of ``STATE_ADDED`` it has), or
        an ``epoch``/``batch`` that is not a whole number in range, is a ``ValueError`` naming it; nothing changes
        then. Keys it does not know are ignored (a state of a later version). ``rank`` is not checked: every rank
        of a DDP job may resume from rank 0's state (its position is every rank's)."""
        from ..errors import echo

        if not isinstance(state, dict):
            raise ValueError(f"state_dict must be a dict (what {self.KIND}.state_dict() returned), got "
                             f"{type(state).__name__}: {echo(state, 80)}")
        mine = self.state_dict()
        for k in ("epoch", "batch", *self.STATE_CHECKS):
            if k not in state:
                raise ValueError(f"state_dict has no {k!r}: it is not a state_dict() of this {self.KIND} (which "
                                 f"holds {', '.join(sorted(mine))})")
        for k in (*self.STATE_CHECKS, *(k for k in self.STATE_ADDED if k in state)):
            if _differs(state[k], mine[k]):
                if k in self.STATE_HINTS:
                    raise ValueError(self.STATE_HINTS[k].format(theirs=echo(state[k], 80), mine=echo(mine[k], 80)))
                raise ValueError(f"state_dict was taken with {k}={echo(state[k], 80)}, this {self.KIND} has "
                                 f"{k}={echo(mine[k], 80)}")
        epoch, pos = whole(state["epoch"], "state_dict epoch"), whole(state["batch"], "state_dict batch")
        if not 0 <= epoch < 2 ** 63:
            raise ValueError(f"state_dict epoch must be in [0, 2**63), got {epoch}")
        nb = len(self.batch_indices(epoch))
        if not 0 <= pos <= nb:
            raise ValueError(f"state_dict batch must be in [0, {nb}] (epoch {epoch} has {nb} batches), got {pos}")
        self._end_started_pass()
        self.epoch, self._pos, self._resume = epoch, pos, True

    def _end_started_pass(self) -> None:
        """A pass whose batches are being handed out (its first ``next`` came) ends here: the next ``next`` of its
        iterator is ``StopIteration``, and it writes no position after this; the new epoch or restored position
        is the next pass's. An iterator made but not started yet is left alone: it reads the position at its
        first ``next`` (Lightning's order)."""
        import inspect

        ref = getattr(self, "_active", None)
        gen = ref() if ref is not None else None
        if gen is not None and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
            gen.close()


def _differs(theirs: Any, mine: Any) -> bool:
    """Whether a restored value is not this reader's (a value that cannot even be compared differs)."""
    try:
        return bool(theirs != mine)
    except Exception:   # an array, an object whose == raises: not what state_dict() wrote
        return True
