"""The scheduler's whole fold as plain data, to compare two schedulers (a restored one and a
full replay) structure by structure: a difference names the attribute path where it lies."""

from __future__ import annotations

import enum
import inspect
from typing import Any

# what is not the fold: connections, threads, settings, the batch being built (spelt here
# apart from the checkpoint's own list, so that a list that drops a part of the fold fails)
NOT_THE_FOLD = frozenset({
    "app", "recorder", "clock", "leads", "_lock", "_placing", "_inflight", "_decode",
    "_read_ahead", "_prefetch", "_read_timeout", "_holds", "_held", "pages_read_ahead",
    "pages_read_ahead_unused", "checkpoints", "max_examined_per_cycle", "backfill",
    "max_preemption_plans_per_cycle", "_plans_left", "decisions",
})
_PLAIN = (str, int, float, bool, bytes, type(None))


def plain(value: Any, _seen: frozenset[int] = frozenset()) -> Any:
    """`value` as nested dicts, lists and scalars: objects by their type and attributes (or
    slots), arrays as lists, sets sorted; the LeaseMemory's compact records rebuilt."""
    if isinstance(value, (*_PLAIN, enum.Enum)):
        return value
    if id(value) in _seen:
        return "<cycle>"
    seen = _seen | {id(value)}
    if inspect.ismethod(value):  # its scheduler is checked apart (see fold_of)
        return f"<method {value.__func__.__qualname__}>"
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and type(value).__module__.startswith("numpy"):
        return tolist()
    if isinstance(value, dict):
        return {_key(k): plain(v, seen) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, seen) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v, seen) for v in value), key=repr)
    if type(value).__name__ in ("UUID", "datetime", "Decimal", "date", "timedelta"):
        return repr(value)
    if type(value).__name__ == "deque":
        return [plain(v, seen) for v in value]
    out: dict[str, Any] = {"__type__": type(value).__name__}
    attrs = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(value, slot):
                attrs[slot] = getattr(value, slot)
    attrs.pop("_pending_events", None)
    if not attrs:
        return repr(value)
    for k, v in attrs.items():
        out[k] = plain(v, seen)
    return out


def _key(k: Any) -> Any:
    return k if isinstance(k, (str, int, float)) else repr(k)


def fold_of(scheduler: Any) -> dict[str, Any]:
    """Everything the scheduler's checkpoint holds, as plain data; its memory of aggregates
    compared lease by lease whether held whole or compactly."""
    fold = scheduler.fold  # the scheduler's fold state (its other parts are not the fold)
    out = {k: plain(v) for k, v in vars(fold).items()
           if k not in NOT_THE_FOLD and k not in ("aggregates", "_fold")}
    memory = scheduler.aggregates
    out["aggregates"] = {str(k): plain(v) for k, v in sorted(memory.items(), key=lambda kv: kv[0])}
    out["held_compactly"] = sorted(str(k) for k in memory.queued)
    # the methods its pools hold are its fold's own, never another scheduler's
    for ps in scheduler.pools.values():
        for part in vars(ps).values():
            for v in getattr(part, "__dict__", {}).values():
                assert not inspect.ismethod(v) or v.__self__ is fold
    return out


def differences(a: Any, b: Any, path: str = "", limit: int = 10) -> list[str]:
    """Where `a` and `b` (plain data) differ, as paths; at most `limit`."""
    out: list[str] = []
    if type(a) is not type(b):
        return [f"{path}: {a!r:.120} != {b!r:.120}"]
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=repr):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'second' if k in b else 'first'}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}", limit)
            if len(out) >= limit:
                break
    elif isinstance(a, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out += differences(x, y, f"{path}[{i}]", limit)
            if len(out) >= limit:
                break
    elif a != b:
        out.append(f"{path}: {a!r:.120} != {b!r:.120}")
    return out[:limit]
