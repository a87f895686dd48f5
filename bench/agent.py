"""`pool bench agent`: start overhead from a start command delivered to the workload running.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.contract import Runtime
from bus.agentbus import AgentLink, ControlLink
from bus.local.server import NatsServer
from client.api import PoolClient
from schemas import v1
from schemas.codec import encode
from workers.plane import ControlPlane

PROBE = NodeProbe(cpu_millis=64000, cpu_arch="amd64", memory_mib=262144, local_disk_gib=100)


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0, "p50_ms": float("nan"), "p90_ms": float("nan")}
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1000,
            "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1000}


def _measure(url: str, node: str, runtime: Runtime, image: str | None, isolation: str,
             starts: int, state: Path, say: Callable[[str], None]) -> dict[str, Any]:
    link = AgentLink(url, node).connect()
    agent = Agent(link, runtime, node_id=node, pool_id="bench", probe=PROBE, state_dir=state,
                  reserve=Reserve(0, 0, 0), heartbeat_interval=3600)
    control = ControlLink(url)
    published: list[float] = []
    delivered: list[float] = []
    try:
        with PoolClient(url) as admin:  # the operator's enrollment comes before registration
            admin.admin("node.enroll", {"node_id": node, "pool_id": "bench",
                                        "trust_level": "trusted"})
        agent.register()
        for i in range(starts):
            lid = str(uuid.uuid4())
            body = encode(v1.LeaseAssignment(
                lease_id=lid, epoch=1,
                shape=v1.ResourceShape(cpu_millis=500, memory_mib=64, runtime=isolation),  # type: ignore[arg-type]
                job=v1.JobSpec(image=image, command=["/bin/sh", "-c", "sleep 2"]),
                deadline_at=time.time() + 60, tenant="bench", pool_id="bench", job_number=1))
            t0 = time.time()
            control.send(node, "start", body, msg_id=f"bench-{lid}")
            before = agent.stats.started
            deadline = time.monotonic() + 60
            while agent.stats.started == before and time.monotonic() < deadline:
                for cmd in link.fetch(timeout=0.5):
                    agent.handle(cmd)
            run = agent.running.get(lid)
            if run is None:
                raise RuntimeError(f"start {i} did not run: {agent.stats}")
            published.append(run.handle.started_at - t0)
            delivered.append(agent.stats.startup_seconds[-1])
            agent._stop_now(run, grace=0.0)
            if (i + 1) % 10 == 0:
                say(f"  {runtime.name}: {i + 1}/{starts} starts")
        deadline = time.monotonic() + 30
        while agent.running and time.monotonic() < deadline:
            agent.watch()
            time.sleep(0.05)
    finally:
        link.close()
        control.close()
    return {"published": _quantiles(published), "delivered": _quantiles(delivered)}


def _plain_docker_run(image: str, starts: int) -> dict[str, Any]:
    cli = shutil.which("docker")
    assert cli is not None
    times = []
    for _ in range(starts):
        name = f"pool-bench-plain-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        subprocess.run([cli, "run", "-d", "--name", name, "--network", "none", image,
                        "/bin/sh", "-c", "sleep 2"], capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
        subprocess.run([cli, "rm", "-f", name], capture_output=True, check=False)
    return _quantiles(times)


@contextmanager
def _docker_image(root: Path) -> Iterator[tuple[Any, str] | str]:
    """(client, image ref by digest), or a one-line reason why docker cannot be measured."""
    try:
        import docker

        from bench.docker_engine import (
            LocalRegistry,
            busybox_by_digest,
            busybox_unavailable,
            engine_unavailable,
        )
    except ImportError as e:  # the docker SDK is an optional extra
        yield f"docker helpers unavailable ({e})"
        return
    why = engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()
    if why is not None:
        yield why
        return
    client = docker.from_env(timeout=120)
    try:
        with busybox_by_digest(client, root) as ref:
            subprocess.run(["docker", "pull", "-q", ref], capture_output=True, check=False)
            yield client, ref
    finally:
        client.close()


def run_agent_bench(*, starts: int = 30, quick: bool = False,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    if quick:
        starts = min(starts, 5)
    say = progress or (lambda _s: None)
    out: dict[str, Any] = {"starts": starts}
    with tempfile.TemporaryDirectory(prefix="pool-bench-agent-") as tmp:
        root = Path(tmp)
        server = NatsServer(store_dir=root / "nats", server_name="pool-bench-agent").start()
        cp = ControlPlane(server.url, run_scheduler=False).start()
        admin = PoolClient(server.url)
        try:
            r = admin.admin("pool.set", {"pool_id": "bench",
                                         "priority_classes": {"standard": 0}})
            assert r["ok"], r
            from agents.runtimes.process import ProcessRuntime

            proc = ProcessRuntime(root / "process")
            why = proc.available()
            if why is None:
                say("process runtime (bubblewrap)…")
                out["process"] = _measure(server.url, "bench-process", proc, None, "sandboxed",
                                          starts, root / "process", say)
            else:
                out["process"] = {"unavailable": why}
            with _docker_image(root / "registry") as got:
                if isinstance(got, str):
                    out["docker"] = {"unavailable": got}
                else:
                    _client, ref = got
                    from agents.runtimes.docker import DockerRuntime

                    node = f"bench-docker-{uuid.uuid4().hex[:6]}"
                    say("docker runtime (runc)…")
                    out["docker"] = _measure(server.url, node, DockerRuntime(node_id=node), ref,
                                             "container", starts, root / "docker", say)
                    say("plain docker run -d of the same image…")
                    out["docker_plain"] = _plain_docker_run(ref, starts)
        finally:
            admin.close()
            cp.stop()
            server.stop()
    out["table"] = _table(out)
    return out


def _table(r: dict[str, Any]) -> str:
    rows = [("figure", "p50 ms", "p90 ms", "n")]

    def add(label: str, q: dict[str, Any] | None) -> None:
        if not q:
            return
        rows.append((label, f"{q['p50_ms']:.1f}", f"{q['p90_ms']:.1f}", str(q["n"])))

    for name in ("process", "docker"):
        got = r.get(name) or {}
        if "unavailable" in got:
            rows.append((f"{name} runtime", "n/a", "n/a", got["unavailable"][:60]))
            continue
        add(f"{name}: start published → running", got.get("published"))
        add(f"{name}: command delivered → running", got.get("delivered"))
    add("plain `docker run -d` (same image)", r.get("docker_plain"))
    width = max(len(x[0]) for x in rows)
    lines = [f"{a:<{width}}  {b:>8}  {c:>8}  {d:>4}" for a, b, c, d in rows]
    lines.insert(1, "-" * len(lines[0]))
    plain = (r.get("docker_plain") or {}).get("p50_ms")
    ours = ((r.get("docker") or {}).get("delivered") or {}).get("p50_ms")
    if plain and ours:
        lines.append(f"docker runtime start ÷ plain docker run -d (p50): {ours / plain:.2f}")
    lines.append("machine: 2 cores, shared; nats-server 2.15 file storage, sync_interval always")
    return "\n".join(lines)

