// det-local dashboard: a run's system metrics (the daemon's samples, issue 30) on the trial and
// command pages: GPU utilisation and memory per slot, CPU, memory and disk I/O, against time.
// Data from /api/trials/ID/system or /api/commands/ID/system; text is set with textContent only.
"use strict";

(function () {
  const page = JSON.parse(document.getElementById("page-data").textContent);
  const box = document.getElementById("system-charts");
  if (!box) return;
  const url = page.page === "trial" ? `/api/trials/${page.trial_id}/system`
    : page.page === "command" ? `/api/commands/${page.job_id}/system` : null;
  if (!url) return;
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
  // chart title -> [unit, test for a metric name, label of a line]
  const CHARTS = [
    ["GPU utilisation (%)", n => /^slot\d+_gpu_util_pct$/.test(n), n => `slot ${n.match(/\d+/)[0]}`],
    ["GPU memory (MiB)", n => /^slot\d+_gpu_mem_used_mb$/.test(n), n => `slot ${n.match(/\d+/)[0]}`],
    ["CPU (% of one core)", n => n === "cpu_util_pct", () => "cpu"],
    ["Memory RSS (MiB)", n => n === "rss_mb", () => "rss"],
    ["Disk (MB/s)", n => n === "read_mb_s" || n === "write_mb_s", n => n.replace("_mb_s", "")],
  ];
  const plots = new Map();
  window.detSystemCharts = plots;

  function draw(reports) {
    const xs = reports.map(r => r.time);
    for (const [title, wanted, label] of CHARTS) {
      const names = [...new Set(reports.flatMap(r => Object.keys(r.metrics)))].filter(wanted).sort();
      if (!names.length) continue;
      const data = [xs, ...names.map(n => reports.map(r => (n in r.metrics ? r.metrics[n] : null)))];
      let plot = plots.get(title);
      if (plot && plot.series.length !== names.length + 1) { plot.destroy(); plot = undefined; }
      if (!plot) {
        const div = document.createElement("div");
        div.className = "chart";
        div.dataset.metric = title;
        box.appendChild(div);
        plot = new uPlot({
          title: title, width: Math.min(560, window.innerWidth - 60), height: 220,
          series: [{label: "time"}, ...names.map((n, i) => ({
            label: label(n), stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
            points: {show: false}}))],
          axes: [{}, {}],
        }, data, div);
        plots.set(title, plot);
      } else {
        plot.setData(data);
      }
    }
    if (!reports.length && !box.textContent) {
      const p = document.createElement("p");
      p.className = "muted";
      p.textContent = "no samples yet (the daemon samples running jobs: daemon.yaml system_metrics)";
      box.appendChild(p);
    } else if (reports.length) {
      for (const p of box.querySelectorAll("p.muted")) p.remove();
    }
  }

  async function refresh() {
    const r = await fetch(url, {credentials: "same-origin"});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || r.statusText);
    draw(body);
  }
  refresh().catch(err => console.error(err));
  setInterval(() => refresh().catch(err => console.error(err)), 5000);
})();
