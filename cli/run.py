"""`pool lease run|logs|watch` and `request --wait`: a lease from request to its job's exit code."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from bus.subjects import command_subject
from cli.output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError, print_envelope

POLL_SECONDS = 0.2  # how often a waiting command looks at its lease again
OUTPUT_POLL_SECONDS = 0.3  # how often the job's output is read again while it runs
RENEW_MARGIN_SECONDS = 60  # renew once this close to the deadline (or a third of the term)
# the states a lease leaves no more (domain/lease.py TERMINAL_STATES)
FINAL_STATES = frozenset({"released", "cancelled", "voided", "preempted", "rejected"})


def exit_code_of(lease: dict[str, Any]) -> int:
    """The exit code `pool lease run` ends with: the job's own when it ran, else 1 (130 for a
    cancelled lease, as for an interrupted command)."""
    reason = lease.get("end_reason")
    code = lease.get("exit_code")
    if reason == "succeeded":
        return EXIT_OK
    if reason == "failed":
        return code if isinstance(code, int) and 0 < code < 256 else EXIT_FAILED
    if reason == "cancelled":
        return EXIT_INTERRUPTED
    return EXIT_FAILED


class Waited:
    """What waiting for a reservation came to: the lease when reserved (or running), or the
    lease and the reasons it will not be."""

    def __init__(self, lease: dict[str, Any], why: dict[str, Any] | None = None) -> None:
        self.lease = lease
        self.why = why

    @property
    def reserved(self) -> bool:
        return self.lease.get("state") in ("reserved", "running")


def _get(c: Any, lease_id: str) -> dict[str, Any]:
    reply = c.lease(lease_id, "get")
    if not reply.get("ok"):
        raise Refused(reply)
    return dict(reply["lease"])


class Refused(Exception):
    """The control plane refused a command this verb needed; its error code and message."""

    def __init__(self, reply: dict[str, Any]) -> None:
        err = reply.get("error") or {}
        super().__init__(str(err.get("message") or "refused"))
        self.code = str(err.get("code") or "error")


def wait_reserved(c: Any, lease_id: str, *, timeout: float | None = None,
                  say: Callable[[str], None] | None = None) -> Waited:
    """Poll until the lease is reserved, or ended, or `timeout` seconds have passed; a lease
    that still waits then comes back with `why` it waits."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said = ""
    while True:
        lease = _get(c, lease_id)
        state = str(lease.get("state"))
        if state in ("reserved", "running"):
            return Waited(lease)
        if state in FINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
            why = c.lease(lease_id, "why")
            return Waited(lease, (why.get("result") or why.get("error") or {}))
        if say is not None and state != said:
            said = state
            say(f"lease {lease_id} {state}; waiting for a reservation (Ctrl-C cancels it)")
        time.sleep(POLL_SECONDS)


def _why_line(waited: Waited) -> str:
    lease, why = waited.lease, waited.why or {}
    reasons = why.get("reasons") or {}
    code = lease.get("rejection_code") or lease.get("end_reason") or lease.get("state")
    text = ", ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
                     for k, v in reasons.items()) if isinstance(reasons, dict) else str(reasons)
    return f"lease {lease.get('lease_id')} not reserved ({code}){': ' + text if text else ''}"


def report_not_reserved(waited: Waited, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"ok": False, "lease": waited.lease, "result": {"why": waited.why},
                          "error": {"code": "not_reserved", "message": _why_line(waited)}}))
    print(f"pool: error [not_reserved]: {_why_line(waited)}", file=sys.stderr)
    return EXIT_FAILED


class OutputReader:
    """The job's output, read page by page through the control plane's telemetry replay (as the
    lease's tenant: the server lets a tenant read only its own leases' samples)."""

    def __init__(self, c: Any, tenant: str, lease_id: str, since: float | None = None) -> None:
        self.c = c
        self.subject = command_subject(tenant, "telemetry", "replay")
        self.lease_id = lease_id
        self.after_seq = 0
        self.since = since

    def read(self, write: Callable[[str], None]) -> bool:
        """Write every chunk stored so far; True when the stream was read to its end."""
        while True:
            body: dict[str, Any] = {"lease": self.lease_id, "kind": "output",
                                    "after_seq": self.after_seq, "limit": 500}
            if self.since is not None and self.after_seq == 0:
                body["since"] = self.since
            reply = self.c.call(self.subject, body)
            if not reply.get("ok"):
                raise Refused(reply)
            result = reply.get("result") or {}
            for sample in result.get("samples") or []:
                self.after_seq = max(self.after_seq, int(sample.get("seq") or 0))
                event = sample.get("event") or {}
                text = (event.get("attrs") or {}).get("text")
                if isinstance(text, str):
                    write(text)
            if result.get("at_end", True) or not result.get("samples"):
                return True


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _renew_if_due(c: Any, lease: dict[str, Any]) -> None:
    """Renew a running lease near its deadline, unless that is already its maximum runtime."""
    deadline, started = lease.get("deadline"), lease.get("started_at")
    if lease.get("state") != "running" or deadline is None or started is None:
        return
    limit = float(started) + float(lease.get("maximum_runtime_seconds") or 0)
    if deadline >= limit - 1:
        return  # the whole maximum runtime is granted: nothing to renew
    term = max(1.0, float(deadline) - float(started))
    if float(deadline) - time.time() < max(RENEW_MARGIN_SECONDS, term / 3):
        c.lease(str(lease["lease_id"]), "renew")


def follow_until_done(c: Any, reader: OutputReader, lease_id: str, *,
                      renew: bool = False) -> dict[str, Any]:
    """Stream the job's output until the lease has ended and its output is drained; renew on
    the way when asked. Returns the ended lease."""
    next_look = 0.0
    while True:
        reader.read(_write)
        if time.monotonic() >= next_look:
            lease = _get(c, lease_id)
            if str(lease.get("state")) in FINAL_STATES:
                reader.read(_write)  # what the agent shipped before it reported the end
                return lease
            if renew:
                _renew_if_due(c, lease)
            next_look = time.monotonic() + 1.0
        time.sleep(OUTPUT_POLL_SECONDS)


def _cancel(c: Any, lease_id: str, say: Callable[[str], None]) -> None:
    """Ctrl-C: cancel the lease and wait (briefly) until its job is confirmed stopped."""
    say(f"cancelling lease {lease_id}…")
    c.lease(lease_id, "cancel", {"reason": "interrupted"})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if str(_get(c, lease_id).get("state")) in FINAL_STATES:
                break
        except Refused:
            break
        time.sleep(POLL_SECONDS)
    say(f"lease {lease_id} cancelled")


def run_lease(c: Any, tenant: str, body: dict[str, Any], job: dict[str, Any], *,
              detach: bool, as_json: bool, quiet: bool,
              on_commit_refused: Callable[[], None] | None = None) -> int:
    """`pool lease run`: request, wait for the reservation, commit the job, stream its output,
    renew as needed, and end with the job's exit code. Ctrl-C cancels the lease."""

    def say(text: str) -> None:
        if not quiet:
            print(f"pool: {text}", file=sys.stderr, flush=True)

    reply = c.request_lease(body)
    if not reply.get("ok"):
        return print_envelope(reply, as_json)
    lease_id = str(reply["lease"]["lease_id"])
    try:
        waited = wait_reserved(c, lease_id, say=say)
        if not waited.reserved:
            return report_not_reserved(waited, as_json)
        committed = c.lease(lease_id, "commit", {"job": job})
        if not committed.get("ok"):
            # the reservation goes back at once, not at the commit timeout, and what this run
            # stored for the job is removed
            c.lease(lease_id, "release", {})
            if on_commit_refused is not None:
                on_commit_refused()
            return print_envelope(committed, as_json)
        lease = committed["lease"]
        if detach:
            print(json.dumps({"ok": True, "lease": lease}) if as_json else lease_id)
            return EXIT_OK
        say(f"lease {lease_id} running on {lease.get('node_id')}")
        ended = follow_until_done(c, OutputReader(c, tenant, lease_id), lease_id, renew=True)
    except KeyboardInterrupt:
        _cancel(c, lease_id, say)
        return EXIT_INTERRUPTED
    code = exit_code_of(ended)
    if as_json:
        print(json.dumps({"ok": code == 0, "lease": ended}))
    if code != EXIT_OK:
        say(f"lease {lease_id} {ended.get('state')} ({ended.get('end_reason')}"
            + (f", exit code {ended.get('exit_code')}" if ended.get("exit_code") is not None
               else "") + ")")
    return code


def parse_duration(text: str | None, flag: str) -> float | None:
    """`--since 10m`: seconds back from now as an epoch time (None when not given)."""
    if not text:
        return None
    from cli.output import parse_since

    try:
        when = parse_since(text)
    except UsageError:
        raise UsageError(f"{flag} {text!r}: not a duration (30s, 10m, 2h) nor an ISO time") \
            from None
    return float(when.timestamp())
