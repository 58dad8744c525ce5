"""Weights held to the control plane's record: a peer's copy that does not match it is
refused, deleted and fetched again from the origin, never used (issue 13)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot, model
from tests.agent.test_weights import (
    PAYLOAD,
    Peer,
    content,
    fake_package,
    package_source,
    peer,
    plant,
    session,
    spec_of,
    staging_is_empty,
)

from llmgw.agent.manifest import CacheEntry, FileDigest, Progress
from llmgw.agent.trust import git_blob_sha1, mismatches
from llmgw.agent.weights import WeightsCache, WeightsError
from llmgw.wire import ReplicaState, WeightsDigests, WeightsFile, WeightsSource

__all__ = ["fake_package", "peer", "session"]  # fixtures, used by name

SHA = hashlib.sha256(PAYLOAD).hexdigest()


def record(source: WeightsSource, sha256: str = SHA) -> WeightsDigests:
    files = [WeightsFile(path="tiny.gguf", size=len(PAYLOAD), sha256=sha256)]
    return WeightsDigests(source=source, origin="package", files=files, sha256=sha256)


async def test_a_rogue_peer_copy_is_refused_and_fetched_from_the_origin(
    tmp_path: Path,
    peer: Peer,
    fake_package: str,
) -> None:
    spec = spec_of(package_source(fake_package))
    # A rogue peer's copy agrees with its own manifest: only the record catches it.
    plant(peer.cache, spec, b"evil" * 1000)
    mine = WeightsCache(tmp_path / "mine")
    mine.trust({spec.name: record(spec.weights)})
    path = await peer.fetch(mine, spec)
    assert path is not None and content(path) == PAYLOAD
    [refusal] = mine.take_refusals()
    assert f"from peer {peer.url} do not match the digests recorded from package" in refusal
    assert "tiny.gguf has 4000 bytes" in refusal and "the copy was deleted" in refusal
    assert mine.take_refusals() == [] and staging_is_empty(mine)


async def test_an_extra_file_from_a_peer_is_refused(
    tmp_path: Path,
    peer: Peer,
    fake_package: str,
) -> None:
    spec = spec_of(package_source(fake_package))
    held = plant(peer.cache, spec, PAYLOAD)
    # The right weights, plus code that would ride along (trust_remote_code).
    (held.parent / "modeling.py").write_bytes(b"import os\n")
    meta = CacheEntry.model_validate_json((held.parent / "meta.json").read_bytes())
    meta.files.append(FileDigest(path="modeling.py", size=10,
                                 sha256=hashlib.sha256(b"import os\n").hexdigest()))
    (held.parent / "meta.json").write_text(meta.model_dump_json())
    mine = WeightsCache(tmp_path / "mine")
    mine.trust({spec.name: record(spec.weights)})
    path = await peer.fetch(mine, spec)
    assert path is not None and not (Path(path).parent / "modeling.py").exists()
    assert "modeling.py not in the record" in mine.take_refusals()[0]


async def test_a_cached_copy_that_does_not_match_is_replaced(
    tmp_path: Path, fake_package: str
) -> None:
    spec = spec_of(package_source(fake_package))
    mine = WeightsCache(tmp_path / "mine")
    plant(mine, spec, b"old" * 100)  # cached before the control plane had a record
    mine.trust({spec.name: record(spec.weights)})
    path = await mine.ensure(spec, progress=Progress())
    assert path is not None and content(path) == PAYLOAD
    assert "cached weights of 'tiny' do not match" in mine.take_refusals()[0]
    assert mine.report()[0].sha256 == SHA and mine.report()[0].source == spec.weights


async def test_an_origin_copy_that_does_not_match_is_refused(
    tmp_path: Path, fake_package: str
) -> None:
    spec = spec_of(package_source(fake_package))
    mine = WeightsCache(tmp_path / "mine")
    mine.trust({spec.name: record(spec.weights, sha256="0" * 64)})
    with pytest.raises(WeightsError, match="from the origin do not match"):
        await mine.ensure(spec, progress=Progress())
    assert mine.report() == [] and mine.lookup(spec) is None and staging_is_empty(mine)


async def test_a_record_of_another_source_is_not_applied(
    tmp_path: Path, fake_package: str
) -> None:
    spec = spec_of(package_source(fake_package))
    mine = WeightsCache(tmp_path / "mine")
    other = WeightsSource(kind="package", package="another-package")
    mine.trust({spec.name: record(other, sha256="0" * 64)})
    path = await mine.ensure(spec, progress=Progress())
    assert path is not None and content(path) == PAYLOAD


def test_files_kept_in_git_are_checked_by_their_blob_id(tmp_path: Path) -> None:
    source = WeightsSource(kind="hf", repo="org/m", revision="abc")
    (tmp_path / "config.json").write_bytes(b"hello\n")
    entry = CacheEntry(model="m", source=source, files=[
        FileDigest(path="config.json", size=6, sha256=hashlib.sha256(b"hello\n").hexdigest())
    ])
    # `git hash-object` of "hello\n", as the Hub lists it.
    blob = "ce013625030ba8dba906f756967f9e9ca394464a"
    assert git_blob_sha1(tmp_path / "config.json") == blob
    good = WeightsDigests(source=source, origin="hub",
                          files=[WeightsFile(path="config.json", size=6, git_sha1=blob)])
    assert mismatches(entry, good, tmp_path) == []
    (tmp_path / "config.json").write_bytes(b"HELLO\n")
    assert mismatches(entry, good, tmp_path) == [f"config.json has git blob"
        f" {git_blob_sha1(tmp_path / 'config.json')}, not {blob}"]



async def test_an_agent_refuses_a_rogue_peer_and_says_so_in_its_report(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, fake_package: str
) -> None:
    source = package_source(fake_package)
    spec = model("sim", name="tiny", weights=source, gpu_classes=["cpu"])
    rogue = make_agent("n1")
    await fake_cp.wait_for(lambda r: r.node == "n1")
    plant(rogue.weights, spec, b"evil" * 1000)
    make_agent("n2")
    await fake_cp.wait_for(lambda r: r.node == "n2")
    assert rogue.server is not None
    peer_url = f"http://127.0.0.1:{rogue.server.port}"
    fake_cp.weight_peers = {"tiny": [peer_url]}
    fake_cp.weight_digests = {"tiny": record(source)}
    fake_cp.assignments["n2"] = [assign(spec, [cpu_slot(0)], node="n2")]
    await fake_cp.wait_state("r1", ReplicaState.READY)
    # Sent once, with the report after the refusal (before the replica was ready).
    [refused] = [m for r in fake_cp.reports if r.node == "n2" for m in r.weights_refused]
    assert f"from peer {peer_url} do not match" in refused
    held = await fake_cp.wait_for(lambda r: r.node == "n2" and bool(r.weights))
    assert held.weights[0].sha256 == SHA  # the origin's copy
