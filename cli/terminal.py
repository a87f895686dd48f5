"""What a job or a node wrote, made safe to show on a terminal: control characters (ESC and
the rest) and text-direction overrides are shown as escapes, never interpreted.
"""

from __future__ import annotations

import sys
from typing import TextIO

# C0 (less tab and newline), DEL, C1 (a lone 0x9b is a CSI to some terminals) and the bidi
# overrides that can make shown text read otherwise than it is
_UNSAFE = [*range(0x09), *range(0x0b, 0x20), 0x7f, *range(0x80, 0xa0),
           *range(0x202a, 0x202f), *range(0x2066, 0x206a)]


def _escape(c: int) -> str:
    return f"\\x{c:02x}" if c <= 0xff else f"\\u{c:04x}"


_KEEP_LINES = {c: _escape(c) for c in _UNSAFE}
_ONE_LINE = {**_KEEP_LINES, 0x09: "\\t", 0x0a: "\\n"}


def terminal_safe(text: str, *, one_line: bool = False) -> str:
    """`text` with every control character escaped (`\\x1b`); tab and newline kept unless
    `one_line`."""
    return text.translate(_ONE_LINE if one_line else _KEEP_LINES)


def write_output(text: str, stream: TextIO | None = None) -> None:
    """A job's output as it came: escaped on a terminal, as written when piped (a file or
    another program gets the job's own bytes)."""
    out = stream if stream is not None else sys.stdout
    out.write(terminal_safe(text) if out.isatty() else text)
    out.flush()
