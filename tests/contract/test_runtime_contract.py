"""One contract, every runtime: the same behaviour from the bubblewrap `process` runtime and the
`docker` runtime (under runc). A runtime that cannot start here is skipped with its reason."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from agents.runtimes.contract import Runtime, WorkloadError, WorkloadHandle, WorkloadSpec
from agents.runtimes.process import ProcessRuntime


class Kind:
    """How to build one runtime, and the image it runs (None for the process runtime)."""

    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture(scope="module", params=["process", "docker"])
def kind(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if request.param == "process":
        why = ProcessRuntime(Path("/tmp")).available()
        if why is not None:
            pytest.skip(why)
        yield {"name": "process", "image": None, "isolation": "sandboxed"}
        return
    from bench.docker_engine import (
        LocalRegistry,
        busybox_by_digest,
        busybox_unavailable,
        engine_unavailable,
    )

    why = engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()
    if why is not None:
        pytest.skip(why)
    import docker

    client = docker.from_env(timeout=120)
    with ExitStack() as stack:
        ref = stack.enter_context(busybox_by_digest(client, tmp_path_factory.mktemp("reg")))
        yield {"name": "docker", "image": ref, "isolation": "container", "client": client}
    client.close()


@pytest.fixture()
def runtime(kind: dict[str, Any], tmp_path: Path) -> Iterator[Runtime]:
    if kind["name"] == "process":
        yield ProcessRuntime(tmp_path / "state")
        return
    from agents.runtimes.docker import LABEL_NODE, DockerRuntime

    node = f"contract-{uuid.uuid4().hex[:8]}"
    yield DockerRuntime(tmp_path / "state", node_id=node)
    for c in kind["client"].containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
        c.remove(force=True)


def spec(kind: dict[str, Any], tmp_path: Path, script: str, **kw: Any) -> WorkloadSpec:
    fields: dict[str, Any] = {
        "lease_id": f"l{uuid.uuid4().hex[:12]}", "epoch": 1, "job_number": 1,
        "command": ("/bin/sh", "-c", script), "image": kind["image"],
        "isolation": kind["isolation"], "memory_mib": 64,
        "checkpoint_dir": str(tmp_path / f"ck-{uuid.uuid4().hex[:6]}"),
    }
    fields.update(kw)
    return WorkloadSpec(**fields)


def wait_exit(rt: Runtime, h: WorkloadHandle, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = rt.poll(h)
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"{h.key} still running after {timeout}s")


def test_a_workload_runs_and_its_exit_code_is_reported(kind: dict[str, Any], runtime: Runtime,
                                                        tmp_path: Path) -> None:
    h = runtime.start(spec(kind, tmp_path, "exit 3"))
    assert wait_exit(runtime, h) == 3
    runtime.forget(h)


def test_it_runs_as_an_unprivileged_user_without_network(kind: dict[str, Any], runtime: Runtime,
                                                          tmp_path: Path) -> None:
    s = spec(kind, tmp_path, "test \"$(id -u)\" = 65534 || exit 10; "
             "grep -q '^CapEff:.0000000000000000' /proc/self/status || exit 11; "
             "if grep -v -e Inter -e face -e 'lo:' /proc/net/dev | grep -q ':'; then exit 12; fi; "
             "echo ok > $POOL_CHECKPOINT_DIR/mark")
    h = runtime.start(s)
    assert wait_exit(runtime, h) == 0
    assert s.checkpoint_dir is not None
    assert (Path(s.checkpoint_dir) / "mark").read_text().strip() == "ok"


def test_a_stop_gives_the_workload_its_grace_then_kills_it(kind: dict[str, Any], runtime: Runtime,
                                                          tmp_path: Path) -> None:
    polite = runtime.start(spec(kind, tmp_path, "trap 'exit 7' TERM; while :; do sleep 0.1; done"))
    stubborn = runtime.start(spec(kind, tmp_path, "trap '' TERM; while :; do sleep 0.1; done"))
    time.sleep(1.0)
    assert runtime.poll(polite) is None
    assert runtime.stop(polite, 5.0) == 7
    t = time.monotonic()
    assert runtime.stop(stubborn, 1.0) == 137
    assert time.monotonic() - t < 15


def test_a_new_runtime_object_readopts_a_running_workload(kind: dict[str, Any], runtime: Runtime,
                                                           tmp_path: Path) -> None:
    h = runtime.start(spec(kind, tmp_path, "sleep 1; exit 4"))
    again = type(runtime)(tmp_path / "state", **({"node_id": runtime.node_id}  # type: ignore[call-arg]
                                                 if kind["name"] == "docker" else {}))
    adopted = [x for x in again.adopt() if x.key == h.key]
    assert len(adopted) == 1
    assert wait_exit(again, adopted[0]) == 4


def test_the_same_job_is_never_started_twice(kind: dict[str, Any], runtime: Runtime,
                                             tmp_path: Path) -> None:
    s = spec(kind, tmp_path, "sleep 2")
    h = runtime.start(s)
    with pytest.raises(WorkloadError):
        runtime.start(s)
    runtime.stop(h, 0.5)


def test_the_output_is_read_in_order_from_any_offset(kind: dict[str, Any], runtime: Runtime,
                                                      tmp_path: Path) -> None:
    # apart in time: the engine copies stdout and stderr separately, so their order within a
    # moment is not kept
    h = runtime.start(spec(kind, tmp_path, "echo one; sleep 0.3; echo two >&2; sleep 1.5; "
                                           "echo three; printf four"))
    read = runtime.read_output  # type: ignore[attr-defined]
    got, offset = b"", 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ended = runtime.poll(h) is not None
        data, offset = read(h, offset, 5)  # small reads: an entry comes in parts
        got += data
        if ended and not data:
            break
        if not data:
            time.sleep(0.1)
    assert got == b"one\ntwo\nthree\nfour"
    assert read(h, offset, 5) == (b"", offset)  # nothing new: the same offset
    assert read(h, 4, 100) == (b"two\nthree\nfour", len(got))  # an offset it did not give
    runtime.forget(h)


def test_a_pool_volume_is_bound_read_only_unless_the_pool_says_rw(kind: dict[str, Any],
                                                                   runtime: Runtime,
                                                                   tmp_path: Path) -> None:
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    for d in (ro, rw):
        d.mkdir()
        d.chmod(0o777)  # the workload's uid writes where the pool allows it
    (ro / "in.txt").write_text("data\n")
    s = spec(kind, tmp_path, "grep -q data /data/in.txt || exit 10; "
             "(echo x > /data/w) 2>/dev/null && exit 11; echo out > /out/o",
             volumes=((str(ro), "/data", True), (str(rw), "/out", False)))
    h = runtime.start(s)
    assert wait_exit(runtime, h) == 0
    assert (rw / "o").read_text() == "out\n" and not (ro / "w").exists()
    runtime.forget(h)


def _not_on_any_command_line(*values: bytes) -> None:
    """No process of the host shows a value in its command line (anyone may read those)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:
            continue
        assert not any(v in text for v in values), cmdline


def test_secret_files_reach_the_workload_read_only_and_in_memory(
        kind: dict[str, Any], runtime: Runtime, tmp_path: Path) -> None:
    # checked by digest: the script itself is on a command line
    key = hashlib.sha256(b"k3y").hexdigest()
    s = spec(kind, tmp_path, f'test "$(sha256sum < /run/secrets/key)" = "{key}  -" || exit 11; '
             "(echo x > /run/secrets/key) 2>/dev/null && exit 12; "
             # a mount of its own (docker's) is memory too; bwrap's lies in its root tmpfs
             "if grep -q ' /run/secrets ' /proc/mounts; then "
             "grep ' /run/secrets ' /proc/mounts | grep -q tmpfs || exit 13; fi; sleep 1",
             secret_files=(("/run/secrets/key", b"k3y"),))
    h = runtime.start(s)
    _not_on_any_command_line(b"k3y")
    assert wait_exit(runtime, h) == 0
    runtime.forget(h)
    if kind["name"] == "docker":  # held in the host's memory until the job is forgotten
        from agents.runtimes.memfiles import SHM_ROOT

        assert not any(SHM_ROOT.glob(f"*{s.lease_id}*"))


def test_secret_variables_reach_the_workload_or_the_start_is_refused(
        kind: dict[str, Any], runtime: Runtime, tmp_path: Path) -> None:
    token = hashlib.sha256(b"t0k en").hexdigest()
    s = spec(kind, tmp_path, f'test "$(printf %s "$TOKEN" | sha256sum)" = "{token}  -" '
             "|| exit 10; sleep 1", secret_env=(("TOKEN", "t0k en"),))
    if kind["name"] == "docker":  # the engine would keep them on its disk: refused, by code
        with pytest.raises(WorkloadError) as e:
            runtime.start(s)
        assert e.value.code == "secrets_unsupported"
        return
    h = runtime.start(s)
    _not_on_any_command_line(b"t0k en")
    assert wait_exit(runtime, h) == 0
    runtime.forget(h)


def test_output_past_the_cap_is_dropped_after_one_marker_line(kind: dict[str, Any],
                                                              runtime: Runtime,
                                                              tmp_path: Path) -> None:
    from agents.output import dropped_marker

    line = b"0123456789" * 4 + b"abcdefghi\n"  # 50 bytes, 100 times: five times the cap
    h = runtime.start(spec(kind, tmp_path, f"i=0; while [ $i -lt 100 ]; do echo {line[:-1].decode()}; "
                                           "i=$((i+1)); done", output_cap_bytes=1000))
    assert wait_exit(runtime, h) == 0
    read = runtime.read_output  # type: ignore[attr-defined]
    got, offset = b"", 0
    for _ in range(200):  # a runtime that never stops giving fails here, not by hanging
        data, offset = read(h, offset, 300)
        if not data:
            break
        got += data
    assert got == (line * 20) + dropped_marker(1000).encode()
    assert read(h, offset, 300) == (b"", offset)
    runtime.forget(h)


def test_the_workdir_is_the_workloads_cwd_and_what_it_writes_there_stays_on_the_host(
        kind: dict[str, Any], runtime: Runtime, tmp_path: Path) -> None:
    from agents.workdir import JobFiles

    # made as the agent makes it (agents/workdir.py), then written by the workload
    work = JobFiles(tmp_path / "files", None).job_dir("job")
    (work / "src").mkdir(parents=True)
    (work / "src" / "in.txt").write_text("data\n")
    s = spec(kind, tmp_path, 'test "$(pwd)" = /work || exit 10; '
             "grep -q data src/in.txt || exit 11; mkdir -p out && cp src/in.txt out/model.txt "
             "&& echo done >> out/model.txt", workdir=str(work))
    h = runtime.start(s)
    assert wait_exit(runtime, h) == 0
    # the artifacts' source: the agent reads them from the host's side of /work
    assert (work / "out" / "model.txt").read_text() == "data\ndone\n"
    runtime.forget(h)


def _output_until(runtime: Runtime, h: WorkloadHandle, needle: bytes,
                  timeout: float = 30.0) -> bytes:
    read = runtime.read_output  # type: ignore[attr-defined]
    got, offset = b"", 0
    deadline = time.monotonic() + timeout
    while needle not in got and time.monotonic() < deadline:
        data, offset = read(h, offset, 4096)
        got += data
        if not data:
            time.sleep(0.05)
    assert needle in got, got
    return got


def test_a_stdin_job_reads_what_is_written_and_ends_its_input_on_close(
    kind: dict[str, Any], runtime: Runtime, tmp_path: Path,
) -> None:
    # `pool lease attach -i`: the agent writes to the job's stdin and closes it for good
    stdin: Any = runtime.stdin  # type: ignore[attr-defined]
    h = runtime.start(spec(kind, tmp_path, "read line; echo got-$line; cat; echo eof; exit 5",
                           stdin=True))
    stdin.write(h.key, b"hello\n")
    _output_until(runtime, h, b"got-hello\n")
    stdin.write(h.key, b"more\n")
    stdin.close(h.key)
    assert _output_until(runtime, h, b"eof\n").endswith(b"got-hello\nmore\neof\n")
    assert wait_exit(runtime, h) == 5
    with pytest.raises(Exception) as closed:  # once closed, never again
        stdin.write(h.key, b"late\n")
    assert getattr(closed.value, "code", "") == "stdin_closed"
    runtime.forget(h)


def test_a_job_without_stdin_reads_nothing_and_cannot_be_written_to(
    kind: dict[str, Any], runtime: Runtime, tmp_path: Path,
) -> None:
    h = runtime.start(spec(kind, tmp_path, "cat; echo eof"))
    assert wait_exit(runtime, h) == 0  # its stdin is empty: cat ends at once
    _output_until(runtime, h, b"eof\n")
    with pytest.raises(Exception) as closed:
        runtime.stdin.write(h.key, b"x")  # type: ignore[attr-defined]
    assert getattr(closed.value, "code", "") == "stdin_closed"
    runtime.forget(h)
