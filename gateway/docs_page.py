"""`/docs`: an interactive page over /openapi.json (try any operation with a token), and the
problem types that `type` URIs point at. Self-contained: nothing is fetched from elsewhere."""

from __future__ import annotations

import html

from litestar import Response

from gateway.problems import STATUS_BY_CODE

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>computepool HTTP API</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:1em;color:#222}
h1{font-size:1.4em} details{border:1px solid #ddd;border-radius:4px;margin:.4em 0;padding:.3em .6em}
summary{cursor:pointer} code,textarea,pre{font:12px ui-monospace,monospace}
.m{display:inline-block;width:4em;font-weight:bold} .GET{color:#07a} .POST{color:#a50}
textarea{width:100%;height:9em} pre{background:#f6f6f6;padding:.5em;overflow:auto;max-height:25em}
table{border-collapse:collapse} td,th{border-bottom:1px solid #eee;padding:2px 8px;text-align:left}
</style></head><body>
<h1>computepool HTTP API</h1>
<p>The command subjects over HTTP; the machine-readable document is <a href="/openapi.json">
/openapi.json</a> (OpenAPI 3.1). Every call needs <code>Authorization: Bearer TOKEN</code>
(<code>pool admin tenant token TENANT</code>).</p>
<p><label>Token <input id="token" size="60" autocomplete="off"></label></p>
<div id="ops">loading /openapi.json…</div>
<h2 id="problems">Problem types</h2>
<p>Errors are <code>application/problem+json</code> (RFC 9457) with the NATS API's stable
<code>code</code> and <code>reasons</code>.</p>
<table><tr><th>code</th><th>status</th></tr>__PROBLEMS__</table>
<script src="/static/docs.js"></script>
</body></html>
"""


def _problem_rows() -> str:
    return "".join(
        f'<tr id="problem-{html.escape(code)}"><td><code>{html.escape(code)}</code></td>'
        f"<td>{status}</td></tr>"
        for code, status in sorted(STATUS_BY_CODE.items()))


PAGE = _PAGE.replace("__PROBLEMS__", _problem_rows()).encode()


async def page() -> Response[bytes]:
    return Response(PAGE, media_type="text/html; charset=utf-8")
