"""Shared output of the `pool` command: exit codes, one-line errors, envelopes and tables.

Exit codes mean: 0 ok, 1 the operation failed, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn, TypeAlias

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

Subparsers: TypeAlias = "argparse._SubParsersAction[Parser]"


class Parser(argparse.ArgumentParser):
    """argparse with usage errors in two lines: what is wrong (with a "did you mean" when a
    word is close to one the command knows) and where the help is; exit 2."""

    # the deepest (sub)command parsed last: unknown flags are reported by the top parser,
    # but they belong to this one
    deepest: ClassVar[Parser | None] = None
    words: ClassVar[list[str]] = []  # what the deepest one was given

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        Parser.deepest, Parser.words = self, [str(a) for a in args or ()]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        where = Parser.deepest if message.startswith("unrecognized arguments") else self
        where = where or self
        message = _with_suggestion(message, where, Parser.words if where is Parser.deepest
                                   else [])
        self.exit(EXIT_USAGE, f"{where.prog}: {message}\nsee `{where.prog} --help`\n")


def verb_at_hand(sub: Subparsers, command: str) -> str | None:
    """The word right after `command` on the command line `sub` was built for (by
    cli.main.build_parser for one command line), else None: a group may then add that verb's
    parser alone."""
    words = getattr(sub, "command_words", None)
    if not words or command not in words:
        return None
    rest = words[words.index(command) + 1:]
    return rest[0] if rest and not rest[0].startswith("-") else None


def _with_suggestion(message: str, parser: argparse.ArgumentParser, words: list[str]) -> str:
    choice = re.match(r"(argument [^:]+: invalid choice: '([^']*)') \(choose from (.*)\)$",
                      message)
    if choice:
        offered = re.findall(r"'([^']*)'", choice.group(3))
        near = difflib.get_close_matches(choice.group(2), offered, n=1)
        return choice.group(1) + (f" (did you mean {near[0]!r}?)" if near
                                  else f" (choose from {', '.join(offered)})")
    # a flag it does not know, close to one it does (also when a required flag is "missing"
    # because it was misspelt)
    known = parser._option_string_actions
    for word in words:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, [s for s in known if s.startswith("--")], n=1)
            if close:
                return f"{message} (did you mean {close[0]} for {flag}?)"
    return message


# a request's wire fields and the flags that set them, so a refusal names the flag
FLAG_OF_FIELD = {
    "$.pool_id": "--pool", "$.maximum_runtime_seconds": "--max-runtime",
    "$.priority_class": "--priority", "$.idempotency_key": "--key", "$.image": "--image",
    "$.image_signature": "--image-signature", "$.image_size_bytes": "--image-size",
    "$.count": "--count", "$.env": "--env", "$.command": "the command after --",
    "$.job.command": "the command after --", "$.job.env": "--env", "$.job.image": "--image",
    "$.shape.network.egress": "--egress", "$.extend_seconds": "--extend-seconds",
    "$.exit_code": "--exit-code", "$.reason": "--reason", "$.epoch": "--epoch",
    "$.tenant": "TENANT", "$.amount_microcredits": "AMOUNT", "$.weight": "--weight",
}


def flag_for(path: str) -> str | None:
    """The flag that sets a wire field (`$.shape.cpu_millis` → `--cpu-millis`), if any."""
    if path in FLAG_OF_FIELD:
        return FLAG_OF_FIELD[path]
    if path.startswith("$.shape.") and path.count(".") == 2:
        return "--" + path.removeprefix("$.shape.").replace("_", "-")
    if path.startswith("$.") and path.count(".") == 1:
        return "--" + path.removeprefix("$.").replace("_seconds", "").replace("_", "-")
    return None


def in_flag_terms(err: dict[str, Any]) -> dict[str, Any]:
    """A schema refusal reworded for the command line: the flag instead of the JSON path, the
    rule instead of a regular expression (`--pool must be lowercase letters, digits, - and _,
    at most 128`)."""
    path = str((err.get("reasons") or {}).get("path") or "")
    flag = flag_for(path) if path else None
    if flag is None:
        return err
    message = re.sub(r" - at `[^`]*`$", "", str(err.get("message") or ""))
    rule = re.match(r"Expected `str` matching regex '\^\[a-z0-9_-\]\{1,(\d+)\}", message)
    if rule:
        message = f"must be lowercase letters, digits, - and _, at most {rule.group(1)}"
    else:
        message = re.sub(r"^Expected `(\w+)` ", lambda m: f"must be {m.group(1)} ", message)
        message = message.replace("must be int ", "must be a whole number ")
        message = message.replace(">=", "≥").replace("<=", "≤")
        if path.endswith("_seconds"):
            message += " (seconds)"
    return {**err, "message": f"{flag} {message}", "reasons": {}}


def fail(message: str, code: str = "error", *, as_json: bool = False) -> int:
    """Report a failed operation on stderr (and as an envelope with --json); exit 1."""
    if as_json:
        print(json.dumps({"ok": False, "error": {"code": code, "message": message}}))
    print(f"pool: error [{code}]: {message}", file=sys.stderr)
    return EXIT_FAILED


class UsageError(Exception):
    """The command line cannot be carried out as given: printed in one line, exit 2."""

    code = "usage"


def print_envelope(reply: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(reply))
    elif reply.get("ok"):
        body = reply.get("lease") or reply.get("result") or {}
        width = max((len(k) for k in body), default=0)
        for k, v in body.items():
            if v is None or v == {} or v == []:
                continue
            shown = (value_text(k, v) if k == "shape" or not isinstance(v, (dict, list))
                     else json.dumps(v))
            print(f"{k:<{width}}  {shown}")
    if not reply.get("ok"):
        err = in_flag_terms(reply.get("error") or {})
        reasons = err.get("reasons") or {}
        # a reason that is a flag (value 1) shows as its name: `commit_timeout=1` read as 1 s
        extra = f" ({', '.join(k if v == 1 else f'{k}={v}' for k, v in reasons.items())})" \
            if reasons else ""
        print(f"pool: error [{err.get('code')}]: {err.get('message')}{extra}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def print_result(result: dict[str, Any], as_json: bool, text: str, *,
                 error: tuple[str, str] | None = None) -> int:
    """A command's outcome: with --json the envelope every command prints (`{"ok": true,
    "result": …}`, or `"ok": false` with the result and an `error` when `error` = (code,
    message) says it failed), else `text`; exit 0, or 1 on failure."""
    if as_json:
        envelope: dict[str, Any] = {"ok": error is None, "result": result}
        if error is not None:
            envelope["error"] = {"code": error[0], "message": error[1], "reasons": {}}
        print(json.dumps(envelope, default=str), flush=True)
    else:
        print(text, flush=True)
    if error is not None:
        print(f"pool: error [{error[0]}]: {error[1]}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def print_item(item: dict[str, Any]) -> None:
    """One item of a command that streams (`lease watch`, `telemetry follow`) with --json: one
    envelope a line, `{"ok": true, "result": …}`."""
    print(json.dumps({"ok": True, "result": item}, default=str), flush=True)


def parse_kv(text: str | None, cast: Callable[[str], Any] = int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (text or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[k.strip()] = cast(v.strip())
    return out


# -- values for people (--json keeps the raw ones) ------------------------------------------

TIME_KEYS = ("deadline", "reservation_deadline", "last_heartbeat", "estimated_start")
CREDIT_KEYS = ("microcredits", "credits", "granted", "held", "spent", "available", "shortfall")


def is_time(name: str) -> bool:
    return name.endswith("_at") or name in TIME_KEYS


def when(epoch: float | None, now: float | None = None) -> str:
    """An epoch time as local ISO time with how long ago (or until): `2026-12-03 18:32:05
    (3m ago)`."""
    import datetime as dt
    import time

    if epoch is None:
        return "-"
    now = time.time() if now is None else now
    local = dt.datetime.fromtimestamp(float(epoch)).strftime("%Y-%m-%d %H:%M:%S")
    return f"{local} ({ago(float(epoch), now)})"


def ago(epoch: float, now: float) -> str:
    """`3m ago`, `in 2h`, `now`: the largest whole unit."""
    delta = now - epoch
    seconds = abs(delta)
    if seconds < 1:
        return "now"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            n = f"{int(seconds // size)}{unit}"
            return f"{n} ago" if delta > 0 else f"in {n}"
    return "now"


def _number(x: float) -> str:
    return f"{x:g}" if x < 10 else f"{x:.1f}".removesuffix(".0")


def shape_text(shape: dict[str, Any] | None) -> str:
    """A shape as people say it: `8 CPU · 32 GiB · 1×A100-40GB` (from a request's shape or the
    views' stored one, whose amounts sit under `resources`)."""
    if not shape:
        return "-"
    if isinstance(shape.get("resources"), dict):
        shape = {**shape, **shape["resources"]}
    if shape.get("gpu_partition") in ("none", ""):
        shape = {**shape, "gpu_partition": None}
    parts = []
    if shape.get("cpu_millis") is not None:
        parts.append(f"{_number(int(shape['cpu_millis']) / 1000)} CPU")
    mib = shape.get("memory_mib")
    if mib is not None:
        parts.append(f"{_number(int(mib) / 1024)} GiB" if int(mib) >= 1024 else f"{mib} MiB")
    gpus = int(shape.get("gpu_count") or 0)
    if gpus:
        model = str(shape.get("gpu_partition") or shape.get("gpu_model") or "GPU").upper()
        gib = shape.get("gpu_memory_gib_min")
        parts.append(f"{gpus}×{model}" + (f"-{gib}GB" if gib and not shape.get("gpu_partition")
                                          else ""))
    if shape.get("local_disk_gib"):
        parts.append(f"{shape['local_disk_gib']} GiB disk")
    return " · ".join(parts) or "-"


def credits_text(microcredits: float | None) -> str:
    """Micro-credits with thousands separators: `1,000,000`."""
    return "-" if microcredits is None else f"{int(microcredits):,}"


def value_text(name: str, v: Any) -> str:
    """One value of a reply or a row, for a table cell or a `key  value` line."""
    if v is None:
        return "-"
    if name == "shape" and isinstance(v, dict):
        return shape_text(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if is_time(name):
            return when(v)
        if any(k in name for k in CREDIT_KEYS):
            return credits_text(v)
    if isinstance(v, dict):
        return ",".join(f"{k}={x}" for k, x in v.items()
                        if x not in (None, 0, {}, [], "")) or "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(name: str, v: Any) -> str:
        return value_text(name, v)

    grid = [list(columns)] + [[cell(c, r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in grid) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in grid)


def parse_since(text: str | None) -> Any:
    """`--since`: a duration back from now (90s, 10m, 2h, 1d, 1h30m) or an ISO 8601 time."""
    import datetime as dt
    import re

    if not text:
        return None
    now = dt.datetime.now(dt.UTC)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text.strip().lower())
    if parts and "".join(n + u for n, u in parts) == text.strip().lower():
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        return now - dt.timedelta(seconds=sum(float(n) * unit[u] for n, u in parts))
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"--since {text!r}: not a duration (10m, 2h, 1d) nor an ISO "
                         "time") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)
