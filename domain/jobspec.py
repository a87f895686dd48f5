"""What a lease's job runs: its image, command, environment, files, secrets' names and
volumes, as recorded in the log (to_dict / from_dict are the event's shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobSpec:
    """What to run inside a lease: an image, its command and environment, how to checkpoint."""

    image: str
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # sorted (name, value)
    checkpoint_interval_seconds: int = 0  # 0: the job does not checkpoint
    checkpoint_path: str | None = None
    image_signature: str | None = None  # base64, over the image's simple-signing payload
    image_size_bytes: int | None = None  # as declared by the job; the agent re-checks it
    # the packed work directory in the tenant's bucket, named by its digest (`sha256:<hex>`)
    workdir_digest: str | None = None
    workdir_size_bytes: int | None = None
    workdir_files: int = 0
    artifacts: tuple[str, ...] = ()  # globs under /work stored at the job's end
    # the tenant's secrets the job gets, by name only (their values are never in the log):
    # sorted (variable, name), (name, path under /run/secrets) and (name, version)
    secret_env: tuple[tuple[str, str], ...] = ()
    secret_files: tuple[tuple[str, str], ...] = ()
    secret_versions: tuple[tuple[str, int], ...] = ()
    registry_secret: str | None = None  # the docker runtime's pulls of `image` use it
    # the pool's volumes it mounts: sorted (name, target in the sandbox)
    volumes: tuple[tuple[str, str], ...] = ()
    stdin: bool = False  # a pipe `pool lease attach -i` writes to, else /dev/null

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(str(c) for c in self.command))
        object.__setattr__(self, "env", tuple(sorted((str(k), str(v)) for k, v in self.env)))
        object.__setattr__(self, "artifacts", tuple(str(a) for a in self.artifacts))
        for name in ("secret_env", "secret_files", "volumes"):
            pairs = getattr(self, name)
            object.__setattr__(self, name, tuple(sorted((str(k), str(v)) for k, v in pairs)))
        object.__setattr__(self, "secret_versions",
                           tuple(sorted((str(k), int(v)) for k, v in self.secret_versions)))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "image": self.image,
            "command": list(self.command),
            "env": {k: v for k, v in self.env},
            "checkpoint_interval_seconds": self.checkpoint_interval_seconds,
            "checkpoint_path": self.checkpoint_path,
            "image_signature": self.image_signature,
            "image_size_bytes": self.image_size_bytes,
        }
        # only when used, so a job without files records the same event as before
        if self.workdir_digest is not None:
            d["workdir"] = {"digest": self.workdir_digest, "size_bytes": self.workdir_size_bytes,
                            "files": self.workdir_files}
        if self.artifacts:
            d["artifacts"] = list(self.artifacts)
        if self.secret_versions:
            d["secrets"] = {"env": dict(self.secret_env), "files": dict(self.secret_files),
                            "versions": dict(self.secret_versions)}
            d["secrets"] |= {"registry": self.registry_secret} if self.registry_secret else {}
        if self.volumes:
            d["volumes"] = dict(self.volumes)
        if self.stdin:
            d["stdin"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        return cls(
            image=str(d["image"]),
            command=tuple(d.get("command", ())),
            env=tuple(dict(d.get("env", {})).items()),
            checkpoint_interval_seconds=int(d.get("checkpoint_interval_seconds", 0)),
            checkpoint_path=d.get("checkpoint_path"),
            image_signature=d.get("image_signature"),
            image_size_bytes=None if d.get("image_size_bytes") is None
            else int(d["image_size_bytes"]),
            workdir_digest=None if not d.get("workdir") else str(d["workdir"]["digest"]),
            workdir_size_bytes=None if not d.get("workdir")
            else int(d["workdir"]["size_bytes"]),
            workdir_files=0 if not d.get("workdir") else int(d["workdir"].get("files", 0)),
            artifacts=tuple(d.get("artifacts", ())),
            secret_env=tuple(dict((d.get("secrets") or {}).get("env", {})).items()),
            secret_files=tuple(dict((d.get("secrets") or {}).get("files", {})).items()),
            secret_versions=tuple(dict((d.get("secrets") or {}).get("versions", {})).items()),
            registry_secret=(d.get("secrets") or {}).get("registry"),
            volumes=tuple(dict(d.get("volumes") or {}).items()),
            stdin=bool(d.get("stdin", False)),
        )
