"""`pool lease run|logs|watch` and `request --wait`: a lease from request to its job's exit code.

Waiting follows the lease's feed and its job's live output as they come (bus/leasewatch.py):
nothing is polled.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bus.subjects import command_subject
from cli.output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError, print_envelope

if TYPE_CHECKING:
    from bus.leasewatch import LeaseWatch

# quiet this long, a wait reads the lease once: a lost feed message cannot hang it
GUARD_SECONDS = 5.0
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


def _record_lease(record: Any) -> dict[str, Any]:
    """A feed record as the fields of a lease that `get` would show."""
    if isinstance(record, dict):  # read without the schemas (bus.leanwatch)
        return dict(record)
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(record)
    return out


def _latest(watch: LeaseWatch, first: Any) -> Any:
    """`first`, or the newest feed record already come after it (a replay arrives in pages):
    what the lease is now, as far as the feed has told."""
    from bus.leaseitems import Change

    latest = first
    for got in watch.pending():
        if isinstance(got, Change):
            latest = got
    return latest


def wait_reserved(c: Any, lease_id: str, *, timeout: float | None = None,
                  say: Callable[[str], None] | None = None, watch: LeaseWatch | None = None,
                  full: bool = True) -> Waited:
    """Follow the lease's feed until it is reserved, or ended, or `timeout` seconds have
    passed; a lease that still waits then comes back with `why` it waits. `full`: the lease as
    `get` shows it, else the fields of its feed record (one request fewer)."""
    from bus.leaseitems import Change

    deadline = None if timeout is None else time.monotonic() + timeout
    said = ""
    own = watch is None
    if watch is None:
        watch = c.watch_lease(lease_id).start()
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            got = None if left is not None and left <= 0 else \
                watch.get(GUARD_SECONDS if left is None else min(left, GUARD_SECONDS))
            if got is not None and not isinstance(got, Change):
                continue  # output before the reservation: none is expected
            if got is None:  # the deadline, or a quiet feed: the lease as it is now
                lease, known = _get(c, lease_id), True
            else:
                lease, known = _record_lease(_latest(watch, got).record), False
            state = str(lease.get("state"))
            if state in ("reserved", "running"):
                return Waited(_get(c, lease_id) if full and not known else lease)
            if state in FINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
                why = c.lease(lease_id, "why")
                if full and not known:
                    lease = _get(c, lease_id)
                return Waited(lease, (why.get("result") or why.get("error") or {}))
            if say is not None and state != said:
                said = state
                say(f"lease {lease_id} {state}; waiting for a reservation (Ctrl-C cancels it)")
    finally:
        if own:
            watch.close()


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
        # the samples read that the live output may bring again (those from `keep_after` on)
        self.seen: Counter[tuple[float, int, str]] = Counter()
        self.keep_after: float | None = None

    def read(self, write: Callable[[str], None]) -> bool:
        """Write every chunk stored so far; True when the stream was read to its end."""
        while True:
            body: dict[str, Any] = {"lease": self.lease_id, "kind": "output",
                                    "after_seq": self.after_seq, "limit": 500}
            if self.since is not None and self.after_seq == 0:
                body["since"] = self.since
            reply = self.c.replay_telemetry(body)
            if not reply.get("ok"):
                raise Refused(reply)
            result = reply.get("result") or {}
            # past samples left out as not their lease's node's: never asked for again
            self.after_seq = max(self.after_seq, int(result.get("last_seq") or 0))
            for sample in result.get("samples") or []:
                self.after_seq = max(self.after_seq, int(sample.get("seq") or 0))
                event = sample.get("event") or {}
                text = (event.get("attrs") or {}).get("text")
                if isinstance(text, str):
                    write(text)
                    at = float(event.get("at") or 0.0)
                    if self.keep_after is not None and at >= self.keep_after:
                        self.seen[(at, int(event.get("seq") or 0), text)] += 1
            if result.get("at_end", True):
                return True
            if not result.get("samples") and not result.get("last_seq"):
                return True


def write_out(text: str) -> None:
    from cli.terminal import write_output

    write_output(text)  # a job's escape sequences are shown, never run, on a terminal


def _renew_due_at(lease: dict[str, Any]) -> float | None:
    """When a running lease is to be renewed (epoch seconds): once this close to its deadline
    (or a third of its term); None when its whole maximum runtime is granted already."""
    deadline, started = lease.get("deadline"), lease.get("started_at")
    if deadline is None or started is None:
        return None
    limit = float(started) + float(lease.get("maximum_runtime_seconds") or 0)
    if deadline >= limit - 1:
        return None  # the whole maximum runtime is granted: nothing to renew
    term = max(1.0, float(deadline) - float(started))
    return float(deadline) - max(RENEW_MARGIN_SECONDS, term / 3)


def follow_until_done(c: Any, watch: LeaseWatch, lease_id: str, *,
                      lease: dict[str, Any] | None = None,
                      seen: Counter[tuple[float, int, str]] | None = None) -> dict[str, Any]:
    """Write the job's output as it comes until the lease's feed says it ended (every output
    published before the end comes before it, on the same connection); renew on the way when
    given the `lease` as its commit left it. `seen`: output read from the store already, not
    written twice. Returns the ended lease's feed record (as a dict)."""
    from bus.leaseitems import Change, Output

    state = str((lease or {}).get("state"))
    due = _renew_due_at(lease) if lease is not None else None
    while True:
        wait = GUARD_SECONDS if due is None else max(0.0, min(GUARD_SECONDS, due - time.time()))
        got = watch.get(wait)
        if got is None:
            if due is not None and time.time() >= due:
                if state == "running":
                    renewed = c.lease(lease_id, "renew")
                    if renewed.get("ok"):
                        due = _renew_due_at(renewed["lease"])
                        continue
                due = time.time() + 1.0  # not running yet, or refused: try again shortly
                continue
            current = _get(c, lease_id)  # a quiet feed: the lease as it is now
            if str(current.get("state")) in FINAL_STATES:
                return current
            continue
        batch = [got, *watch.pending()]
        text = []
        ended = None
        for item in batch:
            if isinstance(item, Output):
                if seen and seen[item.key] > 0:
                    seen[item.key] -= 1
                    continue
                text.append(item.text)
            elif isinstance(item, Change):
                state = item.record.state
                if state in FINAL_STATES and ended is None:
                    ended = _record_lease(item.record)
        if text:
            write_out("".join(text))
        if ended is not None:
            return ended


def _cancel(c: Any, lease_id: str, say: Callable[[str], None],
            watch: LeaseWatch | None) -> None:
    """Ctrl-C: cancel the lease and wait (briefly) until its job is confirmed stopped."""
    from bus.leaseitems import Change

    say(f"cancelling lease {lease_id}…")
    c.lease(lease_id, "cancel", {"reason": "interrupted"})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        got = watch.get(min(GUARD_SECONDS, deadline - time.monotonic())) \
            if watch is not None else None
        if isinstance(got, Change) and got.record.state in FINAL_STATES:
            break
        if got is None:
            try:
                if str(_get(c, lease_id).get("state")) in FINAL_STATES:
                    break
            except Refused:
                break
            if watch is None:
                time.sleep(0.2)
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
    watch: LeaseWatch | None = None
    try:
        # the lease's feed and its job's output, subscribed to before the commit
        watch = c.watch_lease(lease_id, output=not detach).start()
        if str(reply["lease"].get("state")) not in ("reserved", "running"):
            waited = wait_reserved(c, lease_id, say=say, watch=watch, full=False)
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
        ended = follow_until_done(c, watch, lease_id, lease=lease)
        if as_json:
            ended = _get(c, lease_id)  # the whole lease, as `get` shows it
    except KeyboardInterrupt:
        _cancel(c, lease_id, say, watch)
        return EXIT_INTERRUPTED
    finally:
        if watch is not None:
            watch.close()
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
