"""Bad configuration ends with one line naming the problem and exit code 2.

Each case runs the real ``llmgw`` command as a subprocess: the promise is
about what a person sees (no traceback) and what is left behind (nothing).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def assert_one_line_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("llmgw: ") and needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_unknown_database_scheme(tmp_path: Path) -> None:
    result = run("up", "--data-dir", str(tmp_path), "--database-url", "mysql://x/y")
    assert_one_line_error(result, "scheme 'mysql' is not supported")
    assert not (tmp_path / "llmgw.db").exists()


def test_unreachable_postgres(tmp_path: Path) -> None:
    result = run("serve", "--data-dir", str(tmp_path), "--port", "0",
                 "--database-url", "postgresql://postgres@127.0.0.1:1/nothing")
    assert_one_line_error(result, "cannot open the store")


def test_unwritable_data_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run("up", "--data-dir", str(blocker / "data"))
    assert_one_line_error(result, "is not writable")


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run("up", "--data-dir", str(tmp_path), "--port", str(port))
    assert_one_line_error(result, f"port {port} on 127.0.0.1 is already in use")
    # Checked before the store was opened: nothing was written.
    assert not (tmp_path / "llmgw.db").exists()


def test_missing_model_file(tmp_path: Path) -> None:
    catalog = tmp_path / "models.yaml"
    catalog.write_text(
        "- name: mine\n  engine: llamacpp\n  weights: {kind: local, path: /nonexistent/m.gguf}\n"
    )
    result = run("up", "--data-dir", str(tmp_path / "d"), "--catalog", str(catalog))
    assert_one_line_error(result, "weights file /nonexistent/m.gguf does not exist")
    assert not (tmp_path / "d" / "llmgw.db").exists()


def test_missing_catalog_file(tmp_path: Path) -> None:
    result = run("up", "--data-dir", str(tmp_path), "--catalog", str(tmp_path / "none.yaml"))
    assert_one_line_error(result, "cannot read catalog")


@pytest.mark.parametrize("flag", ["--port", "--cpu-slots"])
def test_nonsense_numbers_are_usage_errors(tmp_path: Path, flag: str) -> None:
    result = run("up", "--data-dir", str(tmp_path), flag, "many")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_advertise_url_without_a_scheme(tmp_path: Path) -> None:
    result = run("serve", "--data-dir", str(tmp_path), "--advertise-url", "cp1.example:8080")
    assert_one_line_error(result, "--advertise-url 'cp1.example:8080' must start with http://")
    assert not (tmp_path / "llmgw.db").exists()


@pytest.mark.parametrize("command", ["agent", "gateway"])
def test_control_plane_list_with_a_bad_url(tmp_path: Path, command: str) -> None:
    extra = ["--data-dir", str(tmp_path)] if command == "agent" else ["--token", "t"]
    result = run(command, "--control-plane", "http://cp1:8080,cp2:8080", *extra)
    assert_one_line_error(result, "control plane URL 'cp2:8080' must start with http://")


def test_data_dir_of_a_running_up(tmp_path: Path) -> None:
    # Held as a running `up` holds it: a second `up` on the same data dir
    # stops before anything starts (it used to run on as a standby, rewrite
    # up.json to its own port and, on stopping, kill the first one's engine).
    from llmgw.cli.upchecks import DataDirLock

    held = DataDirLock(tmp_path)
    try:
        # The lock is checked first: a catalog that cannot be read would fail
        # next (and keeps the code before the lock from starting an engine).
        result = run("up", "--data-dir", str(tmp_path), "--catalog", str(tmp_path / "no.yaml"))
        assert_one_line_error(
            result, f"another `llmgw up` (pid {os.getpid()}) is running with the data dir"
        )
        assert not (tmp_path / "llmgw.db").exists()
        assert not (tmp_path / "up.json").exists()
    finally:
        held.release()
    DataDirLock(tmp_path).release()  # free again once the first one is gone
