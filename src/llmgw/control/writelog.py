"""Which records of a table had fields assigned, in order: a log each table holds.

Readers that keep something derived from the fleet (the admin summary's
keeper, adminapi/summary_keeper.py) read again only the records written
since their last look. Every assignment to a record's field is logged by
the record itself (``Logged.__setattr__``, below), into the log of the
table it was last put in (``adopt``), so no code that writes to the fleet
has to remember to say so, and two fleets in one process keep apart. Edits
inside a field's value (a list appended to) are not assignments and are
not logged: such values are replaced, never edited in place (the views'
memo rule, adminapi/views/memo.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

_R = TypeVar("_R")


class WriteLog(Generic[_R]):
    """Records written to, repeats included, oldest first.

    Bounded: past ``limit`` entries the older half is dropped, and a reader
    whose position fell behind is told so (``since`` answers None) and must
    look at everything, which it has to be able to do anyway.
    """

    __slots__ = ("_base", "_limit", "_writes")

    def __init__(self, limit: int = 200_000) -> None:
        self._writes: list[_R] = []
        self._base = 0  # the position of _writes[0]
        self._limit = limit

    def position(self) -> int:
        """Where the next write will be: hand it back to ``since``."""
        return self._base + len(self._writes)

    def since(self, position: int) -> list[_R] | None:
        """Records written since ``position`` (repeats included), or None when
        some of those writes were dropped."""
        start = position - self._base
        return None if start < 0 else self._writes[start:]

    def note(self, record: _R) -> None:
        """``record`` had a field assigned."""
        writes = self._writes
        writes.append(record)
        if len(writes) > self._limit:
            half = len(writes) // 2
            del writes[:half]
            self._base += half

    def adopt(self, record: object) -> None:
        """Log ``record``'s writes here from now on: it was put in this log's table.

        A record kind without a ``_writes`` slot logs nothing.
        """
        with contextlib.suppress(AttributeError):
            object.__setattr__(record, "_writes", self)


@dataclass(slots=True)
class Logged:
    """A record (a dataclass deriving from this one) that notes each assignment to
    one of its fields in the log of the table it was last put in.

    ``_writes`` is the first field of every such record, so it is set before
    any other field is assigned.
    """

    _writes: WriteLog[Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        writes = self._writes
        if writes is not None:
            writes.note(self)


__all__ = ["Logged", "WriteLog"]
