"""The web dashboard at `/`: placeholder until the page lands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.app import Gateway


def handlers(gw: Gateway) -> list[Any]:
    return []
