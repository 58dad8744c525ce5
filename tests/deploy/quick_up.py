"""``llmgw up`` with the fleet's clocks shortened, for tests that watch alerts fire.

The real command, unchanged but for three constants a fleet needs minutes
to show otherwise: nodes report every second and are unreachable after 4 s
without one (not 5 s and 30 s), and a model is parked after 2 failed starts
with a 1 s backoff (not 5 starts from 5 s doubling: over a minute).

    python -m tests.deploy.quick_up up --sim fleet.yaml ...
"""

from __future__ import annotations

import dataclasses
from typing import Any

import llmgw.control.services.agents as agents_service
import llmgw.control.state as state
from llmgw.cli.main import main
from llmgw.control.plane import ControlPlane

REPORT_INTERVAL_S = 1.0
UNREACHABLE_AFTER_S = 4.0


def shorten() -> None:
    agents_service.REPORT_INTERVAL_S = REPORT_INTERVAL_S
    state.UNREACHABLE_AFTER_S = UNREACHABLE_AFTER_S
    # The control plane holds the Policy its reconciler (and the admin plan)
    # read: give each one built here the shortened parking and backoff.
    build = ControlPlane.__init__

    def quick(self: ControlPlane, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        self.policy = dataclasses.replace(self.policy, failure_limit=2, backoff_base_s=1.0)

    ControlPlane.__init__ = quick  # type: ignore[method-assign]


if __name__ == "__main__":
    shorten()
    main()
