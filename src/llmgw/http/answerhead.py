"""An answer's head as uvicorn writes it, made without uvicorn's per-header loop.

uvicorn's send checks each header of an answer against two regexes,
lower-cases it and compares its name three times, in Python, the date and
server headers included (~300 interpreter steps for a gateway answer's six
headers). llmgw's server (llmgw.http.cycle) writes the same bytes
with two shortcuts, both here: the server's default headers rendered once
per list (:class:`DefaultHead`), and each set of header names an app
answers with checked once per process (:func:`names_fit`); an answer they
do not cover goes through a copy of uvicorn's loop, which raises its errors.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

# Response header names uvicorn's send acts on: a list of default headers
# naming one is written by the full loop.
_ACTED_ON = (b"content-length", b"transfer-encoding", b"connection")


class DefaultHead:
    """The server's default headers (date, server) as head bytes, made once per list.

    uvicorn replaces ``server_state.default_headers`` with a new list each
    second (the date) and checks and writes every entry of it on every
    answer; here a list is turned into bytes the first time an answer meets
    it. The list held here cannot be freed, so its identity is a safe key.
    """

    __slots__ = ("block", "headers")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.block: bytes | None = None

    def of(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The bytes of ``headers``, or None if uvicorn's loop must write them."""
        if headers is not self.headers:
            self.headers = headers
            self.block = self._render(headers)
        return self.block

    @staticmethod
    def _render(headers: list[tuple[bytes, bytes]]) -> bytes | None:
        lines = []
        for name, value in headers:
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                return None
            name = name.lower()
            if name in _ACTED_ON:
                return None
            lines.append(name + b": " + value + b"\r\n")
        return b"".join(lines)


# What a tuple of header names means to an answer's head: the index of the
# first content-length (-1: none), or UNFIT for names the full loop must
# write (upper case, invalid, or one uvicorn acts on besides content-length).
# An app answers with a few sets of names, so checking each set once (and
# not each answer's names) is the usual case: callers look the names up in
# NAMES_SEEN themselves and call names_fit only for a set not seen yet.
UNFIT = -2
NAMES_SEEN: dict[tuple[bytes, ...], int] = {}
_NAMES_KEPT = 256


def names_fit(names: tuple[bytes, ...]) -> int:
    """What ``names`` mean to an answer's head (see NAMES_SEEN), remembered if there is room."""
    joined = b"".join(names)
    if (
        HEADER_RE.search(joined)  # one character: the same as a search of each name
        or not joined.islower()  # uvicorn writes names lower-cased
        or b"transfer-encoding" in names
        or b"connection" in names
    ):
        at = UNFIT
    else:
        at = names.index(b"content-length") if b"content-length" in names else -1
    if len(NAMES_SEEN) < _NAMES_KEPT and all(type(name) is bytes for name in names):
        NAMES_SEEN[names] = at
    return at
