(function () {
"use strict";
var DATA = JSON.parse(document.getElementById("plan-data").textContent);
var S = DATA.summary, UNITS = DATA.report.units, COST_UNIT = S.extra_compute.unit || "s";
var PAGE = 50, SVGNS = "http://www.w3.org/2000/svg";
var DEC = {B: 1, KB: 1e3, MB: 1e6, GB: 1e9, TB: 1e12};
var BIN = {KIB: 1024, MIB: 1048576, GIB: 1073741824, TIB: 1099511627776};

function fmtBytes(b) {
  if (b === null || b === undefined) return "-";
  if (UNITS === "auto") {
    var names = ["TB", "GB", "MB", "KB"];
    for (var i = 0; i < names.length; i++) {
      if (Math.abs(b) >= DEC[names[i]]) return (b / DEC[names[i]]).toFixed(2) + " " + names[i];
    }
    return Math.round(b) + " B";
  }
  var k = UNITS.toUpperCase();
  return (b / (DEC[k] || BIN[k])).toFixed(2) + " " + UNITS;
}
function exact(b) { return b === null || b === undefined ? "-" : Number(b).toLocaleString("en-US") + " bytes"; }
function g3(v) { return Number(v.toPrecision(3)).toString(); }
function fmtCost(c) {
  if (c === null || c === undefined) return "-";
  if (COST_UNIT !== "s") return Number(c.toPrecision(4)).toString() + " units";
  var a = Math.abs(c);
  if (a >= 1 || a === 0) return g3(c) + " s";
  if (a >= 1e-3) return g3(c * 1e3) + " ms";
  return g3(c * 1e6) + " us";
}
function el(tag, attrs, kids) {
  var e = document.createElement(tag);
  if (attrs) for (var k in attrs) {
    if (k === "text") e.textContent = attrs[k];
    else if (k === "cls") e.className = attrs[k];
    else e.setAttribute(k, attrs[k]);
  }
  (kids || []).forEach(function (c) {
    if (c === null || c === undefined) return;
    e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
  });
  return e;
}
function sv(tag, attrs) {
  var e = document.createElementNS(SVGNS, tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  return e;
}

// -------------------------------------------------------------------------------------------
// Tables: sortable (click a header), filtered (search box), paged client-side.
// spec: {columns: [{label, get(row), type: "num"|"bytes"|"cost"|"text", cls, fmt}], rows,
//        sort: column index, desc: bool, empty: text, onHover(row|null)}
// -------------------------------------------------------------------------------------------
function makeTable(host, spec) {
  var st = {sort: spec.sort === undefined ? -1 : spec.sort, desc: !!spec.desc, page: 0, filter: ""};
  var cols = spec.columns, all = spec.rows;
  if (!all.length) { host.appendChild(el("p", {cls: "empty", text: spec.empty || "None."})); return; }
  var text = all.map(function (r) {
    return cols.map(function (c) { var v = c.get(r); return v === null || v === undefined ? "" : String(v); })
      .join("\u0001").toLowerCase();
  });
  var search = el("input", {type: "search", placeholder: "filter rows"});
  var info = el("span"), prev = el("button", {text: "\u2039 prev"}), next = el("button", {text: "next \u203a"});
  var bar = el("div", {cls: "tbar"}, [search, prev, info, next]);
  var table = el("table", {cls: "data"}), thead = el("thead"), tbody = el("tbody");
  table.appendChild(thead); table.appendChild(tbody);
  host.appendChild(bar); host.appendChild(el("div", {cls: "scroll"}, [table]));
  var isNum = function (c) { return c.type === "num" || c.type === "bytes" || c.type === "cost"; };
  function header() {
    thead.textContent = "";
    var tr = el("tr");
    cols.forEach(function (c, i) {
      var th = el("th", {cls: isNum(c) ? "num" : "", title: "sort by " + c.label}, [c.label]);
      if (i === st.sort) th.appendChild(el("span", {cls: "arrow", text: st.desc ? "\u25bc" : "\u25b2"}));
      th.addEventListener("click", function () {
        if (st.sort === i) st.desc = !st.desc; else { st.sort = i; st.desc = isNum(c); }
        st.page = 0; render();
      });
      tr.appendChild(th);
    });
    thead.appendChild(tr);
  }
  function view() {
    var idx = [];
    var f = st.filter;
    for (var i = 0; i < all.length; i++) if (!f || text[i].indexOf(f) >= 0) idx.push(i);
    if (st.sort >= 0) {
      var c = cols[st.sort], sgn = st.desc ? -1 : 1, num = isNum(c);
      idx.sort(function (a, b) {
        var x = c.get(all[a]), y = c.get(all[b]);
        if (x === null || x === undefined) x = num ? -Infinity : "";
        if (y === null || y === undefined) y = num ? -Infinity : "";
        if (!num) { x = String(x).toLowerCase(); y = String(y).toLowerCase(); }
        return x < y ? -sgn : x > y ? sgn : a - b;
      });
    }
    return idx;
  }
  function cell(c, r) {
    var v = c.get(r), shown;
    if (c.fmt) shown = c.fmt(v, r);
    else if (c.type === "bytes") shown = fmtBytes(v);
    else if (c.type === "cost") shown = fmtCost(v);
    else shown = v === null || v === undefined ? "" : String(v);
    var td = el("td", {cls: (isNum(c) ? "num " : "") + (c.cls || "")}, [shown]);
    if (c.type === "bytes" && v !== null && v !== undefined) td.title = exact(v);
    return td;
  }
  function render() {
    header();
    var idx = view(), pages = Math.max(1, Math.ceil(idx.length / PAGE));
    st.page = Math.min(st.page, pages - 1);
    tbody.textContent = "";
    var lo = st.page * PAGE, hi = Math.min(idx.length, lo + PAGE);
    for (var i = lo; i < hi; i++) {
      var r = all[idx[i]], tr = el("tr");
      cols.forEach(function (c) { tr.appendChild(cell(c, r)); });
      if (spec.onHover) {
        (function (row) {
          tr.addEventListener("mouseenter", function () { spec.onHover(row); });
          tr.addEventListener("mouseleave", function () { spec.onHover(null); });
        })(r);
      }
      tbody.appendChild(tr);
    }
    info.textContent = idx.length ? ("rows " + (lo + 1) + "\u2013" + hi + " of " + idx.length +
      (idx.length < all.length ? " (filtered from " + all.length + ")" : "") +
      (pages > 1 ? ", page " + (st.page + 1) + " of " + pages : "")) : "no rows match";
    prev.disabled = st.page === 0; next.disabled = st.page >= pages - 1;
    prev.style.display = next.style.display = pages > 1 ? "" : "none";
  }
  prev.addEventListener("click", function () { st.page--; render(); });
  next.addEventListener("click", function () { st.page++; render(); });
  search.addEventListener("input", function () { st.filter = search.value.trim().toLowerCase(); st.page = 0; render(); });
  render();
}

// -------------------------------------------------------------------------------------------
// The memory timeline (SVG): phases shaded, planned stacked by kind, baseline line, budget,
// recompute-group peaks, the planned peak; hover shows the op under the pointer.
// -------------------------------------------------------------------------------------------
function niceStep(span, ticks) {
  var raw = span / Math.max(1, ticks), p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
}
function axisUnit(top) {
  if (UNITS !== "auto") { var k = UNITS.toUpperCase(); return [DEC[k] || BIN[k], UNITS]; }
  var names = ["GB", "MB", "KB"];
  for (var i = 0; i < names.length; i++) if (top >= DEC[names[i]]) return [DEC[names[i]], names[i]];
  return [1, "bytes"];
}

var highlight = null;  // set by the chart: highlight(a, b) shades ops a..b, highlight(null) clears

function drawTimeline(host, T) {
  var n = T.num_ops, P = T.planned, B = T.baseline, G = T.groups;
  if (!n) { host.appendChild(el("p", {cls: "missing", text: "The trace has no ops."})); return; }
  var W = 1300, H = 500, ml = 78, mr = 22, mt = 62, mb = 58, pw = W - ml - mr, ph = H - mt - mb;
  var top = 1;
  P.live.forEach(function (v) { if (v > top) top = v; });
  B.live.forEach(function (v) { if (v > top) top = v; });
  G.rows.forEach(function (g) { if (g[1] > top) top = g[1]; });
  if (T.budget_bytes && T.budget_bytes > top) top = T.budget_bytes;
  if (T.planned_peak.nbytes > top) top = T.planned_peak.nbytes;
  var au = axisUnit(top), scale = au[0];
  var ystep = niceStep(top * 1.12 / scale, 6) * scale, ymax = Math.ceil(top * 1.12 / ystep) * ystep;
  function X(i) { return ml + (i + 0.5) / n * pw; }
  function Y(b) { return mt + ph - b / ymax * ph; }
  var svg = sv("svg", {viewBox: "0 0 " + W + " " + H, role: "img",
    "aria-label": "memory timeline: baseline and planned live bytes per op"});
  // Phases: bands behind the data and a labelled strip under the axis.
  T.phase_spans.forEach(function (s) {
    var x0 = X(s[1] - 0.5), x1 = X(s[2] + 0.5), c = T.phase_colors[s[0]] || "#eeeeee";
    svg.appendChild(sv("rect", {x: x0, y: mt, width: Math.max(0.5, x1 - x0), height: ph, fill: c, opacity: 0.55}));
    svg.appendChild(sv("rect", {x: x0, y: mt + ph + 24, width: Math.max(0.5, x1 - x0), height: 16, fill: c}));
    if (x1 - x0 > 60) {
      var t = sv("text", {x: (x0 + x1) / 2, y: mt + ph + 36, "text-anchor": "middle", "font-size": 11, fill: "#333"});
      t.textContent = s[0]; svg.appendChild(t);
    }
  });
  // Grid and y axis.
  for (var v = 0; v <= ymax + ystep / 2; v += ystep) {
    svg.appendChild(sv("line", {x1: ml, x2: ml + pw, y1: Y(v), y2: Y(v), stroke: "#c8ced6", "stroke-width": 0.6}));
    var yl = sv("text", {x: ml - 6, y: Y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#444"});
    yl.textContent = Number((v / scale).toPrecision(6)).toString(); svg.appendChild(yl);
  }
  var ylab = sv("text", {x: 16, y: mt + ph / 2, "text-anchor": "middle", "font-size": 12, fill: "#333",
    transform: "rotate(-90 16 " + (mt + ph / 2) + ")"});
  ylab.textContent = "live memory (" + au[1] + ")"; svg.appendChild(ylab);
  // x axis ticks (op index).
  var xstep = niceStep(n, 10);
  for (var xi = 0; xi < n; xi += xstep) {
    svg.appendChild(sv("line", {x1: X(xi), x2: X(xi), y1: mt + ph, y2: mt + ph + 5, stroke: "#666"}));
    var xl = sv("text", {x: X(xi), y: mt + ph + 17, "text-anchor": "middle", "font-size": 11, fill: "#444"});
    xl.textContent = String(Math.round(xi)); svg.appendChild(xl);
  }
  var xlab = sv("text", {x: ml + pw / 2, y: H - 4, "text-anchor": "middle", "font-size": 12, fill: "#333"});
  xlab.textContent = "op index" + (T.downsampled ? "  (largest of every " + T.bucket_ops + " ops per point)" : "");
  svg.appendChild(xlab);
  svg.appendChild(sv("line", {x1: ml, x2: ml + pw, y1: mt + ph, y2: mt + ph, stroke: "#666"}));
  // Highlight band (a decision's gap, from the decisions table).
  var hl = sv("rect", {x: 0, y: mt, width: 0, height: ph, fill: "#ff9800", opacity: 0.22, display: "none"});
  svg.appendChild(hl);
  // Planned: stacked areas by kind.
  var m = P.op.length, cum = new Array(m).fill(0);
  T.kinds.forEach(function (k) {
    var vals = P.by_kind[k], up = [], down = [];
    for (var j = 0; j < m; j++) {
      down.push(X(P.op[j]).toFixed(1) + "," + Y(cum[j]).toFixed(1));
      cum[j] += vals[j];
      up.push(X(P.op[j]).toFixed(1) + "," + Y(cum[j]).toFixed(1));
    }
    down.reverse();
    svg.appendChild(sv("path", {d: "M" + up.join("L") + "L" + down.join("L") + "Z", fill: T.kind_colors[k],
      opacity: 0.9, stroke: T.kind_colors[k], "stroke-width": 0.4}));
  });
  // Baseline: a line.
  var bl = [];
  for (var j2 = 0; j2 < B.op.length; j2++) bl.push(X(B.op[j2]).toFixed(1) + "," + Y(B.live[j2]).toFixed(1));
  svg.appendChild(sv("path", {d: "M" + bl.join("L"), fill: "none", stroke: "#222", "stroke-width": 1.4}));
  // Recompute group peaks: triangles between ops.
  G.rows.forEach(function (g) {
    var gx = X(g[0] - 0.5), gy = Y(g[1]);
    svg.appendChild(sv("path", {d: "M" + (gx - 3.5) + "," + (gy - 6) + "L" + (gx + 3.5) + "," + (gy - 6) + "L" + gx + "," + gy + "Z",
      fill: "#7b2d8e"}));
  });
  // Budget.
  if (T.budget_bytes !== null && T.budget_bytes !== undefined) {
    var by = Y(T.budget_bytes);
    svg.appendChild(sv("line", {x1: ml, x2: ml + pw, y1: by, y2: by, stroke: "#d62728", "stroke-width": 1.5,
      "stroke-dasharray": "7 4"}));
    var btx = sv("text", {x: ml + pw - 4, y: by - 5, "text-anchor": "end", "font-size": 12, fill: "#d62728",
      "font-weight": 600});
    btx.textContent = "budget " + fmtBytes(T.budget_bytes); svg.appendChild(btx);
  }
  // Peaks.
  // Each peak: a circle on the data and its label in the band above the plot, joined by a
  // dotted leader, the label on the side with more room.
  function peakMark(pk, color, label, ty) {
    if (pk.op_id === null || pk.op_id < 0) return;
    var px = X(pk.in_recompute ? pk.op_id - 0.5 : pk.op_id), py = Y(pk.nbytes);
    svg.appendChild(sv("line", {x1: px, x2: px, y1: ty + 4, y2: py - 6, stroke: color, "stroke-width": 1,
      "stroke-dasharray": "2 3"}));
    svg.appendChild(sv("circle", {cx: px, cy: py, r: 6, fill: "none", stroke: color, "stroke-width": 2}));
    var right = px < ml + pw * 0.6;
    var t = sv("text", {x: px + (right ? -4 : 4), y: ty, "text-anchor": right ? "start" : "end",
      "font-size": 12, fill: color, "font-weight": 600});
    t.textContent = label; svg.appendChild(t);
  }
  var pp = T.planned_peak, bp = T.baseline_peak;
  peakMark({op_id: bp.op_id, nbytes: bp.nbytes, in_recompute: false}, "#222",
    "baseline peak " + fmtBytes(bp.nbytes) + " (op " + bp.op_id + ")", 18);
  peakMark(pp, "#d62728", "planned peak " + fmtBytes(pp.nbytes) + " (" +
    (pp.in_recompute ? "in the recompute group before op " : "op ") + pp.op_id + ")", 40);
  // Hover.
  var guide = sv("line", {x1: 0, x2: 0, y1: mt, y2: mt + ph, stroke: "#333", "stroke-width": 0.8,
    "stroke-dasharray": "3 3", display: "none"});
  var dot = sv("circle", {r: 4, fill: "#fff", stroke: "#333", "stroke-width": 1.5, display: "none"});
  svg.appendChild(guide); svg.appendChild(dot);
  var overlay = sv("rect", {x: ml, y: mt, width: pw, height: ph, fill: "transparent"});
  svg.appendChild(overlay);
  var wrap = el("div", {cls: "chart-wrap"}), tip = el("div", {cls: "tip"});
  wrap.appendChild(svg); wrap.appendChild(tip); host.appendChild(wrap);

  function nearest(ops, op) {  // index of the sample in sorted ``ops`` nearest to ``op``
    var lo = 0, hi = ops.length - 1;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (ops[mid] < op) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(ops[lo - 1] - op) <= Math.abs(ops[lo] - op)) lo--;
    return lo;
  }
  function row(label, value, color, bold) {
    var sw = color ? el("span", {style: "display:inline-block;width:9px;height:9px;margin-right:5px;background:" + color}) : null;
    var tr = el("tr", {}, [el("td", {}, [sw, label]), el("td", {cls: "n"}, [value])]);
    if (bold) tr.style.fontWeight = "600";
    return tr;
  }
  overlay.addEventListener("mousemove", function (ev) {
    var pt = svg.createSVGPoint(); pt.x = ev.clientX; pt.y = ev.clientY;
    var loc = pt.matrixTransform(svg.getScreenCTM().inverse());
    var op = Math.max(0, Math.min(n - 1, Math.round((loc.x - ml) / pw * n - 0.5)));
    var j = nearest(P.op, op), o = P.op[j], bucket = Math.floor(o / T.bucket_ops);
    var a = bucket * T.bucket_ops, b = Math.min(n - 1, a + T.bucket_ops - 1);
    guide.setAttribute("x1", X(o)); guide.setAttribute("x2", X(o)); guide.setAttribute("display", "");
    dot.setAttribute("cx", X(o)); dot.setAttribute("cy", Y(P.live[j])); dot.setAttribute("display", "");
    tip.textContent = "";
    tip.appendChild(el("div", {cls: "t", text: "op " + o + (P.op_name ? "  " + P.op_name[j] : "")}));
    if (P.module) tip.appendChild(el("div", {cls: "m", text: "module: " + (P.module[j] || "(none)")}));
    tip.appendChild(el("div", {cls: "m", text: "phase: " + P.phase[j] +
      (T.downsampled ? "; the largest of ops " + a + "\u2013" + b : "")}));
    var tb = el("table");
    tb.appendChild(row("planned, live", fmtBytes(P.live[j]), null, true));
    T.kinds.slice().reverse().forEach(function (k) {
      if (P.by_kind[k][j]) tb.appendChild(row(T.kind_labels[k], fmtBytes(P.by_kind[k][j]), T.kind_colors[k]));
    });
    var bj = Math.min(B.op.length - 1, bucket);
    tb.appendChild(row("baseline, live" + (B.op[bj] !== o ? " (op " + B.op[bj] + ")" : ""), fmtBytes(B.live[bj]), null, true));
    if (T.budget_bytes) tb.appendChild(row("budget", fmtBytes(T.budget_bytes)));
    var best = null;
    for (var gi = 0; gi < G.rows.length; gi++) {
      var g = G.rows[gi];
      if (g[0] >= a && g[0] <= b + 1 && (!best || g[1] > best[1])) best = g;
    }
    if (best) tb.appendChild(row("recompute before op " + best[0] + " (" + best[2] + " ops)", fmtBytes(best[1]), "#7b2d8e"));
    tip.appendChild(tb);
    tip.style.display = "block";
    var r = wrap.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
    var tw = tip.offsetWidth, th = tip.offsetHeight;
    tip.style.left = (x + 16 + tw > r.width ? x - 16 - tw : x + 16) + "px";
    tip.style.top = Math.max(0, Math.min(y - th / 2, r.height - th)) + "px";
  });
  overlay.addEventListener("mouseleave", function () {
    tip.style.display = "none"; guide.setAttribute("display", "none"); dot.setAttribute("display", "none");
  });
  highlight = function (a, b) {
    if (a === null) { hl.setAttribute("display", "none"); return; }
    hl.setAttribute("x", X(a - 0.5)); hl.setAttribute("width", Math.max(1, X(b + 0.5) - X(a - 0.5)));
    hl.setAttribute("display", "");
  };
  // Legend and caption.
  var lg = el("div", {cls: "legend"});
  T.kinds.forEach(function (k) {
    lg.appendChild(el("span", {}, [el("span", {cls: "sw", style: "background:" + T.kind_colors[k]}), "planned: " + T.kind_labels[k]]));
  });
  lg.appendChild(el("span", {}, [el("span", {cls: "ln"}), "baseline, no plan"]));
  lg.appendChild(el("span", {}, [el("span", {cls: "ln", style: "border-top:2px dashed #d62728"}), "budget"]));
  if (G.count) lg.appendChild(el("span", {}, [el("span", {cls: "sw", style: "background:#7b2d8e"}),
    "recompute group peak (" + G.count + " groups" + (G.rows.length < G.count ? ", the highest " + G.rows.length + " shown" : "") + ")"]));
  var seen = {};
  T.phase_spans.forEach(function (s) { seen[s[0]] = 1; });
  Object.keys(seen).forEach(function (p) {
    lg.appendChild(el("span", {}, [el("span", {cls: "sw", style: "background:" + (T.phase_colors[p] || "#eee")}), p + " phase"]));
  });
  host.appendChild(lg);
  host.appendChild(el("p", {cls: "chart-caption", text: "Hover for the op under the pointer; hover a decision " +
    "below to shade the ops its tensor is away (after \u201cfree after\u201d, until \u201crebuilt before\u201d)." +
    (T.downsampled ? " " + n + " ops drawn as " + P.op.length + " points, each the op with the most planned " +
      "(or, for the line, baseline) live bytes in its bucket, so no peak is lost." : "")}));
}

// -------------------------------------------------------------------------------------------
// Sections
// -------------------------------------------------------------------------------------------
function decisions(host) {
  var D = DATA.decisions, c = {};
  D.columns.forEach(function (name, i) { c[name] = i; });
  function col(name) { return function (r) { return r[c[name]]; }; }
  var total = 0;
  D.rows.forEach(function (r) { total += r[c.nbytes]; });
  if (D.rows.length) host.appendChild(el("p", {cls: "chart-caption",
    text: D.rows.length + " tensors dropped, " + fmtBytes(total) + " freed. Each is freed right after op " +
      "\u201cfree after\u201d and rebuilt in the recompute group before op \u201cremat before\u201d, or earlier " +
      "when another rebuild needs it (\u201crebuilt before\u201d, from the simulator)."}));
  makeTable(host, {
    rows: D.rows, sort: 4, desc: true, empty: "None: every tensor is kept.",
    columns: [
      {label: "tensor", type: "num", get: col("tensor")},
      {label: "module", cls: "nw mono", get: function (r) { return r[c.module] || "(none)"; }},
      {label: "op", type: "num", get: col("op")},
      {label: "op name", cls: "nw mono", get: col("op_name")},
      {label: "bytes", type: "bytes", get: col("nbytes")},
      {label: "free after", type: "num", get: col("free_after")},
      {label: "remat before", type: "num", get: col("remat_before")},
      {label: "rebuilt before", type: "num", get: col("rebuilt_before"),
       fmt: function (v, r) { return v === null ? "-" : v === r[c.remat_before] ? String(v) : v + " (early)"; }},
      {label: "why", cls: "why", get: col("why")}
    ],
    onHover: function (r) {
      if (!highlight) return;
      if (!r) { highlight(null); return; }
      var back = r[c.rebuilt_before] === null ? r[c.remat_before] : r[c.rebuilt_before];
      highlight(r[c.free_after] + 1, back - 1);
    }
  });
}
function partitions(host) {
  makeTable(host, {
    rows: S.partitions, empty: "None: every module runs on its whole batch.",
    columns: [
      {label: "module", cls: "nw mono", get: function (p) { return p.module || "(none)"; }},
      {label: "over", get: function (p) { return p.chunks === 1 ? "whole (checkpointed)" : (p.over || "batch"); }},
      {label: "chunks", type: "num", get: function (p) { return p.chunks; }},
      {label: "why", cls: "why", get: function (p) { return p.why; }}
    ]
  });
}
function modules(host) {
  if (S.modules === null) {
    host.appendChild(el("p", {cls: "missing", text: "Not shown: the per-module table needs the trace the plan " +
      "was solved for. " + (S.trace.message ? S.trace.message + "." : "")}));
    return;
  }
  var freed = 0, extra = 0;
  S.modules.forEach(function (m) { freed += m.nbytes_freed; extra += m.extra_compute; });
  host.appendChild(el("p", {cls: "chart-caption", text: "Bytes freed by the producer's module; extra compute: " +
    "each re-run op charged to its own module, each partition to its module. Total: " + fmtBytes(freed) +
    " freed, " + fmtCost(extra) + " extra (" + (S.extra_compute.pct_of_step || 0).toFixed(2) + "% of the step)."}));
  makeTable(host, {
    rows: S.modules, sort: 2, desc: true, empty: "No module drops or re-runs anything.",
    columns: [
      {label: "module", cls: "nw mono", get: function (m) { return m.module; }},
      {label: "tensors dropped", type: "num", get: function (m) { return m.tensors_dropped; }},
      {label: "bytes freed", type: "bytes", get: function (m) { return m.nbytes_freed; }},
      {label: "ops re-run", type: "num", get: function (m) { return m.ops_rerun; }},
      {label: "extra compute", type: "cost", get: function (m) { return m.extra_compute; }},
      {label: "% of step", type: "num", get: function (m) { return m.extra_compute_pct; },
       fmt: function (v) { return v.toFixed(2) + "%"; }}
    ]
  });
}
function kv(host, pairs) {
  var dl = el("dl", {cls: "kv"});
  pairs.forEach(function (p) {
    var v = p[1];
    if (v !== null && typeof v === "object") v = JSON.stringify(v);
    dl.appendChild(el("dt", {text: p[0]}));
    dl.appendChild(el("dd", {cls: "mono", text: v === null || v === undefined ? "-" : String(v)}));
  });
  host.appendChild(dl);
}
function solver(host) {
  var s = S.solver, pairs = [["method", s.method], ["status", s.status],
    ["objective", s.objective === null ? null : fmtCost(s.objective)],
    ["lower bound", s.lower_bound === null ? null : fmtCost(s.lower_bound)],
    ["gap", s.gap === null ? null : (100 * s.gap).toFixed(2) + "%"],
    ["wall time", s.wall_s === null ? null : s.wall_s.toFixed(2) + " s"], ["seed", s.seed]];
  var st = DATA.solver_stats || {};
  Object.keys(st).forEach(function (k) { pairs.push([k.replace(/_/g, " "), st[k]]); });
  (s.notes || []).forEach(function (n, i) { pairs.push([i ? "" : "notes", n]); });
  kv(host, pairs);
}
function trace(host) {
  var t = S.trace, r = S.resimulated;
  var pairs = [["name", t.name], ["path in plan", t.path], ["read from", t.read_from], ["state", t.state],
    ["ops", t.num_ops], ["content hash", t.content_hash], ["signature", t.signature], ["workload", t.workload]];
  if (r) pairs.push(["re-simulated", fmtBytes(r.peak_bytes) + " peak at op " + r.peak_op + ", extra " +
    fmtCost(r.extra_compute) + (r.agrees ? " (agrees with the plan)" : " (DIFFERS from the plan)")]);
  if (S.schedule_peak_bytes !== null) pairs.push(["schedule peak", fmtBytes(S.schedule_peak_bytes) + " (" + exact(S.schedule_peak_bytes) + ")"]);
  kv(host, pairs);
}

if (DATA.timeline) drawTimeline(document.getElementById("timeline"), DATA.timeline);
decisions(document.getElementById("decisions"));
partitions(document.getElementById("partitions"));
modules(document.getElementById("modules"));
solver(document.getElementById("solver"));
trace(document.getElementById("trace"));
})();
