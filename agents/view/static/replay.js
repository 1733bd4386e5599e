// The replay page: draws /api/replay?run=NAME as SVG (no library, nothing from elsewhere) and,
// while the run goes on, fetches it again every few seconds and redraws.
//   - heat maps of the buffer's and the drawn batches' ages over the iterations (the share of
//     each iteration's items per age bucket), and one iteration's histograms as bars;
//   - line charts: ESS by age bucket, the share of trained tokens from replay, tau and the
//     drift, gradient norm and clip fraction of replay vs on-policy updates.
// Every drawn value is also in a data- attribute (data-count, data-value, data-values), so
// what a chart shows can be read back exactly.
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
  var root = document.getElementById("replay");
  if (!root) return;
  var run = root.dataset.run, POLL_MS = parseInt(root.dataset.pollMs || "3000", 10);
  var state = { selected: null, data: null };

  function el(tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(tag, attrs, parent, text) {
    var e = document.createElement(tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return (+v.toPrecision(4)).toString();
  }
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; lo = lo - 1; }
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    var err = (hi - lo) / n / step;
    step *= err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  function bucketName(edges, b) {
    if (b === edges.length - 1) return edges[b] + "+";
    return edges[b + 1] - edges[b] === 1 ? String(edges[b]) : edges[b] + "-" + (edges[b + 1] - 1);
  }

  // A line chart of several series over x, gaps where a value is null.
  function lineChart(box, id, title, x, series, ylabel) {
    h("h3", {}, box, title);
    var W = 560, H = 220, L = 52, R = 12, T = 10, B = 30;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, "data-testid": "chart", "data-chart": id, role: "img" }, box);
    var ys = [];
    series.forEach(function (s) { s.values.forEach(function (v) { if (v !== null) ys.push(v); }); });
    if (!x.length || !ys.length) {
      el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#667085" }, svg, "no values yet");
      return;
    }
    var x0 = Math.min.apply(null, x), x1 = Math.max.apply(null, x);
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { if (y0 === 0) { y1 = 1; } else { var d = Math.abs(y0) * 0.1; y0 -= d; y1 += d; } }
    var pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    var sx = function (v) { return L + (v - x0) / (x1 - x0) * (W - L - R); };
    var sy = function (v) { return T + (1 - (v - y0) / (y1 - y0)) * (H - T - B); };
    var axis = el("g", { "font-size": "10", fill: "#475467" }, svg);
    ticks(y0, y1, 5).forEach(function (v) {
      el("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: "#eaecf0" }, axis);
      el("text", { x: L - 5, y: sy(v) + 3, "text-anchor": "end" }, axis, fmt(v));
    });
    ticks(x0, x1, 6).filter(function (v) { return v === Math.round(v); }).forEach(function (v) {  // whole iterations
      el("text", { x: sx(v), y: H - B + 13, "text-anchor": "middle" }, axis, fmt(v));
    });
    el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#98a2b3" }, svg);
    el("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": "11", fill: "#344054" }, svg, "iteration");
    if (ylabel) el("text", { x: 11, y: (T + H - B) / 2, "text-anchor": "middle", "font-size": "11", fill: "#344054",
                              transform: "rotate(-90 11 " + (T + H - B) / 2 + ")" }, svg, ylabel);
    var legend = h("div", { "class": "legend-list" }, box);
    series.forEach(function (s, i) {
      var c = s.color || COLORS[i % COLORS.length], d = "", pen = false;
      s.values.forEach(function (v, j) {
        if (v === null) { pen = false; return; }
        d += (pen ? "L" : "M") + sx(x[j]).toFixed(1) + "," + sy(v).toFixed(1);
        pen = true;
      });
      el("path", { d: d || "M0,0", fill: "none", stroke: c, "stroke-width": "1.8", "stroke-dasharray": s.dash || "",
                   "data-testid": "line", "data-chart": id, "data-series": s.name,
                   "data-x": JSON.stringify(x), "data-values": JSON.stringify(s.values) }, svg);
      if (x.length <= 60) s.values.forEach(function (v, j) {
        if (v !== null) el("circle", { cx: sx(x[j]), cy: sy(v), r: 2.2, fill: c }, svg);
      });
      var item = h("span", {}, legend);
      h("span", { "class": "swatch", style: "background:" + c }, item);
      item.appendChild(document.createTextNode(s.name));
    });
  }

  // A heat map: one column per iteration, one row per age bucket (youngest at the bottom),
  // shaded by the share of the iteration's items in the bucket.
  function heatmap(box, kind, title, data, counts) {
    h("h3", {}, box, title);
    var edges = data.edges, its = data.iterations, nb = edges.length;
    var W = 560, H = 230, L = 52, R = 12, T = 8, B = 30;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, "data-testid": "heatmap", "data-kind": kind, role: "img" }, box);
    var used = 1;  // show the buckets up to the oldest one that holds anything
    counts.forEach(function (row) { row.forEach(function (c, b) { if (c > 0) used = Math.max(used, b + 1); }); });
    var cw = (W - L - R) / Math.max(1, its.length), ch = (H - T - B) / used;
    var axis = el("g", { "font-size": "10", fill: "#475467" }, svg);
    for (var b = 0; b < used; b++) el("text", { x: L - 5, y: T + (used - b - 0.5) * ch + 3, "text-anchor": "end" }, axis, bucketName(edges, b));
    var step = Math.max(1, Math.ceil(its.length / 8));
    its.forEach(function (it, j) { if (j % step === 0 || j === its.length - 1) el("text", { x: L + (j + 0.5) * cw, y: H - B + 13, "text-anchor": "middle" }, axis, String(it)); });
    el("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": "11", fill: "#344054" }, svg, "iteration");
    el("text", { x: 11, y: (T + H - B) / 2, "text-anchor": "middle", "font-size": "11", fill: "#344054",
                 transform: "rotate(-90 11 " + (T + H - B) / 2 + ")" }, svg, "age (steps)");
    counts.forEach(function (row, j) {
      var total = row.reduce(function (a, c) { return a + c; }, 0);
      row.forEach(function (c, b) {
        if (b >= used) return;
        var share = total ? c / total : 0;
        var cell = el("rect", { x: L + j * cw, y: T + (used - b - 1) * ch, width: Math.max(cw - 0.3, 0.5), height: Math.max(ch - 0.3, 0.5),
                                fill: c ? "hsl(215, 80%, " + (95 - 60 * share).toFixed(0) + "%)" : "#f8f9fb",
                                "data-testid": "heat-cell", "data-kind": kind, "data-iteration": String(its[j]),
                                "data-bucket": bucketName(edges, b), "data-count": String(c) }, svg);
        el("title", {}, cell, "iteration " + its[j] + ", age " + bucketName(edges, b) + ": " + c + " (" + (100 * share).toFixed(1) + "%)");
      });
    });
  }

  // One iteration's histograms side by side: the buffer's items, its sampling mass, the drawn items.
  function bars(box, data) {
    var its = data.iterations, j = its.indexOf(state.selected);
    if (j < 0) { j = its.length - 1; state.selected = its[j]; }
    var bar = h("div", { "class": "bar" }, box);
    var label = h("label", {}, bar, "iteration ");
    var sel = h("select", { "data-testid": "iteration-select" }, label);
    its.forEach(function (it) { var o = h("option", { value: String(it) }, sel, String(it)); if (it === state.selected) o.selected = true; });
    sel.addEventListener("change", function () { state.selected = parseInt(sel.value, 10); draw(state.data); });
    var edges = data.edges, nb = edges.length;
    var parts = [["buffer", "items in the buffer", data.buffer_hist[j], "#1f77b4"],
                 ["mass", "sampling probability mass", data.buffer_mass[j], "#9467bd"],
                 ["drawn", "items drawn by this iteration's replay updates", data.drawn_hist[j], "#ff7f0e"]];
    var used = 1;
    parts.forEach(function (p) { (p[2] || []).forEach(function (v, b) { if (v) used = Math.max(used, b + 1); }); });
    var W = 560, H = 200, L = 52, R = 12, T = 10, B = 30;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, "data-testid": "iteration-bars", role: "img" }, box);
    var gw = (W - L - R) / used, bw = gw / 4;
    el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#98a2b3" }, svg);
    parts.forEach(function (p, k) {
      var vals = p[2] || [], total = vals.reduce(function (a, v) { return a + (v || 0); }, 0);
      vals.forEach(function (v, b) {
        if (b >= used) return;
        var share = total ? (v || 0) / total : 0;
        var r = el("rect", { x: L + b * gw + (k + 0.5) * bw, y: T + (1 - share) * (H - T - B), width: bw * 0.9,
                             height: share * (H - T - B), fill: p[3], "data-testid": "iter-bar", "data-kind": p[0],
                             "data-bucket": bucketName(edges, b), "data-value": String(v) }, svg);
        el("title", {}, r, p[1] + ", age " + bucketName(edges, b) + ": " + fmt(v) + " (" + (100 * share).toFixed(1) + "%)");
      });
    });
    for (var b = 0; b < used; b++) el("text", { x: L + (b + 0.5) * gw, y: H - B + 13, "text-anchor": "middle", "font-size": "10", fill: "#475467" }, svg, bucketName(edges, b));
    el("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": "11", fill: "#344054" }, svg, "age (steps); bar height: share of the whole");
    var legend = h("div", { "class": "legend-list" }, box);
    parts.forEach(function (p) { var s = h("span", {}, legend); h("span", { "class": "swatch", style: "background:" + p[3] }, s); s.appendChild(document.createTextNode(p[1])); });
  }

  function draw(data) {
    state.data = data;
    var charts = document.getElementById("replay-charts");
    charts.innerHTML = "";
    var status = document.querySelector("[data-testid=replay-status]");
    status.dataset.iterations = String(data.iterations.length);
    status.textContent = data.iterations.length + " iterations in the log (iterations " +
      (data.iterations.length ? data.iterations[0] + "-" + data.iterations[data.iterations.length - 1] : "none") + ")" +
      (data.finished ? "" : "; the run is going on: the charts update every " + POLL_MS / 1000 + " s");
    if (!data.iterations.length) { h("p", { "class": "muted" }, charts, "No iteration has been logged yet."); return; }
    var grid = h("div", { "class": "chart-grid" }, charts);
    heatmap(h("div", { "class": "chart" }, grid), "buffer", "Ages in the buffer", data, data.buffer_hist);
    heatmap(h("div", { "class": "chart" }, grid), "drawn", "Ages of the drawn items", data, data.drawn_hist);
    var one = h("div", { "class": "chart wide" }, grid);
    h("h3", {}, one, "One iteration: buffer, sampling mass and drawn items by age");
    bars(one, data);
    var x = data.iterations;
    lineChart(h("div", { "class": "chart" }, grid), "ess", "IS effective sample size by age bucket (replay updates)", x,
              Object.keys(data.ess).map(function (b) { return { name: "age " + b, values: data.ess[b] }; }), "ESS / n");
    lineChart(h("div", { "class": "chart" }, grid), "share", "Share of the trained tokens from replay", x,
              [{ name: "replay share", values: data.token_share }], "share");
    lineChart(h("div", { "class": "chart" }, grid), "tau", "tau" + (data.auto_tau ? " (--tau auto, " + (data.tau_signal || "ess") + ")" : " (fixed)"), x,
              [{ name: "tau", values: data.tau }], "steps");
    lineChart(h("div", { "class": "chart" }, grid), "drift", "Policy drift per step of age", x,
              [{ name: "measured (mean of the replay updates)", values: data.drift_measured },
               { name: "fitted (what --tau auto steers by)", values: data.drift, dash: "4,3" }], "c");
    lineChart(h("div", { "class": "chart" }, grid), "grad_norm", "Gradient norm (before clipping)", x,
              [{ name: "replay", values: data.grad_norm.replay }, { name: "on-policy", values: data.grad_norm.on_policy }], "norm");
    lineChart(h("div", { "class": "chart" }, grid), "clip_frac", "Clip fraction", x,
              [{ name: "replay", values: data.clip_frac.replay }, { name: "on-policy", values: data.clip_frac.on_policy }], "share of tokens");
  }

  function load() {
    fetch("/api/replay?run=" + encodeURIComponent(run)).then(function (r) {
      if (!r.ok) throw new Error("the replay log could not be loaded (HTTP " + r.status + ")");
      return r.json();
    }).then(function (data) {
      draw(data);
      if (!data.finished) setTimeout(load, POLL_MS);
    }).catch(function (e) {
      var box = document.getElementById("replay-charts");
      box.innerHTML = "";
      h("p", { "class": "alert error", "data-testid": "replay-error" }, box, String(e.message || e));
      setTimeout(load, POLL_MS * 3);
    });
  }
  load();
})();
