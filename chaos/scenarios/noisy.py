"""Fault scenario 10: a noisy neighbour. One tenant floods heartbeats, requests, queries, event
streams and job output at once beside a tenant with a steady load; judged by the quiet tenant's
request → reserved against the same load alone, the nodes, the log and the floods' answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

from bus.local.auth import Credentials
from chaos.harness import (
    ROOT,
    Outcome,
    Workspace,
    lease_body,
    lease_id_for,
    must,
    percentile,
    setup_pool,
    wait_for,
)

QUIET, NOISY = "beta", "alpha"
# what each flood may be answered with: ok, or the code of a limit it meets; every one of them
# meets the tenant's command rate (rate_limited), and a stream's first page is a read, which
# the tenant's read cap may refuse first
ANSWERS = {"heartbeats": {"ok", "rate_limited"},
           "requests": {"ok", "rate_limited", "queue_limit_exceeded"},
           "queries": {"ok", "concurrency_limit", "rate_limited"},
           "streams": {"ok", "too_many_requests", "concurrency_limit", "rate_limited"}}
# the limits each flood must have met: one code of each group at least once
LIMITS = {"heartbeats": [{"rate_limited"}],
          "requests": [{"rate_limited"}, {"queue_limit_exceeded"}],
          "queries": [{"concurrency_limit", "rate_limited"}],
          "streams": [{"too_many_requests"}]}
MARKER = re.compile(r"\[pool: output past \d+ bytes dropped \(max_output_bytes\)\]")
JOB_IMAGE = "local/job@sha256:" + "c" * 64


def _pool(ws: Workspace, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "cli.main", *args, "--json"],
                         capture_output=True, text=True, env=ws.env(), timeout=60, cwd=ROOT,
                         check=False)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"ok": False, "error": {"code": "no_output",
                                                                      "message": out.stderr}}


def _body(key: str, *, cpu_millis: int = 2, memory_mib: int = 8) -> dict[str, Any]:
    body = lease_body(key, cpu_millis=cpu_millis, memory_mib=memory_mib)
    body["shape"]["runtime"] = "sandboxed"
    return body


def _code(reply: dict[str, Any]) -> str:
    return "ok" if reply.get("ok") else str((reply.get("error") or {}).get("code"))


# -- the floods ------------------------------------------------------------------------------------


class Floods:
    """The noisy tenant's floods, in a process of their own until `stop()` (a neighbour is
    another client: its work must not share the quiet tenant's interpreter): each kind's
    answers counted by code, and the request keys each answer came back for."""

    def __init__(self, nats_url: str, creds: Credentials, http_url: str, token: str,
                 *, running: str, concurrency: int, streams: int, tag: str,
                 kinds: Any = None) -> None:
        import multiprocessing

        self.nats_url, self.creds, self.http_url, self.token = nats_url, creds, http_url, token
        self.tag, self.seconds, self._started = tag, 0.0, 0.0
        self.kinds = set(kinds or ANSWERS)  # all, unless a diagnosis picks some
        self.running, self.concurrency, self.streams = running, concurrency, streams
        self.codes: dict[str, Counter[str]] = {k: Counter() for k in ANSWERS}
        self.accepted: set[str] = set()  # request keys answered ok
        self.refused: set[str] = set()  # request keys answered with a limit's code
        ctx = multiprocessing.get_context("spawn")
        self._stop, self.opened, self._results = ctx.Event(), ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_flood_process, args=(self,), name="chaos-noisy",
                                    daemon=True)
        self.error: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_process"}

    def start(self) -> Floods:
        self._started = time.monotonic()
        self._process.start()
        return self

    def stop(self) -> None:
        import queue

        self._stop.set()
        try:
            codes, self.accepted, self.refused, self.error = self._results.get(timeout=60)
            self.codes = {k: Counter(v) for k, v in codes.items()}
        except queue.Empty:
            self.error = "the flood process sent no result within 60 s"
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
        self.seconds = time.monotonic() - self._started

    def serve(self) -> None:
        """In the flood process: run every flood until told to stop, then send the answers."""
        error: str | None = None
        try:
            asyncio.run(self._run())
        except BaseException as e:  # noqa: BLE001 - reported by the scenario as a failure
            error = repr(e)
        self._results.put(({k: dict(v) for k, v in self.codes.items()}, self.accepted,
                           self.refused, error))

    async def _run(self) -> None:
        from bus.connection import connect
        from bus.local.auth import inbox_prefix

        nc = await connect(self.nats_url, user=self.creds.user, password=self.creds.password,
                           inbox_prefix=inbox_prefix(NOISY).encode())
        try:
            tenant = f"pool.cmd.{NOISY}"
            beat = json.dumps({"epoch": 1}).encode()
            # the streams first: each one's first page is a read, which the query flood
            # would leave no room for (concurrency_limit), and they are held meanwhile
            held = asyncio.ensure_future(self._streams())
            while not self.opened.is_set() and not held.done():
                await asyncio.sleep(0.05)
            work: list[Any] = [held]
            for i in range(self.concurrency):
                if "heartbeats" in self.kinds:
                    work.append(self._loop(
                        nc, "heartbeats",
                        lambda _n: (f"{tenant}.lease.{self.running}.heartbeat", beat)))
                if "queries" in self.kinds:
                    work.append(self._loop(nc, "queries",
                                           lambda _n: (f"{tenant}.query.leases", b"{}")))
                if "requests" in self.kinds:
                    work.append(self._loop(nc, "requests", partial(self._request, i)))
            await asyncio.gather(*work)
        finally:
            await nc.close()

    def _request(self, worker: int, n: int) -> tuple[str, bytes]:
        # after the running lease ends: an accepted request stays queued (the queue cap's
        # work) and takes no capacity from the quiet tenant
        key = f"flood-{self.tag}-{worker}-{n}"
        body = {**_body(key), "after": [{"lease_id": self.running, "condition": "any"}]}
        return f"pool.cmd.{NOISY}.lease.request", json.dumps(body).encode()

    async def _loop(self, nc: Any, kind: str, make: Any) -> None:
        n = 0
        while not self._stop.is_set():
            subject, body = make(n)
            try:
                msg = await nc.request(subject, body, timeout=10)
                code = _code(json.loads(msg.data))
            except Exception as e:  # noqa: BLE001 - a flood no one answered is counted as such
                code = f"no_answer:{type(e).__name__}"
            self.codes[kind][code] += 1
            if kind == "requests":
                key = json.loads(body)["idempotency_key"]
                (self.accepted if code == "ok" else self.refused).add(key)
            n += 1

    async def _streams(self) -> None:
        """Open `streams` event streams through the gateway with the tenant's token, holding
        each one the gateway accepts until the floods stop."""
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"}
        limits = httpx.Limits(max_connections=self.streams + 4)
        if "streams" not in self.kinds:
            self.opened.set()
            return
        async with httpx.AsyncClient(base_url=self.http_url, timeout=10, limits=limits) as c, \
                contextlib.AsyncExitStack() as held:
            async def one() -> None:
                try:
                    r = await held.enter_async_context(
                        c.stream("GET", "/v1/telemetry", headers=headers))
                    if r.status_code == 200:
                        code = "ok"
                    else:
                        code = str(json.loads(await r.aread()).get("code"))
                except Exception as e:  # noqa: BLE001 - counted as no answer
                    code = f"no_answer:{type(e).__name__}"
                self.codes["streams"][code] += 1

            for _ in range(self.streams):  # one after another: each one's first page is a
                await one()                 # read, which the tenant's read cap would refuse
            self.opened.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.1)


def _flood_process(floods: Floods) -> None:
    floods.serve()


# -- the quiet tenant --------------------------------------------------------------------------------


def _quiet(client: Any, phase: str, count: int, rate: float
           ) -> tuple[dict[str, float], Counter[str]]:
    """`count` lease requests at `rate` a second: when each lease's request was sent, and the
    answers' codes."""
    sent: dict[str, float] = {}
    codes: Counter[str] = Counter()
    start = time.monotonic()
    for k in range(count):
        delay = start + k / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        at = time.time()
        reply = client.request_lease(_body(f"{phase}-{k}"))
        codes[_code(reply)] += 1
        if reply.get("ok"):
            sent[str(reply["lease"]["lease_id"])] = at
    return sent, codes


def _latencies(sent: dict[str, float], reserved: dict[str, float]) -> list[float]:
    return [reserved[lid] - at for lid, at in sent.items() if lid in reserved]


# -- the scenario ------------------------------------------------------------------------------------


def scenario_noisy_neighbour(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """`pool up` with users, its gateway and views, `pool agent run` as the one node; the quiet
    tenant's load alone, then again while the noisy tenant floods."""
    from agents.runtimes.process import ProcessRuntime
    from bench.loadgen import stored_times
    from bus.local.auth import url_with_credentials
    from local.embedded import tenant_credentials

    why = ProcessRuntime(ws.dir / "probe").available()
    if why is not None:
        o.skipped = f"process runtime unavailable ({why})"
        return
    # each flood meets its own limit here; the connection cap is scenario 9's (its flood of
    # connections): 32 clients a kind and the gateway's streams are past a tenant's 64, and the
    # guard closing them would make this scenario about reconnects instead
    ws.settings.update(POOL_TENANT_COMMANDS_PER_SECOND=str(size["commands_per_second"]),
                       POOL_TENANT_COMMAND_BURST=str(size["command_burst"]),
                       POOL_TENANT_MAX_CONNECTIONS="1000")
    up = ws.spawn("up", "up", "--http", "127.0.0.1:0")
    up.wait_ready("ready:", timeout=120)
    endpoints = json.loads((ws.home / "endpoints.json").read_text())
    nats_url = str(endpoints["nats_url"])
    service_url = str(endpoints.get("service_url") or nats_url)
    ws.urls.add(service_url)
    http = re.search(r"http: (http://\S+) ", up.output())
    if http is None:
        raise RuntimeError("pool up started no gateway")
    admin = ws.client(service_url)
    setup_pool(admin, [QUIET, NOISY], node_timeout_seconds=int(size["node_timeout_s"]),
               heartbeat_timeout_seconds=int(size["heartbeat_timeout_s"]),
               max_queued_leases=int(size["queue_cap"]),
               requests_per_second=int(size["requests_per_second"]),
               request_burst=int(size["request_burst"]),
               max_output_bytes=int(size["output_cap"]))
    must(_pool(ws, "admin", "node", "creds", "n1", "--pool", "p1", "--trust", "trusted"))
    token = str(_pool(ws, "admin", "tenant", "token", NOISY).get("token") or "")
    if not token:
        raise RuntimeError("no HTTP token for the noisy tenant")
    must(_pool(ws, "admin", "tenant", "creds", QUIET))
    agent = ws.spawn("agent", "agent", "run", "--node-id", "n1", "--pool", "p1",
                     "--heartbeat-interval", "0.5", "--reserve-memory-mib", "0")
    agent.wait_ready("agent n1 in pool p1")
    clients = {}
    for t in (QUIET, NOISY):
        creds = tenant_credentials(t, ws.home)
        assert creds is not None
        clients[t] = (ws.client(url_with_credentials(nats_url, creds), t, timeout=30), creds)
    quiet, noisy = clients[QUIET][0], clients[NOISY][0]

    def state(lid: str) -> str:
        return str((noisy.lease(lid, "get").get("lease") or {}).get("state"))

    def running(key: str, command: list[str]) -> str:
        lid = str(must(noisy.request_lease(_body(key, cpu_millis=100, memory_mib=64)))
                  ["lease"]["lease_id"])
        if not wait_for(lambda: state(lid) == "reserved", 30, 0.1):
            raise RuntimeError(f"the noisy tenant's lease {key} was not reserved")
        must(noisy.lease(lid, "commit", {"job": {"image": JOB_IMAGE, "command": command}}))
        return lid

    # the lease whose heartbeats the noisy tenant floods: running before the quiet load starts
    beating = running("beating", ["sleep", "600"])
    if not wait_for(lambda: state(beating) == "running", 30, 0.1):
        raise RuntimeError("the noisy tenant's job did not start")
    log_before = _last_seq(service_url)
    run = _Rounds(size, quiet)
    since = time.monotonic()

    def flood(r: int) -> Floods:
        return Floods(nats_url, clients[NOISY][1], http.group(1), token, running=beating,
                      concurrency=int(size["concurrency"]), streams=int(size["streams"]),
                      tag=str(r), kinds=size.get("kinds")).start()

    printing = ""
    for r in range(int(size["rounds"])):  # alone and beside in turns: the machine's own load
        run.phase("alone", r)             # drifts alike under both
        floods = flood(r)
        if not printing:  # and, in the first, a job whose output runs past the pool's cap
            printing = running("printing", ["sh", "-c", (
                f"yes noisy-neighbour-output | head -c {int(size['output_bytes'])}; sleep 600")])
        time.sleep(1.0)  # every flood under way
        run.phase("beside", r)
        floods.stop()
        run.add(floods)
    run.seconds = time.monotonic() - since
    capped = wait_for(partial(_output_capped, noisy, printing), 30, 0.5)
    # when each quiet lease was reserved: the server's stored time of its LeaseReserved
    requested, reserved = stored_times(service_url, log_before)
    run.judge_latency(o, requested, reserved)
    _judge_floods(o, run, bool(capped))
    # the flood's accepted leases wait on a lease that runs on: all still queued at the end
    o.zero("queued_past_cap", max(0, len(run.accepted) - int(size["queue_cap"])))
    _judge_log(o, ws.log_reader(service_url), run, beating=beating, printing=printing,
               after=log_before, beat_s=float(size["heartbeat_timeout_s"]) / 4)
    agent.stop()


class _Rounds:
    """The quiet tenant's load, alone and beside the floods in turns, and what the floods got."""

    def __init__(self, size: dict[str, Any], client: Any) -> None:
        self.client, self.count, self.rate = client, int(size["quiet"]), float(size["rate"])
        self.sent: dict[str, dict[str, float]] = {"alone": {}, "beside": {}}
        self.codes: Counter[str] = Counter()
        self.cpu: dict[str, Counter[str]] = {"alone": Counter(), "beside": Counter()}
        self.floods: dict[str, Counter[str]] = {k: Counter() for k in ANSWERS}
        self.accepted: set[str] = set()
        self.refused: set[str] = set()
        self.flood_s = 0.0  # the floods' own time
        self.seconds = 0.0  # the rounds' whole time

    def phase(self, name: str, r: int) -> None:
        before = _cpu_seconds()
        sent, codes = _quiet(self.client, f"{name}-{r}", self.count, self.rate)
        self.cpu[name].update({k: v - before.get(k, 0.0) for k, v in _cpu_seconds().items()})
        self.sent[name].update(sent)
        self.codes.update(codes)
        for lid in sent:  # its capacity back before the next phase, within its own rate
            while _code(self.client.lease(lid, "release")) == "rate_limited":
                time.sleep(0.5)

    def add(self, floods: Floods) -> None:
        if floods.error is not None:
            raise RuntimeError(f"the floods failed: {floods.error!r}")
        for kind, codes in floods.codes.items():
            self.floods[kind].update(codes)
        self.accepted |= floods.accepted
        self.refused |= floods.refused
        self.flood_s += floods.seconds

    def judge_latency(self, o: Outcome, requested: dict[str, float],
                      reserved: dict[str, float]) -> None:
        p99 = {k: percentile(_latencies(sent, reserved), 99) for k, sent in self.sent.items()}
        o.figures.update(quiet=sum(map(len, self.sent.values())),
                         p99_alone_ms=p99["alone"] * 1000, p99_beside_ms=p99["beside"] * 1000,
                         p99_ratio=p99["beside"] / p99["alone"] if p99["alone"] else 0.0)
        o.expect(0 < p99["beside"] <= 2 * p99["alone"],
                 f"the quiet tenant's request → reserved p99 went from "
                 f"{p99['alone'] * 1000:.0f} ms alone to {p99['beside'] * 1000:.0f} ms beside "
                 "the floods (more than 2×)")
        o.zero("quiet_refused", sum(n for c, n in self.codes.items() if c != "ok"),
               str(dict(self.codes)))
        o.zero("quiet_unreserved", len([lid for sent in self.sent.values() for lid in sent
                                        if lid not in reserved]))
        for name, sent in self.sent.items():  # where the time went, and the CPU
            o.detail[name] = {
                "sent_to_stored_p99_ms": percentile(_latencies(sent, requested), 99) * 1000,
                "stored_to_reserved_p99_ms": percentile(
                    [reserved[lid] - requested[lid] for lid in sent
                     if lid in reserved and lid in requested], 99) * 1000,
                "cpu_s": {k: round(v, 2) for k, v in self.cpu[name].items()}}


def _judge_log(o: Outcome, log: Any, run: _Rounds, *, beating: str, printing: str, after: int,
               beat_s: float) -> None:
    """What the log grew by since the quiet load began, by whose lease: the quiet tenant's,
    the flood's accepted requests' (and its two jobs'), nothing of a refused one; and no
    node lost in the whole run."""
    from projections.replay import event_name, notifications

    flood_leases = {lease_id_for(NOISY, k) for k in run.accepted} | {beating, printing}
    refused = {lease_id_for(NOISY, k) for k in run.refused}
    quiet_leases = {lid for sent in run.sent.values() for lid in sent}
    grew: Counter[str] = Counter()
    lost = beats = 0
    for n in notifications(log):
        name, lid = event_name(n.topic), str(n.originator_id)
        lost += name == "NodeLost"
        if n.id <= after:
            continue
        beats += name == "HeartbeatRecorded" and lid == beating
        if lid in refused:
            grew["refused"] += 1
        elif lid in quiet_leases:
            grew["quiet"] += 1
        elif lid in flood_leases:
            grew["flood_accepted"] += 1
        elif n.topic.startswith("domain.lease:"):
            grew["unexplained"] += 1
        else:
            grew["other"] += 1  # nodes, accounts, the pool: capacity and credit for the leases
    o.zero("nodes_lost", lost)
    o.figures["log_growth"] = dict(grew)
    o.zero("refused_appended", grew["refused"])
    o.zero("unexplained_events", grew["unexplained"])
    # one heartbeat (the tenant's flood or its agent's) is news each quarter of the timeout:
    # more than that in the rounds' time is one not coalesced
    bound = int(run.seconds / beat_s) + 1
    o.figures["heartbeats_recorded"] = beats
    o.zero("heartbeats_uncoalesced", max(0, beats - bound),
           f"at most {bound} in {run.seconds:.0f} s")


def _judge_floods(o: Outcome, run: _Rounds, capped: bool) -> None:
    """Every flood answered, and only with ok or its limit's code; each limit met."""
    for kind, codes in run.floods.items():
        o.figures[kind] = dict(codes)
        wrong = {c: n for c, n in codes.items() if c not in ANSWERS[kind]}
        o.expect(not wrong, f"{kind} answered with {wrong}")
        for group in LIMITS[kind]:
            o.expect(any(codes[c] for c in group), f"no {kind} flood met {'/'.join(group)}")
    o.figures["output_capped"] = "yes" if capped else "no"
    o.expect(capped, "the job's output past max_output_bytes was not cut with its marker")


def _output_capped(client: Any, lid: str) -> bool:
    """Whether the lease's shipped output ends with the max_output_bytes marker line."""
    after = 0
    while True:
        page = client.replay_telemetry({"lease": lid, "kind": "output", "after_seq": after})
        result = page.get("result") or {}
        samples = result.get("samples") or []
        if any(MARKER.search(json.dumps(s)) for s in samples):
            return True
        last = int(result.get("last_seq") or 0)
        if not samples or last <= after:
            return False
        after = last


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process and of every process under it (`pool up` with its
    nats-server and scheduler, the agent), by command (user + system, from /proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float, str]] = {}  # pid: (parent, seconds, name)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        words = [c.decode(errors="replace") for c in cmd if c]
        name = (" ".join(words[words.index("cli.main") + 1:][:2]) if "cli.main" in words
                else "chaos floods" if "--multiprocessing-fork" in words
                and int(stat[1]) == os.getpid()
                else Path(words[0]).name if words else "?")
        stats[int(entry)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / tick, name)
    out: dict[str, float] = {}
    for pid, (_parent, seconds, name) in stats.items():
        up = pid
        while up in stats and up != os.getpid():
            up = stats[up][0]
        if up == os.getpid():
            key = "chaos (quiet tenant)" if pid == os.getpid() else name
            out[key] = out.get(key, 0.0) + seconds
    return out


def _last_seq(url: str) -> int:
    async def go() -> int:
        from bus.connection import connect
        from bus.subjects import EVENTS_STREAM

        nc = await connect(url)
        try:
            return int((await nc.jetstream().stream_info(EVENTS_STREAM)).state.last_seq)
        finally:
            await nc.close()

    return asyncio.run(go())
