// Hand-drawn SVG: a stacked bar and a time-series line chart. A charting
// library would be the largest file the console ships and one more thing to
// vendor for air-gapped installs; these two shapes are all it needs.

import { fmtInt, h, s } from "./dom.js";

/**
 * A horizontal stacked bar. parts: [{value, cls, label}] in drawing order.
 * The figures are also written out beside it, so the bar is never the only
 * way to read them (screen readers, colour blindness).
 */
export function stackedBar(parts, total, description) {
  const svg = s("svg", { viewBox: "0 0 1000 18", preserveAspectRatio: "none", role: "img", "aria-label": description });
  svg.append(s("rect", { x: 0, y: 0, width: 1000, height: 18, fill: "#eef1f4" }));
  let x = 0;
  for (const part of parts) {
    if (!total || !part.value) continue;
    const w = (part.value / total) * 1000;
    svg.append(s("rect", { x, y: 0, width: w, height: 18, class: part.cls }, s("title", {}, `${part.label}: ${fmtInt(part.value)}`)));
    x += w;
  }
  return h("div", { class: "bar" }, svg);
}

// Distinguishable on white and for the common colour blindnesses (Okabe-Ito).
const PALETTE = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000", "#8c6d31"];

export function colour(i) {
  return PALETTE[i % PALETTE.length];
}

/** A round top for the y axis whose quarters are round too (1, 2, 2.5 or 5 × 10^k each). */
function niceMax(v) {
  if (v <= 0) return 4;
  const quarter = v / 4;
  const p = 10 ** Math.floor(Math.log10(quarter));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= quarter) return 4 * m * p;
  return 40 * p;
}

function shortNum(v) {
  if (v >= 1e9) return `${+(v / 1e9).toFixed(1)}G`;
  if (v >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
  if (v >= 1e3) return `${+(v / 1e3).toFixed(1)}k`;
  return `${+v.toFixed(1)}`;
}

function clock(t) {
  const d = new Date(t * 1000);
  return `${String(d.getHours()).padStart(2, "0")}:${String(d.getMinutes()).padStart(2, "0")}`;
}

/**
 * A line chart of several series over time.
 * series: [{name, points: [[unixSeconds, value], ...]}], all on one x range
 * [from, to]. Returns a <figure> with the chart, a legend and a caption.
 */
export function lineChart(title, series, { from, to, unit = "", colourOf } = {}) {
  // One colour per name across every chart of a page, so "embed" is the
  // same line in the requests chart and in the tokens chart.
  const pick = (se, i) => colour(colourOf ? colourOf(se.name) : i);
  const W = 640;
  const H = 220;
  const L = 48;
  const R = 10;
  const T = 10;
  const B = 24;
  const all = series.flatMap((se) => se.points);
  const x0 = from ?? Math.min(...all.map((p) => p[0]));
  const x1 = Math.max(to ?? Math.max(...all.map((p) => p[0])), x0 + 60);
  const yMax = niceMax(Math.max(0, ...all.map((p) => p[1])));
  const X = (t) => L + ((t - x0) / (x1 - x0)) * (W - L - R);
  const Y = (v) => T + (1 - v / yMax) * (H - T - B);
  const total = all.reduce((acc, p) => acc + p[1], 0);
  const svg = s("svg", {
    viewBox: `0 0 ${W} ${H}`,
    preserveAspectRatio: "none",
    role: "img",
    "aria-label": `${title}: ${series.length} series, ${fmtInt(total)}${unit ? ` ${unit}` : ""} in all`,
  });
  for (let i = 0; i <= 4; i += 1) {
    const v = (yMax * i) / 4;
    svg.append(s("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "gridline" }));
    svg.append(s("text", { x: L - 4, y: Y(v) + 4, "text-anchor": "end" }, shortNum(v)));
  }
  for (let i = 0; i <= 4; i += 1) {
    const t = x0 + ((x1 - x0) * i) / 4;
    svg.append(s("text", { x: X(t), y: H - 6, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" }, clock(t)));
  }
  svg.append(s("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  svg.append(s("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  series.forEach((se, i) => {
    const pts = [...se.points].sort((a, b) => a[0] - b[0]);
    if (pts.length === 1) {
      svg.append(s("circle", { cx: X(pts[0][0]), cy: Y(pts[0][1]), r: 3, fill: pick(se, i) }, s("title", {}, `${se.name}: ${fmtInt(pts[0][1])}`)));
      return;
    }
    const d = pts.map((p, j) => `${j ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
    svg.append(s("path", { d, class: "series", stroke: pick(se, i), "vector-effect": "non-scaling-stroke" }, s("title", {}, se.name)));
  });
  const legend = h(
    "div",
    { class: "legend" },
    series.map((se, i) => {
      const sum = se.points.reduce((acc, p) => acc + p[1], 0);
      const sw = h("span", { class: "swatch" });
      sw.style.background = pick(se, i);
      return h("span", {}, sw, `${se.name} (${fmtInt(sum)})`);
    }),
  );
  return h("figure", { class: "chart card" }, h("figcaption", {}, h("h3", {}, title)), series.length ? svg : h("p", { class: "empty" }, "No data in this range."), legend);
}
