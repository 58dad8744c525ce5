// Usage: requests and tokens over time, per model, per API key and per team.
//
// The store keeps one row per key, model and minute; the page sums them into
// buckets sized to the range (a day of minutes is 1,440 points per line, more
// than a chart can show), keeps the busiest few series and folds the rest
// into "other" so the legend stays readable.
//
// "Download CSV" fetches the control plane's own CSV of the range (GET
// /usage/report?format=csv, what `llmgw ctl usage --csv` prints) and saves
// it from a blob: a plain link could not carry the admin token.

import { api, apiWithHeaders, ownTeam } from "../api.js";
import { h, numColumn, redraw, section, table, titled } from "../dom.js";
import { lineChart } from "../charts.js";

const RANGES = [
  { value: "3600", label: "last hour", bucket: 60 },
  { value: "21600", label: "last 6 hours", bucket: 300 },
  { value: "86400", label: "last 24 hours", bucket: 900 },
  { value: "604800", label: "last 7 days", bucket: 3600 },
];
const MAX_SERIES = 7;
const CSV_BY = [
  { value: "team", label: "team" },
  { value: "key", label: "key" },
  { value: "model", label: "model" },
  { value: "day", label: "day (UTC)" },
  { value: "day,key,model", label: "day, key and model" },
  { value: "day,team", label: "day and team (with spend)" },
];

/** The file name the control plane gave (Content-Disposition), or a plain one. */
function fileName(headers, fallback) {
  const found = /filename="([^"]+)"/.exec(headers.get("content-disposition") || "");
  return found ? found[1] : fallback;
}

function save(text, name) {
  const url = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
  const link = h("a", { href: url, download: name, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  // Revoked later, not at once: the browser reads the blob after click() returns.
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function totals(rows, keyOf) {
  const out = new Map();
  for (const r of rows) {
    const k = keyOf(r);
    const t = out.get(k) || { name: k, requests: 0, prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0, errors: 0 };
    t.requests += r.requests;
    t.prompt_tokens += r.prompt_tokens;
    t.completion_tokens += r.completion_tokens;
    t.cached_tokens += r.cached_tokens || 0;
    t.errors += r.errors || 0;
    out.set(k, t);
  }
  return [...out.values()].sort((a, b) => b.requests - a.requests || a.name.localeCompare(b.name));
}

/** [{name, points}] of `value(row)` summed per bucket, zero-filled, top series plus "other". */
function series(rows, keyOf, value, from, to, bucket) {
  const byKey = new Map();
  for (const r of rows) {
    const k = keyOf(r);
    if (!byKey.has(k)) byKey.set(k, new Map());
    const b = Math.floor(r.minute / bucket) * bucket;
    const m = byKey.get(k);
    m.set(b, (m.get(b) || 0) + value(r));
  }
  const ranked = [...byKey.entries()]
    .map(([k, m]) => [k, m, [...m.values()].reduce((a, v) => a + v, 0)])
    .sort((a, b) => b[2] - a[2] || String(a[0]).localeCompare(String(b[0])));
  const keep = ranked.slice(0, MAX_SERIES);
  const rest = ranked.slice(MAX_SERIES);
  if (rest.length) {
    const other = new Map();
    for (const [, m] of rest) for (const [b, v] of m) other.set(b, (other.get(b) || 0) + v);
    keep.push([`other (${rest.length})`, other, 0]);
  }
  const start = Math.floor(from / bucket) * bucket;
  return keep.map(([k, m]) => {
    const points = [];
    for (let b = start; b <= to; b += bucket) points.push([b, m.get(b) || 0]);
    return { name: String(k), points };
  });
}

export default {
  title: "Usage",
  create(ctx) {
    const range = h("select", { id: "usage-range" }, RANGES.map((r) => h("option", { value: r.value }, r.label)));
    range.value = RANGES.some((r) => r.value === ctx.params.get("range")) ? ctx.params.get("range") : "3600";
    const csvBy = h("select", { id: "usage-csv-by" }, CSV_BY.map((b) => h("option", { value: b.value }, b.label)));
    const download = h("button", { type: "button", id: "usage-csv", class: "secondary" }, "Download CSV");
    const csvError = h("span", { id: "usage-csv-error", class: "error", role: "alert" });
    const charts = h("div", { id: "usage-charts" });
    const tables = h("div", { id: "usage-tables" });
    const el = titled(
      "Usage",
      h(
        "form",
        { class: "filters", on: { submit: (e) => e.preventDefault() } },
        h("div", { class: "field" }, h("label", { for: "usage-range" }, "Range"), range),
        h("div", { class: "field" }, h("label", { for: "usage-csv-by" }, "CSV by"), csvBy),
        download,
        csvError,
      ),
      charts,
      tables,
    );

    download.addEventListener("click", async () => {
      download.disabled = true;
      csvError.textContent = "";
      const until = Math.floor(Date.now() / 1000);
      const since = Math.floor((until - Number(range.value)) / 60) * 60;
      try {
        const { body, headers } = await apiWithHeaders("/usage/report", { query: { since, until, by: csvBy.value, format: "csv", team: ownTeam() }, raw: true });
        save(body, fileName(headers, "llmgw-usage.csv"));
      } catch (err) {
        csvError.textContent = `Download failed: ${err.message}`;
      } finally {
        download.disabled = false;
      }
    });

    async function refresh() {
      const span = Number(range.value);
      const { bucket } = RANGES.find((r) => r.value === range.value);
      const to = Math.floor(Date.now() / 1000);
      const from = to - span;
      const [answer, keys, teams] = await Promise.all([api("/usage", { query: { since: Math.floor(from / 60) * 60, team: ownTeam() } }), api("/keys"), api("/teams")]);
      const rows = answer.rows;
      const keyName = new Map((keys || []).map((k) => [k.key_id, k.name ? `${k.name} (${k.key_id})` : k.key_id]));
      // A key's team as it is now (the CSV by team counts each row under the
      // team its key had when the row was written).
      const teamName = new Map((teams || []).map((t) => [t.team_id, t.name]));
      const keyTeam = new Map((keys || []).map((k) => [k.key_id, k.team_id ? teamName.get(k.team_id) || k.team_id : "(operator)"]));
      const byTeam = (r) => keyTeam.get(r.key_id) || "(operator)";
      const byModel = (r) => r.model;
      const byKey = (r) => keyName.get(r.key_id) || r.key_id;
      const tokens = (r) => r.prompt_tokens + r.completion_tokens;
      const requests = (r) => r.requests;
      const modelTotals = totals(rows, byModel);
      const keyTotals = totals(rows, byKey);
      const teamTotals = totals(rows, byTeam);
      const rank = (list) => {
        const index = new Map(list.map((t, i) => [t.name, i]));
        return (name) => index.get(name) ?? list.length;
      };
      const modelColour = rank(modelTotals);
      const keyColour = rank(keyTotals);
      redraw(charts, () =>
        h(
          "div",
          { class: "chart-grid" },
          lineChart("Requests per model", series(rows, byModel, requests, from, to, bucket), { from, to, unit: "requests", colourOf: modelColour }),
          lineChart("Tokens per model (prompt + completion)", series(rows, byModel, tokens, from, to, bucket), { from, to, unit: "tokens", colourOf: modelColour }),
          lineChart("Requests per key", series(rows, byKey, requests, from, to, bucket), { from, to, unit: "requests", colourOf: keyColour }),
          lineChart("Tokens per key (prompt + completion)", series(rows, byKey, tokens, from, to, bucket), { from, to, unit: "tokens", colourOf: keyColour }),
        ),
      );
      const columns = (label) => [
        { label, cell: (t) => t.name },
        numColumn("Requests", "requests"),
        numColumn("Prompt tokens", "prompt_tokens"),
        numColumn("Completion tokens", "completion_tokens"),
        numColumn("Cached tokens", "cached_tokens"),
        numColumn("Errors", "errors"),
      ];
      redraw(tables, () =>
        h(
          "div",
          { class: "grid" },
          section("Totals per model", h("div", { id: "usage-by-model" }, table(columns("Model"), modelTotals, { empty: "No requests in this range.", rowAttrs: (t) => ({ dataset: { name: t.name } }) }))),
          section("Totals per key", h("div", { id: "usage-by-key" }, table(columns("Key"), keyTotals, { empty: "No requests in this range.", rowAttrs: (t) => ({ dataset: { name: t.name } }) }))),
          section("Totals per team", h("div", { id: "usage-by-team" }, table(columns("Team"), teamTotals, { empty: "No requests in this range.", rowAttrs: (t) => ({ dataset: { name: t.name } }) }))),
        ),
      );
      ctx.setParams({ range: range.value === "3600" ? "" : range.value });
    }

    range.addEventListener("change", () => ctx.refreshNow());
    return { el, refresh };
  },
};
