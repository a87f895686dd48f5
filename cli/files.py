"""The user's files: `pool lease run --workdir DIR --artifacts GLOB` (pack, store by digest,
name it in the job) and `pool lease artifacts ID [--get DEST]` (list, fetch and verify)."""

from __future__ import annotations

import argparse
import contextlib
import json
import posixpath
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.connect import client_opts, pool_client, tenant_of
from cli.output import EXIT_OK, Subparsers, UsageError, fail, table

ARTIFACT_COLUMNS = ("name", "size_bytes", "sha256", "stored_at")


class _Progress:
    """Upload progress on a terminal's stderr, at most ten times a second."""

    def __init__(self, total: int, what: str) -> None:
        self.total = max(1, total)
        self.what = what
        self.shown = 0.0
        self.on = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if not self.on or (now - self.shown < 0.1 and done < self.total):
            return
        self.shown = now
        print(f"\rpool: {self.what} {done * 100 // self.total:3d}% ({done} bytes)", end="",
              file=sys.stderr, flush=True)
        if done >= self.total:
            print(file=sys.stderr)


class JobFiles:
    """A job with its files: its work directory stored and named, and what to do when the
    commit is refused (remove what this run stored: nothing is left half-kept)."""

    def __init__(self, job: dict[str, Any], stored: Callable[[], None] | None = None) -> None:
        self.job = job
        self._forget = stored

    def commit_refused(self) -> None:
        if self._forget is not None:
            self._forget()


def with_files(c: Any, tenant: str, job: dict[str, Any], workdir: str | None,
               artifacts: list[str] | None, *, quiet: bool) -> JobFiles:
    """`job` with its work directory packed and stored (by digest) and its artifact globs;
    says what was uploaded, or that nothing was."""
    job = dict(job)
    if artifacts:
        job["artifacts"] = list(artifacts)
    if not workdir:
        return JobFiles(job)  # nothing to pack: the packer (pathspec) is not even imported
    from bus.errors import BucketMissing, BusError
    from bus.objects import work_bucket
    from client.workdir import upload

    root = Path(workdir)
    if not root.is_dir():
        raise UsageError(f"--workdir {workdir}: not a directory")
    try:
        done = upload(c.files(), tenant, root,
                      progress_for=None if quiet else lambda n: _Progress(n, "workdir"))
    except BucketMissing as e:
        raise UsageError(f"{e}: the operator makes a tenant's buckets with its user "
                         f"(`pool admin tenant set {tenant} …` on `pool up`)") from None
    if not quiet:
        print(f"pool: {done.line()}", file=sys.stderr, flush=True)
    job["workdir"] = done.job_ref()
    if not done.uploaded:
        return JobFiles(job)  # another run's: not this one's to remove

    def forget() -> None:
        with contextlib.suppress(BusError):
            c.files().delete(work_bucket(tenant), done.packed.digest)

    return JobFiles(job, forget)


def _safe_relative(name: str) -> str | None:
    """An artifact's path under the download folder; None for one that would leave it."""
    norm = posixpath.normpath(name)
    if not name or posixpath.isabs(name) or norm == ".." or norm.startswith("../") \
            or "\x00" in name:
        return None
    return norm


def cmd_lease_artifacts(args: argparse.Namespace) -> int:
    """`pool lease artifacts ID [--get DEST]`."""
    from bus.errors import BusError
    from bus.objects import artifacts_bucket

    tenant = tenant_of(args)
    prefix = f"{args.lease_id}/"
    bucket = artifacts_bucket(tenant)
    with pool_client(args, tenant) as c:
        store = c.files()
        try:
            found = store.list(bucket, prefix)
        except BusError as e:
            return fail(str(e), e.code, as_json=args.json)
        rows: list[dict[str, Any]] = [
            {"name": o.name.removeprefix(prefix), "size_bytes": o.size_bytes,
             "sha256": o.sha256, "stored_at": o.mtime[:19]} for o in found]
        if args.get:
            dest = Path(args.get)
            dest.mkdir(parents=True, exist_ok=True)
            for o, row in zip(found, rows, strict=True):
                rel = _safe_relative(row["name"])
                if rel is None:
                    return fail(f"artifact {row['name']!r} names a path outside {dest}",
                                "artifact_unsafe", as_json=args.json)
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    store.get(bucket, o.name, target)  # verified against its SHA-256
                except BusError as e:
                    return fail(f"{row['name']}: {e}", e.code, as_json=args.json)
                row["path"] = str(target)
    if args.json:
        print(json.dumps({"ok": True, "result": {"lease_id": args.lease_id,
                                                 "artifacts": rows}}))
    elif not rows:
        print(f"no artifacts stored for lease {args.lease_id}", file=sys.stderr)
    else:
        print(table(rows, (*ARTIFACT_COLUMNS, "path") if args.get else ARTIFACT_COLUMNS))
    return EXIT_OK


def add_run_flags(run: argparse.ArgumentParser) -> None:
    """`--workdir` and `--artifacts` of `pool lease run`."""
    run.add_argument("--workdir", metavar="DIR",
                     help="pack DIR (less .gitignore/.poolignore matches), store it by digest "
                     "and give it to the job as /work, its working directory")
    run.add_argument("--artifacts", action="append", metavar="GLOB",
                     help="files under /work to keep at the job's end (repeatable), e.g. "
                     "'out/*'; `pool lease artifacts ID --get DIR` fetches them")


def register(lease: Subparsers) -> None:
    """Add `lease artifacts`."""
    ar = lease.add_parser("artifacts", help="the files a lease's job kept (--artifacts): list "
                          "them, or --get them into a folder, each verified by its SHA-256")
    client_opts(ar, tenant=True)
    ar.add_argument("lease_id")
    ar.add_argument("--get", metavar="DEST", help="download every artifact into DEST")
    ar.set_defaults(func=cmd_lease_artifacts)
