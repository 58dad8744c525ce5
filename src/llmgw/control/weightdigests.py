"""What each model's weights must be: the record every copy in the fleet is held to.

Without it, an agent copying weights from a peer can check them only against
the peer's own manifest, and a node counts as holding a model on its own
word: one rogue node (anyone given a join token) becomes the weight source
for a model across its fabric. So the control plane records each model's
digests once, from the best witness it can reach:

1. ``hub``: the Hub's file list at the catalog's revision (LFS files carry
   their sha256, files kept in git their blob id);
2. ``package``: the digest a weights package ships for the file it
   assembles (``EXPECTED_SHA256``, itself covered by pip's RECORD hashes),
   read from the package installed where the control plane runs;
3. ``first-fetch``: neither could be read (no Hub access from the control
   plane, the package not installed there): the first copy that a node
   *assigned the model* reports, trusted on first use and said so in the
   events. An origin record read later replaces it.

Agents verify every copy against the record (llmgw.agent.trust), and only
nodes whose reported copy matches it are offered as weight peers
(llmgw.control.reports.weight_peers).

The records are one JSON document under the ``weight_digests`` setting
(a few hundred bytes per model; no schema change).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import re
from collections.abc import Awaitable, Callable

import orjson
from pydantic import TypeAdapter

from llmgw.control.state import FleetState, NodeRecord
from llmgw.wire import AgentReport, WeightsDigests, WeightsEntry, WeightsFile, WeightsSource

log = logging.getLogger("llmgw.control.weightdigests")

SETTING = "weight_digests"
# A Hub answer slower than this is no answer: the record falls back to the
# first fetch rather than hold a model's replicas back.
HUB_TIMEOUT_S = 15.0
_PACKAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_RECORDS = TypeAdapter(dict[str, WeightsDigests])


def parse(document: str | None) -> dict[str, WeightsDigests]:
    if not document:
        return {}
    try:
        return _RECORDS.validate_json(document)
    except ValueError:
        log.error("the stored weight digests do not parse; recording them again")
        return {}


def dump(records: dict[str, WeightsDigests]) -> str:
    return orjson.dumps(
        {name: r.model_dump(mode="json", exclude_none=True) for name, r in sorted(records.items())}
    ).decode()


def entry_digest(files: list[WeightsFile]) -> str | None:
    """The digest of a whole entry, as the agent computes it (manifest.CacheEntry.sha256).

    None when a file's sha256 is unknown (a Hub file kept in git).
    """
    if any(f.sha256 is None or f.size is None for f in files) or not files:
        return None
    if len(files) == 1:
        return files[0].sha256
    lines = "".join(f"{f.sha256}  {f.size}  {f.path}\n" for f in sorted(files, key=_path))
    return hashlib.sha256(lines.encode()).hexdigest()


def _path(item: WeightsFile) -> str:
    return item.path


def from_origin(source: WeightsSource, hf_endpoint: str | None = None) -> WeightsDigests | None:
    """The origin's own digests (blocking: run it in a thread); None when unreadable."""
    try:
        if source.kind == "hf":
            return _from_hub(source, hf_endpoint)
        if source.kind == "package":
            return _from_package(source)
    except Exception as exc:  # any failure means "fall back to the first fetch"
        log.warning("cannot read the digests of %s weights %s: %s",
                    source.kind, source.repo or source.package, exc)
    return None


def _from_hub(source: WeightsSource, endpoint: str | None) -> WeightsDigests | None:
    from huggingface_hub import HfApi  # heavy, only when used

    # None: HF_ENDPOINT or the public Hub, as for the agents' downloads.
    info = HfApi(endpoint=endpoint).model_info(
        source.repo or "", revision=source.revision, files_metadata=True, timeout=HUB_TIMEOUT_S
    )
    files: list[WeightsFile] = []
    for sibling in info.siblings or []:
        if source.file is not None and sibling.rfilename != source.file:
            continue
        lfs = sibling.lfs
        if lfs is not None:
            files.append(WeightsFile(path=sibling.rfilename, size=lfs.size, sha256=lfs.sha256))
        elif sibling.blob_id:
            files.append(
                WeightsFile(path=sibling.rfilename, size=sibling.size, git_sha1=sibling.blob_id)
            )
        else:
            return None  # a file the Hub vouches nothing for: no origin record
    if not files:
        return None
    return WeightsDigests(source=source, origin="hub", files=files, sha256=entry_digest(files))


def _from_package(source: WeightsSource) -> WeightsDigests | None:
    name = source.package or ""
    if not _PACKAGE_RE.match(name):
        return None
    module = importlib.import_module(name.replace("-", "_"))
    expected = getattr(module, "EXPECTED_SHA256", None)
    if not isinstance(expected, str) or not _SHA256_RE.match(expected):
        return None
    path = source.file or str(getattr(module, "MODEL_NAME", "model.gguf"))
    files = [WeightsFile(path=path, sha256=expected)]
    return WeightsDigests(source=source, origin="package", files=files, sha256=expected)


def first_fetch(node: str, entry: WeightsEntry) -> WeightsDigests | None:
    """A record from a node's reported copy (trust on first use), when it says enough."""
    if entry.source is None or entry.sha256 is None or not _SHA256_RE.match(entry.sha256):
        return None
    return WeightsDigests(
        source=entry.source, origin="first-fetch", sha256=entry.sha256, node=node
    )


def matches(record: WeightsDigests, entry: WeightsEntry) -> bool | None:
    """Whether a reported copy is the recorded one; None when the record cannot say.

    A Hub record with files kept in git has no whole-entry digest to compare
    a report's with (the Hub gives their blob ids, not their sha256).
    """
    if entry.source != record.source:
        return False
    if record.sha256 is None:
        return None
    return entry.sha256 == record.sha256


# (kind, subject, message) -> one event.
Event = Callable[[str, str, str], Awaitable[None]]
# The records' JSON document -> stored (a fenced write: the leader's only).
Save = Callable[[str], Awaitable[None]]
CACHED_KINDS = frozenset({"hf", "package"})
REFUSAL_CHARS = 1000
REFUSALS_PER_REPORT = 8


class DigestBook:
    """The control plane's records, how they are made, and who gets them.

    Origin lookups run in the background (a Hub answer takes seconds) and
    once per source per control-plane process; a model assigned before its
    lookup ends is fetched by agents from its origin, with no peers offered,
    which is no weaker than the control plane's own read of that origin.
    """

    def __init__(self, save: Save, event: Event) -> None:
        self.records: dict[str, WeightsDigests] = {}
        self._save = save
        self._event = event
        # Sources (as JSON) whose origin lookup ran or runs in this process.
        self._looked_up: set[str] = set()
        self._origin_failed: set[str] = set()
        # Each model's source as JSON, with the source object it was made
        # from: every report asked for its models' (a pydantic dump each,
        # 1 % of a 10,000-node control plane's CPU), and sources change only
        # with the catalog.
        self._keys: dict[str, tuple[WeightsSource, str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def load(self, document: str | None) -> None:
        self.records = parse(document)
        self._looked_up.clear()
        self._origin_failed.clear()

    def current(self, state: FleetState, model: str) -> WeightsDigests | None:
        """The record of the model's catalog source, if there is one."""
        record = self.records.get(model)
        spec = state.models.get(model)
        if record is None or spec is None or record.source != spec.spec.weights:
            return None
        return record

    def vouched(self, state: FleetState, entries: list[WeightsEntry]) -> list[WeightsEntry]:
        """The holdings of a report that placement, peers and views may believe.

        A node that says it holds a model attracts its replicas (placement
        prefers nodes holding the weights), serves it to peers and sizes its
        RAM estimate: a copy of another source, or one the record refutes,
        counts for none of these. Models outside the catalog attract nothing.
        """
        out: list[WeightsEntry] = []
        for entry in entries:
            model = state.models.get(entry.model)
            if model is not None:
                source = model.spec.weights
                if entry.source is not None and entry.source != source:
                    continue
                record = self.records.get(entry.model)
                if record is not None and record.source == source and matches(
                    record, entry
                ) is False:
                    continue
            out.append(entry)
        return out

    def for_node(self, state: FleetState, node: NodeRecord) -> dict[str, WeightsDigests]:
        """The records of the models assigned to the node (its report answer carries them)."""
        out: dict[str, WeightsDigests] = {}
        for replica in state.replicas.on_node(node.name):
            if replica.model not in out:
                record = self.current(state, replica.model)
                if record is not None:
                    out[replica.model] = record
        return out

    def look_up(self, state: FleetState, models: set[str]) -> None:
        """Start reading the origin's digests of these models, where not done yet."""
        for name in sorted(models):
            model = state.models.get(name)
            if model is None or model.spec.weights.kind not in CACHED_KINDS:
                continue
            record = self.current(state, name)
            source = model.spec.weights
            if record is not None and record.origin != "first-fetch":
                continue
            key = self._key(name, source)
            if key in self._looked_up:
                continue
            self._looked_up.add(key)
            task = asyncio.create_task(self._look_up(name, source, key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _key(self, model: str, source: WeightsSource) -> str:
        kept = self._keys.get(model)
        if kept is not None and kept[0] is source:
            return kept[1]
        key = source.model_dump_json()
        self._keys[model] = (source, key)
        return key

    async def _look_up(self, model: str, source: WeightsSource, key: str) -> None:
        try:
            record = await asyncio.to_thread(from_origin, source)
            if record is None:
                self._origin_failed.add(key)
                return
            before = self.records.get(model)
            self.records[model] = record
            await self._save(dump(self.records))
            count = len(record.files or [])
            message = f"weights of {model} recorded from the {record.origin} ({count} files)"
            if before is not None and before.source == source and before.sha256 not in (
                None, record.sha256
            ):
                message += (f"; the copy trusted on first use (from node {before.node})"
                            " does not match them and will be refused")
            await self._event("model", model, message)
        except Exception:  # a lost lead or store: the next process looks again
            log.exception("recording the weight digests of %s", model)

    async def take_report(self, state: FleetState, node: NodeRecord, report: AgentReport) -> None:
        """Events for copies the node refused; a first-fetch record where no origin answered."""
        # A few per report: a rogue agent may report as often as it likes.
        for message in report.weights_refused[:REFUSALS_PER_REPORT]:
            # The agent's words: kept to one line of sane length.
            text = " ".join(message.split())[:REFUSAL_CHARS]
            await self._event("node", node.name, f"node {node.name}: {text}")
        assigned = {r.model for r in state.replicas.on_node(node.name)}
        self.look_up(state, assigned)
        changed = False
        for entry in report.weights:
            spec = state.models.get(entry.model)
            if (
                entry.model not in assigned
                or spec is None
                or entry.source != spec.spec.weights
                or self.current(state, entry.model) is not None
                or self._key(entry.model, spec.spec.weights) not in self._origin_failed
            ):
                continue
            record = first_fetch(node.name, entry)
            if record is None:
                continue
            self.records[entry.model] = record
            changed = True
            await self._event(
                "model", entry.model,
                f"weights of {entry.model} trusted on first use: node {node.name}'s copy"
                f" (sha256 {record.sha256}), since their origin's digests could not be read",
            )
        if changed:
            await self._save(dump(self.records))

    async def settled(self) -> None:
        """Wait for the origin lookups started so far (tests, an orderly stop)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
