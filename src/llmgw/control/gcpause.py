"""Keeping the cyclic garbage collector's pauses off the control plane's requests.

``paused_gc``: no collection while a burst of short-lived objects is alive
(the admin views and summary, the reconciler's and the planner's decision
step: each builds tens of thousands of objects, uses them and drops them,
all synchronously). ``freeze_survivors``: the long-lived fleet state moved
out of the collector's reach, without making garbage immortal.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a view, summary or pass is built.

    Building views (or a pass's snapshot of the fleet) allocates tens of
    thousands of short-lived objects. If a collection runs while they are
    alive it promotes them, and every few calls that triggers a full
    collection over the whole fleet state (about 260,000 objects at 2,000
    nodes): 120-300 ms on this project's machines, measured, which alone
    would be the summary's p99. At 10,000 nodes the collector's share of a
    reconcile pass was a third to a half of it (measured: a pass from empty
    2.5 s with it, 1.4 s without). None of these objects form reference
    cycles, so with the collector paused every one of them is freed by
    reference counting as soon as it is dropped, and the allocation count
    is back where it was. Synchronous code only: the pause must never span
    an ``await``.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# Below this many objects outside the frozen set a full collection takes a
# few milliseconds (about 1 us an object on these machines), so freezing them
# gains nothing, and every freeze risks what the docstring below says.
FREEZE_MIN_OBJECTS = 20_000


def freeze_survivors(min_objects: int | None = None) -> bool:
    """Collect, then freeze (``gc.freeze``) what survived, once there is much of it.

    The fleet's state is hundreds of thousands of long-lived objects; a full
    collection walking them took 120-300 ms and landed on whatever request
    was running, so the runtime looks every few seconds and freezes the old
    generation when it has grown past ``min_objects`` (``FREEZE_MIN_OBJECTS``):
    later collections skip it. A frozen object is never collected again,
    which made this a leak twice over, both found by bench/soak.py (``serve``
    under a steady load, SQLAlchemy statements: each usage upsert's
    ``excluded`` alias and its columns are a reference cycle):

    - freezing without collecting first made every cycle that had become
      garbage since the last freeze immortal: 1.3 MB a minute;
    - freezing every 5 s whatever its size froze, each time, the cycles of
      work in flight (a statement waiting for the database), immortal once
      that work ended: that one site kept ~15 KB more every minute
      (tracemalloc), with serve growing ~57 KB a minute in all.

    In a steady state the old generation stays small (what survives is only
    what was made since) and nothing is frozen; after the fleet grew (nodes
    registered, replicas placed) the new state is frozen once. Returns
    whether it froze. Counting the old generation lists it: cheap while it
    is small, and once it is not, it is frozen right after.
    """
    threshold = FREEZE_MIN_OBJECTS if min_objects is None else min_objects
    if len(gc.get_objects(generation=2)) < threshold:
        return False
    gc.collect()
    gc.freeze()
    return True


def freeze_burst() -> None:
    """Freeze (``gc.freeze``) without collecting first: for right after a burst.

    A reconcile pass that places thousands of replicas leaves hundreds of
    thousands of new objects alive across the store write that follows, where
    the collector cannot be paused; each collection the driver's allocations
    set off walked all of them again (at 10,000 nodes most of the write's
    time). Collecting first (``freeze_survivors``) would walk them once more
    for nothing: they are the pass's records, rows and events, which hold no
    cycles and are freed by reference counting when dropped. What it makes
    immortal is a reference cycle that became garbage and was not yet
    collected, and only on such a pass, which is rare (a fleet's first pass,
    a mass failure).
    """
    gc.freeze()
