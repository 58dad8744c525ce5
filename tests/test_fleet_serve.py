"""A fleet on one machine: `llmgw serve` and two `llmgw agent` processes.

Separate processes and data dirs talking over loopback, as on a real fleet:
the join token is read from serve's output, each agent registers once, gets
its own node token, and keeps reporting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.servers import free_port

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([*LLMGW, *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_and_two_agents_register_and_report(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_log = tmp_path / "serve.log"
    procs = [spawn(["serve", "--host", "127.0.0.1", "--port", str(port),
                    "--trust-reported-fabrics",  # the agents' --fabric decides
                    "--data-dir", str(tmp_path / "cp")], serve_log)]
    try:
        up_json = tmp_path / "cp" / "up.json"
        deadline = time.monotonic() + 30
        while "Credentials" not in serve_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
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
        nodes: dict[str, dict[str, object]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer = httpx.get(f"{url}/admin/v1/nodes", headers=headers, timeout=5)
            assert answer.status_code == 200, answer.text
            nodes = {n["name"]: n for n in answer.json()}
            if len(nodes) == 2 and all(n["state"] == "ready" for n in nodes.values()):
                break
            time.sleep(0.5)
        assert set(nodes) == {"gpu-node-a", "gpu-node-b"}, nodes
        assert nodes["gpu-node-a"]["fabrics"] == ["ib-a"]
        assert nodes["gpu-node-b"]["fabrics"] == ["ib-b"]
        for name in nodes:
            # The node token is on the node, owner-only; the control plane has its hash.
            identity = tmp_path / name / "node.json"
            assert oct(identity.stat().st_mode & 0o777) == "0o600"
            # Reports keep coming: last_seen moves.
        first_seen = {n: nodes[n]["last_seen"] for n in nodes}
        time.sleep(6)
        later = {n["name"]: n["last_seen"] for n in
                 httpx.get(f"{url}/admin/v1/nodes", headers=headers, timeout=5).json()}
        assert all(later[n] > first_seen[n] for n in nodes)  # type: ignore[operator]
    finally:
        for proc in reversed(procs):
            stop(proc)
