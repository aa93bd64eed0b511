// duet operator dashboard: polls the admin API and draws everything itself (SVG), no library, no CDN.
"use strict";

const POLL_MS = 1500;
const WINDOW_S = 300;          // the charts show the last five minutes (or since the first point, at least 60 s)
const COLORS = { prefill: "#f2a33a", decode: "#36b9d6", p50: "#3ccf8e", p90: "#f2c94c", p99: "#f0605d",
                 accent: "#8b8cf8", muted: "#8593a6", bad: "#f0605d", tier: "#8b8cf8" };
const SVG = "http://www.w3.org/2000/svg";

const state = { key: sessionStorage.getItem("duet-key") || "", points: [], lastT: 0, access: null,
                workers: [], auto: null, model: null, weights: null, busy: false, error: null };

// ---------------------------------------------------------------------------------------- data

async function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (state.key) headers.Authorization = "Bearer " + state.key;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = (body.error && body.error.message) || response.statusText;
    const err = new Error(message);
    err.status = response.status;
    throw err;
  }
  return body;
}

async function refresh() {
  if (state.busy) return;
  state.busy = true;
  try {
    const [access, workers, auto, timeline] = await Promise.all([
      api("/admin/access"), api("/admin/workers"), api("/admin/autoscaler"),
      api("/admin/timeline?since=" + state.lastT)]);
    if (!state.model) {
      try {
        const entry = (await api("/v1/models")).data[0];
        state.model = entry.id;
        state.weights = entry.duet || null;  // what the engines hold and run (the card's extension object)
      } catch (e) { state.model = ""; }
    }
    state.access = access; state.workers = workers.data; state.auto = auto;
    for (const p of timeline.data) state.points.push(p);
    if (state.points.length) state.lastT = state.points[state.points.length - 1].t;
    const cutoff = Date.now() / 1000 - 600;
    while (state.points.length && state.points[0].t < cutoff) state.points.shift();
    state.error = null;
  } catch (e) {
    state.error = e.status === 401 ? "This cluster needs an API key to read: enter it above." : "Cannot reach the router: " + e.message;
  } finally {
    state.busy = false;
  }
  render();
}

// ---------------------------------------------------------------------------------------- helpers

const $ = (id) => document.getElementById(id);
function el(tag, attrs = {}, children = []) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k === "class") node.setAttribute("class", v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c) node.appendChild(c);
  return node;
}
function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s === 0) return "0";
  if (s < 0.001) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
  return s.toFixed(s < 10 ? 2 : 1) + " s";
}
function fmtNumber(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toFixed(digits) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (a >= 1e3) return (x / 1e3).toFixed(digits) + "k";
  return a >= 100 || Number.isInteger(x) ? x.toFixed(0) : x.toFixed(digits);
}
const fmtPct = (x) => (x === null || x === undefined ? "–" : (x * 100).toFixed(x < 0.1 ? 1 : 0) + "%");
const fmtBytes = (x) => (x === null || x === undefined ? "–" : fmtNumber(x) + "B/s");
function latest(key) {
  for (let i = state.points.length - 1; i >= 0; i--) {
    const v = state.points[i][key];
    if (v !== null && v !== undefined) return v;
  }
  return null;
}
function sumLast(key, seconds) {
  const since = Date.now() / 1000 - seconds;
  return state.points.filter((p) => p.t >= since).reduce((a, p) => a + (p[key] || 0), 0);
}

// ---------------------------------------------------------------------------------------- charts

// A line chart of some point fields over the last WINDOW_S seconds. Gaps (null) break the line. A series with
// legendOnly is not drawn, only its latest value shown in the legend (in its own fmt, if it has one).
function lineChart(id, spec) {
  const fig = $(id);
  let svg = fig.querySelector("svg");
  let legend = fig.querySelector(".legend");
  if (!svg) {
    svg = el("svg:svg", { viewBox: "0 0 400 150", preserveAspectRatio: "none" });
    legend = el("div", { class: "legend" });
    fig.appendChild(svg); fig.appendChild(legend);
  }
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 400, H = 150, L = 50, R = 6, T = 8, B = 18;
  const now = Date.now() / 1000;
  const first = state.points.length ? state.points[0].t : now;
  const span = Math.min(WINDOW_S, Math.max(60, now - first));
  const t0 = now - span;
  const axisFmt = spec.axisFmt || spec.fmt;
  const pts = state.points.filter((p) => p.t >= t0);
  const drawn = spec.series.filter((s) => !s.legendOnly);
  const values = [];
  for (const s of drawn) for (const p of pts) if (p[s.key] !== null && p[s.key] !== undefined) values.push(s.scale ? p[s.key] * s.scale : p[s.key]);
  let yMax = Math.max(spec.min || 0, ...values, spec.slo ? spec.slo * 1.15 : 0);
  if (spec.max !== undefined) yMax = Math.max(yMax, spec.max);
  if (!(yMax > 0)) yMax = 1;
  yMax = spec.integer ? Math.max(4, Math.ceil(yMax / 4) * 4) : niceCeil(yMax);
  const x = (t) => L + ((t - t0) / span) * (W - L - R);
  const y = (v) => T + (1 - v / yMax) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    svg.appendChild(el("svg:line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    svg.appendChild(el("svg:text", { x: L - 5, y: y(v) + 3, "text-anchor": "end", class: "axis-label", text: axisFmt(v) }));
  }
  const ago = (sec) => (sec >= 120 ? "-" + (sec / 60).toFixed(sec % 60 ? 1 : 0) + " min" : "-" + Math.round(sec) + " s");
  for (const [label, t] of [[ago(span), t0], [ago(span / 2), t0 + span / 2], ["now", now]]) {
    svg.appendChild(el("svg:text", { x: Math.min(Math.max(x(t), L + 10), W - R - 12), y: H - 4,
                                     "text-anchor": "middle", class: "axis-label", text: label }));
  }
  if (spec.slo) {
    svg.appendChild(el("svg:line", { x1: L, x2: W - R, y1: y(spec.slo), y2: y(spec.slo), class: "slo" }));
    svg.appendChild(el("svg:text", { x: W - R - 2, y: y(spec.slo) - 3, "text-anchor": "end", class: "slo-label",
                                     text: "SLO " + spec.fmt(spec.slo) }));
  }
  let plotted = 0;
  for (const s of drawn) {
    let d = "", pen = false;
    for (const p of pts) {
      const raw = p[s.key];
      if (raw === null || raw === undefined) { pen = false; continue; }
      const v = s.scale ? raw * s.scale : raw;
      d += (pen ? "L" : "M") + x(p.t).toFixed(1) + "," + y(v).toFixed(1);
      if (s.step) d += "H" + x(p.t + 1).toFixed(1);
      pen = true; plotted++;
    }
    if (d) svg.appendChild(el("svg:path", { d, class: "series", stroke: s.color,
                                            "stroke-dasharray": s.dash ? "4 3" : "none" }));
  }
  if (!pts.length) svg.appendChild(el("svg:text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty", text: "waiting for data…" }));
  svg.setAttribute("data-points", String(plotted));
  while (legend.firstChild) legend.removeChild(legend.firstChild);
  for (const s of spec.series) {
    const v = latest(s.key);
    const text = v === null ? "–" : s.fmt ? s.fmt(v) : spec.fmt(s.scale ? v * s.scale : v);
    legend.appendChild(el("span", {}, [s.legendOnly ? null : el("i", { style: "background:" + s.color }),
                                       document.createTextNode(s.label + " "), el("b", { text })]));
  }
}
function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// ---------------------------------------------------------------------------------------- render

function render() {
  const banner = $("banner");
  banner.textContent = state.error || "";
  banner.classList.toggle("hidden", !state.error);
  const auto = state.auto;
  $("model").textContent = state.model || "";
  renderWeights(state.weights);
  const readyDecode = state.workers.filter((w) => w.role === "decode" && w.state === "ready").length;
  const status = $("status");
  status.textContent = state.error ? "unreachable" : readyDecode ? "serving" : "no decode worker";
  status.className = "pill " + (state.error || !readyDecode ? "pill-bad" : "pill-ok");
  if (!auto) return;
  const pools = auto.pools;
  $("ratio").textContent = pools.prefill.ready + " : " + pools.decode.ready;
  $("ratio-target").textContent = "(target " + pools.prefill.target + " : " + pools.decode.target + ")";
  $("autoscaler-mode").textContent = auto.enabled ? "autoscaler on · every " + auto.interval_s + " s" : "autoscaler off";

  const [allowed, why] = writesAllowed();
  const note = $("access-note");
  note.textContent = allowed ? "" : "read-only · " + why;
  note.classList.toggle("hidden", allowed);
  renderKpis(auto);
  const slo = auto.slo;
  lineChart("chart-ttft", { fmt: fmtSeconds, slo: slo.ttft_s, series: [
    { key: "ttft_p50", label: "p50", color: COLORS.p50 }, { key: "ttft_p90", label: "p90", color: COLORS.p90 },
    { key: "ttft_p99", label: "p99", color: COLORS.p99 }] });
  lineChart("chart-itl", { fmt: fmtSeconds, slo: slo.itl_s, series: [
    { key: "itl_p50", label: "p50", color: COLORS.p50 }, { key: "itl_p90", label: "p90", color: COLORS.p90 },
    { key: "itl_p99", label: "p99", color: COLORS.p99 }] });
  lineChart("chart-traffic", { fmt: (v) => fmtNumber(v), series: [
    { key: "req_s", label: "finished/s", color: COLORS.accent },
    { key: "waiting_prefill", label: "queued prefill", color: COLORS.prefill },
    { key: "waiting_decode", label: "queued decode", color: COLORS.decode }] });
  lineChart("chart-pools", { fmt: (v) => (Number.isInteger(v) ? String(v) : ""), min: 4, integer: true, series: [
    { key: "ready_prefill", label: "prefill ready", color: COLORS.prefill, step: true },
    { key: "target_prefill", label: "target", color: COLORS.prefill, dash: true, step: true },
    { key: "ready_decode", label: "decode ready", color: COLORS.decode, step: true },
    { key: "target_decode", label: "target", color: COLORS.decode, dash: true, step: true }] });
  lineChart("chart-kv", { fmt: fmtPct, max: 1, series: [
    { key: "kv_prefill", label: "prefill", color: COLORS.prefill }, { key: "kv_decode", label: "decode", color: COLORS.decode }] });
  renderKvHeld();
  lineChart("chart-prefix", { fmt: fmtPct, max: 1, series: [{ key: "prefix_hit", label: "hit rate", color: COLORS.p50 }] });
  lineChart("chart-xfer", { fmt: (v) => fmtNumber(v) + "B/s", axisFmt: (v) => fmtNumber(v, 1), series: [
    { key: "xfer_bytes_s", label: "bandwidth", color: COLORS.decode },
    { key: "xfer_failures", label: "failures", color: COLORS.bad }] });
  lineChart("chart-errors", { fmt: (v) => fmtNumber(v, 2), series: [
    { key: "errors_s", label: "errors/s", color: COLORS.bad }, { key: "recomputes", label: "recomputes", color: COLORS.p90 },
    { key: "lease_expiries", label: "lease expiries", color: COLORS.prefill },
    { key: "placed_again", label: "placed again", color: COLORS.accent }] });
  // speculative decoding: shown while a live worker speculates (the timeline's spec_on)
  const spec = $("chart-spec");
  spec.classList.toggle("hidden", !latest("spec_on"));
  if (!spec.classList.contains("hidden")) lineChart("chart-spec", { fmt: fmtPct, max: 1, series: [
    { key: "spec_accept_rate", label: "accepted", color: COLORS.p50 },
    { key: "spec_accept_len", label: "mean length", legendOnly: true, fmt: (v) => v.toFixed(2) },
    { key: "spec_draft_tok_s", label: "drafted", legendOnly: true, fmt: (v) => fmtNumber(v) + " tok/s" }] });
  renderPool("prefill", pools.prefill);
  renderPool("decode", pools.decode);
  renderDecisions(auto.decisions);
}

function renderKpis(auto) {
  const set = (id, text, cls) => { const n = $(id); n.textContent = text; n.className = "kpi-value" + (cls ? " " + cls : ""); };
  set("kpi-req", fmtNumber(latest("req_s")));
  set("kpi-tok", fmtNumber(latest("tok_s")));
  const judge = (v, slo) => (v === null ? "" : v > slo ? "bad" : v > 0.8 * slo ? "warn" : "good");
  const ttft = latest("ttft_p90"), itl = latest("itl_p90");
  set("kpi-ttft", fmtSeconds(ttft), judge(ttft, auto.slo.ttft_s));
  set("kpi-itl", fmtSeconds(itl), judge(itl, auto.slo.itl_s));
  $("kpi-ttft-slo").textContent = "SLO " + fmtSeconds(auto.slo.ttft_s);
  $("kpi-itl-slo").textContent = "SLO " + fmtSeconds(auto.slo.itl_s);
  const queued = (latest("waiting_prefill") || 0) + (latest("waiting_decode") || 0);
  set("kpi-queue", fmtNumber(queued, 0), queued > 0 ? "warn" : "");
  set("kpi-prefix", fmtPct(latest("prefix_hit")));
  set("kpi-xfer", fmtBytes(latest("xfer_bytes_s")));
  const errors = sumLast("errors_s", 300) + sumLast("xfer_failures", 300);
  set("kpi-errors", fmtNumber(errors, 0), errors > 0 ? "bad" : "good");
}

function writesAllowed() {
  const a = state.access;
  if (!a || !a.pools) return [false, "this server runs no pools"];
  if (a.writes === "disabled") return [false, "writes are disabled: start the server with --admin-key"];
  if (a.writes === "admin_key" && !state.key) return [false, "enter the admin key to scale"];
  return [true, ""];
}

// The pool header and its controls are built once and updated in place (a click must never land on a
// button that is being replaced); the worker cards below are redrawn on every poll.
function renderPool(role, pool) {
  const box = $("pool-" + role);
  let head = box.querySelector(".pool-head");
  if (!head) {
    const minus = el("button", { "data-action": "minus", text: "−" });
    const plus = el("button", { "data-action": "plus", text: "+" });
    const pin = el("input", { type: "checkbox", "data-action": "pin" });
    minus.onclick = () => setTarget(role, state.auto.pools[role].target - 1);
    plus.onclick = () => setTarget(role, state.auto.pools[role].target + 1);
    pin.onchange = () => setPin(role, pin.checked);
    head = el("div", { class: "pool-head" }, [
      el("h2", { text: role === "prefill" ? "Prefill pool" : "Decode pool" }), el("span", { class: "muted summary" }),
      el("div", { class: "controls" }, [minus, el("span", { class: "target", "data-role-target": role }), plus,
                                        el("label", {}, [pin, document.createTextNode("pin")])])]);
    box.appendChild(head);
    box.appendChild(el("div", { class: "workers" }));
  }
  const [allowed, why] = writesAllowed();
  const minus = head.querySelector('[data-action="minus"]'), plus = head.querySelector('[data-action="plus"]');
  const pin = head.querySelector('[data-action="pin"]');
  minus.disabled = !allowed || pool.target <= pool.min;
  plus.disabled = !allowed || pool.target >= pool.max;
  pin.disabled = !allowed;
  if (document.activeElement !== pin) pin.checked = pool.pinned;
  minus.title = why || "one worker less (drains the least busy)";
  plus.title = why || "one worker more";
  pin.title = why || "a pinned pool is left alone by the autoscaler";
  head.querySelector(".target").textContent = String(pool.target);
  head.querySelector(".summary").textContent = pool.ready + " ready · target " + pool.target + " (" + pool.min + "–" +
    pool.max + ")" + (pool.starting ? " · " + pool.starting + " starting" : "") +
    (pool.draining ? " · " + pool.draining + " draining" : "") + (pool.pinned ? " · pinned" : "");
  const grid = box.querySelector(".workers");
  while (grid.firstChild) grid.removeChild(grid.firstChild);
  const workers = state.workers.filter((w) => w.role === role)
    .sort((a, b) => (a.state === "dead") - (b.state === "dead") || a.worker_id.localeCompare(b.worker_id, undefined, { numeric: true }));
  for (const w of workers.slice(0, 12)) grid.appendChild(workerCard(w, role));
  if (!workers.length) grid.appendChild(el("div", { class: "muted", text: "no workers" }));
}

// a worker's KV cache (stats.kv_cache): its dtype (auto: the model dtype it resolved to), and the tokens its device
// blocks in use hold of all they can hold (blocks x block size)
function kvDtype(w) {
  const c = (w.stats || {}).kv_cache;
  return c ? (c.cache_dtype === "auto" ? c.storage : c.cache_dtype) : null;
}
function kvTokens(w) {
  const c = (w.stats || {}).kv_cache;
  if (!c || !w.kv_blocks_total) return null;
  return { held: (w.kv_blocks_used || 0) * c.block_size, total: w.kv_blocks_total * c.block_size };
}

// under the KV-cache chart: per role, the KV dtypes of its live workers and the tokens they hold
function renderKvHeld() {
  const fig = $("chart-kv");
  let box = fig.querySelector(".kv-held");
  if (!box) { box = el("div", { class: "kv-held" }); fig.appendChild(box); }
  while (box.firstChild) box.removeChild(box.firstChild);
  for (const role of ["prefill", "decode"]) {
    const live = state.workers.filter((w) => w.role === role && (w.state === "ready" || w.state === "draining"));
    const dtypes = [...new Set(live.map(kvDtype).filter((d) => d))];
    const tokens = live.map(kvTokens).filter((t) => t);
    const held = tokens.reduce((a, t) => a + t.held, 0), total = tokens.reduce((a, t) => a + t.total, 0);
    box.appendChild(el("span", { "data-role": role, "data-dtype": dtypes.join(","),
      text: role + " KV " + (dtypes.join(", ") || "–") + " · " + (total ? fmtNumber(held, 1) + " / " +
        fmtNumber(total, 1) + " tokens held" : "–") }));
  }
}

function workerCard(w, role) {
  const s = w.stats || {};
  const used = w.kv_blocks_used, total = w.kv_blocks_total;
  const kv = total ? used / total : 0;
  const health = role === "decode"
    ? "transfers " + fmtNumber(s.transfers_ok || 0, 0) + " ok · " + fmtNumber(s.transfers_failed || 0, 0) + " failed"
    : "leases " + fmtNumber(s.leases_held || 0, 0) + " held · " + fmtNumber(s.leases_expired || 0, 0) + " expired";
  const bar = el("div", { class: "bar" }, [el("span", { style: "width:" + (kv * 100).toFixed(1) + "%;background:" +
                                                   (kv > 0.9 ? COLORS.bad : COLORS[role]) })]);
  return el("div", { class: "worker" + (w.state === "dead" ? " dead" : ""), "data-worker": w.worker_id, "data-state": w.state }, [
    el("div", { class: "row" }, [el("span", { class: "id", text: w.worker_id }), el("span", { class: "state state-" + w.state, text: w.state })]),
    el("div", { class: "row" }, [el("span", { text: "running " + (w.running ?? "–") + " · waiting " + (w.waiting ?? "–") }),
                                 el("span", { text: w.uptime_s !== null ? "up " + fmtUptime(w.uptime_s) : "" })]),
    bar,
    el("div", { class: "row" }, [el("span", { class: "kv", "data-dtype": kvDtype(w) || "",
      title: total ? used + " / " + total + " blocks" : "", text: "KV " + (kvDtype(w) ? kvDtype(w) + " · " : "") +
        (kvTokens(w) ? fmtNumber(kvTokens(w).held, 1) + " / " + fmtNumber(kvTokens(w).total, 1) + " tokens"
          : total ? used + " / " + total + " blocks" : "–") }),
                                 el("span", { text: w.pid ? "pid " + w.pid : "" })]),
    ...lowerTiers(w),
    ...loraAdapters(w),
    el("div", { class: "row" }, [el("span", { text: w.state === "dead" || w.state === "draining" ? (w.reason || "") : health })]),
  ]);
}

// the host and disk KV tiers a worker reported (kv_tiers: {tier: {blocks_total, blocks_used}}), and where its
// prompts' KV came from (stats.prefix_hit_tokens_by_source)
function lowerTiers(w) {
  const rows = [];
  for (const tier of ["host", "disk"]) {
    const t = (w.kv_tiers || {})[tier];
    if (!t || !t.blocks_total) continue;
    const frac = t.blocks_used / t.blocks_total;
    rows.push(el("div", { class: "tier", "data-tier": tier }, [
      el("span", { class: "tier-name", text: tier }),
      el("div", { class: "bar thin" }, [el("span", { style: "width:" + (frac * 100).toFixed(1) + "%;background:" + COLORS.tier })]),
      el("span", { text: fmtNumber(t.blocks_used, 0) + " / " + fmtNumber(t.blocks_total, 0) }),
    ]));
  }
  const hits = (w.stats || {}).prefix_hit_tokens_by_source;
  if (hits && (hits.host || hits.disk || hits.peer)) {
    rows.push(el("div", { class: "row hits" }, [el("span", { text: "hit tokens: device " + fmtNumber(hits.device, 0) +
      " · host " + fmtNumber(hits.host, 0) + " · disk " + fmtNumber(hits.disk, 0) + " · peer " + fmtNumber(hits.peer, 0) })]));
  }
  return rows;
}
// a worker's LoRA adapters (stats.lora): every adapter loaded (host memory), those in a device slot highlighted
// (running: requests use it now; pinned: never evicted), and its slots in use of max_loras
function loraAdapters(w) {
  const l = (w.stats || {}).lora;
  if (!l) return [];
  const slots = l.slots || {}, running = new Set(l.running_adapters || []), pinned = new Set(l.pinned || []);
  const names = (l.loaded || []).map((n) => el("span", {
    class: "lora-ad" + (n in slots ? " in-slot" : "") + (running.has(n) ? " running" : "") + (pinned.has(n) ? " pinned" : ""),
    "data-adapter": n, title: n in slots ? "slot " + slots[n] + (running.has(n) ? ", running" : ", idle") +
      (pinned.has(n) ? ", pinned" : "") : "host memory only", text: n }));
  return [el("div", { class: "lora", "data-loaded": (l.loaded || []).join(","), "data-slots": Object.keys(slots).join(",") }, [
    el("span", { class: "tier-name", text: "LoRA" }),
    el("span", { class: "lora-names" }, names.length ? names : [el("span", { class: "muted", text: "none" })]),
    el("span", { class: "lora-slots", title: (l.evictions || 0) + " evictions", text: Object.keys(slots).length + "/" +
      l.max_loras + " slots" }),
  ])];
}
const fmtUptime = (s) => (s < 90 ? s.toFixed(0) + " s" : s < 5400 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h");

function renderDecisions(decisions) {
  const body = $("decisions");
  while (body.firstChild) body.removeChild(body.firstChild);
  if (!decisions.length) {
    body.appendChild(el("tr", {}, [el("td", { colspan: "5", class: "muted", text: "no scaling decision yet" })]));
    return;
  }
  for (const d of decisions.slice(0, 12)) {
    const ago = new Date(d.at * 1000).toLocaleTimeString() + " (" + fmtUptime(Math.max(0, Date.now() / 1000 - d.at)) + " ago)";
    body.appendChild(el("tr", {}, [el("td", { class: "muted", text: ago }), el("td", { text: d.role }),
                                   el("td", { class: d.direction, text: d.direction === "up" ? "▲ up" : "▼ down" }),
                                   el("td", { text: String(d.target) }), el("td", { text: d.reason })]));
  }
}

function fmtSize(n) {  // bytes in binary units, as the worker's log and engine/loading/weights_summary.py write them
  for (const [unit, k] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) if (n >= k) return (n / k).toFixed(1) + " " + unit;
  return n + " B";
}

function renderWeights(w) {  // static while the page is open: drawn when it arrives, not on every poll
  const body = $("weights");
  if (body.dataset.drawn === String(Boolean(w))) return;
  body.dataset.drawn = String(Boolean(w));
  while (body.firstChild) body.removeChild(body.firstChild);
  $("weights-total").textContent = w ? fmtSize(w.weight_bytes) + " resident" + (w.checkpoint_bytes
    ? " · checkpoint " + fmtSize(w.checkpoint_bytes) + " (" + (w.weight_bytes / w.checkpoint_bytes).toFixed(2) + "×)" : "")
    + " · kernels " + w.kernels + " · decode steps: " + w.decode_graphs : "";
  if (!w) {
    body.appendChild(el("tr", {}, [el("td", { colspan: "5", class: "muted", text: "the server did not say" })]));
    return;
  }
  for (const g of w.weights) {
    const shared = g.shared_bytes ? " (+" + fmtSize(g.shared_bytes) + " shared)" : "";
    body.appendChild(el("tr", { "data-kind": g.kind }, [el("td", { text: g.kind }), el("td", { text: g.format }),
      el("td", { class: "num", text: fmtSize(g.bytes) + shared }), el("td", { class: "num", text: String(g.tensors) }),
      el("td", { class: "muted", text: g.kernel })]));
  }
}

// ---------------------------------------------------------------------------------------- actions

async function setTarget(role, target) {
  try {
    await api("/admin/pools/" + role, { method: "POST", body: JSON.stringify({ target }) });
    state.error = null;
  } catch (e) {
    state.error = "Scaling " + role + " failed: " + e.message;
  }
  refresh();
}
async function setPin(role, pin) {
  try {
    await api("/admin/pools/" + role, { method: "POST", body: JSON.stringify({ pin }) });
  } catch (e) {
    state.error = "Pinning " + role + " failed: " + e.message;
  }
  refresh();
}

$("key").value = state.key;
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem("duet-key", state.key);
  state.model = null;
  refresh();
});
refresh();
setInterval(refresh, POLL_MS);
