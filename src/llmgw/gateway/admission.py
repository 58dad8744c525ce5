"""The gateway's hold queue for saturated models: priority classes, fair between teams.

Why the gateway and not the engine holds the queue: an engine queues what it
is sent first come, first served, so a tenant that floods a model puts every
other tenant's request behind its backlog, and one burst raises everyone's
time to first token. Where the catalog states how many requests a replica
runs at once (``ModelRoute.max_concurrency``), the gateway sends no more than
that and holds the rest here, where it can choose the order. A model without
one is not gated at all (nothing here runs for its requests).

The order, when a slot frees:

* **Classes first.** Every waiting request of a higher class
  (``interactive`` > ``standard`` > ``batch``) goes before any of a lower
  one. A flood of a higher class starves the lower ones; their wait is
  bounded like any other (then 503), which is the point of the class.
* **Teams within a class: weighted fair queueing** (start-time fair
  queueing, a request costing 1/weight). Each request is tagged with
  ``max(class clock, its team's last tag)``; the smallest tag goes first
  and moves the class clock to it. A team that sent nothing for a while
  starts at the clock, so it neither banks credit while idle nor waits behind
  another team's backlog: with one flooding team and one occasional one,
  the occasional one's request is next. Requests of one team keep their
  order. The tags reset when the class has nobody waiting.
* **Free slots kept for teams below their share.** Without preemption,
  fair order alone cannot help a request when every slot is held by one
  team: it still waits for one of them to finish (a whole generation). A
  team's share is the slots it would hold if the teams active now (holding
  or waiting) and one more split them evenly. A team below its share takes
  any free slot. A team at or above it leaves ``reserve`` slots free for a
  newcomer, and one more for each other active team below its share, so
  that team's next request starts at once too. A team flooding alone runs
  ``capacity - reserve`` at once (the price: that part of the model's
  throughput while one team has it all), one less per light team active
  beside it. ``batch`` is never below its share in this sense: it always
  leaves the kept slots.

Bounds: at most ``hold_queue_length`` requests wait per model (past it, 429
with ``Retry-After``), none longer than ``hold_wait_s`` (then 503 with
``Retry-After``); a client that leaves is out of the queue at once.

Several gateways (and workers) each hold their own queue: the routing
table's gateway count splits a replica's slots between them (rounded up),
so together they send an engine about what it runs, not N times that.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Sequence
from itertools import count
from typing import Protocol, TypeVar

from llmgw import wire
from llmgw.gateway.replies import ApiError, unavailable

# Ranks: lower is served first.
RANKS: dict[str, int] = {name: rank for rank, name in enumerate(wire.PRIORITY_CLASSES)}
DEFAULT_CLASS: wire.PriorityClass = "standard"
BATCH = RANKS["batch"]
_R = TypeVar("_R", bound="Busy")


# A team whose last request ended less than this ago still has a slot kept
# for its next one (while below its share): an interactive user reads an
# answer and asks again within seconds, a service sends a steady trickle,
# and without the kept slot that next request waits for one of a flooding
# team's generations to end. Longer keeps slots idle for teams that have
# left; each costs the flooding team one slot meanwhile.
RECENT_S = 5.0


def slots_per_replica(max_concurrency: int, gateways: int) -> int:
    """This gateway's share of one replica's slots: ``gateways`` hold them together."""
    return max(1, math.ceil(max_concurrency / max(1, gateways)))


def reserve_of(capacity: int, share: float) -> int:
    """Slots kept for teams with little in flight: ``share`` of them, at least 1 of 2 or more."""
    if capacity < 2 or share <= 0:
        return 0
    return min(capacity - 1, max(1, int(capacity * share)))


class Ticket:
    """One request's place: in the queue, then holding a slot until it leaves."""

    __slots__ = ("future", "granted", "rank", "tag", "team", "weight")

    def __init__(self, team: str, rank: int, weight: float) -> None:
        self.team = team
        self.rank = rank
        self.weight = weight
        self.tag = 0.0
        self.granted = False
        self.future: asyncio.Future[None] | None = None


class _Class:
    """One priority class's waiters of one model, in start-tag order."""

    __slots__ = ("clock", "heap", "last", "live", "teams")

    def __init__(self) -> None:
        # Granted and withdrawn tickets stay in the heap until they reach its
        # top (a removal from its middle costs a rebuild); ``live`` counts the rest.
        self.heap: list[tuple[float, int, Ticket]] = []
        self.clock = 0.0
        self.last: dict[str, float] = {}  # team -> its latest request's finish tag
        self.teams: dict[str, int] = {}  # team -> its live waiters
        self.live = 0

    def push(self, ticket: Ticket, seq: int) -> None:
        team = ticket.team
        start = max(self.clock, self.last.get(team, 0.0))
        ticket.tag = start
        self.last[team] = start + 1.0 / ticket.weight
        heapq.heappush(self.heap, (start, seq, ticket))
        self.teams[team] = self.teams.get(team, 0) + 1
        self.live += 1

    def head(self) -> Ticket | None:
        heap = self.heap
        while heap and heap[0][2].future is None:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def first_of(self, teams: set[str]) -> Ticket | None:
        """The waiter with the smallest tag among ``teams``' (a scan: the reserve's rare case)."""
        best: tuple[float, int, Ticket] | None = None
        for entry in self.heap:
            ticket = entry[2]
            live = ticket.team in teams and ticket.future is not None
            if live and (best is None or entry[:2] < best[:2]):
                best = entry
        return best[2] if best is not None else None

    def served(self, ticket: Ticket) -> None:
        """``ticket`` got its slot: the class's clock moves to its tag."""
        self.clock = max(self.clock, ticket.tag)
        self._gone(ticket)

    def forget(self, ticket: Ticket) -> None:
        """``ticket`` left before its turn."""
        self._gone(ticket)

    def _gone(self, ticket: Ticket) -> None:
        team = ticket.team
        left = self.teams[team] - 1
        if left:
            self.teams[team] = left
        else:
            del self.teams[team]
        self.live -= 1
        if not self.live:  # nobody waits: no tag carries over
            self.heap.clear()
            self.clock = 0.0
            self.last.clear()


class Gate:
    """The slots of one model on this gateway and the requests waiting for them."""

    __slots__ = ("_seq", "_sized_for", "batch", "capacity", "classes", "held", "in_use",
                 "lately", "reserve")  # fmt: skip

    def __init__(self) -> None:
        self.capacity = 0
        self.reserve = 0
        self.in_use = 0
        self.held: dict[str, int] = {}  # team -> slots it holds
        self.batch: set[str] = set()  # teams holding slots whose last request was batch
        self.lately: dict[str, float] = {}  # team -> when its last slot ended (monotonic)
        self.classes = [_Class() for _ in RANKS]
        self._seq = count()
        self._sized_for: object = None

    def resize(self, capacity: int, reserve: int, source: object) -> None:
        """New slot counts (a new routing table); waiters get the slots it adds."""
        self._sized_for = source
        if capacity != self.capacity or reserve != self.reserve:
            self.capacity, self.reserve = capacity, reserve
            self._dispatch()

    def sized_for(self, source: object) -> bool:
        return self._sized_for is source

    @property
    def waiting(self) -> int:
        return sum(c.live for c in self.classes)

    def _fits(self, ticket: Ticket, free: int) -> bool:
        """Whether ``ticket`` may take one of ``free`` slots now.

        A team below its share takes any free slot (not ``batch``). Any other
        leaves ``reserve`` slots free for a newcomer, and one more for each
        other team below its share that holds slots, or held one lately, and
        waits for none (up to ``reserve`` more): that team's next request
        starts at once instead of waiting for one of the big team's to end.
        (A team that waits already is served in its turn.)
        """
        if free <= 0:
            return False
        if free > 2 * self.reserve:
            return True  # more than anyone keeps (below): the usual case, without the sets
        team = ticket.team
        held = self.held
        waiting = self._waiting_teams()
        served = held.keys() | self._lately()
        active = waiting | served
        others = len(active) - (team in active)
        if ticket.rank < BATCH and held.get(team, 0) < self.capacity / (others + 2):
            return True
        if free <= self.reserve:
            return False
        # Every active team's share: the capacity over the active teams and one more.
        share = self.capacity / (len(active) + 1)
        light = sum(1 for t in served if held.get(t, 0) < share and t != team
                    and t not in waiting and t not in self.batch)  # fmt: skip
        # Bounded: at most the reserve again, and never the whole capacity
        # (an empty gate admits anyone).
        keep = self.reserve + min(light, self.reserve)
        return free > min(keep, self.capacity - 1)

    def _lately(self) -> set[str]:
        """Teams holding no slot now whose last one ended less than RECENT_S ago."""
        lately = self.lately
        if not lately:
            return set()
        now = time.monotonic()
        for team in [t for t, at in lately.items() if now - at >= RECENT_S]:
            del lately[team]
        return set(lately)

    def _waiting_teams(self) -> set[str]:
        teams: set[str] = set()
        for waiting in self.classes:
            teams.update(waiting.teams)
        return teams

    def _below_share(self, teams: dict[str, int]) -> set[str]:
        """Those of ``teams`` holding fewer slots than their share (see _fits)."""
        active = self._waiting_teams() | self.held.keys()
        share = self.capacity / (len(active) + 1)
        return {t for t in teams if self.held.get(t, 0) < share}

    def _take(self, ticket: Ticket) -> None:
        ticket.granted = True
        self.in_use += 1
        team = ticket.team
        self.held[team] = self.held.get(team, 0) + 1
        self.lately.pop(team, None)
        if ticket.rank >= BATCH:
            self.batch.add(team)
        else:
            self.batch.discard(team)

    def try_enter(self, ticket: Ticket) -> bool:
        """Take a slot at once when nobody waits and one is free to this ticket."""
        if self.waiting or not self._fits(ticket, self.capacity - self.in_use):
            return False
        self._take(ticket)
        return True

    def queue(self, ticket: Ticket) -> asyncio.Future[None]:
        """Put ``ticket`` in line; the future is done when it holds a slot."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket.future = future
        self.classes[ticket.rank].push(ticket, next(self._seq))
        self._dispatch()
        return future

    def withdraw(self, ticket: Ticket) -> None:
        """A waiter gives up (timed out, client gone); a granted one leaves instead."""
        if ticket.granted:
            self.leave(ticket)
            return
        if ticket.future is not None:
            ticket.future = None
            self.classes[ticket.rank].forget(ticket)

    def leave(self, ticket: Ticket) -> None:
        """A request that held a slot is done with it."""
        if not ticket.granted:
            return
        ticket.granted = False
        self.in_use -= 1
        held = self.held[ticket.team] - 1
        if held:
            self.held[ticket.team] = held
        else:
            del self.held[ticket.team]
            if ticket.team in self.batch:
                self.batch.discard(ticket.team)
            else:
                self.lately[ticket.team] = time.monotonic()
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots: highest class first, then the smallest tag that fits."""
        while self.in_use < self.capacity:
            free = self.capacity - self.in_use
            for waiting in self.classes:
                chosen = waiting.head()
                if chosen is None:
                    continue
                if not self._fits(chosen, free):
                    # The first waiter of a team below its share may still
                    # start, if any waits (the rare case: a scan).
                    if chosen.rank >= BATCH:
                        continue
                    few = self._below_share(waiting.teams)
                    chosen = waiting.first_of(few) if few else None
                    if chosen is None:
                        continue
                waiting.served(chosen)
                self._take(chosen)
                # Out of the queue for good (the heap drops it when it
                # surfaces), whatever it does with its slot.
                future, chosen.future = chosen.future, None
                if future is not None and not future.done():
                    future.set_result(None)
                break
            else:
                return


class Admission:
    """Every gated model's :class:`Gate` on this gateway, by model name.

    Outlives config versions (like the replicas' in-flight counts), so a new
    routing table resizes a gate instead of forgetting who holds its slots.
    """

    def __init__(self, queue_length: int, wait_s: float, reserve_share: float,
                 retry_after_s: float) -> None:  # fmt: skip
        self.queue_length = queue_length
        self.wait_s = wait_s
        self.reserve_share = reserve_share
        self.retry_after_s = retry_after_s
        self.gates: dict[str, Gate] = {}

    def waiting(self) -> dict[str, int]:
        """Requests held per model now (for metrics and load reports)."""
        return {model: n for model, gate in self.gates.items() if (n := gate.waiting)}

    def gate(self, model: str, per_replica: int, replicas: Sequence[object], gateways: int,
             source: object) -> Gate:  # fmt: skip
        """The model's gate, sized for ``replicas`` of ``per_replica`` slots shared by ``gateways``.

        ``source`` is the routing state the sizes came from (the model's
        router of one config version): sized once per version, not per request.
        """
        gate = self.gates.get(model)
        if gate is None:
            gate = self.gates[model] = Gate()
        if not gate.sized_for(source):
            capacity = slots_per_replica(per_replica, gateways) * len(replicas)
            gate.resize(capacity, reserve_of(capacity, self.reserve_share), source)
        return gate

    async def hold(
        self, tenant: Tenant, model: str, per_replica: int, replicas: Sequence[object],
        gateways: int, source: object,
    ) -> Held:  # fmt: skip
        """A slot of the model's gate for ``tenant``'s request, once its turn comes."""
        gate = self.gate(model, per_replica, replicas, gateways, source)
        ticket = Ticket(tenant.tenant, tenant.rank, tenant.weight)
        waited = await self.enter(gate, ticket, model)
        return Held(gate, ticket, waited, slots_per_replica(per_replica, gateways))

    async def enter(self, gate: Gate, ticket: Ticket, model: str) -> float:
        """Hold ``ticket`` until it has a slot of ``gate``; the seconds it waited.

        Raises 429 when the queue is full, 503 when the wait passes its bound;
        both carry ``Retry-After``.
        """
        if gate.try_enter(ticket):
            return 0.0
        if gate.waiting >= self.queue_length:
            raise ApiError(
                429,
                f"Too many requests are waiting for the model `{model}`: it is at capacity.",
                kind="requests", code="queue_full", retry_after=self.retry_after_s,
            )  # fmt: skip
        began = time.monotonic()
        future = gate.queue(ticket)
        if ticket.granted:
            return 0.0
        try:
            async with asyncio.timeout(self.wait_s):
                await future
        except TimeoutError:
            if ticket.granted:  # granted as the time ran out: take it
                return time.monotonic() - began
            gate.withdraw(ticket)
            raise unavailable(
                f"The model `{model}` is at capacity and this request waited"
                f" {self.wait_s:g} s without a turn.",
                "overloaded", self.retry_after_s,
            ) from None  # fmt: skip
        except BaseException:
            gate.withdraw(ticket)  # the client left: out of line, or its slot back
            raise
        return time.monotonic() - began


class Tenant(Protocol):
    """What the queue reads of a request's key (llmgw.gateway.auth.KeyRecord)."""

    @property
    def tenant(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def weight(self) -> float: ...


class Held:
    """A request's slot, from its admission until its answer is over."""

    __slots__ = ("gate", "slots", "ticket", "waited")

    def __init__(self, gate: Gate, ticket: Ticket, waited: float, slots: int) -> None:
        self.gate = gate
        self.ticket = ticket
        self.waited = waited  # seconds in the queue: not the gateway's overhead
        self.slots = slots  # per replica, this gateway's share

    def passed_over(self, replicas: Sequence[_R], tried: Sequence[_R]) -> Sequence[_R]:
        """``tried`` and the replicas running their share already (see full_replicas)."""
        return full_replicas(replicas, self.slots, tried)

    def release(self) -> None:
        self.gate.leave(self.ticket)


class Busy(Protocol):
    """What the gate reads of a replica: its requests in flight from this gateway."""

    @property
    def in_flight(self) -> int: ...


def full_replicas(replicas: Sequence[_R], slots: int, tried: Sequence[_R]) -> list[_R]:
    """Replicas to pass over because they run their share of slots already.

    Empty where that would leave nothing to pick (a replica freed its slot
    and then failed this request): routing then chooses among all as before.
    """
    full = [r for r in replicas if r.in_flight >= slots]
    if not full or len(full) + sum(1 for r in tried if r not in full) >= len(replicas):
        return list(tried)
    return [*tried, *(r for r in full if r not in tried)]
