"""Sim engines as a process (how the agent starts them) and from the typer command."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

from typer.testing import CliRunner

from llmgw.cli.sim import app


def start(*args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "llmgw.sim.engine", "--host", "127.0.0.1", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_module_serves_until_sigterm() -> None:
    params = json.dumps({"startup_s": 0, "decode_ms_per_token": 1})
    proc = start("--port", "0", "--model", "tiny", "--params-json", params, "--count", "2")
    try:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().split()[-1] for _ in range(2)]
        assert all(u.startswith("http://127.0.0.1:") for u in urls) and urls[0] != urls[1]
        for url in urls:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                assert json.load(resp)["data"][0]["id"] == "tiny"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def exit_and_stderr(*args: str) -> tuple[int, str]:
    """How the engine module, started with ``args``, exits at once, and what it says."""
    proc = start(*args)
    try:
        code = proc.wait(10)
        assert proc.stderr is not None
        return code, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_module_exits_1_on_fail_at_start() -> None:
    params = json.dumps({"startup_s": 0.1, "fault": "fail_at_start"})
    code, stderr = exit_and_stderr("--model", "tiny", "--params-json", params)
    assert code == 1 and "failed at start" in stderr


def test_module_refuses_bad_params_with_exit_2() -> None:
    code, stderr = exit_and_stderr("--model", "tiny", "--params-json", '{"kv_blocks": 0}')
    assert code == 2 and "kv_blocks must be > 0" in stderr


def test_typer_command_refuses_bad_flags() -> None:
    result = CliRunner().invoke(app, ["engine", "--fault", "bogus"])
    assert result.exit_code == 2
    assert "fault" in result.output
    result = CliRunner().invoke(app, ["engine", "--params-json", '{"nope": 1}'])
    assert result.exit_code == 2
    assert "nope" in result.output
