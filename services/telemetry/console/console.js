// The Tokenyard ops console: one EventSource (/api/live) drives everything; the charts
// (uPlot, shipped in vendor/) keep their own history, seeded from /api/history. No
// framework, no build step.
"use strict";

const HISTORY_S = 15 * 60; // what the charts show
// Headline rates are averaged over this window: a heartbeat's rate flickers to 0 between
// bursts, a person reading the figure wants the recent level.
const SMOOTH_S = 10;
const COLORS = ["#4aa3ff", "#e0a526", "#2fb36b", "#e06fb0"];
const AXIS = { stroke: "#8a96a3", grid: { stroke: "#2a3542", width: 1 }, ticks: { stroke: "#2a3542", width: 1 } };

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%");
const mib = (v) => (v === null || v === undefined ? "–" : (v / 2 ** 20).toFixed(1) + " MiB");
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const scaled = (v, k) => (v === null || v === undefined ? null : k * v);

// --- history: one time column and one column per plotted value --------------------------------

const history = { ts: [], tokens: [], ttft50: [], ttft99: [], itl50: [], itl99: [],
  waiting: [], running: [], kv: [], prefix: [], energy: [] };
const rackHistory = {}; // rack -> { ts, kw, supply, ret }

function trim(columns) {
  const cut = columns.ts.length ? columns.ts[columns.ts.length - 1] - HISTORY_S : 0;
  let n = 0;
  while (n < columns.ts.length && columns.ts[n] < cut) n++;
  if (n) for (const col of Object.values(columns)) col.splice(0, n);
}

function record(f, ts) {
  const row = { ts, tokens: f.tokens_per_s, ttft50: f.ttft_p50_s, ttft99: f.ttft_p99_s,
    itl50: scaled(f.itl_p50_s, 1000), itl99: scaled(f.itl_p99_s, 1000),
    waiting: f.num_waiting, running: f.num_running, kv: scaled(f.kv_usage, 100),
    prefix: scaled(f.prefix_hit_rate, 100), energy: f.joules_per_token };
  for (const [key, col] of Object.entries(history)) col.push(row[key] ?? null);
  trim(history);
}

function recordRack(rack, ts, r) {
  const h = rackHistory[rack] || (rackHistory[rack] = { ts: [], kw: [], supply: [], ret: [] });
  h.ts.push(ts); h.kw.push(r.power_kw); h.supply.push(r.supply_c); h.ret.push(r.return_c);
  trim(h);
}

/** The mean of a column over the last SMOOTH_S seconds (nulls skipped). */
function smoothed(key) {
  const end = history.ts.length ? history.ts[history.ts.length - 1] : 0;
  let sum = 0, n = 0;
  for (let i = history.ts.length - 1; i >= 0 && history.ts[i] > end - SMOOTH_S; i--) {
    const v = history[key][i];
    if (v !== null && v !== undefined) { sum += v; n++; }
  }
  return n ? sum / n : null;
}

// --- charts ----------------------------------------------------------------------------------

/** Time-axis ticks as a 24-hour clock: uPlot's default adds a date line that overlaps on narrow charts. */
function clockLabels(u, splits) {
  return splits.map((ts) => new Date(1000 * ts).toLocaleTimeString([], { hour12: false }));
}

function makeChart(el, { title, unit, lines, digits, height = 170 }) {
  const opts = {
    title, width: Math.max(200, el.clientWidth), height,
    scales: { x: { time: true } },
    cursor: { drag: { x: false, y: false } },
    legend: { live: true },
    axes: [{ ...AXIS, values: clockLabels, space: 70 }, { ...AXIS, label: unit, size: 56, labelSize: 18 }],
    series: [
      { label: "time", value: (u, ts) => (ts == null ? "–" : new Date(1000 * ts).toLocaleTimeString()) },
      ...lines.map((label, i) => ({
        label, stroke: COLORS[i % COLORS.length], width: 1.5,
        value: (u, v) => (v == null ? "–" : `${v.toFixed(digits)} ${unit}`),
      })),
    ],
  };
  const chart = new uPlot(opts, [[], ...lines.map(() => [])], el);
  new ResizeObserver(() => chart.setSize({ width: Math.max(200, el.clientWidth), height })).observe(el);
  return chart;
}

const FLEET_CHARTS = [
  { id: "c-tokens", title: "throughput", unit: "tok/s", lines: ["generated"], keys: ["tokens"], digits: 1 },
  { id: "c-ttft", title: "time to first token", unit: "s", lines: ["p50", "p99"], keys: ["ttft50", "ttft99"], digits: 3 },
  { id: "c-itl", title: "inter-token latency", unit: "ms", lines: ["p50", "p99"], keys: ["itl50", "itl99"], digits: 1 },
  { id: "c-queue", title: "sequences", unit: "seqs", lines: ["waiting", "running"], keys: ["waiting", "running"], digits: 0 },
  { id: "c-kv", title: "KV cache in use", unit: "%", lines: ["KV use"], keys: ["kv"], digits: 1 },
  { id: "c-prefix", title: "prefix cache hit rate", unit: "%", lines: ["hit rate"], keys: ["prefix"], digits: 1 },
  { id: "c-energy", title: "energy per output token", unit: "J", lines: ["J/token"], keys: ["energy"], digits: 3 },
];
const charts = {};
const rackCharts = {}; // rack -> { power, coolant }

/** New data; the legend shows the latest values unless the mouse is over the chart. */
function update(chart, data) {
  chart.setData(data);
  if (chart.cursor.idx == null && data[0].length) chart.setLegend({ idx: data[0].length - 1 });
}

function drawCharts() {
  for (const spec of FLEET_CHARTS) {
    charts[spec.id] ||= makeChart($(spec.id), spec);
    update(charts[spec.id], [history.ts, ...spec.keys.map((k) => history[k])]);
  }
  for (const [rack, c] of Object.entries(rackCharts)) {
    const h = rackHistory[rack];
    if (!h) continue;
    update(c.power, [h.ts, h.kw]);
    update(c.coolant, [h.ts, h.supply, h.ret]);
  }
}

// --- figures, fleet, requests ------------------------------------------------------------------

function renderFigures(f, windowS) {
  const avg = `${SMOOTH_S} s avg`;
  const t = f.kv_tiers || {};
  const items = [
    ["live workers", f.live_workers, "live-workers"],
    [`tokens/s · ${avg}`, fmt(smoothed("tokens"), 1), "tokens-per-s"],
    [`requests/s · ${windowS} s`, fmt(f.requests_per_s, 2), "requests-per-s"],
    ["TTFT p50", fmt(f.ttft_p50_s, 3) + " s", "ttft-p50"],
    ["TTFT p99", fmt(f.ttft_p99_s, 3) + " s", "ttft-p99"],
    ["ITL p50", f.itl_p50_s === null ? "–" : fmt(1000 * f.itl_p50_s, 1) + " ms", "itl-p50"],
    ["ITL p99", f.itl_p99_s === null ? "–" : fmt(1000 * f.itl_p99_s, 1) + " ms", "itl-p99"],
    [`waiting / running · ${avg}`, `${fmt(smoothed("waiting"), 1)} / ${fmt(smoothed("running"), 1)}`, "queue"],
    ["KV use", pct(f.kv_usage), "kv-use"],
    ["prefix hit rate", pct(f.prefix_hit_rate), "prefix-hit"],
    [`J per output token · ${windowS} s`, fmt(f.joules_per_token, 3), "joules-per-token"],
    ["cache hits: local / shared tier", `${pct(t.local_hit_rate)} / ${pct(t.shared_hit_rate)}`, "kv-tier-hits"],
    ["KV to / from shared tier", `${mib(t.offload_bytes)} / ${mib(t.fetch_bytes)}`, "kv-moved"],
  ];
  $("figures").innerHTML = items.map(([label, value, id]) =>
    `<div class="figure"><b data-testid="fig-${id}">${esc(value)}</b><span>${esc(label)}</span></div>`).join("");
}

function workerHtml(w) {
  return `<div class="worker ${esc(w.state)}" data-testid="worker" data-worker="${esc(w.worker_id)}"
      data-state="${esc(w.state)}" title="${esc(w.model)}">
    <b>${esc(w.worker_id)}</b>
    <small>${esc(w.role)} · ${esc(w.state)} · run ${w.num_running} wait ${w.num_waiting}</small><br>
    <small>KV ${pct(w.kv_usage)} · ${fmt(w.tokens_per_s, 1)} tok/s · hit ${pct(w.prefix_hit_rate)}</small>
    ${loraHtml(w.lora_adapters || [])}
    <div class="actions"><button class="needs-admin" data-drain="${esc(w.worker_id)}">drain</button></div>
  </div>`;
}

/** The LoRA adapters a worker serves (its heartbeat's lora_adapters), one badge each. */
function loraHtml(adapters) {
  if (!adapters.length) return "";
  return `<div class="loras" data-testid="worker-loras">LoRA ${adapters.map((a) =>
    `<span class="badge lora" data-testid="worker-lora" data-lora="${esc(a)}">${esc(a)}</span>`).join(" ")}</div>`;
}

const SIMULATED = "modelled from the workers' heartbeats by the facilities simulator, not measured";

function rackBodyHtml(r) {
  const cap = r.power_cap_kw ? ` / ${fmt(r.power_cap_kw, 1)}` : "";
  const source = r.source === "simulator"
    ? `<span class="badge simulated" data-testid="rack-source" title="${SIMULATED}">simulated</span>`
    : r.source ? `<span class="badge source" data-testid="rack-source">${esc(r.source)}</span>` : "";
  return `<h3>${esc(r.name)} <span class="badge ${esc(r.state)}" data-testid="rack-state">${esc(r.state)}</span>${source}</h3>
    <div class="reason">${esc(r.reason)}</div>
    <div class="readings" ${r.source === "simulator" ? `title="${SIMULATED}"` : ""}>
      <span>⚡ <b data-testid="rack-kw">${fmt(r.power_kw, 2)}</b>${cap} kW</span>
      <span>supply ${fmt(r.supply_c, 1)} °C</span><span>return ${fmt(r.return_c, 1)} °C</span>
      <span>flow ${fmt(r.flow_lpm, 1)} l/min</span>
    </div>
    ${r.nodes.map((n) => `<div class="node"><span class="node-name">${esc(n.name)}</span>
      <div class="workers">${n.workers.map(workerHtml).join("") || "<small>no workers</small>"}</div></div>`).join("")}
    <div class="actions">
      <button class="needs-admin" data-fault="${esc(r.name)}" data-kind="pump_failure">inject pump fault</button>
      <button class="needs-admin" data-clear="${esc(r.name)}">clear faults</button>
    </div>`;
}

/** A rack's element: a body redrawn every snapshot, and charts made once (uPlot keeps state). */
function rackElement(r) {
  let el = document.querySelector(`[data-testid="rack"][data-rack="${CSS.escape(r.name)}"]`);
  if (el) return el;
  el = document.createElement("div");
  el.dataset.testid = "rack"; el.dataset.rack = r.name;
  el.innerHTML = `<div class="rack-body"></div><div class="rack-charts"><div></div><div></div></div>`;
  $("fleet").appendChild(el);
  if (r.power_kw !== null) {
    const [power, coolant] = el.querySelectorAll(".rack-charts > div");
    const sim = r.source === "simulator" ? " (simulated)" : "";
    rackCharts[r.name] = {
      power: makeChart(power, { title: `power${sim}`, unit: "kW", lines: ["power"], digits: 2, height: 120 }),
      coolant: makeChart(coolant, { title: `coolant${sim}`, unit: "°C", lines: ["supply", "return"], digits: 1, height: 120 }),
    };
  }
  return el;
}

let lastRacks = [];

function renderFleet(racks, ts) {
  lastRacks = racks;
  for (const r of racks) {
    if (r.power_kw !== null) recordRack(r.name, ts, r);
    const el = rackElement(r);
    el.className = `rack ${r.state}`;
    el.dataset.state = r.state;
    el.querySelector(".rack-body").innerHTML = rackBodyHtml(r);
  }
}

function statusHtml(r) {
  if (r.status !== "error") return `${esc(r.status)} ${esc(r.finish_reason ?? "")}`;
  const why = [r.error_code, r.error_message].filter(Boolean).join(": ") || "no reason recorded";
  return `error <span class="request-error" data-testid="request-error" title="${esc(why)}">${esc(why)}</span>`;
}

function renderRequests(requests) {
  $("requests").innerHTML = requests.map((r) => `<tr class="${esc(r.status)}" data-request="${esc(r.request_id)}" data-testid="request-row">
    <td>${esc(r.request_id.slice(0, 22))}…</td><td>${new Date(1000 * r.started_at).toLocaleTimeString()}</td>
    <td>${esc(r.model)}</td><td>${statusHtml(r)}</td>
    <td>${fmt(r.ttft_s, 3)}</td><td>${fmt(r.duration_s, 3)}</td>
    <td>${r.prompt_tokens ?? "–"} / ${r.cached_tokens ?? "–"} / ${r.output_tokens ?? "–"}</td>
    <td>${esc(r.worker_path.join(" → "))}</td></tr>`).join("");
}

// --- the trace waterfall -----------------------------------------------------------------------

/** Spans parent-first, each followed by its children in start order, with their depth. */
function spanTree(spans) {
  const ids = new Set(spans.map((s) => s.span_id));
  const children = {};
  for (const s of spans) {
    const parent = ids.has(s.parent_span_id) ? s.parent_span_id : "";
    (children[parent] ||= []).push(s);
  }
  const out = [];
  const walk = (parent, depth) => {
    for (const s of (children[parent] || []).sort((a, b) => a.start_unix_ns - b.start_unix_ns)) {
      out.push([s, depth]);
      walk(s.span_id, depth + 1);
    }
  };
  walk("", 0);
  return out;
}

function spanLabel(s) {
  const a = s.attributes;
  if (s.name === "engine.prefill") return `prefill · ${a["tokenyard.prompt_tokens"]} prompt tokens`;
  if (s.name === "engine.decode_step") return `decode step ${a["tokenyard.step"]} · +${a["tokenyard.new_tokens"]} tok`;
  if (s.name === "engine.decode_steps") return `${a["tokenyard.steps"]} more decode steps`;
  return `${s.service} · ${s.name}`;
}

async function showTrace(requestId) {
  const resp = await fetch(`/api/requests/${encodeURIComponent(requestId)}/trace`);
  const body = await resp.json();
  if (!resp.ok) { $("trace").textContent = body?.error?.message ?? "no trace"; return; }
  const total = Math.max(...body.spans.map((s) => s.start_offset_s + s.duration_s), 1e-6);
  $("trace").innerHTML = `<h2>Trace <small>${esc(requestId)} · ${esc(body.trace_id)} · ${fmt(1000 * total, 1)} ms</small></h2>` +
    spanTree(body.spans).map(([s, depth]) => {
      const engine = s.name.startsWith("engine.") ? " engine" : "";
      return `<div class="span-row${engine}" data-testid="span" data-span="${esc(s.name)}" data-depth="${depth}"
        title="${esc(JSON.stringify(s.attributes))}">
      <span class="span-name" style="padding-left:${12 * depth}px">${esc(spanLabel(s))}</span>
      <span class="span-track"><span class="span-bar ${esc(s.service)}${engine} ${esc(s.status)}"
        style="left:${(100 * s.start_offset_s) / total}%;width:${(100 * s.duration_s) / total}%"></span></span>
      <span>${fmt(1000 * s.duration_s, 1)} ms</span></div>`;
    }).join("");
}

// --- admin actions -----------------------------------------------------------------------------

function adminToken() { return $("admin-token").value.trim(); }

async function adminCall(method, path, body) {
  const resp = await fetch(path, {
    method,
    headers: { "Authorization": `Bearer ${adminToken()}`, "Content-Type": "application/json" },
    body: body ? JSON.stringify(body) : undefined,
  });
  const data = await resp.json().catch(() => ({}));
  $("message").textContent = resp.ok
    ? `${method} ${path}: done`
    : `${method} ${path}: ${resp.status} ${data?.error?.message ?? ""}`;
}

const CAN = { prefill: ["prefill", "both"], decode: ["decode", "both"] };

/** What a drain of `rack` would cost: the serving workers it drains, and the roles no serving
 * worker would be left for (then the fleet stops serving). */
function drainCost(rack) {
  const serving = [];
  for (const r of lastRacks) for (const n of r.nodes) for (const w of n.workers) {
    if (w.alive && w.state !== "drain") serving.push({ ...w, rack: r.name });
  }
  const drained = serving.filter((w) => w.rack === rack);
  const left = serving.filter((w) => w.rack !== rack);
  const roles = Object.keys(CAN).filter((role) =>
    serving.some((w) => CAN[role].includes(w.role)) && !left.some((w) => CAN[role].includes(w.role)));
  return { drained: drained.map((w) => w.worker_id), roles, every: drained.length > 0 && left.length === 0 };
}

/** Asks before a fault that would leave the fleet unable to serve; true to go on. */
function confirmFault(rack) {
  const { drained, roles, every } = drainCost(rack);
  if (!roles.length && !every) return true;
  const what = every ? "every worker still serving" : `the last worker that can ${roles.join(" and ")}`;
  return window.confirm(
    `A pump fault drains rack ${rack}: ${drained.join(", ")}.\n` +
    `That is ${what}: the fleet stops serving until the fault clears. Inject it?`);
}

function injectFault(rack, kind) {
  if (!confirmFault(rack)) { $("message").textContent = `fault on ${rack}: cancelled`; return; }
  adminCall("POST", `/api/admin/racks/${rack}/faults`, { kind });
}

document.addEventListener("click", (e) => {
  const t = e.target.closest("[data-drain],[data-fault],[data-clear],[data-request]");
  if (!t) return;
  if (t.dataset.drain) adminCall("POST", `/api/admin/workers/${t.dataset.drain}/drain`);
  else if (t.dataset.fault) injectFault(t.dataset.fault, t.dataset.kind);
  else if (t.dataset.clear) adminCall("DELETE", `/api/admin/racks/${t.dataset.clear}/faults`);
  else if (t.dataset.request) showTrace(t.dataset.request);
});

$("admin-token").addEventListener("input", () => {
  document.body.classList.toggle("admin-on", adminToken() !== "");
  sessionStorage.setItem("tokenyard-admin", adminToken());
});

// --- start -------------------------------------------------------------------------------------

async function seedHistory() {
  try {
    const h = await (await fetch(`/api/history?minutes=${HISTORY_S / 60}`)).json();
    h.fleet.forEach((row) => record(row, row.ts));
    for (const [rack, rows] of Object.entries(h.racks)) rows.forEach((r) => recordRack(rack, r.ts, r));
  } catch (err) { $("message").textContent = `history: ${err}`; }
}

function connect() {
  const source = new EventSource("/api/live");
  source.onopen = () => { $("conn").textContent = "live"; $("conn").classList.add("live"); };
  source.onerror = () => { $("conn").textContent = "reconnecting…"; $("conn").classList.remove("live"); };
  source.onmessage = (event) => {
    const snap = JSON.parse(event.data);
    record(snap.figures, snap.ts);
    renderFigures(snap.figures, snap.window_s);
    renderFleet(snap.racks, snap.ts);
    renderRequests(snap.requests);
    drawCharts();
  };
}

$("admin-token").value = sessionStorage.getItem("tokenyard-admin") || "";
document.body.classList.toggle("admin-on", adminToken() !== "");
seedHistory().then(connect);
