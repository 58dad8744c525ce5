"""The errors llmgw raises on purpose, in one tree.

    LlmgwError                 anything llmgw reports to a person or a client
    ├── ConfigError            bad settings: exit code 2 with one line, no traceback
    ├── StoreError             the store cannot be reached or is inconsistent
    │   └── NotLeaderError     a write from a deposed reconciler (stale epoch)
    ├── StandbyError           a write sent to a control-plane instance that is not the leader
    ├── ControlPlaneUnavailable  no control-plane instance took a call (down, restarting, standbys)
    ├── ValidationError        a catalog entry, request or report that is malformed
    │   └── TransitionError    a replica state change its lifecycle does not allow
    ├── NotFoundError          a named node, model, replica or key does not exist
    ├── AuthError              a missing or wrong credential
    ├── ForbiddenError         a known caller whose role does not allow the action
    ├── DiscoveryError         nvidia-smi / NVML output that cannot be understood
    └── EngineError            an engine could not be built or started

Outside errors (sqlalchemy, aiohttp, OSError, ...) are translated into these at
the boundary that meets them, once, so callers handle one family.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Base of all errors llmgw raises deliberately."""


class ConfigError(LlmgwError):
    """A setting that cannot work (URL scheme, unwritable dir, port in use...)."""


class StoreError(LlmgwError):
    """The store failed or refused an operation."""


class NotLeaderError(StoreError):
    """A write carried a leader epoch older than the current one."""


class StandbyError(LlmgwError):
    """This control-plane instance is a standby: the write belongs to the leader.

    Answered as HTTP 503 with the leader's URL when known (llmgw.wire.LEADER_HEADER).
    A standby that took the write itself would act on views up to seconds old
    and change memory the leader never reads.
    """


class ControlPlaneUnavailable(LlmgwError):
    """No control-plane instance took a call: down, restarting, the network, or only standbys.

    The client side of StandbyError and of an outage: the agent's loop and
    the gateway's retry it (llmgw.cpclient, llmgw.failover).
    """

    def __init__(self, message: str, *, standby_answered: bool = False) -> None:
        super().__init__(message)
        # A standby answered: the store is up and a leader is being elected,
        # so a caller should try again soon rather than back off for long.
        self.standby_answered = standby_answered


class ValidationError(LlmgwError):
    """Input that breaks a rule; the message names the field and the rule."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TransitionError(ValidationError):
    """A replica asked to change state in a way its lifecycle does not allow.

    Raised by ReplicaRecord.move_to (llmgw.control.state); an operator sees
    it as a refused request (e.g. draining a replica that already failed).
    """


class NotFoundError(LlmgwError):
    """A named thing does not exist."""


class AuthError(LlmgwError):
    """A credential is missing, wrong, or not valid for this route."""


class ForbiddenError(LlmgwError):
    """The caller is known (its credential is good) but its role does not allow this."""


class DiscoveryError(LlmgwError):
    """GPU discovery met output it cannot understand."""


class EngineError(LlmgwError):
    """An engine adapter cannot build a command, or the engine failed to start."""
