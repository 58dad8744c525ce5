"""Engines under a user of their own cannot read the agent's secrets (agent --engine-user).

Real agents, real engine processes (the stub engine, under the system's
Python: the test's own interpreter lives under /root, closed to other users),
the real supervisor and engine guard, and a real user made with useradd. The
data dir sits in a directory others may pass through: pytest's own temporary
directories are root's alone, which would hide the agent's own file modes.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane, StubAdapter
from tests.agent.test_agent import stub_model

from llmgw.agent.engines.base import EngineLaunch, LaunchContext
from llmgw.agent.engineuser import EngineUser
from llmgw.errors import ConfigError
from llmgw.wire import EngineKind, ReplicaState

ENGINE_USER = "llmgw-engine-test"
SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists(),
                                reason="starting engines under another user needs root")


@pytest.fixture(scope="module")
def engine_user() -> EngineUser:
    try:
        pwd.getpwnam(ENGINE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        ENGINE_USER], check=True)
    return EngineUser.resolve(ENGINE_USER)


@pytest.fixture
def passable() -> Iterator[Path]:
    parent = Path(tempfile.mkdtemp(prefix="llmgw-engine-user-"))
    parent.chmod(0o711)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


class SystemPythonStub(StubAdapter):
    def build(self, ctx: LaunchContext) -> EngineLaunch:
        launch = super().build(ctx)
        return EngineLaunch(argv=[SYSTEM_PYTHON, *launch.argv[1:]], env=launch.env)


def _read_as(user: EngineUser, path: Path) -> str:
    """What the engine user gets opening ``path``: "ok" or the error's name."""
    program = ("import sys\ntry:\n open(sys.argv[1], 'rb').read(1); print('ok')\n"
               "except OSError as e:\n print(type(e).__name__)")
    done = subprocess.run([SYSTEM_PYTHON, "-c", program, str(path)], capture_output=True,
                          text=True, check=True, **user.popen())
    return done.stdout.strip()


@pytest.mark.parametrize("guarded", [True, False], ids=["behind-its-guard", "alone"])
async def test_an_engine_under_its_own_user_cannot_read_the_agents_secrets(
    make_agent: AgentFactory, fake_cp: FakeControlPlane, engine_user: EngineUser,
    passable: Path, guarded: bool,
) -> None:
    data_dir = passable / "agent"
    agent = make_agent(data_dir=data_dir, engine_user=ENGINE_USER,
                       adapters={EngineKind.SIM: SystemPythonStub()})
    await fake_cp.wait_for(lambda report: True)  # registered: its key and token are on disk
    secrets = [data_dir / "agent.key", data_dir / "node.json", data_dir / "engines.json"]
    tls_key = data_dir / "tls" / "node.key"  # as the node's certificate keeps it
    agent.node_cert.directory.mkdir(exist_ok=True)
    os.chmod(agent.node_cert.directory, 0o700)
    tls_key.write_text("key")
    secrets.append(tls_key)
    args = [item for path in secrets for item in ("--try-read", str(path))]
    assignment = fake_cp.assign_one(stub_model(args=args))
    if guarded:  # a replica with an engine key is started behind its guard
        assignment = assignment.model_copy(update={"engine_key": "k" * 32})
        fake_cp.assignments["n1"] = [assignment]
    await fake_cp.wait_state(assignment.replica_id, ReplicaState.READY)

    runner = agent.replicas.runners[assignment.replica_id]
    assert runner.proc is not None
    started = psutil.Process(runner.proc.pid)
    engine = started.children()[0] if guarded else started
    assert engine.uids().real == engine.uids().effective == engine_user.uid
    assert engine.gids().real == engine_user.gid
    if guarded:  # the guard holds the node's TLS key: it stays the agent's
        assert started.uids().real == os.geteuid()
    log = (data_dir / "logs" / f"{assignment.replica_id}.log").read_text()
    assert f"uid {engine_user.uid} gid {engine_user.gid} groups []" in log  # none of the agent's
    for path in secrets:
        assert f"read {path}: PermissionError" in log, log
        assert _read_as(engine_user, path) == "PermissionError"
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o710
    assert data_dir.stat().st_gid == engine_user.gid
    log_file = data_dir / "logs" / f"{assignment.replica_id}.log"
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    if guarded:
        # The parent-death signal survived the change of user: nothing of the
        # engine is left unguarded when its guard dies.
        started.kill()
        psutil.wait_procs([engine], timeout=10)
        assert not engine.is_running()


def test_the_weights_an_engine_loads_are_made_readable_to_it(
    engine_user: EngineUser, passable: Path,
) -> None:
    data_dir = passable / "agent"
    data_dir.mkdir(mode=0o700)
    engine_user.prepare(data_dir)
    # As a copy lands: staged owner-only, renamed into place.
    model = data_dir / "weights" / "m-abc" / "snapshot"
    model.mkdir(parents=True, mode=0o700)
    os.chmod(model.parent, 0o700)
    (model / "model.gguf").write_bytes(b"GGUF")
    os.chmod(model / "model.gguf", 0o600)
    other = data_dir / "weights" / "other"
    other.mkdir(mode=0o700)
    (other / "x").write_bytes(b"x")
    assert _read_as(engine_user, model / "model.gguf") == "PermissionError"
    engine_user.grant_weights(data_dir / "weights", str(model))
    assert _read_as(engine_user, model / "model.gguf") == "ok"
    assert _read_as(engine_user, other / "x") == "PermissionError"  # only what it loads
    assert not (model / "model.gguf").stat().st_mode & 0o022  # read, never write


def test_an_engine_user_needs_a_root_agent_and_an_unprivileged_user(
    engine_user: EngineUser, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="no such user"):
        EngineUser.resolve("llmgw-nobody-here")
    with pytest.raises(ConfigError, match="unprivileged"):
        EngineUser.resolve("root")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="needs the agent to run as root"):
        EngineUser.resolve(ENGINE_USER)
