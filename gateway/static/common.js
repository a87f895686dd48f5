// helpers shared by the dashboard's pages: build table rows from data, never from HTML strings
"use strict";
const el = (tag, text, cls) => {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
};
function table(id, columns, rows, cell) {
  const t = document.getElementById(id);
  if (!t) return;
  t.replaceChildren();
  const head = el("tr");
  for (const c of columns) head.append(el("th", c));
  t.append(head);
  if (!rows.length) {
    const tr = el("tr"), td = el("td", "none", "muted");
    td.colSpan = columns.length;
    tr.append(td);
    t.append(tr);
  }
  for (const r of rows) {
    const tr = el("tr");
    for (const c of columns) {
      const v = cell ? cell(r, c) : r[c];
      if (v instanceof Node) { const td = el("td"); td.append(v); tr.append(td); }
      else tr.append(el("td", v === null || v === undefined ? "" : v,
                        typeof v === "number" ? "num" : ""));
    }
    t.append(tr);
  }
}
const when = (s) => s ? new Date(s * 1000).toLocaleTimeString() : "";
const trim = (x) => (x < 10 ? +x.toFixed(2) : +x.toFixed(1)).toString();
// a shape as people say it: `8 CPU · 32 GiB · 1×A100-40GB` (as the CLI prints it)
const amounts = (shape) => {
  if (!shape) return "";
  const r = shape.resources || shape, parts = [];
  if (r.cpu_millis != null) parts.push(trim(r.cpu_millis / 1000) + " CPU");
  if (r.memory_mib != null) parts.push(r.memory_mib >= 1024 ? trim(r.memory_mib / 1024) +
                                       " GiB" : r.memory_mib + " MiB");
  if (r.gpu_count) {
    const part = shape.gpu_partition && shape.gpu_partition !== "none" ? shape.gpu_partition : "";
    const gib = shape.gpu_memory_gib_min;
    parts.push(r.gpu_count + "×" + String(part || shape.gpu_model || "GPU").toUpperCase() +
               (gib && !part ? "-" + gib + "GB" : ""));
  }
  if (r.local_disk_gib) parts.push(r.local_disk_gib + " GiB disk");
  return parts.join(" · ");
};
// `45 s`, `3 min 10 s`, `2 h 05 min`, `3.2 d`
const duration = (s) => {
  if (s == null || !isFinite(s)) return "";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min" + (s % 60 ? " " + (s % 60) + " s" : "");
  if (s < 86400) return Math.floor(s / 3600) + " h " +
    String(Math.floor(s % 3600 / 60)).padStart(2, "0") + " min";
  return (s / 86400).toFixed(1) + " d";
};
// an epoch time as local `2026-12-06 14:03:05`
const stamp = (s) => {
  if (!s) return "";
  const d = new Date(s * 1000), p = (n) => String(n).padStart(2, "0");
  return d.getFullYear() + "-" + p(d.getMonth() + 1) + "-" + p(d.getDate()) + " " +
    p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds());
};
// micro-credits as credits: `1.5 credits`
const credits = (micro) => micro == null ? "" :
  (micro / 1e6).toLocaleString("en", {maximumFractionDigits: 6}) + " credits";
const words = (x) => String(x == null ? "" : x).replace(/_/g, " ");
