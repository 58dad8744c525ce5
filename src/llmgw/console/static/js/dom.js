// Building DOM nodes from data, never from HTML strings: model names, node
// names, log lines and error messages all come from outside (agents, engines,
// catalog entries), and any of them set through innerHTML would be a script
// running with the admin token in reach.

const SVG_NS = "http://www.w3.org/2000/svg";

function apply(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "on") {
      for (const [event, handler] of Object.entries(value)) el.addEventListener(event, handler);
    } else if (key === "class") {
      el.setAttribute("class", Array.isArray(value) ? value.filter(Boolean).join(" ") : value);
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (key === "value" && "value" in el) {
      el.value = value;
    } else if (key === "style") {
      // CSSOM, not the style attribute: the CSP forbids inline styles.
      Object.assign(el.style, value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** h("button", {on: {click}}, "Cordon") */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

/** SVG element, same calling convention as h(). */
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

// One formatter each, made once: Number.toLocaleString builds a new one per
// call, which on a page of 40 nodes × 8 devices was most of the render time.
const INT = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : INT.format(n);
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let v = Number(n);
  let i = 0;
  while (v >= 1000 && i < units.length - 1) {
    v /= 1000;
    i += 1;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

const pad = (n) => String(n).padStart(2, "0");

/** Local time as 2026-10-05 14:03:07: unambiguous whatever the browser's locale. */
export function fmtTime(unixSeconds) {
  if (!unixSeconds) return "–";
  const d = new Date(unixSeconds * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function fmtAgo(unixSeconds) {
  if (!unixSeconds) return "never";
  return `${fmtDuration(Date.now() / 1000 - unixSeconds)} ago`;
}

/** A <table> from column definitions [{label, cell(row) -> node|string, cls}]. */
export function table(columns, rows, { caption, empty = "Nothing to show.", rowAttrs } = {}) {
  if (!rows.length) return h("p", { class: "empty" }, empty);
  return h(
    "table",
    {},
    caption ? h("caption", {}, caption) : null,
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.cls }, c.label)))),
    h(
      "tbody",
      {},
      rows.map((row) =>
        h("tr", rowAttrs ? rowAttrs(row) : {}, columns.map((c) => h("td", { class: c.cls }, c.cell(row)))),
      ),
    ),
  );
}

/** A state word with its colour class, e.g. badge("ready"). */
export function badge(state, text) {
  return h("span", { class: ["badge", `st-${String(state).replace(/[^a-z0-9-]/gi, "")}`] }, text ?? state);
}

/** A labelled number, as the overview's tiles show them. */
export function stat(label, value, { cls } = {}) {
  return h("div", { class: ["stat", cls] }, h("span", { class: "stat-value" }, fmtInt(value)), h("span", { class: "stat-label" }, label));
}

/** A card of counts; a count flagged "warn" or "bad" is shown so only when it is not zero. */
export function statCard(title, id, counts) {
  return section(title, h("div", { class: "stats", id }, counts.map(([label, value, flag]) => stat(label, value, { cls: value ? flag : "" }))));
}

/** A table column of whole numbers, ``row[field]``, right-aligned. */
export function numColumn(label, field) {
  return { label, cls: "num", cell: (row) => fmtInt(row[field]) };
}

/** A page's element: its heading, then its parts. */
export function titled(title, ...children) {
  return h("div", {}, h("h1", {}, title), children);
}

/** A filter's search box, holding ``value`` (from the page's URL). */
export function searchBox(id, value, placeholder) {
  return h("input", { id, type: "search", value: value || "", placeholder });
}

/** A filter's choice: "any", then ``options``; set to ``value`` when it is one of them. */
export function choice(id, options, value) {
  const el = h("select", { id }, h("option", { value: "" }, "any"), options.map((o) => h("option", { value: o }, o)));
  el.value = value || "";
  return el;
}

/** A page's filters: a search form of [label, control] pairs (each label names its control's id). */
export function filterForm(fields) {
  return h(
    "form",
    { class: "filters", role: "search", on: { submit: (e) => e.preventDefault() } },
    fields.map(([label, control]) => h("div", { class: "field" }, h("label", { for: control.id }, label), control)),
  );
}

export function section(title, ...children) {
  const id = `sec-${title.toLowerCase().replace(/[^a-z0-9]+/g, "-")}`;
  return h("section", { class: "card", "aria-labelledby": id }, h("h2", { id }, title), children);
}

export function errorText(err) {
  return err && err.message ? err.message : String(err);
}

/**
 * Re-render `container` with `build()` and put keyboard focus back on the
 * element that had it (matched by id or aria-label). Pages redraw every few
 * seconds; without this a keyboard user's focus would fall back to the top
 * of the page on every refresh.
 */
export function redraw(container, build) {
  const active = document.activeElement;
  let key = null;
  if (active && active !== document.body && container.contains(active)) {
    key = active.id ? `#${CSS.escape(active.id)}` : active.getAttribute("aria-label") ? `[aria-label="${CSS.escape(active.getAttribute("aria-label"))}"]` : null;
  }
  container.replaceChildren(...[build()].flat());
  if (key) {
    const again = container.querySelector(key);
    if (again) again.focus();
  }
}
