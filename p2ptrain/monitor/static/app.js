// The p2ptrain monitor page: polls /api/state and redraws. Plain DOM and SVG, no framework, no build step.
// Every string in the state came from a peer and is untrusted: it only ever reaches the page as a text node
// (el()/svg() below and textContent); nothing here writes HTML from data.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function replace(id, ...children) {
  const node = document.getElementById(id);
  node.replaceChildren(...children);
  return node;
}

const short = (peer) => (peer ? "…" + String(peer).slice(-6) : "—");
const fmt = (x, digits = 3) => (x === null || x === undefined ? "—" : Number(x).toPrecision(digits));
const secs = (x) => (x === null || x === undefined ? "—" : x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s");
const clock = (t) => new Date(t * 1000).toLocaleTimeString();
const percent = (x) => (x === null || x === undefined ? "—" : Math.round(x * 100) + "%");

function bytes(x) {
  // decimal units, as link speeds are quoted: "12.5 MB"
  if (x === null || x === undefined) return "—";
  const units = ["B", "kB", "MB", "GB", "TB", "PB"];
  const i = Math.max(0, Math.min(units.length - 1, Math.floor(Math.log10(Math.max(x, 1)) / 3)));
  return (i ? (x / 10 ** (3 * i)).toPrecision(3) : String(x)) + " " + units[i];
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const perStep = (x) => (x === null || x === undefined ? "—" : bytes(x) + "/step");

function syncMode(s) {
  if (s.sync === null) return "—";
  return s.sync === "diloco" ? `DiLoCo, H = ${s.sync_every}` : "every step";
}

function label(state, peer) {
  const p = state.peers.find((q) => q.peer_id === peer);
  return p && p.region ? p.region : short(peer);
}

// ---- summary tiles -------------------------------------------------------------------------------------

function renderSummary(state) {
  const s = state.summary;
  const tiles = [
    ["peers alive", `${s.peers_alive} / ${s.peers_seen}`],
    ["epoch", s.epoch === null ? "—" : s.epoch],
    ["step", s.step],
    ["loss", fmt(s.loss, 4)],
    ["step time", secs(s.step_time_s)],
    ["predicted", secs(s.predicted_step_s)],
    ["tokens/s", s.tokens_per_s ? Math.round(s.tokens_per_s).toLocaleString() : "—"],
    ["sync", syncMode(s)],
    ["round", s.round === null ? "—" : `${s.round} · ${plural(s.round_steps_left, "step")} left`],
    ["utilisation", percent(s.utilisation)],
    ["MFU", percent(s.mfu)],
    ["sent by the trainers", perStep(s.sent_bytes_per_step)],
    ["re-plans", s.replans],
    ["joins / leaves", `${s.joins} / ${s.leaves}`],
  ];
  replace("summary", ...tiles.map(([k, v]) => el("div", { class: "tile" }, el("div", { class: "label" }, k),
    el("div", { class: "value", "data-key": k }, v))));
}

// ---- charts --------------------------------------------------------------------------------------------

function lineChart(id, series, markers, opts) {
  // drawn at the container's width, so that text keeps its size however wide the panel is
  const W = Math.max(320, document.getElementById(id).clientWidth || 640), H = opts.height || 220;
  const L = 56, R = 12, T = 10, B = 28;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const points = series.flatMap((s) => s.points);
  if (!points.length) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, opts.empty || "no data yet"));
    replace(id, root);
    return;
  }
  let [x0, x1] = [Math.min(...points.map((p) => p[0])), Math.max(...points.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...points.map((p) => p[1])), Math.max(...points.map((p) => p[1]))];
  if (opts.zero) y0 = Math.min(0, y0);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.08;
  y0 = opts.zero && y0 === 0 ? 0 : y0 - pad; y1 += pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const axis = svg("g", { class: "axis" });
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    axis.append(svg("line", { x1: L, x2: W - R, y1: sy(y), y2: sy(y) }));
    axis.append(svg("text", { x: L - 6, y: sy(y) + 4, "text-anchor": "end" }, (opts.tick || fmt)(y)));
  }
  const steps = Math.max(1, Math.min(Math.floor(W / 90), Math.round(x1 - x0)));
  for (let i = 0; i <= steps; i++) {
    const x = Math.round(x0 + ((x1 - x0) * i) / steps);
    axis.append(svg("text", { x: sx(x), y: H - 8, "text-anchor": "middle" }, x));
  }
  axis.append(svg("text", { x: L - 6, y: H - 8, "text-anchor": "end" }, "step"));
  root.append(axis);
  for (const m of markers) {
    if (m.x < x0 || m.x > x1) continue;
    const g = svg("g", { class: `marker ${m.kind}` });
    g.append(svg("line", { x1: sx(m.x), x2: sx(m.x), y1: T, y2: H - B }));
    g.append(svg("title", {}, m.text));
    root.append(g);
  }
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    root.append(svg("path", { d, class: `series ${s.cls}` }));
    if (s.dots) {
      for (const p of s.points) {
        const c = svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, class: `point ${s.cls}-point`, "data-step": p[0] });
        c.append(svg("title", {}, `step ${p[0]}: ${fmt(p[1], 5)}`));
        root.append(c);
      }
    }
    if (s.name) {
      const last = s.points[s.points.length - 1];
      root.append(svg("text", { x: Math.min(sx(last[0]), W - R - 70), y: sy(last[1]) - 6, class: "legend" }, s.name));
    }
  }
  replace(id, root);
}

function renderCharts(state) {
  const markers = state.events.filter((e) => e.kind !== "start").map((e) => ({ x: e.step, kind: e.kind, text: e.text }));
  const series = state.series;
  lineChart("loss-chart", [{ points: series.loss, cls: "measured loss", dots: true }], markers,
    { empty: "no loss yet (the last stage reports it after each step)", height: 240 });
  lineChart("time-chart", [
    { points: series.step_time_s, cls: "measured", dots: true, name: "measured" },
    { points: series.predicted_step_s, cls: "predicted", name: "predicted" },
  ], markers, { zero: true, tick: secs, empty: "no steps yet" });
  lineChart("tokens-chart", [{ points: series.tokens_per_s, cls: "measured", dots: true }], markers, {
    zero: true, tick: (y) => Math.round(y).toLocaleString(),
    empty: state.tokens_per_step ? "no steps yet" : "tokens/s needs --tokens-per-step",
  });
}

// ---- plan ----------------------------------------------------------------------------------------------

function renderPlan(state) {
  const plan = state.plan;
  if (!plan) {
    replace("plan", el("p", { class: "muted" }, "no plan yet: the agents are measuring their links"));
    replace("plan-title");
    replace("plan-costs");
    return;
  }
  const byId = Object.fromEntries(state.peers.map((p) => [p.peer_id, p]));
  const head = el("tr", {}, el("th", {}, ""), ...Array.from({ length: plan.stages }, (_, j) => el("th", {}, `stage ${j}`)));
  const rows = plan.pipelines.map((row, i) => el("tr", {}, el("th", {}, `pipeline ${i}`), ...row.map((peer) => {
    const p = byId[peer] || {};
    const cls = "cell" + (peer === plan.leader ? " leader" : "");
    return el("td", { class: cls, "data-peer": peer, title: peer }, el("div", { class: "peer" }, short(peer)),
      el("div", { class: "dev" }, [p.region, p.device_name].filter(Boolean).join(" · ") || "—"));
  })));
  const table = el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
  const extra = [];
  if (plan.spares.length) extra.push(el("p", { class: "muted" }, "spares: " + plan.spares.map((p) => label(state, p)).join(", ")));
  replace("plan", table, ...extra);
  replace("plan-title", `epoch ${plan.epoch} · ${plan.stages} stages × ${plan.replicas} pipelines · objective ${plan.objective}` +
    (plan.reason ? ` · ${plan.reason}` : ""));
  const parts = [`predicted ${secs(plan.predicted_step_s)} per step (cost ${fmt(plan.cost_s, 4)} s: data parallel ` +
    `${fmt(plan.data_parallel_s, 4)} s, pipeline ${fmt(plan.pipeline_s, 4)} s)`];
  for (const [name, cost] of Object.entries(plan.baselines)) {
    parts.push(`${name} ${fmt(cost, 4)} s (×${(cost / plan.cost_s).toFixed(2)})`);
  }
  if (state.summary.step_time_s !== null) parts.push(`measured ${secs(state.summary.step_time_s)} per step`);
  replace("plan-costs", parts.join(" · "));
}

// ---- peers ---------------------------------------------------------------------------------------------

function role(p) {
  const r = p.role;
  if (r.kind === "trainer") return `stage ${r.stage} · pipeline ${r.pipeline}`;
  if (r.kind === "spare") return r.backup_of.length ? `spare · copy of stage ${r.backup_of.join(", ")}` : "spare";
  return "—";
}

function renderPeers(state) {
  const rows = state.peers.map((p) => el("tr", { "data-peer": p.peer_id },
    el("td", { title: p.peer_id }, short(p.peer_id) + (p.leader ? " ★" : "")),
    el("td", { class: "text device" }, p.device_name ?? "—"),
    el("td", { class: "text region" }, p.region || "—"),
    el("td", {}, p.memory_gb ? `${fmt(p.memory_gb, 3)} GB` : "—"),
    el("td", {}, p.tflops ? `${fmt(p.tflops, 3)} TFLOP/s` : "—"),
    el("td", {}, p.address ? el("span", { class: `pill ${p.address}`, title: (p.maddrs || []).join("\n") }, p.address) : "—"),
    el("td", {}, el("span", { class: `pill ${p.liveness}` }, p.liveness)),
    el("td", {}, role(p)),
    el("td", {}, p.step ?? "—"),
    el("td", {}, fmt(p.loss, 4)),
    el("td", {}, perStep(p.sent_bytes)),
    el("td", {}, percent(p.utilisation)),
    el("td", {}, percent(p.mfu)),
    el("td", { title: "DHT calls, their kB, and heartbeat pings' and link probes' kB, a minute since the peer started" },
      p.traffic ? `${p.traffic.dht_calls} · ${p.traffic.dht_kb} kB · ${p.traffic.control_kb} kB` : "—"),
    el("td", {}, p.heartbeat_age_s === null ? "—" : `${Math.round(p.heartbeat_age_s)} s ago`),
  ));
  document.querySelector("#peers tbody").replaceChildren(...rows);
}

// ---- link heat maps ------------------------------------------------------------------------------------

function heatmap(id, state, matrix, unit, lowIsGood) {
  const peers = state.links.peers;
  const n = peers.length;
  const values = matrix.flat().filter((v) => v !== null && v > 0);
  if (!n || !values.length) {
    replace(id, el("p", { class: "muted" }, "no links measured yet"));
    return;
  }
  const lo = Math.log(Math.min(...values)), hi = Math.log(Math.max(...values));
  const cell = Math.max(12, Math.min(40, Math.floor(520 / n))), L = 80, T = 80;
  const [w, h] = [L + n * cell + 4, T + n * cell + 4];
  const root = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: w, height: h, role: "img" });
  peers.forEach((peer, i) => {
    const name = label(state, peer);
    root.append(svg("text", { x: L - 4, y: T + i * cell + cell / 2 + 4, "text-anchor": "end" }, name));
    root.append(svg("text", { x: 0, y: 0, transform: `translate(${L + i * cell + cell / 2 + 4},${T - 4}) rotate(-60)` }, name));
  });
  matrix.forEach((row, i) => row.forEach((v, j) => {
    if (i === j) return;
    const t = v === null || hi === lo ? 0.5 : (Math.log(v) - lo) / (hi - lo);
    const good = lowIsGood ? 1 - t : t;
    const fill = v === null ? "#eee" : `hsl(${Math.round(good * 120)}, 65%, ${v === null ? 90 : 55}%)`;
    const rect = svg("rect", { x: L + j * cell, y: T + i * cell, width: cell - 1, height: cell - 1, fill, class: "link" });
    rect.append(svg("title", {}, `${label(state, peers[i])} → ${label(state, peers[j])}: ${v === null ? "not measured" : fmt(v, 3) + " " + unit}`));
    root.append(rect);
  }));
  const [best, worst] = lowIsGood ? [Math.exp(lo), Math.exp(hi)] : [Math.exp(hi), Math.exp(lo)];
  replace(id, root, el("p", { class: "muted" }, `green ${fmt(best, 3)} ${unit} … red ${fmt(worst, 3)} ${unit}; grey: not measured`));
}

function renderLinks(state) {
  const estimated = (state.links.estimated || []).reduce((a, b) => a + b, 0) / 2;
  const pairs = state.links.peers.length * (state.links.peers.length - 1) / 2;
  const share = estimated && pairs ? `; ${pairs - estimated} of ${pairs} pairs measured, the rest estimated by the planner` : "";
  replace("links-units", `(${state.links.units}; row sends to column${share})`);
  heatmap("latency-map", state, state.links.latency_ms, "ms", true);
  heatmap("bandwidth-map", state, state.links.bandwidth_gbps, "Gbps", false);
}

// ---- events --------------------------------------------------------------------------------------------

function renderEvents(state) {
  const items = state.events.slice().reverse().map((e) => el("li", { class: e.kind },
    el("span", { class: "when" }, `${clock(e.time)} · step ${e.step}`),
    e.peer ? `${label(state, e.peer)} (${short(e.peer)}): ` : "", e.text));
  replace("events", ...items);
}

// ---- the loop ------------------------------------------------------------------------------------------

function render(state) {
  document.getElementById("run").textContent = state.run;
  document.title = `p2ptrain · ${state.run}`;
  const emu = state.emulation ? ` · emulated network (time scale ${state.emulation.time_scale}, size factor ${fmt(state.emulation.size_factor, 4)})` : "";
  const read = state.last_read === null ? "no read of the DHT yet"
    : `last read of the DHT ${clock(state.last_read)} (${Math.round(state.time - state.last_read)} s ago)`;
  const failed = state.poll_errors ? ` · ${state.poll_errors} reads failed` : "";
  document.getElementById("status").textContent = `${read} · ${state.polls} reads${failed}${emu}`;
  renderSummary(state);
  renderCharts(state);
  renderPlan(state);
  renderPeers(state);
  renderLinks(state);
  renderEvents(state);
  document.body.dataset.polls = state.polls;
}

async function poll() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (err) {
    document.getElementById("status").textContent = `cannot reach the monitor (${err.message}); retrying…`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
