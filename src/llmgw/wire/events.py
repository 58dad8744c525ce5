"""What happened in the fleet, as the control plane records and shows it."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from llmgw.wire.base import Wire


class Event(Wire):
    id: int | None = None
    at: float
    kind: str  # "placed", "evicted", "failed", "parked", "drain", "leader", ...
    subject: str = ""  # model, replica or node it is about
    message: str
    data: dict[str, Annotated[str | int | float | bool | None, Field()]] = Field(
        default_factory=dict
    )
