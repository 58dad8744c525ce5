"""A process's own figures on request: ``kill -USR1 PID`` writes one line to its stderr.

A leak in a long-running part shows as memory, file descriptors or asyncio
tasks that only grow. RSS and descriptors can be read from outside (``ps``,
``/proc``); asyncio tasks cannot: they exist only inside the event loop, and
a task that is never awaited or cancelled (a watch per lost connection, a
timer per request) is the leak asyncio programs have. So every long-running
llmgw process (``serve``, ``up``, ``gateway``, ``agent``, ``sim fleet``, the
sim engine) answers SIGUSR1 with one line::

    llmgw-procstats {"part": "gateway", "pid": 4242, "rss_bytes": ..., "open_files": ...,
                     "asyncio_tasks": ..., "threads": ..., "gc_objects": ...,
                     "top_tasks": [["Gateway._flush_loop", 1], ...]}

Why a signal and not an admin route: the simulated fleet and an agent that
serves no weights have no HTTP server, and a route on the gateway's port would
be one more thing on the request path to guard. A signal reaches only what the
operating system lets through (the process's own user, or root), costs
nothing until it is sent, and works the same in every part. The line goes to
stderr directly, not through logging, so that a quiet log level cannot swallow
an answer that was asked for (as the Go runtime's SIGQUIT dump does).

With ``LLMGW_TRACEMALLOC=N`` in its environment, the first SIGUSR1 also
starts tracing allocations (N frames each), and every later line carries
``allocation_growth``: the allocation sites holding the most memory allocated
since that first signal, as ``[site, KiB, blocks]``. In a process past its
warm-up that is what it kept, so the code holding on to memory tops the list,
and signals minutes apart show whether it keeps growing. Tracing from a
signal rather than from start-up (``PYTHONTRACEMALLOC``, which works too but
then counts the imports) keeps start-up's hundreds of thousands of blocks
out of every snapshot, which then takes milliseconds, not minutes of a
loaded process's loop.

The figures are taken on the event loop between callbacks, so the task count
is exact. ``gc_objects`` walks the heap (tens of milliseconds in a large
process), which is paid only when someone asks. A process that has not yet
installed the handler (still starting) dies of SIGUSR1, as any program does:
send it to processes that are up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import tracemalloc
from typing import Any

MARKER = "llmgw-procstats"
SIGNAL = signal.SIGUSR1
TOP_TASKS = 8
TOP_SITES = 12
TRACE_ENV = "LLMGW_TRACEMALLOC"
SITE_FRAMES = 4


def rss_bytes() -> int | None:
    """Resident memory now (Linux ``/proc/self/statm``); None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def open_files() -> int | None:
    """Open file descriptors (sockets and pipes included), without the one used to count."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return None


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return str(getattr(coro, "__qualname__", None) or type(coro).__name__)


def allocations_held() -> list[list[Any]] | None:
    """Memory allocated since tracing began and still held, by site; None when not tracing.

    Tracing starts at the first call when ``LLMGW_TRACEMALLOC`` asks for it,
    so a snapshot holds only what was allocated since and survived: in a
    process in a steady state, its growth, with nothing to compare against.
    """
    if not tracemalloc.is_tracing():
        frames = _wanted_frames()
        if frames:
            tracemalloc.start(frames)
            return []  # tracing from now on; the next line shows what stays
        return None
    # What is being counted right now (this function's own objects) is not growth.
    current = tracemalloc.take_snapshot().filter_traces((
        tracemalloc.Filter(False, tracemalloc.__file__, all_frames=True),
        tracemalloc.Filter(False, __file__, all_frames=True),
    ))
    key = "traceback" if tracemalloc.get_traceback_limit() > 1 else "lineno"
    return [[_site(s.traceback), round(s.size / 1024, 1), s.count]
            for s in current.statistics(key)[:TOP_SITES]]


def _wanted_frames() -> int:
    try:
        return max(0, min(int(os.environ.get(TRACE_ENV, "0")), 100))
    except ValueError:
        return 0


def _site(traceback: tracemalloc.Traceback) -> str:
    # Innermost first: where the memory was allocated, then who asked. Deep
    # in a library the allocating lines say little, so after the innermost
    # frame come llmgw's own frames, where there are any: the code to fix.
    frames = list(reversed(traceback))
    ours = [f for f in frames[1:] if f"{os.sep}llmgw{os.sep}" in f.filename]
    shown = [frames[0], *ours][:SITE_FRAMES] if ours else frames[:SITE_FRAMES]
    return " <- ".join(f"{f.filename.rsplit(os.sep, 1)[-1]}:{f.lineno}" for f in shown)


def snapshot(part: str) -> dict[str, Any]:
    """The figures of this process; call it on the event loop's thread."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no running loop: a plain thread asked
        tasks = set()
    # Grouped by coroutine, so a growing count names what grows.
    by_name = collections.Counter(_coro_name(t) for t in tasks)
    stats: dict[str, Any] = {
        "part": part,
        "pid": os.getpid(),
        "rss_bytes": rss_bytes(),
        "open_files": open_files(),
        "asyncio_tasks": len(tasks),
        "threads": threading.active_count(),
        "gc_objects": len(gc.get_objects()),
        "top_tasks": [[name, count] for name, count in by_name.most_common(TOP_TASKS)],
    }
    held = allocations_held()
    if held is not None:
        stats["allocation_growth"] = held
    return stats


def format_line(stats: dict[str, Any]) -> str:
    return f"{MARKER} {json.dumps(stats, separators=(',', ':'))}\n"


def parse_line(line: str) -> dict[str, Any] | None:
    """The figures from one line of a process's stderr, or None if it is not such a line."""
    head, _, body = line.strip().partition(" ")
    if head != MARKER:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _write(part: str) -> None:
    # stderr may be closed or a full pipe; an answer nobody reads is no
    # reason to disturb the process.
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(format_line(snapshot(part)))
        sys.stderr.flush()


def install(part: str) -> bool:
    """Answer SIGUSR1 on the running loop from now on; False where that is not possible.

    Not possible: off the main thread (an embedded server in a test), or on a
    platform without the signal. The loop removes the handler when it closes.
    """
    try:
        asyncio.get_running_loop().add_signal_handler(SIGNAL, _write, part)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        return False
    return True
