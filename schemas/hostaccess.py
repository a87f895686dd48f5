"""What a pool lets a job reach outside its sandbox: host paths offered as named volumes, and
the networks a job with egress may reach past the denied ranges (its pool's allow-list)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

TrustLevel = Literal["trusted", "marketplace"]
# a host path a pool offers as a volume (domain.volumes): named by the operator only
VolumeName = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}(?!\n)$", max_length=63)]
HostPath = Annotated[str, Meta(pattern=r"^/[^\x00-\x1f\x7f]{0,4095}(?!\n)$", max_length=4096)]
VolumeTarget = Annotated[
    str,
    Meta(pattern=r"^/[A-Za-z0-9._/-]{1,255}(?!\n)$", max_length=256,
         description="Where the volume appears in the sandbox: an absolute path outside what "
         "the sandbox provides (/usr, /tmp, /work, /run/secrets, …)."),
]
MAX_POOL_VOLUMES = 32
MAX_JOB_VOLUMES = 16
# an IPv4 network a pool lets its jobs with egress reach (the sandboxes' filters are IPv4's)
EgressCidr = Annotated[
    str,
    Meta(pattern=r"^[0-9]{1,3}(\.[0-9]{1,3}){3}(/[0-9]{1,2})?(?!\n)$", max_length=18,
         description="An IPv4 address or network (CIDR) a job with egress may reach."),
]
MAX_EGRESS_ALLOW = 64


class VolumeConfig(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A host path a pool offers jobs as a named volume: read-only unless told otherwise, on
    nodes of the trust levels listed (none listed: every level)."""

    host_path: HostPath
    read_only: bool = True
    trust_levels: Annotated[list[TrustLevel], Meta(max_length=8)] = []


class VolumeMount(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A volume as the agent mounts it: the pool's host path at the job's target."""

    name: VolumeName
    host_path: HostPath
    target: VolumeTarget
    read_only: bool = True
