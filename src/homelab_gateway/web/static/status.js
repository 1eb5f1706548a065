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
  $("upstreams").replaceChildren(
    ...Object.entries(snapshot.upstreams || {}).map(([name, entry]) => upstreamCard(name, entry)));
  const models = snapshot.models;
  $("model-section").hidden = !models || !Object.keys(models).length;
  if (models) $("models").replaceChildren(...Object.entries(models).map(([n, e]) => modelCard(n, e)));
  renderInFlight(snapshot.in_flight || [], snapshot.in_flight_total || 0);
  renderFinished(snapshot.finished || [], snapshot.now);
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
  if (event === "snapshot" && data.length) render(JSON.parse(data.join("\n")));
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
  connect();
});
