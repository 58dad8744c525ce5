"""How ``llmgw ctl`` prints: tables for people, ``--json`` for scripts, ``--watch``.

``--json`` prints the admin API's own JSON as it came, so a script reads the
same fields the API documents; the tables are for people and may change.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

JsonOpt = Annotated[bool, typer.Option("--json", help="The API's JSON, for scripts.")]
WatchOpt = Annotated[float | None, typer.Option(
    "--watch", help="Refresh every N seconds until Ctrl-C.", min=0.1)]


# What a terminal would act on rather than show: C0 and C1 control codes
# (ESC starts the sequences that move the cursor, retitle the window or
# rewrite what is on screen; CR and backspace overwrite what was printed)
# and the bidirectional overrides that reorder text. Node names, reasons,
# engine errors and log lines are written by nodes and engines, which a
# rogue one fills with them. Line feeds and tabs stay, and a carriage return
# right before a line feed (CSV's line end): a refusal lists one problem per
# line, and a terminal only moves on to the next line for them.
_UNPRINTABLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]|\r(?!\n)")
SHOWN_INSTEAD = "\ufffd"


def clean(text: str) -> str:
    """``text`` with every control code but line ends and tabs replaced by U+FFFD."""
    return _UNPRINTABLE.sub(SHOWN_INSTEAD, text)


def cleaned(value: Any) -> Any:
    """An admin API answer with every string in it :func:`clean` (keys included)."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, list):
        return [cleaned(item) for item in value]
    if isinstance(value, dict):
        return {clean(str(k)): cleaned(v) for k, v in value.items()}
    return value


def make_console() -> Console:
    # markup=False: every string printed comes, at least in part, from the
    # fleet (node names, reasons, engine log lines); with markup on, a
    # "[link=...]" or "[/]" in one of them would restyle or break the output.
    # Styles are given as Text styles instead.
    return Console(highlight=False, soft_wrap=False, markup=False)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def print_answer(answer: Any, as_json: bool, line: str) -> None:
    """An admin API answer to a change: its JSON with --json, else ``line`` for people."""
    if as_json:
        print_json(answer)
    else:
        typer.echo(line)


def show_view(
    fetch: Callable[[], Any], render: Callable[[Any], Any], every: float | None
) -> None:
    """Print ``render(fetch())`` once; with ``every`` (--watch), redraw it as often until Ctrl-C."""
    console = make_console()
    if not every:
        console.print(render(fetch()))
        return
    with Live(render(fetch()), console=console, auto_refresh=False) as live, _FirstCtrlC() as stop:
        while not stop.wait(every):
            live.update(render(fetch()), refresh=True)


class _FirstCtrlC:
    """While watching, the first Ctrl-C ends the loop between refreshes; a second one interrupts.

    Python raises KeyboardInterrupt wherever the main thread happens to be: in
    the middle of a fetch that raise can land inside the HTTP client's pool
    with its lock taken, and closing the client at exit then waits on that
    lock for ever (a test saw ``status --watch`` hang after Ctrl-C on a loaded
    machine). So the first Ctrl-C only sets an event; a fetch under way
    finishes (bounded by the client's timeout) and the loop ends. A second
    Ctrl-C is the impatient user's, and gets the usual interrupt.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> threading.Event:
        def on_sigint(signum: int, frame: Any) -> None:
            if self.stop.is_set():
                raise KeyboardInterrupt
            self.stop.set()

        self._previous = signal.signal(signal.SIGINT, on_sigint)
        return self.stop

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


def ago(at: float | None) -> str:
    if at is None:
        return "never"
    return duration(max(0.0, time.time() - at)) + " ago"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def byte_size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def print_listing(
    data: list[dict[str, Any]],
    as_json: bool,
    columns: Sequence[str],
    row: Callable[[dict[str, Any]], Sequence[str]],
    empty: str,
) -> None:
    """A list from the API: its JSON, or a table of one ``row(item)`` each (``empty`` for none)."""
    if as_json:
        print_json(data)
        return
    table = new_table(*columns)
    for item in data:
        table.add_row(*row(item))
    make_console().print(table if data else empty)


def new_table(*columns: str, title: str | None = None) -> Table:
    # min_width: a title wider than a narrow table would otherwise wrap.
    table = Table(title=title, title_justify="left", box=None, header_style="bold",
                  pad_edge=False, min_width=len(title) + 1 if title else None)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def local_time(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")
