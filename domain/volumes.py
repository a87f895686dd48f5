"""Volumes: host paths a pool's operator offers jobs by name, each for nodes of some trust
levels; a job asks for a name and where to mount it, never for a host path."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from domain.errors import VolumeNotAllowed, VolumeUnknown

# where a volume may not go in a sandbox: what the runtime itself provides there
RESERVED_TARGETS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/proc", "/dev", "/tmp", "/work",
                    "/run/secrets", "/checkpoint", "/etc")


def target_problem(target: str) -> str | None:
    """Why `target` cannot be a volume's mount point in a sandbox, or None."""
    parts = target.split("/")
    if not target.startswith("/") or target == "/" or any(p in ("", ".", "..")
                                                          for p in parts[1:]):
        return f"{target!r} is not an absolute, normalised path"
    for reserved in RESERVED_TARGETS:
        if target == reserved or target.startswith(reserved + "/") or \
                reserved.startswith(target + "/"):
            return f"{target!r} would cover or sit in {reserved}, which the sandbox provides"
    return None


@dataclass(frozen=True)
class Volume:
    """A host path offered as `name`; read-only unless the operator says so; `trust_levels`
    empty: on nodes of every trust level."""

    name: str
    host_path: str
    read_only: bool = True
    trust_levels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "trust_levels", tuple(sorted(set(self.trust_levels))))

    def problems(self) -> list[str]:
        host = self.host_path
        if not host.startswith("/") or any(p in (".", "..") for p in host.split("/")):
            return [f"volume {self.name!r}: host path {host!r} is not absolute and normalised"]
        return []

    def allows(self, trust_level: str | None) -> bool:
        return not self.trust_levels or trust_level in self.trust_levels

    def to_dict(self) -> dict[str, Any]:
        return {"host_path": self.host_path, "read_only": self.read_only,
                "trust_levels": list(self.trust_levels)}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> Volume:
        return cls(name=str(name), host_path=str(d["host_path"]),
                   read_only=bool(d.get("read_only", True)),
                   trust_levels=tuple(d.get("trust_levels", ())))


def volumes_from_dict(d: Mapping[str, Any] | None) -> tuple[Volume, ...]:
    return tuple(sorted((Volume.from_dict(k, v) for k, v in (d or {}).items()),
                        key=lambda v: v.name))


def admit_volumes(offered: Iterable[Volume], wanted: Iterable[tuple[str, str]],
                  node_trust: str | None, *, pool_id: str) -> None:
    """Raise VolumeUnknown for a name the pool does not offer, VolumeNotAllowed for one it
    offers only to nodes of other trust levels than the lease's node's."""
    by_name = {v.name: v for v in offered}
    wanted = list(wanted)
    unknown = sorted(name for name, _ in wanted if name not in by_name)
    if unknown:
        raise VolumeUnknown(f"pool {pool_id} offers no volume named "
                            f"{', '.join(repr(n) for n in unknown)} (it offers "
                            f"{', '.join(sorted(by_name)) or 'none'})", reasons=tuple(unknown))
    barred = sorted(name for name, _ in wanted if not by_name[name].allows(node_trust))
    if barred:
        raise VolumeNotAllowed(
            f"volume {', '.join(repr(n) for n in barred)} of pool {pool_id} is offered to "
            f"nodes of trust level {', '.join(by_name[barred[0]].trust_levels)}, and this "
            f"lease's node is {node_trust or 'unknown'}", reasons=tuple(barred))
