"""`-f job.yaml` for `pool lease run|request`: a lease request and its job, checked against the
published wire schema with errors that name the place in the file."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

from cli.output import UsageError

# the job's own keys; every other key is the lease request's (schemas/json/LeaseRequest.json)
JOB_KEYS = ("image", "image_signature", "image_size_bytes", "command", "env",
            "checkpoint_policy", "workdir", "artifacts", "secret_env", "secret_files", "volumes",
            "stdin", "registry_secret")
# the job's keys the request does not take; `workdir` is a local folder, packed at run time
_JOB_ONLY = ("checkpoint_policy", "image_size_bytes", "workdir", "artifacts", "secret_env",
             "secret_files", "volumes", "stdin", "registry_secret")
_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]*)`(?: - at `\$(?P<at>.*)`)?$")


def _place(message: str) -> tuple[str, str]:
    """msgspec's `Expected … - at `$.shape.cpu_millis`` as (`shape.cpu_millis`, `Expected …`)."""
    unknown = _UNKNOWN.match(message)
    if unknown:
        where = (unknown.group("at") or "").lstrip(".")
        return (f"{where}.{unknown.group('name')}" if where else unknown.group("name"),
                "unknown key (see schemas/json/LeaseRequest.json and JobSpec.json)")
    at = _AT.search(message)
    if at is None:
        return "(top level)", message
    path = at.group("path").lstrip(".") or "(top level)"
    return path, message[:at.start()]


def _check(doc: dict[str, Any], struct: type[Any], file: str, prefix: str = "") -> None:
    import msgspec

    try:
        msgspec.convert(doc, struct)
    except msgspec.ValidationError as e:
        path, what = _place(str(e))
        raise UsageError(f"{file}: {prefix}{path}: {what}") from None


def load(path: str, *, key: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request body and the job of a job file (YAML or JSON), both checked."""
    import yaml

    from schemas import v1

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"-f {path}: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{path}:{where}: not YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: a job file is a mapping of keys (pool_id, shape, "
                         "maximum_runtime_seconds, command, …)")
    job = {k: doc[k] for k in JOB_KEYS if k in doc}
    body = {k: v for k, v in doc.items() if k not in _JOB_ONLY}
    body["idempotency_key"] = key or str(doc.get("idempotency_key") or uuid.uuid4().hex)
    _check(body, v1.LeaseRequest, path)
    workdir = job.pop("workdir", None)
    _check(job, v1.JobSpec, path)
    if workdir is not None:
        if not isinstance(workdir, str) or not workdir:
            raise UsageError(f"{path}: workdir: a folder's path (relative to the job file)")
        job["workdir"] = str(Path(path).parent / workdir)
    return body, job
