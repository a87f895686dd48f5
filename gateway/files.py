"""A tenant's files over HTTP: work directories in by digest (`/v1/workdirs/{digest}`) and a
lease's artifacts out (`/v1/compute-leases/{id}/artifacts[/{name}]`), through its own NATS user.
"""

from __future__ import annotations

import asyncio
import hashlib
import posixpath
import re
import secrets
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.handlers import HTTPRouteHandler
from litestar.response import Stream

from bus.errors import BusError
from bus.objects import FileStore, StoredObject, artifacts_bucket, work_bucket
from bus.subjects import is_token
from gateway.problems import problem
from gateway.shared import Gateway, Refused, principal_of, refusal_headers
from gateway.tokens import Principal
from gateway.upstream import NotEnrolled

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
WORKDIRS = "/v1/workdirs"
READ_BYTES = 1 << 20
_DIGEST_PARAM = {"name": "digest", "in": "path", "required": True,
                 "schema": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}}
_LEASE_PARAM = {"name": "lease_id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": "^[a-z0-9_-]{1,128}$"}}
_NAME_PARAM = {"name": "name", "in": "path", "required": True,
               "description": "the artifact's path under /work (may hold `/`)",
               "schema": {"type": "string", "maxLength": 1024}}


def _op(operation_id: str, summary: str, params: list[dict[str, Any]], ok: str,
        media: str = "application/json") -> dict[str, Any]:
    problem_ref = {"application/problem+json": {"schema": {
        "$ref": "#/components/schemas/Problem"}}}
    return {"operationId": operation_id, "tags": ["files"], "summary": summary,
            "parameters": params,
            "responses": {ok: {"description": "OK", "content": {media: {"schema": {
                "type": "string", "format": "binary"} if media != "application/json" else {
                "type": "object", "additionalProperties": True}}}},
                **{str(s): {"description": "a problem", "content": problem_ref}
                   for s in (400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503)}}}


# the OpenAPI document's entries for these paths (gateway.openapi adds them)
PATHS: dict[str, dict[str, Any]] = {
    WORKDIRS + "/{digest}": {
        "get": _op("getWorkdir", "Whether the tenant's work bucket holds a packed work "
                   "directory (its size and SHA-256), so an unchanged one is not sent again",
                   [_DIGEST_PARAM], "200"),
        "put": {**_op("putWorkdir", "Store a packed work directory (a tar, `pool lease run "
                      "--workdir`) under the SHA-256 of its bytes; the body must hash to the "
                      "path's digest", [_DIGEST_PARAM], "201"),
                "requestBody": {"required": True, "content": {"application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"}}}}},
    },
    WORKDIRS + "/{digest}/delete": {
        "post": _op("deleteWorkdir", "Remove a stored work directory from the tenant's work "
                    "bucket", [_DIGEST_PARAM], "200")},
    "/v1/compute-leases/{lease_id}/artifacts": {
        "get": _op("listArtifacts", "The files a lease's job kept (--artifacts): name, size, "
                   "SHA-256", [_LEASE_PARAM], "200")},
    "/v1/compute-leases/{lease_id}/artifacts/{name}": {
        "get": _op("getArtifact", "One artifact's bytes, verified against its SHA-256 before "
                   "they are sent (the `X-Content-SHA256` header names it)",
                   [_LEASE_PARAM, _NAME_PARAM], "200", "application/octet-stream")},
}


def _digest(raw: str) -> str:
    if not DIGEST.fullmatch(raw):
        raise Refused("invalid_field", "a work directory is named sha256:<64 hex digits>",
                      {"path": "digest"})
    return raw


def _lease(raw: str) -> str:
    if not is_token(raw):
        raise Refused("lease_not_found", f"no lease {raw[:64]!r}")
    return raw


def _artifact_name(raw: str) -> str:
    norm = posixpath.normpath(raw)
    if not raw or len(raw) > 1024 or posixpath.isabs(raw) or norm in (".", "..") \
            or norm.startswith("../") or not raw.isprintable():
        raise Refused("invalid_field", "an artifact is named by its path under /work",
                      {"path": "name"})
    return norm


def _row(o: StoredObject, prefix: str = "") -> dict[str, Any]:
    return {"name": o.name.removeprefix(prefix), "size_bytes": o.size_bytes,
            "sha256": o.sha256, "stored_at": o.mtime[:19]}


def _json(data: Any, status: int = 200) -> Response[bytes]:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


async def _store(gw: Gateway, who: Principal) -> FileStore:
    client = await gw.upstream.client(who)
    return client.files()


async def _in_thread(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except BusError as e:
        raise Refused(e.code, str(e)) from None


async def _receive(request: Request[Any, Any, Any], dest: Path, digest: str,
                   limit: int) -> int:
    """The body into `dest`, refused past `limit` bytes or unless it hashes to `digest`."""
    announced = request.headers.get("content-length")
    if announced and announced.isdigit() and int(announced) > limit:
        raise Refused("workdir_too_large", f"the work directory is {announced} bytes; this "
                      f"gateway takes at most {limit} (max_upload_bytes)",
                      {"limit": "max_upload_bytes", "max_bytes": limit})
    h = hashlib.sha256()
    size = 0
    out = await asyncio.to_thread(open, dest, "wb")
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused("workdir_too_large", f"the work directory is over {limit} bytes, "
                              "this gateway's max_upload_bytes",
                              {"limit": "max_upload_bytes", "max_bytes": limit})
            h.update(chunk)
            await asyncio.to_thread(out.write, chunk)
    finally:
        await asyncio.to_thread(out.close)
    if "sha256:" + h.hexdigest() != digest:
        raise Refused("digest_mismatch", f"the body's {size} bytes hash to sha256:"
                      f"{h.hexdigest()}, not to {digest}")
    return size


async def _workdir(gw: Gateway, who: Principal, request: Request[Any, Any, Any]) -> Response[Any]:
    digest = _digest(str(request.path_params.get("digest", "")))
    bucket = work_bucket(who.tenant)
    store = await _store(gw, who)
    have = await _in_thread(store.info, bucket, digest)
    if request.method == "GET":
        if have is None:
            raise Refused("object_missing", f"no work directory {digest} stored")
        return _json({"digest": digest, "size_bytes": have.size_bytes, "sha256": have.sha256})
    if have is not None and "sha256:" + have.sha256 == digest:
        async for _ in request.stream():  # sent anyway: drained, not stored twice
            pass
        return _json({"digest": digest, "size_bytes": have.size_bytes, "uploaded": False})
    limit = gw.upstream.settings.max_upload_bytes
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) <= limit:  # refused before the body is read
        await _in_thread(store.check_room, bucket, int(announced))
    with tempfile.TemporaryDirectory(prefix="pool-gw-workdir-") as tmp:
        path = Path(tmp) / "workdir.tar"
        size = await _receive(request, path, digest, limit)
        # a put that fails part-way leaves no object (bus.objects.FileStore.put)
        await _in_thread(store.put, bucket, digest, path, timeout=60.0)
    return _json({"digest": digest, "size_bytes": size, "uploaded": True}, 201)


async def _delete_workdir(gw: Gateway, who: Principal,
                          request: Request[Any, Any, Any]) -> Response[Any]:
    digest = _digest(str(request.path_params.get("digest", "")))
    store = await _store(gw, who)
    if not await _in_thread(store.delete, work_bucket(who.tenant), digest):
        raise Refused("object_missing", f"no work directory {digest} stored")
    return _json({"digest": digest, "deleted": True})


async def _artifacts(gw: Gateway, who: Principal,
                     request: Request[Any, Any, Any]) -> Response[Any]:
    lease_id = _lease(str(request.path_params.get("lease_id", "")))
    store = await _store(gw, who)
    prefix = f"{lease_id}/"
    found = await _in_thread(store.list, artifacts_bucket(who.tenant), prefix)
    return _json({"lease_id": lease_id, "items": [_row(o, prefix) for o in found]})


async def _artifact(gw: Gateway, who: Principal,
                    request: Request[Any, Any, Any]) -> Response[Any]:
    lease_id = _lease(str(request.path_params.get("lease_id", "")))
    name = _artifact_name(str(request.path_params.get("name", "")).lstrip("/"))
    store = await _store(gw, who)
    tmp = Path(tempfile.mkdtemp(prefix="pool-gw-artifact-"))
    path = tmp / secrets.token_hex(8)
    try:
        # fetched whole and checked against its SHA-256 first: a client never gets bytes
        # the store cannot vouch for, and a failure is a problem, not a cut-off body
        got = await _in_thread(store.get, artifacts_bucket(who.tenant), f"{lease_id}/{name}",
                               path)
    except BaseException:
        _remove(tmp)
        raise

    async def body() -> AsyncIterator[bytes]:
        f = await asyncio.to_thread(open, path, "rb")
        try:
            while chunk := await asyncio.to_thread(f.read, READ_BYTES):
                yield chunk
        finally:
            f.close()
            _remove(tmp)

    return Stream(body(), media_type="application/octet-stream", headers={
        "Content-Length": str(got.size_bytes), "X-Content-SHA256": got.sha256,
        "Content-Disposition": f'attachment; filename="{posixpath.basename(name)}"'})


def _remove(tmp: Path) -> None:
    for p in tmp.iterdir():
        p.unlink(missing_ok=True)
    tmp.rmdir()


def _wrap(gw: Gateway, answer: Any, name: str) -> Any:
    async def handle(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            who = principal_of(gw, request)
            if who.is_admin:
                raise Refused("forbidden", "the admin token acts for no tenant; use a "
                              "tenant's token for its files")
            return await answer(gw, who, request)  # type: ignore[no-any-return]
        except Refused as e:
            return problem(e.code, e.detail, e.reasons, instance=request.url.path,
                           headers=refusal_headers(e))
        except NotEnrolled as e:
            return problem(e.code, str(e), instance=request.url.path)

    handle.__name__ = name
    return handle


def handlers(gw: Gateway) -> list[Any]:
    """The files' route handlers; a work directory's upload has no body limit but the
    gateway's max_upload_bytes, checked as it streams in."""
    return [
        HTTPRouteHandler(path=WORKDIRS + "/{digest:str}", http_method=["GET"])(
            _wrap(gw, _workdir, "getWorkdir")),
        HTTPRouteHandler(path=WORKDIRS + "/{digest:str}", http_method=["PUT"],
                         request_max_body_size=None)(_wrap(gw, _workdir, "putWorkdir")),
        HTTPRouteHandler(path=WORKDIRS + "/{digest:str}/delete", http_method=["POST"])(
            _wrap(gw, _delete_workdir, "deleteWorkdir")),
        HTTPRouteHandler(path="/v1/compute-leases/{lease_id:str}/artifacts",
                         http_method=["GET"])(_wrap(gw, _artifacts, "listArtifacts")),
        HTTPRouteHandler(path="/v1/compute-leases/{lease_id:str}/artifacts/{name:path}",
                         http_method=["GET"])(_wrap(gw, _artifact, "getArtifact")),
    ]
