// Events: placements, evictions, failures, parking, drains, leader changes,
// newest first, filterable by kind, subject and text.

import { api } from "../api.js";
import { badge, choice, filterForm, fmtInt, fmtTime, h, redraw, searchBox, table, titled } from "../dom.js";

const LIMIT = 500;

export default {
  title: "Events",
  create(ctx) {
    const p = ctx.params;
    const kind = choice("event-kind", []);
    let kindValue = p.get("kind") || "";
    const subject = searchBox("event-subject", p.get("subject"), "model, replica or node");
    const text = searchBox("event-text", p.get("text"), "words in the message");
    const count = h("p", { class: "muted", id: "event-count", role: "status" });
    const list = h("div", { id: "event-list" });
    let events = [];
    const kinds = new Set();

    const el = titled(
      "Events",
      filterForm([
        ["Kind", kind],
        ["Subject", subject],
        ["Message contains", text],
      ]),
      count,
      list,
    );

    function render() {
      const subj = subject.value.trim().toLowerCase();
      const words = text.value.trim().toLowerCase();
      const rows = events.filter(
        (e) =>
          (!kindValue || e.kind === kindValue) &&
          (!subj || (e.subject || "").toLowerCase().includes(subj)) &&
          (!words || e.message.toLowerCase().includes(words)),
      );
      count.textContent = `${fmtInt(rows.length)} of the last ${fmtInt(events.length)} ${kindValue ? `${kindValue} ` : ""}events`;
      redraw(list, () =>
        table(
          [
            { label: "When", cell: (e) => h("time", { datetime: new Date(e.at * 1000).toISOString() }, fmtTime(e.at)) },
            { label: "Kind", cell: (e) => badge(["failed", "parked"].includes(e.kind) ? e.kind : "kind", e.kind) },
            { label: "Subject", cell: (e) => h("span", { class: "mono" }, e.subject || "") },
            { label: "Message", cell: (e) => e.message },
          ],
          rows,
          { empty: "No event matches.", rowAttrs: (e) => ({ dataset: { kind: e.kind } }) },
        ),
      );
      ctx.setParams({ kind: kindValue, subject: subject.value.trim(), text: text.value.trim() });
    }

    function updateKinds() {
      const before = kinds.size;
      for (const e of events) kinds.add(e.kind);
      if (kindValue) kinds.add(kindValue);
      if (kinds.size === before && kind.options.length > 1) return;
      kind.replaceChildren(h("option", { value: "" }, "any"), ...[...kinds].sort().map((k) => h("option", { value: k }, k)));
      kind.value = kindValue;
    }

    kind.addEventListener("change", () => {
      kindValue = kind.value;
      render();
      ctx.refreshNow();
    });
    subject.addEventListener("input", render);
    text.addEventListener("input", render);

    async function refresh() {
      // The kind is the API's filter, so "parked" finds the last 500 parkings,
      // not the parkings among the last 500 events.
      const answer = await api("/events", { query: { limit: LIMIT, kind: kindValue } });
      // The API answers oldest first; the log reads newest first.
      events = [...answer].reverse();
      updateKinds();
      render();
    }

    return { el, refresh };
  },
};
