"""The catalog's models by name: a dict that counts its writes.

Readers that keep something derived from the catalog (the adapter index
every report's answer reads, control.adapters) must know whether a model
came, went or was replaced. The routing version told them, but it also
moves with every node that turns unreachable or back: at 10,000 nodes
reporting slower than every 30 s that was nearly every report, and each
one walked the whole catalog again (a sixth of the control plane's CPU,
measured with py-spy). ``version`` moves on every write to the table and
on nothing else.

A record's ``spec`` is replaced only together with a write of the record
to the table (services.catalog does both), so a reader keyed on
``version`` never keeps a stale spec.
"""

from __future__ import annotations

from typing import Any, TypeVar

V = TypeVar("V")
_MISSING: Any = object()


class ModelTable(dict[str, V]):
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

    def __ior__(self, other: Any) -> ModelTable[V]:  # type: ignore[override,misc]
        self.update(other)
        return self


__all__ = ["ModelTable"]
