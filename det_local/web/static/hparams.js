// det-local dashboard: the hyperparameter views of one experiment (ECharts, loaded by this page
// only). Data comes from /api/experiments/{id}/hparams. Nothing from the store is read as
// markup: tables and notes are built with textContent, chart labels are drawn on the canvas,
// and the tooltips (HTML in ECharts) are built from escaped text only.
"use strict";

const PAGE = JSON.parse(document.getElementById("page-data").textContent);
const TERMINAL = new Set(["COMPLETED", "CANCELED", "ERROR"]);
const REFRESH_MS = 3000;
// weak -> strong; the better end of the metric gets the strong colour
const RAMP = ["#fee8c8", "#fdbb84", "#ef6548", "#b30000", "#4a0000"];

function el(name, text, cls) {
  const e = document.createElement(name);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, c => ESCAPES[c]);
}

// A value as the trials table shows it: strings as they are, numbers to 6 significant digits.
function shown(v) {
  if (v === undefined || v === null) return "";
  if (typeof v === "string") return v;
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(6)));
  return JSON.stringify(v);
}

// A tooltip: lines of text, escaped, as the HTML ECharts puts in its tooltip box.
function tip(lines) {
  return lines.map(escapeHtml).join("<br>");
}

async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin"});
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// ---------------------------------------------------------------- the data, as charts see it
// One axis per varying hyperparameter: categorical -> category (the config's values, then any
// other value seen), log -> log, int/double -> value; a value that is not a number puts a
// numeric hyperparameter on a category axis.
function axisOf(h, trials) {
  const values = trials.map(t => t.hparams[h.name]).filter(v => v !== undefined && v !== null);
  let kind = h.type === "log" ? "log" : h.type === "int" || h.type === "double" ? "value" : "category";
  if (kind !== "category" && values.some(v => typeof v !== "number")) kind = "category";
  if (kind === "log" && values.some(v => v <= 0)) kind = "value";
  let categories = null;
  if (kind === "category") {
    categories = [];
    for (const v of [...(Array.isArray(h.vals) ? h.vals : []), ...values]) {
      const s = shown(v);
      if (!categories.includes(s)) categories.push(s);
    }
  }
  const at = t => {
    const v = t.hparams[h.name];
    if (v === undefined || v === null) return null;
    return kind === "category" ? shown(v) : v;
  };
  return {name: h.name, type: h.type, kind, categories, at};
}

function modelOf(d) {
  const scored = d.trials.filter(t => typeof t.metric === "number" && Number.isFinite(t.metric));
  const varying = d.hyperparameters.filter(h => h.varies);
  const axes = varying.map(h => axisOf(h, scored));
  const metrics = scored.map(t => t.metric);
  let lo = Math.min(...metrics), hi = Math.max(...metrics);
  if (!(hi > lo)) { lo = lo - (Math.abs(lo) || 1) * 1e-6; hi = hi + (Math.abs(hi) || 1) * 1e-6; }
  return {
    d, scored, axes, lo, hi,
    fixed: d.hyperparameters.filter(h => !h.varies),
    metric: d.metric || "metric",
    // what decides whether a chart is rebuilt (brush and zoom lost) or only given new data
    shape: JSON.stringify(axes.map(a => [a.name, a.kind, a.categories])),
  };
}

function visualMap(m, dimension, show) {
  const smaller = m.d.smaller_is_better;
  return {
    id: "metric", type: "continuous", dimension, min: m.lo, max: m.hi, show,
    right: 0, top: "middle", itemHeight: 160, calculable: false,
    text: smaller ? ["worse", "better"] : ["better", "worse"],
    inRange: {color: smaller ? [...RAMP].reverse() : RAMP},
  };
}

function trialLines(m, t) {
  const out = [`trial ${t.trial_id}`, `${m.metric}: ${shown(t.metric)}`];
  for (const a of m.axes) out.push(`${a.name}: ${shown(t.hparams[a.name])}`);
  return out;
}

// ---------------------------------------------------------------- parallel coordinates
function parallelOption(m) {
  const axes = m.axes.map((a, i) => ({
    id: `ax:${a.name}`, dim: i, name: a.name, type: a.kind,
    ...(a.kind === "category" ? {data: a.categories} : {scale: true}),
    axisLabel: {width: 90, overflow: "truncate"},
  }));
  axes.push({id: "ax:metric", dim: m.axes.length, name: m.metric, type: "value", scale: true,
    nameTextStyle: {fontWeight: "bold"}});
  return {
    animation: false,
    tooltip: {trigger: "item", formatter: p => tip(trialLines(m, m.scored[p.dataIndex]))},
    parallel: {left: 70, right: 130, top: 50, bottom: 30,
      parallelAxisDefault: {nameLocation: "end", nameGap: 16, nameTextStyle: {fontSize: 12}}},
    parallelAxis: axes,
    visualMap: visualMap(m, m.axes.length, true),
    series: [parallelSeries(m)],
  };
}

function parallelSeries(m) {
  return {
    id: "trials", type: "parallel", smooth: false,
    lineStyle: {width: 2, opacity: 0.85},
    inactiveOpacity: 0.06, activeOpacity: 1,
    data: m.scored.map(t => ({name: `trial ${t.trial_id}`,
      value: [...m.axes.map(a => a.at(t)), t.metric]})),
  };
}

// ---------------------------------------------------------------- a scatter per hyperparameter
function scatterOption(m, a) {
  const x = a.kind === "category" ? {type: "category", data: a.categories}
    : {type: a.kind, scale: true};
  return {
    animation: false,
    title: {text: a.type === "log" ? `${a.name} (log)` : a.name, left: "center",
      textStyle: {fontSize: 13}},
    grid: {left: 64, right: 24, top: 40, bottom: 44},
    tooltip: {trigger: "item", formatter: p => {
      const t = m.scored.find(s => s.trial_id === p.value[2]);
      return tip([`trial ${p.value[2]}`, `${a.name}: ${shown(t ? t.hparams[a.name] : p.value[0])}`,
        `${m.metric}: ${shown(p.value[1])}`]);
    }},
    xAxis: {...x, name: a.name, nameLocation: "middle", nameGap: 28,
      axisLabel: {width: 80, overflow: "truncate", hideOverlap: true}},
    yAxis: {type: "value", name: m.metric, scale: true},
    dataZoom: [{type: "inside", xAxisIndex: 0, filterMode: "none"},
      {type: "inside", yAxisIndex: 0, filterMode: "none"}],
    visualMap: visualMap(m, 1, false),
    series: [scatterSeries(m, a)],
  };
}

function scatterSeries(m, a) {
  return {id: "points", type: "scatter", symbolSize: 10, cursor: "pointer",
    data: m.scored.filter(t => a.at(t) !== null).map(t => [a.at(t), t.metric, t.trial_id])};
}

// ---------------------------------------------------------------- the page
class HparamsView {
  constructor(expId) {
    this.expId = expId;
    this.note = document.getElementById("hp-note");
    this.count = document.getElementById("hp-count");
    this.selectedBox = document.getElementById("hp-selected");
    this.fixedList = document.getElementById("hp-fixed");
    this.parallelBox = document.getElementById("hp-parallel");
    this.scatterBox = document.getElementById("hp-scatters");
    this.parallel = null;
    this.scatters = new Map();  // hyperparameter name -> {box, chart, shape}
    this.model = null;
    this.last = "";
    window.addEventListener("resize", () => {
      if (this.parallel) this.parallel.resize();
      this.scatters.forEach(s => s.chart.resize());
    });
  }

  async refresh() {
    const d = await getJSON(`/api/experiments/${this.expId}/hparams`);
    const text = JSON.stringify(d);
    if (text !== this.last) { this.last = text; this.show(d); }
    return d;
  }

  show(d) {
    const m = modelOf(d);
    const old = this.model;
    this.model = m;
    this.showNote(m);
    this.showFixed(m);
    this.showParallel(m, old);
    this.showScatters(m);
    this.showSelection();
  }

  showNote(m) {
    const missing = m.d.trials.length - m.scored.length;
    if (!m.d.trials.length) this.note.textContent = "This experiment has no trials yet.";
    else if (missing === 1) this.note.textContent = "1 trial has no validation metric yet.";
    else if (missing) this.note.textContent = `${missing} trials have no validation metric yet.`;
    else this.note.textContent = "";
  }

  showFixed(m) {
    const items = m.fixed.map(h => {
      const t = m.d.trials.find(t => h.name in t.hparams);
      let v = t ? shown(t.hparams[h.name]) : h.type === "const" ? shown(h.val) : "";
      if (!t && Array.isArray(h.vals)) v = `one of ${h.vals.map(shown).join(", ")}`;
      const li = el("li");
      li.append(el("code", h.name), ` = ${v}`);
      return li;
    });
    if (!items.length) items.push(el("li", "none: every hyperparameter varies", "muted"));
    this.fixedList.replaceChildren(...items);
  }

  showParallel(m, old) {
    if (!m.scored.length) {
      if (this.parallel) { this.parallel.dispose(); this.parallel = null; }
      this.parallelBox.replaceChildren(el("p", "no trial has a validation metric yet", "muted"));
      this.parallelBox.classList.add("hp-empty");
      return;
    }
    this.parallelBox.classList.remove("hp-empty");
    if (this.parallel && old && old.shape === m.shape && old.scored.length) {
      // same axes: new lines and colours only; each axis keeps its brushed range
      this.parallel.setOption({visualMap: visualMap(m, m.axes.length, true),
        tooltip: parallelOption(m).tooltip, series: [parallelSeries(m)]});
      return;
    }
    if (!this.parallel) {
      this.parallelBox.replaceChildren();
      this.parallel = echarts.init(this.parallelBox);
      this.parallel.on("axisareaselected", () => this.showSelection());
      this.parallel.on("click", p => this.open(this.model.scored[p.dataIndex]));
    }
    this.parallel.setOption(parallelOption(m), {notMerge: true});
  }

  showScatters(m) {
    const names = new Set(m.axes.map(a => a.name));
    for (const [name, s] of this.scatters) {
      if (!names.has(name) || !m.scored.length) {
        s.chart.dispose(); s.box.remove(); this.scatters.delete(name);
      }
    }
    if (!m.scored.length) return;
    if (!m.axes.length && !this.scatterBox.childElementCount) {
      this.scatterBox.replaceChildren(el("p", "no hyperparameter varies between the trials", "muted"));
    }
    for (const a of m.axes) {
      let s = this.scatters.get(a.name);
      const shape = JSON.stringify([a.kind, a.categories]);
      if (s && s.shape === shape) {
        // new points only: the zoom stays as the user left it
        s.chart.setOption({visualMap: visualMap(m, 1, false), tooltip: scatterOption(m, a).tooltip,
          series: [scatterSeries(m, a)]});
        continue;
      }
      if (!s) {
        const box = el("div", undefined, "hp-chart hp-scatter");
        box.dataset.hparam = a.name;
        this.scatterBox.querySelectorAll("p.muted").forEach(p => p.remove());
        this.scatterBox.appendChild(box);
        const chart = echarts.init(box);
        chart.on("click", p => {
          if (p.componentType === "series") this.open({trial_id: p.value[2]});
        });
        s = {box, chart, shape};
        this.scatters.set(a.name, s);
      }
      s.shape = shape;
      s.chart.setOption(scatterOption(m, a), {notMerge: true});
    }
  }

  open(t) {
    if (t && Number.isInteger(t.trial_id)) window.location.assign(`/trials/${t.trial_id}`);
  }

  // The lines the brushes leave active (all of them without a brush), best first.
  selected() {
    const m = this.model;
    if (!this.parallel || !m.scored.length) return [];
    const series = this.parallel.getModel().getSeries()[0];
    const inactive = new Set(series.getRawIndicesByActiveState("inactive"));
    return m.scored.filter((_, i) => !inactive.has(i));
  }

  showSelection() {
    const m = this.model;
    const chosen = this.selected();
    this.count.textContent = m.scored.length
      ? `${chosen.length} of ${m.scored.length} trials selected` : "";
    if (!chosen.length) { this.selectedBox.replaceChildren(); return; }
    const rungs = m.d.trials.some(t => t.rung !== null && t.rung !== undefined);
    const headers = ["Trial", "State", ...(rungs ? ["Rung"] : []), m.metric,
      ...m.axes.map(a => a.name)];
    const table = el("table");
    table.id = "hp-selected-table";
    const head = el("tr");
    headers.forEach(h => head.appendChild(el("th", h)));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const t of chosen) {
      const tr = el("tr");
      tr.dataset.trial = String(t.trial_id);
      const a = el("a", String(t.trial_id));
      a.href = `/trials/${Number(t.trial_id)}`;
      tr.appendChild(el("td")).appendChild(a);
      tr.appendChild(el("td", t.state));
      if (rungs) tr.appendChild(el("td", shown(t.rung)));
      tr.appendChild(el("td", shown(t.metric)));
      for (const ax of m.axes) tr.appendChild(el("td", shown(t.hparams[ax.name])));
      body.appendChild(tr);
    }
    this.selectedBox.replaceChildren(table);
  }
}

async function hparamsPage() {
  const view = new HparamsView(PAGE.experiment_id);
  window.detHparams = view;
  const d = await view.refresh();
  let state = d.state;
  while (!TERMINAL.has(state)) {
    await new Promise(resolve => setTimeout(resolve, REFRESH_MS));
    try {
      state = (await view.refresh()).state;
    } catch (err) {
      console.warn("hyperparameter view: refresh failed:", err.message);
    }
  }
}

if (PAGE.page === "hparams") hparamsPage().catch(err => {
  document.querySelector("main").appendChild(el("p", `error: ${err.message}`, "error"));
  console.error(err);
});
