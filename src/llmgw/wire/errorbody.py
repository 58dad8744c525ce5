"""How every llmgw API says no: one error body, and how a standby points at the leader.

The control plane's APIs, the gateway and the simulated engine answer errors
as ``{"error": {"message", "type", "code"}}`` (OpenAI's shape, which clients
already read). :class:`ErrorBody` renders that body and parses it, so the
agent, the gateway's link, ``llmgw ctl`` and the simulated fleet read one
shape instead of each digging ``["error"]["message"]`` out of a dict.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

# A standby answers the agent API and the gateway link with HTTP 503, an error
# body whose ``code`` is STANDBY_CODE, and the leader's advertised URL in
# LEADER_HEADER when the store knows it. Agents and gateways read these two to
# move to the leader instead of taking a standby's answer (stale assignments,
# heartbeats the leader never sees) or retrying it forever.
STANDBY_CODE = "standby"
LEADER_HEADER = "X-Llmgw-Leader"


class ErrorDetail(BaseModel):
    """What went wrong: ``message`` is the sentence a person acts on."""

    # Not Wire's "refuse unknown fields": an error body may come from another
    # version, or from a proxy in between, and its reader wants the message
    # whatever else the body carries.
    model_config = ConfigDict(extra="ignore")

    message: str
    type: str | None = None
    code: str | int | None = None
    # OpenAI's: the request field at fault (the gateway's and engines' bodies).
    param: str | None = None
    # A standby's: the leader it knows (also in LEADER_HEADER).
    leader: str | None = None


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    error: ErrorDetail

    @classmethod
    def of(cls, message: str, kind: str, code: str | int | None = None) -> ErrorBody:
        """The control plane's usual body: message, type and code (``null`` included)."""
        return cls(error=ErrorDetail(message=message, type=kind, code=code))

    def render(self) -> bytes:
        # The fields the writer set, None included (clients see ``"code": null``
        # today), and no others: each API keeps its own shape (``param`` is
        # the gateway's, ``leader`` a standby's).
        return self.model_dump_json(exclude_unset=True).encode()

    @classmethod
    def parse(cls, body: bytes | str) -> ErrorBody | None:
        """The body as an error body; None when it is not one (an HTML page, a proxy's text)."""
        try:
            return cls.model_validate_json(body)
        except ValidationError:
            return None

    @classmethod
    def message_in(cls, body: bytes | str) -> str | None:
        """The error's message, when ``body`` is an error body with one."""
        parsed = cls.parse(body)
        return parsed.error.message if parsed is not None and parsed.error.message else None

    @property
    def from_standby(self) -> bool:
        """Whether a standby sent it: the call belongs to the leader."""
        return self.error.code == STANDBY_CODE
