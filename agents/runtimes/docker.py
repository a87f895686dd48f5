"""The `docker` runtime: each job in a locked-down container, found again by its labels.
What the container is allowed: docs/architecture.md#the-node-agent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Literal, cast

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import Container
from docker.types import DeviceRequest, Ulimit

from agents.runtimes import dockerlogs, dockernet, egress, memfiles
from agents.runtimes.contract import (
    ImageRejected,
    RuntimeUnavailable,
    Unsupported,
    Usage,
    WorkloadError,
    WorkloadHandle,
    WorkloadSpec,
    job_env,
)
from agents.runtimes.dockerstdin import DockerStdin
from agents.runtimes.enter import SandboxEntry

LABEL_LEASE = "computepool.lease"
LABEL_EPOCH = "computepool.epoch"
LABEL_JOB = "computepool.job"
LABEL_NODE = "computepool.node"
LABEL_CHECKPOINT = "computepool.checkpoint_dir"
LABEL_OUTPUT_CAP = "computepool.output_cap_bytes"
_RESERVED_LABELS = {LABEL_LEASE, LABEL_EPOCH, LABEL_JOB, LABEL_NODE, LABEL_CHECKPOINT,
                    LABEL_OUTPUT_CAP}

WORKLOAD_UID = 65534
WORKLOAD_USER = f"{WORKLOAD_UID}:{WORKLOAD_UID}"
SECRETS_MOUNT = "/run/secrets"  # where the workload sees its secret files, as in `process`
CHECKPOINT_MOUNT = "/checkpoint"  # where the workload sees its checkpoint dir, as in `process`
WORKDIR_MOUNT = "/work"  # where the workload sees its files (agents/workdir.py), as in `process`
TMPFS_OPTIONS = "rw,nosuid,nodev,size=64m,mode=1777"
OCI_RUNTIMES = {"container": "runc", "sandboxed": "runsc"}  # isolation class → engine runtime

_DIGEST_REF = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def digest_pinned(image: str) -> bool:
    """True for `repo@sha256:<64 hex>`: the only references the agent runs."""
    return bool(_DIGEST_REF.match(image))


def container_name(spec: WorkloadSpec, node_id: str | None) -> str:
    """One name per (node, lease, epoch, job): the engine itself refuses a second start."""
    parts = ["computepool", *([node_id] if node_id else []), spec.lease_id,
             str(spec.epoch), str(spec.job_number)]
    return _NAME_UNSAFE.sub("_", "-".join(parts))


def container_options(spec: WorkloadSpec, *, oci_runtime: str,
                      node_id: str | None = None) -> dict[str, Any]:
    """The keyword arguments for `containers.create`: the whole isolation policy, in one place."""
    # the runtime's own labels are what adoption trusts: a spec label cannot set them
    labels = {k: v for k, v in spec.labels if k not in _RESERVED_LABELS}
    labels.update({LABEL_LEASE: spec.lease_id, LABEL_EPOCH: str(spec.epoch),
                   LABEL_JOB: str(spec.job_number),
                   LABEL_OUTPUT_CAP: str(max(0, spec.output_cap_bytes))})
    if node_id:
        labels[LABEL_NODE] = node_id
    env = dict(job_env(spec))  # the device variables are the runtime's (contract)
    env["POOL_LEASE_ID"] = spec.lease_id
    volumes: dict[str, dict[str, str]] = {}
    if spec.checkpoint_dir is not None:
        volumes[spec.checkpoint_dir] = {"bind": CHECKPOINT_MOUNT, "mode": "rw"}
        env["POOL_CHECKPOINT_DIR"] = CHECKPOINT_MOUNT
        labels[LABEL_CHECKPOINT] = spec.checkpoint_dir
    if spec.workdir is not None:  # the job's files, read-write, and where it starts
        volumes[spec.workdir] = {"bind": WORKDIR_MOUNT, "mode": "rw"}
        env["POOL_WORKDIR"] = WORKDIR_MOUNT
    for host, target, read_only in spec.volumes:  # the pool's, as its operator named them
        volumes[host] = {"bind": target, "mode": "ro" if read_only else "rw"}
    device_requests = []
    if spec.gpu_count > 0:
        if spec.gpu_uuids:
            # exactly the lease's own devices; the toolkit's hook reads NVIDIA_VISIBLE_DEVICES
            device_requests.append(DeviceRequest(device_ids=list(spec.gpu_uuids),
                                                 capabilities=[["gpu"]]))
        else:  # a node registered before device inventories: counted only
            device_requests.append(DeviceRequest(count=spec.gpu_count, capabilities=[["gpu"]]))
    memory = spec.memory_mib * 1024 * 1024
    return {
        "name": container_name(spec, node_id),
        "command": list(spec.command) or None,  # none: the image's own CMD
        "user": WORKLOAD_USER,
        "read_only": True,
        "tmpfs": {"/tmp": TMPFS_OPTIONS},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        # egress: a network of the workload's own, named as its container (agents/runtimes/
        # dockernet.py), never the engine's default bridge shared with every other container
        "network_mode": "none" if spec.network_egress == "none" else container_name(spec, node_id),
        "ipc_mode": "private",
        "nano_cpus": spec.cpu_millis * 1_000_000,
        "mem_limit": memory,
        "memswap_limit": memory,  # no swap beyond the shape
        "pids_limit": spec.pids_limit,
        "ulimits": [Ulimit(name="nofile", soft=1024, hard=1024), Ulimit(name="core", soft=0, hard=0)],
        "device_requests": device_requests or None,
        "runtime": oci_runtime,
        # a real pid 1 that forwards signals: SIGTERM reaches the job as it would outside
        "init": True,
        "environment": env,
        "volumes": volumes or None,
        "working_dir": WORKDIR_MOUNT if spec.workdir is not None else None,
        "labels": labels,
        "log_config": dockerlogs.log_config(spec.output_cap_bytes),
        # a stdin job: OpenStdin and StdinOnce (what the SDK sets when not detached), so the
        # end of the agent's attach stream is the end of the job's input (dockerstdin.py)
        **({"stdin_open": True, "detach": False} if spec.stdin else {"detach": True}),
    }


def _open_to_workload(top: Path) -> None:
    """Let the workload's uid 65534 write the job's files: the tree the agent just unpacked
    (nothing of the job's yet, so no link of its making is followed; links are left as they
    are)."""
    for here, _dirs, names in os.walk(top, followlinks=False):
        os.chmod(here, 0o777)
        for name in names:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 if os.stat(path).st_mode & 0o111 else 0o666)


class DockerRuntime:
    """Runs workloads as containers on the local engine; everything it needs is on the labels.

    `node_id` scopes adoption: a runtime adopts only containers carrying its own node label, so
    several agents (or test runs) can share one engine.
    """

    name = "docker"
    can_wait = False  # its jobs are polled
    can_read_output = True
    can_enter = False  # no exec or port-forward into a container

    def __init__(self, state_dir: Path | str | None = None, *, node_id: str | None = None,
                 client: docker.DockerClient | None = None, timeout_seconds: int = 120) -> None:
        # the engine keeps all state on its containers' labels; `state_dir` is accepted so that
        # both runtimes are built alike, and unused
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.node_id = node_id
        self._client = client
        self._timeout = timeout_seconds
        self._classes: tuple[str, ...] | None = None
        self._cpu_samples: dict[str, tuple[int, float]] = {}
        self._output: dict[str, dockerlogs.Readers] = {}
        self._lock = threading.Lock()
        self._filter = dockernet.Filter()
        self._egress: str | None = None  # why jobs get no egress here ("" when they do)
        self.egress_allow: list[str] = []  # the operator's CIDRs (POOL_EGRESS_ALLOW)
        self.stdin = DockerStdin()  # the stdin streams of the jobs started with one

    # -- the engine ------------------------------------------------------------------------

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            try:
                self._client = docker.from_env(timeout=self._timeout)
            except docker.errors.DockerException as e:
                raise RuntimeUnavailable(f"no Docker engine answers: {e}") from e
        return self._client

    def available(self) -> str | None:
        """None when the engine answers, else why not."""
        try:
            self.client.ping()
        except RuntimeUnavailable as e:
            return str(e)
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            return f"the Docker engine does not answer: {e}"
        return None

    def binds_gpus(self) -> bool:
        """GPUs by UUID need the NVIDIA container toolkit registered with the engine."""
        if self.available() is not None:
            return False
        try:
            runtimes = self.client.info().get("Runtimes") or {}
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return False
        return "nvidia" in runtimes

    def network_egress(self) -> str:
        """`open` where each job's network can be filtered (dockernet), else `none`."""
        if self._egress is None:
            try:
                self.egress_allow = egress.allowed_by_operator()
                why = self._filter.unavailable()
            except ValueError as e:  # a typo must not open more than meant: no egress at all
                why = f"{egress.ALLOW_ENV}: {e}"
            self._egress = why or ""
        return "none" if self._egress else "open"

    def limitations(self) -> list[str]:
        """What this runtime cannot enforce here, one line each (said at the agent's start)."""
        self.network_egress()
        return [f"{self._egress}: jobs that ask for egress are refused"] if self._egress else []

    def _networks(self) -> dockernet.Networks:
        mine = [LABEL_LEASE] + ([f"{LABEL_NODE}={self.node_id}"] if self.node_id else [])
        return dockernet.Networks(self.client, mine, self._filter)

    def isolation_classes(self) -> tuple[str, ...]:
        if self._classes is None:
            if self.available() is not None:
                return ()  # not cached: the engine may come up later
            self._classes = ("container",) + (("sandboxed",) if self._has_runsc() else ())
        return self._classes

    def _has_runsc(self) -> bool:
        try:
            runtimes = self.client.info().get("Runtimes") or {}
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return False
        entry = runtimes.get(OCI_RUNTIMES["sandboxed"])
        if entry is None:
            return False
        # registered is not enough: on a local engine the binary must really be there
        path = entry.get("path") or ""
        return not (os.path.isabs(path) and self._engine_is_local() and not os.path.exists(path))

    def _engine_is_local(self) -> bool:
        base = str(getattr(self.client.api, "base_url", ""))
        return base.startswith(("http+unix://", "unix://", "http+docker://localunixsocket"))

    def _oci_runtime(self, isolation: str) -> str:
        oci = OCI_RUNTIMES.get(isolation)
        if oci is None or isolation not in self.isolation_classes():
            raise WorkloadError(f"this node's docker runtime cannot provide {isolation!r} "
                                f"(it offers {', '.join(self.isolation_classes()) or 'nothing'})",
                                code="isolation_unavailable")
        return oci

    # -- images ----------------------------------------------------------------------------

    @staticmethod
    def _check_ref(image: str | None) -> str:
        if not image:
            raise ImageRejected("the docker runtime needs an image", code="image_missing")
        if not digest_pinned(image):
            raise ImageRejected(f"{image!r} is not pinned by digest (repo@sha256:…)",
                                code="image_not_digest_pinned")
        return image

    def ensure_image(self, image: str | None, *, max_size_bytes: int | None = None,
                     auth: tuple[str, str] | None = None) -> str:
        """The local image id for a digest-pinned `image`, pulled if absent (as `auth`'s user,
        given), within the limit."""
        image = self._check_ref(image)
        pulled = False
        try:
            try:
                found = self.client.images.get(image)
            except docker.errors.ImageNotFound:
                creds = {"username": auth[0], "password": auth[1]} if auth else None
                found = self.client.images.pull(image, auth_config=creds)
                pulled = True
        except docker.errors.APIError as e:
            raise ImageRejected(f"could not pull {image}: {e.explanation or e}",
                                code=pull_refusal(str(e.explanation or e))) from e
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise RuntimeUnavailable(f"the Docker engine failed while pulling {image}: {e}") from e
        size = int(found.attrs.get("Size") or 0)
        if max_size_bytes is not None and size > max_size_bytes:
            if pulled and found.id is not None:  # do not keep what the node may not run
                try:
                    self.client.images.remove(found.id, force=False, noprune=False)
                except docker.errors.DockerException:
                    pass
            raise ImageRejected(f"{image} is {size} bytes, over the limit of {max_size_bytes}",
                                code="image_too_large")
        return str(found.id)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        if spec.secret_env:
            # the engine keeps a container's environment in its configuration on disk: refused
            # rather than written down (files are handed over in memory, below)
            raise WorkloadError("this node's docker runtime cannot hand a job secret variables "
                                "without writing them to the engine's disk; use secret files",
                                code="secrets_unsupported")
        self._check_ref(spec.image)
        if spec.network_egress != "none" and self.network_egress() == "none":
            raise WorkloadError(f"this node cannot keep a job's egress off private and host "
                                f"addresses ({self._egress})", code="egress_unavailable")
        if spec.network_egress != "none":
            egress.allowed(self.egress_allow, spec.egress_allow)  # refused before any pull
        oci = self._oci_runtime(spec.isolation)
        options = container_options(spec, oci_runtime=oci, node_id=self.node_id)
        try:
            self.client.containers.get(options["name"])
        except docker.errors.NotFound:
            pass
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise RuntimeUnavailable(f"the Docker engine does not answer: {e}") from e
        else:
            raise WorkloadError(f"workload {spec.key} was already started here",
                                code="already_started")
        if spec.secret_files:
            held = memfiles.write(options["name"], spec.secret_files, uid=WORKLOAD_UID,
                                  gid=WORKLOAD_UID)
            options["volumes"] = {**(options["volumes"] or {}),
                                  str(held): {"bind": SECRETS_MOUNT, "mode": "ro"}}
        try:
            return self._start(spec, options)
        except BaseException:
            memfiles.wipe(options["name"])
            raise

    def _start(self, spec: WorkloadSpec, options: dict[str, Any]) -> WorkloadHandle:
        image_id = self.ensure_image(spec.image, max_size_bytes=spec.max_image_size_bytes,
                                     auth=spec.registry_auth)
        if spec.checkpoint_dir is not None:
            os.makedirs(spec.checkpoint_dir, exist_ok=True)
            os.chmod(spec.checkpoint_dir, 0o777)  # the workload's uid 65534 writes there
        if spec.workdir is not None:
            _open_to_workload(Path(spec.workdir))
        net = options["network_mode"] if options["network_mode"] != "none" else None
        if net is not None:
            self._networks().create(net, options["labels"],
                                    egress.allowed(self.egress_allow, spec.egress_allow))
        try:
            return self._create(spec, image_id, options)
        except BaseException:
            if net is not None:
                self._networks().remove(net)
            raise

    def _create(self, spec: WorkloadSpec, image_id: str, options: dict[str, Any]) -> WorkloadHandle:
        try:
            container = self.client.containers.create(image_id, **options)
        except docker.errors.APIError as e:
            if e.status_code == 409:
                raise WorkloadError(f"workload {spec.key} was already started here",
                                    code="already_started") from e
            raise self._start_error(spec, e) from e
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise RuntimeUnavailable(f"the Docker engine does not answer: {e}") from e
        try:
            if spec.stdin:  # attached before it starts: no input can come before the stream
                self.stdin.open(spec.key, self.client.api, str(container.id))
            container.start()
            container.reload()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            # never started: remove it, so the redelivered start command can create it again
            self.stdin.close(spec.key)
            try:
                container.remove(force=True)
            except docker.errors.DockerException:
                pass
            if isinstance(e, docker.errors.APIError):
                raise self._start_error(spec, e) from e
            raise RuntimeUnavailable(f"the Docker engine does not answer: {e}") from e
        return self._handle(container)

    @staticmethod
    def _start_error(spec: WorkloadSpec, e: docker.errors.APIError) -> WorkloadError:
        text = str(e.explanation or e)
        if spec.gpu_count > 0 and ("device driver" in text or "gpu" in text.lower()):
            return WorkloadError(f"the engine cannot give this container GPUs: {text}",
                                 code="gpu_unavailable")
        return WorkloadError(f"the engine refused workload {spec.key}: {text}")

    def _handle(self, container: Container) -> WorkloadHandle:
        labels = container.labels
        attrs = container.attrs
        state = attrs.get("State") or {}
        started = dockerlogs.parse_docker_time(state.get("StartedAt"))
        if started is None:
            started = dockerlogs.parse_docker_time(attrs.get("Created")) or time.time()
        extra = {"name": container.name or "",
                 "oci_runtime": str((attrs.get("HostConfig") or {}).get("Runtime") or "")}
        for label, key in ((LABEL_CHECKPOINT, "checkpoint_dir"), (LABEL_OUTPUT_CAP, "output_cap")):
            if label in labels:
                extra[key] = labels[label]
        return WorkloadHandle(
            lease_id=labels[LABEL_LEASE], epoch=int(labels.get(LABEL_EPOCH, "0")),
            job_number=int(labels.get(LABEL_JOB, "0")), runtime=self.name,
            ref=str(container.id), started_at=started, extra=extra,
        )

    def _container(self, handle: WorkloadHandle) -> Container:
        try:
            return self.client.containers.get(handle.ref)
        except docker.errors.NotFound as e:
            raise WorkloadError(f"the container of workload {handle.key} is gone",
                                code="workload_lost") from e
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise RuntimeUnavailable(f"the Docker engine does not answer: {e}") from e

    def poll(self, handle: WorkloadHandle) -> int | None:
        state = self._container(handle).attrs.get("State") or {}
        if state.get("Status") in ("exited", "dead"):
            return int(state.get("ExitCode", 0))
        return None

    def exit_reason(self, handle: WorkloadHandle) -> str | None:
        """Why an ended workload ended, where the engine knows more than the exit code."""
        state = self._container(handle).attrs.get("State") or {}
        if state.get("OOMKilled"):
            return "oom_killed"
        return state.get("Error") or None

    def stop(self, handle: WorkloadHandle, grace_seconds: float) -> int | None:
        container = self._container(handle)
        if self.poll(handle) is None:
            # docker's own stop takes whole seconds; this keeps the grace exact
            self._kill(container, "SIGTERM")
            deadline = time.monotonic() + max(0.0, grace_seconds)
            while time.monotonic() < deadline and self.poll(handle) is None:
                time.sleep(0.05)
            if self.poll(handle) is None:
                self._kill(container, "SIGKILL")
                try:
                    container.wait(timeout=30)
                except (docker.errors.DockerException, requests.exceptions.RequestException):
                    pass
        return self.poll(handle)

    @staticmethod
    def _kill(container: Container, sig: str) -> None:
        try:
            container.kill(signal=sig)
        except docker.errors.APIError as e:
            if e.status_code not in (404, 409):  # 409: it is not running any more
                raise WorkloadError(f"could not signal {container.name}: {e}") from e

    def adopt(self) -> list[WorkloadHandle]:
        labels = [LABEL_LEASE] + ([f"{LABEL_NODE}={self.node_id}"] if self.node_id else [])
        try:
            found = self.client.containers.list(all=True, filters={"label": labels})
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise RuntimeUnavailable(f"the Docker engine does not answer: {e}") from e
        out = []
        for container in found:
            if container.status == "created":
                # created but never started (the agent died in between): it never ran, and the
                # start command, acknowledged only after a start, will come again
                try:
                    container.remove(force=True)
                except docker.errors.DockerException:
                    pass
                continue
            out.append(self._handle(container))
        self._networks().sweep({str(h.extra["name"]) for h in out})
        return sorted(out, key=lambda h: h.key)

    def forget(self, handle: WorkloadHandle) -> None:
        self.stdin.close(handle.key)
        with self._lock:
            self._cpu_samples.pop(handle.ref, None)
            self._output.pop(handle.ref, None)
        try:
            container = self.client.containers.get(handle.ref)
        except docker.errors.NotFound:
            return
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise RuntimeUnavailable(f"the Docker engine does not answer: {e}") from e
        if container.status in ("running", "paused", "restarting"):
            return  # still running: keep it so it can be adopted and stopped
        try:
            container.remove(v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            raise WorkloadError(f"could not remove {container.name}: {e}") from e
        memfiles.wipe(str(container.name))  # the job's secret files, if it had any
        self._networks().remove(str(container.name))  # its network, if it had one

    def usage(self, handle: WorkloadHandle) -> Usage:
        container = self._container(handle)
        if container.status != "running":
            return Usage()
        try:
            # stream=False: one dict (the stubs answer "an iterator or a dict" whatever it is)
            stats = cast("dict[str, Any]", container.stats(stream=False, one_shot=True))
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return Usage()
        cpu_ns = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
        now = time.time()
        cpu_millis = None
        if cpu_ns is not None:
            with self._lock:
                last = self._cpu_samples.get(handle.ref)
                self._cpu_samples[handle.ref] = (int(cpu_ns), now)
            # the rate since the last sample; the first one averages since the start
            prev_ns, prev_at = last if last is not None else (0, handle.started_at)
            elapsed = max(1e-3, now - prev_at)
            cpu_millis = max(0, int((int(cpu_ns) - prev_ns) / 1e9 / elapsed * 1000))
        memory = stats.get("memory_stats") or {}
        memory_mib = None
        if "usage" in memory:
            detail = memory.get("stats") or {}
            # what `docker stats` shows: the page cache the kernel can drop does not count
            cache = detail.get("total_inactive_file", detail.get("inactive_file", 0))
            memory_mib = max(0, int(memory["usage"]) - int(cache)) // (1 << 20)
        return Usage(cpu_millis_used=cpu_millis, memory_mib_used=memory_mib)

    def read_output(self, handle: WorkloadHandle, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to `limit` bytes of the job's stdout and stderr from `offset`, and the offset
        after them (the same offset when nothing new was written): the first
        `max_output_bytes` of it, then one marker line when it wrote more (dockerlogs)."""
        cap = int(handle.extra.get("output_cap") or 64 << 20)  # a container from before caps
        with self._lock:
            readers = self._output.setdefault(handle.ref, dockerlogs.Readers())
        out = readers.read(lambda after: self._entries(handle, after), offset, limit, cap)
        return out, offset + len(out)

    def _entries(self, handle: WorkloadHandle, after_ns: int) -> list[tuple[int, bytes]]:
        options: dict[str, Any] = {"stdout": True, "stderr": True, "timestamps": True}
        if after_ns:
            # whole seconds: the engine's `since` counts from the start of that second, so the
            # entries of it already read are dropped by their times
            options["since"] = max(1, after_ns // 1_000_000_000)
        try:
            raw = self._container(handle).logs(**options)
        except WorkloadError as e:
            raise OSError(str(e)) from e  # the agent ships what it has and looks again later
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise OSError(f"the Docker engine does not answer: {e}") from e
        return dockerlogs.stamped_entries(raw if isinstance(raw, bytes) else b"")

    def wait(self, handle: WorkloadHandle, timeout: float) -> str | None:
        raise Unsupported("the docker runtime's jobs are polled (can_wait)")

    def enter(self, handle: WorkloadHandle) -> SandboxEntry:
        raise Unsupported("the docker runtime cannot be entered (can_enter)")

    def logs(self, handle: WorkloadHandle, *, tail: int | Literal["all"] = "all") -> str:
        """The workload's stdout and stderr (the last `tail` lines), for failure reports."""
        data = self._container(handle).logs(stdout=True, stderr=True, tail=tail)
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)


def pull_refusal(message: str) -> str:
    """The code of a refused pull: `registry_unauthorized` when the registry wanted (other)
    credentials (a job's `registry_secret`), else `image_pull_failed`."""
    lowered = message.lower()
    if any(w in lowered for w in ("unauthorized", "authentication required",
                                  "no basic auth credentials", "denied")):
        return "registry_unauthorized"
    return "image_pull_failed"


def time_plain_docker_run(image: str) -> float:
    """Seconds for a plain `docker run --rm IMAGE true`, the image already local: the baseline
    that `pool bench agent` prints next to the docker runtime's own start overhead."""
    cli = shutil.which("docker")
    if cli is None:
        raise RuntimeUnavailable("the docker command line is not installed")
    present = subprocess.run([cli, "image", "inspect", image], capture_output=True, check=False)
    if present.returncode != 0:
        pulled = subprocess.run([cli, "pull", "-q", image], capture_output=True, text=True,
                                check=False)
        if pulled.returncode != 0:
            raise WorkloadError(f"docker pull {image} failed: {pulled.stderr.strip()}",
                                code="image_pull_failed")
    t0 = time.perf_counter()
    run = subprocess.run([cli, "run", "--rm", image, "true"], capture_output=True, text=True,
                         check=False)
    elapsed = time.perf_counter() - t0
    if run.returncode != 0:
        raise WorkloadError(f"docker run {image} true failed: {run.stderr.strip()}")
    return elapsed
