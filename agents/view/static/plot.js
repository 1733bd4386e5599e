// Interactive metric plots for the viewer: every element with class "plot" and a data-runs
// list of run names fetches /api/metrics and draws the chosen metric against the chosen x axis
// as SVG, one line per run (and per decoding for evaluations), with a moving mean and a hover
// read-out. No library and nothing loaded from elsewhere.
(function () {
  "use strict";
  var COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  var NS = "http://www.w3.org/2000/svg";
  var SKIP = { iteration: 1, episodes: 1, global_step: 1 };

  function el(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
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
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; lo = lo - 1; }
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    var err = (hi - lo) / n / step;
    step *= err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return (+v.toPrecision(4)).toString();
  }
  function smooth(pts, w) {
    if (w <= 1) return pts;
    var out = [], sum = 0, q = [];
    for (var i = 0; i < pts.length; i++) {
      q.push(pts[i][1]); sum += pts[i][1];
      if (q.length > w) sum -= q.shift();
      out.push([pts[i][0], sum / q.length]);
    }
    return out;
  }

  function Plot(root) {
    this.root = root;
    this.runs = JSON.parse(root.dataset.runs || "[]");
    this.smoothDefault = parseInt(root.dataset.smooth || "1", 10);
    var self = this;
    var q = this.runs.map(function (r) { return "run=" + encodeURIComponent(r); }).join("&");
    fetch("/api/metrics?" + q).then(function (r) {
      if (!r.ok) throw new Error("the metrics could not be loaded (HTTP " + r.status + ")");
      return r.json();
    }).then(function (data) { self.init(data); }).catch(function (e) {
      h("p", { "class": "alert error", "data-testid": "plot-error" }, root, String(e.message || e));
    });
  }

  Plot.prototype.init = function (data) {
    var root = this.root, self = this;
    this.data = data.runs;
    var kinds = {};
    this.data.forEach(function (run) { run.rows.forEach(function (r) { kinds[r.kind || "train"] = 1; }); });
    var bar = h("div", { "class": "bar" }, root);
    function select(label, testid, options, value) {
      var l = h("label", {}, bar, label + " ");
      var s = h("select", { "data-testid": testid }, l);
      options.forEach(function (o) { var opt = h("option", { value: o }, s, o); if (o === value) opt.selected = true; });
      s.addEventListener("change", function () { self.update(); });
      return s;
    }
    var kindList = Object.keys(kinds).sort(function (a, b) { return (a === "train" ? -1 : b === "train" ? 1 : a < b ? -1 : 1); });
    this.kind = select("rows", "plot-kind", kindList, kindList[0]);
    this.kind.addEventListener("change", function () { self.fillMetrics(); self.update(); });
    var metricLabel = h("label", {}, bar, "metric ");
    this.metric = h("select", { "data-testid": "plot-metric" }, metricLabel);
    this.metric.addEventListener("change", function () { self.update(); });
    this.x = select("x axis", "plot-x", ["episodes", "iteration", "time_total_s"], "episodes");
    var sl = h("label", {}, bar, "moving mean over ");
    this.smooth = h("input", { type: "number", min: "1", value: String(this.smoothDefault), style: "width:4em", "data-testid": "plot-smooth" }, sl);
    h("span", {}, sl, " rows");
    this.smooth.addEventListener("input", function () { self.update(); });
    this.svg = el("svg", { viewBox: "0 0 820 330", "data-testid": "plot-svg", role: "img" }, root);
    this.legend = h("div", { "class": "legend-list", "data-testid": "plot-legend" }, root);
    this.note = h("p", { "class": "note" }, root);
    this.tip = h("div", { "class": "tip", "data-testid": "plot-tooltip" }, root);
    this.fillMetrics();
    this.update();
  };

  Plot.prototype.fillMetrics = function () {
    var kind = this.kind.value, keys = {};
    this.data.forEach(function (run) {
      run.rows.forEach(function (r) {
        if ((r.kind || "train") !== kind) return;
        for (var k in r) if (!SKIP[k] && typeof r[k] === "number") keys[k] = 1;
      });
    });
    var list = Object.keys(keys).sort();
    var prefer = ["success", "return_mean", "loss"];
    var value = prefer.filter(function (p) { return keys[p]; })[0] || list[0];
    this.metric.innerHTML = "";
    for (var i = 0; i < list.length; i++) {
      var o = h("option", { value: list[i] }, this.metric, list[i]);
      if (list[i] === value) o.selected = true;
    }
  };

  Plot.prototype.series = function () {
    var kind = this.kind.value, metric = this.metric.value, xkey = this.x.value;
    var w = Math.max(1, parseInt(this.smooth.value, 10) || 1), out = [];
    this.data.forEach(function (run) {
      var groups = {};
      run.rows.forEach(function (r) {
        if ((r.kind || "train") !== kind) return;
        var x = r[xkey], y = r[metric];
        if (typeof x !== "number" || typeof y !== "number") return;
        var g = kind === "eval" && r.decoding ? run.name + " \u00b7 " + r.decoding : run.name;
        (groups[g] = groups[g] || []).push([x, y]);
      });
      Object.keys(groups).sort().forEach(function (g) {
        var pts = groups[g].sort(function (a, b) { return a[0] - b[0]; });
        out.push({ name: g, points: smooth(pts, w) });
      });
    });
    return out;
  };

  Plot.prototype.update = function () {
    var svg = this.svg, self = this;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    this.legend.innerHTML = "";
    var series = this.series();
    this.current = series;
    var W = 820, H = 330, L = 60, R = 16, T = 12, B = 40;
    var xs = [], ys = [];
    series.forEach(function (s) { s.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
    if (!xs.length) {
      el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#667085" }, svg).textContent =
        "no numeric values of " + this.metric.value + " against " + this.x.value;
      this.note.textContent = "";
      return;
    }
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs), y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) {
      if (y0 === 0) { y1 = 1; } else { var d = Math.abs(y0) * 0.1; y0 -= d; y1 += d; }
    }
    var pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    var sx = function (v) { return L + (v - x0) / (x1 - x0) * (W - L - R); };
    var sy = function (v) { return T + (1 - (v - y0) / (y1 - y0)) * (H - T - B); };
    this.scale = { sx: sx, sy: sy, x0: x0, x1: x1, L: L, R: R, W: W };
    var axis = el("g", { "font-size": "11", fill: "#475467" }, svg);
    ticks(y0, y1, 6).forEach(function (v) {
      el("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: "#eaecf0" }, axis);
      el("text", { x: L - 6, y: sy(v) + 4, "text-anchor": "end" }, axis).textContent = fmt(v);
    });
    ticks(x0, x1, 8).forEach(function (v) {
      el("line", { x1: sx(v), x2: sx(v), y1: T, y2: H - B, stroke: "#f2f4f7" }, axis);
      el("text", { x: sx(v), y: H - B + 15, "text-anchor": "middle" }, axis).textContent = fmt(v);
    });
    el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#98a2b3" }, svg);
    el("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", "font-size": "12", fill: "#344054" }, svg).textContent = this.x.value;
    el("text", { x: 14, y: (T + H - B) / 2, "text-anchor": "middle", "font-size": "12", fill: "#344054",
                 transform: "rotate(-90 14 " + (T + H - B) / 2 + ")" }, svg).textContent = this.metric.value;
    series.forEach(function (s, i) {
      var c = COLORS[i % COLORS.length];
      var d = s.points.map(function (p, j) { return (j ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); }).join("");
      el("path", { d: d, fill: "none", stroke: c, "stroke-width": "1.8", "data-testid": "plot-series",
                   "data-series": s.name, "data-points": String(s.points.length) }, svg);
      if (s.points.length <= 40) s.points.forEach(function (p) { el("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.6, fill: c }, svg); });
      var item = h("span", {}, self.legend);
      h("span", { "class": "swatch", style: "background:" + c }, item);
      item.appendChild(document.createTextNode(s.name + " (" + s.points.length + ")"));
    });
    this.cursor = el("line", { y1: T, y2: H - B, stroke: "#667085", "stroke-dasharray": "3,3", visibility: "hidden" }, svg);
    var hit = el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "transparent", "data-testid": "plot-hit" }, svg);
    hit.addEventListener("mousemove", function (ev) { self.hover(ev); });
    hit.addEventListener("mouseleave", function () { self.tip.style.display = "none"; self.cursor.setAttribute("visibility", "hidden"); });
    var problems = [];
    this.data.forEach(function (run) { if (run.problems && run.problems.length) problems.push(run.name + ": " + run.problems.length + " line(s) of metrics.jsonl skipped (see the run page)"); });
    this.note.textContent = problems.join("; ");
  };

  Plot.prototype.hover = function (ev) {
    var box = this.svg.getBoundingClientRect(), s = this.scale;
    var vx = (ev.clientX - box.left) / box.width * s.W;
    var x = s.x0 + (vx - s.L) / (s.W - s.L - s.R) * (s.x1 - s.x0);
    var lines = [this.x.value + " \u2248 " + fmt(x)];
    this.current.forEach(function (ser) {
      var best = null;
      ser.points.forEach(function (p) { if (best === null || Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p; });
      if (best) lines.push(ser.name + ": " + fmt(best[1]) + " at " + fmt(best[0]));
    });
    this.tip.textContent = "";
    for (var i = 0; i < lines.length; i++) { if (i) this.tip.appendChild(document.createElement("br")); this.tip.appendChild(document.createTextNode(lines[i])); }
    var rootBox = this.root.getBoundingClientRect();
    this.tip.style.display = "block";
    this.tip.style.left = (ev.clientX - rootBox.left + 14) + "px";
    this.tip.style.top = (ev.clientY - rootBox.top + 10) + "px";
    this.cursor.setAttribute("x1", vx); this.cursor.setAttribute("x2", vx);
    this.cursor.setAttribute("visibility", "visible");
  };

  document.querySelectorAll(".plot[data-runs]").forEach(function (root) { new Plot(root); });
})();
