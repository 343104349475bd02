// det-local dashboard: /usage, a chart per user (or experiment, slot, kind): slot-hours
// allocated and used. Data from /api/usage (`det-local usage --json`); textContent only.
"use strict";

(async function () {
  const page = JSON.parse(document.getElementById("page-data").textContent);
  const box = document.getElementById("usage-charts");
  const q = `since=${encodeURIComponent(page.since)}&by=${encodeURIComponent(page.by)}`;
  const r = await fetch(`/api/usage?${q}`, {credentials: "same-origin"});
  const rep = await r.json();
  if (!r.ok) throw new Error(rep.error || r.statusText);
  const charts = [];
  window.detUsageCharts = charts;
  for (const row of rep.rows) {
    const div = document.createElement("div");
    div.className = "chart";
    div.dataset.key = String(row.key);
    box.appendChild(div);
    // one bar pair: allocated and used slot-hours
    const bars = uPlot.paths.bars({size: [0.6, 80]});
    charts.push(new uPlot({
      title: `${page.by} ${row.key === null ? "-" : row.key}: ${row.slot_hours.toFixed(2)} slot-hours` +
        (row.mean_util_pct === null ? "" : `, ${row.mean_util_pct}% used`),
      width: 320, height: 200,
      scales: {x: {time: false, range: [-0.5, 1.5]}, y: {range: [0, Math.max(row.slot_hours, 0.01) * 1.1]}},
      axes: [{values: (u, ticks) => ticks.map(t => (t === 0 ? "allocated" : t === 1 ? "used" : ""))}, {}],
      series: [{}, {label: "slot-hours", fill: "#1f77b4", stroke: "#1f77b4", paths: bars, points: {show: false}}],
    }, [[0, 1], [row.slot_hours, row.used_slot_hours]], div));
  }
})().catch(err => console.error(err));
