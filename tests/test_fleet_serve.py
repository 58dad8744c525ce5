"""A fleet on one machine: `llmgw serve` and two `llmgw agent` processes.

Separate processes and data dirs talking over loopback, as on a real fleet:
the join token is read from serve's output, each agent registers once, gets
its own node token, and keeps reporting.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from tests.servers import free_port, stop_group
from tests.waiting import eventually_sync

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([*LLMGW, *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def test_serve_and_two_agents_register_and_report(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_log = tmp_path / "serve.log"
    procs = [spawn(["serve", "--host", "127.0.0.1", "--port", str(port),
                    "--trust-reported-fabrics",  # the agents' --fabric decides
                    "--data-dir", str(tmp_path / "cp")], serve_log)]
    try:
        up_json = tmp_path / "cp" / "up.json"
        eventually_sync(lambda: "Credentials" in serve_log.read_text(), 30,
                        "serve to write its credentials", every_s=0.2)
        saved = json.loads(up_json.read_text())
        join, admin_token = saved["join_token"], saved["admin_token"]
        assert join.startswith("llmgw-join-") and oct(up_json.stat().st_mode & 0o777) == "0o600"
        # No secret on stdout (the journal, under systemd): only where they are.
        log_text = serve_log.read_text()
        assert str(up_json) in log_text
        for secret in (join, admin_token, saved["api_key"]):
            assert secret not in log_text
        join_file = tmp_path / "join-token"
        join_file.write_text(join + "\n")

        for name, fabric in (("gpu-node-a", "ib-a"), ("gpu-node-b", "ib-b")):
            procs.append(spawn(
                ["agent", "--control-plane", url, "--join-token-file", str(join_file),
                 "--name", name,
                 "--fabric", fabric, "--data-dir", str(tmp_path / name), "--cpu-slots", "2"],
                tmp_path / f"{name}.log",
            ))
        headers = {"Authorization": f"Bearer {admin_token}"}

        def listed() -> dict[str, dict[str, Any]]:
            answer = httpx.get(f"{url}/admin/v1/nodes", headers=headers, timeout=5)
            assert answer.status_code == 200, answer.text
            return {n["name"]: n for n in answer.json()}

        def both_ready() -> dict[str, dict[str, Any]] | None:
            seen = listed()
            return seen if len(seen) == 2 and all(
                n["state"] == "ready" for n in seen.values()) else None

        nodes = eventually_sync(both_ready, 60, "both nodes ready", every_s=0.5, note=listed)
        assert set(nodes) == {"gpu-node-a", "gpu-node-b"}, nodes
        assert nodes["gpu-node-a"]["fabrics"] == ["ib-a"]
        assert nodes["gpu-node-b"]["fabrics"] == ["ib-b"]
        for name in nodes:
            # The node token is on the node, owner-only; the control plane has its hash.
            identity = tmp_path / name / "node.json"
            assert oct(identity.stat().st_mode & 0o777) == "0o600"
            # Reports keep coming: last_seen moves.
        first_seen = {n: nodes[n]["last_seen"] for n in nodes}

        def reported_again() -> bool:
            now = listed()
            return all(now[n]["last_seen"] > first_seen[n] for n in first_seen)

        eventually_sync(reported_again, 15, "a later report from each node", every_s=0.5,
                        note=listed)
    finally:
        for proc in reversed(procs):
            stop_group(proc, grace_s=20)
