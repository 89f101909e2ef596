// Hand-drawn SVG charts (no library: the page works offline): a line chart with event markers, and the
// planner's stacked bar. Both take the numbers they draw from the server's JSON.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
  "#4b5563", "#65a30d", "#7c3aed", "#0d9488"];

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function ticks(lo, hi, n) {
  if (!(hi > lo)) return [lo];
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
  const m = [1, 2, 5, 10].find((k) => (hi - lo) / (k * step) <= n) * step;
  const out = [];
  for (let v = Math.ceil(lo / m) * m; v <= hi + 1e-12; v += m) out.push(+v.toPrecision(12));
  return out;
}

function short(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + "k";
  return +v.toPrecision(4) + "";
}

// series: [{name, points: [[step, value], ...]}]; markers: [{x, label}] (guard interventions, warnings).
function lineChart(opts) {
  const W = 640, H = 260, L = 56, R = 12, T = 12, B = 28;
  const all = opts.series.flatMap((s) => s.points);
  const box = el("figure", {class: "chart", "data-testid": opts.testid, "data-points": opts.count ?? all.length});
  box.append(el("figcaption", {}, opts.title));
  if (!all.length) {
    box.append(el("p", {class: "muted"}, "no points yet"));
    return box;
  }
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;  // loops: a long run has 10^5 points
  for (const [x, y] of all) {
    if (x < x0) x0 = x;
    if (x > x1) x1 = x;
    if (y < y0) y0 = y;
    if (y > y1) y1 = y;
  }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const g = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": opts.title + ": " +
    opts.series.map((s) => `${s.name}, ${s.points.length} points, last ${s.points.length ?
      short(s.points[s.points.length - 1][1]) : "none"}`).join("; ")});
  for (const v of ticks(y0, y1, 5)) {
    g.append(svg("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid"}));
    g.append(svg("text", {x: L - 6, y: sy(v) + 4, "text-anchor": "end", class: "tick"}, short(v)));
  }
  for (const v of ticks(x0, x1, 6)) {
    g.append(svg("text", {x: sx(v), y: H - 8, "text-anchor": "middle", class: "tick"}, short(v)));
  }
  for (const m of opts.markers || []) {
    const line = svg("line", {x1: sx(m.x), x2: sx(m.x), y1: T, y2: H - B, class: "marker " + (m.kind || "")});
    line.append(svg("title", {}, m.label));
    g.append(line);
  }
  opts.series.forEach((s, i) => {
    const d = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join("");
    g.append(svg("path", {d, fill: "none", stroke: PALETTE[i % PALETTE.length], "stroke-width": 2}));
    if (s.points.length === 1) {
      g.append(svg("circle", {cx: sx(s.points[0][0]), cy: sy(s.points[0][1]), r: 3,
        fill: PALETTE[i % PALETTE.length]}));
    }
  });
  box.append(g);
  if (opts.series.length > 1 || (opts.markers || []).length) {
    box.append(el("p", {class: "legend"},
      opts.series.map((s, i) => el("span", {}, el("i", {style: `background:${PALETTE[i % PALETTE.length]}`}),
        s.name)),
      (opts.markers || []).length ? el("span", {}, el("i", {class: "marker-key"}), "guard / warning") : null));
  }
  return box;
}

// parts: [{name, bytes}], limit: usable bytes. A horizontal stacked bar with a line at the limit.
function stackedBar(parts, limit, testid) {
  const W = 640, H = 56, total = parts.reduce((a, p) => a + p.bytes, 0);
  const scale = Math.max(total, limit || 0) || 1;
  const g = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "data-testid": testid,
    "aria-label": "per-device memory by component: " + parts.map((p) => `${p.name} ${gib(p.bytes)}`).join(", ")});
  let x = 0;
  parts.forEach((p, i) => {
    const w = p.bytes / scale * W;
    const r = svg("rect", {x, y: 8, width: Math.max(w, 0), height: 32, fill: PALETTE[i % PALETTE.length],
      "data-part": p.name, "data-bytes": p.bytes});
    r.append(svg("title", {}, `${p.name}: ${gib(p.bytes)}`));
    g.append(r);
    x += w;
  });
  if (limit) {
    const lx = Math.min(limit / scale * W, W - 1);
    g.append(svg("line", {x1: lx, x2: lx, y1: 2, y2: 46, class: "limit"}));
    g.append(svg("text", {x: Math.max(lx - 4, 40), y: 54, "text-anchor": "end", class: "tick"}, "usable"));
  }
  return g;
}
