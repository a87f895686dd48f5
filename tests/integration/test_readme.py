"""The README is a front door: short, and every command in it works verbatim on the real
binary (the first lease is run end to end against `pool up` and a sandboxed agent)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.runtimes.process import ProcessRuntime

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SEPARATORS = {";", "&&", "||", "&", "|", "(", ")"}


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)


def _pool_commands(block: str) -> list[list[str]]:
    """Each `pool …` command of a shell block, as its words (comments, pipes, `&`, `$( )`
    taken apart)."""
    commands: list[list[str]] = [[]]
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        commands.append([])
        for word in lexer:
            if word in SEPARATORS or set(word) <= set(";&|()"):
                commands.append([])
            else:
                commands[-1].append(word)
    return [c for c in commands if c and c[0] == "pool"]


def test_the_readme_is_a_short_front_door() -> None:
    lines = README.count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/"
    assert not re.search(r"\bround\b", README, flags=re.IGNORECASE)
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    demo, tests = (b.strip() for b in _sh_blocks(_section("Set-up")))
    assert demo == "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/pool demo"
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_pool_command_in_the_readme_parses() -> None:
    from cli.main import build_parser

    commands = [c for block in _sh_blocks(README) for c in _pool_commands(block)]
    assert len(commands) >= 8
    parser = build_parser()
    for words in commands:
        argv = words[1:]
        if "--" in argv:  # the job's command, split off as `pool` itself does
            argv = argv[:argv.index("--")]
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse: {shlex.join(words)}")


def _table_cells(text: str) -> list[str]:
    """Every cell of every Markdown table in the text (`\\|` inside a cell is not a border)."""
    return [cell.strip() for line in text.splitlines() if line.startswith("|")
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def test_every_readme_table_cell_is_short() -> None:
    long = [cell for cell in _table_cells(README) if len(cell) > 200]
    assert not long, (f"{len(long)} README table cells exceed 200 characters; move the detail "
                      f"into docs/performance.md or another docs/ page: {long[0][:80]}…")


def test_every_command_of_the_headline_figures_parses() -> None:
    from cli.main import build_parser

    spans = re.findall(r"`([^`]+)`", "\n".join(_table_cells(_section("Headline figures"))))
    pool = [shlex.split(span) for span in spans if span.startswith("pool ")]
    modules = [span.split()[2] for span in spans if span.startswith("python -m ")]
    assert pool and modules
    parser = build_parser()
    for words in pool:
        argv = words[1:]
        if "--" in argv:
            argv = argv[:argv.index("--")]
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README figure's command does not parse: {shlex.join(words)}")
    for module in modules:
        assert (ROOT / (module.replace(".", "/") + ".py")).exists(), f"no module {module}"


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("POOL_") and k != "VIRTUAL_ENV"}
    from bus.local.server import free_port

    # free ports for the NATS server and the HTTP API, so it never meets a pool already running
    env.update(POOL_HOME=str(home), POOL_NATS_PORT="0", POOL_HTTP=f"127.0.0.1:{free_port()}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


@pytest.mark.slow
@pytest.mark.skipif(ProcessRuntime(Path("/tmp")).available() is not None,
                    reason="the first lease runs in the bubblewrap sandbox, unavailable here")
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "activate").exists(),
                    reason="the README's commands run in the set-up's .venv")
def test_the_first_lease_runs_verbatim(tmp_path: Path) -> None:
    up_block, lease_block = _sh_blocks(_section("A first lease"))
    env = _env(tmp_path / "home")

    def start_up() -> tuple[subprocess.Popen[str], str]:
        """`pool up` from the README; ("", …) once it printed ready, else what it said."""
        proc = subprocess.Popen(["bash", "-c", up_block], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            if line.startswith("ready"):
                return proc, ""
            assert time.monotonic() < deadline, "pool up was not ready in 3 minutes"
        return proc, proc.stderr.read()

    up, failed = start_up()
    if failed:  # the embedded PostgreSQL can miss its start-up window on a loaded machine
        up, failed = start_up()
    lease: subprocess.Popen[str] | None = None
    try:
        assert not failed, f"pool up ended: {failed}"
        # to files: the agent the block starts in the background keeps its output open
        with open(tmp_path / "out", "w") as out_f, open(tmp_path / "err", "w") as err_f:
            lease = subprocess.Popen(
                ["bash", "-e", "-c", ". .venv/bin/activate\n" + lease_block], cwd=ROOT, env=env,
                stdout=out_f, stderr=err_f, start_new_session=True)
            rc = lease.wait(240)
        out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
        assert rc == 0, f"{out}\n{err}"
        # after the admin commands' replies: the run's output, then the followed logs
        lines = out.splitlines()
        assert any(lines[i:i + 4] == ["1", "1", "2", "3"] for i in range(len(lines))), out
        assert "succeeded" in out and "ok    nats" in out
    finally:
        for proc in (lease, up):  # the agent in the lease block's group, then pool up
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT if proc is up else signal.SIGTERM)
        up.wait(60)
