"""Interactive sessions into a lease's running job (exec, port-forward, attach): each is an
event in the log, so one lease may open only so many per window."""

from __future__ import annotations

from domain.errors import IllegalTransition, SessionLimit
from domain.lease_guards import LeaseGuards
from domain.lease_values import LeaseState

S = LeaseState

# exec and port-forward sessions one lease may open per window: each is an event in the log
SESSIONS_PER_WINDOW = 30
SESSION_WINDOW_SECONDS = 60


class LeaseSessions(LeaseGuards):
    """The sessions opened into the lease's job: who, when and what, never the bytes."""

    def open_session(self, now: float, *, session_id: str, kind: str,
                     command: tuple[str, ...] = (), tty: bool = False, port: int | None = None,
                     rows: int | None = None, cols: int | None = None) -> None:
        """Record that the tenant opened an interactive session (`exec` of `command`, a
        `forward` to `port`, an `attach`) into the running job, if running and unexpired."""
        self._require("open_session", {S.RUNNING})
        self._require_not_past_deadline(now)
        if kind not in ("exec", "forward", "attach"):
            raise IllegalTransition(self.state, "open_session", detail=f"no session kind {kind!r}")
        at = self.session_window_at
        if at is not None and now - at < SESSION_WINDOW_SECONDS \
                and self.sessions_in_window >= SESSIONS_PER_WINDOW:
            raise SessionLimit(
                f"at most {SESSIONS_PER_WINDOW} sessions per {SESSION_WINDOW_SECONDS} s into "
                "one lease", limit=SESSIONS_PER_WINDOW, window_seconds=SESSION_WINDOW_SECONDS,
                retry_after_seconds=at + SESSION_WINDOW_SECONDS - now)
        self._session_opened(at=float(now), session_id=session_id, kind=kind,
                             command=list(command), tty=tty, port=port, rows=rows, cols=cols,
                             epoch=self.epoch)
