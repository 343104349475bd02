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

// Progress counters a trainer reports beside its metrics: how far it got, not how well it
// learns; they are not drawn as curves (the x axis shows them).
const PROGRESS = new Set(["batches", "epochs"]);

// reports -> Map metric -> [{step, time, y}], ascending steps, one point per step (the latest
// report wins: a restarted run replaces what it repeats)
function pointsOf(reports) {
  const byMetric = new Map();
  for (const r of reports) {
    for (const [name, v] of Object.entries(r.metrics)) {
      if (typeof v !== "number" || PROGRESS.has(name)) continue;
      if (!byMetric.has(name)) byMetric.set(name, new Map());
      byMetric.get(name).set(r.steps_completed, {step: r.steps_completed, time: r.time, y: v});
    }
  }
  const out = new Map();
  for (const [name, points] of byMetric) {
    out.set(name, [...points.values()].sort((a, b) => a.step - b.step));
  }
  return out;
}

// reports -> Map metric -> [[x...], [y...]] with x = steps_completed (the trial page's charts)
function seriesOf(reports) {
  const out = new Map();
  for (const [name, pts] of pointsOf(reports)) out.set(name, [pts.map(p => p.step), pts.map(p => p.y)]);
  return out;
}

// ---------------------------------------------------------------- x units
// batches: steps_completed; records: batches x global_batch_size; epochs: records /
// records_per_epoch; time: seconds since the trial started (its record's created_at; a
// report's time is when the trial reported it).
const UNITS = {
  batches: {axis: "batches", x: p => p.step},
  records: {axis: "records", x: (p, t) => p.step * t.gbs,
    needs: t => t.gbs ? "" : "records need hyperparameters.global_batch_size (an integer) in the config"},
  epochs: {axis: "epochs", x: (p, t) => p.step * t.gbs / t.rpe,
    needs: t => !t.rpe ? "epochs need records_per_epoch in the experiment's config"
      : !t.gbs ? "epochs need hyperparameters.global_batch_size (an integer) in the config" : ""},
  time: {axis: "seconds since the trial started", x: (p, t) => p.time - t.start},
};

// What a trial of a /metrics body brings to the x units.
function unitInfo(body, t) {
  return {gbs: t.global_batch_size, rpe: body.records_per_epoch, start: t.started_at};
}

// The controls above the curves (pages.py's curve_controls); state() reads them.
class CurveControls {
  constructor(onChange) {
    this.unit = document.getElementById("x-unit");
    this.logY = document.getElementById("log-y");
    this.topN = document.getElementById("top-n");
    this.note = document.getElementById("curve-note");
    for (const c of [this.unit, this.logY, this.topN]) if (c) c.addEventListener("change", onChange);
  }
  state() {
    return {unit: this.unit.value, logY: this.logY.checked,
            topN: this.topN ? Number(this.topN.value) : null};
  }
  // Disable the units some trial cannot be drawn in (the option's title says why); a chosen
  // unit that became impossible goes back to batches.
  allow(infos) {
    for (const opt of this.unit.options) {
      const needs = UNITS[opt.value].needs;
      const why = needs ? infos.map(needs).find(w => w) || "" : "";
      opt.disabled = !!why;
      opt.title = why;
    }
    if (this.unit.selectedOptions[0].disabled) this.unit.value = "batches";
  }
}

// One trial's points of one metric as a line in the chosen unit.
function lineOf(pts, info, ctl, label, style) {
  const unit = UNITS[ctl.unit];
  const xy = pts.map(p => [unit.x(p, info), p.y]).filter(([x]) => Number.isFinite(x));
  xy.sort((a, b) => a[0] - b[0]);
  return {label, xs: xy.map(([x]) => x), ys: xy.map(([, y]) => y), ...style};
}

// Lines for a log scale: values <= 0 left out, and a note saying how many; a chart with no
// value above 0 stays linear (a log scale would have nothing to draw) and says so.
function forScale(lines, logY) {
  if (!logY) return {lines, logY: false, note: ""};
  if (!lines.some(l => l.ys.some(y => y > 0))) {
    return {lines, logY: false, note: "no value > 0: drawn on a linear scale"};
  }
  let dropped = 0;
  const out = lines.map(l => ({...l, ys: l.ys.map(y => {
    if (y > 0) return y;
    if (y !== null) dropped++;
    return null;
  })}));
  return {lines: out, logY: true,
          note: dropped ? `${dropped} value(s) <= 0 left out on the log scale` : ""};
}

function addLine(curves, key, line) {
  if (!curves.has(key)) curves.set(key, []);
  curves.get(key).push(line);
}

// ---------------------------------------------------------------- charts
// One chart: one line per series ({label, xs, ys, stroke, width, legend}); `charts` keeps it for
// later updates. opts (all given): {axis (the x axis' label), logY, plugins}. The legend is one
// compact line of names under the chart (no values: uPlot's live legend listed every line as
// "trial N: --" in rows); a line with legend: false (the grey ones) is left out of it.
class Chart {
  constructor(parent, title, lines, opts) {
    this.box = el("div", undefined, "chart");
    this.box.dataset.metric = title;
    parent.appendChild(this.box);
    const series = [{label: opts.axis}];
    lines.forEach((l, i) => series.push(
      {label: String(l.label), stroke: l.stroke || COLORS[i % COLORS.length], width: l.width || 1.5,
       spanGaps: true, points: {show: false}, top: !!l.top,
       class: l.legend === false ? "no-legend" : undefined}));
    this.key = Chart.key(lines, opts);
    this.labels = lines.map(l => l.label);
    this.logY = opts.logY;
    this.plot = new uPlot({
      title: title, width: Math.min(560, window.innerWidth - 60), height: 260,
      scales: {x: {time: false}, y: opts.logY ? {distr: 3, log: 10} : {}},
      series: series, axes: [{label: opts.axis}, {}], plugins: opts.plugins,
      legend: {live: false},
    }, [[]], this.box);
    this.note = el("div", "", "chart-note muted");
    this.box.appendChild(this.note);
  }

  // What the chart is drawn with, beyond its data: a change rebuilds it.
  static key(lines, opts) {
    return JSON.stringify([opts.axis, !!opts.logY,
      lines.map(l => [l.label, l.stroke, l.width, l.legend])]);
  }

  zoom() {
    const x = this.plot.scales.x;
    const old = this.plot.data[0];
    const zoomed = old && old.length > 1 && x.min != null &&
      (x.min > old[0] || x.max < old[old.length - 1]);
    return zoomed ? {min: x.min, max: x.max} : null;
  }

  // New data; a zoomed chart keeps its zoom (setData(data, false)), one that shows everything
  // grows to include the new points.
  update(lines, note) {
    const tables = lines.map(l => [l.xs, l.ys]);
    const data = tables.length ? uPlot.join(tables) : [[]];
    const zoomed = this.zoom();
    this.plot.setData(data, !zoomed);
    this.note.textContent = note || "";
  }

  destroy() { this.plot.destroy(); this.box.remove(); }
}

// curves: Map title -> lines. A chart whose lines or options changed is drawn again (keeping
// its zoom when its x unit is the same); charts of titles no longer there go.
function syncCharts(container, charts, curves, opts) {
  opts = {axis: "batches", logY: false, plugins: [], ...opts};
  for (const [title, chart] of charts) {
    if (!curves.has(title)) { chart.destroy(); charts.delete(title); }
  }
  for (const [title, all] of curves) {
    const {lines, logY, note} = forScale(all, !!opts.logY);
    const o = {...opts, logY};
    let chart = charts.get(title);
    let zoom = null;
    if (chart && chart.key !== Chart.key(lines, o)) {
      if (JSON.parse(chart.key)[0] === o.axis) zoom = chart.zoom();
      chart.destroy(); charts.delete(title); chart = undefined;
    }
    if (!chart) {
      chart = new Chart(container, title, lines, o);
      charts.set(title, chart);
    }
    chart.update(lines, note);
    if (zoom) chart.plot.setScale("x", zoom);
  }
  // keep the page's order of charts
  for (const title of curves.keys()) container.appendChild(charts.get(title).box);
}

// metrics ordered: `first` (a searcher metric) first, then by name
function metricOrder(first) {
  return (a, b) => (b === first) - (a === first) || a.localeCompare(b);
}

const MIN_REFRESH_MS = 1000;

// Live curves by server-sent events: each of `ids` streams its experiment's progress
// (/api/experiments/ID/stream: "metrics" when a trial reported, "state", "end"). `first` draws
// the page; then `changed` runs on news, at most once a second and never twice at once (the
// server downsamples, so news costs one refetch of the curves, not a stream of points). A
// stream's opening counts as news: it covers what was reported between the first fetch and it.
async function followExperiments(ids, first, changed) {
  let running = false;
  let pending = false;
  let lastRun = 0;
  async function kick() {
    if (running) { pending = true; return; }
    running = true;
    try {
      const wait = lastRun + MIN_REFRESH_MS - Date.now();
      if (wait > 0) await new Promise(resolve => setTimeout(resolve, wait));
      lastRun = Date.now();
      pending = false;
      await changed();
    } finally {
      running = false;
      if (pending) kick().catch(fail);
    }
  }
  await first();
  for (const id of ids) {
    const source = new EventSource(`/api/experiments/${id}/stream`);
    source.onopen = () => kick().catch(fail);
    source.addEventListener("metrics", () => kick().catch(fail));
    source.addEventListener("state", () => kick().catch(fail));
    source.addEventListener("end", () => { source.close(); kick().catch(fail); });
  }
}

// ---------------------------------------------------------------- experiment page
// Learning curves: one chart per metric of the chosen group, one line per trial, best first;
// the best N trials (by the searcher metric) drawn in colour, the others thin and grey. While
// the experiment runs the page follows its stream (followExperiments) and fetches the curves
// again when there are new reports (one stream per experiment, not per trial).
const GREY = "rgba(140,140,140,0.45)";

async function experimentPage() {
  const container = document.getElementById("charts");
  const buttons = document.querySelectorAll(".groups button");
  const charts = new Map();
  window.detCharts = charts;
  let group = "validation";
  let body = null;
  const ctl = new CurveControls(() => render());

  function render() {
    if (!body) return;
    const infos = body.trials.filter(t => t.reports.length).map(t => unitInfo(body, t));
    ctl.allow(infos);
    const c = ctl.state();
    const ranked = body.trials.filter(t => t.best_validation !== null);
    const top = new Set((c.topN ? ranked.slice(0, c.topN) : ranked).map(t => t.trial_id));
    ctl.note.textContent = ranked.length ? "" :
      `no trial has a validation of ${body.metric} yet: none is highlighted`;
    const curves = new Map();
    body.trials.forEach((t, i) => {
      const hot = top.has(t.trial_id) || !ranked.length;
      const style = hot ? {stroke: COLORS[i % COLORS.length], width: ranked.length ? 2.5 : 1.5, top: ranked.length > 0}
        : {stroke: GREY, width: 1, legend: false};
      for (const [metric, pts] of pointsOf(t.reports)) {
        addLine(curves, metric, lineOf(pts, unitInfo(body, t), c, `trial ${t.trial_id}`, style));
      }
    });
    const ordered = new Map([...curves].sort(([a], [b]) => metricOrder(PAGE.metric)(a, b)));
    if (!ordered.size) {
      for (const chart of charts.values()) chart.destroy();
      charts.clear();
      container.replaceChildren(el("p", `no ${group} metrics yet`, "muted"));
      return;
    }
    for (const p of container.querySelectorAll(":scope > p")) p.remove();
    syncCharts(container, charts, ordered, {axis: UNITS[c.unit].axis, logY: c.logY});
  }

  // the newest request wins: an answer to an older one (another group, an earlier poll) that
  // arrives late is dropped, so a chart never flips back to what the user left
  let loads = 0;
  async function load() {
    const seq = ++loads;
    const got = await getJSON(`/api/experiments/${PAGE.experiment_id}/metrics?group=${group}`);
    if (seq !== loads) return;
    body = got;
    render();
  }
  async function show(g) {
    group = g;
    buttons.forEach(b => b.classList.toggle("on", b.dataset.group === g));
    for (const chart of charts.values()) chart.destroy();
    charts.clear();
    await load();
  }
  buttons.forEach(b => b.addEventListener("click", () => show(b.dataset.group).catch(fail)));
  await followExperiments([PAGE.experiment_id], () => show("validation"), load);
}

// ---------------------------------------------------------------- compare page
// One chart per metric (validation first), one line per trial coloured by its experiment.
async function comparePage() {
  const container = document.getElementById("charts");
  const charts = new Map();
  window.detCharts = charts;
  const exps = PAGE.experiments;
  const ctl = new CurveControls(() => render());
  let bodies = [];

  function render() {
    const infos = bodies.flatMap(b => b.trials.filter(t => t.reports.length).map(t => unitInfo(b, t)));
    ctl.allow(infos);
    const c = ctl.state();
    const metrics = new Set(exps.map(e => e.metric));
    const curves = new Map();
    for (const b of bodies) {
      const color = COLORS[exps.findIndex(e => e.id === b.experiment_id) % COLORS.length];
      for (const t of b.trials) {
        for (const [metric, pts] of pointsOf(t.reports)) {
          // the legend names each experiment once (its colour), not every trial
          const key = `${b.group}: ${metric}`;
          const named = (curves.get(key) || []).some(l => l.exp === b.experiment_id && l.legend !== false);
          const line = lineOf(pts, unitInfo(b, t), c, named ? `exp ${b.experiment_id} / trial ${t.trial_id}`
            : `exp ${b.experiment_id}`, {stroke: color, width: 1.5, legend: named ? false : undefined});
          addLine(curves, key, {...line, exp: b.experiment_id});
        }
      }
    }
    const rank = k => {
      const [g, m] = k.split(/: (.*)/s);
      return [g === "validation" ? 0 : 1, metrics.has(m) ? 0 : 1, k];
    };
    const ordered = new Map([...curves].sort(([a], [b]) => {
      const [x, y] = [rank(a), rank(b)];
      return x[0] - y[0] || x[1] - y[1] || x[2].localeCompare(y[2]);
    }));
    if (!ordered.size) container.replaceChildren(el("p", "no metrics yet", "muted"));
    else for (const p of container.querySelectorAll(":scope > p")) p.remove();
    syncCharts(container, charts, ordered, {axis: UNITS[c.unit].axis, logY: c.logY});
  }

  async function load() {
    const urls = exps.flatMap(e => ["validation", "training"].map(
      g => `/api/experiments/${e.id}/metrics?group=${g}`));
    bodies = await Promise.all(urls.map(getJSON));
    render();
  }
  await followExperiments(exps.map(e => e.id), load, load);
}

// ---------------------------------------------------------------- trial page
// A uPlot plugin: a dashed vertical line at each checkpoint's steps_completed, and over it a
// thin element whose title names the checkpoint (what hovering shows).
function checkpointMarkers(checkpoints) {
  return {hooks: {
    init: u => { u.ckptMarks = el("div", undefined, "ckpt-marks"); u.over.appendChild(u.ckptMarks); },
    draw: u => {
      const {left, top, width, height} = u.bbox;
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "#8e44ad";
      ctx.lineWidth = Math.max(1, devicePixelRatio);
      ctx.setLineDash([5 * devicePixelRatio, 4 * devicePixelRatio]);
      const shown = [];
      for (const c of checkpoints()) {
        if (c.state === "DELETED") continue;  // its files are gone: nothing to go back to
        const x = u.valToPos(c.steps_completed, "x", true);
        if (!(x >= left && x <= left + width)) continue;
        ctx.beginPath();
        ctx.moveTo(x, top);
        ctx.lineTo(x, top + height);
        ctx.stroke();
        const m = el("div", undefined, "ckpt-marker");
        m.style.left = `${u.valToPos(c.steps_completed, "x")}px`;
        m.title = `checkpoint ${c.uuid} at ${c.steps_completed} batches (${c.state})`;
        m.dataset.uuid = c.uuid;
        shown.push(m);
      }
      ctx.restore();
      u.ckptMarks.replaceChildren(...shown);
    },
  }};
}

const RANK = /^\[rank=(\d+)\] /;

async function trialPage() {
  const id = PAGE.trial_id;
  const container = document.getElementById("charts");
  const charts = new Map();
  window.detCharts = charts;
  let checkpoints = [];
  const plugins = [checkpointMarkers(() => checkpoints)];
  async function refreshMetrics() {
    const [reports, trial] = await Promise.all(
      [getJSON(`/api/trials/${id}/metrics`), getJSON(`/api/trials/${id}`)]);
    const before = JSON.stringify(checkpoints);
    checkpoints = trial.checkpoints.map(c => ({uuid: c.uuid, steps_completed: c.steps_completed, state: c.state}));
    const curves = new Map();
    const groups = [...new Set(reports.map(r => r.group))];
    for (const g of groups) {
      for (const [metric, [xs, ys]] of seriesOf(reports.filter(r => r.group === g))) {
        curves.set(`${g}: ${metric}`, [{label: g, xs, ys}]);
      }
    }
    syncCharts(container, charts, curves, {plugins});
    if (JSON.stringify(checkpoints) !== before) for (const c of charts.values()) c.plot.redraw(false);
  }

  // The log: each line a div (text only) with its rank (from Determined's `[rank=N] ` prefix,
  // "" for lines without one); shown when it matches the rank filter and the search.
  const log = document.getElementById("log");
  const search = document.getElementById("log-search");
  const rankSel = document.getElementById("log-rank");
  const follow = document.getElementById("log-follow");
  const status = document.getElementById("log-status");
  const ranks = new Set();
  function shown(div) {
    const needle = search.value;
    return (rankSel.value === "" || div.dataset.rank === rankSel.value) &&
      (!needle || div.textContent.includes(needle));
  }
  function seeRank(rank) {
    if (ranks.has(rank)) return;
    ranks.add(rank);
    const opt = el("option", rank);
    opt.value = rank;
    const after = [...rankSel.options].find(o => o.value !== "" && Number(o.value) > Number(rank));
    rankSel.insertBefore(opt, after || null);
  }
  function addLines(lines) {
    const frag = document.createDocumentFragment();
    for (const line of lines) {
      const div = el("div", line);
      const m = RANK.exec(line);
      div.dataset.rank = m ? m[1] : "";
      if (m) seeRank(m[1]);
      div.hidden = !shown(div);
      frag.appendChild(div);
    }
    log.appendChild(frag);
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }
  function refilter() {
    for (const div of log.children) div.hidden = !shown(div);
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }
  search.addEventListener("input", refilter);
  rankSel.addEventListener("change", refilter);
  saveRaw(document.getElementById("log-raw"));

  await refreshMetrics();
  const first = await getJSON(`/api/trials/${id}/logs`);
  addLines(first.lines);
  const source = new EventSource(`/api/trials/${id}/stream?offset=${first.offset}`);
  source.onopen = () => { status.textContent = "live"; refreshMetrics().catch(fail); };
  source.addEventListener("log", e => addLines(JSON.parse(e.data).lines));
  source.addEventListener("metrics", () => refreshMetrics().catch(fail));
  source.addEventListener("state", e => { status.textContent = JSON.parse(e.data).state; });
  source.addEventListener("end", e => {
    status.textContent = `${JSON.parse(e.data).state} (ended)`;
    source.close();
    refreshMetrics().catch(fail);
  });
  source.onerror = () => { if (source.readyState === EventSource.CLOSED) status.textContent = "disconnected"; };
}

// A download link of this origin: fetched here (the service worker adds the login header,
// web/guard.py; a browser's own download would go without it), then saved from memory.
function saveRaw(a) {
  if (!a) return;
  a.addEventListener("click", async (e) => {
    e.preventDefault();
    try {
      const r = await fetch(a.href, {credentials: "same-origin"});
      if (!r.ok) throw new Error((await r.json()).error || r.statusText);
      const named = /filename="([^"]+)"/.exec(r.headers.get("content-disposition") || "");
      const save = el("a");
      save.href = URL.createObjectURL(await r.blob());
      save.download = named ? named[1] : "trial.log";
      document.body.appendChild(save);
      save.click();
      save.remove();
      setTimeout(() => URL.revokeObjectURL(save.href), 60000);
    } catch (err) {
      fail(err);
    }
  });
}

function fail(err) {
  const p = el("p", `error: ${err.message}`, "error");
  document.querySelector("main").appendChild(p);
  console.error(err);
}

const PAGES = {experiment: experimentPage, trial: trialPage, compare: comparePage};
const run = PAGES[PAGE.page];
if (run) run().catch(fail);
