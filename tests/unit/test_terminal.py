"""A job's output and a node's samples on a terminal: escape sequences are shown, never run;
piped, the job's output is passed on as it was written."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

from cli.run import write_out
from cli.telemetry import _format_sample
from cli.terminal import terminal_safe, write_output
from schemas import v1

HOSTILE = "ok\x1b]0;owned\x07\x1b[2J\r\x9bA\u202egnp.exe\tdone\n"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_control_characters_are_escaped_and_lines_and_tabs_kept() -> None:
    shown = terminal_safe(HOSTILE)
    assert shown == "ok\\x1b]0;owned\\x07\\x1b[2J\\x0d\\x9bA\\u202egnp.exe\tdone\n"
    assert not any(ord(c) < 0x20 and c not in "\n\t" for c in shown)
    assert terminal_safe("a\tb\n", one_line=True) == "a\\tb\\n"


def test_job_output_is_escaped_on_a_terminal_and_passed_as_written_to_a_pipe() -> None:
    tty, pipe = Tty(), io.StringIO()
    write_output(HOSTILE, tty)
    write_output(HOSTILE, pipe)
    assert "\x1b" not in tty.getvalue() and "\\x1b]0;owned" in tty.getvalue()
    assert pipe.getvalue() == HOSTILE


def test_pool_lease_logs_writes_through_the_escaping_writer() -> None:
    import sys

    tty = Tty()
    old, sys.stdout = sys.stdout, tty
    try:
        write_out(HOSTILE)
    finally:
        sys.stdout = old
    assert "\x1b" not in tty.getvalue() and tty.getvalue().endswith("done\n")


def test_a_telemetry_sample_is_one_harmless_line() -> None:
    event = v1.TelemetryEvent(kind="output", at=time.time(), attrs={"text": HOSTILE})
    sample = SimpleNamespace(event=event, kind="output", pool="p1", node="n1", tenant="alpha",
                             lease="l1", error=None)
    line = _format_sample(sample)
    assert "\n" not in line and "\x1b" not in line and "\\x1b[2J" in line
