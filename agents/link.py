"""What the node agent asks of its link to the control plane (bus.agentbus.AgentLink; a
simulated node's agents.simulate.SimLink has what a simulated node uses). Each member is
called as it is, never probed for."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bus.agentbus import AgentCommand
    from bus.objects import FileStore


class Link(Protocol):
    def request(self, suffix: str, body: bytes, *, timeout: float = 5.0,
                headers: dict[str, str] | None = None) -> bytes:
        """A report on `pool.node.<node>.<suffix>` (register, heartbeat, lease reports)."""
        ...

    def fetch(self, batch: int = 16, timeout: float = 1.0) -> list[AgentCommand]:
        """Commands waiting for this node."""
        ...

    def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Telemetry: fire and forget."""
        ...

    def send(self, subject: str, body: bytes) -> None:
        """A session's frame, which must not be lost silently."""
        ...

    def send_soon(self, subject: str, body: bytes) -> concurrent.futures.Future[None]:
        """`send` without waiting for it."""
        ...

    def subscribe(self, subject: str, on_data: Callable[[str, bytes], None]
                  ) -> Callable[[], None]:
        """A session's incoming frames; what it returns ends the subscription."""
        ...

    def files(self) -> FileStore | None:
        """The tenants' file buckets (work directories, artifacts); None where the link has
        none (a job asking for files is refused there: agents/workdir.py)."""
        ...
