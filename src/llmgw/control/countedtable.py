"""A dict of records by name that counts its writes.

Readers that keep something derived from a table (the summary keeper from
the nodes, the adapter index from the catalog) must learn whether a record
came, went or was put in another's place without listing and comparing the
whole table: ``version`` moves on every write to the table and on nothing
else. Assigning a field of a record already in the table is not a write to
the table; tables that need those keep their own log (NodeTable).
"""

from __future__ import annotations

from typing import Any, Self, TypeVar

V = TypeVar("V")
_MISSING: Any = object()


class CountedTable(dict[str, V]):
    __slots__ = ("version",)

    def __init__(self, *args: Any, **kwargs: V) -> None:
        super().__init__(*args, **kwargs)
        self.version = 0

    def __setitem__(self, name: str, value: V) -> None:
        super().__setitem__(name, value)
        self.version += 1

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self.version += 1

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        if default is _MISSING:
            value = super().pop(name)
        elif name not in self:
            return default
        else:
            value = super().pop(name)
        self.version += 1
        return value

    def popitem(self) -> tuple[str, V]:
        item = super().popitem()
        self.version += 1
        return item

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def setdefault(self, name: str, default: V) -> V:
        if name not in self:
            self[name] = default
        return self[name]

    def update(self, *args: Any, **kwargs: V) -> None:
        super().update(*args, **kwargs)
        self.version += 1

    def __ior__(self, other: Any) -> Self:  # type: ignore[override,misc]
        self.update(other)
        return self


__all__ = ["CountedTable"]
