"""The real-GPU check (`scripts/gpu-check.sh`): one job per NVIDIA GPU, bound to its device.
What it needs, does and proves: docs/gpus.md#the-real-gpu-check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
_UUID = re.compile(r"\(UUID: ((?:GPU|MIG)-[0-9A-Za-z-]+)\)")


def _say(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def run(*, timeout_s: float = 240.0) -> int:
    """The whole check; an exit code (0: every job saw exactly its own device)."""
    from agents.probe import Reserve, probe_node
    from agents.runtimes.process import ProcessRuntime

    started = time.monotonic()
    probe = probe_node(".")
    if not probe.gpus.gpus:
        _say(f"no NVIDIA GPU here: {probe.gpus.note or 'NVML lists none'}")
        return EXIT_NO_GPU
    whole = probe.gpus.whole()
    _say(f"driver {probe.gpus.driver}: " + ", ".join(
        f"{g.index}:{g.model} {g.uuid} minor={g.minor} nvlink={g.nvlink_domain}"
        for g in probe.gpus.gpus))
    if not whole:
        _say("every GPU is in MIG mode: this check runs one job per whole GPU")
        return EXIT_FAILED
    with tempfile.TemporaryDirectory(prefix="pool-gpu-check-") as tmp:
        state = Path(tmp)
        runtime = ProcessRuntime(state / "agent")
        why = runtime.available()
        if why is not None:
            _say(f"the process runtime cannot start here: {why}")
            return EXIT_FAILED
        if not runtime.binds_gpus():
            _say("the process runtime cannot bind GPUs here (no /dev/nvidiactl)")
            return EXIT_FAILED
        return _check(state, runtime, probe, Reserve(500, 1024, 0), len(whole),
                      started + timeout_s)


def _check(state: Path, runtime: Any, probe: Any, reserve: Any, gpus: int,
           deadline: float) -> int:
    from agents.agent import Agent
    from bus.agentbus import AgentLink
    from bus.local.server import NatsServer
    from client.api import PoolClient
    from control.plane import ControlPlane

    with NatsServer(store_dir=state / "nats", server_name="pool-gpu-check") as server:
        cp = ControlPlane(server.url, leader_ttl_seconds=1.0).start()
        admin = PoolClient(server.url)
        tenant = PoolClient(server.url, "gpucheck")
        stop = threading.Event()
        link = None
        thread = None
        try:
            _ok(admin.admin("pool.set", {"pool_id": "gpu", "priority_classes": {"standard": 10},
                                         "heartbeat_timeout_seconds": 30}))
            _ok(admin.admin("tenant.set", {"tenant": "gpucheck", "pool_id": "gpu",
                                           "weight": 1.0}))
            _ok(admin.admin("credits.grant", {"tenant": "gpucheck", "transfer_id": "gpu-check",
                                              "amount_microcredits": 10**12}))
            # an enrollment allows no GPUs unless it says how many
            _ok(admin.admin("node.enroll", {"node_id": "gpu-check", "pool_id": "gpu",
                                            "trust_level": "trusted",
                                            "max_gpus": len(probe.gpus.gpus)}))
            link = AgentLink(server.url, "gpu-check").connect()
            agent = Agent(link, runtime, node_id="gpu-check", pool_id="gpu", probe=probe,
                          state_dir=state / "agent", reserve=reserve, heartbeat_interval=1.0)
            _ok(agent.register())
            thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
            thread.start()
            leases = []
            for k in range(gpus):
                r = _ok(tenant.request_lease({
                    "pool_id": "gpu", "idempotency_key": f"gpu-check-{k}",
                    "shape": {"cpu_millis": 100, "memory_mib": 256, "gpu_count": 1,
                              "runtime": "sandboxed"},
                    "maximum_runtime_seconds": 300}))
                leases.append(r["lease"]["lease_id"])
            devices = {lid: _wait(lambda lid=lid: tenant.lease(lid, "get")["lease"].get(
                "devices"), deadline, f"lease {lid} reserved") for lid in leases}
            for lid in leases:
                # the process runtime runs the host's nvidia-smi; the image is only recorded
                _ok(tenant.lease(lid, "commit", {"job": {
                    "image": "local/gpu-check@sha256:" + "0" * 64,
                    "command": ["nvidia-smi", "-L"]}}))
            for lid in leases:
                _wait(lambda lid=lid: tenant.lease(lid, "get")["lease"]["state"] in (
                    "released", "expired", "reconciling"), deadline, f"lease {lid} ended")
            return _judge(state / "agent" / "process", leases, devices)
        finally:
            stop.set()
            if thread is not None:
                thread.join(15)
            if link is not None:
                link.close()
            tenant.close()
            admin.close()
            cp.stop()


def _judge(logs: Path, leases: list[str], devices: dict[str, list[str]]) -> int:
    """Each job's `nvidia-smi -L` must list exactly its lease's one device."""
    failed = 0
    report = []
    for lid in leases:
        out = "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"{lid}.*.log")))
        seen = _UUID.findall(out)
        ok = seen == devices[lid]
        failed += not ok
        report.append({"lease_id": lid, "devices": devices[lid], "nvidia_smi_L": out.strip(),
                       "saw_exactly_its_own": ok})
        print(f"lease {lid} bound to {','.join(devices[lid])}:", flush=True)
        print("  " + (out.strip().replace("\n", "\n  ") or "(no output)"), flush=True)
    all_devices = [d for lid in leases for d in devices[lid]]
    distinct = len(set(all_devices)) == len(all_devices)
    print(json.dumps({"ok": not failed and distinct, "jobs": report}), flush=True)
    if not distinct:
        _say("two leases were bound to one device")
    return EXIT_OK if not failed and distinct else EXIT_FAILED


def _ok(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        raise RuntimeError(f"refused: {reply.get('error')}")
    return reply


def _wait(what: Any, deadline: float, label: str) -> Any:
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {label}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole check")
    args = p.parse_args(argv)
    try:
        return run(timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as e:
        _say(str(e))
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
