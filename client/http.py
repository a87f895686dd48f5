"""The tenant's client over the gateway's HTTP API: the same calls and reply envelopes as
client.api.PoolClient, so a command does not care which transport it was given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

import httpx

if TYPE_CHECKING:  # imported where used: a one-shot command needs neither nats nor msgspec
    from client.httpfiles import HttpFileStore
    from client.httpwatch import HttpLeaseWatch

LEASES = "/v1/compute-leases"
# the lease verbs the HTTP API answers, and how: GET (a read) or POST (a command)
_READS = {"get": "", "why": "/why"}
_COMMANDS = ("commit", "heartbeat", "renew", "release", "cancel")
# the views a tenant reads, by the path that answers them
VIEW_PATHS = {"leases": LEASES, "queue": "/v1/queue", "balance": "/v1/balance"}
# the filters each answers (gateway.routes' LEASE_FILTERS and QUEUE_FILTERS; a test keeps them
# equal, and the CLI need not import the gateway to know them)
VIEW_FILTERS: dict[str, tuple[str, ...]] = {
    "leases": ("state", "pool", "priority_class", "node_id", "name", "label"),
    "queue": ("pool", "priority_class", "state"), "balance": ()}
# the operator's commands the gateway serves: admin path (`pool.admin.<path>`) → method and URL;
# `{name}` is filled from the body's field (`node.<node_id>.<verb>`: from the path itself)
# (tests/unit/test_admin_paths.py keeps this equal to gateway.routes' admin routes)
ADMIN_PATHS: dict[str, tuple[str, str]] = {
    "pool.create": ("POST", "/v1/admin/pools"),
    "pool.set": ("POST", "/v1/admin/pools/{pool_id}"),
    "pool.show": ("GET", "/v1/admin/pools/{pool_id}"),
    "pool.prices": ("POST", "/v1/admin/pools/{pool_id}/prices"),
    "pool.images": ("POST", "/v1/admin/pools/{pool_id}/images"),
    "tenant.set": ("POST", "/v1/admin/tenants"),
    "cohort.set": ("POST", "/v1/admin/cohorts"),
    "reservation.create": ("POST", "/v1/admin/pools/{pool_id}/reservations"),
    "reservation.list": ("GET", "/v1/admin/pools/{pool_id}/reservations"),
    "reservation.delete": ("POST",
                           "/v1/admin/pools/{pool_id}/reservations/{reservation_id}/delete"),
    "node.register": ("POST", "/v1/admin/nodes"),
    "node.enroll": ("POST", "/v1/admin/nodes/enrollments"),
    "node.{node}.{verb}": ("POST", "/v1/admin/nodes/{node_id}/{verb}"),
    "credits.grant": ("POST", "/v1/admin/credits/grants"),
    "secrets.reseal": ("POST", "/v1/admin/secrets/reseal"),
}


class HttpTransportError(Exception):
    """The gateway could not be asked: no answer, or an answer that is not the API's."""

    code = "gateway_unreachable"


class NotOverHttp(Exception):
    """What this client cannot do over the HTTP API yet."""

    code = "not_over_http"


def _not_over_http(command: str, why: str) -> dict[str, Any]:
    """The refusal of an operator's command the gateway cannot carry, in one line."""
    return {"ok": False, "error": {
        "code": NotOverHttp.code, "reasons": {},
        "message": f"`{command}` needs the plane's NATS ({why}): run it where `pool up` runs, "
                   "or pass --nats-url"}}


def _admin_request(path: str, body: dict[str, Any]) -> tuple[str, str, list[str]] | None:
    """The method and URL that carry admin `path` over HTTP, and the body fields the URL
    holds; None where the gateway has no route for it."""
    parts = path.split(".")
    if len(parts) == 3 and parts[0] == "node":  # node.<node>.<verb>: both in the URL
        method, template = ADMIN_PATHS["node.{node}.{verb}"]
        fill = {"node_id": parts[1], "verb": parts[2]}
    elif path in ADMIN_PATHS:
        method, template = ADMIN_PATHS[path]
        fill = {name: str(body.get(name, "")) for name in _params(template)}
    else:
        return None
    url = template.format(**{k: quote(v, safe="") for k, v in fill.items()})
    return method, url, [name for name in fill if name in body]


def _params(template: str) -> list[str]:
    return [p.split("}")[0] for p in template.split("{")[1:]]


def _envelope_error(r: httpx.Response) -> dict[str, Any]:
    """A problem+json refusal as the envelope's error (the command service's code)."""
    try:
        p = r.json()
    except ValueError:
        p = {}
    if not isinstance(p, dict) or "code" not in p:
        return {"ok": False, "error": {"code": "http_" + str(r.status_code),
                                       "message": f"HTTP {r.status_code} from {r.url}",
                                       "reasons": {}}}
    reasons = p.get("reasons") if isinstance(p.get("reasons"), dict) else {}
    return {"ok": False, "error": {"code": str(p["code"]),
                                   "message": str(p.get("detail") or p["code"]),
                                   "reasons": reasons}}


class HttpClient:
    """Speaks for the tenant its bearer token names, through one gateway."""

    def __init__(self, url: str, token: str, *, tenant: str = "", timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.tenant = tenant
        self.timeout = timeout
        # a plain-http gateway is never spoken TLS to (no redirects are followed): loading the
        # CA certificates would only cost every command a fifth of a second
        tls = self.url.lower().startswith("https://")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, verify=tls,
                                  headers={"Authorization": f"Bearer {token}",
                                           "Accept": "application/json"})

    def _send(self, method: str, path: str, *, body: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None) -> httpx.Response:
        try:
            return self._http.request(method, path, json=body, params=params)
        except httpx.HTTPError as e:
            raise HttpTransportError(f"{self.url}: {e or type(e).__name__}") from e

    def _reply(self, r: httpx.Response, key: str) -> dict[str, Any]:
        if r.is_success:
            try:
                return {"ok": True, key: r.json()}
            except ValueError:
                raise HttpTransportError(f"{self.url} answered {r.status_code} without JSON: "
                                         "is it the computepool HTTP API?") from None
        return _envelope_error(r)

    def whoami(self) -> dict[str, Any]:
        """Who the token speaks for: `{"kind": "tenant", "tenant": …}` or the admin."""
        return self._reply(self._send("GET", "/v1/whoami"), "result")

    # -- tenant (as client.api.PoolClient) ---------------------------------------------------

    def request_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("count", 1) != 1:
            raise NotOverHttp("--count: a batch of leases is requested over NATS only; "
                              "request them one by one")
        return self._reply(self._send("POST", LEASES, body=body), "lease")

    def lease(self, lease_id: str, verb: str, body: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        path = f"{LEASES}/{quote(lease_id, safe='')}"
        if verb in _READS:  # a read's body fields go as query parameters (`why?at=`)
            return self._reply(self._send("GET", path + _READS[verb], params=body or None),
                               "lease" if verb == "get" else "result")
        if verb not in _COMMANDS:
            raise NotOverHttp(f"lease {verb}: not in the HTTP API")
        return self._reply(self._send("POST", f"{path}/{verb}", body=body or {}), "lease")

    def queue_positions(self) -> dict[str, Any]:
        return self._reply(self._send("GET", "/v1/queue/positions"), "result")

    def secret(self, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Set, list or delete one of this tenant's secrets (as client.api.PoolClient)."""
        body = dict(body or {})
        if verb == "set":
            return self._reply(self._send("POST", "/v1/secrets", body=body), "result")
        if verb == "list":
            return self._reply(self._send("GET", "/v1/secrets"), "result")
        if verb == "delete":
            name = quote(str(body.pop("name", "")), safe="")
            return self._reply(self._send("POST", f"/v1/secrets/{name}/delete", body=body),
                               "result")
        raise NotOverHttp(f"secret {verb}: not in the HTTP API")

    def watch_lease(self, lease_id: str, *, output: bool = False,
                    after: int = 0) -> HttpLeaseWatch:
        """One of this tenant's leases as it happens, through the gateway's streams: as
        client.api.PoolClient.watch_lease, the same items and calls."""
        from client.httpwatch import HttpLeaseWatch

        return HttpLeaseWatch(self._http, lease_id, output=output, after=after)

    def replay_telemetry(self, body: dict[str, Any]) -> dict[str, Any]:
        """A lease's job output stored after `after_seq` (and from `since`), read to its end
        from the gateway's log stream, as one page that is at its end."""
        from client.httpwatch import sse_events
        lease, kind = body.get("lease"), body.get("kind")
        if not isinstance(lease, str) or kind != "output":
            raise NotOverHttp("telemetry replay: only a lease's output is read over HTTP")
        params: dict[str, Any] = {"follow": "0"}
        if body.get("since") is not None:
            params["since"] = body["since"]
        headers = {"Accept": "text/event-stream"}
        if body.get("after_seq"):
            headers["Last-Event-ID"] = str(int(body["after_seq"]))
        samples: list[dict[str, Any]] = []
        try:
            with self._http.stream("GET", f"{LEASES}/{quote(lease, safe='')}/logs",
                                   params=params, headers=headers) as r:
                if not r.is_success:
                    r.read()
                    return _envelope_error(r)
                for event in sse_events(r.iter_lines()):
                    if event.get("event") == "error":
                        err = json.loads(event["data"])
                        return {"ok": False, "error": {**err, "reasons": {}}}
                    samples.append(json.loads(event["data"]))
        except httpx.HTTPError as e:
            raise HttpTransportError(f"{self.url}: {e or type(e).__name__}") from e
        return {"ok": True, "result": {"samples": samples, "at_end": True}}

    def lease_events(self, lease_id: str, after: int = 0) -> Iterator[dict[str, Any]]:
        """The lease's feed records after feed sequence `after`, each with its `seq`, until
        the lease ends (the gateway closes the stream then). A refusal raises."""
        from client.httpwatch import StreamRefused, refusal, sse_events
        headers = {"Accept": "text/event-stream"}
        if after:
            headers["Last-Event-ID"] = str(after)
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(self.timeout, read=None),
                              headers={**self._http.headers, **headers}) as http, \
                    http.stream("GET", f"{LEASES}/{quote(lease_id, safe='')}/events") as r:
                if not r.is_success:
                    raise refusal(r)
                for event in sse_events(r.iter_lines()):
                    data = json.loads(event["data"])
                    if event.get("event") == "error":
                        raise StreamRefused(str(data.get("code")), str(data.get("message")))
                    yield {"seq": int(event.get("id") or 0), **data}
        except httpx.HTTPError as e:
            raise HttpTransportError(f"{self.url}: {e or type(e).__name__}") from e

    def view(self, name: str, *, filters: dict[str, str] | None = None, limit: int = 100,
             cursor: str | None = None, at: float | None = None) -> dict[str, Any]:
        """A page of one of the tenant's views, as the NATS query answers it (`rows`,
        `next_cursor`); `at`: as it was then."""
        if name not in VIEW_PATHS:
            raise NotOverHttp(f"the {name} view: a tenant reads only "
                              f"{', '.join(VIEW_PATHS)} over HTTP")
        params: dict[str, Any] = dict(filters or {})
        if name != "balance":
            params["limit"] = limit
            if cursor:
                params["cursor"] = cursor
            if at is not None:
                params["at"] = at
        reply = self._reply(self._send("GET", VIEW_PATHS[name], params=params), "result")
        if not reply["ok"]:
            return reply
        got = reply["result"]
        if name == "balance":
            return {"ok": True, "result": {"rows": [got], "next_cursor": None}}
        return {"ok": True, "result": {"rows": got.get("items") or [],
                                       "next_cursor": got.get("next_cursor")}}

    def usage(self, pool: str | None = None) -> dict[str, Any]:
        return self._reply(self._send("GET", "/v1/usage",
                                      params={"pool": pool} if pool else None), "result")

    # -- admin (the admin token) ---------------------------------------------------------------

    def admin(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """An operator's command (`pool.admin.<path>`, as client.api.PoolClient.admin) through
        the gateway's admin route for it; `not_over_http` where the gateway has none."""
        body = dict(body or {})
        request = _admin_request(path, body)
        if request is None:
            return _not_over_http("pool admin …", f"the gateway does not serve {path}")
        method, url, in_url = request
        if method == "GET":  # a read: the URL holds its ids, and nothing else of the body goes
            extra = sorted(k for k, v in body.items()
                           if k not in in_url and v not in (None, False, "", [], {}))
            if extra:
                return _not_over_http("pool admin …", f"the gateway's {path} does not "
                                      f"take {', '.join(extra)}")
            return self._reply(self._send("GET", url), "result")
        return self._reply(self._send("POST", url, body=body), "result")

    def pool_shares(self, pool_id: str) -> dict[str, Any]:
        """The pool's fair shares as its leading scheduler holds them (as
        client.api.PoolClient.pool_shares); the gateway's bus refusals read as
        `scheduler_unavailable`, as no answer over NATS does."""
        reply = self._reply(self._send("GET", f"/v1/admin/pools/{quote(pool_id, safe='')}"
                                       "/shares"), "result")
        error = reply.get("error") or {}
        if error.get("code") in ("bus_timeout", "bus_unavailable"):
            from client.api import scheduler_unavailable  # nats only on this path

            return scheduler_unavailable(pool_id, str(error.get("message") or error["code"]))
        return reply

    def files(self) -> HttpFileStore:
        """The tenant's work directories and artifacts through the gateway (as
        client.api.PoolClient.files, for the calls the CLI makes)."""
        from client.httpfiles import HttpFileStore

        return HttpFileStore(self._http, self.url)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

