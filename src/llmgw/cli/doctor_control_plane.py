"""``llmgw doctor --control-plane URL[,URL...]``: does each instance answer, and which leads.

With a leader and standbys (docs/install.md, "Two control-plane instances"),
"the control plane answers" is not enough: a node whose agent reaches only
standbys that know no leader cannot register or report, and two instances
that both say they lead do not share one database. Each instance is asked
for ``/healthz`` (its role and epoch) and a standby for ``/healthz/leader``,
whose refusal names the leader it read from the store.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmgw.errors import ConfigError
from llmgw.failover import standby_hint
from llmgw.tls import CA_CERT, client_context
from llmgw.wire import LEADER_HEADER

CONTROL_PLANE_TIMEOUT_S = 3.0


def _instance(url: str, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """One control-plane instance: does it answer, and as leader or standby."""
    state: dict[str, Any] = {"url": url, "reachable": False, "role": None,
                             "leader_named": None, "detail": ""}
    if not url.startswith(("http://", "https://")):
        state["detail"] = "not an http:// or https:// URL"
        return state
    status, body, _ = _get(url + "/healthz", context)
    if status is None:
        state["detail"] = f"no answer: {body.decode(errors='replace')}"
        return state
    state["reachable"] = True
    facts = _json_object(body) if status == 200 else {}
    if not isinstance(facts.get("leader"), bool):
        # It answered: that is what an agent needs first. Not an llmgw control
        # plane, or one from before leader election; either way, no role to show.
        state["detail"] = f"HTTP {status}"
        return state
    epoch = facts.get("epoch")
    if facts["leader"]:
        state.update(role="leader", detail=f"leader (epoch {epoch})")
        return state
    state["role"] = "standby"
    # /healthz does not say who leads; a standby's refusal of /healthz/leader
    # names the leader it read from the store.
    status, body, headers = _get(url + "/healthz/leader", context)
    _, hint = standby_hint(status or 0, {LEADER_HEADER: headers.get(LEADER_HEADER.lower(), "")},
                           body)
    state["leader_named"] = hint
    state["detail"] = "standby" + (f" (leader: {hint})" if hint else " (no leader known)")
    return state


def _get(
    url: str, context: ssl.SSLContext | None = None
) -> tuple[int | None, bytes, dict[str, str]]:
    """(status, body, headers) of a GET; (None, why, {}) when nothing answered.

    Header names come lower-cased: HTTP's are case-insensitive and servers
    differ in how they spell them.
    """
    try:
        with urllib.request.urlopen(url, timeout=CONTROL_PLANE_TIMEOUT_S,
                                    context=context) as answer:
            return answer.status, answer.read(), _lower(answer.headers.items())
    except urllib.error.HTTPError as exc:  # it answered: reachable, whatever it said
        return exc.code, exc.read(), _lower(exc.headers.items())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, str(getattr(exc, "reason", exc)).encode(), {}


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in items}


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def probe_control_plane(value: str, ca_file: Path | None = None) -> dict[str, Any]:
    """Every instance of ``--control-plane URL[,URL...]``, and which of them leads.

    ``ca_file``: the fleet's CA (the agent's ``ca.pem``) for https:// instances.
    """
    urls = [part.strip().rstrip("/") for part in value.split(",") if part.strip()]
    if not urls:
        raise ConfigError("--control-plane: no control plane URL given")
    context = client_context(ca_file) if ca_file is not None else None
    instances = [_instance(url, context) for url in dict.fromkeys(urls)]
    leaders = [i["url"] for i in instances if i["role"] == "leader"]
    return {
        "url": ",".join(i["url"] for i in instances),
        "reachable": any(i["reachable"] for i in instances),
        # The one instance that says it leads; None for none (or, wrongly, several).
        "leader": leaders[0] if len(leaders) == 1 else None,
        "detail": "; ".join(
            i["detail"] if len(instances) == 1 else f"{i['url']}: {i['detail']}"
            for i in instances
        ),
        "instances": instances,
    }


def agent_ca(data_dir: Path) -> Path | None:
    """The CA an agent on this data dir fetched and checked (llmgw.tls), if it has one."""
    path = data_dir / CA_CERT
    return path if path.is_file() else None


def judge_leadership(instances: list[dict[str, Any]], warn: Callable[[str], None]) -> bool:
    """Warn when the instances given do not show exactly one leader; True when none leads.

    Only instances that reported a role count: an instance that answered
    without one (not an llmgw control plane, or an older one) says nothing
    either way.
    """
    leaders = [i["url"] for i in instances if i["role"] == "leader"]
    standbys = [i for i in instances if i["role"] == "standby"]
    if len(leaders) > 1:
        warn(f"{len(leaders)} control-plane instances say they lead ({', '.join(leaders)}): "
             "they do not share one database, or one has just lost its lock")
    if leaders or not standbys:
        return False
    named = sorted({i["leader_named"] for i in standbys if i["leader_named"]})
    if named:
        warn(f"no control-plane instance given is the leader; the standbys name "
             f"{', '.join(named)}: agents do not follow a leader they were not given: add it")
        return False
    warn("no control-plane instance is the leader, and no standby knows one: agents cannot "
         "register or report until one takes over")
    return True
