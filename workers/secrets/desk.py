"""The command side of secrets: a tenant sets (sealed, a new version), lists and deletes its
own; a commit's job gets the versions of the secrets it names; a node opens a lease's for the
placement it holds. No value is ever recorded in the log or logged."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import msgspec

from bus.secrets import SecretRecord, SecretWriteConflict
from domain.errors import IllegalTransition, StaleEpoch
from domain.lease import LeaseState
from schemas import v1
from schemas.secret import SecretFetch, SecretSet
from workers.errors import SecretLimit, SecretsUnavailable, SecretUnknown, WriteConflict
from workers.sealing import KeyRing, Unreadable
from workers.secrets.settings import SecretSettings

if TYPE_CHECKING:
    from bus.secrets import SecretStore
    from workers.application import PoolApp

_TRIES = 5


def sealed_context(tenant: str, name: str, version: int) -> str:
    """What a sealed value is bound to: this tenant's secret of this name at this version."""
    return f"{tenant}/{name}/{version}"


def public(record: SecretRecord) -> dict[str, Any]:
    """What anyone but the job may see of a secret: never its value or ciphertext."""
    return {"name": record.name, "version": record.version, "size_bytes": record.size_bytes,
            "updated_at": record.updated_at, "key_id": record.key_id}


def names_of(job: v1.JobSpec) -> list[str]:
    """The secrets a job names, each once, sorted (its registry's among them)."""
    registry = {job.registry_secret} if job.registry_secret else set()
    return sorted(set(job.secret_env.values()) | set(job.secret_files) | registry)


class SecretDesk:
    """What the command responders answer secret commands (and a node's fetch) with."""

    def __init__(self, app: PoolApp, settings: SecretSettings, *, store: SecretStore) -> None:
        self.app = app
        self.settings = settings
        self.store = store

    def _ring(self) -> KeyRing:
        if self.settings.ring is None:
            raise SecretsUnavailable("this plane has no key to seal secrets: its operator sets "
                                     "POOL_SECRET_KEYS")
        return self.settings.ring

    def set(self, tenant: str, cmd: SecretSet) -> dict[str, Any]:
        ring = self._ring()
        for _ in range(_TRIES):
            found = self.store.latest(tenant, cmd.name)
            if found is None and len(self.store.listing(tenant)) >= self.settings.max_per_tenant:
                raise SecretLimit(f"tenant {tenant!r} keeps {self.settings.max_per_tenant} "
                                  "secrets, the most this plane allows "
                                  "(POOL_SECRET_MAX_PER_TENANT); delete one first",
                                  {"max_per_tenant": self.settings.max_per_tenant})
            version = 1 if found is None else found[0].version + 1
            key_id, sealed = ring.seal(cmd.value,
                                       context=sealed_context(tenant, cmd.name, version))
            record = SecretRecord(name=cmd.name, version=version, key_id=key_id, sealed=sealed,
                                  size_bytes=len(cmd.value), updated_at=self.app.clock())
            try:
                self.store.put(tenant, record, last_revision=None if found is None else found[1])
            except SecretWriteConflict:
                continue
            return {"secret": public(record)}
        raise WriteConflict(f"secret {cmd.name!r} kept changing; try again")

    def listing(self, tenant: str) -> dict[str, Any]:
        return {"secrets": [public(r) for r in self.store.listing(tenant)]}

    def delete(self, tenant: str, name: str) -> dict[str, Any]:
        if not self.store.purge(tenant, name):
            raise SecretUnknown(f"tenant {tenant!r} has no secret named {name!r}",
                                {"secret": name})
        return {"name": name, "deleted": True}

    def reseal(self) -> dict[str, Any]:
        """Every tenant's newest version of each secret sealed again under the ring's active
        key (the same version, a new KV revision), so an older key can leave the ring. Older
        kept versions stay as they were sealed."""
        ring = self._ring()
        counts = {"resealed": 0, "current": 0, "unreadable": 0, "changed_meanwhile": 0}
        for tenant, record, revision in self.store.every():
            if record.key_id == ring.active:
                counts["current"] += 1
                continue
            context = sealed_context(tenant, record.name, record.version)
            try:
                value = ring.open(record.key_id, record.sealed, context=context)
            except Unreadable:
                counts["unreadable"] += 1  # its key already left the ring
                continue
            key_id, sealed = ring.seal(value, context=context)
            try:
                self.store.put(tenant, msgspec.structs.replace(record, key_id=key_id,
                                                               sealed=sealed),
                               last_revision=revision)
            except SecretWriteConflict:
                counts["changed_meanwhile"] += 1  # set again meanwhile: under the active key
                continue
            counts["resealed"] += 1
        return {"active_key": ring.active, **counts}

    def resolve(self, tenant: str, job: v1.JobSpec) -> v1.JobSpec:
        """The job with the current version of each secret it names (a client's versions
        replaced); SecretUnknown naming every secret the tenant does not have."""
        names = names_of(job)
        if not names:
            return msgspec.structs.replace(job, secret_versions={}) if job.secret_versions \
                else job
        self._ring()
        versions: dict[str, int] = {}
        for name in names:
            found = self.store.latest(tenant, name)
            if found is not None:
                versions[name] = found[0].version
        unknown = [n for n in names if n not in versions]
        if unknown:
            raise SecretUnknown(f"tenant {tenant!r} has no secret named "
                                f"{', '.join(repr(n) for n in unknown)} (pool secret set NAME)",
                                {"secret": unknown[0], "unknown": len(unknown)})
        return msgspec.structs.replace(job, secret_versions=versions)

    def fetch(self, node: str, lease_id: str, cmd: SecretFetch) -> dict[str, Any]:
        """The values of the secrets a running job on `node` names, for the placement it
        holds: another node's lease is not found, an older placement is stale."""
        ring = self._ring()
        lease = self.app.lease_on_node(node, lease_id)
        if lease.epoch != cmd.epoch:
            raise StaleEpoch(lease.epoch, cmd.epoch)
        job = lease.job
        if lease.state is not LeaseState.RUNNING or job is None or not job.is_active:
            raise IllegalTransition(lease.state, "fetch_secrets", reasons=("job_not_running",),
                                    detail="secrets are handed out only to a starting or "
                                    "running job")
        tenant = lease.tenant_id
        out: list[dict[str, Any]] = []
        for name, version in job.spec.secret_versions:
            record = self.store.version(tenant, name, version)
            if record is None:
                raise SecretUnknown(f"secret {name!r} version {version} of tenant {tenant!r} "
                                    "is no longer kept (deleted, or replaced too often)",
                                    {"secret": name, "version": version})
            try:
                value = ring.open(record.key_id, record.sealed,
                                  context=sealed_context(tenant, name, version))
            except Unreadable as e:
                raise SecretsUnavailable(f"secret {name!r} does not open under this plane's "
                                         f"keys ({e})", {"secret": name}) from e
            out.append({"name": name, "version": version,
                        "value": base64.b64encode(value).decode()})
        return {"lease_id": lease_id, "epoch": lease.epoch, "secrets": out,
                "env": dict(job.spec.secret_env), "files": dict(job.spec.secret_files)}
