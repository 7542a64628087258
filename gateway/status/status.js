// Sluice status page: fetches admin/state every few seconds and renders it. Colour first,
// worst first, a unit on every number. Sections are rendered from the document's shape (see
// gateway/status/__init__.py), so a feature that adds a section shows without changes here.
// Text goes in with textContent only: nothing from the document is parsed as HTML.
"use strict";

const RANK = { grey: 0, green: 0, yellow: 1, red: 2 };
const ORDER = ["ratelimit", "budgets", "limits", "admission", "fleet", "backends", "rejections",
  "rollout", "traffic", "datapath", "policy", "routes"];
const SKIP = new Set(["now", "colour", "reasons", "history", "gateway", "series"]);
const params = new URLSearchParams(location.search);
const REFRESH_S = Math.max(1, Number(params.get("refresh")) || 2);
let lastOk = 0;
let lastDoc = null;

const rank = (c) => (c in RANK ? RANK[c] : 1);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function badge(colour) {
  return el("span", { class: `badge c-${colour in RANK ? colour : "yellow"}` }, colour);
}

function ago(t) {
  const s = Math.max(0, Date.now() / 1000 - t);
  return `${duration(s)} ago`;
}

function duration(s) {
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s < 10 ? s.toFixed(1) : Math.round(s)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

const COUNT_UNITS = [
  [/in_flight|waiting|requests|rejected|rejections|recent|total|^count$/, "req"],
  [/reloads$/, "reloads"],
  [/members$/, "members"],
  [/connections|^idle$/, "conn"],
  [/errors?$/, "err"],
  [/tokens$/, "tok"],
  [/sources|flows/, ""],
];

const UNIT_KEYS = /^(t|at)$|_at$|_ms$|_s$|_bytes$|_pct$|util|pressure|^load$|_ratio$|_fraction$|qps|_rps$|per_s(econd)?$|port|pid|weight|version/;
const hasUnit = (k) => UNIT_KEYS.test(k) || COUNT_UNITS.some(([re, u]) => u && re.test(k));

// One value as text, its unit read from its key (gateway/status: units live in key names).
function fmt(key, v) {
  if (v === null || v === undefined || v === "") return "—";
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (Array.isArray(v)) return v.map((x) => fmt(key, x)).join(", ") || "—";
  if (typeof v === "object") {
    // {reason: count} under "rejections": the parent's unit when the child key has none
    return Object.entries(v).map(([k, x]) => `${k}: ${fmt(hasUnit(k) ? k : key, x)}`).join(", ") || "—";
  }
  if (typeof v !== "number") return String(v);
  const k = String(key);
  if (k === "t" || k === "at" || k.endsWith("_at")) return ago(v);
  if (k.endsWith("_ms")) return `${v.toFixed(v < 10 ? 1 : 0)} ms`;
  if (k.endsWith("_s")) return duration(v);
  if (k.endsWith("_bytes")) return bytes(v);
  if (k.endsWith("_pct")) return `${v.toFixed(0)} %`;
  if (/util|pressure|^load$|_ratio$|_fraction$/.test(k)) return `${(v * 100).toFixed(0)} %`;
  if (/qps|_rps$|per_s(econd)?$/.test(k)) return `${v.toFixed(v < 10 ? 1 : 0)} /s`;
  if (/port|pid|weight|version|^priority$/.test(k)) return String(v);
  const n = Number.isInteger(v) ? String(v) : v.toFixed(2);
  for (const [re, unit] of COUNT_UNITS) if (re.test(k)) return unit ? `${n} ${unit}` : n;
  return n;
}

const isNum = (v) => typeof v === "number";
const isRows = (v) => Array.isArray(v) && v.length > 0 && v.every((x) => x && typeof x === "object" && !Array.isArray(x)) && !isHistory(v);
const worstFirst = (rows) => (Array.isArray(rows) ? [...rows] : []).sort((a, b) =>
  rank(b.colour) - rank(a.colour) ||
  (b.pressure ?? b.load ?? 0) - (a.pressure ?? a.load ?? 0));

// A cell: an object with a `state` (a breaker's snapshot) shows its state, the rest on hover.
function cell(c, v) {
  if (c === "colour" && v) return el("td", {}, badge(v));
  if (v && typeof v === "object" && !Array.isArray(v) && "state" in v) {
    return el("td", { title: fmt(c, v) }, fmt(c, v.state));
  }
  if (v && typeof v === "object") return el("td", { class: "obj", title: fmt(c, v) }, fmt(c, v));
  return el("td", { class: isNum(v) ? "num" : "" }, fmt(c, v));
}

function table(rows, skip) {
  const cols = [];
  const nested = new Set();
  for (const r of rows) {
    for (const [k, v] of Object.entries(r)) {
      if (isRows(v) || isHistory(v)) nested.add(k);
      else if (!cols.includes(k) && !(skip || []).includes(k)) cols.push(k);
    }
  }
  // colour first, then the name or address the row is about
  cols.sort((a, b) => prio(a) - prio(b));
  const head = el("tr", {}, ...cols.map((c) => el("th", {}, c.replaceAll("_", " "))));
  const sorted = worstFirst(rows);
  const body = sorted.map((r) => el("tr", { class: `row-${r.colour || "none"}` },
    ...cols.map((c) => cell(c, r[c]))));
  const out = el("div", {}, el("table", {}, el("thead", {}, head), el("tbody", {}, ...body)));
  for (const r of sorted) {  // a row's own lists (a rule's hottest keys) follow the table
    for (const k of nested) {
      if (isRows(r[k])) out.append(el("h3", {}, `${r.name || r.address || ""} ${k.replaceAll("_", " ")}`), table(r[k]));
      else if (isHistory(r[k])) out.append(el("div", { class: "muted" }, `${r.name || ""} ${k}`), strip(r[k]));
    }
  }
  return out;
}

function prio(k) {
  const first = ["colour", "name", "address", "healthy", "ejected", "breaker", "load", "in_flight",
    "stage"];
  const i = first.indexOf(k);
  return i < 0 ? first.length : i;
}

function kv(obj) {
  const rows = Object.entries(obj).filter(([, v]) => !isRows(v) && !isHistory(v) && !(v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length > 4));
  if (!rows.length) return null;
  return el("table", {}, el("tbody", {}, ...rows.map(([k, v]) =>
    el("tr", {}, el("th", {}, k.replaceAll("_", " ")),
      k === "colour" ? el("td", {}, badge(v)) : el("td", { class: isNum(v) ? "num" : "" }, fmt(k, v))))));
}

// A colour history: [{t, colour}] (t: Unix time), or [[seconds_ago, colour], ...].
const mark = (h) => Array.isArray(h) ? { colour: h[1], when: `${duration(h[0])} ago` }
  : { colour: h.colour, when: "t" in h ? ago(h.t) : `${duration(h.ago_s || 0)} ago` };
const isHistory = (v) => Array.isArray(v) && v.length > 0 && v.every((h) =>
  (Array.isArray(h) && h.length === 2 && typeof h[1] === "string") || (h && typeof h === "object" && "colour" in h && ("t" in h || "ago_s" in h) && Object.keys(h).length <= 3));

function strip(history) {
  const box = el("div", { class: "strip", style: "display:flex;gap:1px;height:12px;margin:4px 0" });
  for (const h of history.slice(-180).map(mark)) {
    box.append(el("span", { class: `c-${h.colour}`, style: "flex:0 0 5px", title: `${h.colour} ${h.when}` }));
  }
  return box;
}

function histories(h) {
  if (isHistory(h)) return [strip(h)];
  if (!h || typeof h !== "object" || Array.isArray(h)) return [];
  return Object.entries(h).filter(([, v]) => isHistory(v)).flatMap(([k, v]) =>
    [el("div", { class: "muted" }, `${k.replaceAll("_", " ")} colour history`), strip(v)]);
}

// A section from its shape: badge for `colour`, history strip, tables for lists of dicts,
// key/value for the rest; nested dicts become sub-sections.
function generic(value, depth) {
  const out = [];
  if (isRows(value)) return [table(value)];
  if (!value || typeof value !== "object") return [el("p", {}, fmt("", value))];
  const plain = kv(Object.fromEntries(Object.entries(value).filter(([k]) => k !== "history" && k !== "colour")));
  out.push(...histories(value.history));
  if (plain) out.push(plain);
  for (const [k, v] of Object.entries(value)) {
    if (k === "history") continue;
    if (isRows(v)) out.push(el("h3", {}, k.replaceAll("_", " ")), table(v));
    else if (v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length > 4 && depth < 2) {
      out.push(el("h3", {}, k.replaceAll("_", " ")), ...generic(v, depth + 1));
    }
  }
  return out;
}

function backends(value) {
  if (!Array.isArray(value.backends)) return generic(value, 0);
  const out = [];
  for (const b of worstFirst(value.backends || [])) {
    const errs = Object.entries(b.errors || {}).map(([k, n]) => `${k} ${n}`).join(", ");
    out.push(el("h3", { "data-backend": b.name }, badge(b.colour || "grey"), b.name,
      el("span", { class: "muted" }, `${b.protocol || ""} · ${fmt("members", (b.members || []).length)}`),
      b.recent_errors ? el("span", { class: "err" }, `${fmt("errors", b.recent_errors)} in the last ${duration(recentWindow())}`) : null,
      errs ? el("span", { class: "muted" }, `since start: ${errs}`) : null));
    if (isRows(b.members)) out.push(table(b.members));
    const rest = Object.fromEntries(Object.entries(b).filter(([k]) => !["name", "protocol", "colour", "members", "errors", "recent_errors"].includes(k)));
    const extra = kv(rest);
    if (extra) out.push(extra);
  }
  const rest = Object.fromEntries(Object.entries(value).filter(([k]) => k !== "backends"));
  if (Object.keys(rest).length) out.push(...generic(rest, 1));
  return out;
}

function rejections(value) {
  const reasons = new Set([...Object.keys(value.recent || {}), ...Object.keys(value.total || {})]);
  if (!reasons.size) return [el("p", { class: "muted" }, "no request rejected since start")];
  const rows = [...reasons].map((r) => ({ reason: r, recent: (value.recent || {})[r] || 0, total: (value.total || {})[r] || 0 }))
    .sort((a, b) => b.recent - a.recent || b.total - a.total);
  const head = el("tr", {}, el("th", {}, "reason"), el("th", {}, `last ${duration(value.window_s || 0)}`), el("th", {}, "since start"));
  return [el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows.map((r) =>
    el("tr", {}, el("td", {}, r.reason), el("td", { class: "num" }, fmt("recent", r.recent)), el("td", { class: "num" }, fmt("total", r.total))))))];
}

const recentWindow = () => (lastDoc && lastDoc.rejections && lastDoc.rejections.window_s) || 300;

// A feature that is switched off says so in one line.
const off = (v) => v && typeof v === "object" && v.state === "off";

const RENDER = { backends, rejections };

// -- charts: the last 15 minutes of `series` (gateway/status/series.py), inline SVG ----------
const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#1b7c83", "#d4a72c", "#6e7781"];
const CW = 420, CH = 120, PAD = 50;

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

// One chart: lines {name: [value|null]} over the times `t` (Unix s) up to `now`.
// The time axis spans what was sampled, from one minute up to 15.
function chart(id, title, unit, t, lines, now, max) {
  const span = Math.min(900, Math.max(60, now - (t[0] || now)));
  const names = Object.keys(lines).filter((n) => lines[n].some((v) => v !== null));
  let top = max || 0;
  for (const n of names) for (const v of lines[n]) if (v !== null && v > top) top = v;
  top = top > 0 ? top : 1;
  const x = (ts) => PAD + (CW - PAD - 6) * (1 - Math.min(span, Math.max(0, now - ts)) / span);
  const y = (v) => 6 + (CH - 24) * (1 - v / top);
  const box = svg("svg", { viewBox: `0 0 ${CW} ${CH}`, width: CW, height: CH, role: "img",
    "aria-label": title });
  box.append(svg("line", { x1: PAD, y1: y(0), x2: CW - 6, y2: y(0), stroke: "#d0d7de" }));
  box.append(svg("line", { x1: PAD, y1: y(top), x2: CW - 6, y2: y(top), stroke: "#eaeef2" }));
  const label = (text, ax, ay, anchor) => {
    const e = svg("text", { x: ax, y: ay, "font-size": 10, fill: "#57606a", "text-anchor": anchor });
    e.textContent = text;
    box.append(e);
  };
  label(unit === "%" ? `${Math.round(top * 100)} %` : `${+top.toFixed(top < 10 ? 1 : 0)} ${unit}`, PAD - 3, y(top) + 3, "end");
  label("0", PAD - 3, y(0) + 3, "end");
  label(`-${duration(span)}`, PAD, CH - 4, "start");
  label("now", CW - 6, CH - 4, "end");
  const legend = el("div", { class: "legend" });
  names.forEach((n, i) => {
    const colour = PALETTE[i % PALETTE.length];
    const vs = lines[n];
    let run = [];
    const runs = [];
    vs.forEach((v, j) => {
      if (v === null || t[j] === undefined) { if (run.length) runs.push(run); run = []; }
      else run.push([x(t[j]), y(v)]);
    });
    if (run.length) runs.push(run);
    for (const pts of runs) {
      if (pts.length === 1) pts.push([pts[0][0] + 3, pts[0][1]]);  // a lone point: a short dash
      const r = pts.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`);
      box.append(svg("polyline", { points: r.join(" "), fill: "none", stroke: colour,
        "stroke-width": 1.6, "data-series": n }));
    }
    const last = [...vs].reverse().find((v) => v !== null);
    legend.append(el("span", {}, el("i", { style: `background:${colour}` }), `${n} `,
      el("b", {}, unit === "%" ? `${Math.round(last * 100)} %` : `${+last.toFixed(1)} ${unit}`)));
  });
  const fig = el("figure", { "data-chart": id }, el("figcaption", {}, title), box, legend);
  if (!names.length) fig.append(el("div", { class: "muted" }, "nothing measured yet"));
  return fig;
}

function charts(series, now) {
  if (!series || !Array.isArray(series.t) || !series.t.length) return null;
  const t = series.t;
  const per = (key) => Object.fromEntries(Object.entries(series.backends || {}).map(([b, ls]) => [b, ls[key] || []]));
  const figs = [
    chart("rps", "requests per second, per backend", "/s", t, per("rps"), now),
    chart("p99", "p99 latency, per backend", "ms", t, per("p99_ms"), now),
    chart("ttft", "p99 time to first token, per backend", "ms", t, per("ttft_p99_ms"), now),
  ];
  if (series.queues && Object.keys(series.queues).length) {
    figs.push(chart("queue", "admission queue length, per pool", "req", t, series.queues, now));
  }
  if (series.tenants && Object.keys(series.tenants).length) {
    figs.push(chart("share", "share of the tokens served, per tenant", "%", t, series.tenants, now, 1));
  }
  return el("section", { id: "s-charts" }, el("h2", {}, "last 15 minutes"),
    el("div", { class: "charts" }, ...figs));
}

function render(doc) {
  const colour = doc.colour || "grey";
  const banner = document.getElementById("banner");
  banner.className = `c-${colour in RANK ? colour : "yellow"}`;
  banner.dataset.colour = colour;
  document.getElementById("colour").textContent = colour.toUpperCase();
  const gw = doc.gateway || {};
  const pol = doc.policy || {};
  const stage = doc.rollout && doc.rollout.stage ? ` (rollout: ${doc.rollout.stage})` : "";
  const ports = (gw.listeners || []).map((l) => `${l.name} ${l.host ? l.host + ":" : ""}${l.port}`).join(" · ");
  document.getElementById("summary").textContent =
    `${gw.state || "?"} · ${fmt("in_flight", gw.in_flight)} in flight · policy ${pol.version || "?"}${stage}` +
    ` · up ${fmt("uptime_s", gw.uptime_s)} · pid ${gw.pid || "?"} · ${ports}`;
  const reasons = document.getElementById("reasons");
  reasons.replaceChildren(...(doc.reasons || []).map((r) => el("li", {}, r)));
  document.getElementById("history").replaceChildren(...(doc.history || []).slice(-180).map((h) =>
    el("span", { class: `c-${h.colour}`, title: `${h.colour} ${ago(h.t)}` })));
  document.title = `${colour.toUpperCase()} · Sluice`;

  const keys = Object.keys(doc).filter((k) => !SKIP.has(k));
  keys.sort((a, b) => (ORDER.indexOf(a) + 1 || 99) - (ORDER.indexOf(b) + 1 || 99));
  keys.push("gateway");
  const sections = keys.filter((k) => doc[k] !== undefined && doc[k] !== null).map((k) => {
    const v = doc[k];
    const c = v && typeof v === "object" && !Array.isArray(v) ? v.colour : undefined;
    const body = off(v) ? [el("p", { class: "muted" }, "off")] : (RENDER[k] || ((x) => generic(x, 0)))(v);
    return el("section", { id: `s-${k}` }, el("h2", {}, c ? badge(c) : null, k.replaceAll("_", " ")), ...body);
  });
  const drawn = charts(doc.series, doc.now || Date.now() / 1000);
  document.getElementById("sections").replaceChildren(...(drawn ? [drawn] : []), ...sections);
}

async function tick() {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 5000);
  try {
    const r = await fetch("admin/state", { cache: "no-store", signal: ctl.signal });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    lastDoc = await r.json();
    lastOk = Date.now();
    render(lastDoc);
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    const banner = document.getElementById("banner");
    banner.className = "c-grey";
    banner.dataset.colour = "grey";
    document.getElementById("colour").textContent = "NO ANSWER";
    document.getElementById("reasons").replaceChildren(el("li", {},
      lastOk ? `the gateway has not answered for ${duration((Date.now() - lastOk) / 1000)} (${e.message}); below: its last answer` : `no answer from the gateway (${e.message})`));
  } finally {
    clearTimeout(timer);
    setTimeout(tick, REFRESH_S * 1000);
  }
}

document.getElementById("refresh").textContent = REFRESH_S;
tick();
