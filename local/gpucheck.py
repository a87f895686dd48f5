"""The real-GPU check (`scripts/gpu-check.sh`): one job per NVIDIA GPU or MIG instance, bound
to its device. What it needs, does and proves: docs/gpus.md#the-real-gpu-check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import re
import shlex
import sys
import tempfile
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
_UUID = re.compile(r"\(UUID: ((?:GPU|MIG)-[0-9A-Za-z-]+)\)")
LIST_COMMAND = ("nvidia-smi", "-L")


def _say(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def run(report: dict[str, Any], *, timeout_s: float = 240.0, nvml: Any = None,
        dev: Path = Path("/dev"), list_command: tuple[str, ...] = LIST_COMMAND,
        capabilities: Path | None = None) -> int:
    """The whole check, its findings added to `report`; an exit code (0: every job saw
    exactly its own device). `nvml`, `dev`, `list_command` and `capabilities` (the driver's
    MIG capabilities folder) are stand-ins' seams."""
    from agents.probe import Reserve, probe_node
    from agents.runtimes.process import ProcessRuntime

    started = time.monotonic()
    probe = probe_node(".", nvml=nvml, capabilities=capabilities)
    report["gpus"] = probe.gpus.to_dict()
    if not probe.gpus.gpus:
        return _fail(report, f"no NVIDIA GPU here: {probe.gpus.note or 'NVML lists none'}",
                     EXIT_NO_GPU)
    _say(f"driver {probe.gpus.driver}: " + ", ".join(
        f"{g.index}:{g.model} {g.uuid} minor={g.minor} nvlink={g.nvlink_domain}"
        + (f" MIG={','.join(p for p, _ in g.mig_profiles)}" if g.mig_enabled else "")
        for g in probe.gpus.gpus))
    with tempfile.TemporaryDirectory(prefix="pool-gpu-check-") as tmp:
        state = Path(tmp)
        runtime = ProcessRuntime(state / "agent", dev=dev)
        why = runtime.available()
        report["bwrap"] = runtime.bwrap
        if why is not None:
            return _fail(report, f"the process runtime cannot start here: {why}")
        if not runtime.binds_gpus():
            return _fail(report, f"the process runtime cannot bind GPUs here (no {dev}/nvidiactl)")
        return _check(state, runtime, probe, Reserve(500, 1024, 0), report, list_command,
                      started + timeout_s)


def _fail(report: dict[str, Any], why: str, code: int = EXIT_FAILED) -> int:
    _say(why)
    report["reason"] = why
    return code


def _shapes(probe: Any) -> list[dict[str, Any]]:
    """One lease shape per device: a whole GPU each, and each MIG instance by its profile."""
    base = {"cpu_millis": 100, "memory_mib": 256, "gpu_count": 1, "runtime": "sandboxed"}
    shapes = [dict(base) for _ in probe.gpus.whole()]
    for g in probe.gpus.gpus:
        if g.mig_enabled:
            shapes += [{**base, "gpu_partition": profile} for profile, _ in g.mig_profiles]
    return shapes


def _check(state: Path, runtime: Any, probe: Any, reserve: Any, report: dict[str, Any],
           list_command: tuple[str, ...], deadline: float) -> int:
    from agents.agent import Agent
    from bus.agentbus import AgentLink
    from bus.local.server import NatsServer
    from client.api import PoolClient
    from workers.bootstrap import PlaneConfig, build, served
    from workers.plane import ROLES, ControlPlane

    with NatsServer(store_dir=state / "nats", server_name="pool-gpu-check") as server:
        config = PlaneConfig(server.url, leader_ttl_seconds=1.0)
        cp = ControlPlane(build(config, served(ROLES))).start()
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
            for k, shape in enumerate(_shapes(probe)):
                r = _ok(tenant.request_lease({
                    "pool_id": "gpu", "idempotency_key": f"gpu-check-{k}", "shape": shape,
                    "maximum_runtime_seconds": 300}))
                leases.append(r["lease"]["lease_id"])
            devices = {lid: _wait(lambda lid=lid: tenant.lease(lid, "get")["lease"].get(
                "devices"), deadline, f"lease {lid} reserved") for lid in leases}
            for lid in leases:
                # the process runtime runs the host's nvidia-smi; the image is only recorded
                _ok(tenant.lease(lid, "commit", {"job": {
                    "image": "local/gpu-check@sha256:" + "0" * 64,
                    "command": list(list_command)}}))
            for lid in leases:
                _wait(lambda lid=lid: tenant.lease(lid, "get")["lease"]["state"] in (
                    "released", "expired", "reconciling"), deadline, f"lease {lid} ended")
            # what each job printed, as its tenant reads it (the node deletes its own copy once
            # shipped)
            outputs = {lid: _output(tenant, lid) for lid in leases}
            return _judge(outputs, leases, devices, _parents(probe), report)
        finally:
            stop.set()
            if thread is not None:
                thread.join(15)
            if link is not None:
                link.close()
            tenant.close()
            admin.close()
            cp.stop()


def _parents(probe: Any) -> dict[str, str]:
    """MIG instance UUID -> its GPU's UUID."""
    return {uuid: g.uuid for g in probe.gpus.gpus for _, uuid in g.mig_profiles}


def _output(tenant: Any, lease_id: str) -> str:
    """The job's output, paged through the plane's telemetry replay as its tenant."""
    text, after = [], 0
    while True:
        reply = _ok(tenant.replay_telemetry({"lease": lease_id, "kind": "output",
                                             "after_seq": after, "limit": 500}))
        result = reply.get("result") or {}
        samples = result.get("samples") or []
        after = max([after, int(result.get("last_seq") or 0),
                     *(int(x.get("seq") or 0) for x in samples)])
        text += [t for x in samples
                 if isinstance(t := ((x.get("event") or {}).get("attrs") or {}).get("text"), str)]
        if result.get("at_end", True) or not (samples or result.get("last_seq")):
            return "".join(text)


def _judge(outputs: dict[str, str], leases: list[str], devices: dict[str, list[str]],
           parents: dict[str, str], report: dict[str, Any]) -> int:
    """Each job's `nvidia-smi -L` must list exactly its lease's device: a whole GPU alone, or a
    MIG instance under its own GPU (nvidia-smi names the GPU first) and no other instance."""
    failed = 0
    jobs = []
    for lid in leases:
        out = outputs[lid]
        seen = _UUID.findall(out)
        expected = [u for d in devices[lid] for u in ((parents[d], d) if d in parents else (d,))]
        ok = sorted(seen) == sorted(expected)
        failed += not ok
        jobs.append({"lease_id": lid, "devices": devices[lid], "expected": expected,
                     "seen": seen, "saw_exactly_its_own": ok, "output": out})
        print(f"lease {lid} bound to {','.join(devices[lid])}: "
              f"{'exactly its own' if ok else 'NOT exactly its own'}", flush=True)
        print("  " + (out.strip().replace("\n", "\n  ") or "(no output)"), flush=True)
    all_devices = [d for lid in leases for d in devices[lid]]
    distinct = len(set(all_devices)) == len(all_devices)
    report["jobs"] = jobs
    if not distinct:
        _fail(report, "two leases were bound to one device")
    elif failed:
        _fail(report, f"{failed} of {len(leases)} jobs did not see exactly their own device")
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


def write_report(out: Path, report: dict[str, Any]) -> None:
    """`report.json`, and each job's output as `jobs/<lease id>.txt`."""
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    for job in report.get("jobs", []):
        (out / "jobs" / f"{job['lease_id']}.txt").write_text(job["output"])
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole check")
    p.add_argument("--out", type=Path, help="write report.json and each job's output here")
    p.add_argument("--nvml", metavar="MODULE",
                   help="import this module instead of pynvml (a test's stand-in)")
    p.add_argument("--dev", type=Path, default=Path("/dev"),
                   help="where the GPUs' device nodes are (a test's stand-in /dev)")
    p.add_argument("--capabilities", type=Path,
                   help="the driver's MIG capabilities folder (a test's stand-in of "
                        "/proc/driver/nvidia/capabilities)")
    p.add_argument("--list-command", default=shlex.join(LIST_COMMAND),
                   help="what each job runs to list the GPUs it sees (default: %(default)s)")
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "python": platform.python_version(), "list_command": args.list_command}
    try:
        nvml = importlib.import_module(args.nvml) if args.nvml else None
        code = run(report, timeout_s=args.timeout, nvml=nvml, dev=args.dev,
                   list_command=tuple(shlex.split(args.list_command)),
                   capabilities=args.capabilities)
    except (RuntimeError, TimeoutError) as e:
        code = _fail(report, str(e))
    except Exception as e:  # noqa: BLE001 - a GPU machine's one run must still leave a report
        traceback.print_exc()
        code = _fail(report, f"{type(e).__name__}: {e}")
    report["ok"] = code == EXIT_OK
    report["exit"] = code
    if "jobs" in report:
        print(json.dumps({"ok": report["ok"], "jobs": [
            {k: v for k, v in j.items() if k != "output"} for j in report["jobs"]]}), flush=True)
    if args.out is not None:
        write_report(args.out, report)
    return code


if __name__ == "__main__":
    sys.exit(main())
