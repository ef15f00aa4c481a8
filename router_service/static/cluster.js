// The live cluster page: polls /api/state (the Admin GetClusterState reply as JSON) every second and redraws.
// With an auth token, open the page as /#token=TOKEN: the token stays in this tab and goes out as a bearer header.
"use strict";

const POLL_MS = 1000;
const token = new URLSearchParams(location.hash.slice(1)).get("token") || sessionStorage.getItem("token");
if (token) sessionStorage.setItem("token", token);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}

function card(label, value, bad) {
  const node = el("div", {class: bad ? "card bad" : "card"});
  node.append(el("b", {}, value), label);
  return node;
}

function heat(value, max) {
  // white -> deep orange, by share of the busiest shard
  const f = max > 0 ? value / max : 0;
  const g = Math.round(255 - 150 * f), b = Math.round(255 - 220 * f);
  return `rgb(255, ${g}, ${b})`;
}

function drawSummary(s) {
  const load = s.load || {};
  const counts = load.counts || {};
  const router = s.router || {};
  const down = (s.replicas || []).filter(r => !r.alive && !r.drained).length;
  const box = document.getElementById("summary");
  box.replaceChildren(
    card("routing epoch", s.epoch),
    card("controller", s.controller_alive ? "alive" : "down", !s.controller_alive),
    card("replicas down", down, down > 0),
    card("active sequences", router.active_sequences),
    card("waiting", router.waiting_requests),
    card("steps", router.steps),
    card("rerouted tokens", counts.rerouted ?? 0),
    card("degraded tokens", counts.degraded ?? router.degraded_slots ?? 0, (counts.degraded ?? 0) > 0),
    card("retried calls", router.retried_calls),
    card("no-replica policy", s.no_replica_policy),
  );
}

function drawHeatmap(load) {
  const table = document.getElementById("heatmap");
  if (!load || !load.counts) { table.replaceChildren(); return; }
  const rows = load.counts.shard_load || [];
  const max = Math.max(0, ...rows.flat());
  document.getElementById("window").textContent =
    `(token slots over the last ${Math.round(load.covered_s || 0)} s of a ${load.window_s} s window)`;
  const head = el("tr", {}, "");
  head.replaceChildren(el("th", {}, "layer \\ expert"));
  for (let e = 0; e < load.num_experts; e++) head.append(el("th", {}, e));
  const body = [head];
  rows.forEach((row, i) => {
    const tr = el("tr", {}, "");
    tr.replaceChildren(el("th", {}, load.layers[i]));
    row.forEach((v, e) => {
      const td = el("td", {"data-layer": load.layers[i], "data-expert": e, title: `${v} token slots`},
                    Math.round(v));
      td.style.background = heat(v, max);
      tr.append(td);
    });
    body.push(tr);
  });
  table.replaceChildren(...body);
}

function replicaState(r) {
  if (r.drained) return "drained";
  if (r.restoring) return "restoring";
  return r.alive ? "alive" : "down";
}

function drawReplicas(replicas) {
  const body = document.querySelector("#replicas tbody");
  body.replaceChildren(...replicas.map(r => {
    const state = replicaState(r);
    const row = el("tr", {class: state === "alive" ? "" : state, "data-actor": r.actor, "data-state": state});
    row.append(el("td", {}, r.actor), el("td", {class: "num"}, r.expert), el("td", {}, state),
               el("td", {}, r.breaker), el("td", {}, (r.node_id || "").slice(0, 12)),
               el("td", {}, (r.gpu_ids || []).join(",") || "–"), el("td", {}, r.device || "–"),
               el("td", {class: "num"}, r.generation), el("td", {class: "num"}, r.calls),
               el("td", {class: "num"}, r.tokens));
    return row;
  }));
}

function drawEvents(events) {
  const body = document.querySelector("#events tbody");
  body.replaceChildren(...events.slice(-20).reverse().map(ev => el("tr", {"data-kind": ev.kind},
    el("td", {}, new Date(ev.time * 1000).toLocaleTimeString()), el("td", {}, ev.kind), el("td", {}, ev.actor),
    el("td", {}, JSON.stringify(ev.detail)))));
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch("/api/state", {headers: token ? {Authorization: `Bearer ${token}`} : {}});
    const body = await reply.json();
    if (!reply.ok) throw new Error(body.error ? body.error.message : `HTTP ${reply.status}`);
    document.getElementById("model").textContent = body.model;
    drawSummary(body);
    drawHeatmap(body.load);
    drawReplicas(body.replicas || []);
    drawEvents(body.events || []);
    document.getElementById("control").textContent = JSON.stringify(body.control, null, 1);
    status.className = "status";
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    status.className = "status error";
    status.textContent = `cannot read the cluster state: ${err.message}`;
  }
}

refresh();
setInterval(refresh, POLL_MS);
