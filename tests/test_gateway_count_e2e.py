"""How many gateways route, as real processes tell the control plane (control/gateway_count.py).

`llmgw serve` runs a gateway of its own; a standalone `llmgw gateway`
following it over HTTP is a second. The routing table every gateway reads
(GET /gateway/v1/config) must say 1 while serve's is alone -- that is what
lets it place new prefixes by load -- 2 once the standalone one reports, and
1 again once that one has been gone for the staleness window, so the gateway
left behind goes back to placing by load instead of by hash for good.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
from tests.servers import free_port, stop_group
from tests.waiting import eventually_sync

from llmgw.control.gateway_count import SETTLE_S
from llmgw.control.inflight import STALE_AFTER_S

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*LLMGW, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_the_routing_table_counts_serves_gateway_and_a_standalone_one(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_log = tmp_path / "serve.log"
    serve = spawn(
        ["serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "cp")],
        serve_log,
    )
    gateway: subprocess.Popen[bytes] | None = None
    try:
        eventually_sync(
            lambda: "Credentials" in serve_log.read_text(),
            30,
            "serve to write its credentials",
            every_s=0.2,
        )
        admin_token = json.loads((tmp_path / "cp" / "up.json").read_text())["admin_token"]
        headers = {"Authorization": f"Bearer {admin_token}"}
        seen: list[int] = []

        def gateways() -> int:
            answer = httpx.get(
                f"{url}/gateway/v1/config", params={"after": -1}, headers=headers, timeout=5
            )
            assert answer.status_code == 200, answer.text
            count = int(answer.json()["routing"]["gateways"])
            if not seen or seen[-1] != count:
                seen.append(count)
            return count

        def settle_to(count: int, within_s: float) -> None:
            eventually_sync(
                lambda: gateways() == count,
                within_s,
                f"the table to count {count} gateway(s)",
                every_s=0.2,
                note=lambda: f"{seen}; serve log: {serve_log.read_text()[-1500:]}",
            )

        # Serve's own gateway, once reports have come in for the settling time.
        settle_to(1, SETTLE_S + 20)
        token_file = tmp_path / "admin.token"
        token_file.write_text(admin_token)
        token_file.chmod(0o600)
        gateway_log = tmp_path / "gateway.log"
        gateway = spawn(
            [
                "gateway",
                "--control-plane",
                url,
                "--token-file",
                str(token_file),
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
            ],
            gateway_log,
        )
        settle_to(2, 30)
        stop_group(gateway)
        assert gateway.returncode == 0, gateway_log.read_text()[-2000:]
        settle_to(1, STALE_AFTER_S + 15)
        # Never "not known" (0) again once settled, nor anything but 1 and 2.
        assert seen[seen.index(1) :] == [1, 2, 1], seen
    finally:
        if gateway is not None:
            stop_group(gateway)
        stop_group(serve)
