// The fleet dashboard: renders each snapshot the server pushes over server-sent events.
// Every text the fleet sends goes in with textContent, never as HTML.
"use strict";

const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
// `share(metric)`: whether the chart's figures are fractions, drawn on 0 % to 100 % at most.
const CHARTS = [
  { id: "chart-accuracy", key: "accuracy", value: (s, i) => s.accuracy[i],
    share: (metric) => metric === "accuracy" },
  { id: "chart-loss", key: "loss", value: (s, i) => s.loss[i], format: (v) => v.toFixed(2) },
  { id: "chart-sparsity", key: "sparsity", value: (s, i) => s.sparsity[i], share: () => true },
  { id: "chart-traffic", key: "bytes", format: bytes,
    value: (s, i) => (s.bytes_sent[i] ?? 0) + (s.bytes_received[i] ?? 0) },
];
const charts = {};
let received = { at: Date.now(), now: Date.now() / 1000 };
let shown = null;  // the server's clock of the snapshot on the page
let streaming = false;  // whether the event stream is delivering
const POLL_MS = 2000;

function pct(v, digits = 1) { return v == null ? "–" : (100 * v).toFixed(digits) + " %"; }

// The task's metric: accuracy as a percentage, any other (mae, reconstruction_error) named.
function figure(v, metric) {
  if (metric === "accuracy" || metric == null) return pct(v);
  return v == null ? "–" : v.toPrecision(4) + " " + metric;
}

function si(v, unit) {
  if (v == null) return "–";
  const steps = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [size, prefix] of steps) {
    if (Math.abs(v) >= size) return (v / size).toFixed(1) + " " + prefix + unit;
  }
  // Three significant digits: a round's 0.2 J is not "0 J".
  return Number(v.toPrecision(3)) + " " + unit;
}

function bytes(v) { return si(v, "B"); }

function age(since) {
  if (!since) return "";
  const now = received.now + (Date.now() - received.at) / 1000;
  const s = Math.max(0, Math.round(now - since));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0");
  return Math.floor(s / 86400) + "d";
}

// Seconds as 12.3, or to two significant digits below one (0.041).
function secs(v) { return v >= 1 ? v.toFixed(1) : String(Number(v.toPrecision(2))); }

// The round's measured training seconds over its cost table's prediction: "12.3 / 11.0".
function trainText(agent) {
  if (agent.train_s == null) return "–";
  return secs(agent.train_s) + (agent.predicted_s == null ? "" : " / " + secs(agent.predicted_s));
}

// Memory in MiB, as the agents report it; a small model's 0.4 MiB is not "0 MiB".
function mib(v) { return v == null ? "–" : (v >= 10 ? v.toFixed(0) : secs(v)) + " MiB"; }

function trainTitle(agent) {
  if (agent.train_s == null || agent.predicted_s == null || agent.predicted_s <= 0) return "";
  const error = (agent.train_s - agent.predicted_s) / agent.predicted_s;
  return (error >= 0 ? "+" : "") + (100 * error).toFixed(0) + " % against the prediction";
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text != null) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function label(agent, multi) { return multi ? agent.fleet + "/" + agent.agent : agent.agent; }

function stoppedText(agent) {
  const round = agent.saved ? agent.saved.round : agent.round;
  return "stopped after round " + round;
}

function savedText(saved) {
  if (!saved) return "";
  const energy = saved.energy_j == null ? "–" : si(saved.energy_j, "J");
  const rounds = saved.rounds === 1 ? "1 round" : (saved.rounds ?? "–") + " rounds";
  return "saved " + rounds + " · " + si(saved.flops, "FLOP") +
    " · " + bytes(saved.bytes) + " · energy " + energy;
}

function card(value, text) {
  const node = el("div", null, "card");
  node.append(el("div", value, "value"), el("div", text, "label"));
  return node;
}

function renderSummary(snapshot) {
  const box = document.getElementById("summary");
  box.replaceChildren();
  for (const fleet of snapshot.fleets) {
    const suffix = snapshot.fleets.length > 1 ? " · " + fleet.fleet : "";
    box.append(
      card(fleet.online + " / " + fleet.agents, "agents online" + suffix),
      card(String(fleet.round), "round" + suffix),
      card(figure(fleet.mean_accuracy, fleet.metric), "mean " + fleet.metric + suffix),
      card(String(fleet.stopped), "stopped early" + suffix));
    if (fleet.epsilon != null) {
      box.append(card(epsilonText(fleet.epsilon), epsilonLabel(fleet) + suffix));
    }
  }
  const names = snapshot.fleets.map((f) => f.fleet);
  document.getElementById("fleet-name").textContent =
    names.length === 1 ? names[0] : names.length + " fleets";
  document.getElementById("run").textContent = snapshot.fleets
    .filter((f) => f.run_id || f.strategy)
    .map((f) => (names.length > 1 ? f.fleet + ": " : "") + runText(f))
    .join("; ");
}

function epsilonText(v) { return v == null ? "–" : Number(v.toPrecision(3)).toString(); }

// Whose privacy loss the fleet's epsilon is: the run's (client-level DP, every participant
// alike) or its weakest device's (sample-level DP, each device its own).
function epsilonLabel(fleet) {
  return fleet.dp === "client" ? "ε, client-level (the run's)" : "max ε, sample-level (per device)";
}

// Which run the page shows, and its strategy: "run run-0003 · fedavg".
function runText(fleet) {
  return [fleet.run_id ? "run " + fleet.run_id : "", fleet.strategy].filter(Boolean).join(" · ");
}

function renderStopped(agents, multi) {
  const list = document.getElementById("stopped-list");
  list.replaceChildren();
  for (const agent of agents.filter((a) => a.stopped)) {
    const item = el("li");
    item.dataset.agent = agent.agent;
    item.append(el("strong", label(agent, multi)), " ",
      el("span", stoppedText(agent), "badge stopped"),
      el("span", savedText(agent.saved), "saved"));
    list.append(item);
  }
  document.getElementById("none-stopped").hidden = list.children.length > 0;
}

function stateCell(agent) {
  const cell = el("td", null, agent.error ? "error" : "");
  cell.dataset.field = "state";
  if (agent.stopped) {
    cell.append(el("span", stoppedText(agent), "badge stopped"));
  } else {
    cell.textContent = agent.error ? agent.state + ": " + agent.error : agent.state || "–";
  }
  return cell;
}

function row(agent, index, multi) {
  const tr = el("tr", null, agent.stopped ? "is-stopped" : "");
  tr.dataset.agent = agent.agent;
  const cell = (field, text, className) => {
    const td = el("td", text, className);
    td.dataset.field = field;
    return td;
  };
  const name = cell("agent", null);
  const swatch = el("span", null, "swatch");
  swatch.style.background = COLORS[index % COLORS.length];
  name.append(swatch, label(agent, multi));
  if (!multi) {
    const logLink = el("a", "log", "log-link");
    logLink.href = "logs/" + encodeURIComponent(agent.agent);
    logLink.title = "this agent's log records of its latest run";
    name.append(" ", logLink);
  }
  if (agent.profile) name.title = "profile " + agent.profile;
  const presence = cell("presence", null);
  const since = age(agent.since);
  presence.append(el("span", agent.presence + (since ? " · " + since : ""), "badge " + agent.presence));
  const limited = agent.limited_by && agent.limited_by !== "none" ? " (" + agent.limited_by + ")" : "";
  const train = cell("train_s", trainText(agent), "num");
  train.title = trainTitle(agent);
  const reduction = cell("reduction", agent.reduction || "–");
  reduction.title = agent.reduction_why;
  const kept = cell("kept", agent.kept || "–");
  kept.title = agent.kept_why;
  tr.append(name, presence, stateCell(agent),
    cell("round", String(agent.round), "num"),
    cell("accuracy", figure(agent.accuracy, agent.metric), "num"),
    kept,
    cell("sparsity", pct(agent.sparsity), "num"),
    cell("p_k", agent.p_k == null ? "–" : agent.p_k.toFixed(2) + limited, "num"),
    train,
    cell("peak_memory", mib(agent.peak_memory_mb), "num"),
    reduction,
    cell("bytes_sent", bytes(agent.bytes_sent), "num"),
    cell("bytes_received", bytes(agent.bytes_received), "num"),
    cell("energy", si(agent.energy_total_j, "J"), "num"),
    cell("epsilon", epsilonText(agent.epsilon), "num"),
    cell("staleness", agent.staleness == null ? "–" : agent.staleness.toFixed(1), "num"),
    cell("stragglers", agent.stragglers.length ? agent.stragglers.join(", ") : "–"),
    cell("quarantined", agent.quarantined.length ? agent.quarantined.join(", ") : "–"));
  return tr;
}

function renderTable(snapshot, multi) {
  const body = document.querySelector("#fleet tbody");
  body.replaceChildren(...snapshot.agents.map((a, i) => row(a, i, multi)));
  const others = snapshot.members.map((m) => m.agent + " (" + m.role + ", " + m.presence + ")");
  document.getElementById("members").textContent =
    others.length ? "Also connected: " + others.join(", ") : "";
}

function columns(agents, spec) {
  const rounds = [...new Set(agents.flatMap((a) => a.series.rounds))].sort((x, y) => x - y);
  const data = [rounds];
  for (const agent of agents) {
    const byRound = new Map(agent.series.rounds.map((r, i) => [r, spec.value(agent.series, i)]));
    data.push(rounds.map((r) => byRound.get(r) ?? null));
  }
  return data;
}

// A share's axis: what the data spans, padded, within 0 % to 100 %; a flat line (every
// sparsity 0) on all of it, not on uPlot's default span of a flat line, 0 to 100 (10000 %).
function shareRange(u, min, max) {
  if (min == null || max == null || max - min < 1e-9) return [0, 1];
  const [low, high] = uPlot.rangeNum(min, max, 0.1, true);
  return [Math.max(0, low), Math.min(1, high)];
}

// Tick labels of a share with as many decimals as its ticks' step needs: 20 %, 2.5 %.
function shareTicks(u, ticks, axis, space, step) {
  const digits = Math.max(0, Math.min(3, -Math.floor(Math.log10(100 * step + 1e-12))));
  return ticks.map((v) => pct(v, digits));
}

// The axis as wide as its longest label (uPlot's fixed default cuts "100.0 %" or "12.3 kB").
function axisSize(u, values, axis, cycle) {
  const spec = u.axes[axis];
  if (cycle > 1) return spec._size;
  const longest = (values ?? []).reduce((a, v) => (v.length > a.length ? v : a), "");
  u.ctx.font = spec.font[0];
  const text = longest ? u.ctx.measureText(longest).width / devicePixelRatio : 0;
  return Math.ceil(spec.ticks.size + spec.gap + text + 8);
}

function chartOptions(spec, names, width, metric) {
  const share = spec.share ? spec.share(metric) : false;
  const format = share ? pct : spec.format || ((v) => figure(v, metric));
  return {
    width, height: 220,
    scales: { x: { time: false }, y: share ? { range: shareRange } : {} },
    legend: { live: false },
    axes: [
      { label: "round", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] },
      { size: axisSize, values: share ? shareTicks : (u, ticks) => ticks.map(format) },
    ],
    series: [{ label: "round" }, ...names.map((name, i) => ({
      label: name, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
      points: { show: true, size: 5 }, value: (u, v) => v == null ? "–" : format(v),
    }))],
  };
}

function renderCharts(snapshot, multi) {
  const agents = snapshot.agents;
  const names = agents.map((a) => label(a, multi));
  const metric = snapshot.fleets.length ? snapshot.fleets[0].metric : "accuracy";
  const key = [metric, ...names].join("\n");
  for (const spec of CHARTS) {
    const box = document.getElementById(spec.id);
    const data = columns(agents, spec);
    const existing = charts[spec.id];
    if (existing && existing.key === key) {
      existing.plot.setData(data);
      continue;
    }
    if (existing) existing.plot.destroy();
    const options = chartOptions(spec, names, box.clientWidth || 400, metric);
    charts[spec.id] = { plot: new uPlot(options, data, box), key };
  }
}

// The snapshot on the page, unless it is older than the one shown (a poll's answer that
// arrives after the stream's next snapshot).
function render(snapshot) {
  if (shown != null && snapshot.now < shown) return;
  shown = snapshot.now;
  received = { at: Date.now(), now: snapshot.now };
  const multi = snapshot.fleets.length > 1;
  renderSummary(snapshot);
  renderStopped(snapshot.agents, multi);
  renderTable(snapshot, multi);
  renderCharts(snapshot, multi);
  document.body.dataset.version = snapshot.version;
  document.getElementById("updated").textContent =
    "updated " + new Date().toLocaleTimeString();
}

function connection(text, state) {
  const badge = document.getElementById("connection");
  badge.textContent = text;
  badge.className = "badge " + state;
}

function listen() {
  const source = new EventSource("api/events");
  source.addEventListener("open", () => connection("live", "live"));
  source.addEventListener("snapshot", (event) => {
    streaming = true;
    connection("live", "live");
    render(JSON.parse(event.data));
  });
  source.addEventListener("error", () => {
    streaming = false;
    if (source.readyState === EventSource.CLOSED) {
      connection("disconnected: reload (with ?token= if the dashboard has one)", "closed");
    } else {
      connection("reconnecting", "reconnecting");
    }
  });
}

// While the stream delivers nothing (not open yet, held back by a proxy that buffers it, or
// a browser out of connections to this address), the page asks for the fleet itself.
async function poll() {
  if (streaming) return;
  try {
    const answer = await fetch("api/fleet", { cache: "no-store" });
    if (!answer.ok || streaming) return;
    render(await answer.json());
    connection("polling: the live stream is not getting through", "reconnecting");
  } catch (error) {
    // The dashboard is away; the stream's own retries say so.
  }
}

new ResizeObserver(() => {
  for (const [id, chart] of Object.entries(charts)) {
    chart.plot.setSize({ width: document.getElementById(id).clientWidth, height: 220 });
  }
}).observe(document.querySelector(".charts"));

// The fleet as the page was served, so the page shows it from its first paint.
const initial = JSON.parse(document.getElementById("snapshot").textContent);
if (initial) render(initial);
listen();
setInterval(poll, POLL_MS);
