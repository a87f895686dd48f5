"""The fault suite's harness: real processes in a workspace, the outcome of a scenario, shared
bodies and helpers."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.errors import BusError
from bus.local.server import NatsServer

ROOT = Path(__file__).resolve().parent.parent


# -- outcomes ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One scenario's figures and the checks that did not hold."""

    number: int
    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)  # for --json and logs, not the line

    @property
    def passed(self) -> bool:
        return not self.problems and self.skipped is None

    def zero(self, name: str, value: int, detail: str = "") -> None:
        """A figure that must be 0 for the scenario to pass."""
        self.figures[name] = value
        if value:
            self.problems.append(f"{name}={value}" + (f" ({detail})" if detail else ""))

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def line(self) -> str:
        figs = " ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        if self.skipped is not None:
            verdict = f"skipped: {self.skipped}"
        elif self.passed:
            verdict = "ok"
        else:
            verdict = "FAILED: " + "; ".join(self.problems[:4])
        return f"{self.number}. {self.name}: {figs}  [{verdict}] ({self.seconds:.0f} s)"

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.number, "name": self.name, "passed": self.passed,
                "skipped": self.skipped, "figures": self.figures, "problems": self.problems,
                "detail": self.detail,
                "seconds": round(self.seconds, 1)}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    if isinstance(v, dict):
        return ",".join(f"{k}:{x}" for k, x in sorted(v.items())) or "-"
    return str(v)


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); 0.0 for no samples."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def wait_for(pred: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    """`pred()`'s first truthy value within `timeout` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except (BusError, OSError):
            got = None
        if got:
            return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(every)


# -- processes -----------------------------------------------------------------------------------


class Proc:
    """One `python -m cli.main …` child in its own session; its output goes to a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.args, self.log = name, args, log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, marker: str, timeout: float = 60.0) -> None:
        if not wait_for(lambda: marker in self.output() or not self.alive(), timeout, 0.05) \
                or not self.alive():
            tail = self.output()[-600:]
            self.kill()
            raise RuntimeError(f"{self.name} did not start: {tail}")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no clean-up, no flush, as a crash or an OOM kill would."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGINT)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.popen.wait()


class Workspace:
    """A scenario's temporary directory, the servers and processes started in it, and the
    connections opened to them; `close()` ends them all."""

    def __init__(self, name: str, keep: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"pool-chaos-{name}-"))
        self.home = self.dir / "home"
        self.home.mkdir()
        self.keep = keep
        self.procs: list[Proc] = []
        self.servers: list[NatsServer] = []
        self.closers: list[Callable[[], None]] = []  # our connections: closed first
        self.after: list[Callable[[], None]] = []  # when the processes are gone: last first
        self.urls: set[str] = set()
        self.settings: dict[str, str] = {}  # POOL_… settings of the processes it starts

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
        env.update(self.settings)
        env.update(POOL_HOME=str(self.home), POOL_NATS_PORT="0",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"))
                                              if p))
        return env

    def spawn(self, name: str, *args: str) -> Proc:
        p = Proc(name, list(args), self.env(), self.dir / f"{name}.log")
        self.procs.append(p)
        return p

    def serve(self, url: str, *, name: str = "serve", leader_ttl: float = 3.0,
              database_url: str | None = None) -> Proc:
        args = ["serve", "--nats-url", url, "--leader-ttl", str(leader_ttl)]
        if database_url:
            args += ["--database-url", database_url]
        p = self.spawn(f"{name}-{len(self.procs)}", *args)
        p.wait_ready("serving commands")
        return p

    def nats(self, name: str = "chaos") -> NatsServer:
        s = NatsServer(store_dir=self.dir / f"nats-{name}", server_name=f"pool-{name}").start()
        self.servers.append(s)
        self.urls.add(s.url)
        return s

    def client(self, url: str, tenant: str = "", timeout: float = 10.0,
               **connect_options: Any) -> Any:
        from client.api import PoolClient

        c = PoolClient(url, tenant, timeout=timeout, **connect_options)
        self.closers.append(c.close)
        return c

    def log_reader(self, url: str) -> Any:
        """A PoolApp on the log, for reading it (the checks replay it)."""
        from workers.application import PoolApp
        from workers.bootstrap import app_env

        app = PoolApp(env=app_env(url))
        self.closers.append(app.close)
        self.urls.add(url)
        return app

    def close(self, failed: bool) -> None:
        from bus.runtime import close_runtime

        for c in reversed(self.closers):
            try:
                c()
            except Exception:  # noqa: BLE001, S110 - best effort
                pass
        for url in self.urls:
            try:
                close_runtime(url)
            except Exception:  # noqa: BLE001, S110 - best effort
                pass
        for p in reversed(self.procs):
            try:
                p.stop(10)
            except Exception:  # noqa: BLE001 - best effort: kill what is left
                p.kill()
        for c in reversed(self.after):
            try:
                c()
            except Exception:  # noqa: BLE001, S110 - best effort
                pass
        for s in self.servers:
            s.stop()
        if not (self.keep or failed):
            shutil.rmtree(self.dir, ignore_errors=True)


# -- pool set-up -----------------------------------------------------------------------------------


def node_body(node_id: str, pool: str = "p1", *, cpu_millis: int = 4000,
              memory_mib: int = 8192, gpus: int = 0) -> dict[str, Any]:
    """A node's registration; `gpus` > 0 lists that many GPU devices (two NVLink pairs…)."""
    caps: dict[str, Any] = {
        "allocatable": {"cpu_millis": cpu_millis, "memory_mib": memory_mib, "gpu_count": gpus,
                        "local_disk_gib": 100},
        "zone": "z1", "failure_domain": "z1", "gpu_memory_gib": 80 if gpus else 0}
    if gpus:
        caps["gpu_model"] = "NVIDIA A100 80GB"
        caps["devices"] = [{"id": f"GPU-{node_id}-{k}", "model": "NVIDIA A100 80GB",
                            "memory_mib": 80 * 1024, "minor": k, "nvlink_domain": f"nv{k // 2}"}
                           for k in range(gpus)]
    return {"node_id": node_id, "pool_id": pool, "capabilities": caps}


def lease_body(key: str, pool: str = "p1", *, cpu_millis: int = 1000,
               memory_mib: int = 1024, gpu_count: int = 0) -> dict[str, Any]:
    shape: dict[str, Any] = {"cpu_millis": cpu_millis, "memory_mib": memory_mib}
    if gpu_count:
        shape["gpu_count"] = gpu_count
    return {"pool_id": pool, "shape": shape,
            "maximum_runtime_seconds": 600, "idempotency_key": key,
            "priority_class": "standard"}


def setup_pool(admin: Any, tenants: list[str], *, nodes: int = 0, pool: str = "p1",
               gpus: int = 0, **config: Any) -> None:
    """A pool whose nodes never time out (they have no agents), tenants with ample credit."""
    cfg = {"pool_id": pool, "priority_classes": {"standard": 10},
           "node_timeout_seconds": 86_400, "heartbeat_timeout_seconds": 3600,
           "commit_timeout_seconds": 3600, **config}

    def admin_call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        # each command reads what the one before wrote, possibly on another replica: the
        # recorder confirms reads with the stream leader, so no waiting is needed here
        return must(admin.admin(path, body))

    admin_call("pool.set", cfg)
    for t in tenants:
        admin_call("tenant.set", {"tenant": t, "pool_id": pool, "weight": 1.0})
        admin_call("credits.grant", {"tenant": t, "amount_microcredits": 10**14,
                                     "transfer_id": f"initial-{t}"})
    for i in range(nodes):
        admin_call("node.register", node_body(f"n{i}", pool, gpus=gpus))


def must(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        raise RuntimeError(f"set-up command refused: {reply.get('error')}")
    return reply


def lease_id_for(tenant: str, key: str) -> str:
    from domain.lease import Lease

    return str(Lease.create_id(tenant, key))


def error_code(e: BaseException) -> str:
    return str(getattr(e, "code", type(e).__name__))


def known_codes() -> set[str]:
    """Every stable error code a reply may carry: schema, domain, service, bus and view errors."""
    import workers.application  # noqa: F401 - loads every module that defines an error class
    from bus.errors import BusError as B
    from domain.errors import DomainError
    from projections.errors import BadQuery, ViewsUnavailable
    from schemas.codec import SCHEMA_ERROR_CODES
    from workers.errors import ServiceError

    codes = set(SCHEMA_ERROR_CODES) | {BadQuery.code, ViewsUnavailable.code,
                                       "views_unavailable"}

    def walk(cls: type) -> Iterator[type]:
        yield cls
        sub: type
        for sub in cls.__subclasses__():
            yield from walk(sub)

    for base in (DomainError, ServiceError, B):
        for cls in walk(base):
            code = getattr(cls, "code", None)
            if isinstance(code, str):
                codes.add(code)
    return codes


def database_url(ws: Workspace) -> str:
    """The machine's PostgreSQL when it answers (POOL_TEST_DATABASE_URL or :5432/test), else a
    private cluster of this workspace."""
    from projections.postgres.embedded import reachable_database_url

    url = os.environ.get("POOL_TEST_DATABASE_URL") or reachable_database_url(
        "postgresql://postgres@127.0.0.1:5432/test")
    if url:
        return url
    return str(private_postgres(ws).url)


def private_postgres(ws: Workspace) -> Any:
    from projections.postgres.pgproc import PrivatePostgres

    pg = PrivatePostgres().start()
    ws.after.append(pg.destroy)
    return pg


def diff_vs_rebuild(log: Any, db: str, schema: str) -> tuple[int, str]:
    """Rows that differ between the live views and a rebuild from event 1, and the tracking."""
    from projections import views as pv

    rebuilt = f"{schema}_rebuilt"
    pv.rebuild(log, db, schema=rebuilt)
    diff, where = 0, []
    for view in pv.VIEWS:
        live, again = (Counter(json.dumps(r, sort_keys=True, default=str)
                               for r in pv.dump(db, s, view)) for s in (schema, rebuilt))
        d = sum(((live - again) + (again - live)).values())
        if d:
            where.append(f"{view}:{d}")
        diff += d
    live_pos, again_pos = pv.positions_at(db, schema), pv.positions_at(db, rebuilt)
    if live_pos != again_pos:
        diff += 1
        where.append(f"tracking {live_pos} vs {again_pos}")
    pv.drop_schema(db, rebuilt)
    return diff, ", ".join(where)


def count_notifications(log: Any) -> int:
    from projections.replay import notifications

    return sum(1 for _ in notifications(log))
