// a lease's page as its story: what it is, a timeline of its life, why it waits, its flight
// recorder in words; one read (/dashboard/leases/ID) again whenever the live stream moves
"use strict";
const leaseId = document.querySelector("main").dataset.lease;
const liveDot = document.getElementById("live");
const WAITING = new Set(["requested", "held", "queued"]);
const ENDS = {LeaseReleased: "released", LeaseCancelled: "cancelled", LeaseRejected: "rejected",
              ReservationVoided: "voided", LeasePreempted: "preempted"};
// the state each event starts (those that start none only add to the recorder)
const ENDED = new Set(Object.values(ENDS));
const STARTS = {LeaseQueued: "queued", LeaseReserved: "reserved", LeaseCommitted: "running",
                StopRequested: "stopping", PreemptionNoticed: "preempting",
                LeaseExpired: "expired", ReconciliationStarted: "reconciling",
                LeaseRequeued: "queued", ...ENDS};

const ago = (s) => {
  const d = Date.now() / 1000 - s;
  return d >= 0 ? duration(d) + " ago" : "in " + duration(-d);
};
const at = (s) => s ? stamp(s) + " (" + ago(s) + ")" : "";

// one event of the recorder in words
function said(e) {
  const f = e.fields || {};
  switch (e.type) {
    case "LeaseRequested":
      return "requested " + amounts(f.shape) + " in pool " + f.pool_id + ", class " +
        words(f.priority_class) + ", for up to " + duration(f.maximum_runtime_seconds) +
        (f.queued_at ? "; queued" : "");
    case "LeaseQueued": return "queued";
    case "LeaseRejected":
      return "rejected: " + words(f.code) +
        (f.reasons && f.reasons.length ? " (" + f.reasons.map(words).join(", ") + ")" : "");
    case "LeaseReserved":
      return "reserved on node " + f.node_id + " (epoch " + f.epoch + ")" +
        (f.hold_microcredits ? ", " + credits(f.hold_microcredits) + " held" : "") +
        (f.reservation_deadline ? "; to be committed by " + stamp(f.reservation_deadline) : "");
    case "LeaseCommitted":
      return "committed: job " + f.job_number + " (" + String((f.job_spec || {}).image || "")
        .split("@")[0] + ") may run until " + stamp(f.deadline);
    case "JobSubmitted": return "job " + f.job_number + " submitted";
    case "JobStarted": return "the job started on its node (epoch " + f.epoch + ")";
    case "JobExited": return "the job exited with code " + f.exit_code;
    case "JobFailed": return "the job failed: " + words(f.reason);
    case "HeartbeatRecorded":
      return "heartbeat from its node" + (f.checkpoint_at ? ", checkpoint at " +
        stamp(f.checkpoint_at) : "");
    case "LeaseRenewed":
      return "renewed until " + stamp(f.deadline) + (f.clamped ? " (its maximum runtime)" : "");
    case "LeaseReleased":
      return "released: " + words(f.reason) +
        (f.exit_code != null ? ", exit code " + f.exit_code : "");
    case "StopRequested": return "asked to stop: " + words(f.reason);
    case "LeaseCancelled": return "cancelled: " + words(f.reason);
    case "LeaseExpired": return "expired: " + words(f.reason);
    case "ReconciliationStarted": return "reconciling with its node";
    case "ReservationVoided": return "reservation voided: " + words(f.reason);
    case "PreemptionNoticed": return "told it will be preempted";
    case "LeasePreempted": return "preempted";
    case "LeaseRequeued": return "queued again (attempt " + f.attempts + ")";
    case "LeaseRetried":
      return "attempt " + (f.attempt - 1) + " " + words(f.reason) +
        (f.node_id ? " on node " + f.node_id : "") +
        (f.exit_code != null ? ", exit code " + f.exit_code : "") + "; attempt " + f.attempt +
        (f.held_until ? " waits until " + stamp(f.held_until) : " next");
    default:
      return words(e.type.replace(/([a-z])([A-Z])/g, "$1 $2").toLowerCase());
  }
}

const eventAt = (e) => (e.fields && e.fields.at) || e.at;

// the lease's life as stages: [{state, from, to, reason}], from its events
function stages(events, why) {
  const out = [];
  for (const e of events) {
    let state = STARTS[e.type], from = eventAt(e);
    if (e.type === "LeaseRetried") state = e.fields.held_until ? "held" : "queued";
    if (e.type === "LeaseRequested") {
      const after = (e.fields.workflow || {}).after || [];
      state = e.fields.queued_at ? "queued" : after.length ? "held" : "requested";
      from = e.fields.queued_at || e.fields.requested_at || e.at;
    }
    if (!state) continue;
    const last = out[out.length - 1];
    if (last && last.to == null) {
      if (last.state === state) continue;  // queued, then queued again: one stage
      last.to = from;
      last.reason = said(e);
    }
    out.push({state, from, to: ENDS[e.type] ? from : null,
              reason: ENDS[e.type] ? said(e) : ""});
  }
  const open = out[out.length - 1];
  if (open && open.to == null) {
    open.now = true;
    if (WAITING.has(open.state)) open.reason = whyLine(why) || "waiting for a node";
    else if (open.state === "reserved") open.reason = "waiting for its commit";
    else if (open.state === "running") open.reason = "its job runs";
  }
  return out;
}

function timeline(list) {
  const box = document.getElementById("timeline");
  box.replaceChildren();
  for (const s of list) {
    const li = el("li", null, "stage stage-" + s.state + (s.now ? " now" : ""));
    const ended = ENDED.has(s.state);
    li.append(el("b", s.state),
              el("span", ended ? stamp(s.from) : s.now ? duration(Date.now() / 1000 - s.from) +
                 " so far" : duration(s.to - s.from), "took"),
              el("span", s.reason, "reason"));
    li.title = stamp(s.from) + (s.to && s.to !== s.from ? " → " + stamp(s.to) : "");
    box.append(li);
  }
}

function whyLine(why) {
  if (!why || !why.reasons) return "";
  const r = why.reasons, parts = [];
  if (why.position != null) parts.push("position " + why.position + " in the queue");
  if (why.estimated_start_in_seconds != null)
    parts.push("expected to start in about " + duration(why.estimated_start_in_seconds) +
               " (" + stamp(why.estimated_start_at) + ")");
  if (r.queue && r.queue.reserved)
    parts.push("node " + (r.queue.reserved_node_id || "?") + " is being kept for it");
  const filters = Object.entries(r.filters || {});
  if (filters.length)
    parts.push("no node fits it now: " + filters.map(([k, n]) => n + " of " +
               (r.nodes_total ?? "?") + " nodes " + words(k).replace(/^insufficient /,
               "lack ")).join(", "));
  for (const t of r.tenant || []) parts.push(words(t));
  if (r.waiting_for && r.waiting_for.length)
    parts.push("until lease " + r.waiting_for.join(", lease ") + " has ended as it asks");
  if (r.held_until) parts.push("until " + at(r.held_until));
  if (r.never_satisfiable) parts.push("no node of the pool could ever hold it");
  return parts.join("; ");
}

function showWhy(state, why) {
  const p = document.getElementById("why");
  const filters = (why && why.reasons && why.reasons.filters) || {};
  if (WAITING.has(state)) {
    const line = whyLine(why);
    p.textContent = line ? line.charAt(0).toUpperCase() + line.slice(1) + "." :
      "It waits for the scheduler's next cycle.";
    table("why-filters", ["filter", "nodes it rules out"], Object.entries(filters).map(
      ([k, n]) => ({filter: words(k), "nodes it rules out": n})));
  } else {
    p.textContent = "It is not waiting: it is " + state + ".";
    document.getElementById("why-filters").replaceChildren();
  }
}

function details(lease, row, events, list) {
  const L = {...row, ...lease};
  const end = list.find((s) => ENDED.has(s.state));
  const ended = L.ended_at || (end ? end.from : null);
  const ranFrom = L.started_at;
  const ranTo = L.run_ended_at || ended;
  const held = L.credits_held ?? L.hold_microcredits ?? 0;
  const creditText = [credits(held) + " held",
    L.credits_charged != null ? credits(L.credits_charged) + " charged" : "",
    L.credits_released ? credits(L.credits_released) + " released" : "",
    L.credits_shortfall ? credits(L.credits_shortfall) + " short" : ""]
    .filter(Boolean).join(" · ");
  const first = events.find((e) => e.type === "LeaseReserved");
  const rows = [
    ["state", L.state], ["tenant", L.tenant], ["pool", L.pool_id || L.pool],
    ["node", L.node_id || "not placed yet"], ["shape", amounts(L.shape)],
    ["priority class", words(L.priority_class)], ["epoch", L.epoch], ["attempts", L.attempts],
    ["requested", at(L.requested_at)],
    ["waited", first ? duration(eventAt(first) - L.requested_at) : ended ? "never placed" :
      duration(Date.now() / 1000 - L.requested_at) + " so far"],
    ["reserved", L.reserved_at ? at(L.reserved_at) : "not yet"],
    ["started", ranFrom ? at(ranFrom) : ended ? "never" : "not yet"],
    ["ran", ranFrom ? duration((ranTo || Date.now() / 1000) - ranFrom) +
      (ranTo ? "" : " so far") : "-"],
    ["ended", ended ? at(ended) : "not yet"],
    ["maximum runtime", duration(L.maximum_runtime_seconds) || "-"],
    ["deadline", !L.deadline ? "-" : ended ? stamp(L.deadline) : at(L.deadline)],
    ["credits", creditText],
    ["exit code", L.exit_code ?? "-"], ["end reason", L.end_reason ? words(L.end_reason) : "-"],
  ];
  if (L.name) rows.push(["name", L.name]);
  const labels = Object.entries(L.labels || {});
  if (labels.length) rows.push(["labels", labels.map(([k, v]) => k + "=" + v).join(", ")]);
  table("lease", ["field", "value"], rows.map(([field, value]) => ({field, value})),
        (r, c) => c === "field" ? r.field : String(r.value ?? "-"));
  for (const tr of document.querySelectorAll("#lease tr")) {
    const cells = tr.querySelectorAll("td");
    if (cells.length === 2) tr.dataset.field = cells[0].textContent;
  }
  const state = document.getElementById("state");
  state.textContent = L.state || "";
  state.className = "state-" + L.state;
}

// each attempt and how it ended: those retried (attempt_ends), then the one it is on
function attempts(L, list) {
  const ends = L.attempt_ends || [];
  const end = list.find((s) => ENDED.has(s.state));
  const ended = L.ended_at || (end ? end.from : null);
  const box = document.getElementById("attempts-box");
  box.hidden = !ends.length;
  if (!ends.length) return;
  const rows = ends.map((a) => ({attempt: a.attempt, node: a.node_id || "-",
    ended: stamp(a.ended_at), "end reason": words(a.end_reason), "exit code": a.exit_code ?? "-"}));
  rows.push({attempt: L.attempts, node: L.node_id || "not placed yet",
    ended: ended ? stamp(ended) : "not yet",
    "end reason": L.end_reason ? words(L.end_reason) : "its attempt now (" + L.state + ")",
    "exit code": L.exit_code ?? "-"});
  table("attempts", ["attempt", "node", "ended", "end reason", "exit code"], rows);
}

const changes = [];
let shown = null;
function render(story) {
  const events = story.events || [];
  const lease = story.lease || {}, row = story.row || {};
  const state = lease.state || row.state || "";
  const list = stages(events, story.why);
  details(lease, row, events, list);
  attempts({...row, ...lease}, list);
  timeline(list);
  showWhy(state, story.why);
  table("history", ["#", "when", "what"], events, (e, c) => ({
    "#": e.version, when: stamp(eventAt(e)), what: said(e)})[c]);
  const key = state + "/" + events.length;
  if (key !== shown) {
    shown = key;
    const lastEvent = events[events.length - 1];
    changes.push({seen: stamp(Date.now() / 1000), state,
                  event: lastEvent ? said(lastEvent) : ""});
    table("changes", ["seen", "state", "event"], changes);
  }
}

let loading = false, again = false, lastLoad = 0, timer = 0;
async function load() {
  if (loading) { again = true; return; }
  loading = true;
  lastLoad = Date.now();
  try {
    const got = await fetch("/dashboard/leases/" + encodeURIComponent(leaseId));
    if (got.ok) render(await got.json());
    else table("lease", ["problem"], [{problem: (await got.json()).detail}]);
  } finally {
    loading = false;
    if (again) { again = false; load(); }
  }
}

// a busy fleet's snapshots come every half second: read the lease again at most once a second
function poke() {
  clearTimeout(timer);
  timer = setTimeout(load, Math.max(0, 1000 - (Date.now() - lastLoad)));
}

// live: the dashboard's snapshot stream; each snapshot means something moved, so read again
const source = new EventSource("/dashboard/stream");
const connected = (on) => {
  liveDot.classList.toggle("on", on);
  liveDot.title = on ? "live: connected" : "live: not connected";
};
source.onopen = () => connected(true);
source.addEventListener("snapshot", () => { connected(true); poke(); });
source.onerror = () => connected(source.readyState === EventSource.OPEN);
load();
