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
  table("queue", ["lease", "tenant", "pool", "class", "shape", "queued", "position",
                  "starts in", "why"], s.queue, (r, c) => ({
    lease: leaseLink(r.lease_id), tenant: r.tenant, pool: r.pool, class: r.priority_class,
    shape: amounts(r.shape), queued: when(r.queued_at || r.requested_at),
    position: r.why && r.why.position, "starts in": r.why &&
      r.why.estimated_start_in_seconds != null ?
      Math.round(r.why.estimated_start_in_seconds) + " s" : "", why: reason(r.why)})[c]);
  table("leases", ["lease", "tenant", "pool", "state", "node", "shape", "requested",
                   "credits held"], s.leases, (r, c) => ({
    lease: leaseLink(r.lease_id), tenant: r.tenant, pool: r.pool,
    state: el("span", r.state, "state-" + r.state), node: r.node_id, shape: amounts(r.shape),
    requested: when(r.requested_at), "credits held": r.credits_held})[c]);
  shares(s.shares);
  table("credits", ["tenant", "granted", "held", "spent", "available"], s.balances);
}

const live = document.getElementById("live");
const source = new EventSource("/dashboard/stream");
source.addEventListener("snapshot", (e) => {
  live.classList.add("on");
  render(JSON.parse(e.data));
});
source.onerror = () => live.classList.remove("on");
