"""`pool up`: the embedded default starts, serves, stops on Ctrl-C and finds its data again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import nats
import pytest

from tests.proc_children import children


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["POOL_NATS_PORT"] = "0"  # any free port: tests must not collide with a running pool
    return env


def _start(home: Path, *flags: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
    env = _env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--home", str(home), "--json", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    return proc, json.loads(line)


def _service_url(home: Path) -> str:
    # the embedded server requires a user: the service's credentials are in endpoints.json
    return str(json.loads((home / "endpoints.json").read_text())["service_url"])


def _interrupt(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(30)


async def _publish_and_count(url: str, publish: bool) -> int:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        if publish:
            await js.publish("pool.evt.probe.p1", b"hello")
        info = await js.stream_info("POOL_EVENTS")
        return int(info.state.messages)
    finally:
        await nc.close()


def test_pool_up_keeps_its_events_across_a_restart(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, info = _start(home)
    try:
        assert "nats_url" in info, info
        assert str(info["nats_url"]).startswith("nats://127.0.0.1:")
        assert str(info["database_url"]).startswith("postgresql://")
        assert asyncio.run(_publish_and_count(_service_url(home), publish=True)) == 1
    finally:
        assert _interrupt(proc) == 0
    assert (home / "nats").is_dir() and (home / "pg").is_dir()
    assert not (home / "endpoints.json").exists()

    proc, info = _start(home)
    try:
        assert asyncio.run(_publish_and_count(_service_url(home), publish=False)) == 1
    finally:
        assert _interrupt(proc) == 0


def test_pool_up_reports_an_unreachable_database_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env.update(POOL_NATS_PORT="0", POOL_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "up", "--home", str(tmp_path), "--exit-when-ready"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "database_unavailable" in lines[0], out.stderr


def test_a_second_pool_up_on_the_same_home_names_the_holder_and_touches_nothing(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    proc, _ = _start(home, "--no-postgres")
    try:
        endpoints = (home / "endpoints.json").read_bytes()
        out = subprocess.run(
            [sys.executable, "-m", "cli.main", "up", "--home", str(home), "--no-postgres",
             "--exit-when-ready"],
            check=False, capture_output=True, text=True, env=_env(), timeout=60,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert "ready" not in out.stdout
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert "instance_running" in lines[0] and f"pid {proc.pid}" in lines[0], lines[0]
        # the first instance keeps its endpoints and still serves
        assert (home / "endpoints.json").read_bytes() == endpoints
        assert asyncio.run(_publish_and_count(_service_url(home), publish=True)) == 1
    finally:
        assert _interrupt(proc) == 0
    # once the first has stopped, the home is free again
    proc, _ = _start(home, "--no-postgres")
    assert _interrupt(proc) == 0


def _children(pid: int) -> list[int]:
    """The spawned Python children of `pid` (multiprocessing's resource tracker left out)."""
    return children(pid, marked=b"spawn_main")


def _wait_for(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: pool up keeps one process")
def test_pool_up_runs_the_scheduler_in_a_child_it_restarts_and_stops(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, info = _start(home, "--no-postgres")
    last = None
    try:
        first = info["scheduler_pid"]
        assert isinstance(first, int) and _children(proc.pid) == [first], info
        os.kill(first, signal.SIGHUP)  # a hang-up is the parent's to act on
        time.sleep(1)
        assert _children(proc.pid) == [first]
        for sig in (signal.SIGKILL, signal.SIGTERM):  # dead without a word, or stopped alone
            gone = _children(proc.pid)[0]
            os.kill(gone, sig)

            def replaced(g: int = gone) -> bool:
                kids = _children(proc.pid)  # read once: the old child may be reaped in between
                return len(kids) == 1 and kids != [g]

            _wait_for(replaced, 120, f"no new scheduler process within 120 s after {sig!r}")
        last = _children(proc.pid)[0]
        time.sleep(2)  # the new one stays, and pool up itself still answers
        assert _children(proc.pid) == [last]
        assert asyncio.run(_publish_and_count(_service_url(home), publish=True)) == 1
        # a terminal's hang-up reaches both: pool up unwinds and stops the child after it
        os.kill(last, signal.SIGHUP)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 129
    finally:
        if proc.poll() is None:
            _interrupt(proc)
    assert last is not None and not Path(f"/proc/{last}").exists()


def test_pool_up_one_process_keeps_the_scheduler_in_its_own_process(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "up", "--home", str(tmp_path / "home"),
         "--no-postgres", "--one-process", "--exit-when-ready", "--json"],
        check=False, capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["scheduler_pid"] is None
