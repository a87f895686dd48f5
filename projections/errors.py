"""Errors raised by projections/: the views, their queries and the embedded PostgreSQL."""

from __future__ import annotations

from typing import ClassVar


class ProjectionError(Exception):
    """Base class of every error raised by projections/."""

    code: ClassVar[str] = "projection_error"


class DatabaseUnavailable(ProjectionError):
    """PostgreSQL could not be started or reached."""

    code = "database_unavailable"


class ViewsUnavailable(ProjectionError):
    """The views' database could not answer (down, or the views not built yet)."""

    code = "views_unavailable"


class BadQuery(ProjectionError):
    """A filter, tenant, cursor or page size the view cannot take."""

    code = "invalid_field"


class BeforeHistory(BadQuery):
    """A time before the views began keeping their past (or a view that keeps none)."""

    code = "before_history"


class UnknownView(ProjectionError):
    """A view name that is not one of the views."""

    code = "unknown_view"


class PositionMoved(ProjectionError):
    """A view's position went back (a rebuild) after a batch was read for it: read again."""

    code = "position_moved"


# -- the credit audit's checkpoints ---------------------------------------------------------


class CheckpointInvalid(ProjectionError):
    """An audit checkpoint is unreadable, or its content does not match its own digest."""

    code = "audit_checkpoint_invalid"


class CheckpointMismatch(ProjectionError):
    """An audit checkpoint disagrees with the log it claims to summarise."""

    code = "audit_checkpoint_mismatch"
