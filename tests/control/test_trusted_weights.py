"""Trusted weights on the control plane: each model's digests are recorded once (from its
origin, else the first copy of a node given the model) and a node's word that it holds a
model makes it no one's weight source (issue 13)."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from tests.agent.fakes import serve_app
from tests.control.planekit import Plane, inventory, register, report_ok

from llmgw.control import weightdigests
from llmgw.control.plane import ControlPlane
from llmgw.control.state import ReplicaRecord
from llmgw.wire import (
    AgentReport,
    ModelSpec,
    ShardAssignment,
    WeightsEntry,
    WeightsFile,
    WeightsSource,
)

SHA = hashlib.sha256(b"the real weights").hexdigest()
BOGUS = hashlib.sha256(b"a rogue's weights").hexdigest()


@pytest.fixture
def origin_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WeightsSource:
    """A weights package installed where the control plane runs, shipping its digest."""
    pkg = tmp_path / "site" / "llmgw_test_trusted_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'MODEL_NAME = "tiny.gguf"\nEXPECTED_SHA256 = "{SHA}"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("llmgw_test_trusted_pkg", None)
    return WeightsSource(kind="package", package="llmgw-test-trusted-pkg")


async def _report(client: httpx.AsyncClient, url: str, token: str, report: AgentReport
                  ) -> dict[str, object]:
    body: dict[str, object] = (await report_ok(client, url, token, report)).json()
    return body


def holding(node: str, source: WeightsSource, sha256: str, port: int) -> AgentReport:
    return AgentReport(node=node, inventory=inventory(node), agent_port=port,
                       weights=[WeightsEntry(model="m", source=source, sha256=sha256)])


async def _model_on_n2(cp: ControlPlane, source: WeightsSource) -> None:
    await cp.catalog.put([ModelSpec(name="m", engine="sim", weights=source)])
    cp.state.replicas["r1"] = ReplicaRecord(id="r1", model="m", created_at=0.0,
                                            shards=[ShardAssignment(node="n2")])


async def test_a_rogue_node_is_no_weight_source_for_a_model_it_was_not_given(
    plane: Plane, origin_package: WeightsSource
) -> None:
    cp, _, url = plane
    await _model_on_n2(cp, origin_package)
    async with httpx.AsyncClient() as client:
        # Anyone with the join token: a fake agent on loopback with a valid node token.
        rogue = await register(client, url, plane.join, "n1")
        await _report(client, url, rogue, holding("n1", origin_package, BOGUS, 9999))
        honest = await register(client, url, plane.join, "n2")
        ask = AgentReport(node="n2", inventory=inventory("n2"))
        await _report(client, url, honest, ask)
        await cp.digests.settled()
        answer = await _report(client, url, honest, ask)
        assert answer["weight_peers"] == {}
        assert answer["weight_digests"] == {"m": {
            "source": origin_package.model_dump(mode="json"), "origin": "package",
            "files": [{"path": "tiny.gguf", "size": None, "sha256": SHA, "git_sha1": None}],
            "sha256": SHA, "node": None}}
        # Its report says nothing the record does not: the rogue stays out,
        # whatever else it claims to hold.
        await _report(client, url, rogue, AgentReport(
            node="n1", inventory=inventory("n1"), agent_port=9999,
            weights=[WeightsEntry(model="m", sha256=SHA)]))
        assert (await _report(client, url, honest, ask))["weight_peers"] == {}
        # Nor does placement (which prefers nodes holding a model) or the
        # summary count what the record refutes.
        await _report(client, url, rogue, holding("n1", origin_package, BOGUS, 9999))
        assert cp.state.nodes["n1"].weights == []
        # A node whose copy is the recorded one is a peer (and its copy is
        # still verified by whoever reads it: llmgw.agent.trust).
        holder = await register(client, url, plane.join, "n3")
        await _report(client, url, holder, holding("n3", origin_package, SHA, 9998))
        answer = await _report(client, url, honest, ask)
        assert answer["weight_peers"] == {"m": ["http://127.0.0.1:9998"]}
        assert [w.sha256 for w in cp.state.nodes["n3"].weights] == [SHA]
    events = [e["message"] for e in await cp.store.list_events(kind="model")]
    assert "weights of m recorded from the package (1 files)" in events


async def test_without_an_origin_only_a_node_given_the_model_is_trusted_first(
    plane: Plane,
) -> None:
    cp, _, url = plane
    source = WeightsSource(kind="package", package="llmgw-not-installed-anywhere")
    await _model_on_n2(cp, source)
    async with httpx.AsyncClient() as client:
        honest = await register(client, url, plane.join, "n2")
        ask = AgentReport(node="n2", inventory=inventory("n2"))
        await _report(client, url, honest, ask)
        await cp.digests.settled()  # the origin could not be read
        rogue = await register(client, url, plane.join, "n1")
        await _report(client, url, rogue, holding("n1", source, BOGUS, 9999))
        answer = await _report(client, url, honest, ask)
        assert answer["weight_digests"] == {} and answer["weight_peers"] == {}
        answer = await _report(client, url, honest, holding("n2", source, SHA, 9998))
        digests = answer["weight_digests"]
        assert isinstance(digests, dict)
        assert digests["m"]["origin"] == "first-fetch" and digests["m"]["sha256"] == SHA
        assert digests["m"]["node"] == "n2"
    events = [e["message"] for e in await cp.store.list_events(kind="model")]
    assert any("trusted on first use: node n2's copy" in e for e in events)
    await cp.load()  # kept across a restart
    assert cp.digests.records["m"].sha256 == SHA


async def test_a_refused_copy_becomes_an_event_naming_the_peer(plane: Plane) -> None:
    cp, _, url = plane
    message = ("weights of 'm' from peer http://10.0.0.9:7000 do not match the digests"
               " recorded from hub (m.gguf has 4 bytes, not 9); the copy was deleted")
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n2")
        await _report(client, url, token, AgentReport(
            node="n2", inventory=inventory("n2"), weights_refused=[message]))
    events = await cp.store.list_events(kind="node", subject="n2")
    assert f"node n2: {message}" in [e["message"] for e in events]


async def test_the_hub_record_holds_lfs_digests_and_git_blob_ids() -> None:
    # The Hub's answer for a pinned revision, as huggingface_hub asks for it
    # (files_metadata): LFS files with their sha256, git files with their blob id.
    gguf = hashlib.sha256(b"gguf").hexdigest()
    answer = {"id": "org/m", "sha": "a" * 40, "siblings": [
        {"rfilename": "m.gguf", "size": 4, "blobId": "b" * 40,
         "lfs": {"sha256": gguf, "size": 4, "pointerSize": 130}},
        {"rfilename": "config.json", "size": 6,
         "blobId": "ce013625030ba8dba906f756967f9e9ca394464a"},
    ]}
    asked: list[str] = []

    async def model_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/api/models/org/m/revision/{rev}", model_info)
    async with serve_app(app) as url:
        whole = WeightsSource(kind="hf", repo="org/m", revision="abc")
        record = await asyncio.to_thread(weightdigests.from_origin, whole, url)
        one = WeightsSource(kind="hf", repo="org/m", revision="abc", file="m.gguf")
        single = await asyncio.to_thread(weightdigests.from_origin, one, url)
    assert asked == ["/api/models/org/m/revision/abc"] * 2
    assert record is not None and record.origin == "hub" and record.sha256 is None
    assert record.files == [
        WeightsFile(path="m.gguf", size=4, sha256=gguf),
        WeightsFile(path="config.json", size=6,
                    git_sha1="ce013625030ba8dba906f756967f9e9ca394464a"),
    ]
    # One LFS file: its digest is the entry's, as the agent computes it.
    assert single is not None and single.sha256 == gguf
    assert single.files == [WeightsFile(path="m.gguf", size=4, sha256=gguf)]
