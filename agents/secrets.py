"""A lease's secrets on the node: fetched from the plane for the placement the agent holds,
checked against what the job names, and handed to the runtime in memory; never written down."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from agents.runtimes.contract import WorkloadError
from schemas import v1
from schemas.codec import encode
from schemas.secret import SecretFetch

Call = Callable[[str, bytes], dict[str, Any]]
SecretEnv = tuple[tuple[str, str], ...]
SecretFiles = tuple[tuple[str, bytes], ...]


def fetch(call: Call, a: v1.LeaseAssignment) -> dict[str, Any]:
    """The job's secrets as WorkloadSpec fields (`secret_env`, `secret_files`,
    `registry_auth`; none when it names none), asked of the plane on the node's own subject
    (the answer comes into the node's own inbox). A refusal is a WorkloadError with the
    plane's code (`secret_unknown`, `stale_epoch`, ...); its message names secrets, never
    values. BusError passes through: the start is tried again."""
    job = a.job
    if not job.secret_env and not job.secret_files and not job.registry_secret:
        return {}
    reply = call(f"lease.{a.lease_id}.secrets", encode(SecretFetch(epoch=a.epoch)))
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise WorkloadError(str(err.get("message") or "the plane refused the job's secrets"),
                            code=str(err.get("code") or "secrets_refused"))
    values: dict[str, bytes] = {}
    try:
        for s in (reply.get("result") or {}).get("secrets", []):
            values[str(s["name"])] = base64.b64decode(s["value"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise WorkloadError("the plane's answer with the job's secrets is malformed",
                            code="secrets_refused") from e
    registry = {job.registry_secret} if job.registry_secret else set()
    missing = sorted({*job.secret_env.values(), *job.secret_files, *registry} - set(values))
    if missing:
        raise WorkloadError(f"the plane did not hand over secret {', '.join(missing)}",
                            code="secret_unknown")
    env: list[tuple[str, str]] = []
    for var, name in sorted(job.secret_env.items()):
        try:
            text = values[name].decode()
        except UnicodeDecodeError:
            text = "\0"
        if "\0" in text:
            raise WorkloadError(f"secret {name!r} is not text without NUL bytes, so it cannot "
                                f"be the variable {var}; hand it over as a file",
                                code="secret_not_text")
        env.append((var, text))
    files = tuple((path, values[name]) for name, path in sorted(job.secret_files.items()))
    out: dict[str, Any] = {"secret_env": tuple(env), "secret_files": files}
    if job.registry_secret:
        out["registry_auth"] = registry_auth(job.registry_secret, values[job.registry_secret])
    return out


def registry_auth(name: str, value: bytes) -> tuple[str, str]:
    """A registry secret's `user:password` (as `docker login` takes them; the first `:`
    splits them, so a password may hold more); refused with `registry_secret_malformed`,
    naming the secret and never its value."""
    try:
        text = value.decode().strip("\r\n")
    except UnicodeDecodeError:
        text = ""
    user, sep, password = text.partition(":")
    if not sep or not user or not password or any(c in text for c in "\0\r\n"):
        raise WorkloadError(f"registry secret {name!r} is not `user:password` on one line",
                            code="registry_secret_malformed")
    return user, password
