"""`computepool.Client`: a tenant's leases, feed, logs, artifacts and secrets through the one
client of the CLI (client.api.PoolClient over NATS, client.http.HttpClient over the gateway).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Self
from urllib.parse import urlsplit

import msgspec

from bus.errors import BusError
from bus.subjects import command_subject
from client.contexts import ContextError
from client.contexts import load as load_contexts
from client.http import HttpClient, HttpTransportError, NotOverHttp
from computepool.errors import PoolError
from gateway.wire import Lease
from schemas import v1
from schemas.feed import FeedRecord

# the states a lease leaves no more (domain/lease.py TERMINAL_STATES)
FINAL_STATES = frozenset({"released", "cancelled", "voided", "preempted", "rejected"})
# quiet this long, a wait reads the lease once: a lost feed message cannot hang it
GUARD_SECONDS = 5.0
# nats (bus.leasewatch, client.httpwatch) is imported only by the calls that follow a lease:
# a one-shot call over HTTP starts as fast as the CLI's did before
_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (BusError, HttpTransportError, NotOverHttp,
                                                  ContextError)


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `Client.run` came to: the ended lease, the job's exit code (None: it never ran)
    and everything it wrote to stdout and stderr."""

    lease: Lease
    exit_code: int | None
    output: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Artifact(msgspec.Struct, frozen=True, kw_only=True):
    """One file a lease's job kept (`artifacts=` globs), stored by the plane."""

    name: str  # relative to the lease
    size_bytes: int
    sha256: str
    stored_at: str


class LeaseList(msgspec.Struct, frozen=True, kw_only=True):
    """A page of the tenant's leases view; pass `next_cursor` back as `cursor` for the next."""

    rows: list[dict[str, Any]]
    next_cursor: str | None = None


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Every transport's failure as a PoolError with the transport's stable code."""
    try:
        yield
    except Exception as e:
        watch = sys.modules.get("client.httpwatch")
        known = _TRANSPORT_ERRORS + ((watch.StreamRefused,) if watch is not None else ())
        if not isinstance(e, known):
            raise
        raise PoolError(str(getattr(e, "code", "error")), str(e) or type(e).__name__) from e


def _lines(chunks: Iterator[str]) -> Iterator[str]:
    """Output chunks as lines, each with its newline (the last one may have none)."""
    held = ""
    for chunk in chunks:
        held += chunk
        *whole, held = held.split("\n")
        for line in whole:
            yield line + "\n"
    if held:
        yield held


class Client:
    """Speaks for one tenant: over the HTTP gateway for an `http(s)://` URL and its `token`,
    over NATS for a `nats://` URL with the tenant's `user` and `password` (or in the URL).
    `transport`: an already built client.api.PoolClient or client.http.HttpClient."""

    def __init__(self, url: str | None = None, *, token: str | None = None, tenant: str = "",
                 user: str | None = None, password: str | None = None, pool: str = "default",
                 timeout: float = 10.0, transport: Any = None) -> None:
        if transport is None:
            transport = _transport(url, token=token, tenant=tenant, user=user,
                                   password=password, timeout=timeout)
        self.transport = transport
        self.tenant: str = tenant or str(getattr(transport, "tenant", "") or "")
        self.pool = pool

    @classmethod
    def from_context(cls, name: str | None = None, *, timeout: float = 10.0) -> Self:
        """The saved context `name` (`pool login`), else $POOL_CONTEXT's, else the current."""
        try:
            ctx = load_contexts().pick(name or os.environ.get("POOL_CONTEXT") or None)
        except ContextError as e:
            raise PoolError(e.code, str(e)) from e
        if ctx is None:
            raise PoolError("no_context", "no context saved: `pool login URL` first")
        return cls(ctx.url, token=ctx.token, tenant=ctx.tenant, pool=ctx.pool or "default",
                   timeout=timeout)

    # -- the lease's verbs -------------------------------------------------------------------

    def envelope(self, lease_id: str, verb: str, body: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        """A lease verb's reply envelope as the plane gave it, ok or not (for a caller that
        shows replies verbatim, as the CLI does); only a transport failure raises."""
        with translated():
            reply: dict[str, Any] = self.transport.lease(lease_id, verb, body)
        return reply

    def _lease(self, lease_id: str, verb: str, body: dict[str, Any] | None = None) -> Lease:
        return _lease_of(self.envelope(lease_id, verb, body))

    def request(self, request: v1.LeaseRequest | None = None, *, pool: str | None = None,
                cpu_millis: int = 1000, memory_mib: int = 512,
                max_runtime_seconds: int = 3600, runtime: v1.RuntimeClass = "sandboxed",
                name: str | None = None, labels: Mapping[str, str] | None = None,
                priority_class: str = "standard", idempotency_key: str | None = None) -> Lease:
        """Ask for one lease: a whole `LeaseRequest`, or its everyday fields."""
        if request is None:
            request = v1.LeaseRequest(
                pool_id=pool or self.pool,
                shape=v1.ResourceShape(cpu_millis=cpu_millis, memory_mib=memory_mib,
                                       runtime=runtime),
                maximum_runtime_seconds=max_runtime_seconds,
                idempotency_key=idempotency_key or os.urandom(16).hex(),
                priority_class=priority_class, name=name, labels=dict(labels or {}))
        body = {k: v for k, v in msgspec.to_builtins(request).items()
                if v is not None and v != [] and v != {}}
        with translated():
            reply: dict[str, Any] = self.transport.request_lease(body)
        return _lease_of(reply)

    def get(self, lease_id: str) -> Lease:
        return self._lease(lease_id, "get")

    def why(self, lease_id: str) -> dict[str, Any]:
        """Why a lease waits: reason codes and counts of nodes per failed filter."""
        reply = self.envelope(lease_id, "why")
        if not reply.get("ok"):
            raise PoolError.from_envelope(reply)
        return dict(reply.get("result") or {})

    def commit(self, lease_id: str, command: Sequence[str] = (), *, image: str | None = None,
               env: Mapping[str, str] | None = None, artifacts: Sequence[str] = ()) -> Lease:
        """Confirm a reserved lease and start its job; `artifacts`: globs of the files it
        keeps (`out/*`), read back with `artifacts` and `download`."""
        return self._lease(lease_id, "commit", {"job": _job(command, image, env, artifacts)})

    def renew(self, lease_id: str, extend_seconds: int | None = None) -> Lease:
        body = {} if extend_seconds is None else {"extend_seconds": extend_seconds}
        return self._lease(lease_id, "renew", body)

    def cancel(self, lease_id: str, reason: str | None = None) -> Lease:
        return self._lease(lease_id, "cancel", {"reason": reason} if reason else {})

    def release(self, lease_id: str, *, exit_code: int | None = None,
                reason: str | None = None) -> Lease:
        body: dict[str, Any] = {}
        if exit_code is not None:
            body["exit_code"] = exit_code
        if reason:
            body["reason"] = reason
        return self._lease(lease_id, "release", body)

    def leases(self, *, limit: int = 100, cursor: str | None = None,
               **filters: str) -> LeaseList:
        """A page of the tenant's leases, filtered (state=, pool=, name=, label="k=v", …)."""
        with translated():
            if isinstance(self.transport, HttpClient):
                reply = self.transport.view("leases", filters=filters, limit=limit,
                                            cursor=cursor)
            else:
                body: dict[str, Any] = {"filters": filters, "limit": limit}
                if cursor:
                    body["cursor"] = cursor
                reply = self.transport.call(command_subject(self.tenant, "query", "leases"),
                                            body)
        result = _result_of(reply)
        return LeaseList(rows=list(result.get("rows") or []),
                         next_cursor=result.get("next_cursor"))

    # -- a job from request to exit ----------------------------------------------------------

    def run(self, command: Sequence[str], *, image: str | None = None,
            env: Mapping[str, str] | None = None, pool: str | None = None,
            cpu_millis: int = 1000, memory_mib: int = 512, max_runtime_seconds: int = 3600,
            runtime: v1.RuntimeClass | None = None, name: str | None = None,
            labels: Mapping[str, str] | None = None, artifacts: Sequence[str] = (),
            timeout: float | None = None) -> RunResult:
        """Request a lease, wait for its reservation, commit `command`, collect its output
        until it ends; `timeout` seconds (None: no limit) past, the lease is cancelled and
        PoolError("run_timeout") raised. The pool's lease term is not renewed: keep
        `max_runtime_seconds` within it."""
        lease = self.request(pool=pool, cpu_millis=cpu_millis, memory_mib=memory_mib,
                             max_runtime_seconds=max_runtime_seconds,
                             runtime=runtime or ("container" if image else "sandboxed"),
                             name=name, labels=labels)
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: list[str] = []
        with translated():
            watch = self.transport.watch_lease(lease.lease_id, output=True).start()
        try:
            if lease.state not in ("reserved", "running"):
                self._wait_reserved(watch, lease.lease_id, deadline)
            committed = self.envelope(lease.lease_id, "commit",
                                      {"job": _job(command, image, env, artifacts)})
            if not committed.get("ok"):  # the reservation goes back at once
                self.envelope(lease.lease_id, "release", {})
                raise PoolError.from_envelope(committed)
            chunks.extend(self._follow(watch, lease.lease_id, deadline))
        except (KeyboardInterrupt, PoolError) as e:
            if isinstance(e, KeyboardInterrupt) or e.code == "run_timeout":
                with contextlib.suppress(PoolError):
                    self.envelope(lease.lease_id, "cancel", {"reason": "interrupted"})
            raise
        finally:
            with contextlib.suppress(Exception):
                watch.close()
        ended = self.get(lease.lease_id)
        code = ended.exit_code
        if code is None and ended.end_reason == "succeeded":
            code = 0
        return RunResult(lease=ended, exit_code=code, output="".join(chunks))

    def _next(self, watch: Any, lease_id: str, deadline: float | None) -> Any:
        """The watch's next item; None after a quiet spell; raises past the deadline."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise PoolError("run_timeout", f"lease {lease_id}: the run's timeout passed")
        with translated():
            return watch.get(GUARD_SECONDS if left is None else min(left, GUARD_SECONDS))

    def _wait_reserved(self, watch: Any, lease_id: str, deadline: float | None) -> None:
        from bus.leaseitems import Output

        while True:
            got = self._next(watch, lease_id, deadline)
            if isinstance(got, Output):
                continue
            lease = self.get(lease_id) if got is None else None
            state = lease.state if lease is not None else got.record.state
            if state in ("reserved", "running"):
                return
            if state in FINAL_STATES:
                why = self.envelope(lease_id, "why")
                reasons = (why.get("result") or {}).get("reasons") or {}
                record = lease or got.record
                raise PoolError("not_reserved", f"lease {lease_id} {state} "
                                f"({record.rejection_code or record.end_reason or state})",
                                reasons if isinstance(reasons, dict) else {})

    def _follow(self, watch: Any, lease_id: str, deadline: float | None,
                seen: Counter[tuple[float, int, str]] | None = None) -> Iterator[str]:
        """The job's output as it comes until the lease's feed says it ended (every output
        published before the end comes before it); `seen`: output already read."""
        from bus.leaseitems import Change, Output

        while True:
            got = self._next(watch, lease_id, deadline)
            if got is None:
                if self.get(lease_id).state in FINAL_STATES:
                    return
            elif isinstance(got, Output):
                if seen and seen[got.key] > 0:
                    seen[got.key] -= 1
                    continue
                yield got.text
            elif isinstance(got, Change) and got.record.state in FINAL_STATES:
                return

    # -- the feed and the output -------------------------------------------------------------

    def watch(self, lease_id: str, *, after: int = 0) -> Iterator[FeedRecord]:
        """Each state change of the lease (its feed records after feed sequence `after`, then
        live) until it ends."""
        from bus.leaseitems import Change

        self.get(lease_id)  # an unknown lease, or another tenant's: refused here
        with translated():
            watch = self.transport.watch_lease(lease_id, after=after).start()
        try:
            while True:
                got = self._next(watch, lease_id, None)
                if got is None:
                    if self.get(lease_id).state in FINAL_STATES:
                        return
                elif isinstance(got, Change):
                    yield got.record
                    if got.record.state in FINAL_STATES:
                        return
        finally:
            with contextlib.suppress(Exception):
                watch.close()

    def logs(self, lease_id: str, *, follow: bool = False,
             since: float | None = None) -> Iterator[str]:
        """The job's output as lines (each with its newline): what is stored (from `since`,
        Unix seconds), and with `follow` what it writes after, until the lease ends."""
        if not follow:
            yield from _lines(self._stored(lease_id, since, None, None))
            return
        with translated():
            watch = self.transport.watch_lease(lease_id, output=True).start()
        try:
            seen: Counter[tuple[float, int, str]] = Counter()
            stored = self._stored(lease_id, since, watch.live_from, seen)
            yield from _lines(_chain(stored, self._follow(watch, lease_id, None, seen)))
        finally:
            with contextlib.suppress(Exception):
                watch.close()

    def _stored(self, lease_id: str, since: float | None, keep_after: float | None,
                seen: Counter[tuple[float, int, str]] | None) -> Iterator[str]:
        """The output stored so far, page by page; what is stamped from `keep_after` on is
        counted in `seen` (the live output may bring it again)."""
        after_seq = 0
        while True:
            body: dict[str, Any] = {"lease": lease_id, "kind": "output", "after_seq": after_seq,
                                    "limit": 500}
            if since is not None and after_seq == 0:
                body["since"] = since
            with translated():
                reply = self.transport.replay_telemetry(body)
            result = _result_of(reply)
            after_seq = max(after_seq, int(result.get("last_seq") or 0))
            for sample in result.get("samples") or []:
                after_seq = max(after_seq, int(sample.get("seq") or 0))
                event = sample.get("event") or {}
                text = (event.get("attrs") or {}).get("text")
                if isinstance(text, str):
                    at = float(event.get("at") or 0.0)
                    if seen is not None and keep_after is not None and at >= keep_after:
                        seen[(at, int(event.get("seq") or 0), text)] += 1
                    yield text
            if result.get("at_end", True) or not (result.get("samples")
                                                   or result.get("last_seq")):
                return

    # -- artifacts and secrets ---------------------------------------------------------------

    def artifacts(self, lease_id: str) -> list[Artifact]:
        """The files the lease's job kept (over NATS, or the HTTP gateway)."""
        from bus.objects import artifacts_bucket

        prefix = f"{lease_id}/"
        with translated():
            found = self.transport.files().list(artifacts_bucket(self._files_tenant()), prefix)
        return [Artifact(name=o.name.removeprefix(prefix), size_bytes=o.size_bytes,
                         sha256=o.sha256, stored_at=o.mtime[:19]) for o in found]

    def _files_tenant(self) -> str:
        """The tenant whose buckets these are: a gateway's token names it when no tenant
        was given (the gateway reads only that tenant's buckets whatever is asked)."""
        if not self.tenant and hasattr(self.transport, "whoami"):
            with translated():
                self.tenant = str((self.transport.whoami().get("result") or {}).get("tenant")
                                  or "")
        if not self.tenant:
            raise PoolError("no_tenant", "artifacts belong to a tenant: name one")
        return self.tenant

    def download(self, lease_id: str, dest: str | os.PathLike[str]) -> list[Path]:
        """Every artifact of the lease into `dest`, each verified against its SHA-256."""
        from bus.objects import artifacts_bucket

        root = Path(dest)
        got: list[Path] = []
        for a in self.artifacts(lease_id):
            rel = PurePosixPath(a.name)
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise PoolError("artifact_unsafe", f"artifact {a.name!r} names a path "
                                f"outside {root}")
            target = root.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with translated():
                self.transport.files().get(artifacts_bucket(self._files_tenant()),
                                           f"{lease_id}/{a.name}", target)
            got.append(target)
        return got

    def set_secret(self, name: str, value: bytes) -> dict[str, Any]:
        """Store a new version of a secret; its name, version and size come back."""
        import base64

        reply = self._secret("set", {"name": name, "value": base64.b64encode(value).decode()})
        return dict(reply.get("secret") or {})

    def secrets(self) -> list[dict[str, Any]]:
        """The tenant's secrets: names, versions and sizes (never values)."""
        return list(self._secret("list", {}).get("secrets") or [])

    def delete_secret(self, name: str) -> None:
        self._secret("delete", {"name": name})

    def _secret(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        with translated():
            reply = self.transport.secret(verb, body)
        return _result_of(reply)

    def close(self) -> None:
        with translated():
            self.transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transport(url: str | None, *, token: str | None, tenant: str, user: str | None,
               password: str | None, timeout: float) -> Any:
    if not url:
        raise PoolError("no_url", "Client: give a URL (http(s):// with token=, nats:// with "
                        "tenant=) or use Client.from_context()")
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        if not token:
            raise PoolError("no_token", f"{url}: the HTTP API needs token=")
        return HttpClient(url, token, tenant=tenant, timeout=timeout)
    if scheme in ("nats", "tls"):
        if not tenant:
            raise PoolError("no_tenant", f"{url}: over NATS, say which tenant with tenant=")
        from client.api import PoolClient

        options: dict[str, Any] = {}
        if user is not None:
            options.update(user=user, password=password or "")
        with translated():
            return PoolClient(url, tenant, timeout=timeout, **options)
    raise PoolError("bad_url", f"{url}: not an http://, https:// or nats:// URL")


def _chain(*parts: Iterator[str]) -> Iterator[str]:
    for part in parts:
        yield from part


def _job(command: Sequence[str], image: str | None, env: Mapping[str, str] | None,
         artifacts: Sequence[str] = ()) -> dict[str, Any]:
    if isinstance(command, str):
        raise PoolError("bad_command", "command: a list of words, e.g. ['echo', 'hi']")
    job: dict[str, Any] = {"command": list(command)}
    if image:
        job["image"] = image
    if env:
        job["env"] = dict(env)
    if artifacts:
        job["artifacts"] = list(artifacts)
    return job


def _result_of(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        raise PoolError.from_envelope(reply)
    return dict(reply.get("result") or {})


def _lease_of(reply: dict[str, Any]) -> Lease:
    if not reply.get("ok"):
        raise PoolError.from_envelope(reply)
    try:
        return msgspec.convert(reply.get("lease"), Lease)
    except msgspec.ValidationError as e:
        raise PoolError("bad_reply", f"the lease in the reply: {e}") from e
