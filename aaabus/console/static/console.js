// The aaabus console page: follows /api/events (Server-Sent Events) and draws what comes.
// Plain JavaScript and SVG, no library, no build step: what the wheel ships is what runs.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let session = { operate: false, token: null };
let layout = null; // the graph's positions: they depend on the config only, computed once
let latest = null;

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}

function size(bytes) {
  if (bytes == null) return "";
  const units = ["B", "kB", "MB", "GB"];
  let n = bytes, i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function duration(s) {
  if (s == null) return "";
  if (s < 120) return `${Math.round(s)}s`;
  if (s < 7200) return `${Math.round(s / 60)}m`;
  return `${(s / 3600).toFixed(1)}h`;
}

function el(tag, attrs, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// -- the domain graph --------------------------------------------------------------------------

function computeLayout(graph, servers) {
  // Domains on an ellipse (from the left, clockwise), each domain's servers on a small ring
  // around it, a router at the middle of its domains: readable from 2 domains to ~20.
  const W = 1000, H = 420, cx = W / 2, cy = H / 2;
  const domains = graph.domains;
  const hubs = {};
  const many = domains.length > 1;
  const rx = many ? W / 2 - 130 : 0, ry = many && domains.length > 2 ? H / 2 - 95 : 0;
  domains.forEach((d, i) => {
    const a = (2 * Math.PI * i) / domains.length + Math.PI;
    hubs[d.name] = { x: cx + rx * Math.cos(a), y: cy + ry * Math.sin(a) };
  });
  const pos = {};
  const byId = Object.fromEntries(servers.map((s) => [s.id, s]));
  for (const d of domains) {
    const members = d.servers.filter((id) => byId[id] && !byId[id].router);
    const r = Math.max(55, Math.min(110, 8 * members.length));
    members.forEach((id, i) => {
      // From the top, so that two members sit above and below their domain, off its lines.
      const a = (2 * Math.PI * i) / Math.max(1, members.length) - Math.PI / 2;
      pos[id] = { x: hubs[d.name].x + r * Math.cos(a), y: hubs[d.name].y + r * 0.6 * Math.sin(a) };
    });
  }
  for (const s of servers) {
    if (!s.router) continue;
    const hs = s.domains.map((d) => hubs[d]);
    pos[s.id] = {
      x: hs.reduce((t, h) => t + h.x, 0) / hs.length,
      y: hs.reduce((t, h) => t + h.y, 0) / hs.length,
    };
  }
  return { W, H, hubs, pos };
}

function drawGraph(state) {
  const svg = document.getElementById("graph");
  if (!layout) layout = computeLayout(state.graph, state.servers);
  svg.setAttribute("viewBox", `0 0 ${layout.W} ${layout.H}`);
  svg.replaceChildren();
  const small = state.servers.length > 60;
  for (const e of state.graph.edges) {
    const a = layout.pos[e.server], b = layout.hubs[e.domain];
    const cls = e.up == null ? "unknown" : e.up ? "up" : "down";
    el("line", { x1: a.x, y1: a.y, x2: b.x, y2: b.y, class: `edge ${cls}`,
      "data-edge": `${e.server}-${e.domain}` }, svg);
  }
  for (const [name, h] of Object.entries(layout.hubs)) {
    const g = el("g", { class: "hub", "data-domain": name }, svg);
    el("rect", { x: h.x - 24, y: h.y - 11, width: 48, height: 22, rx: 6 }, g);
    el("text", { x: h.x, y: h.y + 4, "text-anchor": "middle" }, g).textContent = name;
  }
  for (const s of state.servers) {
    const p = layout.pos[s.id];
    const g = el("g", { class: `srv ${s.state}`, "data-server": s.id, "data-state": s.state }, svg);
    const r = small ? 7 : 12;
    if (s.router) {
      const k = r + 4;
      el("polygon", { class: "node", "data-router": "true",
        points: `${p.x},${p.y - k} ${p.x + k},${p.y} ${p.x},${p.y + k} ${p.x - k},${p.y}` }, g);
    } else {
      el("circle", { class: "node", cx: p.x, cy: p.y, r }, g);
    }
    if (!small || s.router) {
      el("text", { x: p.x, y: p.y + 3.5, "text-anchor": "middle" }, g).textContent = s.id;
    }
    const tip = el("title", {}, g);
    tip.textContent = `${s.name} (server ${s.id}${s.router ? ", router" : ""}): ${s.state}` +
      (s.error ? ` - ${s.error}` : "");
  }
}

// -- tables ------------------------------------------------------------------------------------

function spark(history) {
  if (history.length < 2) return "";
  const w = 90, h = 22;
  const top = Math.max(1, ...history.flat());
  const line = (k) => history.map((p, i) =>
    `${((i / (history.length - 1)) * w).toFixed(1)},${(h - (p[k] / top) * (h - 2) - 1).toFixed(1)}`
  ).join(" ");
  return `<svg class="spark" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}">` +
    `<polyline fill="none" stroke="#2a6fdb" stroke-width="1.3" points="${line(0)}"/>` +
    `<polyline fill="none" stroke="#e07a1f" stroke-width="1.3" points="${line(1)}"/></svg>`;
}

function drawServers(servers) {
  const rows = servers.map((s) => {
    const f = s.figures;
    const num = (k) => `<td class="num" data-figure="${k}">${f ? esc(f[k]) : ""}</td>`;
    const mq = (k) => `<td class="num" data-figure="${k}">${f && f.mqtt ? esc(f[k]) : ""}</td>`;
    const stop = session.operate && s.up
      ? `<button class="stop" data-stop="${s.id}" data-name="${esc(s.name)}">stop…</button>` : "";
    const head = `<tr data-server="${s.id}" data-state="${s.state}">` +
      `<td>${s.id}</td><td>${esc(s.name)}${s.router ? " ◆" : ""}</td>` +
      `<td>${esc(s.domains.join(", "))}</td>` +
      `<td><span class="state ${s.state}">${s.state}</span></td>`;
    // Not up: why, in the server's row, instead of figures that would be stale.
    if (!f) return head + `<td colspan="15" class="why">${esc(s.error || "")}</td></tr>`;
    return head + `<td>${f ? duration(f.uptime_s) : ""}</td><td>${f ? size(f.storage_bytes) : ""}</td>` +
      num("queued") + num("held_back") + num("dead_letters") +
      num("msgs_in_per_s") + num("msgs_out_per_s") +
      `<td>${spark(s.history)}</td>` + num("clock_size") +
      mq("mqtt_connections") + mq("mqtt_sessions") + num("retained") +
      mq("publications_in") + mq("publications_out") + `<td>${stop}</td></tr>`;
  });
  document.querySelector("#servers tbody").innerHTML = rows.join("");
}

function drawClients(clients) {
  const q = document.getElementById("client-search").value.trim().toLowerCase();
  const shown = clients.clients.filter((c) => !q ||
    `${c.client} ${c.server} ${c.protocol} ${c.address}`.toLowerCase().includes(q));
  document.querySelector("#clients tbody").innerHTML = shown.map((c) =>
    `<tr data-client="${esc(c.client)}"><td>${esc(c.client)}</td><td>${c.server}</td>` +
    `<td>${esc(c.protocol)}</td><td class="num">${c.keep_alive}s</td>` +
    `<td class="num">${c.inflight}</td><td class="num">${c.backlog}</td>` +
    `<td>${esc(c.address)}</td></tr>`).join("") +
    (clients.truncated ? `<tr><td colspan="7">(more: each server lists 500 at most)</td></tr>` : "");
}

function drawTopics(topics, roaming) {
  document.querySelector("#topics tbody").innerHTML = topics.topics.map((t) =>
    `<tr><td>${esc(t.filter)}</td><td>${t.servers.join(", ")}</td></tr>`).join("");
  document.querySelector("#roaming tbody").innerHTML = roaming.sessions.map((r) =>
    `<tr data-client="${esc(r.client)}" data-anchor="${r.anchor}">` +
    `<td>${esc(r.client)}</td><td>${r.anchor}</td>` +
    `<td>${r.holder}${r.moving ? " (moving)" : ""}</td></tr>`).join("");
}

function drawSummary(servers) {
  const up = servers.filter((s) => s.up).length;
  document.getElementById("summary").textContent =
    `${up} of ${servers.length} servers up`;
  const refused = servers.filter((s) => s.state === "refused");
  const banner = document.getElementById("banner");
  if (refused.length) {
    banner.hidden = false;
    banner.textContent = `${refused.length} server(s) refuse the console: ${refused[0].error}`;
  } else {
    banner.hidden = true;
  }
}

function draw(state) {
  latest = state;
  drawSummary(state.servers);
  drawGraph(state);
  drawServers(state.servers);
  drawClients(state.clients);
  drawTopics(state.topics, state.roaming);
  document.body.dataset.ready = "true";
}

// -- the one action ----------------------------------------------------------------------------

async function stopServer(id, name) {
  const typed = window.prompt(`Stop server ${id}? This stops the process cleanly.\n` +
    `Type its name (${name}) to confirm:`);
  if (typed !== name) return;
  const answer = await fetch(`/api/servers/${id}/stop`, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Console-Token": session.token },
    body: JSON.stringify({ confirm: typed }),
  });
  const body = await answer.json();
  if (!body.ok) window.alert(`not stopped: ${body.error}`);
}

// -- start -------------------------------------------------------------------------------------

async function start() {
  session = await (await fetch("/api/session")).json();
  document.querySelectorAll("th.operate").forEach((th) => {
    th.textContent = session.operate ? "action" : "";
  });
  document.getElementById("client-search").addEventListener("input", () => {
    if (latest) drawClients(latest.clients);
  });
  document.getElementById("servers").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-stop]");
    if (button) stopServer(Number(button.dataset.stop), button.dataset.name);
  });
  const live = document.getElementById("live");
  const events = new EventSource("/api/events");
  events.onopen = () => { live.className = "live on"; };
  events.onerror = () => {
    live.className = "live off";
    document.getElementById("summary").textContent = "console not reachable: retrying…";
  };
  events.onmessage = (message) => draw(JSON.parse(message.data));
}

start();
