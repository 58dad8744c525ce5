"""Weights checked against what the control plane recorded, before any engine loads them.

A peer's manifest only says what the peer claims: a rogue node serving its
fabric can make its files and its manifest agree. What the control plane
recorded from the origin (the Hub's LFS digests at the pinned revision, the
digest a package ships) or from the first copy it trusted is the one
reference every copy is held to: a file missing, extra or different refuses
the whole copy (an extra file is how code would ride along, e.g. for
``trust_remote_code``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llmgw.agent.manifest import HASH_BLOCK, CacheEntry, WeightsError
from llmgw.wire import WeightsDigests

# How many file names a refusal lists before it only counts the rest.
NAMED_FILES = 5


class TamperedWeights(WeightsError):
    """A copy that does not match the recorded digests; never used, always deleted."""


def git_blob_sha1(path: Path) -> str:
    """The id git (and so the Hub) gives a file it stores without LFS."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def mismatches(entry: CacheEntry, expected: WeightsDigests, root: Path) -> list[str]:
    """What differs between a copy under ``root`` and the record; empty when it matches.

    ``entry.files`` carry digests of the bytes on disk (the fetchers hash
    what they wrote), so only git blob ids need the files read again.
    """
    if entry.source != expected.source:
        return ["it is of another source or revision"]
    problems: list[str] = []
    if expected.files is not None:
        got = {f.path: f for f in entry.files}
        wanted = {f.path: f for f in expected.files}
        problems += [f"{p} missing" for p in sorted(wanted.keys() - got.keys())]
        problems += [f"{p} not in the record" for p in sorted(got.keys() - wanted.keys())]
        for path in sorted(wanted.keys() & got.keys()):
            want, have = wanted[path], got[path]
            if want.size is not None and want.size != have.size:
                problems.append(f"{path} has {have.size} bytes, not {want.size}")
            elif want.sha256 is not None and want.sha256 != have.sha256:
                problems.append(f"{path} has sha256 {have.sha256}, not {want.sha256}")
            elif want.sha256 is None and want.git_sha1 is not None:
                blob = git_blob_sha1(root / path)
                if blob != want.git_sha1:
                    problems.append(f"{path} has git blob {blob}, not {want.git_sha1}")
    if expected.sha256 is not None and not problems and entry.sha256 != expected.sha256:
        problems.append(f"its digest is {entry.sha256}, not {expected.sha256}")
    return problems


def check(entry: CacheEntry, expected: WeightsDigests, root: Path, where: str) -> None:
    """Raise TamperedWeights naming ``where`` the copy came from, unless it matches."""
    problems = mismatches(entry, expected, root)
    if not problems:
        return
    shown = "; ".join(problems[:NAMED_FILES])
    if len(problems) > NAMED_FILES:
        shown += f"; and {len(problems) - NAMED_FILES} more"
    raise TamperedWeights(
        f"weights of {entry.model!r} from {where} do not match the digests recorded"
        f" from {expected.origin} ({shown}); the copy was deleted"
    )
