// radixgen console: the radix tree snapshot of /v1/radix_tree drawn as SVG, one block per namespace,
// edges left to right (an edge's box shows its text preview, tokens, hits and idle time on the tree's clock).
"use strict";

const NODE_W = 230, NODE_H = 40, COL_GAP = 36, ROW_GAP = 10, NS_GAP = 34, NS_HEAD = 22;

function drawTree(container, tree) {
  container.replaceChildren();
  if (!tree.nodes.length) {
    const p = document.createElement("p");
    p.className = "tree-empty";
    p.textContent = "The radix cache is empty: finished requests leave their prefixes here.";
    container.appendChild(p);
    return;
  }
  const children = new Map(), byNs = new Map();
  for (const n of tree.nodes) {
    if (n.parent === null) {
      if (!byNs.has(n.namespace)) byNs.set(n.namespace, []);
      byNs.get(n.namespace).push(n);
    } else {
      if (!children.has(n.parent)) children.set(n.parent, []);
      children.get(n.parent).push(n);
    }
  }
  // rows: each leaf takes a row; a parent sits level with the middle of its children
  const pos = new Map();
  let row = 0, maxDepth = 0, y = 0;
  const blocks = [];
  function place(n) {
    maxDepth = Math.max(maxDepth, n.depth);
    const kids = children.get(n.id) || [];
    if (!kids.length) { pos.set(n.id, row++); return pos.get(n.id); }
    const rows = kids.map(place);
    pos.set(n.id, (rows[0] + rows[rows.length - 1]) / 2);
    return pos.get(n.id);
  }
  const order = tree.namespaces.filter(ns => byNs.has(ns));
  for (const ns of order) {
    const start = row;
    byNs.get(ns).forEach(place);
    blocks.push({ns, start, rows: row - start, y});
    y += NS_HEAD + (row - start) * (NODE_H + ROW_GAP) + NS_GAP;
  }
  const width = (maxDepth + 1) * (NODE_W + COL_GAP) + 10;
  const svg = svgEl("svg", {width, height: y, role: "img", "aria-label": "radix tree"});
  for (const b of blocks) {
    svg.appendChild(svgEl("text", {x: 0, y: b.y + 14, class: "ns-label"}, `namespace: ${b.ns}`));
    const top = b.y + NS_HEAD - b.start * (NODE_H + ROW_GAP);
    const xy = n => [n.depth * (NODE_W + COL_GAP), top + pos.get(n.id) * (NODE_H + ROW_GAP)];
    for (const n of tree.nodes.filter(m => m.namespace === b.ns)) {
      const [x, yy] = xy(n);
      for (const c of children.get(n.id) || []) {
        const [cx, cy] = xy(c);
        const x0 = x + NODE_W, y0 = yy + NODE_H / 2, y1 = cy + NODE_H / 2, mid = (x0 + cx) / 2;
        svg.appendChild(svgEl("path", {class: "edge", d: `M${x0},${y0} C${mid},${y0} ${mid},${y1} ${cx},${y1}`}));
      }
      svg.appendChild(nodeBox(n, x, yy));
    }
  }
  container.appendChild(svg);
}

function nodeBox(n, x, y) {
  const g = svgEl("g", {class: "node" + (n.locked ? " locked" : ""), transform: `translate(${x},${y})`,
                         "data-node-id": n.id});
  g.appendChild(svgEl("rect", {width: NODE_W, height: NODE_H, rx: 6}));
  const preview = n.text === null ? "(text hidden: salted namespace)" : JSON.stringify(n.text).slice(1, -1);
  g.appendChild(svgEl("text", {x: 8, y: 16, class: "preview"}, clip(preview, 32)));
  const stats = `${n.tokens} tok · ${n.subtree_tokens} below · ${n.hits} hit${n.hits === 1 ? "" : "s"}` +
                ` · idle ${n.idle_ticks}`;
  g.appendChild(svgEl("text", {x: 8, y: 32, class: "stats"}, stats));
  if (n.hidden_children > 0) {
    g.appendChild(svgEl("text", {x: NODE_W + 4, y: NODE_H / 2 + 4, class: "more"}, `+${n.hidden_children}`));
  }
  const title = svgEl("title", {}, `${n.text === null ? "" : n.text}\n` +
    `prefix ${n.prefix_len} tokens, this edge ${n.tokens}, subtree ${n.subtree_tokens}; ${n.hits} hits; ` +
    `last used ${n.idle_ticks} tree operations ago${n.locked ? "; held by a running request" : ""}`);
  g.appendChild(title);
  return g;
}

function clip(s, n) { return s.length <= n ? s : s.slice(0, n - 1) + "…"; }
