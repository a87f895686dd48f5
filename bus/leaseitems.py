"""What following one lease hands its caller (its feed's changes, its job's output) and the rule
that output is passed on only from the node the feed names; shared by both lease watches.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_WAITING = 1000  # output samples of a node the feed has not named (yet) kept per watch


@dataclass(frozen=True)
class Output:
    """A piece of the job's output as the agent published it: its text, and when (the agent's
    clock) and in which heartbeat round, which tell it from the same text stored earlier."""

    text: str
    at: float
    seq: int

    @property
    def key(self) -> tuple[float, int, str]:
        return self.at, self.seq, self.text


@dataclass(frozen=True)
class Change:
    """A feed record of the lease: a state it took, and its feed sequence. `record` is a
    schemas.feed.FeedRecord, or a FeedFields where the record was read without the schemas."""

    seq: int
    record: Any


class FeedFields(dict[str, Any]):
    """A feed record's fields as JSON gives them, read as the record's attributes (the lean
    watch's: it loads no schemas)."""

    @property
    def state(self) -> str | None:
        return self.get("state")

    @property
    def node_id(self) -> str | None:
        return self.get("node_id")


def output_sample(data: bytes) -> tuple[str, float, int] | None:
    """An output sample's text, time and round, or None when it is not one."""
    try:
        sample = json.loads(data)
        text = sample["attrs"]["text"]
        at, seq = float(sample.get("at", 0.0)), int(sample.get("seq", 0))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return (text, at, seq) if isinstance(text, str) else None


class OutputGate:
    """A node speaks only for the leases it holds: its output is handed over once the feed (the
    control plane's word) names it as the lease's node; till then it waits here."""

    def __init__(self, hand: Callable[[Output], None]) -> None:
        self._hand = hand
        self._nodes: set[str] = set()
        self._waiting: list[tuple[str, Output]] = []

    def output(self, subject: str, out: Output) -> None:
        """`out` as published on `subject` (pool.tel.<pool>.<node>.<tenant>.<lease>.output)."""
        parts = subject.split(".")
        node = parts[3] if len(parts) == 7 else ""
        if node in self._nodes:
            self._hand(out)
        elif node:
            self._waiting.append((node, out))
            del self._waiting[:-MAX_WAITING]  # a forger's flood: the oldest go

    def placed(self, node: str | None) -> None:
        """The feed names `node` as the lease's: its output waiting so far is handed over."""
        if not node or node in self._nodes:
            return
        self._nodes.add(node)
        for n, out in self._waiting:
            if n == node:
                self._hand(out)
        self._waiting = [(n, out) for n, out in self._waiting if n != node]
