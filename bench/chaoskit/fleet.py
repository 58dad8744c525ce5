"""A fleet on loopback as an operator runs it: serve (leader and standby), a gateway, agents.

Separate processes and data dirs: ``llmgw serve`` instances on one
PostgreSQL database (each names the other with ``--peer-url``), one
standalone ``llmgw gateway`` following every instance, and ``llmgw agent``
processes with CPU slots running real engine processes (simulated ones and
llama.cpp). The admin token stands in for a gateway token (docs/security.md).

``whole()`` is the suite's definition of a fleet that is whole again: every
model has what it should have now, every replica is ready, no node is
unreachable but those the fault left dead, nothing parked or unplaceable,
and every agent that should be up has reported since the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from chaoskit.admin import Admin
from chaoskit.procs import Proc, engine_children, free_port, kill_all, orphan_engines


@dataclass
class Credentials:
    admin_token: str
    api_key: str
    api_key_id: str
    join_token: str


@dataclass
class Fleet:
    root: Path
    database_url: str
    nodes: dict[str, int]  # name -> CPU slots
    control_planes: int = 2
    # Weights dirs on a tmpfs of this size (MiB) for these nodes: a real
    # filesystem that can really fill up (the disk_full fault).
    weights_tmpfs_mib: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    serves: list[Proc] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    gateway: Proc | None = None
    gateway_url: str = ""
    agents: dict[str, Proc] = field(default_factory=dict)
    creds: Credentials | None = None
    admin: Admin | None = None
    _mounts: list[Path] = field(default_factory=list)

    # -- start -------------------------------------------------------------------

    async def start(self) -> None:
        ports = [free_port() for _ in range(self.control_planes)]
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        for index, port in enumerate(ports):
            self.serves.append(self._serve_proc(index, port))
        self.serves[0].start()
        self.creds = await self._credentials(self.root / "cp0" / "up.json")
        self.admin = Admin(self.urls, self.creds.admin_token)
        await self._wait(lambda: self._leads(self.urls[0]), 60, "serve 0 leading")
        for proc in self.serves[1:]:
            proc.start()
        token_file = self.root / "gateway-token"
        token_file.write_text(self.creds.admin_token)
        token_file.chmod(0o600)
        join_file = self.root / "join-token"
        join_file.write_text(self.creds.join_token)
        join_file.chmod(0o600)
        gw_port = free_port()
        self.gateway_url = f"http://127.0.0.1:{gw_port}"
        self.gateway = Proc("gateway", [
            "gateway", "--control-plane", ",".join(self.urls), "--token-file", str(token_file),
            "--host", "127.0.0.1", "--port", str(gw_port), "--log-level", "warning",
            "--open-metrics",  # the run reads its per-model figures
        ], self.root / "gateway.log", self.env)
        self.gateway.start()
        for name, slots in self.nodes.items():
            self.agents[name] = self._agent_proc(name, slots, join_file)
            self.agents[name].start()
        await self.wait_nodes_ready(set(self.nodes), timeout_s=90)

    def _serve_proc(self, index: int, port: int) -> Proc:
        peers = [u for i, u in enumerate(self.urls) if i != index]
        argv = ["serve", "--host", "127.0.0.1", "--port", str(port),
                "--advertise-url", self.urls[index], "--data-dir", str(self.root / f"cp{index}"),
                "--database-url", self.database_url, "--log-level", "warning"]
        for peer in peers:
            argv += ["--peer-url", peer]
        return Proc(f"serve{index}", argv, self.root / f"serve{index}.log", self.env)

    def _agent_proc(self, name: str, slots: int, join_file: Path) -> Proc:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        size = self.weights_tmpfs_mib.get(name)
        weights = data_dir / "weights"
        if size and weights not in self._mounts:
            weights.mkdir(exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m,mode=0700", "tmpfs",
                            str(weights)], check=True)
            self._mounts.append(weights)
        return Proc(name, [
            "agent", "--control-plane", ",".join(self.urls), "--join-token-file", str(join_file),
            "--name", name, "--data-dir", str(data_dir), "--cpu-slots", str(slots),
            # A clean stop takes the engines along; a kill -9 (the faults) cannot.
            "--stop-engines", "--log-level", "warning",
        ], self.root / f"{name}.log", self.env)

    def weights_dir(self, node: str) -> Path:
        return self.root / node / "weights"

    async def _credentials(self, up_json: Path) -> Credentials:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                saved = json.loads(await asyncio.to_thread(up_json.read_text))
                return Credentials(saved["admin_token"], saved["api_key"],
                                   await self._key_id(saved), saved["join_token"])
            if not self.serves[0].alive():
                raise RuntimeError(f"serve exited:\n{self.serves[0].tail()}")
            await asyncio.sleep(0.2)
        raise RuntimeError(f"no credentials in {up_json}:\n{self.serves[0].tail()}")

    async def _key_id(self, saved: dict[str, Any]) -> str:
        # up.json names the key's secret only; its id is in the key list.
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                try:
                    answer = await http.get(
                        f"{self.urls[0]}/admin/v1/keys",
                        headers={"Authorization": f"Bearer {saved['admin_token']}"})
                    if answer.status_code == 200:
                        keys = answer.json()
                        return str(next(k["key_id"] for k in keys if k["name"] == "first key"))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)

    async def _leads(self, url: str) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(f"{url}/healthz")).json().get("leader") is True
        except (httpx.HTTPError, ValueError):
            return False

    async def _wait(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await predicate():
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{what}: not within {timeout_s:g} s\n{self.logs()}")

    # -- views -------------------------------------------------------------------

    @property
    def api(self) -> Admin:
        assert self.admin is not None
        return self.admin

    async def summary(self) -> dict[str, Any] | None:
        return await self.api.leader_get("/summary")

    async def node_views(self) -> dict[str, dict[str, Any]]:
        nodes = await self.api.leader_get("/nodes") or []
        return {n["name"]: n for n in nodes}

    async def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        replicas = await self.api.leader_get("/replicas") or []
        return [r for r in replicas if model is None or r["model"] == model]

    async def whole(self, *, dead: set[str] | None = None, resumed: set[str] | None = None,
                    since: float = 0.0, gone: set[str] | None = None,
                    also: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """``dead``: nodes the fault left dead (unreachable in a whole fleet); ``resumed``:
        agents restarted or resumed, which must have reported after ``since``
        (time.monotonic(); one back within the unreachable grace never shows as
        unreachable); ``gone``: replicas whose engines died, which must no longer
        be called ready (right after a kill the summary cannot know yet)."""
        dead = dead or set()
        if also is not None and not await also():
            return False
        if gone and any(r["id"] in gone and r["state"] == "ready" for r in await self.replicas()):
            return False
        summary = await self.summary()
        if summary is None:
            return False
        nodes, replicas, models = summary["nodes"], summary["replicas"], summary["models"]
        if not (nodes["unreachable"] == len(dead) and nodes["draining"] == 0
                and models["short"] == 0
                and not summary["parked"] and not summary["unplaceable"]
                and all(replicas[s] == 0 for s in
                        ("starting", "failed", "draining", "unreachable"))):
            return False
        if not resumed:
            return True
        views = await self.node_views()
        wall_since = time.time() - (time.monotonic() - since)
        return all((views.get(name, {}).get("last_seen") or 0) > wall_since for name in resumed)

    async def wait_whole(self, timeout_s: float, **kwargs: Any) -> float | None:
        """time.monotonic() when the fleet was first seen whole, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.whole(**kwargs):
                return time.monotonic()
            await asyncio.sleep(0.25)
        return None

    async def wait_nodes_ready(self, names: set[str], timeout_s: float) -> None:
        async def ready() -> bool:
            views = await self.node_views()
            return all(views.get(n, {}).get("state") == "ready" for n in names)

        await self._wait(ready, timeout_s, f"nodes {sorted(names)} ready")

    # -- operations ------------------------------------------------------------------

    async def apply(self, specs: list[dict[str, Any]]) -> None:
        answer = await self.api.call("POST", "/apply", {"models": specs})
        if answer.status_code != 200:
            raise RuntimeError(f"apply: {answer.status_code} {answer.text}")

    async def restart_serve(self, index: int) -> None:
        proc = self.serves[index]
        proc.stop()
        proc.start()

        async def answers() -> bool:
            try:
                async with httpx.AsyncClient(timeout=2) as http:
                    return (await http.get(f"{self.urls[index]}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await self._wait(answers, 60, f"serve {index} answering again")

    def logs(self, lines: int = 15) -> str:
        procs = [*self.serves, *([self.gateway] if self.gateway else []),
                 *self.agents.values()]
        return "\n".join(f"--- {p.name}\n{p.tail(lines)}" for p in procs)

    # -- stop ----------------------------------------------------------------------

    async def close(self) -> None:
        if self.admin is not None:
            await self.admin.close()
        # Agents first, each with its engines (they outlive a plain stop).
        engines = []
        for proc in self.agents.values():
            if proc.alive():
                engines += engine_children(proc.pid)
        for proc in [*self.agents.values(), *([self.gateway] if self.gateway else []),
                     *self.serves]:
            proc.stop()
        kill_all(engines)
        kill_all(orphan_engines(self.root))
        for mount in self._mounts:
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(mount)], check=False)


def create_database(admin_url: str) -> str:
    """A fresh database on the PostgreSQL at ``admin_url``; returns its URL."""
    name = f"llmgw_chaos_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = admin_url.rpartition("/")
    return f"{base}/{name}"


def drop_database(admin_url: str, database_url: str) -> None:
    name = database_url.rpartition("/")[2].split("?")[0]
    with contextlib.suppress(psycopg.Error), psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
