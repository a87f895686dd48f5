// a lease's page: its state, why it waits, its flight recorder, and its live changes
"use strict";
const leaseId = document.querySelector("main").dataset.lease;
const admin = document.getElementById("who").textContent === "admin";
const base = admin ? "/v1/admin/leases/" : "/v1/compute-leases/";

function show(lease) {
  const rows = Object.entries(lease).filter(([, v]) => v !== null && v !== "")
    .map(([k, v]) => ({field: k, value: typeof v === "object" ? JSON.stringify(v) : v}));
  table("lease", ["field", "value"], rows);
}

async function load() {
  const got = await fetch(base + encodeURIComponent(leaseId));
  if (got.ok) show(await got.json());
  else table("lease", ["problem"], [{problem: (await got.json()).detail}]);
  if (!admin) {
    const why = await fetch("/v1/compute-leases/" + encodeURIComponent(leaseId) + "/why");
    document.getElementById("why").textContent = why.ok ?
      JSON.stringify(await why.json(), null, 1) : "";
  }
  const hist = await fetch(base + encodeURIComponent(leaseId) + "/history");
  const events = hist.ok ? (await hist.json()).events : [];
  table("history", ["#", "event", "when", "details"], events, (e, c) => ({
    "#": e.version, event: e.type, when: when(e.at),
    details: Object.entries(e.fields).filter(([, v]) => v !== null && v !== "" &&
      !(Array.isArray(v) && !v.length)).map(([k, v]) =>
      k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join("  ")})[c]);
}

const changes = [];
if (!admin) {
  const source = new EventSource("/v1/compute-leases/" + encodeURIComponent(leaseId) +
                                 "/events");
  source.addEventListener("lease", (e) => {
    const lease = JSON.parse(e.data);
    document.getElementById("live").classList.add("on");
    show(lease);
    changes.push({version: e.lastEventId, state: lease.state, node: lease.node_id,
                  seen: new Date().toLocaleTimeString()});
    table("changes", ["version", "state", "node", "seen"], changes);
  });
  source.onerror = () => { document.getElementById("live").classList.remove("on"); };
}
load();
