// Overview: the fleet summary (GET /summary), as one screen.
//
// The numbers are the summary's own, never recomputed here: the console and
// `llmgw ctl status` must say the same thing. The models listing is read only
// for what the summary names without explaining (why a model is unplaceable).

import { api } from "../api.js";
import { postAction } from "../actions.js";
import { fmtDuration, fmtInt, h, numColumn, redraw, section, statCard, table, titled } from "../dom.js";
import { stackedBar } from "../charts.js";

function classBars(gpus) {
  if (!gpus.length) return h("p", { class: "empty" }, "No devices reported yet.");
  return h(
    "div",
    {},
    h(
      "div",
      { class: "legend" },
      h("span", {}, h("span", { class: "swatch sw-used" }), "used"),
      h("span", {}, h("span", { class: "swatch sw-unhealthy" }), "unhealthy or out of placement"),
      h("span", {}, h("span", { class: "swatch sw-free" }), "free"),
    ),
    h(
      "div",
      { class: "bars" },
      gpus.map((g) =>
        h(
          "div",
          { class: "bar-row", dataset: { class: g.class } },
          h("span", { class: "bar-label mono" }, g.class),
          stackedBar(
            [
              { value: g.used, cls: "fill-used", label: "used" },
              { value: g.unhealthy, cls: "fill-unhealthy", label: "unhealthy" },
              { value: g.free, cls: "fill-free", label: "free" },
            ],
            g.total,
            `${g.class}: ${g.used} used, ${g.unhealthy} unhealthy, ${g.free} free of ${g.total}`,
          ),
          h(
            "span",
            { class: "bar-figures" },
            h("span", { class: "f-used" }, `${fmtInt(g.used)} used`),
            " · ",
            h("span", { class: "f-unhealthy" }, `${fmtInt(g.unhealthy)} unhealthy`),
            " · ",
            h("span", { class: "f-free" }, `${fmtInt(g.free)} free`),
            " · of ",
            h("span", { class: "f-total" }, fmtInt(g.total)),
          ),
        ),
      ),
    ),
  );
}

function storeSection(summary) {
  const parts = [];
  if (summary.store_error) parts.push(h("p", { class: "error", id: "store-error" }, summary.store_error));
  if (summary.store.length) {
    parts.push(
      table(
        [
          { label: "Member", cell: (m) => m.name },
          { label: "Host", cell: (m) => h("span", { class: "mono" }, m.host) },
          { label: "Role", cell: (m) => m.role },
          { label: "State", cell: (m) => m.state },
          { label: "Lag (bytes)", cls: "num", cell: (m) => (m.lag < 0 ? "unknown" : fmtInt(m.lag)) },
        ],
        summary.store,
      ),
    );
  } else if (!summary.store_error) {
    parts.push(h("p", { class: "muted" }, "A single database: no replicated members to show."));
  }
  return section("Store", h("div", { id: "store" }, parts));
}

export default {
  title: "Overview",
  create(ctx) {
    const body = h("div", {});
    const flash = h("p", { class: "error", role: "alert" });
    const el = titled("Fleet overview", flash, body);

    function unpark(model, button) {
      return postAction(ctx, flash, button, `/models/${encodeURIComponent(model)}/unpark`, `Unpark ${model}`);
    }

    async function refresh() {
      const [summary, models] = await Promise.all([api("/summary"), api("/models")]);
      const reasons = new Map((models || []).map((m) => [m.name, m.unplaceable_reason || m.reason]));
      const n = summary.nodes;
      const r = summary.replicas;
      const m = summary.models;
      redraw(body, () => [
        h(
          "div",
          { class: "grid totals" },
          statCard("Nodes", "node-totals", [
            ["total", n.total],
            ["ready", n.ready],
            ["cordoned", n.cordoned, "warn"],
            ["draining", n.draining, "warn"],
            ["unreachable", n.unreachable, "bad"],
          ]),
          statCard("Replicas", "replica-totals", [
            ["ready", r.ready],
            ["starting", r.starting],
            ["draining", r.draining, "warn"],
            ["failed", r.failed, "bad"],
            // Ready or starting on a node that stopped reporting: not routed to.
            ["unreachable", r.unreachable, "bad"],
          ]),
          statCard("Models", "model-totals", [
            ["total", m.total],
            ["satisfied", m.satisfied],
            ["short", m.short, "bad"],
          ]),
        ),
        section("Devices by class", h("div", { id: "gpu-bars" }, classBars(summary.gpus))),
        h(
          "div",
          { class: "grid" },
          section(
            "Fabrics",
            h(
              "div",
              { id: "fabrics" },
              table(
                [
                  { label: "Fabric", cell: (f) => h("span", { class: "mono" }, f.fabric) },
                  numColumn("Nodes", "nodes"),
                  numColumn("With weights", "nodes_with_weights"),
                  numColumn("Models present", "models_present"),
                  numColumn("Largest free block (nodes)", "largest_free_block"),
                ],
                summary.fabrics,
                { empty: "No node names a fabric.", rowAttrs: (f) => ({ dataset: { fabric: f.fabric } }) },
              ),
            ),
          ),
          section(
            "Unplaceable models",
            h(
              "div",
              { id: "unplaceable" },
              summary.unplaceable.length
                ? h(
                    "ul",
                    {},
                    summary.unplaceable.map((name) =>
                      h("li", { dataset: { model: name } }, h("strong", {}, name), ": ", reasons.get(name) || "short of replicas and none starting"),
                    ),
                  )
                : h("p", { class: "empty" }, "None: every model has what it needs, or a replica on its way."),
            ),
          ),
        ),
        h(
          "div",
          { class: "grid" },
          section(
            "Parked models",
            h(
              "div",
              { id: "parked" },
              table(
                [
                  { label: "Model", cell: (p) => h("strong", {}, p.model) },
                  numColumn("Failures", "failures"),
                  { label: "Last error", cell: (p) => p.reason || "–" },
                  {
                    label: "",
                    cell: (p) => {
                      const b = h("button", { type: "button", class: "small", "aria-label": `Unpark ${p.model}` }, "Unpark");
                      b.addEventListener("click", () => unpark(p.model, b));
                      return b;
                    },
                  },
                ],
                summary.parked,
                { empty: "No parked models.", rowAttrs: (p) => ({ dataset: { model: p.model } }) },
              ),
            ),
          ),
          section(
            "Idle replicas (10 min or more)",
            h(
              "div",
              { id: "idle" },
              table(
                [
                  { label: "Replica", cell: (i) => h("a", { class: "mono", href: `#/replicas?q=${encodeURIComponent(i.id)}` }, i.id) },
                  { label: "Model", cell: (i) => i.model },
                  { label: "Idle", cls: "num", cell: (i) => fmtDuration(i.idle_seconds) },
                  numColumn("GPUs", "gpus"),
                ],
                summary.idle_replicas,
                { empty: "No idle replicas.", rowAttrs: (i) => ({ dataset: { replica: i.id } }) },
              ),
            ),
          ),
        ),
        storeSection(summary),
      ]);
    }

    return { el, refresh };
  },
};
