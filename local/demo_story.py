"""The demo's story: the tenants' requests (special cases, the flood, the twists), the commits
they make as leases are reserved, and the wait for it all to end."""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

from local.demo_stage import (
    EDGE,
    FLOOD_SHAPE,
    HALF_LAB,
    HPC,
    IMAGE,
    LAB,
    POOL,
    TENANTS,
    TRAIN,
    Stage,
    Tracked,
)


class Story(Stage):
    """The scenes the tenants play, on the stage set up below."""

    # -- the tenants -------------------------------------------------------------------------

    def committer(self) -> None:
        """Each tenant commits its leases once the leases view shows them reserved (a requeued
        one again); one query a round, not a request per lease."""
        from bus.errors import BusError
        from projections.summary import Summary

        summary = Summary(self.emb.database_url)
        try:
            while not self._stop.is_set():
                with self._lock:
                    pending = {t.lease_id: t for t in self.tracked.values()
                               if t.state not in ("released", "cancelled", "rejected")}
                for lid, state in summary.states(list(pending)).items():
                    t = pending[lid]
                    t.state = state
                    if state == "reserved":
                        try:
                            r = self.clients[t.tenant].lease(lid, "commit",
                                                             {"job": t.job} if t.job else {})
                        except BusError as e:
                            # a plane too busy to answer in time: say so in the report, and
                            # ask again next round (a commit is idempotent) rather than stop
                            self.unanswered.append(f"commit of {lid}: {e}")
                            continue
                        if r.get("ok"):
                            t.state = r["lease"]["state"]
                self._stop.wait(0.3)
        finally:
            summary.close()

    def watcher(self) -> None:
        """The views' summary for the live dashboard, once a second (shown, never judged: the
        checks read the log)."""
        from projections.summary import Summary

        summary = Summary(self.emb.database_url)
        try:
            while not self._stop.is_set():
                self.last_snapshot = summary.snapshot()
                self._stop.wait(1.0)
        finally:
            summary.close()

    def scenario(self) -> None:
        """The story: the special cases first, then the flood, then the twists."""
        # a request no node in the pool could ever hold: rejected at once, with reasons
        self.impossible = self.submit("globex", "impossible", {
            "cpu_millis": 1000, "memory_mib": 1024, "gpu_count": 16}, None, kind="impossible")
        # preemptible batch work that fills the HPC node (an urgent job will want it)
        victims = [self.submit("globex", f"batch-{i}", {"cpu_millis": 8000, "memory_mib": 8192,
                                                        "gpu_count": 8},
                               {"image": IMAGE, "command": ["sleep", "40"]},
                               kind="victim", priority="preemptible", pool=HPC)
                   for i in range(1)]
        self.victims = [v for v in victims if v is not None]
        # a 2-node gang of 8 A100s each in one rack: both members reserved in one save or
        # neither, committed together, each bound to its node's eight devices
        self.gang = self.submit("acme", "train-2x8", {"cpu_millis": 8000, "memory_mib": 8192,
                                                      "gpu_count": 8},
                                {"image": IMAGE, "command": ["sleep", "4"]}, kind="gang",
                                pool=TRAIN, group={"members": 2, "same": "rack"})
        # globex fills the lab node: its own half and, borrowed, acme's
        borrowers = [self.submit("globex", f"borrow-{i}", HALF_LAB,
                                 {"image": IMAGE, "command": ["sleep", "60"]},
                                 kind="borrower", pool=LAB) for i in range(2)]
        self.borrowers = [b for b in borrowers if b is not None]
        # on the edge pool: real sandboxed jobs (one to cancel), and a job on a node whose
        # agent will go silent
        local = {"cpu_millis": 200, "memory_mib": 128, "region": "local", "runtime": "sandboxed"}
        # without a sandbox here, the lease to cancel runs on a simulated node of the main pool
        # (its agent stops the simulated workload and confirms, as a real one would)
        self.to_cancel = self.submit(
            "acme", "long-job", local if self.local else {"cpu_millis": 1000, "memory_mib": 1024},
            {"image": IMAGE, "command": ["sleep", "60"]}, kind="cancel",
            pool=EDGE if self.local else POOL)
        self.quiet = self.submit("acme", "on-quiet-node", {"cpu_millis": 1000, "memory_mib": 1024},
                                 {"image": IMAGE, "command": ["sleep", "60"]}, kind="quiet",
                                 pool=EDGE)
        self.sandboxed: list[Tracked] = []
        if self.local:
            for i in range(3):
                t = self.submit("acme", f"sandboxed-{i}", local, {"image": IMAGE, "command": [
                    "sh", "-c", f"echo job {i} as $(id -u) in a sandbox; sleep 2"]},
                    kind="sandboxed", pool=EDGE)
                if t is not None:
                    self.sandboxed.append(t)

        # a flood of whole-node jobs from all three tenants: fair share decides who runs
        def flood(tenant: str, offset: int) -> None:
            rnd = random.Random(offset)
            for i in range(offset, self.flood, 3):
                self.submit(tenant, f"flood-{i}", FLOOD_SHAPE,
                            {"image": IMAGE, "command": ["sleep", str(rnd.choice((2, 3, 4)))]})

        floods = [threading.Thread(target=flood, args=(t, k), daemon=True)
                  for k, t in enumerate(TENANTS)]
        for th in floods:
            th.start()
        self._wait_running(self.victims + self.borrowers
                           + [x for x in (self.to_cancel, self.quiet) if x], 60)
        # the twists: an urgent job preempts the batch work, a cancel, an agent goes quiet
        self.high = self.submit("acme", "urgent", {"cpu_millis": 8000, "memory_mib": 8192,
                                                   "gpu_count": 8},
                                {"image": IMAGE, "command": ["sleep", "3"]}, kind="high",
                                priority="high", pool=HPC)
        # acme wants its own half of the lab back: one of globex's leases is preempted for it
        self.owner = self.submit("acme", "my-half", HALF_LAB,
                                 {"image": IMAGE, "command": ["sleep", "3"]}, kind="owner",
                                 pool=LAB)
        if self.owner is not None:
            deadline = time.monotonic() + 20  # answered at once unless the plane is loaded
            while time.monotonic() < deadline:
                why = self.clients["acme"].lease(self.owner.lease_id, "why").get("result") or {}
                if "waiting_for_reclaim" in str(why.get("reasons")):
                    self.reclaim_why = why.get("reasons")
                    break
                time.sleep(0.2)
        if self.to_cancel is not None:
            self.clients["acme"].lease(self.to_cancel.lease_id, "cancel", {"reason": "demo"})
        if self.quiet is not None:
            # the node's agent stops answering (as a hung or partitioned host would)
            self.procs["fleet-quiet"].send_signal(signal.SIGSTOP)
        for th in floods:
            th.join()

    def _wait_running(self, ts: list[Tracked], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                self.get(t).get("state") == "running" for t in ts):
            time.sleep(0.3)

    # -- the end -----------------------------------------------------------------------------

    def settle(self, timeout: float) -> None:
        """Wait for the story to finish; then cancel whatever still waits (out of credit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            open_ = [t for t in self.tracked.values() if t.kind not in ("victim", "borrower")
                     and t.state not in ("released", "cancelled", "rejected", "preempted")
                     and not (t.tenant == "initech" and t.state == "queued")]
            if not open_ and self.elapsed() > 8:
                break
            self._refresh()
            time.sleep(0.5)
        self._refresh()
        self.credit_why = self._credit_why([t for t in self.tracked.values()
                                            if t.tenant == "initech" and t.state == "queued"])
        for t in self.tracked.values():
            if t.state in ("queued", "reserved", "running", "preempting"):
                self.clients[t.tenant].lease(t.lease_id, "cancel", {"reason": "demo over"})

    def _credit_why(self, waiting: list[Tracked], timeout: float = 10.0) -> dict[str, Any]:
        """`why` of initech's waiting leases: the first that names its credits. A lease queued
        since the scheduler's last cycle has no reasons yet, so ask again until one does."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while waiting:
            for t in waiting:
                why = self.clients["initech"].lease(t.lease_id, "why").get("result") or {}
                last = why or last
                if "insufficient_credits" in str(why.get("reasons", {})):
                    return why
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        return last

    def _refresh(self) -> None:
        for t in list(self.tracked.values()):
            if t.state not in ("released", "cancelled", "rejected", "preempted"):
                lease = self.get(t)
                t.state = lease.get("state", t.state)
                t.final = lease
