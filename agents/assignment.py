"""What a start order asks of a node: the checks before its job may start here, and the
workload spec the runtime is handed for it.
"""

from __future__ import annotations

from pathlib import Path

from agents.gpubind import Binding
from agents.runtimes.contract import WorkloadSpec
from agents.workdir import JobFiles
from schemas import v1

# isolation classes, weakest first: a runtime that gives a stronger one may serve a weaker ask
_STRENGTH = ("container", "sandboxed", "microvm", "dedicated-host")


def _stronger_or_equal(have: str, want: str) -> bool:
    try:
        return _STRENGTH.index(have) >= _STRENGTH.index(want)
    except ValueError:
        return False


def refusals(a: v1.LeaseAssignment, *, isolation_classes: tuple[str, ...],
             trust_level: str) -> list[str]:
    """Why this node may not run the order's job (its isolation, its image policy); [] if none."""
    reasons: list[str] = []
    want = a.shape.runtime
    if not any(_stronger_or_equal(have, want) for have in isolation_classes):
        reasons.append("isolation_unavailable")
    if a.image_policy is not None:
        from domain.policy.images import verify_for_start

        reasons += verify_for_start(
            a.image_policy, a.job.image, a.job.image_signature, a.job.image_size_bytes,
            trust_level, want, tenant=a.tenant)
    return reasons


def where(a: v1.LeaseAssignment, node_id: str) -> tuple[tuple[str, str], ...]:
    """What the job is told of where it runs (after its own env, so these win)."""
    told: tuple[tuple[str, str], ...] = (
        ("POOL_LEASE_ID", a.lease_id), ("POOL_TENANT", a.tenant), ("POOL_POOL", a.pool_id),
        ("POOL_NODE", node_id), ("POOL_ATTEMPT", str(a.attempt)))
    if a.array_size:  # one of the leases of a `count` request
        told += (("POOL_ARRAY_INDEX", str(a.array_index or 0)),
                 ("POOL_ARRAY_SIZE", str(a.array_size)))
    return told


def workload_spec(a: v1.LeaseAssignment, bound: Binding, *, node_id: str, checkpoint_dir: Path,
                  files: JobFiles) -> WorkloadSpec:
    """The order as its runtime is handed it (volumes and secrets are added once checked)."""
    return WorkloadSpec(
        lease_id=a.lease_id, epoch=a.epoch, job_number=a.job_number,
        command=tuple(a.job.command), image=a.job.image,
        env=(*a.job.env.items(), *where(a, node_id)),
        cpu_millis=a.shape.cpu_millis, memory_mib=max(16, a.shape.memory_mib),
        max_image_size_bytes=(a.image_policy or {}).get("max_image_size_bytes"),
        gpu_count=a.shape.gpu_count, network_egress=a.shape.network.egress,
        gpu_uuids=bound.uuids, gpu_minors=bound.minors, gpu_mig=bound.mig, gpu_caps=bound.caps,
        isolation=a.shape.runtime,
        checkpoint_dir=str(checkpoint_dir),
        labels=(("computepool.tenant", a.tenant), ("computepool.pool", a.pool_id)),
        workdir=str(files.job_dir(f"{a.lease_id}.{a.epoch}.{a.job_number}"))
        if a.job.workdir is not None or a.job.artifacts else None,
        output_cap_bytes=a.max_output_bytes, stdin=a.job.stdin, egress_allow=tuple(a.egress_allow),
    )
