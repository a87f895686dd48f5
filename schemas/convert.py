"""Wire to domain and back for the whole-object conversions: pool settings and patches, image
policies, and the lease as a reply shows it."""

from __future__ import annotations

import dataclasses
from typing import Any

from domain.lease import Lease
from domain.policy.images import DEFAULT_ISOLATION_BY_TRUST, ImagePolicy
from domain.poolconfig import PoolConfig, PreemptionSettings, normal_egress_allow
from domain.volumes import Volume
from schemas import v1
from schemas.hostaccess import VolumeConfig


def lease_view(lease: Lease) -> dict[str, Any]:
    """The lease as a reply shows it."""
    return {
        "lease_id": str(lease.id),
        "tenant": lease.tenant_id,
        "pool_id": lease.pool_id,
        "state": str(lease.state),
        "epoch": lease.epoch,
        "node_id": lease.node_id,
        "devices": list(lease.devices),  # the node's GPU devices it holds
        "name": lease.name,
        "labels": dict(lease.labels),
        "priority_class": lease.priority_class,
        "preemptible": lease.preemptible,
        "checkpointable": lease.checkpointable,
        "requeue_on_preemption": lease.requeue_when_preempted,
        "shape": lease.requested_shape.to_dict(),
        "maximum_runtime_seconds": lease.maximum_runtime_seconds,
        "requested_at": lease.requested_at,
        "reserved_at": lease.reserved_at,
        "reservation_deadline": lease.reservation_deadline,
        "started_at": lease.started_at,
        "deadline": lease.deadline,
        "last_heartbeat_at": lease.last_heartbeat_at,
        "last_checkpoint_at": lease.last_checkpoint_at,
        "hold_microcredits": lease.hold_microcredits,
        "attempts": lease.attempts,  # the attempt it is on: 2, 3, … once retried
        # each retried attempt's end: [{attempt, end_reason, node_id, exit_code, ended_at}]
        "attempt_ends": [{"attempt": a, "end_reason": r, "node_id": n, "exit_code": c,
                          "ended_at": at} for a, r, n, c, at in lease.attempt_ends],
        "held_reason": lease.held_reason,
        "held_until": lease.held_until,
        "after": [list(d) for d in lease.after or ()],
        "max_running": lease.max_running,
        "exit_code": lease.exit_code,
        "end_reason": lease.end_reason,
        "rejection_code": lease.rejection_code,
        "version": lease.version,
    }


def gang_view(members: list[Lease]) -> dict[str, Any]:
    """A gang as a reply shows it beside any of its members: its constraint and, per member
    in member order, where it is and which devices it holds."""
    gang = next(m.gang for m in members if m.gang is not None)
    return {
        "gang_id": gang.gang_id,
        "size": gang.size,
        "strategy": gang.strategy,
        "same": gang.same,
        "spread": gang.spread,
        "members": [{"member": m.gang.member if m.gang is not None else None,
                     "lease_id": str(m.id), "state": str(m.state), "epoch": m.epoch,
                     "node_id": m.node_id, "devices": list(m.devices)} for m in members],
    }


def _default_class(classes: dict[str, int]) -> str:
    return "standard" if "standard" in classes else min(classes, key=classes.__getitem__)


def pool_config_from_wire(cfg: v1.PoolConfig) -> PoolConfig:
    classes = dict(cfg.priority_classes)
    return PoolConfig(
        packing=cfg.packing,
        commit_timeout_seconds=cfg.commit_timeout_seconds,
        priority_classes=tuple(classes.items()),
        default_priority_class=_default_class(classes),
        preemption=PreemptionSettings(
            enabled=cfg.preemption.enabled,
            min_runtime_seconds=cfg.preemption.min_runtime_seconds,
            grace_seconds=cfg.preemption.grace_seconds,
        ),
        aging_seconds_per_rank=cfg.aging_seconds_per_rank,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_seconds,
        default_lease_seconds=cfg.default_lease_seconds,
        node_timeout_seconds=cfg.node_timeout_seconds,
        lost_node_release_seconds=cfg.lost_node_release_seconds,
        maximum_runtime_seconds=cfg.maximum_runtime_seconds,
        non_preemptible_classes=tuple(cfg.non_preemptible_classes),
        fair_share_half_life_seconds=cfg.fair_share_half_life_seconds,
        max_workdir_bytes=cfg.max_workdir_bytes,
        artifact_ttl_seconds=cfg.artifact_ttl_seconds,
        max_artifact_bytes=cfg.max_artifact_bytes,
        renew_step_seconds=cfg.renew_step_seconds,
        max_queued_leases=cfg.max_queued_leases,
        queue_timeout_seconds=cfg.queue_timeout_seconds,
        requests_per_second=cfg.requests_per_second,
        request_burst=cfg.request_burst,
        max_voided_reservations=cfg.max_voided_reservations,
        voided_reservation_window_seconds=cfg.voided_reservation_window_seconds,
        max_output_bytes=cfg.max_output_bytes,
        max_attempts=cfg.max_attempts,
        volumes=volumes_from_wire(cfg.volumes),
        egress_allow=normal_egress_allow(cfg.egress_allow),
    )


def volumes_from_wire(volumes: dict[str, VolumeConfig]) -> tuple[Volume, ...]:
    return tuple(Volume(name=name, host_path=v.host_path, read_only=v.read_only,
                        trust_levels=tuple(v.trust_levels))
                 for name, v in sorted(volumes.items()))


_PATCHED_AS_IS = ("packing", "commit_timeout_seconds", "aging_seconds_per_rank",
                  "heartbeat_timeout_seconds", "default_lease_seconds", "node_timeout_seconds",
                  "lost_node_release_seconds", "maximum_runtime_seconds",
                  "fair_share_half_life_seconds", "renew_step_seconds",
                  "max_queued_leases", "queue_timeout_seconds", "requests_per_second",
                  "request_burst", "max_voided_reservations",
                  "voided_reservation_window_seconds", "max_attempts")


# the user's files' limits, patched as they are too
_FILES_PATCHED = ("max_workdir_bytes", "artifact_ttl_seconds", "max_artifact_bytes",
                  "max_output_bytes")


def pool_config_patched(base: PoolConfig, patch: v1.PoolPatch) -> PoolConfig:
    """`base` with the settings `patch` names; every other setting as it was."""
    changes: dict[str, Any] = {name: value for name in (*_PATCHED_AS_IS, *_FILES_PATCHED)
                               if (value := getattr(patch, name)) is not None}
    if patch.priority_classes is not None:
        classes = dict(patch.priority_classes)
        changes["priority_classes"] = tuple(classes.items())
        changes["default_priority_class"] = _default_class(classes)
    if patch.volumes is not None:
        changes["volumes"] = volumes_from_wire(patch.volumes)
    if patch.egress_allow is not None:
        changes["egress_allow"] = normal_egress_allow(patch.egress_allow)
    if patch.non_preemptible_classes is not None:
        changes["non_preemptible_classes"] = tuple(patch.non_preemptible_classes)
    if patch.preemption is not None:
        pp = patch.preemption
        changes["preemption"] = dataclasses.replace(base.preemption, **{
            name: value for name in ("enabled", "min_runtime_seconds", "grace_seconds")
            if (value := getattr(pp, name)) is not None})
    return dataclasses.replace(base, **changes)


def image_policy_from_wire(cfg: v1.ImagePolicyConfig) -> ImagePolicy:
    by_trust = dict(DEFAULT_ISOLATION_BY_TRUST)
    by_trust.update(cfg.isolation_by_trust.items())
    return ImagePolicy(
        approved_registries=tuple(cfg.approved_registries),
        tenant_registries=tuple((t, tuple(rs)) for t, rs in cfg.tenant_registries.items()),
        trusted_keys=tuple((k.key_id, k.public_key_pem) for k in cfg.trusted_keys),
        require_signature=cfg.require_signature,
        max_image_size_bytes=cfg.max_image_size_bytes,
        isolation_by_trust=tuple(by_trust.items()),
        untrusted_tenants=tuple(cfg.untrusted_tenants),
        untrusted_tenant_isolation=cfg.untrusted_tenant_isolation,
    )
