// /docs: one form per operation of /openapi.json; sends it with the token typed above.
"use strict";
(async function () {
  const spec = await (await fetch("/openapi.json")).json();
  const ops = document.getElementById("ops");
  ops.textContent = "";
  for (const [path, methods] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const d = document.createElement("details");
      const s = document.createElement("summary");
      s.innerHTML = '<span class="m ' + method.toUpperCase() + '"></span><code></code> ';
      s.querySelector(".m").textContent = method.toUpperCase();
      s.querySelector("code").textContent = path;
      s.append(op.summary);
      d.append(s);
      const inputs = {};
      for (const p of op.parameters || []) {
        const l = document.createElement("label");
        l.textContent = p.name + " (" + p.in + ") ";
        const i = document.createElement("input");
        inputs[p.name] = [p, i];
        l.append(i);
        d.append(l, document.createElement("br"));
      }
      let body = null;
      if (op.requestBody) {
        body = document.createElement("textarea");
        body.value = "{}";
        d.append(body);
      }
      const go = document.createElement("button");
      go.textContent = "Send";
      const out = document.createElement("pre");
      go.onclick = async () => {
        let url = path;
        const q = new URLSearchParams();
        const headers = {"Authorization": "Bearer " + document.getElementById("token").value};
        for (const [name, [p, i]] of Object.entries(inputs)) {
          if (!i.value) continue;
          if (p.in === "path") url = url.replace("{" + name + "}", encodeURIComponent(i.value));
          else if (p.in === "query") q.set(name, i.value);
          else if (p.in === "header") headers[name] = i.value;
        }
        if (body) headers["Content-Type"] = "application/json";
        const qs = q.toString();
        const r = await fetch(url + (qs ? "?" + qs : ""),
          {method: method.toUpperCase(), headers, body: body ? body.value : undefined});
        out.textContent = r.status + " " + r.statusText + "\n" + await r.text();
      };
      d.append(go, out);
      ops.append(d);
    }
  }
})();
