// Models: the catalog with each model's replicas, and applying an entry.
//
// Apply is dry-run first: the Apply button stays disabled until a dry run of
// exactly the text in the box came back clean, so an operator always sees
// what will change (and what the planner will then do) before it happens.

import { api, ApiError } from "../api.js";
import { badge, errorText, fmtInt, h, numColumn, redraw, section, table, titled } from "../dom.js";
import { postAction } from "../actions.js";
import { modelTable } from "./plan.js";

const EXAMPLE = `name: my-model
engine: sim
gpu_classes: [a100-80g]
gpus: 1
min_replicas: 1
max_replicas: 2
`;

// An external model's URLs, each up, down or not yet checked by a gateway.
const URL_STATE = { up: ["ready", "up"], down: ["failed", "down"], unknown: ["starting", "not checked yet"] };

function urlList(m) {
  return h(
    "ul",
    { class: "problems" },
    m.external.map((u) => h("li", {}, h("span", { class: "mono" }, u.url), " ", badge(...URL_STATE[u.state]), u.reason ? h("span", { class: "muted" }, ` ${u.reason}`) : null)),
  );
}

/** Each base model followed by its LoRA adapters (ctl models orders them the same way). */
function underBases(models) {
  const byBase = new Map();
  for (const m of models) {
    if (!m.base) continue;
    if (!byBase.has(m.base)) byBase.set(m.base, []);
    byBase.get(m.base).push(m);
  }
  const names = new Set(models.map((m) => m.name));
  const out = [];
  for (const m of models) if (!m.base) out.push(m, ...(byBase.get(m.name) || []));
  for (const m of models) if (m.base && !names.has(m.base)) out.push(m);
  return out;
}

function modelState(m) {
  if (m.base) {
    if (m.loaded_on) return badge("ready", "loaded");
    if (m.demanded) return badge("starting", "asked for");
    return badge("draining", "idle");
  }
  if (m.external) {
    if (m.ready >= m.desired) return badge("ready", "satisfied");
    return m.ready ? badge("draining", "degraded") : badge("failed", m.starting ? "checking" : "down");
  }
  if (m.parked) return badge("parked");
  if (m.unplaceable) return badge("failed", "unplaceable");
  if (m.ready < m.desired) return badge("starting", "short");
  return badge("ready", "satisfied");
}

function shape(spec) {
  if (spec.base) return `LoRA rank ${(spec.adapter || {}).rank ?? "?"} of ${spec.base} (no devices of its own)`;
  if (spec.external) return spec.external.model ? `upstream name ${spec.external.model}` : "external";
  const parts = [`${spec.gpus} × ${spec.gpu_classes.join(" | ")}`];
  if (spec.tp > 1 || spec.pp > 1) parts.push(`tp ${spec.tp} pp ${spec.pp}`);
  if (spec.nodes > 1) parts.push(`${spec.nodes} nodes`);
  return parts.join(", ");
}

/** The lines of a validation error, one problem each (catalog.py joins them with newlines). */
function problemList(message) {
  const lines = String(message).split("\n").filter((l) => l.trim());
  return h("ul", { class: "problems" }, lines.map((l) => h("li", {}, l)));
}

function describeDiff(result) {
  // Whatever the API reports about the change, shown as lists of names.
  const out = [];
  for (const key of ["added", "changed", "unchanged"]) {
    const names = result && Array.isArray(result[key]) ? result[key] : null;
    if (names && names.length) out.push(h("li", {}, h("strong", {}, `${key}: `), names.join(", ")));
  }
  if (result && result.changed_fields) {
    for (const [name, fields] of Object.entries(result.changed_fields)) {
      if (fields.length) out.push(h("li", {}, `${name}: ${fields.join(", ")} changed`));
    }
  }
  return out.length ? h("ul", {}, out) : h("p", { class: "muted" }, "No change to the catalog.");
}

export default {
  title: "Models",
  create(ctx) {
    const flash = h("p", { class: "error", role: "alert" });
    const list = h("div", { id: "model-list" });
    const text = h("textarea", { id: "apply-text", rows: 12, spellcheck: "false", "aria-describedby": "apply-help" }, "");
    text.value = EXAMPLE;
    const dryRun = h("button", { type: "button", id: "apply-dry-run", class: "secondary" }, "Dry run");
    const apply = h("button", { type: "button", id: "apply-go", disabled: true }, "Apply");
    const result = h("div", { id: "apply-result", "aria-live": "polite" });
    let checkedText = null;

    const el = titled(
      "Models",
      flash,
      section("Catalog", list),
      section(
        "Apply a catalog entry",
        h(
          "div",
          { class: "editor" },
          h("label", { for: "apply-text" }, "Entry (YAML or JSON: one entry, a list, or models: [...])"),
          h("p", { id: "apply-help", class: "muted" }, "Dry run first: it validates the entry and shows what would change; Apply is enabled once the dry run passes."),
          text,
          h("div", { class: "actions" }, dryRun, apply),
          result,
        ),
      ),
    );

    text.addEventListener("input", () => {
      apply.disabled = text.value !== checkedText;
    });

    async function send(dry) {
      const body = text.value;
      result.replaceChildren(h("p", { class: "muted" }, dry ? "Checking…" : "Applying…"));
      dryRun.disabled = true;
      apply.disabled = true;
      try {
        const answer = await api("/apply", { method: "POST", json: { document: body, source: "console", dry_run: dry } });
        if (dry) {
          checkedText = body;
          const touched = [...answer.added, ...answer.changed];
          result.replaceChildren(
            h("p", { class: "ok" }, "Valid. Applying it would change the catalog like this:"),
            describeDiff(answer),
            ...(answer.plan && touched.length ? [h("p", {}, "and the scheduler's next pass would then do this for them:"), modelTable(answer.plan, touched)] : []),
          );
        } else {
          checkedText = null;
          result.replaceChildren(h("p", { class: "ok" }, "Applied."), describeDiff(answer));
          await ctx.refreshNow();
        }
      } catch (err) {
        checkedText = null;
        if (err instanceof ApiError && err.status === 422) {
          result.replaceChildren(h("div", { class: "error", role: "alert", id: "apply-errors" }, h("strong", {}, "The entry is not valid:"), problemList(err.message)));
        } else {
          result.replaceChildren(h("p", { class: "error", role: "alert" }, errorText(err)));
        }
      } finally {
        dryRun.disabled = false;
        apply.disabled = text.value !== checkedText;
      }
    }

    dryRun.addEventListener("click", () => send(true));
    apply.addEventListener("click", () => send(false));

    function unpark(name, button) {
      return postAction(ctx, flash, button, `/models/${encodeURIComponent(name)}/unpark`, `Unpark ${name}`);
    }

    async function refresh() {
      const [models, replicas] = await Promise.all([api("/models"), api("/replicas")]);
      const byModel = new Map();
      for (const r of replicas) {
        if (!byModel.has(r.model)) byModel.set(r.model, []);
        byModel.get(r.model).push(r);
      }
      redraw(list, () =>
        table(
          [
            {
              label: "Model",
              cell: (m) => [
                m.base ? h("span", { class: "adapter", "aria-label": `adapter of ${m.base}` }, "└ ", h("strong", {}, m.name)) : h("strong", {}, m.name),
                m.spec.aliases.length ? h("div", { class: "muted" }, `aliases: ${m.spec.aliases.join(", ")}`) : null,
              ],
            },
            { label: "Engine", cell: (m) => m.spec.engine },
            { label: "Devices per replica", cell: (m) => h("span", { class: "mono" }, shape(m.spec)) },
            { label: "Min–max", cls: "num", cell: (m) => (m.external ? "–" : `${m.min_replicas}–${m.max_replicas}${m.on_demand ? " (on demand)" : ""}`) },
            numColumn("Wanted now", "desired"),
            numColumn("Ready", "ready"),
            numColumn("Starting", "starting"),
            { label: "State", cell: (m) => modelState(m) },
            {
              label: "Replicas",
              cell: (m) => {
                if (m.external) return urlList(m);
                if (m.base) {
                  // The base's replicas that have this adapter loaded.
                  const on = (byModel.get(m.base) || []).filter((r) => (r.adapters || []).includes(m.name));
                  if (!on.length) return h("span", { class: "muted" }, "loaded nowhere");
                  return h("ul", { class: "problems" }, on.map((r) => h("li", {}, h("span", { class: "muted" }, "loaded on "), h("a", { class: "mono", href: `#/replicas?q=${encodeURIComponent(r.id)}` }, r.id))));
                }
                const rs = byModel.get(m.name) || [];
                if (!rs.length) return h("span", { class: "muted" }, "none");
                return h(
                  "ul",
                  { class: "problems" },
                  rs.map((r) => h("li", {}, h("a", { class: "mono", href: `#/replicas?q=${encodeURIComponent(r.id)}` }, r.id), " ", badge(r.state), r.asleep ? [" ", badge("draining", "asleep")] : null, " ", h("span", { class: "muted" }, r.shards.map((s) => `${s.node}:${s.devices.join(",")}`).join(" ")), (r.adapters || []).length ? h("span", { class: "muted" }, ` · ${r.adapters.length} adapter(s) loaded`) : null)),
                );
              },
            },
            {
              label: "Why",
              cell: (m) => {
                const parts = [];
                if (m.reason) parts.push(h("span", {}, m.reason));
                if (m.parked) {
                  parts.push(h("div", {}, `${fmtInt(m.failures)} failed starts in a row`));
                  const b = h("button", { type: "button", class: "small", "aria-label": `Unpark ${m.name}` }, "Unpark");
                  b.addEventListener("click", () => unpark(m.name, b));
                  parts.push(b);
                }
                return parts.length ? parts : "–";
              },
            },
          ],
          underBases(models),
          { empty: "The catalog is empty: apply an entry below.", rowAttrs: (m) => ({ dataset: { model: m.name, ...(m.base ? { base: m.base } : {}) } }) },
        ),
      );
    }

    return { el, refresh };
  },
};
