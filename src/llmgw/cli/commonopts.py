"""Options that several ``llmgw`` commands take, declared once so that their help cannot drift.

``--control-plane`` is how ``agent``, ``gateway`` and ``sim fleet`` find the fleet;
``--allow-key-env`` is the same rule wherever a gateway serves (``up``,
``serve``, ``gateway``): which variables an external model may name as its
key (llmgw.gateway.external).
"""

from __future__ import annotations

import typer

CONTROL_PLANE_OPTION = typer.Option(
    envvar="LLMGW_CONTROL_PLANE",
    help="Control plane URL, or several comma-separated (leader and standbys).",
)
ALLOW_KEY_ENV_OPTION = typer.Option(
    "--allow-key-env", help="An environment variable an external model's api_key_env may name"
    " besides LLMGW_EXTERNAL_* (repeatable): its value goes to that model's URLs.")
