"""What the engine's process does between the guard's fork and its exec.

The engine guard (agent.engineguard) starts the engine as its child. Two
things happen in the child first: it takes the engine user where the agent
has one (agent.engineuser; uvloop's subprocess_exec takes no user or group
arguments), and it asks the kernel for SIGTERM when the guard goes away, so
nothing of an engine is left unguarded. In that order: the kernel clears the
parent-death signal when the user changes. Standard library only, as the
guard's process is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the engine's process before exec: SIGTERM when the guard goes away."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def engine_start(user: pwd.struct_passwd | None) -> Callable[[], None]:
    """The child's steps before exec: become ``user`` (in its own group alone, none of
    the guard's), then :func:`die_with_parent`."""
    if user is None:
        return die_with_parent

    def start() -> None:
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
        die_with_parent()

    return start
