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
const amounts = (shape) => {
  const r = (shape && (shape.resources || shape)) || {};
  return [r.cpu_millis ? (r.cpu_millis / 1000) + " cpu" : "",
          r.memory_mib ? r.memory_mib + " MiB" : "",
          r.gpu_count ? r.gpu_count + " gpu" : ""].filter(Boolean).join(" · ");
};
