// pdserve router dashboard: polls /dashboard/data, keeps history here, draws the charts of
// charts.js. Rates are computed from counter differences against the router's own clock
// (data.now_s), never the browser's.
"use strict";

const POLL_MS = 1000;

// ---- the charts ----------------------------------------------------------------------------

function chart(id, title, unit, series = [], yMax = null) {
  return new LineChart(document.getElementById(id), { title, unit, series, yMax });
}

const QUANTILES = [{ name: "p50" }, { name: "p90" }, { name: "p99" }];
const sloLine = (name) => ({ name, color: "#6b7280", dash: true, reference: true });

const charts = {
  requests: chart("chart-requests", "Requests finished per second", "requests / s"),
  tokens: chart("chart-tokens", "Token throughput", "tokens / s"),
  ttft: chart("chart-ttft", "Time to first token (last 10 s)", "milliseconds",
    [...QUANTILES, sloLine("TTFT SLO")]),
  itl: chart("chart-itl", "Inter-token latency (last 10 s)", "milliseconds",
    [...QUANTILES, sloLine("TPOT SLO")]),
  goodput: chart("chart-goodput", "Goodput: requests/s meeting both SLOs", "requests / s"),
  attainment: chart("chart-attainment", "SLO attainment", "% of requests", [], 100),
  pools: chart("chart-pools", "Pool sizes", "live workers"),
  load: chart("chart-load", "Per-worker load (waiting + running)", "requests"),
  kv: chart("chart-kv", "KV cache usage per worker", "% of blocks", [], 100),
  prefix: chart("chart-prefix", "Prefix-cache hit rate", "% of prompt tokens", [], 100),
  transfer: chart("chart-transfer", "KV transfer throughput", "MB / s"),
};

let previous = null;

function rate(now, before, key) {
  const dt = now.now_s - before.now_s;
  return dt > 0 ? (key(now) - key(before)) / dt : null;
}

function requestRates(d, p) {
  const out = {};
  for (const outcome of Object.keys(d.counters.requests)) {
    out[outcome] = p ? rate(d, p, (x) => x.counters.requests[outcome]) : null;
  }
  return out;
}

function quantileSeries(q, sloName, sloMs) {
  const out = { p50: q?.p50 ?? null, p90: q?.p90 ?? null, p99: q?.p99 ?? null };
  out[sloName] = sloMs;
  return out;
}

function prefixRates(d, p) {
  const c = d.counters;
  const total = c.prompt_tokens > 0 ? (100 * c.prefix_hit_tokens) / c.prompt_tokens : null;
  let interval = null;
  if (p) {
    const prompts = c.prompt_tokens - p.counters.prompt_tokens;
    const hits = c.prefix_hit_tokens - p.counters.prefix_hit_tokens;
    interval = prompts > 0 ? (100 * hits) / prompts : null;
  }
  return { "last second": interval, "since start": total };
}

function transferRates(d, p) {
  if (!p) return { "wall clock": null, "per transfer-second": null };
  const bytes = d.counters.kv_transfer_bytes - p.counters.kv_transfer_bytes;
  const busy = d.counters.kv_transfer_s - p.counters.kv_transfer_s;
  return {
    "wall clock": rate(d, p, (x) => x.counters.kv_transfer_bytes) / 1e6,
    "per transfer-second": busy > 0 ? bytes / busy / 1e6 : null,
  };
}

function perWorker(d, key) {
  const out = {};
  for (const w of d.workers) out[w.worker_id] = w.up ? key(w) : null;
  return out;
}

function update(d) {
  const t = d.now_s, p = previous;
  const windows = Object.fromEntries(d.goodput.map((g) => [g.window, g]));
  charts.requests.push(t, requestRates(d, p));
  charts.tokens.push(t, {
    generated: p ? rate(d, p, (x) => x.counters.generation_tokens) : null,
    prompt: p ? rate(d, p, (x) => x.counters.prompt_tokens) : null,
  });
  charts.ttft.push(t, quantileSeries(d.latency_ms.ttft, "TTFT SLO", d.slo.ttft_ms));
  charts.itl.push(t, quantileSeries(d.latency_ms.itl, "TPOT SLO", d.slo.tpot_ms));
  const goodput = {}, attainment = {};
  for (const [w, g] of Object.entries(windows)) {
    goodput[`goodput ${w}`] = g.goodput_rps;
    attainment[w] = g.slo_attainment === null ? null : 100 * g.slo_attainment;
  }
  const longest = d.goodput[d.goodput.length - 1];
  if (longest) goodput[`all requests ${longest.window}`] = longest.request_rps;
  charts.goodput.push(t, goodput);
  charts.attainment.push(t, attainment);
  charts.pools.push(t, d.pools);
  charts.load.push(t, perWorker(d, (w) => w.waiting + w.running));
  charts.kv.push(t, perWorker(d, (w) => (w.kv_usage === null ? null : 100 * w.kv_usage)));
  charts.prefix.push(t, prefixRates(d, p));
  charts.transfer.push(t, transferRates(d, p));
  updateTiles(d, windows);
  updateWorkers(d.workers);
  previous = d;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

function updateTiles(d, windows) {
  const r = d.counters.requests;
  setText("tile-uptime", fmtDuration(d.uptime_s));
  setText("tile-slo", `${fmt(d.slo.ttft_ms)} / ${fmt(d.slo.tpot_ms)} ms`);
  setText("tile-ok", fmt(r.ok));
  setText("tile-bad", `${fmt(r.error)} / ${fmt(r.rejected)}`);
  setText("tile-workers", String(d.workers.length));
  const last = d.goodput[d.goodput.length - 1];
  const a = last ? windows[last.window].slo_attainment : null;
  setText("tile-attainment", a === null ? "–" : `${(100 * a).toFixed(1)} %`);
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
}

function updateWorkers(workers) {
  const body = document.getElementById("workers-body");
  body.replaceChildren();
  for (const w of workers) {
    const row = document.createElement("tr");
    cell(row, w.worker_id);
    cell(row, w.role);
    cell(row, w.up ? "up" : "no answer", w.up ? "up" : "down");
    cell(row, w.up ? String(w.waiting) : "–");
    cell(row, w.up ? String(w.running) : "–");
    cell(row, w.up && w.kv_usage !== null ? `${(100 * w.kv_usage).toFixed(1)} %` : "–");
    cell(row, w.up ? `${w.free_blocks} / ${w.total_blocks}` : "–");
    cell(row, w.up ? String(w.cached_blocks) : "–");
    body.appendChild(row);
  }
}

function setStatus(text, cls) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = `status ${cls}`;
}

async function poll() {
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    update(await response.json());
    document.body.dataset.polls = String(Number(document.body.dataset.polls) + 1);
    delete document.body.dataset.lastError;
    setStatus("live", "status-ok");
  } catch (err) {
    document.body.dataset.lastError = String(err);
    setStatus(`no data: ${err}`, "status-bad");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

window.addEventListener("resize", () => { for (const c of Object.values(charts)) c.draw(); });
for (const c of Object.values(charts)) c.draw();
poll();
