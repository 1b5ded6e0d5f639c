// radixgen console: small SVG line charts of a metric over the last polls (no library).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// points: [{t: seconds, v: number}], oldest first. The y axis starts at 0 and ends at opts.max (or the largest
// value seen); the current value is printed above the line with opts.format.
function drawLineChart(container, points, opts) {
  const width = 300, height = 70, pad = 4;
  container.replaceChildren();
  const now = document.createElement("div");
  now.className = "now";
  const last = points.length ? points[points.length - 1].v : null;
  now.textContent = last === null ? "–" : opts.format(last);
  container.appendChild(now);
  const svg = svgEl("svg", {viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none"});
  svg.appendChild(svgEl("line", {x1: 0, y1: height - pad, x2: width, y2: height - pad, stroke: "#dde1e6"}));
  if (points.length >= 2) {
    const t0 = points[0].t, t1 = points[points.length - 1].t;
    const top = opts.max !== undefined ? opts.max : Math.max(1e-9, ...points.map(p => p.v));
    const x = t => (t1 === t0 ? 0 : (t - t0) / (t1 - t0)) * width;
    const y = v => height - pad - (Math.min(v, top) / top) * (height - 2 * pad);
    const coords = points.map(p => `${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`);
    svg.appendChild(svgEl("polygon", {points: `0,${height - pad} ${coords.join(" ")} ${width},${height - pad}`,
                                      fill: opts.color, "fill-opacity": 0.12}));
    svg.appendChild(svgEl("polyline", {points: coords.join(" "), fill: "none", stroke: opts.color,
                                       "stroke-width": 1.5, "vector-effect": "non-scaling-stroke"}));
  }
  container.appendChild(svg);
}
