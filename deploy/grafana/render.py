"""Draw the Grafana dashboard's panels from a Prometheus server, without Grafana.

Grafana is not in Debian's packages, and a picture of the dashboard is only
worth something if its numbers come from a real scrape. This runs every
panel's queries against Prometheus's HTTP API (as Grafana would: range
queries for graphs, instant queries for stats and tables), lays the panels
out by their ``gridPos``, and has Chromium take the screenshot. It also
shows a query Prometheus refused, so a broken panel cannot hide.

    python deploy/grafana/render.py --prometheus http://127.0.0.1:9090 \\
        --out dashboard.png [--minutes 15] [--rate-interval 1m] [--summary panels.json]

Needs playwright and a Chromium (``--chromium``, default /usr/bin/chromium).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "llmgw-fleet.json"
ROW_PX = 30  # Grafana's grid: 24 columns, rows of 30 px
WIDTH_PX = 1600
COLOURS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#8ab8ff",
           "#fade2a", "#37872d", "#c4162a", "#1f60c4", "#fa6400"]


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (unix time, value); one point for instant queries
    labels: dict[str, str] = field(default_factory=dict)
    ref: str = "A"


@dataclass
class Panel:
    title: str
    kind: str
    unit: str
    grid: dict[str, int]
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)
    stacked: bool = False
    step: float = 0.0  # of range queries: a longer gap between points is a gap in the data


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as answer:
            return json.load(answer)


def substitute(expr: str, rate_interval: str) -> str:
    """The dashboard's variables as Grafana fills them with every model selected."""
    return (expr.replace("$__rate_interval", rate_interval)
            .replace('=~"$model"', '=~".*"'))


def legend(fmt: str, labels: dict[str, str], fallback: str) -> str:
    if not fmt:
        return fallback
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def run_target(prom: Prometheus, target: dict[str, Any], instant: bool, start: float,
               end: float, step: float, rate_interval: str) -> tuple[list[Series], str | None]:
    expr = substitute(target["expr"], rate_interval)
    try:
        if instant:
            answer = prom.get("/api/v1/query", query=expr, time=end)
        else:
            answer = prom.get("/api/v1/query_range", query=expr, start=start, end=end, step=step)
    except urllib.error.HTTPError as exc:
        return [], f"{expr}: {exc.read().decode(errors='replace')[:300]}"
    if answer.get("status") != "success":
        return [], f"{expr}: {answer.get('error')}"
    out = []
    for result in answer["data"]["result"]:
        labels = {k: v for k, v in result["metric"].items() if k != "__name__"}
        name = legend(target.get("legendFormat", ""), labels, json.dumps(labels) or expr)
        if "value" in result:
            points = [(float(result["value"][0]), float(result["value"][1]))]
        else:
            points = [(float(t), float(v)) for t, v in result["values"]]
        out.append(Series(name, points, labels, target.get("refId", "A")))
    return out, None


def load_panels(dashboard: dict[str, Any], prom: Prometheus, minutes: float,
                rate_interval: str) -> list[Panel]:
    end = time.time()
    start = end - minutes * 60
    step = max(1.0, round(minutes * 60 / 300))
    panels = []
    for raw in dashboard["panels"]:
        unit = raw.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        panel = Panel(raw["title"], raw["type"], unit, raw["gridPos"], step=step)
        custom = raw.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
        panel.stacked = custom.get("stacking", {}).get("mode", "none") != "none"
        for transform in raw.get("transformations", []):
            panel.renames.update(transform.get("options", {}).get("renameByName", {}))
        for target in raw.get("targets", []):
            instant = raw["type"] in ("stat", "table") or bool(target.get("instant"))
            found, error = run_target(prom, target, instant, start, end, step, rate_interval)
            panel.series += found
            if error:
                panel.errors.append(error)
        if panel.stacked:
            stack(panel.series)
        panels.append(panel)
    return panels


def stack(series: list[Series]) -> None:
    """Each series drawn on top of the ones before it, as Grafana's normal stacking."""
    below: dict[float, float] = {}
    for s in series:
        s.points = [(t, v + below.get(t, 0.0)) for t, v in s.points]
        below.update(s.points)


# -- formatting -------------------------------------------------------------------


def fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞"
    if unit == "s":
        if value == 0:
            return "0 s"
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit == "bytes":
        for size, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{value / size:.3g} {name}"
        return f"{value:.0f} B"
    if unit == "percentunit":
        return f"{value * 100:.3g} %"
    suffix = {"celsius": " °C", "watt": " W", "reqps": " req/s"}.get(unit, "")
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g}M{suffix}"
    if abs(value) >= 1e3:
        return f"{value / 1e3:.3g}k{suffix}"
    return f"{value:.3g}{suffix}"


def graph_svg(panel: Panel, width: int, height: int) -> str:
    points = [(t, v) for s in panel.series for t, v in s.points if math.isfinite(v)]
    if not points:
        return ""
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    lo, hi = min(0.0, min(v for _, v in points)), max(v for _, v in points)
    if hi == lo:
        hi = lo + 1
    left, bottom = 70, 18

    def xy(t: float, v: float) -> str:
        x = left + (t - t0) / max(t1 - t0, 1) * (width - left - 8)
        y = 6 + (hi - v) / (hi - lo) * (height - bottom - 6)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg width="{width}" height="{height}">']
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        y = 6 + (hi - v) / (hi - lo) * (height - bottom - 6)
        parts.append(f'<line x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#2c3235"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f"{html.escape(fmt(v, panel.unit))}</text>")
    for i in range(4):
        t = t0 + (t1 - t0) * i / 3
        x = left + (t - t0) / max(t1 - t0, 1) * (width - left - 8)
        label = time.strftime("%H:%M:%S", time.localtime(t))
        anchor = ("start", "middle", "middle", "end")[i]
        parts.append(f'<text x="{x:.1f}" y="{height - 3}" text-anchor="{anchor}">{label}</text>')
    for n, series in enumerate(panel.series):
        for run in _runs(series.points, panel.step):
            line = " ".join(xy(t, v) for t, v in run)
            parts.append(f'<polyline fill="none" stroke="{COLOURS[n % len(COLOURS)]}" '
                         f'stroke-width="1.5" points="{line}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _runs(points: list[tuple[float, float]], step: float) -> list[list[tuple[float, float]]]:
    """Points split where data is missing, so a gap is drawn as one (as Grafana does)."""
    runs: list[list[tuple[float, float]]] = []
    last = None
    for t, v in points:
        if not math.isfinite(v):
            last = None
            continue
        if last is None or (step and t - last > 1.5 * step):
            runs.append([])
        runs[-1].append((t, v))
        last = t
    return runs


def panel_body(panel: Panel, width: int, height: int) -> str:
    if panel.kind == "timeseries":
        svg = graph_svg(panel, width - 16, height - 30 - 18 * min(3, _legend_rows(panel, width)))
        keys = "".join(
            f'<span><i style="background:{COLOURS[n % len(COLOURS)]}"></i>'
            f"{html.escape(s.name)}</span>" for n, s in enumerate(panel.series))
        return (svg or '<div class="empty">No data</div>') + f'<div class="keys">{keys}</div>'
    if panel.kind == "stat":
        if not panel.series:
            return '<div class="empty">No data</div>'
        cells = "".join(
            f'<div class="stat"><b style="color:{COLOURS[n % len(COLOURS)]}">'
            f"{html.escape(fmt(s.points[-1][1], panel.unit))}</b>"
            f"<span>{html.escape(s.name)}</span></div>" for n, s in enumerate(panel.series))
        return f'<div class="stats">{cells}</div>'
    return table_html(panel)


def _legend_rows(panel: Panel, width: int) -> int:
    chars = sum(len(s.name) + 4 for s in panel.series)
    return max(1, math.ceil(chars * 7 / max(width, 1)))


def table_html(panel: Panel) -> str:
    """One row per label set, one value column per query (Grafana's merge)."""
    rows: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    for s in panel.series:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "job"))
        rows.setdefault(key, {})[panel.renames.get(f"Value #{s.ref}", "Value")] = s.points[-1][1]
    if not rows:
        return '<div class="empty">No data</div>'
    labels = sorted({k for key in rows for k, _ in key})
    values = list(dict.fromkeys(v for r in rows.values() for v in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in labels + values)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(dict(key).get(c, ''))}</td>" for c in labels)
        + "".join(f"<td>{html.escape(fmt(vals[c], 'short')) if c in vals else ''}</td>"
                  for c in values) + "</tr>"
        for key, vals in sorted(rows.items()))
    return f"<table><tr>{head}</tr>{body}</table>"


def page(title: str, panels: list[Panel], source: str) -> str:
    col = WIDTH_PX / 24
    blocks = []
    for p in panels:
        g = p.grid
        x, y, w, h = g["x"] * col, g["y"] * ROW_PX, g["w"] * col, g["h"] * ROW_PX
        style = f"left:{x:.0f}px;top:{y:.0f}px;width:{w - 8:.0f}px;height:{h - 8:.0f}px"
        if p.kind == "row":
            blocks.append(f'<div class="row" style="{style}">{html.escape(p.title)}</div>')
            continue
        errors = "".join(f'<div class="error">{html.escape(e)}</div>' for e in p.errors)
        blocks.append(f'<div class="panel" style="{style}"><h3>{html.escape(p.title)}</h3>'
                      f"{errors}{panel_body(p, int(w - 8), int(h - 8))}</div>")
    bottom = max(p.grid["y"] + p.grid["h"] for p in panels) * ROW_PX
    return f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ margin: 0; background: #111217; color: #ccccdc; font: 12px sans-serif; }}
header {{ padding: 10px 12px; font-size: 16px; }} header small {{ color: #8e8e9e; }}
main {{ position: relative; width: {WIDTH_PX}px; height: {bottom}px; margin: 0 8px 8px; }}
.panel {{ position: absolute; background: #181b1f; border: 1px solid #2c3235;
  border-radius: 3px; overflow: hidden; padding: 4px 8px; box-sizing: border-box; }}
.row {{ position: absolute; font-size: 14px; font-weight: bold; padding-top: 6px; }}
h3 {{ margin: 2px 0 4px; font-size: 13px; font-weight: 500; }}
svg text {{ fill: #8e8e9e; font-size: 10px; }}
.keys span {{ margin-right: 10px; white-space: nowrap; }}
.keys i {{ display: inline-block; width: 10px; height: 3px; margin-right: 4px;
  vertical-align: middle; }}
.stats {{ display: flex; flex-wrap: wrap; gap: 6px 16px; }}
.stat {{ display: flex; flex-direction: column; }} .stat b {{ font-size: 24px; }}
.empty {{ color: #8e8e9e; padding: 20px; text-align: center; }}
.error {{ color: #f2495c; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ text-align: left; padding: 2px 6px; border-bottom: 1px solid #2c3235; }}
</style></head><body><header>{html.escape(title)} <small>{html.escape(source)}</small></header>
<main>{"".join(blocks)}</main></body></html>"""


def screenshot(document: str, out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            tab = browser.new_page(viewport={"width": WIDTH_PX + 16, "height": 900})
            tab.set_content(document)
            tab.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--prometheus", required=True, help="Prometheus base URL")
    args.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args.add_argument("--minutes", type=float, default=15.0, help="time range drawn")
    args.add_argument("--rate-interval", default="1m",
                      help="$__rate_interval (Grafana: 4 scrape intervals or more)")
    args.add_argument("--chromium", default="/usr/bin/chromium")
    args.add_argument("--summary", type=Path,
                      help="also write, per panel, its series count and any refused query")
    opts = args.parse_args(argv)
    dashboard = json.loads(opts.dashboard.read_text())
    panels = load_panels(dashboard, Prometheus(opts.prometheus), opts.minutes,
                         opts.rate_interval)
    source = (f"rendered from {opts.prometheus}, last {opts.minutes:g} min, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    document = page(dashboard["title"], panels, source)
    opts.out.with_suffix(".html").write_text(document)
    screenshot(document, opts.out, opts.chromium)
    if opts.summary:
        opts.summary.write_text(json.dumps(
            {p.title: {"series": len(p.series), "errors": p.errors}
             for p in panels if p.kind != "row"}, indent=2))
    refused = [e for p in panels for e in p.errors]
    for error in refused:
        print(f"refused: {error}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
