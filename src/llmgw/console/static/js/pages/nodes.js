// Nodes: each node's device map (cards, MIG instances as card/migN, CPU
// slots) coloured by state, with cordon / uncordon / drain.
//
// Only one page of nodes is ever in the DOM: at 2,000 nodes × 8 devices a
// full render is 16,000 boxes and several hundred milliseconds of layout on
// every refresh, while a page of 40 is a few milliseconds however large the
// fleet grows.
//
// State and class filters are the API's own (?state=, ?gpu_class=), so a
// filtered view downloads only what it shows. When the API pages too (it
// answers X-Total-Count for ?name=&offset=&limit=), only the shown page is
// fetched; otherwise the page filters and pages the full list here.

import { apiWithHeaders } from "../api.js";
import { postAction } from "../actions.js";
import { badge, choice, filterForm, fmtAgo, fmtInt, h, redraw, searchBox, titled } from "../dom.js";

const PAGE_SIZE = 40;
const STATES = ["ready", "cordoned", "draining", "unreachable"];
const STATUS_TEXT = { free: "free", used: "used", unhealthy: "unhealthy", unplaceable: "out of placement" };
const STATUS_CLASS = { free: "dev-free", used: "dev-used", unhealthy: "dev-unhealthy", unplaceable: "dev-outplace" };

/** Devices grouped by the card they live on (MIG instances under their card), in card order. */
function groupByCard(devices) {
  const groups = new Map();
  const order = (d) => (d.gpu_class === "cpu" ? 1e9 : d.number >= 1000 ? Math.floor((d.number - 1000) / 100) : d.number);
  for (const d of [...devices].sort((a, b) => order(a) - order(b) || a.number - b.number)) {
    const key = d.gpu_class === "cpu" ? "cpu" : `card ${order(d)}`;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(d);
  }
  return groups;
}

/** One device; `heat` is its card's temperature and power when the box stands for the card. */
function deviceBox(d, heat) {
  const detail =
    d.status === "used"
      ? h("a", { href: `#/replicas?q=${encodeURIComponent(d.used_by)}`, class: "mono" }, d.used_by)
      : STATUS_TEXT[d.status] || d.status;
  const title = [
    `${d.label} · ${d.gpu_class}`,
    d.name,
    `${fmtInt(d.memory_used_mib)} / ${fmtInt(d.memory_total_mib)} MiB`,
    d.utilization_pct === null ? "utilisation: not reported" : `utilisation ${d.utilization_pct} %`,
    d.status === "used" ? `used by ${d.used_by}` : STATUS_TEXT[d.status],
    ...(d.unhealthy_reasons || []),
    d.unplaceable_reason || "",
  ]
    .filter(Boolean)
    .join("\n");
  return h(
    "li",
    { class: ["dev", STATUS_CLASS[d.status]], title, dataset: { device: d.label, status: d.status } },
    h("span", { class: "dev-label mono" }, d.label),
    h("span", { class: "dev-kind" }, d.mig_profile || (d.gpu_class === "cpu" ? "cpu slot" : d.gpu_class)),
    h("br"),
    h("span", { class: "dev-state" }, d.status === "used" ? ["used by ", detail] : detail),
    heat ? [h("br"), h("span", { class: "dev-heat" }, heat)] : null,
  );
}

function cardHeat(devs) {
  // Temperature and power are the card's, also for its MIG instances.
  const d = devs[0];
  const parts = [];
  if (d.temperature_c !== null && d.temperature_c !== undefined) parts.push(`${d.temperature_c} °C`);
  if (d.power_w !== null && d.power_w !== undefined) parts.push(`${Math.round(d.power_w)} W`);
  return parts.join(" · ");
}

function deviceMap(node) {
  if (!node.devices.length) return h("p", { class: "empty" }, "No devices reported.");
  const groups = groupByCard(node.devices);
  const reasons = [];
  for (const d of node.devices) {
    if (d.status === "unhealthy") reasons.push(h("li", {}, h("strong", {}, d.label), ` unhealthy: ${(d.unhealthy_reasons || []).join("; ") || "reported unhealthy"}`));
    else if (d.status === "unplaceable") reasons.push(h("li", {}, h("strong", {}, d.label), ` out of placement: ${d.unplaceable_reason || "not placeable"}`));
  }
  return h(
    "div",
    {},
    h(
      "div",
      { class: "cards" },
      [...groups.entries()].map(([key, devs]) => {
        const mig = devs.some((d) => d.number >= 1000);
        // A whole card is one box with its own heat line; only a card in
        // MIG mode (and the CPU slots) needs a frame around several boxes.
        if (!mig && key !== "cpu" && devs.length === 1) {
          return h("ul", { class: "devices", "aria-label": `${node.name} ${key}`, dataset: { card: key } }, deviceBox(devs[0], cardHeat(devs)));
        }
        return h(
          "div",
          { class: "gpu-card", dataset: { card: key } },
          h(
            "div",
            { class: "gpu-card-head" },
            h("strong", {}, key === "cpu" ? "CPU slots" : key),
            mig ? h("span", {}, "MIG") : null,
            h("span", {}, cardHeat(devs)),
          ),
          h("ul", { class: "devices", "aria-label": `${node.name} ${key} devices` }, devs.map((d) => deviceBox(d))),
        );
      }),
    ),
    reasons.length ? h("ul", { class: "reasons" }, reasons) : null,
  );
}

function classSummary(node) {
  return node.classes.map((c) => `${c.gpu_class}: ${c.free}/${c.total} free`).join(" · ");
}

export default {
  title: "Nodes",
  create(ctx) {
    const p = ctx.params;
    const q = searchBox("node-q", p.get("q"), "part of a name");
    const state = choice("node-state", STATES, p.get("state"));
    const cls = choice("node-class", []);
    let classValue = p.get("class") || "";
    let page = Math.max(0, Number(p.get("page") || 0) | 0);
    const flash = h("p", { class: "error", role: "alert" });
    const count = h("span", { id: "node-count", role: "status" });
    const prev = h("button", { type: "button", class: "secondary" }, "Previous");
    const next = h("button", { type: "button", class: "secondary" }, "Next");
    const list = h("div", { class: "node-list", id: "node-list" });
    let nodes = [];
    // Set when the API paged for us: the fleet's size for the filters given.
    let serverTotal = null;
    // The fleet's size as the API reports it beside a filtered page.
    let serverFleet = null;
    let debounce = null;
    // Two clicks for drain: it moves every replica off the node.
    let armedDrain = null;

    const el = titled(
      "Nodes",
      filterForm([
        ["Name", q],
        ["State", state],
        ["Device class", cls],
      ]),
      h(
        "div",
        { class: "legend" },
        h("span", {}, h("span", { class: "swatch sw-free" }), "free"),
        h("span", {}, h("span", { class: "swatch sw-used" }), "used by a replica"),
        h("span", {}, h("span", { class: "swatch sw-unhealthy" }), "unhealthy"),
        h("span", {}, h("span", { class: "swatch sw-outplace" }), "out of placement"),
      ),
      flash,
      h("div", { class: "pager" }, prev, next, count),
      list,
    );

    function filtered() {
      if (serverTotal !== null) return nodes;
      const needle = q.value.trim().toLowerCase();
      return nodes.filter(
        (n) =>
          (!needle || n.name.toLowerCase().includes(needle)) &&
          (!state.value || n.state === state.value) &&
          (!classValue || n.classes.some((c) => c.gpu_class === classValue)),
      );
    }

    function act(node, verb, button) {
      return postAction(ctx, flash, button, `/nodes/${encodeURIComponent(node)}/${verb}`, `${verb} ${node}`);
    }

    function actions(n) {
      const out = [];
      const add = (verb, label, cls) => {
        const b = h("button", { type: "button", class: ["small", cls], "aria-label": `${label} ${n.name}` }, label);
        b.addEventListener("click", () => act(n.name, verb, b));
        out.push(b);
      };
      if (n.admin_state === "ready") add("cordon", "Cordon", "secondary");
      if (n.admin_state !== "ready") add("uncordon", "Uncordon", "secondary");
      if (n.admin_state !== "draining") {
        const armed = armedDrain === n.name;
        const b = h("button", { type: "button", class: ["small", "danger"], "aria-label": `${armed ? "Confirm drain of" : "Drain"} ${n.name}` }, armed ? "Confirm drain" : "Drain");
        b.addEventListener("click", () => {
          if (armedDrain === n.name) {
            armedDrain = null;
            act(n.name, "drain", b);
          } else {
            // Armed for a few seconds only: a confirm button left waiting
            // is a drain one stray click away.
            armedDrain = n.name;
            setTimeout(() => {
              if (armedDrain === n.name) {
                armedDrain = null;
                render();
              }
            }, 8000);
            render();
          }
        });
        out.push(b);
      }
      return h("div", { class: "actions" }, out);
    }

    function nodeCard(n) {
      const products = [...new Set(n.devices.filter((d) => d.gpu_class !== "cpu").map((d) => d.name.replace(/ MIG .*/, "")))];
      const meta = [
        products.join(", ") || null,
        n.fabrics.length ? `fabric ${n.fabrics.join(", ")}` : "no fabric",
        n.address,
        `last report ${fmtAgo(n.last_seen)}`,
        n.driver_version ? `driver ${n.driver_version}` : null,
      ].filter(Boolean);
      return h(
        "article",
        { class: "node", dataset: { node: n.name, state: n.state }, "aria-label": `node ${n.name}` },
        h("div", { class: "node-head" }, h("h3", { class: "mono" }, n.name), badge(n.state), actions(n)),
        h("div", { class: "node-meta" }, meta.join(" · "), h("br"), classSummary(n)),
        n.warnings.length ? h("ul", { class: "reasons" }, n.warnings.map((w) => h("li", {}, w))) : null,
        deviceMap(n),
      );
    }

    function render() {
      const rows = filtered();
      const matching = serverTotal ?? rows.length;
      const pages = Math.max(1, Math.ceil(matching / PAGE_SIZE));
      page = Math.min(page, pages - 1);
      const shown = serverTotal !== null ? rows : rows.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE);
      const filtering = q.value.trim() || state.value || classValue;
      count.textContent = matching
        ? `${fmtInt(page * PAGE_SIZE + 1)}–${fmtInt(page * PAGE_SIZE + shown.length)} of ${fmtInt(matching)} nodes` +
          // The fleet's size, when it is what was loaded (no API-side filter).
          (() => {
            const all = serverTotal === null ? nodes.length : serverFleet;
            return !state.value && !classValue && all !== null && matching !== all ? ` (${fmtInt(all)} in all)` : "";
          })()
        : filtering
          ? "0 nodes match."
          : "No node has registered yet.";
      prev.disabled = page === 0;
      next.disabled = page >= pages - 1;
      redraw(list, () => (shown.length ? shown.map(nodeCard) : [h("p", { class: "empty" }, filtering ? "No node matches these filters." : "Nodes appear here once their agent registers (llmgw agent --join-token ...).")]));
      ctx.setParams({ q: q.value.trim(), state: state.value, class: classValue, page: page ? String(page) : "" });
    }

    // Filters the API applies need a new fetch; the name filter redraws at
    // once from what is loaded (and refetches shortly after when the API pages).
    function refetch() {
      page = 0;
      render();
      ctx.refreshNow();
    }

    function turnPage(delta) {
      page += delta;
      if (serverTotal !== null) ctx.refreshNow();
      else render();
    }

    q.addEventListener("input", () => {
      page = 0;
      if (serverTotal === null) {
        render();
        return;
      }
      clearTimeout(debounce);
      debounce = setTimeout(() => ctx.refreshNow(), 250);
    });
    state.addEventListener("change", refetch);
    cls.addEventListener("change", () => {
      classValue = cls.value;
      refetch();
    });
    prev.addEventListener("click", () => turnPage(-1));
    next.addEventListener("click", () => turnPage(1));

    // Classes seen on any node so far: a class filter narrows the list to
    // that class, which must not take the other classes out of the menu.
    const seen = new Set();

    function updateClasses() {
      for (const n of nodes) for (const c of n.classes) seen.add(c.gpu_class);
      if (classValue) seen.add(classValue);
      const wanted = [...seen].sort();
      const have = [...cls.options].slice(1).map((o) => o.value);
      if (wanted.join("\n") === have.join("\n")) return;
      cls.replaceChildren(h("option", { value: "" }, "any"), ...wanted.map((c) => h("option", { value: c }, c)));
      cls.value = wanted.includes(classValue) ? classValue : "";
    }

    async function refresh() {
      const { body, headers } = await apiWithHeaders("/nodes", {
        query: { state: state.value, gpu_class: classValue, name: q.value.trim(), offset: page * PAGE_SIZE, limit: PAGE_SIZE },
      });
      const total = headers.get("X-Total-Count");
      serverTotal = total === null ? null : Number(total);
      const fleet = headers.get("X-Fleet-Count");
      serverFleet = fleet === null ? null : Number(fleet);
      nodes = body;
      updateClasses();
      render();
    }

    return { el, refresh };
  },
};
