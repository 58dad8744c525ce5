"""``llmgw ctl``: the admin API from a terminal.

Tables for people, ``--json`` for scripts (the admin API's own JSON, as it
came), ``--watch`` where a screen that refreshes saves re-typing.

Where to connect and with what, first found wins: ``--url``/``--token``,
then ``LLMGW_URL``/``LLMGW_ADMIN_TOKEN``, then ``up.json`` in the data dir
(written by ``llmgw up`` and ``llmgw serve``), then http://127.0.0.1:8080.

A control plane that cannot be reached, or refuses the token, is one line
on stderr and exit code 1: someone typing ``ctl status`` during an incident
needs the reason, not a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import httpx
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from llmgw.config import default_data_dir

DEFAULT_URL = "http://127.0.0.1:8080"
ADMIN_PREFIX = "/admin/v1"
# Long enough for a summary of a large fleet on a busy control plane, short
# enough that a black-holed address fails while someone is still looking.
REQUEST_TIMEOUT_S = 15.0
EXIT_ERROR = 1

app = typer.Typer(
    name="ctl",
    help="Operate a running llmgw: fleet status, nodes, models, replicas, keys.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
ctl = app

P = ParamSpec("P")
R = TypeVar("R")


class CtlError(Exception):
    """A problem to show as one line (exit code 1)."""


# -- where to connect --------------------------------------------------------------


@dataclass
class Settings:
    url: str | None = None
    token: str | None = None
    data_dir: Path | None = None


def _up_json(data_dir: Path | None) -> dict[str, Any]:
    path = (data_dir or default_data_dir()) / "up.json"
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        raise CtlError(f"{path} is not valid JSON; remove it or pass --url and --token") from None
    return data if isinstance(data, dict) else {}


class AdminClient:
    """The admin API over HTTP; every failure becomes a CtlError with one line."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/").removesuffix(ADMIN_PREFIX)
        self._http = httpx.Client(
            base_url=self.base_url + ADMIN_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=REQUEST_TIMEOUT_S,
        )

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, *, body: Any = None,
             params: dict[str, Any] | None = None) -> Any:
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, json=body, params=clean)
        except httpx.TimeoutException:
            raise CtlError(f"the control plane at {self.base_url} did not answer within "
                           f"{REQUEST_TIMEOUT_S:g} s") from None
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise CtlError(f"cannot reach the control plane at {self.base_url}: {reason}") from None
        if response.status_code == 401:
            raise CtlError(f"the control plane at {self.base_url} refused the admin token "
                           "(pass --token, set LLMGW_ADMIN_TOKEN, or check up.json)")
        if response.status_code >= 400:
            raise CtlError(_error_text(response))
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise CtlError(f"{self.base_url} answered {path} with something that is not JSON; "
                           "is this an llmgw control plane?") from None


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        first = response.text.strip().splitlines()[0] if response.text.strip() else ""
        message = f"HTTP {response.status_code} {first[:200]}".strip()
    return str(message)


def _client(ctx: typer.Context) -> AdminClient:
    settings: Settings = ctx.obj or Settings()
    url, token = settings.url, settings.token
    if not url or not token:
        up = _up_json(settings.data_dir)
        url = url or up.get("admin_url") or DEFAULT_URL
        token = token or up.get("admin_token")
    if not token:
        raise CtlError("no admin token: pass --token, set LLMGW_ADMIN_TOKEN, "
                       "or run `llmgw up` (it writes one to up.json)")
    return AdminClient(str(url), str(token))


def guarded(fn: Callable[P, R]) -> Callable[P, R]:
    """One line and exit code 1 for any CtlError."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except CtlError as exc:
            typer.echo(f"llmgw ctl: {exc}", err=True)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(
        envvar="LLMGW_URL", help="Control plane base URL, e.g. http://127.0.0.1:8080.")] = None,
    token: Annotated[str | None, typer.Option(
        envvar="LLMGW_ADMIN_TOKEN", help="The admin token.")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        envvar="LLMGW_DATA_DIR", help="Where up.json is (default: llmgw's data dir).")] = None,
) -> None:
    ctx.obj = Settings(url=url, token=token, data_dir=data_dir)


JsonOpt = Annotated[bool, typer.Option("--json", help="The API's JSON, for scripts.")]
WatchOpt = Annotated[float | None, typer.Option(
    "--watch", help="Refresh every N seconds until Ctrl-C.", min=0.1)]


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def _watch(fetch: Callable[[], Any], render: Callable[[Any], Any], every: float) -> None:
    console = _console()
    with Live(render(fetch()), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(every)
                live.update(render(fetch()), refresh=True)
        except KeyboardInterrupt:
            pass


# -- formatting helpers -------------------------------------------------------------


def _ago(at: float | None) -> str:
    if at is None:
        return "never"
    return _duration(max(0.0, time.time() - at)) + " ago"


def _duration(seconds: float | None) -> str:
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


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(*columns: str, title: str | None = None) -> Table:
    # min_width: a title wider than a narrow table would otherwise wrap.
    table = Table(title=title, title_justify="left", box=None, header_style="bold",
                  pad_edge=False, min_width=len(title) + 1 if title else None)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _when(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")


# -- status ---------------------------------------------------------------------------


def _status_view(data: dict[str, Any]) -> Group:
    s, models = data["summary"], data["models"]
    n, r, m = s["nodes"], s["replicas"], s["models"]
    parts: list[Any] = [
        Text.from_markup(
            f"[bold]Nodes[/]     {n['total']} total: {n['ready']} ready, {n['cordoned']} cordoned, "
            f"{n['draining']} draining, {n['unreachable']} unreachable"),
        Text.from_markup(
            f"[bold]Replicas[/]  {r['ready']} ready, {r['starting']} starting, "
            f"{r['draining']} draining, {r['failed']} failed"),
        Text.from_markup(
            f"[bold]Models[/]    {m['total']} total: {m['satisfied']} satisfied, "
            f"{m['short']} short"),
        Text(""),
    ]
    devices = _table("CLASS", "TOTAL", "USED", "FREE", "UNHEALTHY", title="Devices by class")
    for g in s["gpus"]:
        devices.add_row(g["class"], str(g["total"]), str(g["used"]), str(g["free"]),
                        str(g["unhealthy"]))
    parts += [devices if s["gpus"] else Text("Devices: none reported"), Text("")]
    if s["fabrics"]:
        fabrics = _table("FABRIC", "NODES", "WITH WEIGHTS", "MODELS", "FREE BLOCK",
                         title="Fabrics")
        for f in s["fabrics"]:
            fabrics.add_row(f["fabric"], str(f["nodes"]), str(f["nodes_with_weights"]),
                            str(f["models_present"]), str(f["largest_free_block"]))
        parts += [fabrics, Text("")]
    reasons = {mv["name"]: mv.get("reason") for mv in models}
    if s["unplaceable"]:
        parts.append(Text("Unplaceable", style="bold red"))
        for name in s["unplaceable"]:
            why = reasons.get(name) or "short of replicas, none starting"
            parts.append(Text(f"  {name}: {why}"))
        parts.append(Text(""))
    if s["parked"]:
        parts.append(Text("Parked (not retried; llmgw ctl unpark MODEL)", style="bold yellow"))
        for p in s["parked"]:
            parts.append(Text(f"  {p['model']}: {p['failures']} failures: {p['reason'] or '-'}"))
        parts.append(Text(""))
    if s["idle_replicas"]:
        idle = _table("REPLICA", "MODEL", "IDLE", "GPUS", title="Idle replicas (10 min or more)")
        for i in s["idle_replicas"]:
            idle.add_row(i["id"], i["model"], _duration(i["idle_seconds"]), str(i["gpus"]))
        parts += [idle, Text("")]
    if s.get("store_error"):
        parts.append(Text(f"Store: {s['store_error']}", style="bold red"))
    elif s["store"]:
        store = _table("MEMBER", "HOST", "ROLE", "STATE", "LAG", title="Store")
        for mb in s["store"]:
            store.add_row(mb["name"], mb["host"], mb["role"], mb["state"],
                          "unknown" if mb["lag"] < 0 else _bytes(mb["lag"]))
        parts.append(store)
    else:
        parts.append(Text("Store: a single database"))
    return Group(*parts)


@app.command()
@guarded
def status(ctx: typer.Context, as_json: JsonOpt = False, watch: WatchOpt = None) -> None:
    """The whole fleet on one screen."""
    client = _client(ctx)

    def fetch() -> dict[str, Any]:
        summary = client.call("GET", "/summary")
        # The reasons behind "unplaceable" live on the models.
        models = client.call("GET", "/models") if summary["unplaceable"] else []
        return {"summary": summary, "models": models}

    if as_json:
        _print_json(fetch()["summary"])
    elif watch:
        _watch(fetch, _status_view, watch)
    else:
        _console().print(_status_view(fetch()))


# -- nodes ---------------------------------------------------------------------------

nodes_app = typer.Typer(help="Nodes: list (default), show, delete.", no_args_is_help=False)
app.add_typer(nodes_app, name="nodes")


def _node_devices(node: dict[str, Any]) -> str:
    lines = []
    for c in node["classes"]:
        labels = [d["label"] for d in node["devices"] if d["gpu_class"] == c["gpu_class"]]
        mig = " [" + " ".join(labels) + "]" if "-mig-" in c["gpu_class"] else ""
        lines.append(f"{c['gpu_class']} {c['free']}/{c['total']} free{mig}")
    return "\n".join(lines) or "-"


def _node_issues(node: dict[str, Any]) -> str:
    lines = []
    for d in node["devices"]:
        if d["status"] == "unhealthy":
            lines.append(f"{d['label']} unhealthy: {'; '.join(d['unhealthy_reasons']) or '?'}")
        elif d["status"] == "unplaceable":
            lines.append(f"{d['label']} not placeable: {d['unplaceable_reason'] or '?'}")
    lines += node["warnings"]
    return "\n".join(lines) or "-"


@nodes_app.callback(invoke_without_command=True)
@guarded
def nodes(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    state: Annotated[str | None, typer.Option(
        help="ready, cordoned, draining, unreachable")] = None,
    fabric: Annotated[str | None, typer.Option(help="Only nodes in this fabric.")] = None,
) -> None:
    """Nodes with their devices by class, health and reasons."""
    if ctx.invoked_subcommand is not None:
        return
    data = _client(ctx).call("GET", "/nodes", params={"state": state, "fabric": fabric})
    if as_json:
        _print_json(data)
        return
    table = _table("NODE", "STATE", "FABRICS", "DEVICES", "HEALTH", "MODELS", "SEEN")
    for node in data:
        table.add_row(node["name"], node["state"], ",".join(node["fabrics"]) or "-",
                      _node_devices(node), _node_issues(node), str(len(node["models"])),
                      _ago(node["last_seen"]))
    _console().print(table if data else "No nodes registered.")


@nodes_app.command("show")
@guarded
def node_show(ctx: typer.Context, name: str, as_json: JsonOpt = False) -> None:
    """One node, device by device (MIG instances as card/migN)."""
    node = _client(ctx).call("GET", f"/nodes/{name}")
    if as_json:
        _print_json(node)
        return
    console = _console()
    console.print(f"[bold]{node['name']}[/]  {node['state']}  {node['address']}  "
                  f"fabrics: {','.join(node['fabrics']) or '-'}  seen {_ago(node['last_seen'])}")
    table = _table("DEVICE", "CLASS", "STATUS", "USED BY", "MEMORY", "TEMP", "POWER", "UTIL",
                   "REASON")
    for d in node["devices"]:
        table.add_row(
            d["label"], d["gpu_class"], d["status"], d["used_by"] or "-",
            f"{d['memory_used_mib']}/{d['memory_total_mib']} MiB",
            "-" if d["temperature_c"] is None else f"{d['temperature_c']} C",
            "-" if d["power_w"] is None else f"{d['power_w']:.0f} W",
            "-" if d["utilization_pct"] is None else f"{d['utilization_pct']}%",
            "; ".join(d["unhealthy_reasons"]) or d["unplaceable_reason"] or "",
        )
    console.print(table)
    console.print(f"weights: {', '.join(node['models']) or '-'}")


@nodes_app.command("delete")
@guarded
def node_delete(ctx: typer.Context, name: str) -> None:
    """Forget a node; its agent must register again with a join token."""
    typer.echo(_client(ctx).call("DELETE", f"/nodes/{name}")["message"])


def _node_action(ctx: typer.Context, name: str, action: str) -> None:
    node = _client(ctx).call("POST", f"/nodes/{name}/{action}")
    typer.echo(f"node {node['name']} is {node['state']}")


@app.command()
@guarded
def cordon(ctx: typer.Context, node: str) -> None:
    """Place nothing new on NODE; its replicas stay."""
    _node_action(ctx, node, "cordon")


@app.command()
@guarded
def uncordon(ctx: typer.Context, node: str) -> None:
    """Let NODE take new replicas again."""
    _node_action(ctx, node, "uncordon")


@app.command()
@guarded
def drain(ctx: typer.Context, node: str) -> None:
    """Move NODE's replicas away (new one first, then the old one) and place nothing there."""
    _node_action(ctx, node, "drain")


# -- models ---------------------------------------------------------------------------

models_app = typer.Typer(help="Models: list (default), show, delete.")
app.add_typer(models_app, name="models")


def _model_status(m: dict[str, Any]) -> str:
    if m["parked"]:
        return "parked"
    if m["ready"] >= m["desired"]:
        return "ok"
    return "unplaceable" if m["unplaceable"] or m["total"] <= m["ready"] else "starting"


@models_app.callback(invoke_without_command=True)
@guarded
def models(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Models: replicas ready against what they should have now."""
    if ctx.invoked_subcommand is not None:
        return
    data = _client(ctx).call("GET", "/models")
    if as_json:
        _print_json(data)
        return
    table = _table("MODEL", "ENGINE", "READY", "STARTING", "MIN-MAX", "STATUS", "REASON")
    for m in data:
        table.add_row(m["name"], m["spec"]["engine"], f"{m['ready']}/{m['desired']}",
                      str(m["starting"]), f"{m['min_replicas']}-{m['max_replicas']}",
                      _model_status(m), m["reason"] or "")
    _console().print(table if data else "No models in the catalog (llmgw ctl apply -f FILE).")


@models_app.command("show")
@guarded
def model_show(ctx: typer.Context, name: str) -> None:
    """One model and its entry, as JSON."""
    _print_json(_client(ctx).call("GET", f"/models/{name}"))


@models_app.command("delete")
@guarded
def model_delete(ctx: typer.Context, name: str) -> None:
    """Remove a model from the catalog and stop its replicas."""
    typer.echo(_client(ctx).call("DELETE", f"/models/{name}")["message"])


@app.command()
@guarded
def unpark(ctx: typer.Context, model: str) -> None:
    """Retry a parked model from zero failures."""
    m = _client(ctx).call("POST", f"/models/{model}/unpark")
    typer.echo(f"model {m['name']} unparked")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror or exc}") from None


def _plan_view(plan: dict[str, Any]) -> Group:
    table = _table("MODEL", "STATUS", "CURRENT", "DESIRED", "REASON")
    for m in plan.get("models", []):
        table.add_row(m["name"], m["status"], str(m["current"]), str(m["desired"]),
                      m.get("reason") or "")
    devices = _table("CLASS", "TOTAL", "USED", "FREE", "UNHEALTHY", "FREE AFTER",
                     title="Devices by class")
    for d in plan.get("devices", []):
        devices.add_row(d["gpu_class"], str(d["total"]), str(d["used"]), str(d["free"]),
                        str(d["unhealthy"]), str(d.get("free_after", "")))
    lines: list[Any] = [table, Text(""), devices, Text("")]
    lines.append(Text(f"{plan.get('placements', 0)} placement(s), "
                      f"{plan.get('removals', 0)} removal(s)"))
    if plan.get("unplaceable"):
        lines.append(Text("unplaceable: " + ", ".join(plan["unplaceable"]), style="bold red"))
    return Group(*lines)


@app.command()
@guarded
def apply(
    ctx: typer.Context,
    file: Annotated[Path, typer.Option("-f", "--file", help="YAML or JSON catalog entries.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the diff and the plan only.")]
    = False,
    as_json: JsonOpt = False,
) -> None:
    """Add or change catalog entries from FILE."""
    body = {"document": _read(file), "source": str(file), "dry_run": dry_run}
    result = _client(ctx).call("POST", "/apply", body=body)
    if as_json:
        _print_json(result)
        return
    console = _console()
    verb = "would be" if dry_run else "were"
    for name in result["added"]:
        console.print(f"+ {name}  (added)")
    for name in result["changed"]:
        console.print(f"~ {name}  ({', '.join(result['changed_fields'].get(name, []))})")
    for name in result["unchanged"]:
        console.print(f"= {name}  (unchanged)")
    console.print(f"{len(result['added'])} added, {len(result['changed'])} changed "
                  f"({verb} applied)")
    if dry_run and result.get("plan"):
        console.print()
        console.print(_plan_view(result["plan"]))


@app.command()
@guarded
def plan(
    ctx: typer.Context,
    what_if: Annotated[Path | None, typer.Option(
        "--what-if", help="Plan as if these entries (YAML/JSON) were added.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """What the scheduler would do now: where models go, what cannot be placed and why."""
    client = _client(ctx)
    if what_if is None:
        result = client.call("GET", "/plan")
    else:
        result = client.call("POST", "/plan",
                             body={"document": _read(what_if), "source": str(what_if)})
    if as_json:
        _print_json(result)
    else:
        _console().print(_plan_view(result))


# -- replicas -------------------------------------------------------------------------

replicas_app = typer.Typer(help="Replicas: list (default), show, drain.")
app.add_typer(replicas_app, name="replicas")


def _progress(r: dict[str, Any]) -> str:
    d = r.get("download")
    if d:
        total = d.get("bytes_total")
        pct = f"{100 * d['bytes_done'] / total:.0f}% of {_bytes(total)}" if total else _bytes(
            d["bytes_done"])
        eta = f", {_duration(d['eta_s'])} left" if d.get("eta_s") else ""
        return f"weights {pct}{eta}"
    return r.get("reason") or ""


def _replicas_view(data: list[dict[str, Any]]) -> Any:
    if not data:
        return Text("No replicas.")
    table = _table("REPLICA", "MODEL", "STATE", "WHERE", "URL", "IDLE", "GPUS", "PROGRESS")
    for r in data:
        where = " ".join(f"{s['node']}:{','.join(s['devices'])}" for s in r["shards"])
        table.add_row(r["id"], r["model"], r["state"], where, r["url"] or "-",
                      _duration(r["idle_seconds"]), str(r["gpus"]), _progress(r))
    return table


@replicas_app.callback(invoke_without_command=True)
@guarded
def replicas(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Only this model's replicas.")] = None,
    node: Annotated[str | None, typer.Option(help="Only replicas on this node.")] = None,
    state: Annotated[str | None, typer.Option(help="starting, ready, draining, failed")] = None,
    as_json: JsonOpt = False,
    watch: WatchOpt = None,
) -> None:
    """Replicas, where they run, and how far a start has got."""
    if ctx.invoked_subcommand is not None:
        return
    client = _client(ctx)

    def fetch() -> Any:
        return client.call("GET", "/replicas",
                           params={"model": model, "node": node, "state": state})

    if as_json:
        _print_json(fetch())
    elif watch:
        _watch(fetch, _replicas_view, watch)
    else:
        _console().print(_replicas_view(fetch()))


@replicas_app.command("show")
@guarded
def replica_show(ctx: typer.Context, replica_id: str) -> None:
    """One replica as JSON, with the engine's log tail."""
    _print_json(_client(ctx).call("GET", f"/replicas/{replica_id}"))


@replicas_app.command("drain")
@guarded
def replica_drain(ctx: typer.Context, replica_id: str) -> None:
    """Stop routing to a replica; in-flight requests finish, then it stops."""
    r = _client(ctx).call("POST", f"/replicas/{replica_id}/drain")
    typer.echo(f"replica {r['id']} is {r['state']}")


# -- events, keys, usage, join token -----------------------------------------------------


@app.command()
@guarded
def events(
    ctx: typer.Context,
    kind: Annotated[str | None, typer.Option(help="e.g. placed, failed, parked, drain")] = None,
    subject: Annotated[str | None, typer.Option(help="A model, replica or node.")] = None,
    since: Annotated[int, typer.Option(help="Only events after this id.", min=0)] = 0,
    limit: Annotated[int, typer.Option(help="At most this many (the latest).", min=1,
                                       max=1000)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """What the control plane did and why, oldest first."""
    data = _client(ctx).call("GET", "/events", params={"kind": kind, "subject": subject,
                                                       "since": since, "limit": limit})
    if as_json:
        _print_json(data)
        return
    table = _table("ID", "TIME", "KIND", "SUBJECT", "MESSAGE")
    for e in data:
        table.add_row(str(e["id"]), _when(e["at"]), e["kind"], e["subject"], e["message"])
    _console().print(table if data else "No events.")


keys_app = typer.Typer(help="API keys: list (default), create, revoke.")
app.add_typer(keys_app, name="keys")


@keys_app.callback(invoke_without_command=True)
@guarded
def keys(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """API keys (never their secrets)."""
    if ctx.invoked_subcommand is not None:
        return
    data = _client(ctx).call("GET", "/keys")
    if as_json:
        _print_json(data)
        return
    table = _table("KEY", "NAME", "MODELS", "RPM", "TPM", "EXPIRES", "REVOKED")
    for k in data:
        table.add_row(k["key_id"], k["name"], ",".join(k["models"]) or "all",
                      str(k["rpm"] or "-"), str(k["tpm"] or "-"), _when(k["expires_at"]),
                      "yes" if k["revoked"] else "")
    _console().print(table if data else "No API keys.")


@keys_app.command("create")
@guarded
def key_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(help="A label for people.")] = "",
    model: Annotated[list[str] | None, typer.Option(
        "--model", help="A model it may use (repeat; default all).")] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.", min=1)] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute.", min=1)] = None,
    expires_in_days: Annotated[float | None, typer.Option(help="Expire after N days.",
                                                          min=0)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an API key; its secret is shown now and never again."""
    body = {"name": name, "models": model or [], "rpm": rpm, "tpm": tpm,
            "expires_at": None if expires_in_days is None
            else time.time() + expires_in_days * 86400}
    created = _client(ctx).call("POST", "/keys", body=body)
    if as_json:
        _print_json(created)
        return
    typer.echo(f"key {created['key']['key_id']} created. Its secret, shown only this once:")
    typer.echo(created["secret"])


@keys_app.command("revoke")
@guarded
def key_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke an API key (gateways refuse it at their next config update)."""
    k = _client(ctx).call("DELETE", f"/keys/{key_id}")
    typer.echo(f"key {k['key_id']} revoked")


@app.command()
@guarded
def usage(
    ctx: typer.Context,
    minutes: Annotated[int, typer.Option(help="Over the last N minutes.", min=1)] = 60,
    key: Annotated[str | None, typer.Option(help="Only this key id.")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    per_minute: Annotated[bool, typer.Option(help="One row per minute.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Requests and tokens per key and model."""
    since = int(time.time()) - minutes * 60
    data = _client(ctx).call("GET", "/usage", params={"since": since, "key_id": key,
                                                      "model": model})
    if as_json:
        _print_json(data)
        return
    rows = data["rows"] if per_minute else data["by_key_model"]
    columns = ("MINUTE",) if per_minute else ()
    table = _table(*columns, "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "CACHED",
                   "ERRORS")
    for row in [*rows, {**data["total"], "key_id": "total", "model": ""}]:
        minute = (_when(row["minute"]) if "minute" in row else "",) if per_minute else ()
        table.add_row(*minute, row["key_id"] or "", row["model"] or "", str(row["requests"]),
                      str(row["prompt_tokens"]), str(row["completion_tokens"]),
                      str(row["cached_tokens"]), str(row["errors"]))
    _console().print(table)


@app.command("join-token")
@guarded
def join_token(
    ctx: typer.Context,
    rotate: Annotated[bool, typer.Option("--rotate", help="Make a new join token.")] = False,
) -> None:
    """Make a new join token for agents (the old one stops working)."""
    if not rotate:
        raise CtlError("join tokens are stored only as hashes and cannot be shown; "
                       "make a new one with --rotate")
    token = _client(ctx).call("POST", "/join-token/rotate")["join_token"]
    typer.echo(token)


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("COLUMNS", "160")
    app()
