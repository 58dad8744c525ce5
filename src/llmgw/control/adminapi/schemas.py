"""Request and answer bodies of the admin API that are not fleet views.

API keys are shown without their hash as well as without their secret: the
hash is what the gateway checks against, and a list of them is a list of
things to brute-force offline if it leaks from a console screenshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmgw.control.adminapi.tenancy_schemas import LimitsBody, LimitsUpdate
from llmgw.control.gateway_count import LastReport, Placement, placement
from llmgw.control.store.repo import Row
from llmgw.wire import (
    ApiKeyInfo,
    ModelSpec,
    UsageRecord,
    check_node_name,
)


class _Body(BaseModel):
    # Unknown fields are refused, as in wire.py: a typo such as "dryrun"
    # must not silently apply for real.
    model_config = ConfigDict(extra="forbid")


class Done(BaseModel):
    message: str


class AddressClaim(BaseModel):
    """An address bound to the node first given a certificate for it (control.nodecerts)."""

    address: str
    node: str
    claimed_at: float


class CatalogInput(_Body):
    """Catalog entries as JSON (``models``) or as a YAML/JSON document's text."""

    models: list[ModelSpec] | None = None
    document: str | None = Field(None, max_length=4_000_000)
    # Named in error messages ("models.yaml: line 3 ...").
    source: str = Field("request", max_length=300)
    dry_run: bool = False


class ApplyResult(BaseModel):
    dry_run: bool
    added: list[str] = Field(default_factory=list)
    changed: list[str] = Field(default_factory=list)
    unchanged: list[str] = Field(default_factory=list)
    # For each changed model, the top-level fields that differ.
    changed_fields: dict[str, list[str]] = Field(default_factory=dict)
    # What the planner would do with the new catalog (dry runs only).
    plan: dict[str, Any] | None = None


class EventView(BaseModel):
    id: int
    at: float
    kind: str
    subject: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


def event_view(row: Row) -> EventView:
    return EventView(id=row["id"], at=row["at"], kind=row["kind"], subject=row["subject"] or "",
                     message=row["message"], data=dict(row["data"] or {}))


class GatewayView(BaseModel):
    id: str
    # Seconds since its last load report (it reports about once a second).
    last_report_s: float
    # Requests it was proxying, summed over the replicas its last report named.
    in_flight: int
    # Model -> requests waiting for a replica (an on-demand start), as it last reported.
    waiting: dict[str, int]


class GatewaysAnswer(BaseModel):
    """The gateways whose load reports reach this instance, and the count the table tells them."""

    # Gateways that reported in the last 30 s, as the routing table carries it;
    # 0: not known yet (this instance started or took over under 5 s of reports ago).
    count: int
    # How gateways place a new prompt prefix with that count (docs/gateway.md).
    placement: Placement
    # False on a standby: gateways report to the leader, so a standby lists none.
    leader: bool
    # By id; only those not yet stale.
    gateways: list[GatewayView]


def gateways_answer(count: int, leader: bool, reports: Mapping[str, LastReport],
                    now: float) -> GatewaysAnswer:
    """``reports`` as GatewayCount keeps them, ``now`` on the same (monotonic) clock."""
    return GatewaysAnswer(
        count=count, placement=placement(count), leader=leader,
        gateways=[GatewayView(id=gateway, last_report_s=round(max(0.0, now - report.at), 1),
                              in_flight=report.in_flight, waiting=dict(report.waiting))
                  for gateway, report in sorted(reports.items())],
    )


class KeyCreate(LimitsBody):
    name: str = Field("", max_length=200)
    # Models the key may use; empty: all (within its team's).
    models: list[str] = Field(default_factory=list, max_length=1000)
    expires_at: float | None = Field(None, ge=0)
    # The team (id or name) the key belongs to; none: the operator's.
    team: str | None = Field(None, max_length=200)


class KeyUpdate(LimitsUpdate):
    """What may change on a key; fields left out stay (null clears a limit or the team)."""

    team: str | None = Field(None, max_length=200)


class KeyView(LimitsBody):
    model_config = ConfigDict(extra="ignore")

    key_id: str
    name: str
    models: list[str]
    expires_at: float | None
    revoked: bool
    team_id: str | None = None


def key_view(info: ApiKeyInfo) -> KeyView:
    return KeyView.model_validate(info.model_dump(exclude={"secret_hash"}))


class KeyCreated(BaseModel):
    key: KeyView
    # The key itself: shown here once, stored only as a hash.
    secret: str


class UsageCounts(BaseModel):
    """What every usage answer counts, summed over the store's rows (per minute, key, model)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    # At the catalog's prices when the usage was recorded (ModelSpec.price).
    spend_usd: float = 0.0

    def add(self, row: Mapping[str, Any]) -> None:
        """Add one row's counters (a store row, or a record dumped as one)."""
        for counter in USAGE_COUNTERS:
            setattr(self, counter, getattr(self, counter) + row.get(counter, 0))


# In the order of the API's answers and the CSV's columns.
USAGE_COUNTERS = tuple(UsageCounts.model_fields)


class UsageTotal(UsageCounts):
    key_id: str | None = None
    model: str | None = None


class UsageAnswer(BaseModel):
    since: int
    # One row per minute, key and model.
    rows: list[UsageRecord] = Field(default_factory=list)
    # Per key and model over the whole window, most requests first.
    by_key_model: list[UsageTotal] = Field(default_factory=list)
    total: UsageTotal = Field(default_factory=UsageTotal)


def usage_answer(since: int, rows: list[Row]) -> UsageAnswer:
    answer = UsageAnswer(since=since)
    groups: dict[tuple[str, str], UsageTotal] = {}
    for row in rows:
        record = UsageRecord(**{k: row[k] for k in UsageRecord.model_fields})
        answer.rows.append(record)
        group = groups.get((record.key_id, record.model))
        if group is None:
            group = groups[(record.key_id, record.model)] = UsageTotal(
                key_id=record.key_id, model=record.model
            )
        group.add(row)
        answer.total.add(row)
    answer.by_key_model = sorted(groups.values(),
                                 key=lambda g: (-g.requests, g.key_id or "", g.model or ""))
    return answer


class JoinToken(BaseModel):
    # Shown once: agents register with it (llmgw agent --join-token).
    join_token: str


class RotatedToken(BaseModel):
    # Shown once; the old token no longer works.
    token: str


class NodeFabrics(_Body):
    # The node's fabrics from now on, whatever its reports say.
    fabrics: list[str] = Field(max_length=16)

    @field_validator("fabrics")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for item in value:
            check_node_name(item, "fabric name")
        return value


class JoinTokenCreate(_Body):
    # Seconds until it stops working; none: the control plane's default
    # (llmgw serve --join-token-ttl); 0: never (kubeadm's convention).
    ttl_s: float | None = Field(None, ge=0, le=10 * 365 * 86400)
    # How many nodes may register with it; none: any number.
    uses: int | None = Field(None, ge=1, le=100_000)
    description: str = Field("", max_length=200)


class JoinTokenView(BaseModel):
    id: str
    description: str
    created_at: float
    expires_at: float | None
    max_uses: int | None
    uses: int
    revoked: bool
    usable: bool


class JoinTokenCreated(BaseModel):
    token: JoinTokenView
    # Shown once: agents register with it (llmgw agent --join-token-file).
    join_token: str
