"""Version 1 of the interactive sessions' wire types: a tenant's request to open an exec, an
attach or a port-forward into its running lease, and the order that tells the lease's node
(docs/exec.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from schemas.v1 import Count, SchemaVersion, SubjectToken

# chosen by the client (so it can listen before it asks): long enough not to be guessed
SessionId = Annotated[str, Meta(pattern=r"^[a-z0-9]{16,64}(?!\n)$", min_length=16, max_length=64)]
Argument = Annotated[str, Meta(max_length=4096)]
Command = Annotated[list[Argument], Meta(max_length=256)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Cells = Annotated[int, Meta(ge=1, le=10_000)]
SessionKind = Literal["exec", "forward", "attach"]


def _check(kind: str, command: list[str], port: int | None) -> None:
    if kind == "exec" and not command:
        raise ValueError("an exec session needs a command")
    if kind == "exec" and port is not None:
        raise ValueError("an exec session takes no port")
    if kind == "forward" and (port is None or command):
        raise ValueError("a forward session needs a port and no command")
    if kind == "attach" and (port is not None or command):
        raise ValueError("an attach session takes no command and no port")


class SessionOpen(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Open a session into the tenant's running lease (`pool.cmd.<tenant>.lease.<id>.session`):
    run `command` in its sandbox (with a terminal when `tty`), forward to `port` there, or
    attach to the job's own output (and its stdin, when it was started with one)."""

    schema_version: SchemaVersion = 1
    session_id: SessionId
    kind: SessionKind = "exec"
    command: Command = []
    tty: bool = False
    rows: Cells | None = None
    cols: Cells | None = None
    port: Port | None = None

    def __post_init__(self) -> None:
        _check(self.kind, self.command, self.port)


class SessionOrder(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The pool tells the lease's node to join a session (`pool.agent.<node>.session`), made
    from the `SessionOpened` event in the log."""

    schema_version: SchemaVersion = 1
    lease_id: SubjectToken
    epoch: Count
    tenant: SubjectToken
    session_id: SessionId
    kind: SessionKind = "exec"
    command: Command = []
    tty: bool = False
    rows: Cells | None = None
    cols: Cells | None = None
    port: Port | None = None

    def __post_init__(self) -> None:
        _check(self.kind, self.command, self.port)


PUBLIC_STRUCTS: tuple[type[Struct], ...] = (SessionOpen, SessionOrder)
