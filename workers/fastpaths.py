"""The one switch of the plane's fast paths, POOL_FAST_PATHS=on|off, read once at process start:
the domain's lean trigger and fold (ADR 012), the commands answered on the bus's loop (ADR 010)
and the node table's memory of shapes that fit nowhere."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

from domain.fold import use_lean_paths
from domain.policy.placement import remember_misses

ENV = "POOL_FAST_PATHS"
_VALUES = {"": True, "on": True, "off": False}


class FastPathsSettingError(ValueError):
    """POOL_FAST_PATHS is neither `on` nor `off`."""

    code: ClassVar[str] = "invalid_fast_paths_setting"


def parse(value: str | None) -> bool:
    """True for `on` (or unset, the default), False for `off`; anything else is refused."""
    try:
        return _VALUES[(value or "").strip().lower()]
    except KeyError:
        raise FastPathsSettingError(
            f"{ENV}={value!r}: expected 'on' or 'off' (unset means 'on')") from None


def configure(env: Mapping[str, str]) -> bool:
    """Read the switch from `env` and set every fast path by it; returns whether they are on."""
    global ON
    ON = parse(env.get(ENV))
    use_lean_paths(ON)
    remember_misses(ON)
    return ON


ON: bool = True
configure(os.environ)  # once, when the process first imports the workers' application
