// Plan: the reconciler's next pass as a dry run (GET /plan), and "what if I
// add this model" (POST /plan with a pasted entry). Both are the planner's
// own answer; the page only lays it out.

import { api, ApiError } from "../api.js";
import { badge, errorText, fmtInt, h, numColumn, redraw, section, statCard, table, titled } from "../dom.js";

const STATUS_BADGE = {
  satisfied: "ready",
  placing: "starting",
  "backing off": "draining",
  "cannot fit now": "failed",
  "can never fit": "failed",
  parked: "parked",
};

function statusBadge(status) {
  return badge(STATUS_BADGE[status] || "kind", status);
}

function replicaLine(r) {
  const extra = [r.fabric ? `fabric ${r.fabric}` : null, r.score != null ? `score ${r.score.toFixed(2)}` : null, r.why].filter(Boolean).join(", ");
  return h(
    "li",
    { dataset: { action: r.action } },
    h("strong", {}, r.action),
    " ",
    h("span", { class: "mono" }, r.devices.join(" ") || "–"),
    r.action === "place" ? null : h("span", { class: "muted" }, ` ${r.id}`),
    extra ? h("span", { class: "muted" }, ` (${extra})`) : null,
  );
}

function candidates(m) {
  if (!m.candidates.length) return null;
  return h(
    "details",
    {},
    h("summary", {}, `Best ${m.candidates.length} candidate node${m.candidates.length === 1 ? "" : "s"}`),
    table(
      [
        { label: "Node", cell: (c) => h("span", { class: "mono" }, c.node) },
        { label: "Class", cell: (c) => h("span", { class: "mono" }, c.gpu_class) },
        { label: "Score", cls: "num", cell: (c) => c.score.toFixed(3) },
        { label: "Parts", cell: (c) => Object.entries(c.scores).map(([k, v]) => `${k} ${v.toFixed(2)}`).join(", ") },
      ],
      m.candidates,
    ),
  );
}

// Nodes placement passes over for this model after failures there. Without
// them, a plan that skips the node holding the weights looks like a bug.
function avoidedList(m) {
  const lines = m.avoided || [];
  if (!lines.length) return null;
  return h(
    "div",
    { class: "avoided" },
    h("span", { class: "muted" }, "Nodes avoided after failures:"),
    h("ul", { class: "problems" }, lines.map((line) => h("li", {}, line))),
  );
}

/** The per-model table of a plan; `only` limits it to some models (what-if). */
export function modelTable(plan, only) {
  const models = only ? plan.models.filter((m) => only.includes(m.name)) : plan.models;
  return table(
    [
      { label: "Model", cell: (m) => h("strong", {}, m.name) },
      { label: "Status", cell: (m) => statusBadge(m.status) },
      numColumn("Wanted", "desired"),
      numColumn("Has", "current"),
      {
        label: "Where",
        cell: (m) => [m.replicas.length ? h("ul", { class: "problems" }, m.replicas.map(replicaLine)) : h("span", { class: "muted" }, "nowhere"), candidates(m)],
      },
      { label: "Why not", cell: (m) => [m.reason || "", avoidedList(m)] },
    ],
    models,
    { empty: "No models in the catalog.", rowAttrs: (m) => ({ dataset: { model: m.name, status: m.status } }) },
  );
}

export function deviceTable(plan) {
  return table(
    [
      { label: "Class", cell: (d) => h("span", { class: "mono" }, d.gpu_class) },
      numColumn("Total", "total"),
      numColumn("Used", "used"),
      numColumn("Unhealthy", "unhealthy"),
      numColumn("Out of placement", "out_of_placement"),
      numColumn("Free", "free"),
      numColumn("Free on ready nodes", "free_ready"),
      numColumn("Free after this plan", "free_after"),
    ],
    plan.devices,
    { empty: "No devices.", rowAttrs: (d) => ({ dataset: { class: d.gpu_class } }) },
  );
}

function problemList(message) {
  return h("ul", { class: "problems" }, String(message).split("\n").filter((l) => l.trim()).map((l) => h("li", {}, l)));
}

const EXAMPLE = `name: what-if-model
engine: vllm
gpu_classes: [h100-80g]
gpus: 2
tp: 2
`;

export default {
  title: "Plan",
  create() {
    const overview = h("div", { id: "plan-overview" });
    const devices = h("div", { id: "plan-devices" });
    const models = h("div", { id: "plan-models" });
    const text = h("textarea", { id: "whatif-text", rows: 8, spellcheck: "false" });
    text.value = EXAMPLE;
    const run = h("button", { type: "button", id: "whatif-run" }, "What if");
    const result = h("div", { id: "whatif-result", "aria-live": "polite" });

    async function whatIf() {
      run.disabled = true;
      result.replaceChildren(h("p", { class: "muted" }, "Planning…"));
      try {
        const plan = await api("/plan", { method: "POST", json: { document: text.value, source: "what-if" } });
        const added = plan.what_if || [];
        result.replaceChildren(
          h("p", {}, `With ${added.join(", ")} added, the next pass would make ${fmtInt(plan.placements)} placement(s) and ${fmtInt(plan.removals)} removal(s):`),
          modelTable(plan, added),
          h("h3", {}, "Devices after it"),
          deviceTable(plan),
        );
      } catch (err) {
        result.replaceChildren(
          err instanceof ApiError && err.status === 422
            ? h("div", { class: "error", role: "alert", id: "whatif-errors" }, h("strong", {}, "The entry is not valid:"), problemList(err.message))
            : h("p", { class: "error", role: "alert" }, errorText(err)),
        );
      } finally {
        run.disabled = false;
      }
    }
    run.addEventListener("click", whatIf);

    const el = titled(
      "Plan",
      h("p", { class: "muted" }, "What the scheduler's next pass would do, computed by the same code as the pass itself. Nothing here changes the fleet."),
      overview,
      section("Devices by class", devices),
      section("Models", models),
      section(
        "What if",
        h(
          "div",
          { class: "editor" },
          h("label", { for: "whatif-text" }, "Model entry to try (YAML or JSON; nothing is applied)"),
          text,
          h("div", { class: "actions" }, run),
          result,
        ),
      ),
    );

    async function refresh() {
      const plan = await api("/plan");
      redraw(overview, () =>
        h(
          "div",
          { class: "grid" },
          statCard("Next pass", "plan-totals", [
            ["placements", plan.placements],
            ["removals", plan.removals],
            ["unplaceable", plan.unplaceable.length, "bad"],
          ]),
          statCard("Nodes", "plan-nodes", Object.entries(plan.nodes).sort()),
        ),
      );
      redraw(devices, () => deviceTable(plan));
      redraw(models, () => modelTable(plan));
    }

    return { el, refresh };
  },
};
