// the fleet page: one EventSource of snapshots from /dashboard/stream, rendered in place
"use strict";
const shareHistory = {};  // tenant -> [weighted share, …] over this page's life
const HISTORY = 120;

function leaseLink(id) {
  const a = el("a", id.slice(0, 8));
  a.href = "/leases/" + encodeURIComponent(id);
  a.title = id;
  a.className = "lease-link";
  a.dataset.lease = id;
  return a;
}

function fleet(f) {
  const box = document.getElementById("fleet");
  box.replaceChildren();
  const card = (label, value, used, total) => {
    const c = el("div", null, "card");
    c.append(el("span", label, "muted"), el("b", value));
    if (total) {
      const bar = el("div", null, "bar"), fill = el("i");
      fill.style.width = Math.round(100 * used / total) + "%";
      bar.append(fill);
      c.append(bar);
    }
    box.append(c);
  };
  const states = Object.entries(f.by_state).map(([s, n]) => n + " " + s).join(", ");
  card("nodes", f.nodes, 0, 0);
  card("by state", states || "none", 0, 0);
  const t = f.totals;
  card("cpu free", (t.cpu_millis.free / 1000).toFixed(1) + " / " +
       (t.cpu_millis.allocatable / 1000).toFixed(1), t.cpu_millis.allocated,
       t.cpu_millis.allocatable);
  card("memory free (GiB)", (t.memory_mib.free / 1024).toFixed(0) + " / " +
       (t.memory_mib.allocatable / 1024).toFixed(0), t.memory_mib.allocated,
       t.memory_mib.allocatable);
  card("gpus free", t.gpu_count.free + " / " + t.gpu_count.allocatable, t.gpu_count.allocated,
       t.gpu_count.allocatable);
  table("zones", ["zone", "nodes", "cpu free", "memory free (GiB)", "gpus free"],
        Object.entries(f.by_zone).map(([z, v]) => ({zone: z, nodes: v.nodes,
          "cpu free": (v.cpu_millis_free || 0) / 1000,
          "memory free (GiB)": Math.round((v.memory_mib_free || 0) / 1024),
          "gpus free": v.gpu_count_free || 0})));
  table("gpus", ["model", "total", "free"],
        Object.entries(f.gpus_by_model).map(([m, v]) => ({model: m, total: v.total,
                                                          free: v.free})));
  const nodes = f.node_rows || [];
  document.getElementById("nodes-box").hidden = !f.node_rows;
  table("nodes", ["node_id", "pool", "state", "zone", "gpu_model", "cpu", "memory", "gpus"],
        nodes, (r, c) => c === "cpu" ? r.cpu_millis_allocated / 1000 + " / " +
          r.cpu_millis_allocatable / 1000 : c === "memory" ? r.memory_mib_allocated + " / " +
          r.memory_mib_allocatable : c === "gpus" ? r.gpu_count_allocated + " / " +
          r.gpu_count_allocatable : r[c]);
}

function reason(why) {
  if (!why || !why.reasons) return "";
  const parts = [];
  for (const [k, v] of Object.entries(why.reasons)) {
    if (k === "queue" || v === false || v === null) continue;
    if (Array.isArray(v)) parts.push(k + ": " + v.join(", "));
    else if (typeof v === "object") parts.push(k + ": " + Object.entries(v).map(
      ([a, b]) => a + "=" + b).join(", "));
    else parts.push(k + "=" + v);
  }
  return parts.join("; ");
}

function shares(s) {
  table("shares", ["tenant", "dominant share", "weight", "share / weight"],
        Object.entries(s).map(([t, v]) => ({tenant: t, "dominant share": v.dominant_share,
          weight: v.weight, "share / weight": v.weighted_share})));
  for (const [t, v] of Object.entries(s)) {
    (shareHistory[t] = shareHistory[t] || []).push(v.weighted_share);
    if (shareHistory[t].length > HISTORY) shareHistory[t].shift();
  }
  const svg = document.getElementById("shares-chart");
  svg.replaceChildren();
  const W = 460, H = 140, colors = ["#4a7bd0", "#d0804a", "#3b9b5b", "#a04ad0", "#c33"];
  const top = Math.max(0.01, ...Object.values(shareHistory).flat());
  Object.entries(shareHistory).forEach(([t, pts], i) => {
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts.map((p, j) =>
      (j * W / (HISTORY - 1)).toFixed(1) + "," + (H - 12 - p / top * (H - 20)).toFixed(1))
      .join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colors[i % colors.length]);
    const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
    label.textContent = t;
    label.setAttribute("x", 4 + 70 * i);
    label.setAttribute("y", H - 1);
    label.setAttribute("fill", colors[i % colors.length]);
    label.setAttribute("font-size", "11");
    svg.append(line, label);
  });
}

function render(s) {
  fleet(s.fleet);
  renderQueue(s.queue);
  renderLeases(s.leases);
  shares(s.shares);
  table("credits", ["tenant", "granted", "held", "spent", "available"], s.balances);
}

function renderQueue(rows) {
  table("queue", ["lease", "tenant", "pool", "class", "shape", "queued", "position",
                  "starts in", "why"], rows, (r, c) => ({
    lease: leaseLink(r.lease_id), tenant: r.tenant, pool: r.pool, class: r.priority_class,
    shape: amounts(r.shape), queued: when(r.queued_at || r.requested_at),
    position: r.why && r.why.position, "starts in": r.why &&
      r.why.estimated_start_in_seconds != null ?
      Math.round(r.why.estimated_start_in_seconds) + " s" : "", why: reason(r.why)})[c]);
}

function renderLeases(rows) {
  table("leases", ["lease", "tenant", "pool", "state", "node", "shape", "requested",
                   "credits held"], rows, (r, c) => ({
    lease: leaseLink(r.lease_id), tenant: r.tenant, pool: r.pool,
    state: el("span", r.state, "state-" + r.state), node: r.node_id, shape: amounts(r.shape),
    requested: when(r.requested_at), "credits held": r.credits_held})[c]);
}

// the time slider: at 0 the page is live; moved back, it shows the fleet (the admin's: a
// tenant reads no node) and the queue and leases as they were, from the ?at= routes
let past = null;  // the time shown, epoch seconds; null: live
let admin = false;
const slider = document.getElementById("time-slider");
const timeLabel = document.getElementById("time-label");

async function rowsAt(path, at, state) {
  const r = await fetch(path + "?limit=1000&at=" + at + (state ? "&state=" + state : ""));
  if (!r.ok) throw new Error(path + ": " + r.status);
  const page = await r.json();
  return {rows: page.items || [], seq: page.as_of_seq};
}

function fleetOf(nodes) {
  const dims = ["cpu_millis", "memory_mib", "gpu_count"];
  const f = {nodes: nodes.length, by_state: {}, totals: {}, by_zone: {}, gpus_by_model: {},
             node_rows: nodes};
  for (const d of dims) f.totals[d] = {allocatable: 0, allocated: 0, free: 0};
  for (const n of nodes) {
    f.by_state[n.state] = (f.by_state[n.state] || 0) + 1;
    const z = f.by_zone[n.zone] = f.by_zone[n.zone] || {nodes: 0};
    z.nodes += 1;
    for (const d of dims) {
      const a = n[d + "_allocatable"] || 0, u = n[d + "_allocated"] || 0;
      f.totals[d].allocatable += a;
      f.totals[d].allocated += u;
      f.totals[d].free += Math.max(0, a - u);
      z[d + "_free"] = (z[d + "_free"] || 0) + Math.max(0, a - u);
    }
    if (n.gpu_model && n.gpu_count_allocatable) {
      const g = f.gpus_by_model[n.gpu_model] = f.gpus_by_model[n.gpu_model] ||
        {total: 0, free: 0};
      g.total += n.gpu_count_allocatable;
      g.free += Math.max(0, n.gpu_count_allocatable - n.gpu_count_allocated);
    }
  }
  return f;
}

async function showPast(at) {
  const q = await rowsAt(admin ? "/v1/admin/views/queue" : "/v1/queue", at);
  const active = ["queued", "reserved", "running", "stopping", "preempting", "expired",
                  "reconciling"];  // each state's page, as the live snapshot reads them
  const leases = await Promise.all(active.map((state) => rowsAt(
    admin ? "/v1/admin/views/leases" : "/v1/compute-leases", at, state)));
  const nodes = admin ? (await rowsAt("/v1/admin/views/capacity", at)).rows : null;
  if (past !== at) return;  // moved again meanwhile
  if (nodes) fleet(fleetOf(nodes));
  renderQueue(q.rows);
  renderLeases(leases.flatMap((page) => page.rows));
  timeLabel.textContent = "as it was at " + new Date(at * 1000).toLocaleString() +
    " (the log up to event " + q.seq + ")" + (admin ? "" : "; the fleet: now");
}

slider.addEventListener("input", () => {
  const back = Number(slider.value);
  if (back === 0) {
    past = null;
    timeLabel.textContent = "now, live";
    return;
  }
  past = Math.round(Date.now() / 1000) + back;
  timeLabel.textContent = "reading " + new Date(past * 1000).toLocaleString() + "…";
  showPast(past).catch((e) => { timeLabel.textContent = "could not read then: " + e.message; });
});

const live = document.getElementById("live");
const source = new EventSource("/dashboard/stream");
source.addEventListener("snapshot", (e) => {
  live.classList.add("on");
  const s = JSON.parse(e.data);
  admin = s.who && s.who.kind === "admin";
  if (past === null) render(s);
});
source.onerror = () => live.classList.remove("on");
