// Replicas: where each runs, how far its start has got (weights download,
// engine loading), and the tail of its engine's log, which is where the
// reason for a failed start usually is.

import { api } from "../api.js";
import { badge, choice, filterForm, fmtBytes, fmtDuration, fmtInt, h, redraw, searchBox, titled } from "../dom.js";

const STATES = ["starting", "ready", "draining", "failed"];

function download(d) {
  if (!d) return null;
  const pct = d.bytes_total ? Math.min(100, (100 * d.bytes_done) / d.bytes_total) : null;
  const label = d.bytes_total
    ? `${fmtBytes(d.bytes_done)} of ${fmtBytes(d.bytes_total)} (${pct.toFixed(0)} %)`
    : `${fmtBytes(d.bytes_done)}`;
  const extra = [d.rate_bps ? `${fmtBytes(d.rate_bps)}/s` : null, d.eta_s != null ? `${fmtDuration(d.eta_s)} left` : null].filter(Boolean).join(", ");
  return h(
    "div",
    { class: "download" },
    pct === null ? h("progress", { "aria-label": "weights download" }) : h("progress", { max: 100, value: pct.toFixed(1), "aria-label": "weights download" }),
    " ",
    h("span", {}, `weights ${label}${extra ? `, ${extra}` : ""}`),
  );
}

export default {
  title: "Replicas",
  create(ctx) {
    const p = ctx.params;
    const q = searchBox("replica-q", p.get("q"), "id, model or node");
    const state = choice("replica-state", STATES, p.get("state"));
    const count = h("p", { class: "muted", id: "replica-count", role: "status" });
    const list = h("div", { id: "replica-list" });
    // Which logs are open survives the redraw every few seconds.
    const open = new Set();
    let replicas = [];

    const el = titled(
      "Replicas",
      filterForm([
        ["Search", q],
        ["State", state],
      ]),
      count,
      list,
    );

    function row(r) {
      const logs = h(
        "details",
        { open: open.has(r.id) },
        h("summary", {}, `Engine log (last ${r.log_tail.length} lines)`),
        r.log_tail.length ? h("pre", { class: "log" }, r.log_tail.join("\n")) : h("p", { class: "empty" }, "No log lines reported."),
      );
      logs.addEventListener("toggle", () => (logs.open ? open.add(r.id) : open.delete(r.id)));
      return h(
        "tr",
        { dataset: { replica: r.id } },
        h("td", {}, h("span", { class: "mono" }, r.id), h("div", { class: "muted" }, `generation ${r.generation}`)),
        h("td", {}, r.model),
        h("td", {}, badge(r.state), r.draining && r.state !== "draining" ? [" ", badge("draining")] : null),
        h("td", {}, r.shards.map((s) => h("div", { class: "mono" }, `${s.node}: ${s.devices.join(", ") || "–"}`))),
        h("td", { class: "num" }, fmtInt(r.in_flight)),
        h("td", { class: "num" }, r.idle_seconds == null ? "–" : fmtDuration(r.idle_seconds)),
        h("td", {}, r.reason ? h("div", {}, r.reason) : null, download(r.download), r.url ? h("div", { class: "mono muted" }, r.url) : null, logs),
      );
    }

    function render() {
      const needle = q.value.trim().toLowerCase();
      const rows = replicas.filter(
        (r) =>
          (!state.value || r.state === state.value) &&
          (!needle || r.id.toLowerCase().includes(needle) || r.model.toLowerCase().includes(needle) || r.nodes.some((n) => n.toLowerCase().includes(needle))),
      );
      count.textContent = `${fmtInt(rows.length)} of ${fmtInt(replicas.length)} replicas`;
      redraw(list, () =>
        rows.length
          ? h(
              "table",
              {},
              h(
                "thead",
                {},
                h("tr", {}, ["Replica", "Model", "State", "Node: devices", "In flight", "Idle", "Status"].map((t, i) => h("th", { scope: "col", class: i === 4 || i === 5 ? "num" : null }, t))),
              ),
              h("tbody", {}, rows.map(row)),
            )
          : h("p", { class: "empty" }, "No replica matches."),
      );
      ctx.setParams({ q: q.value.trim(), state: state.value });
    }

    q.addEventListener("input", render);
    state.addEventListener("change", render);

    async function refresh() {
      replicas = await api("/replicas");
      render();
    }

    return { el, refresh };
  },
};
