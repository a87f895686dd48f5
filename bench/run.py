"""`pool bench run`: N sequential `pool lease run -- true` as a user runs them, whole processes
on an idle plane with one local agent, beside `bwrap … true` run directly (the sandbox's floor).

The plane is this checkout's own, started as the README's first lease does it, in a temporary
POOL_HOME: `pool up --no-postgres`, a pool, a tenant, a node and `pool agent run`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RUNS = 30
QUICK_RUNS = 5
WARMUP = 2  # runs not counted: the first placement on a fresh plane and the page cache
TENANT, POOL, NODE = "bench", "bench", "local-1"
DOCKER_NODE = "local-docker"
ROOT = Path(__file__).resolve().parents[1]


def pool_argv() -> list[str]:
    """The `pool` command as installed beside this Python, else this checkout's module."""
    script = Path(sys.executable).with_name("pool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cli.main"]


def quantiles(xs: Sequence[float]) -> dict[str, float]:
    s = sorted(xs)
    if not s:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"),
                "min_ms": float("nan"), "max_ms": float("nan")}
    return {"n": len(s), "p50_ms": statistics.median(s) * 1000,
            "p99_ms": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1000,
            "min_ms": s[0] * 1000, "max_ms": s[-1] * 1000}


def timed(argv: Sequence[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    out = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    return time.perf_counter() - t0, out


@contextmanager
def local_plane(home: Path, say: Callable[[str], None],
                docker_image: str | None = None) -> Iterator[dict[str, str]]:
    """An idle plane with one local agent in `home`; yields the environment a tenant's
    `pool` runs in. With `docker_image`, a second node (DOCKER_NODE) whose agent runs the
    Docker runtime, that image's first run done. Everything it started is stopped on the way
    out."""
    from bus.local.server import free_port

    # bytecode cached as an installed Python keeps it (not compiled again at each start where
    # the machine sets PYTHONDONTWRITEBYTECODE): the command as a user's machine runs it
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("POOL_") and k != "PYTHONDONTWRITEBYTECODE"}
    # this checkout's code, also where an editable install of another one is on the path
    # the gateway on a free port too: a bench beside another plane must not meet its :8080
    env.update(POOL_HOME=str(home), POOL_NATS_PORT=str(free_port()),
               POOL_HTTP=f"127.0.0.1:{free_port()}", POOL_OTEL_EXPORTER="none",
               PYTHONPATH=str(ROOT))
    pool = pool_argv()
    procs: list[subprocess.Popen[str]] = []
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(name: str, *argv: str, ready: str) -> None:
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([*pool, *argv], env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if ready in line:
                return
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"`pool {' '.join(argv)}` did not get ready: see {logs}/{name}.log")

    def admin(*argv: str) -> None:
        out = subprocess.run([*pool, *argv], env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"`pool {' '.join(argv)}` failed: {out.stderr.strip()}")

    try:
        say("bench run: starting a plane (pool up --no-postgres) in " + str(home))
        spawn("up", "up", "--no-postgres", ready="ready:")
        admin("admin", "pool", "create", POOL)
        admin("admin", "tenant", "set", TENANT, "--pool", POOL)
        admin("admin", "node", "creds", NODE, "--pool", POOL)
        spawn("agent", "agent", "run", "--node-id", NODE, "--pool", POOL, "--json",
              ready="{")
        # the agent is up once it has registered: wait until a lease can be placed
        deadline = time.monotonic() + 60
        while True:
            _, out = timed([*pool, "lease", "run", "--tenant", TENANT, "--pool", POOL,
                             "--quiet", "--", "true"], env)
            if out.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no lease ran on the local agent: {out.stderr.strip()}")
            time.sleep(0.5)
        if docker_image is not None:
            # trusted: a container is the weakest isolation allowed on a trusted node only
            # (domain/policy/images.py); the image pulled by the agent's first run, not timed
            admin("admin", "node", "creds", DOCKER_NODE, "--pool", POOL, "--trust", "trusted")
            spawn("docker-agent", "agent", "run", "--node-id", DOCKER_NODE, "--pool", POOL,
                  "--runtime", "docker", "--json", ready="{")
            admin("lease", "run", "--tenant", TENANT, "--pool", POOL, "--quiet",
                  "--image", docker_image, "--", "true")
        yield env
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _bwrap_true() -> list[str] | None:
    """`bwrap … true` with the process runtime's own sandbox arguments."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    from agents.runtimes.process import ProcessRuntime

    with tempfile.TemporaryDirectory() as tmp:
        args = ProcessRuntime(Path(tmp), cgroups=None, slirp=None)._sandbox_args(None)
    return [bwrap, *args, "--", "true"]


def _exit_to_ended(pool: list[str], env: dict[str, str]) -> float:
    """One job that prints the time and exits: how long after its last line the control plane
    recorded its end (the feed record of the `JobExited` event, as `pool lease watch` shows
    it; one clock, this machine's)."""
    _, out = timed([*pool, "lease", "run", "--tenant", TENANT, "--pool", POOL, "--quiet",
                     "--json", "--", "sh", "-c", "date +%s.%N"], env)
    if out.returncode != 0:
        raise RuntimeError(f"the timing job exited {out.returncode}: {out.stderr.strip()}")
    lines = out.stdout.splitlines()
    printed = float(lines[0])
    lease_id = json.loads(lines[-1])["lease"]["lease_id"]
    _, watched = timed([*pool, "lease", "watch", lease_id, "--tenant", TENANT, "--json"], env)
    for line in watched.stdout.splitlines():
        record = json.loads(line)
        record = record.get("result", record)
        if record.get("event") == "JobExited":
            return float(record["at"]) - printed
    raise RuntimeError(f"no JobExited record for lease {lease_id}: {watched.stdout!r}")


def _echo_to_terminal(pool: list[str], env: dict[str, str], lines: int) -> list[float]:
    """One job that prints the time `lines` times, 50 ms apart: how long each line took from the
    job's `date` to `pool lease run`'s stdout (read here as it is written; one clock)."""
    job = f"for i in $(seq {lines}); do date +%s.%N; sleep 0.05; done"
    proc = subprocess.Popen([*pool, "lease", "run", "--tenant", TENANT, "--pool", POOL,
                             "--quiet", "--", "sh", "-c", job], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    out = [time.time() - float(line) for line in proc.stdout if line.strip()]
    if proc.wait(60) != 0 or len(out) != lines:
        raise RuntimeError(f"the echo job exited {proc.returncode} after {len(out)} lines")
    return out


def docker_unavailable() -> str | None:
    """None when the docker mode can run here, else one line saying why not."""
    try:
        from bench.docker_engine import LocalRegistry, busybox_unavailable, engine_unavailable
    except ImportError as e:
        return f"the Docker SDK is not installed ({e})"
    return engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()


@contextmanager
def _busybox_image(root: Path, docker: bool) -> Iterator[str | None]:
    """The busybox image by digest from a local registry (bench/docker_engine.py), pulled
    into the engine; None without `docker`."""
    if not docker:
        yield None
        return
    import docker as sdk

    from bench.docker_engine import busybox_by_digest

    client = sdk.from_env(timeout=120)
    try:
        with busybox_by_digest(client, root) as ref:
            try:
                client.images.pull(ref)
                yield ref
            finally:  # the pulled copy too: the engine keeps nothing of the bench
                with contextlib.suppress(sdk.errors.DockerException):
                    client.images.remove(ref, force=True)
    finally:
        client.close()


def _docker_runs(pool: list[str], env: dict[str, str], image: str,
                 runs: int) -> tuple[list[float], list[float]]:
    """`pool lease run --image IMAGE -- true` and `docker run --rm IMAGE true`, in turns."""
    docker = shutil.which("docker") or "docker"
    lease = [*pool, "lease", "run", "--tenant", TENANT, "--pool", POOL, "--quiet", "--image",
             image, "--", "true"]
    lease_s: list[float] = []
    docker_s: list[float] = []
    for i in range(WARMUP + runs):
        took, out = timed(lease, env)
        if out.returncode != 0:
            raise RuntimeError(f"`pool lease run --image … -- true` exited {out.returncode}: "
                               f"{out.stderr.strip()}")
        plain, ran = timed([docker, "run", "--rm", image, "true"], env)
        if ran.returncode != 0:
            raise RuntimeError(f"`docker run --rm … true` exited {ran.returncode}: "
                               f"{ran.stderr.strip()}")
        if i >= WARMUP:
            lease_s.append(took)
            docker_s.append(plain)
    return lease_s, docker_s


def run_run_bench(*, runs: int = RUNS, quick: bool = False, docker: bool = False,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`runs` sequential `pool lease run -- true` (after WARMUP uncounted), each beside a
    `bwrap … true` and a `pool --help` so they share the machine's swing; then `runs` jobs
    that print the time as they end, for job exit → its end recorded in the log; and a job's
    printed lines → `pool lease run`'s stdout. With `docker`, also `runs` of `pool lease run
    --image busybox… -- true` on a Docker-runtime agent, each beside `docker run --rm` of the
    same image (skipped, with its reason in `docker_skipped`, where no engine answers)."""
    say = progress or (lambda _s: None)
    if quick:
        runs = QUICK_RUNS
    pool = pool_argv()
    bwrap = _bwrap_true()
    skipped = docker_unavailable() if docker else None
    if skipped is not None:
        say(f"bench run: docker mode skipped: {skipped}")
    lease_s: list[float] = []
    bwrap_s: list[float] = []
    help_s: list[float] = []
    ended_s: list[float] = []
    docker_lease_s: list[float] = []
    docker_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="pool-bench-run-") as tmp, \
            _busybox_image(Path(tmp) / "registry", docker and skipped is None) as image, \
            local_plane(Path(tmp) / "home", say, docker_image=image) as env:
        run = [*pool, "lease", "run", "--tenant", TENANT, "--pool", POOL, "--quiet", "--",
               "true"]
        for i in range(WARMUP + runs):
            took, out = timed(run, env)
            if out.returncode != 0:
                raise RuntimeError(f"`pool lease run -- true` exited {out.returncode}: "
                                   f"{out.stderr.strip()}")
            if i >= WARMUP:
                lease_s.append(took)
                if bwrap is not None:
                    took, _ = timed(bwrap, env)
                    bwrap_s.append(took)
                took, _ = timed([*pool, "--help"], env)
                help_s.append(took)
            if (i + 1) % 10 == 0:
                say(f"bench run: {i + 1}/{WARMUP + runs}")
        for _ in range(runs):
            ended_s.append(_exit_to_ended(pool, env))
        say(f"bench run: {runs} jobs timed from exit to their end in the log")
        echo_s = _echo_to_terminal(pool, env, max(runs, 10))
        if image is not None:
            docker_lease_s, docker_s = _docker_runs(pool, env, image, runs)
            say(f"bench run: {runs} docker runs each way")
    rows = {"pool lease run -- true": quantiles(lease_s),
            "bwrap … true (direct)": quantiles(bwrap_s),
            "pool --help": quantiles(help_s),
            "job exit → JobExited": quantiles(ended_s),
            "job's echo → terminal": quantiles(echo_s)}
    if image is not None:
        rows["lease run --image … true"] = quantiles(docker_lease_s)
        rows["docker run --rm … true"] = quantiles(docker_s)
    lines = [f"{'':<26} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'min ms':>8} {'max ms':>8}"]
    for name, q in rows.items():
        lines.append(f"{name:<26} {q['n']:4d} {q['p50_ms']:8.1f} {q['p99_ms']:8.1f} "
                     f"{q['min_ms']:8.1f} {q['max_ms']:8.1f}")
    lines.append(f"sequential whole processes on an idle plane with one local agent; "
                 f"machine: {os.cpu_count()} cores")
    if skipped is not None:
        lines.append(f"docker mode skipped: {skipped}")
    docker_rows: dict[str, Any] = {"docker_skipped": skipped} if docker else {}
    if image is not None:
        docker_rows.update(docker_lease_run=rows["lease run --image … true"],
                           docker_run=rows["docker run --rm … true"])
    return {**docker_rows, "runs": runs, "lease_run": rows["pool lease run -- true"],
            "bwrap": rows["bwrap … true (direct)"], "help": rows["pool --help"],
            "exit_to_ended": rows["job exit → JobExited"],
            "echo_to_terminal": rows["job's echo → terminal"], "table": "\n".join(lines)}


def bench_main(prog: str, doc: str | None, run: Callable[..., dict[str, Any]],
               argv: list[str] | None, *, runs: int = RUNS, quick_runs: int = QUICK_RUNS) -> int:
    """`python -m bench.<prog> [--runs N] [--quick] [--json]`: one run of `run`, its table (or
    its figures as JSON) on stdout and its progress on stderr."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m bench.{prog}", description=doc)
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--quick", action="store_true", help=f"{quick_runs} runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(runs=args.runs, quick=args.quick,
                 progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in result.items() if k != "table"}) if args.json
          else result["table"])
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("run", __doc__, run_run_bench, argv)


if __name__ == "__main__":
    sys.exit(main())
