"""A job's output on its way to its tenant: read from the runtime, capped per lease, paced,
and shipped as `output` telemetry by one thread of its own, never the heartbeat's.
"""

from __future__ import annotations

import codecs
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024  # of one job's output per look: the jobs take turns
CHUNK_CHARS = 1000  # per `output` sample (a telemetry attribute holds ≤ 1,024)
# after a write wakes the shipper, what else is written this soon goes out with it: a line
# reaches its tenant at once, a flood goes out in a few samples a second per job
BATCH_SECONDS = 0.005
BYTES_PER_SECOND = 4 << 20  # all of an agent's jobs together: one flood cannot fill the link
BURST_BYTES = 1 << 20
IDLE_SECONDS = 1.0  # the shipper looks on its own this often (runtimes that cannot wake it)


def dropped_marker(cap_bytes: int) -> str:
    """The one line that stands for everything past a job's output cap."""
    return f"\n[pool: output past {cap_bytes} bytes dropped (max_output_bytes)]\n"


Read = Callable[[int, int], tuple[bytes, int]]  # (offset, limit) -> (data, offset after)
Send = Callable[[str], None]  # one `output` sample's text


@dataclass
class Stream:
    """One job's output: how far it was read and shipped, and what is left to do."""

    read: Read
    send: Send
    cap_bytes: int
    on_done: Callable[[], None]
    offset: int = 0  # bytes read (and shipped, up to the cap)
    dropped: bool = False  # the cap was passed: the marker went out, nothing more is read
    final: bool = False  # the job exited: ship what is left, then `on_done`
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))


class Pacer:
    """A token bucket of bytes: `take(n)` sleeps until n bytes may go."""

    def __init__(self, rate: float, burst: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()

    def take(self, n: int, stop: threading.Event) -> None:
        while not stop.is_set():
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= min(n, self.burst):
                self.tokens -= n  # may go below zero: the next take waits for it
                return
            stop.wait((min(n, self.burst) - self.tokens) / self.rate)


class OutputShipper:
    """Ships every followed job's output in turns, each job's at most `cap_bytes` then one
    marker line, all of them together at most `bytes_per_second`. Its thread holds none of
    the agent's locks: a backlog delays no heartbeat and no report but its own job's end."""

    def __init__(self, *, bytes_per_second: float = BYTES_PER_SECOND,
                 burst_bytes: float = BURST_BYTES) -> None:
        self.pacer = Pacer(bytes_per_second, burst_bytes)
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, key: str, stream: Stream) -> None:
        with self._lock:
            self._streams[key] = stream
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="output-shipper",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def poke(self) -> None:
        """Something was written: look now."""
        self._wake.set()

    def finish(self, key: str) -> bool:
        """The job exited: ship the rest, then call its `on_done`. False when not followed."""
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                return False
            stream.final = True
        self._wake.set()
        return True

    def offset(self, key: str) -> int | None:
        """How far the job's output was read to be shipped; None when it is not followed."""
        with self._lock:
            stream = self._streams.get(key)
            return None if stream is None else stream.offset

    def forget(self, key: str) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(IDLE_SECONDS)
            self._wake.clear()
            time.sleep(BATCH_SECONDS)
            busy = True
            while busy and not self._stop.is_set():
                with self._lock:
                    streams = list(self._streams.items())
                busy = False
                for key, stream in streams:
                    try:
                        busy = self._turn(key, stream) or busy
                    except Exception:  # a closed link: the next look retries
                        log.info("output of %s: left for the next look", key, exc_info=True)

    def _turn(self, key: str, stream: Stream) -> bool:
        """Ship one read of the job's output; True when there may be more right away."""
        data = b""
        if not stream.dropped:
            room = stream.cap_bytes - stream.offset
            try:
                data, after = stream.read(stream.offset, max(1, min(READ_BYTES, room)))
            except OSError:
                data, after = b"", stream.offset
            if data and room <= 0:  # past the cap: one marker line, nothing more is read
                stream.dropped = True
                self._send(stream, stream.decoder.decode(b"", final=True)
                           + dropped_marker(stream.cap_bytes))
                data = b""
            elif data:
                data = data[:room]
                self.pacer.take(len(data), self._stop)
                stream.offset = after if len(data) == after - stream.offset \
                    else stream.offset + len(data)
                self._send(stream, stream.decoder.decode(data))
        if data:
            return True
        if stream.final:
            self._send(stream, stream.decoder.decode(b"", final=True))
            with self._lock:
                if self._streams.get(key) is stream:
                    del self._streams[key]
            stream.on_done()
        return False

    @staticmethod
    def _send(stream: Stream, text: str) -> None:
        for i in range(0, len(text), CHUNK_CHARS):
            stream.send(text[i:i + CHUNK_CHARS])
