// radixgen console: the playground (a streamed chat over /v1/chat/completions) and the runtime view (polls
// /v1/radix_tree: the radix tree, the KV pool, the queues, hit rate and tokens/s). Served by `radixgen serve`
// and by the router (whose /v1/radix_tree lists one document per worker).
"use strict";

const $ = id => document.getElementById(id);
const POLL_MS = 1500, HISTORY = 80;
const state = {messages: [], controller: null, pollTimer: null, history: new Map()};

// ------------------------------------------------------------------ API key and requests

$("api-key").value = localStorage.getItem("radixgen-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("radixgen-api-key", $("api-key").value);
  loadModel();
});

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return `HTTP ${resp.status}`;
  }
}

async function loadModel() {
  try {
    const resp = await fetch("/v1/models", {headers: headers()});
    $("model-name").textContent = resp.ok ? (await resp.json()).data[0].id : `(${resp.status}: set the API key)`;
  } catch (e) {
    $("model-name").textContent = "(server unreachable)";
  }
}

// ------------------------------------------------------------------ tabs

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => showView(tab.dataset.view));
}

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  $("view-playground").hidden = name !== "playground";
  $("view-runtime").hidden = name !== "runtime";
  if (name === "runtime") startPolling(); else stopPolling();
  location.hash = name;
}

// ------------------------------------------------------------------ playground

$("constraint-kind").addEventListener("change", () => {
  const kind = $("constraint-kind").value;
  $("constraint").disabled = kind === "none";
  $("constraint").placeholder = {
    none: "", json_schema: '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}',
    regex: "(yes|no), because .{0,40}", choices: "one choice per line",
  }[kind];
  $("constraint-error").hidden = true;
});

function escapeRegex(s) { return s.replace(/[.*+?^${}()|[\]\\\/]/g, "\\$&"); }

// the request's constraint fields, or throws an Error naming what is wrong with the box's content
function constraintFields() {
  const kind = $("constraint-kind").value, text = $("constraint").value.trim();
  if (kind === "none") return {};
  if (!text) throw new Error(`the ${kind.replace("_", " ")} box is empty`);
  if (kind === "json_schema") {
    let schema;
    try { schema = JSON.parse(text); } catch (e) { throw new Error(`the JSON schema does not parse: ${e.message}`); }
    return {response_format: {type: "json_schema", json_schema: {name: "console", schema}}};
  }
  if (kind === "regex") return {regex: text};
  const choices = text.split("\n").map(s => s.trim()).filter(Boolean);
  return {regex: `(?:${choices.map(escapeRegex).join("|")})`};
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function addMessage(role, text) {
  const hint = document.querySelector("#transcript .hint");
  if (hint) hint.remove();
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.innerHTML = '<div class="role"></div><div class="body"></div><div class="meta"></div>';
  div.querySelector(".role").textContent = role;
  div.querySelector(".body").textContent = text;
  $("transcript").appendChild(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return div;
}

function showMeta(div, usage, finish, seconds) {
  const meta = div.querySelector(".meta");
  const parts = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(`${usage.prompt_tokens} prompt tokens, <b>${cached} cached</b>`, `${usage.completion_tokens} generated`);
  }
  if (finish) parts.push(`finish: ${finish}`);
  parts.push(`${seconds.toFixed(2)} s`);
  meta.innerHTML = parts.join(" · ");
  meta.dataset.cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : "";
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  let extra;
  try {
    extra = constraintFields();
    $("constraint-error").hidden = true;
  } catch (e) {
    $("constraint-error").textContent = e.message;
    $("constraint-error").hidden = false;
    return;
  }
  $("prompt").value = "";
  state.messages.push({role: "user", content: text});
  addMessage("user", text);
  const div = addMessage("assistant", "");
  if (extra.response_format) div.classList.add("json");
  const system = $("system").value.trim();
  const body = {
    messages: [...(system ? [{role: "system", content: system}] : []), ...state.messages],
    stream: true, stream_options: {include_usage: true},
    temperature: numberField("temperature"), top_p: numberField("top_p"), max_tokens: numberField("max_tokens"),
    seed: numberField("seed"), ...extra,
  };
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let answer = "", usage = null, finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
                                                      signal: state.controller.signal});
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const event of sseEvents(resp)) {
      if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          div.querySelector(".body").textContent = answer;
          $("transcript").scrollTop = $("transcript").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    state.messages.push({role: "assistant", content: answer});
    div.dataset.done = "1";
  } catch (e) {
    div.classList.add("failed");
    div.querySelector(".body").textContent = answer + (answer ? "\n" : "") +
      (e.name === "AbortError" ? "(stopped)" : `error: ${e.message}`);
    div.dataset.done = "error";
    state.messages.pop();
  } finally {
    showMeta(div, usage, finish, (performance.now() - started) / 1000);
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// the JSON events of a server-sent event stream, until `data: [DONE]`
async function* sseEvents(resp) {
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("transcript").innerHTML = '<p class="hint">New chat.</p>';
});

// ------------------------------------------------------------------ runtime view

function startPolling() {
  if (state.pollTimer === null) {
    poll();
    state.pollTimer = setInterval(poll, POLL_MS);
  }
}

function stopPolling() {
  if (state.pollTimer !== null) clearInterval(state.pollTimer);
  state.pollTimer = null;
  $("poll-status").textContent = "not polling";
}

async function poll() {
  if ($("pause").checked) { $("poll-status").textContent = "paused"; return; }
  const query = `max_nodes=${encodeURIComponent($("max-nodes").value)}&max_depth=${encodeURIComponent($("max-depth").value)}`;
  try {
    const resp = await fetch(`/v1/radix_tree?${query}`, {headers: headers()});
    if (!resp.ok) throw new Error(await errorText(resp));
    const doc = await resp.json();
    $("runtime-error").hidden = true;
    // a server sends one document; the router one per worker
    const workers = doc.workers ? doc.workers : [{url: "", doc}];
    renderWorkers(workers);
    $("poll-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("runtime-error").textContent = `/v1/radix_tree: ${e.message}`;
    $("runtime-error").hidden = false;
  }
}

function renderWorkers(workers) {
  const box = $("workers");
  for (const stale of [...box.children]) {
    if (!workers.some(w => w.url === stale.dataset.url)) stale.remove();
  }
  for (const w of workers) {
    let el = [...box.children].find(c => c.dataset.url === w.url);
    if (!el) {
      el = $("worker-template").content.firstElementChild.cloneNode(true);
      el.dataset.url = w.url;
      box.appendChild(el);
    }
    const error = typeof w.error === "string" ? w.error : (w.error && w.error.error && w.error.error.message) ||
      JSON.stringify(w.error);
    el.querySelector(".worker-title").textContent = w.url ? `worker ${w.url}${w.doc ? "" : ` — ${error}`}` : "";
    if (w.doc) renderWorker(el, w.url, w.doc);
  }
}

function renderWorker(el, url, doc) {
  const pool = doc.pool;
  const parts = [["running", pool.running, "var(--running)"], ["cached", pool.cached, "var(--cached)"],
                 ["free", pool.free, "var(--free)"]];
  el.querySelector(".pool-bar").replaceChildren(...parts.map(([name, n, color]) => {
    const d = document.createElement("div");
    d.style.width = `${(100 * n) / Math.max(1, pool.total)}%`;
    if (n > 0) d.style.minWidth = "3px";  // a few cached tokens in a large pool stay visible
    d.style.background = color;
    d.title = `${name}: ${n} tokens`;
    return d;
  }));
  const legend = el.querySelector(".pool-legend");
  legend.replaceChildren();
  for (const [name, n, color] of parts) {
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = color;
    const label = document.createElement("span");
    label.textContent = name === "running" ? `running (${pool.shared_locked} shared, locked)` : name;
    const num = document.createElement("span");
    num.className = "num";
    num.dataset.state = name;
    num.textContent = `${n.toLocaleString()} tok`;
    legend.append(sw, label, num);
  }
  if (doc.tiers) {  // the hierarchical cache's tiers under the pool
    const t = doc.tiers, line = document.createElement("div");
    line.className = "muted tiers";
    const disk = t.disk_pages === null ? "no disk tier" : t.disk_enabled ? `disk ${t.disk_pages.toLocaleString()} pages`
      : "disk tier off";
    line.textContent = `host tier ${t.host_used.toLocaleString()} / ${t.host_total.toLocaleString()} tok · ${disk}`;
    legend.append(line);
  }
  el.querySelector(".queues").innerHTML =
    `<div><div class="big">${doc.queues.running}</div><div class="muted">running</div></div>` +
    `<div><div class="big">${doc.queues.waiting}</div><div class="muted">waiting</div></div>` +
    `<div><div class="big">${doc.counters.num_requests}</div><div class="muted">requests</div></div>`;

  const hist = state.history.get(url) || [];
  const c = doc.counters, prev = hist[hist.length - 1];
  const point = {t: doc.time, c, hit: 0, tps: 0};
  if (prev) {
    const dt = Math.max(1e-3, doc.time - prev.t), prompt = c.prompt_tokens - prev.c.prompt_tokens;
    point.hit = prompt > 0 ? (c.cached_tokens - prev.c.cached_tokens) / prompt : prev.hit;
    point.tps = (c.generation_tokens - prev.c.generation_tokens) / dt;
  } else {
    point.hit = doc.cache_hit_rate;
  }
  hist.push(point);
  if (hist.length > HISTORY) hist.shift();
  state.history.set(url, hist);
  drawLineChart(el.querySelector(".hit-chart"), hist.map(p => ({t: p.t, v: p.hit})),
                {max: 1, color: "#2a9d6a", format: v => `${(100 * v).toFixed(0)}% (total ${(100 * doc.cache_hit_rate).toFixed(0)}%)`});
  drawLineChart(el.querySelector(".tps-chart"), hist.slice(1).map(p => ({t: p.t, v: p.tps})),
                {color: "#2f6fde", format: v => `${v.toFixed(1)} tok/s`});

  const tree = doc.tree;
  el.querySelector(".tree-summary").textContent =
    `— ${tree.nodes.length} of ${tree.total_nodes} edges, ${tree.total_tokens.toLocaleString()} tokens` +
    (doc.isolated ? " (this key's namespaces)" : "");
  drawTree(el.querySelector(".tree"), tree);
}

loadModel();
showView(location.hash === "#runtime" ? "runtime" : "playground");
