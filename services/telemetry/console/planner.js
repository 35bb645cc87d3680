// The capacity planner page: a form posted to /api/plan (the `tokenyard plan` function) and
// the plan as a table. No framework, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const num = (v, digits = 0) =>
  Number(v).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });

// [label, key (data-testid plan-<key>), how to show it]
const ROWS = [
  ["parallelism (tp x pp, ep)", "parallelism", (p) => `${p.tp} x ${p.pp}, ep ${p.ep}`],
  ["memory per GPU: weights / KV / buffers", "memory", (p) => {
    const m = p.memory_per_gpu_gb;
    return `${num(m.weights, 1)} / ${num(m.kv, 1)} / ${num(m.buffers, 1)} GB`;
  }],
  ["KV capacity per replica", "kv-capacity",
    (p) => `${num(p.kv_capacity_tokens)} tokens, ${num(p.kv_capacity_seqs)} conversations`],
  ["decode batch, inter-token latency", "decode-batch",
    (p) => `${p.decode_batch}, ${num(p.decode_itl_ms, 1)} ms`],
  ["decode tok/s per replica", "decode-tok-s", (p) => num(p.decode_tok_s_per_replica)],
  ["prefill tok/s per replica", "prefill-tok-s", (p) => num(p.prefill_tok_s_per_replica)],
  ["requests/s", "requests-per-s", (p) => num(p.requests_per_s, 1)],
  ["replicas: prefill : decode", "replicas", (p) => `${p.prefill_replicas} : ${p.decode_replicas}`],
  ["TTFT (queue + prefill + hand-off)", "ttft", (p) => `${num(p.ttft_ms)} ms`],
  ["GPUs", "gpus", (p) => num(p.gpus_total)],
  ["nodes, racks", "racks", (p) => `${num(p.nodes)}, ${num(p.racks)}`],
  ["IT / facility power", "power", (p) => `${num(p.it_power_kw, 1)} / ${num(p.facility_power_kw, 1)} kW`],
  ["coolant flow", "coolant", (p) => `${num(p.coolant_flow_lpm)} L/min`],
];

function fill(select, values, chosen) {
  select.innerHTML = values.map((v) => `<option${v === chosen ? " selected" : ""}>${esc(v)}</option>`).join("");
}

async function loadOptions() {
  const o = await (await fetch("/api/plan/options")).json();
  const form = $("plan-form");
  fill(form.elements.model, o.models, "llama-3.1-70b");
  fill(form.elements.gpu, o.gpus, "h100");
  fill(form.elements.weights_dtype, o.dtypes, "bf16");
}

function render(plan) {
  $("plan-rows").innerHTML = ROWS.map(([label, key, show]) =>
    `<tr><th>${esc(label)}</th><td data-testid="plan-${key}">${esc(show(plan))}</td></tr>`).join("");
  $("plan-warnings").innerHTML = plan.warnings.map((w) => `<li>${esc(w)}</li>`).join("");
  $("plan-message").textContent = `${plan.model} on ${plan.hardware}, ${plan.weights_dtype} weights`;
}

async function submit(e) {
  e.preventDefault();
  const f = e.target.elements;
  const body = {
    model: f.model.value, gpu: f.gpu.value, weights_dtype: f.weights_dtype.value,
    users: Number(f.users.value), tps_per_user: Number(f.tps_per_user.value),
    prompt_len: Number(f.prompt_len.value), output_len: Number(f.output_len.value),
  };
  $("plan-message").textContent = "planning…";
  const resp = await fetch("/api/plan", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    $("plan-rows").innerHTML = ""; $("plan-warnings").innerHTML = "";
    $("plan-message").textContent = `no plan: ${data?.error?.message ?? resp.status}`;
    return;
  }
  render(data);
}

$("plan-form").addEventListener("submit", submit);
loadOptions();
