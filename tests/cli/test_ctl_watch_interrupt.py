"""Ctrl-C during ``ctl ... --watch`` ends the loop only between refreshes.

Python raises KeyboardInterrupt wherever the main thread is: landing inside
a fetch, it once left the HTTP client's pool lock taken (the pool does not
release it on an exception at that point), and the exit then hung closing
the client. Here the fetch takes such a lock the same way and the Ctrl-C
arrives while it is held.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from llmgw.cli.ctl.render import show_view


def test_a_ctrl_c_during_a_fetch_lets_it_finish_and_ends_the_watch() -> None:
    pool_lock = threading.Lock()
    fetched = 0

    def fetch() -> int:
        nonlocal fetched
        pool_lock.acquire()
        if fetched == 2:
            # The Ctrl-C, mid-fetch: delivered to this (the main) thread.
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        fetched += 1
        pool_lock.release()  # not in a finally, as in the pool
        return fetched

    before = signal.getsignal(signal.SIGINT)
    show_view(fetch, str, every=0.1)  # returns: no KeyboardInterrupt
    assert fetched == 3
    assert not pool_lock.locked()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_interrupts() -> None:
    sent = 0

    def fetch() -> str:
        nonlocal sent
        if sent < 2 and threading.current_thread() is threading.main_thread():
            sent += 1
            if sent == 2:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
        return "view"

    with pytest.raises(KeyboardInterrupt):
        show_view(fetch, str, every=0.1)
