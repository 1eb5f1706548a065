// The status page: reads GET status/events (server-sent events, one `snapshot` frame per
// change) and renders each snapshot. Everything is written with textContent: names come from
// the config and from clients' addresses, never as markup.
//
// The stream is read with fetch, not EventSource, because EventSource cannot send a header:
// with `protect_metrics` the key goes as `x-api-key`, kept in this tab's sessionStorage, and
// never in a URL (URLs end up in proxies' logs and the browser's history).
"use strict";

const KEY_ITEM = "homelab-gateway-status-key";
const CLASSES = ["interactive", "normal", "batch"];
const RETRY_FIRST = 1000;
const RETRY_MAX = 15000;

let retryDelay = RETRY_FIRST;

function $(id) {
  return document.getElementById(id);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  if (value < 1) return value.toFixed(2) + " s";
  if (value < 60) return value.toFixed(1) + " s";
  const s = Math.floor(value);
  if (s < 3600) return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h " + String(Math.floor(s / 60) % 60).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d " + (Math.floor(s / 3600) % 24) + "h";
}

function when(value) {
  // A moment as epoch seconds or an ISO 8601 string, in the viewer's local time.
  const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  return isNaN(date) ? String(value) : date.toLocaleTimeString();
}

function number(value) {
  return value === null || value === undefined ? "–" : String(value);
}

function setState(state, text) {
  const node = $("connection");
  node.dataset.state = state;
  node.textContent = text || state;
}

// --- rendering --------------------------------------------------------------------------

function lineBlock(entry) {
  // The line of an upstream (or a model): counts only, never one row per waiter.
  const block = el("div", { class: "line" });
  const waiting = entry.waiting || 0;
  block.append(
    el("div", {},
      "waiting ", el("b", { class: "waiting" }, waiting),
      entry.longest_wait_s != null ? ", longest " : "",
      entry.longest_wait_s != null ? el("b", { class: "longest" }, seconds(entry.longest_wait_s)) : ""),
  );
  const byClass = entry.waiting_by_class;
  if (byClass && waiting) {
    const classes = el("div", { class: "classes" });
    for (const name of CLASSES) {
      if (name in byClass) classes.append(el("span", { "data-class": name }, name, " ", el("b", {}, byClass[name])));
    }
    block.append(classes);
  }
  const byClient = entry.waiting_by_client;
  if (Array.isArray(byClient) && byClient.length) {
    const body = el("tbody");
    for (const row of byClient) {
      const name = row.others !== undefined ? `${row.others} other clients` : row.client;
      body.append(el("tr", { "data-client": row.others !== undefined ? "" : row.client },
        el("td", {}, name), el("td", { class: "num" }, row.count)));
    }
    block.append(el("table", { class: "clients" },
      el("thead", {}, el("tr", {}, el("th", {}, "client"), el("th", { class: "num" }, "waiting"))), body));
  }
  return block;
}

function healthBadge(entry) {
  if (!entry.health) return null;
  return el("span", { class: "health", "data-health": entry.health }, entry.health);
}

function upstreamCard(name, entry) {
  const slots = entry.slots || 0;
  const inUse = entry.in_use || 0;
  const fill = el("div", { class: "fill" });
  fill.style.width = slots ? Math.min(100, (100 * inUse) / slots) + "%" : "0";
  const card = el("article", { class: "card upstream", "data-upstream": name },
    el("h3", {}, name), healthBadge(entry),
    entry.state ? el("span", { class: "state", "data-state": entry.state }, entry.state) : null,
    el("div", { class: "models" }, (entry.models || []).join(", ") || "no model"),
    el("div", {
      class: "bar", role: "meter", "aria-label": `${name} slots in use`,
      "aria-valuemin": 0, "aria-valuemax": slots, "aria-valuenow": inUse,
      "data-full": slots > 0 && inUse >= slots,
    }, fill),
    el("div", { class: "slots" },
      el("b", { class: "in-use" }, inUse), " / ", el("span", { class: "slot-count" }, slots), " slots in use"),
  );
  if (entry.health && entry.health !== "up" && (entry.down_since || entry.last_error)) {
    card.append(el("div", { class: "health-detail" },
      entry.last_error || "", entry.down_since ? ` (down since ${when(entry.down_since)})` : ""));
  }
  card.append(lineBlock(entry));
  return card;
}

function boxCard(name, box) {
  // A box's accelerator memory: what its models hold (loaded, loading, unloading), and which
  // are loaded now.
  const fill = el("div", { class: "fill" });
  fill.style.width = box.memory ? Math.min(100, (100 * box.used) / box.memory) + "%" : "0";
  return el("article", { class: "card box", "data-box": name },
    el("h3", {}, name),
    el("div", { class: "bar", role: "meter", "aria-label": `${name} memory in use`,
      "aria-valuemin": 0, "aria-valuemax": box.memory, "aria-valuenow": box.used }, fill),
    el("div", { class: "slots" }, el("b", { class: "used" }, number(box.used)), " / ",
      number(box.memory), " memory held"),
    el("div", { class: "models loaded" },
      box.loaded.length ? "loaded: " + box.loaded.join(", ") : "nothing loaded"));
}

function modelCard(name, entry) {
  const card = el("article", { class: "card model", "data-model": name }, el("h3", {}, name));
  if (entry && typeof entry === "object") {
    // Models served by the same upstreams share one line: say which, so equal counts read
    // as one line, not as two.
    if (entry.upstreams) card.append(el("div", { class: "models" }, "on " + entry.upstreams.join(", ")));
    if (entry.line) card.append(el("div", { class: "models" }, "line " + entry.line));
    card.append(lineBlock(entry));
  }
  return card;
}

function outcomeClass(outcome) {
  return outcome === "completed" ? "outcome-completed" : "outcome-bad";
}

function renderInFlight(rows, total) {
  const body = $("in-flight").tBodies[0];
  body.replaceChildren(...rows.map((r) => el("tr", { "data-request": r.request_id },
    el("td", {}, r.model || "-"), el("td", {}, r.surface), el("td", {}, r.client), el("td", {}, r.class),
    el("td", {}, r.upstream), el("td", { class: "num" }, seconds(r.elapsed_s)),
    el("td", { class: "num" }, seconds(r.queue_wait_s)), el("td", { class: "num" }, seconds(r.ttft_s)),
    el("td", { class: "num tokens" }, r.output_tokens), el("td", { class: "num" }, number(r.tokens_per_s)))));
  if (!rows.length) body.append(el("tr", {}, el("td", { class: "empty", colspan: 10 }, "nothing in flight")));
  $("in-flight-count").textContent = total;
  const more = $("in-flight-more");
  more.hidden = total <= rows.length;
  more.textContent = `and ${total - rows.length} more`;
}

function renderFinished(rows, now) {
  const body = $("finished").tBodies[0];
  body.replaceChildren(...rows.map((r) => el("tr", { "data-request": r.request_id },
    el("td", {}, seconds(now - r.ended) + " ago"), el("td", {}, r.model || "-"), el("td", {}, r.surface),
    el("td", {}, r.client),
    el("td", { class: outcomeClass(r.outcome) }, r.outcome), el("td", { class: "num" }, number(r.status)),
    el("td", { class: "num" }, seconds(r.queue_wait_s)), el("td", { class: "num" }, seconds(r.ttft_s)),
    el("td", { class: "num" }, `${number(r.input_tokens)} / ${number(r.output_tokens)}`),
    el("td", { class: "num" }, number(r.tokens_per_s)), el("td", { class: "num" }, seconds(r.duration_s)))));
  if (!rows.length) body.append(el("tr", {}, el("td", { class: "empty", colspan: 11 }, "nothing yet")));
}

function renderClients(clients) {
  // The clients with a max_in_flight or a tokens_per_day: what they hold, what they used.
  const rows = Object.entries(clients || {});
  $("client-section").hidden = !rows.length;
  $("clients").tBodies[0].replaceChildren(...rows.map(([name, c]) => {
    const held = c.in_flight ? Object.values(c.in_flight).reduce((a, b) => Math.max(a, b), 0) : null;
    return el("tr", { "data-client": name },
      el("td", {}, name), el("td", { class: "num held" }, number(held)),
      el("td", { class: "num" }, number(c.max_in_flight)),
      el("td", { class: "num used" }, number(c.tokens_used)),
      el("td", { class: "num" }, number(c.tokens_per_day)));
  }));
}

function render(snapshot) {
  $("version").textContent = snapshot.version;
  $("uptime").textContent = seconds(snapshot.uptime_s);
  const cluster = snapshot.cluster;
  $("cluster").hidden = !cluster;
  if (cluster) {
    $("cluster").textContent = `shared line: ${cluster.instance}, Redis ${cluster.redis}` +
      (cluster.redis === "up" ? "" : ` (${cluster.last_error || "unreachable"})`);
    $("cluster").dataset.state = cluster.redis;
  }
  // Each gateway keeps its own ledger: the days (and /llm/v1/usage) are this one's requests.
  $("days-note").hidden = !cluster;
  $("days-note").textContent = cluster
    ? `Requests through this gateway (${cluster.instance}) only: each gateway of the cluster ` +
      "keeps its own usage ledger." : "";
  $("upstreams").replaceChildren(
    ...Object.entries(snapshot.upstreams || {}).map(([name, entry]) => upstreamCard(name, entry)));
  const boxes = snapshot.boxes || {};
  $("box-section").hidden = !Object.keys(boxes).length;
  $("boxes").replaceChildren(...Object.entries(boxes).map(([name, box]) => boxCard(name, box)));
  const models = snapshot.models;
  $("model-section").hidden = !models || !Object.keys(models).length;
  if (models) $("models").replaceChildren(...Object.entries(models).map(([n, e]) => modelCard(n, e)));
  live = liveCounts(snapshot.upstreams);
  slotsLegend();
  renderClients(snapshot.clients);
  renderInFlight(snapshot.in_flight || [], snapshot.in_flight_total || 0);
  renderFinished(snapshot.finished || [], snapshot.now);
}

// --- charts -----------------------------------------------------------------------------
// Drawn as inline SVG from the gateway's own samples: a stream's first snapshot carries the
// last hour (`history`), each `sample` event adds one, each `usage` event redraws the days.
// A line chart's points are in the data's own units (x: seconds before the newest sample,
// y: the value), mapped onto the plot by one transform, so the SVG holds the real numbers.

const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT = { width: 480, height: 150, left: 42, right: 10, top: 8, bottom: 20 };
const DAYS_PLOT = { width: 960, height: 180, left: 48, right: 10, top: 8, bottom: 20 };
const compact = new Intl.NumberFormat(undefined, { notation: "compact", maximumFractionDigits: 1 });
const hours = { interval: 10, size: 360, samples: [], fields: null };
let lastUsage = null;
let live = null; // slots, in use and waiting as the newest snapshot says: the slots legend

function liveCounts(upstreams) {
  // As a sample counts them: every upstream's slots and those in use, each line's waiters once.
  const entries = Object.values(upstreams || {});
  const lines = new Map(entries.map((e) => [e.line, e.waiting || 0]));
  return {
    slots: entries.reduce((sum, e) => sum + (e.slots || 0), 0),
    in_use: entries.reduce((sum, e) => sum + (e.in_use || 0), 0),
    waiting: [...lines.values()].reduce((sum, n) => sum + n, 0),
  };
}

function slotsLegend() {
  // Live, not the newest sample's: a sample may be minutes old, taken while slots were busy.
  const now = live || { slots: 0, in_use: 0, waiting: 0 };
  legend($("chart-slots"), [
    ["in-use", "in use", `${now.in_use} / ${now.slots}`], ["waiting", "waiting", now.waiting],
    ["slots", "slots", now.slots],
  ]);
}

function sized(svg, plot) {
  // The plot as wide as the SVG is drawn, so that its text is the page's size at any width.
  const width = Math.max(240, Math.round(svg.getBoundingClientRect().width)) || plot.width;
  svg.setAttribute("viewBox", `0 0 ${width} ${plot.height}`);
  return { ...plot, width };
}

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function niceMax(value) {
  // The smallest 1, 2 or 5 times a power of ten at or above `value`: round axis labels.
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((top) => top >= value * (1 - 1e-9));
}

function ago(seconds) {
  if (seconds <= 0) return "now";
  return seconds >= 120 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds)} s ago`;
}

function yAxis(plot, top, format) {
  const grid = svgEl("g", { class: "grid" });
  const inner = plot.height - plot.top - plot.bottom;
  for (const share of [0, 0.5, 1]) {
    const y = plot.top + inner * (1 - share);
    grid.append(svgEl("line", { x1: plot.left, x2: plot.width - plot.right, y1: y, y2: y }),
      svgEl("text", { x: plot.left - 5, y: y + 3.5, "text-anchor": "end" }, format(top * share)));
  }
  return grid;
}

function legend(figure, items) {
  // items: [class, label, value]; the value as text, never markup.
  figure.querySelector(".legend").replaceChildren(...items.map(([cls, label, value]) =>
    el("span", {}, el("span", { class: `swatch ${cls}` }), label, " ", el("b", {}, value))));
}

function lineChart(id, series, floor, format) {
  // series: [{name, cls, points: [[x, y], ...]}], x from -span to 0; `floor`: the least top.
  const figure = $(id);
  const svg = figure.querySelector("svg");
  const plot = sized(svg, PLOT);
  const span = hours.size * hours.interval;
  const values = series.flatMap((s) => s.points.map(([, y]) => y));
  const top = niceMax(Math.max(floor, ...values));
  const width = plot.width - plot.left - plot.right;
  const height = plot.height - plot.top - plot.bottom;
  const ticks = svgEl("g", { class: "grid" });
  for (const [share, anchor] of [[0, "start"], [0.5, "middle"], [1, "end"]]) {
    ticks.append(svgEl("text", { x: plot.left + width * share, y: plot.height - 5, "text-anchor": anchor },
      ago(span * (1 - share))));
  }
  const area = svgEl("g", {
    class: "plot",
    transform: `translate(${plot.left} ${plot.top + height}) scale(${width / span} ${-height / top}) translate(${span} 0)`,
  });
  for (const s of series) {
    const points = s.points.map(([x, y]) => `${x},${y}`).join(" ");
    if (s.fill && s.points.length) {
      const first = s.points[0][0];
      const last = s.points[s.points.length - 1][0];
      area.append(svgEl("polygon", { class: "area", points: `${first},0 ${points} ${last},0` }));
    }
    area.append(svgEl("polyline", {
      class: `series ${s.cls}`, "data-series": s.name, points, "vector-effect": "non-scaling-stroke",
    }));
  }
  const children = [yAxis(plot, top, format), ticks, area];
  if (!values.length) {
    children.push(svgEl("text", { class: "empty", x: plot.width / 2, y: plot.height / 2, "text-anchor": "middle" },
      "no samples yet"));
  }
  svg.replaceChildren(...children);
}

function drawHistory() {
  const samples = hours.samples;
  const newest = samples.length ? samples[samples.length - 1] : null;
  const span = hours.size * hours.interval;
  const shown = newest ? samples.filter((s) => newest.at - s.at <= span) : [];
  const series = (field) => shown.map((s) => [Number((s.at - newest.at).toFixed(3)), s[field]]);
  $("history-span").textContent = `one sample every ${seconds(hours.interval)}`;
  lineChart("chart-slots", [
    { name: "slots", cls: "slots", points: series("slots") },
    { name: "in_use", cls: "in-use", points: series("in_use"), fill: true },
    { name: "waiting", cls: "waiting", points: series("waiting") },
  ], 2, (v) => String(Math.round(v)));
  lineChart("chart-output", [{ name: "output_per_s", cls: "output", points: series("output_per_s") }],
    1, (v) => compact.format(v));
  lineChart("chart-input", [{ name: "input_per_s", cls: "input", points: series("input_per_s") }],
    1, (v) => compact.format(v));
  for (const id of ["chart-slots", "chart-output", "chart-input"]) {
    $(id).querySelector("svg").dataset.newest = newest ? newest.at : ""; // where x = 0 is
  }
  slotsLegend();
  // A rate is a sample's alone: say when it was taken.
  const last = newest ? `sample at ${when(newest.at)}` : "no sample yet";
  const rate = (field) => compact.format(newest ? newest[field] : 0);
  const peak = (field) => compact.format(Math.max(0, ...shown.map((s) => s[field])));
  legend($("chart-output"), [["output", last, rate("output_per_s")], ["output", "peak", peak("output_per_s")]]);
  legend($("chart-input"), [["input", last, rate("input_per_s")], ["input", "peak", peak("input_per_s")]]);
}

function receiveHistory(ring) {
  hours.interval = ring.interval;
  hours.size = ring.size;
  hours.fields = ring.fields;
  hours.samples = ring.samples.map((row) => Object.fromEntries(ring.fields.map((f, i) => [f, row[i]])));
  drawHistory();
}

function receiveSample(row) {
  if (!hours.fields) return; // before the first snapshot: it brings the whole hour
  hours.samples.push(Object.fromEntries(hours.fields.map((f, i) => [f, row[i]])));
  if (hours.samples.length > hours.size) hours.samples.splice(0, hours.samples.length - hours.size);
  drawHistory();
}

function drawDays(usage) {
  // Stacked bars: each day's tokens (input + output) by client, the title of each its numbers.
  lastUsage = usage;
  const figure = $("chart-days");
  const svg = figure.querySelector("svg");
  const plot = sized(svg, DAYS_PLOT);
  const days = usage.days;
  const rows = usage.clients.map((row, i) => ({
    name: row.others !== undefined ? `${row.others} other clients` : row.client,
    client: row.others !== undefined ? "" : row.client,
    cls: row.others !== undefined ? "c8" : `c${i % 8}`,
    input: row.input_tokens,
    output: row.output_tokens,
  }));
  const totals = days.map((_, d) => rows.reduce((sum, r) => sum + r.input[d] + r.output[d], 0));
  const top = niceMax(Math.max(10, ...totals));
  const width = plot.width - plot.left - plot.right;
  const height = plot.height - plot.top - plot.bottom;
  const step = width / days.length;
  const bars = svgEl("g", { class: "bars" });
  const labels = svgEl("g", { class: "grid" });
  days.forEach((day, d) => {
    let base = plot.top + height;
    for (const r of rows) {
      const tokens = r.input[d] + r.output[d];
      if (!tokens) continue;
      const tall = (tokens / top) * height;
      base -= tall;
      bars.append(svgEl("rect", {
        class: r.cls, x: plot.left + d * step + step * 0.15, y: base, width: step * 0.7, height: tall,
        "data-client": r.client, "data-day": day, "data-tokens": tokens,
      }, svgEl("title", {}, `${r.name}, ${day}: ${tokens.toLocaleString()} tokens ` +
        `(${r.input[d].toLocaleString()} in, ${r.output[d].toLocaleString()} out)`)));
    }
    labels.append(svgEl("text", { x: plot.left + (d + 0.5) * step, y: plot.height - 5, "text-anchor": "middle" },
      day.slice(5)));
  });
  const children = [yAxis(plot, top, (v) => compact.format(v)), labels, bars];
  if (!rows.length) {
    children.push(svgEl("text", { class: "empty", x: plot.width / 2, y: plot.height / 2, "text-anchor": "middle" },
      "no tokens counted in these days"));
  }
  svg.replaceChildren(...children);
  legend(figure, rows.map((r) => [r.cls, r.name,
    compact.format(r.input.reduce((a, b) => a + b, 0) + r.output.reduce((a, b) => a + b, 0))]));
}

// --- the event stream -------------------------------------------------------------------

function dispatch(block) {
  // One SSE event (the lines between two blank lines), as the EventSource parser reads it.
  let event = "message";
  const data = [];
  for (const line of block.split(/\r\n|\r|\n/)) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return;
  const payload = JSON.parse(data.join("\n"));
  if (event === "snapshot") {
    render(payload);
    if (payload.history) receiveHistory(payload.history);
  } else if (event === "sample") receiveSample(payload.sample);
  else if (event === "usage") drawDays(payload);
}

function retry() {
  setState("reconnecting", `reconnecting in ${Math.round(retryDelay / 1000)} s`);
  setTimeout(connect, retryDelay);
  retryDelay = Math.min(RETRY_MAX, retryDelay * 2);
}

function askForKey(rejected) {
  setState("key", "key needed");
  $("key-message").textContent = rejected
    ? "That key was not accepted. Try another."
    : "This gateway protects its status with an API key.";
  $("key-form").hidden = false;
  $("content").hidden = true;
  $("forget-key").hidden = true;
  $("key").focus();
}

async function connect() {
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = { accept: "text/event-stream" };
  if (key) headers["x-api-key"] = key;
  let response;
  try {
    response = await fetch("status/events", { headers, cache: "no-store", credentials: "omit" });
  } catch (error) {
    retry();
    return;
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY_ITEM);
    askForKey(Boolean(key));
    return;
  }
  if (!response.ok || !response.body) {
    retry();
    return;
  }
  $("key-form").hidden = true;
  $("content").hidden = false;
  $("forget-key").hidden = !key;
  setState("live");
  retryDelay = RETRY_FIRST;
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.search(/\r\n\r\n|\n\n|\r\r/)) >= 0) {
        const separator = buffer.startsWith("\r\n\r\n", end) ? 4 : 2;
        dispatch(buffer.slice(0, end));
        buffer = buffer.slice(end + separator);
      }
    }
  } catch (error) {
    // The connection broke (the gateway restarted, the network went): reconnect below.
  }
  retry();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    $("key").value = "";
    connect();
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    location.reload();
  });
  window.addEventListener("resize", () => {
    if (hours.fields) drawHistory();
    if (lastUsage) drawDays(lastUsage);
  });
  connect();
});
