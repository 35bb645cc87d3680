// The Tokenyard ops console: one EventSource (/api/live) drives everything; the charts keep
// their own history, seeded from /api/history. No framework, no build step.
"use strict";

const HISTORY_POINTS = 450; // 15 minutes at one snapshot every 2 s
const series = {
  tokens: [[]], ttft: [[], []], itl: [[], []], queue: [[], []], kv: [[]], prefix: [[]],
};
const rackPower = {}; // rack -> [[ts, kW]]
const rackCoolant = {}; // rack -> [[ts, supply °C, return °C]]
const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%");
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

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

function push(line, value) {
  line.push(value);
  if (line.length > HISTORY_POINTS) line.shift();
}

function record(f) {
  push(series.tokens[0], f.tokens_per_s);
  push(series.ttft[0], f.ttft_p50_s); push(series.ttft[1], f.ttft_p99_s);
  push(series.itl[0], f.itl_p50_s === null ? null : 1000 * f.itl_p50_s);
  push(series.itl[1], f.itl_p99_s === null ? null : 1000 * f.itl_p99_s);
  push(series.queue[0], f.num_waiting); push(series.queue[1], f.num_running);
  push(series.kv[0], 100 * f.kv_usage);
  push(series.prefix[0], f.prefix_hit_rate === null ? null : 100 * f.prefix_hit_rate);
}

const COLORS = ["#4aa3ff", "#e0a526"];

function drawChart(canvas, lines) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const values = lines.flat().filter((v) => v !== null && v !== undefined);
  const max = Math.max(1e-9, ...values) * 1.1;
  g.strokeStyle = "#2a3542"; g.fillStyle = "#8a96a3"; g.font = "10px system-ui";
  g.beginPath(); g.moveTo(0, h - 0.5); g.lineTo(w, h - 0.5); g.stroke();
  g.fillText(values.length ? max.toPrecision(3) : "no data yet", 2, 10);
  lines.forEach((line, i) => {
    g.strokeStyle = COLORS[i % COLORS.length]; g.lineWidth = 1.5; g.beginPath();
    let drawing = false;
    line.forEach((v, x) => {
      if (v === null || v === undefined) { drawing = false; return; }
      const px = (x / Math.max(1, HISTORY_POINTS - 1)) * w;
      const py = h - (v / max) * (h - 12) - 1;
      if (drawing) g.lineTo(px, py); else g.moveTo(px, py);
      drawing = true;
    });
    g.stroke();
  });
}

function drawCharts() {
  drawChart($("c-tokens"), series.tokens);
  drawChart($("c-ttft"), series.ttft);
  drawChart($("c-itl"), series.itl);
  drawChart($("c-queue"), series.queue);
  drawChart($("c-kv"), series.kv);
  drawChart($("c-prefix"), series.prefix);
  document.querySelectorAll("canvas[data-rack]").forEach((c) => {
    drawChart(c, [(rackPower[c.dataset.rack] || []).map((p) => p[1])]);
  });
  document.querySelectorAll("canvas[data-coolant]").forEach((c) => {
    const rows = rackCoolant[c.dataset.coolant] || [];
    drawChart(c, [rows.map((p) => p[1]), rows.map((p) => p[2])]);
  });
}

function renderFigures(f) {
  const items = [
    ["live workers", f.live_workers, "live-workers"],
    ["tokens/s", fmt(f.tokens_per_s, 1), "tokens-per-s"],
    ["requests/s", fmt(f.requests_per_s, 2), "requests-per-s"],
    ["TTFT p50", fmt(f.ttft_p50_s, 3) + " s", "ttft-p50"],
    ["TTFT p99", fmt(f.ttft_p99_s, 3) + " s", "ttft-p99"],
    ["ITL p50", f.itl_p50_s === null ? "–" : fmt(1000 * f.itl_p50_s, 1) + " ms", "itl-p50"],
    ["ITL p99", f.itl_p99_s === null ? "–" : fmt(1000 * f.itl_p99_s, 1) + " ms", "itl-p99"],
    ["waiting / running", `${f.num_waiting} / ${f.num_running}`, "queue"],
    ["KV use", pct(f.kv_usage), "kv-use"],
    ["prefix hit rate", pct(f.prefix_hit_rate), "prefix-hit"],
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
    <div class="actions"><button class="needs-admin" data-drain="${esc(w.worker_id)}">drain</button></div>
  </div>`;
}

function rackHtml(r) {
  const cap = r.power_cap_kw ? ` / ${fmt(r.power_cap_kw, 1)}` : "";
  return `<div class="rack ${esc(r.state)}" data-testid="rack" data-rack="${esc(r.name)}" data-state="${esc(r.state)}">
    <h3>${esc(r.name)} <span class="badge ${esc(r.state)}" data-testid="rack-state">${esc(r.state)}</span></h3>
    <div class="reason">${esc(r.reason)}</div>
    <div class="readings">
      <span>⚡ <b data-testid="rack-kw">${fmt(r.power_kw, 2)}</b>${cap} kW</span>
      <span>supply ${fmt(r.supply_c, 1)} °C</span><span>return ${fmt(r.return_c, 1)} °C</span>
      <span>flow ${fmt(r.flow_lpm, 1)} l/min</span>
    </div>
    <div class="rack-charts"><figure><figcaption>kW</figcaption><canvas data-rack="${esc(r.name)}"></canvas></figure>
      <figure><figcaption>supply / return °C</figcaption><canvas data-coolant="${esc(r.name)}"></canvas></figure></div>
    ${r.nodes.map((n) => `<div class="node"><span class="node-name">${esc(n.name)}</span>
      <div class="workers">${n.workers.map(workerHtml).join("") || "<small>no workers</small>"}</div></div>`).join("")}
    <div class="actions">
      <button class="needs-admin" data-fault="${esc(r.name)}" data-kind="pump_failure">inject pump fault</button>
      <button class="needs-admin" data-clear="${esc(r.name)}">clear faults</button>
    </div>
  </div>`;
}

function renderFleet(racks, ts) {
  for (const r of racks) {
    if (r.power_kw === null) continue;
    const line = rackPower[r.name] || (rackPower[r.name] = []);
    line.push([ts, r.power_kw]);
    if (line.length > HISTORY_POINTS) line.shift();
    const temps = rackCoolant[r.name] || (rackCoolant[r.name] = []);
    temps.push([ts, r.supply_c, r.return_c]);
    if (temps.length > HISTORY_POINTS) temps.shift();
  }
  $("fleet").innerHTML = racks.map(rackHtml).join("");
}

function renderRequests(requests) {
  $("requests").innerHTML = requests.map((r) => `<tr class="${esc(r.status)}" data-request="${esc(r.request_id)}" data-testid="request-row">
    <td>${esc(r.request_id.slice(0, 22))}…</td><td>${new Date(1000 * r.started_at).toLocaleTimeString()}</td>
    <td>${esc(r.model)}</td><td>${esc(r.status)} ${esc(r.finish_reason ?? "")}</td>
    <td>${fmt(r.ttft_s, 3)}</td><td>${fmt(r.duration_s, 3)}</td>
    <td>${r.prompt_tokens ?? "–"} / ${r.cached_tokens ?? "–"} / ${r.output_tokens ?? "–"}</td>
    <td>${esc(r.worker_path.join(" → "))}</td></tr>`).join("");
}

async function showTrace(requestId) {
  const resp = await fetch(`/api/requests/${encodeURIComponent(requestId)}/trace`);
  const body = await resp.json();
  if (!resp.ok) { $("trace").textContent = body?.error?.message ?? "no trace"; return; }
  const total = Math.max(...body.spans.map((s) => s.start_offset_s + s.duration_s), 1e-6);
  const depth = {};
  for (const s of body.spans) depth[s.span_id] = s.parent_span_id in depth ? depth[s.parent_span_id] + 1 : 0;
  $("trace").innerHTML = `<h2>Trace <small>${esc(requestId)} · ${esc(body.trace_id)}</small></h2>` +
    body.spans.map((s) => `<div class="span-row" data-testid="span" title="${esc(JSON.stringify(s.attributes))}">
      <span class="span-name" style="padding-left:${12 * depth[s.span_id]}px">${esc(s.service)} · ${esc(s.name)}</span>
      <span class="span-track"><span class="span-bar ${esc(s.service)}"
        style="left:${(100 * s.start_offset_s) / total}%;width:${(100 * s.duration_s) / total}%"></span></span>
      <span>${fmt(1000 * s.duration_s, 1)} ms</span></div>`).join("");
}

document.addEventListener("click", (e) => {
  const t = e.target.closest("[data-drain],[data-fault],[data-clear],[data-request]");
  if (!t) return;
  if (t.dataset.drain) adminCall("POST", `/api/admin/workers/${t.dataset.drain}/drain`);
  else if (t.dataset.fault) adminCall("POST", `/api/admin/racks/${t.dataset.fault}/faults`, { kind: t.dataset.kind });
  else if (t.dataset.clear) adminCall("DELETE", `/api/admin/racks/${t.dataset.clear}/faults`);
  else if (t.dataset.request) showTrace(t.dataset.request);
});

$("admin-token").addEventListener("input", () => {
  document.body.classList.toggle("admin-on", adminToken() !== "");
  sessionStorage.setItem("tokenyard-admin", adminToken());
});

async function seedHistory() {
  try {
    const h = await (await fetch("/api/history?minutes=15")).json();
    h.fleet.forEach(record);
    for (const [rack, rows] of Object.entries(h.racks)) {
      rackPower[rack] = rows.map((r) => [r.ts, r.power_kw]);
      rackCoolant[rack] = rows.map((r) => [r.ts, r.supply_c, r.return_c]);
    }
  } catch (err) { $("message").textContent = `history: ${err}`; }
}

function connect() {
  const source = new EventSource("/api/live");
  source.onopen = () => { $("conn").textContent = "live"; $("conn").classList.add("live"); };
  source.onerror = () => { $("conn").textContent = "reconnecting…"; $("conn").classList.remove("live"); };
  source.onmessage = (event) => {
    const snap = JSON.parse(event.data);
    record(snap.figures);
    renderFigures(snap.figures);
    renderFleet(snap.racks, snap.ts);
    renderRequests(snap.requests);
    drawCharts();
  };
}

$("admin-token").value = sessionStorage.getItem("tokenyard-admin") || "";
document.body.classList.toggle("admin-on", adminToken() !== "");
seedHistory().then(connect);
