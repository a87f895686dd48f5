"""The web dashboard at `/`: placeholder until the page lands."""

from __future__ import annotations

from typing import Any

from gateway.shared import Gateway


def handlers(gw: Gateway) -> list[Any]:
    return []
