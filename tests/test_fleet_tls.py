"""A fleet over TLS on one machine: `llmgw serve --tls`, two agents, a gateway and ctl.

Real processes on loopback, as on a fleet whose network others share: the
agents have only the join token (which carries the CA's fingerprint) and
trust the control plane from their first call; the standalone gateway is
given the fingerprint and serves its own OpenAI endpoint with TLS; ctl on the
control plane's machine finds the CA in up.json. A client told another
fingerprint, or a CA that did not sign the server's certificate, is refused
with a line that says so; plain HTTP to another machine is refused unless
allowed.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tests.servers import free_port, stop_group
from tests.test_fleet_serve import spawn

from llmgw.errors import ConfigError
from llmgw.servertls import ensure_server_tls
from llmgw.tls import fingerprint, split_join_token, wants_tls

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


def wait_for(path: Path, text: str, seconds: float = 30) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in (found := path.read_text()):
            return found
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}: {path.read_text() if path.exists() else ''}")


def llmgw(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, *args], capture_output=True, text=True, timeout=timeout)


def test_serve_two_agents_a_gateway_and_ctl_over_tls(tmp_path: Path) -> None:
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    serve_log = tmp_path / "serve.log"
    procs = [spawn(["serve", "--host", "127.0.0.1", "--port", str(port), "--tls",
                    "--data-dir", str(tmp_path / "cp")], serve_log)]
    try:
        wait_for(serve_log, "Credentials")
        saved = json.loads((tmp_path / "cp" / "up.json").read_text())
        ca_file = Path(saved["ca_file"])
        fp = fingerprint(ca_file.read_bytes())
        assert saved["admin_url"] == url and saved["ca_fingerprint"] == fp
        assert split_join_token(saved["join_token"])[1] == fp
        assert fp in serve_log.read_text()  # the banner shows it (not a secret)
        join_file = tmp_path / "join-token"
        join_file.write_text(saved["join_token"] + "\n")

        # Plain HTTP to the TLS port gets nowhere; the CA verifies it.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/admin/v1/nodes", timeout=5)
        admin = httpx.Client(verify=ssl.create_default_context(cafile=str(ca_file)),
                             headers={"Authorization": f"Bearer {saved['admin_token']}"})

        # A token made by ctl (on this machine: URL, admin token and CA from
        # up.json) carries the fingerprint too.
        made = llmgw("ctl", "--data-dir", str(tmp_path / "cp"), "join-tokens", "create",
                     "--uses", "1")
        assert made.returncode == 0, made.stderr
        assert split_join_token(made.stdout.strip())[1] == fp
        second_file = tmp_path / "join-token-2"
        second_file.write_text(made.stdout)
        for name, token_file in (("tls-a", join_file), ("tls-b", second_file)):
            procs.append(spawn(
                ["agent", "--control-plane", url, "--join-token-file", str(token_file),
                 "--name", name, "--data-dir", str(tmp_path / name)],
                tmp_path / f"{name}.log"))
        # The gateway has the fingerprint only; the admin token stands in for
        # a gateway token, as an operator running a gateway by hand may.
        gw_token = tmp_path / "gw-token"
        gw_token.write_text(saved["admin_token"])
        gw_port = free_port()
        procs.append(spawn(
            ["gateway", "--control-plane", url, "--ca-hash", fp, "--token-file", str(gw_token),
             "--host", "127.0.0.1", "--port", str(gw_port), "--tls-dir", str(tmp_path / "gw")],
            tmp_path / "gw.log"))

        nodes: dict[str, dict[str, object]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer = admin.get(f"{url}/admin/v1/nodes", timeout=5)
            assert answer.status_code == 200, answer.text
            nodes = {n["name"]: n for n in answer.json()}
            if len(nodes) == 2 and all(n["state"] == "ready" and n["agent_port"]
                                       for n in nodes.values()):
                break
            time.sleep(0.5)
        assert set(nodes) == {"tls-a", "tls-b"}, nodes
        for name in nodes:  # each agent kept the CA it fetched and checked
            assert (tmp_path / name / "ca.pem").read_bytes() == ca_file.read_bytes()
        # Each agent's own server (peer weights, nudges, /metrics) listens with
        # a certificate the control plane signed with the fleet's CA.
        fleet_ca = ssl.create_default_context(cafile=str(ca_file))
        for name, node in nodes.items():
            agent_url = f"127.0.0.1:{node['agent_port']}"
            assert httpx.get(f"https://{agent_url}/metrics", verify=fleet_ca,
                             timeout=5).status_code == 200
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://{agent_url}/metrics", timeout=5)
            assert (tmp_path / name / "tls" / "node.pem").exists()
        # doctor on a node checks the control plane against the agent's CA.
        doctor = llmgw("doctor", "--control-plane", url, "--data-dir", str(tmp_path / "tls-a"),
                       "--json")
        report = json.loads(doctor.stdout)["control_plane"]
        assert report["reachable"] and report["leader"] == url, report

        # The gateway took its keys from the control plane over TLS and serves
        # its own endpoint with TLS, under a CA of its own.
        wait_for(tmp_path / "gw.log", "(TLS)")
        gw_ca = ssl.create_default_context(cafile=str(tmp_path / "gw" / "ca.pem"))
        headers = {"Authorization": f"Bearer {saved['api_key']}"}
        models = httpx.get(f"https://127.0.0.1:{gw_port}/v1/models", headers=headers,
                           verify=gw_ca, timeout=5)
        assert models.status_code == 200, models.text

        # ctl on this machine: the URL, token and CA all from up.json.
        listed = llmgw("ctl", "--data-dir", str(tmp_path / "cp"), "nodes", "--json")
        assert listed.returncode == 0, listed.stderr
        assert {n["name"] for n in json.loads(listed.stdout)} == {"tls-a", "tls-b"}
        # ctl given a CA that did not sign the server's certificate is refused.
        other = ensure_server_tls(tmp_path / "other", ["localhost"])
        refused = llmgw("ctl", "--url", url, "--token", saved["admin_token"],
                        "--ca-file", str(other.ca_file), "nodes")
        assert refused.returncode == 1
        assert "not signed by the CA this ctl trusts" in refused.stderr, refused.stderr

        # An agent whose join token names another CA stops at once, sending
        # nothing (the join token included) to the server it cannot trust.
        secret = split_join_token(saved["join_token"])[0]
        wrong = f"{secret}.{fingerprint(other.ca_file.read_bytes())}"
        bad = llmgw("agent", "--control-plane", url, "--join-token", wrong, "--name", "tls-c",
                    "--data-dir", str(tmp_path / "tls-c"))
        assert bad.returncode == 2
        assert re.search(r"presents a CA with fingerprint sha256:[0-9a-f]{64}, not", bad.stderr)
        assert not (tmp_path / "tls-c" / "ca.pem").exists()
        names = {n["name"] for n in admin.get(f"{url}/admin/v1/nodes", timeout=5).json()}
        assert "tls-c" not in names
        # A plain token (no fingerprint) on an https:// control plane: no CA to trust.
        plain = llmgw("agent", "--control-plane", url, "--join-token", secret,
                      "--name", "tls-d", "--data-dir", str(tmp_path / "tls-d"))
        assert plain.returncode == 2 and "no CA to check it against" in plain.stderr
    finally:
        for proc in reversed(procs):
            stop_group(proc, grace_s=20)


@pytest.mark.parametrize("command", [
    ["agent", "--data-dir", "{tmp}", "--join-token", "t"],
    ["gateway", "--token", "t", "--host", "127.0.0.1", "--port", "0"],
    ["ctl", "--token", "t", "--url", "http://10.255.0.1:8080", "nodes"],
])
def test_plain_http_to_another_machine_is_refused_unless_allowed(
    tmp_path: Path, command: list[str]
) -> None:
    # Refused before any connection is tried: nothing is sent to 10.255.0.1.
    args = [part.replace("{tmp}", str(tmp_path)) for part in command]
    if args[0] != "ctl":
        args += ["--control-plane", "http://10.255.0.1:8080"]
    refused = llmgw(*args)
    assert refused.returncode in (1, 2)
    assert "is plain HTTP" in refused.stderr and "--insecure-http" in refused.stderr


def test_a_gateway_on_a_network_address_needs_tls_or_the_flag() -> None:
    refused = llmgw("gateway", "--control-plane", "http://127.0.0.1:1", "--token", "t",
                    "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2
    assert "not a loopback address" in refused.stderr and "--insecure-http" in refused.stderr


def test_which_binds_use_tls_by_default() -> None:
    assert not wants_tls("127.0.0.1", tls=None, insecure_http=False)  # nothing leaves
    assert not wants_tls("::1", tls=None, insecure_http=False)
    assert wants_tls("0.0.0.0", tls=None, insecure_http=False)
    assert wants_tls("10.0.0.5", tls=None, insecure_http=False)
    assert not wants_tls("0.0.0.0", tls=None, insecure_http=True)
    assert wants_tls("127.0.0.1", tls=True, insecure_http=False)
    with pytest.raises(ConfigError, match="contradict"):
        wants_tls("127.0.0.1", tls=True, insecure_http=True)


def test_join_tokens_carry_the_fingerprint_and_old_ones_still_parse() -> None:
    fp = "sha256:" + "ab" * 32
    assert split_join_token(f"llmgw-join-x_y-z.{fp}") == ("llmgw-join-x_y-z", fp)
    assert split_join_token("llmgw-join-x_y-z") == ("llmgw-join-x_y-z", None)
    with pytest.raises(ConfigError, match="not sha256"):
        split_join_token("llmgw-join-x.sha256:beef")


def test_a_generated_certificate_is_kept_and_reissued_for_new_names(tmp_path: Path) -> None:
    first = ensure_server_tls(tmp_path, ["localhost", "127.0.0.1"])
    ca, cert = first.ca_file, first.cert_file
    assert ca is not None
    ca_pem, cert_pem = ca.read_bytes(), cert.read_bytes()
    assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600
    ensure_server_tls(tmp_path, ["127.0.0.1"])
    assert cert.read_bytes() == cert_pem  # covered already: kept
    ensure_server_tls(tmp_path, ["127.0.0.1", "cp1.example"])
    assert cert.read_bytes() != cert_pem and ca.read_bytes() == ca_pem  # same CA


def test_instances_on_one_store_share_the_fleet_ca(tmp_path: Path, pg_database_url: str) -> None:
    # A leader and a standby with data dirs of their own: one CA, so an agent
    # whose join token carries its fingerprint trusts whichever leads.
    ports = [free_port(), free_port()]
    procs = []
    try:
        for n, port in enumerate(ports):
            log = tmp_path / f"serve{n}.log"
            procs.append(spawn(["serve", "--host", "127.0.0.1", "--port", str(port), "--tls",
                                "--database-url", pg_database_url,
                                "--data-dir", str(tmp_path / f"cp{n}")], log))
            wait_for(log, "Role:")
        saved = [json.loads((tmp_path / f"cp{n}" / "up.json").read_text()) for n in (0, 1)]
        assert saved[0]["ca_fingerprint"] == saved[1]["ca_fingerprint"]
        first_ca = ssl.create_default_context(cafile=saved[0]["ca_file"])
        answer = httpx.get(f"https://127.0.0.1:{ports[1]}/healthz", verify=first_ca, timeout=5)
        assert answer.status_code == 200, answer.text
    finally:
        for proc in reversed(procs):
            stop_group(proc, grace_s=20)
