"""How `pool lease watch` prints a lease's changes: one line a change, or an envelope a line
with `--json`."""

from __future__ import annotations

from typing import Any

from cli.output import print_item


def print_change(item: Any, as_json: bool) -> None:
    import msgspec

    r = item.record
    if as_json:
        body = msgspec.to_builtins(r) if r is not None else {"error": item.error}
        print_item({"seq": item.seq, **body})
        return
    if r is None:
        print(f"{item.seq}  undecodable record on {item.subject}: {item.error}", flush=True)
        return
    line = change_line(r.at, r.lease_id, r.previous_state, r.state, r.node_id, r.end_reason,
                        r.exit_code)
    if r.attempt_end_reason:  # a retry: how the attempt before ended
        line += f"  attempt {r.attempt - 1} {r.attempt_end_reason}, attempt {r.attempt} next"
    elif r.attempt > 1:
        line += f"  attempt {r.attempt}"
    if r.held_reason:
        line += f"  ({r.held_reason})"
    print(line, flush=True)


def print_lease(lease: dict[str, Any], as_json: bool) -> None:
    if as_json:
        keys = ("lease_id", "tenant", "pool_id", "state", "end_reason", "node_id", "devices",
                "epoch", "exit_code", "version")
        print_item({"seq": None, **{k: lease.get(k) for k in keys}})
        return
    print(change_line(None, str(lease.get("lease_id")), None, str(lease.get("state")),
                       lease.get("node_id"), lease.get("end_reason"), lease.get("exit_code")),
          flush=True)


def change_line(at: float | None, lease_id: str, previous: str | None, state: str,
                 node: str | None, end_reason: str | None, exit_code: int | None) -> str:
    import time

    parts = [f"{previous} → {state}" if previous else state]
    if node:
        parts.append(f"on {node}")
    if end_reason:
        parts.append(end_reason)
    if exit_code is not None:
        parts.append(f"exit code {exit_code}")
    when = time.strftime("%H:%M:%S", time.localtime(at) if at is not None else time.localtime())
    return f"{when}  {lease_id}  {'  '.join(parts)}"
