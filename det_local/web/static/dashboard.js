// det-local dashboard: charts (uPlot) and the live log. Data comes from /api/ as JSON and is
// put into the page with textContent only: nothing from the store is ever read as markup.
"use strict";

const PAGE = JSON.parse(document.getElementById("page-data").textContent);
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];

async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin"});
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function el(name, text, cls) {
  const e = document.createElement(name);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

// reports -> {metric name: [[x...], [y...]]} with x = steps_completed, ascending, one point
// per step (the latest report wins: a restarted run replaces what it repeats)
function seriesOf(reports) {
  const byMetric = new Map();
  for (const r of reports) {
    for (const [name, v] of Object.entries(r.metrics)) {
      if (typeof v !== "number") continue;
      if (!byMetric.has(name)) byMetric.set(name, new Map());
      byMetric.get(name).set(r.steps_completed, v);
    }
  }
  const out = new Map();
  for (const [name, points] of byMetric) {
    const xs = [...points.keys()].sort((a, b) => a - b);
    out.set(name, [xs, xs.map(x => points.get(x))]);
  }
  return out;
}

// One chart: one line per series ({label, xs, ys}); `charts` keeps it for later updates.
class Chart {
  constructor(parent, title, labels) {
    this.box = el("div", undefined, "chart");
    this.box.dataset.metric = title;
    parent.appendChild(this.box);
    const series = [{label: "batches"}];
    labels.forEach((label, i) => series.push(
      {label: String(label), stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
       points: {show: false}}));
    this.labels = labels;
    this.plot = new uPlot({
      title: title, width: Math.min(560, window.innerWidth - 60), height: 260,
      scales: {x: {time: false}}, series: series,
      axes: [{label: "batches"}, {}],
    }, [[]], this.box);
  }

  // New data; a zoomed chart keeps its zoom (setData(data, false)), one that shows everything
  // grows to include the new points.
  update(lines) {
    const tables = lines.map(l => [l.xs, l.ys]);
    const data = tables.length ? uPlot.join(tables) : [[]];
    const x = this.plot.scales.x;
    const old = this.plot.data[0];
    const zoomed = old && old.length > 1 && x.min != null &&
      (x.min > old[0] || x.max < old[old.length - 1]);
    this.plot.setData(data, !zoomed);
  }
}

function syncCharts(container, charts, curves) {
  // curves: Map metric -> [{label, xs, ys}]
  for (const [metric, lines] of curves) {
    let chart = charts.get(metric);
    const labels = lines.map(l => l.label);
    if (chart && chart.labels.join() !== labels.join()) {
      chart.plot.destroy(); chart.box.remove(); chart = undefined;
    }
    if (!chart) {
      chart = new Chart(container, metric, labels);
      charts.set(metric, chart);
    }
    chart.update(lines);
  }
}

// ---------------------------------------------------------------- experiment page
async function experimentPage() {
  const container = document.getElementById("charts");
  const buttons = document.querySelectorAll(".groups button");
  let charts = new Map();
  async function show(group) {
    buttons.forEach(b => b.classList.toggle("on", b.dataset.group === group));
    charts.forEach(c => { c.plot.destroy(); c.box.remove(); });
    charts = new Map();
    const body = await getJSON(`/api/experiments/${PAGE.experiment_id}/metrics?group=${group}`);
    const curves = new Map();
    for (const t of body.trials) {
      for (const [metric, [xs, ys]] of seriesOf(t.reports)) {
        if (!curves.has(metric)) curves.set(metric, []);
        curves.get(metric).push({label: `trial ${t.trial_id}`, xs, ys});
      }
    }
    // the searcher's metric first
    const ordered = new Map([...curves].sort(([a], [b]) =>
      (b === PAGE.metric) - (a === PAGE.metric) || a.localeCompare(b)));
    if (!ordered.size) container.replaceChildren(el("p", `no ${group} metrics yet`, "muted"));
    else container.replaceChildren();
    syncCharts(container, charts, ordered);
    window.detCharts = charts;
  }
  buttons.forEach(b => b.addEventListener("click", () => show(b.dataset.group)));
  await show("validation");
}

// ---------------------------------------------------------------- trial page
async function trialPage() {
  const id = PAGE.trial_id;
  const container = document.getElementById("charts");
  const charts = new Map();
  window.detCharts = charts;
  async function refreshMetrics() {
    const reports = await getJSON(`/api/trials/${id}/metrics`);
    const curves = new Map();
    const groups = [...new Set(reports.map(r => r.group))];
    for (const g of groups) {
      for (const [metric, [xs, ys]] of seriesOf(reports.filter(r => r.group === g))) {
        curves.set(`${g}: ${metric}`, [{label: g, xs, ys}]);
      }
    }
    syncCharts(container, charts, curves);
  }

  const log = document.getElementById("log");
  const search = document.getElementById("log-search");
  const follow = document.getElementById("log-follow");
  const status = document.getElementById("log-status");
  function addLines(lines) {
    const needle = search.value;
    const frag = document.createDocumentFragment();
    for (const line of lines) {
      const div = el("div", line);
      if (needle && !line.includes(needle)) div.hidden = true;
      frag.appendChild(div);
    }
    log.appendChild(frag);
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }
  search.addEventListener("input", () => {
    for (const div of log.children) div.hidden = !!search.value && !div.textContent.includes(search.value);
  });

  await refreshMetrics();
  const first = await getJSON(`/api/trials/${id}/logs`);
  addLines(first.lines);
  const source = new EventSource(`/api/trials/${id}/stream?offset=${first.offset}`);
  source.onopen = () => { status.textContent = "live"; refreshMetrics(); };
  source.addEventListener("log", e => addLines(JSON.parse(e.data).lines));
  source.addEventListener("metrics", () => refreshMetrics());
  source.addEventListener("state", e => { status.textContent = JSON.parse(e.data).state; });
  source.addEventListener("end", e => {
    status.textContent = `${JSON.parse(e.data).state} (ended)`;
    source.close();
    refreshMetrics();
  });
  source.onerror = () => { if (source.readyState === EventSource.CLOSED) status.textContent = "disconnected"; };
}

const run = PAGE.page === "experiment" ? experimentPage : PAGE.page === "trial" ? trialPage : null;
if (run) run().catch(err => {
  const p = el("p", `error: ${err.message}`, "error");
  document.querySelector("main").appendChild(p);
  console.error(err);
});
