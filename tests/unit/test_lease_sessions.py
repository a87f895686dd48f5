"""A lease's exec and port-forward sessions in the domain: only while it runs, each an event,
at most SESSIONS_PER_WINDOW per window."""

from __future__ import annotations

import pytest

from domain.errors import IllegalTransition, LeaseExpired, SessionLimit
from domain.lease import SESSION_WINDOW_SECONDS, SESSIONS_PER_WINDOW
from tests.unit.test_domain_lease import new_lease, running_lease

SID = "0123456789abcdef0123456789abcdef"


def test_a_running_lease_records_who_opened_what_and_when() -> None:
    lease = running_lease()
    lease.open_session(20, session_id=SID, kind="exec", command=("sh",), tty=True, rows=24,
                       cols=80)
    event = lease.collect_events()[-1]
    assert type(event).__name__ == "SessionOpened"
    assert lease.last_session == {"session_id": SID, "kind": "exec", "command": ["sh"],
                                  "tty": True, "port": None, "rows": 24, "cols": 80,
                                  "epoch": lease.epoch, "at": 20.0}
    assert lease.state.value == "running"  # a session changes no state


def test_a_lease_that_is_not_running_takes_no_session() -> None:
    queued = new_lease()
    queued.queue(1)
    with pytest.raises(IllegalTransition):
        queued.open_session(2, session_id=SID, kind="exec", command=("true",))
    done = running_lease()
    done.release(20, exit_code=0)
    with pytest.raises(IllegalTransition):
        done.open_session(21, session_id=SID, kind="forward", port=80)
    late = running_lease()
    assert late.deadline is not None
    with pytest.raises(LeaseExpired):
        late.open_session(late.deadline + 1, session_id=SID, kind="exec", command=("true",))


def test_sessions_past_the_window_s_limit_are_refused_until_it_passes() -> None:
    lease = running_lease()
    for i in range(SESSIONS_PER_WINDOW):
        lease.open_session(20 + i * 0.1, session_id=f"{i:032x}", kind="exec", command=("t",))
    with pytest.raises(SessionLimit) as refused:
        lease.open_session(25, session_id=SID, kind="exec", command=("t",))
    assert refused.value.details["retry_after_seconds"] == SESSION_WINDOW_SECONDS - 5
    lease.open_session(20 + SESSION_WINDOW_SECONDS, session_id=SID, kind="exec", command=("t",))
