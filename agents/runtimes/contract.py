"""The runtime contract: how a node agent starts, watches, stops and re-adopts a workload,
and what more a runtime can do for it (follow, read, enter, feed a job), said by flags.
One suite runs against every runtime: tests/contract/test_runtime_contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from agents.runtimes.enter import SandboxEntry


class WorkloadError(Exception):
    """A runtime could not do what it was asked; `code` is stable."""

    code = "runtime_failed"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class RuntimeUnavailable(WorkloadError):
    """The runtime's engine or binary is not usable on this machine."""

    code = "runtime_unavailable"


class Unsupported(WorkloadError):
    """Asked of a runtime what its flags say it cannot do (`can_wait`, `can_enter`, ...)."""

    code = "unsupported"


class ImageRejected(WorkloadError):
    """The agent's own image check (defence in depth) refused the image."""

    code = "image_rejected"


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything a runtime needs to start one job of one lease, in the shape's own units."""

    lease_id: str
    epoch: int
    job_number: int
    command: tuple[str, ...]
    image: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cpu_millis: int = 1000
    memory_mib: int = 256
    pids_limit: int = 256
    gpu_count: int = 0
    gpu_uuids: tuple[str, ...] = ()  # the GPU / MIG UUIDs of the lease's devices, and no other
    gpu_minors: tuple[int, ...] = ()  # their GPUs' /dev/nvidia<minor> (a MIG's parent's)
    gpu_mig: bool = False  # MIG instances: the MIG capability devices are needed too
    gpu_caps: tuple[int, ...] = ()  # their own /dev/nvidia-caps/nvidia-cap<N>, and no other
    network_egress: str = "none"  # "none" unless the shape asks for egress
    # CIDRs its pool lets a job with egress reach past the denied ranges (agents/runtimes/
    # egress.py), besides the node operator's own; checked again by the runtime
    egress_allow: tuple[str, ...] = ()
    isolation: str = "sandboxed"  # the runtime class the lease needs
    checkpoint_dir: str | None = None  # told to the workload through POOL_CHECKPOINT_DIR
    labels: tuple[tuple[str, str], ...] = ()
    max_image_size_bytes: int | None = None  # the pool's image size limit, checked after pull
    # the job's directory on the host, its /work and working directory (agents/workdir.py)
    workdir: str | None = None
    # the most bytes of the job's stdout and stderr the node keeps; the rest is dropped
    output_cap_bytes: int = 64 << 20
    # the pool's volumes the job asked for: (host path, target in the sandbox, read-only)
    volumes: tuple[tuple[str, str, bool], ...] = ()
    # the lease's secrets, held in memory only and never in a repr: variables, and files
    # (a path under /run/secrets, its bytes); a runtime delivers them without a host file
    secret_env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    secret_files: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)
    stdin: bool = False  # a pipe the agent writes to (`pool lease attach -i`), else /dev/null
    # the (user, password) the docker runtime pulls `image` with (the job's registry secret)
    registry_auth: tuple[str, str] | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        """One workload per (lease, epoch, job): the agent never starts the same key twice."""
        return f"{self.lease_id}.{self.epoch}.{self.job_number}"


# which devices a job sees: the runtime's to say, never the job's (a job naming other GPUs
# in them, or `all`, would see through a runtime that binds by these names)
DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


def job_env(spec: WorkloadSpec) -> list[tuple[str, str]]:
    """The job's own variables, less the device ones, then these set to its devices' UUIDs
    (for a job with devices): the agent's word over the job's, whatever the job asked."""
    env = [(k, v) for k, v in spec.env if k not in DEVICE_VARIABLES]
    if spec.gpu_count > 0 and spec.gpu_uuids:
        env += [(k, ",".join(spec.gpu_uuids)) for k in DEVICE_VARIABLES]
    return env


@dataclass
class WorkloadHandle:
    """A started workload: enough to poll, stop and re-adopt it after an agent restart."""

    lease_id: str
    epoch: int
    job_number: int
    runtime: str
    ref: str  # a pid (process) or a container id (docker)
    started_at: float
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.lease_id}.{self.epoch}.{self.job_number}"


@dataclass(frozen=True)
class Usage:
    """A point-in-time sample of a workload's use; None where the runtime cannot tell."""

    cpu_millis_used: int | None = None
    memory_mib_used: int | None = None


class StdinSink(Protocol):
    """The write ends of the stdin of a runtime's jobs started with one, by workload key."""

    def write(self, key: str, data: bytes) -> None:
        """All of `data` to the job's stdin (waiting while it does not read); StdinClosed
        (agents/runtimes/stdin.py) when it has none."""
        ...

    def close(self, key: str) -> None:
        """The end of the job's input."""
        ...


class Runtime(Protocol):
    """A way to run workloads on this node inside a given isolation boundary. Every runtime
    has every member: what one cannot do its flags say (the agent asks them, never the
    runtime's attributes), and the method raises Unsupported if called all the same."""

    name: str
    can_wait: bool  # `wait` tells a job's exit and output as they happen (else: polled)
    can_read_output: bool  # `read_output` gives the job's stdout and stderr (logs, attach)
    can_enter: bool  # `enter` opens the running job's sandbox (exec, port-forward)

    @property
    def stdin(self) -> StdinSink | None:
        """The jobs' stdin (`pool lease attach -i`); None: every job's is /dev/null."""
        ...

    def isolation_classes(self) -> tuple[str, ...]:
        """The runtime classes this runtime really provides here (probed, not assumed)."""
        ...

    def binds_gpus(self) -> bool:
        """Whether a workload here can be given exactly its own GPU devices and no other: a
        runtime that cannot does not offer GPU shapes at all."""
        ...

    def network_egress(self) -> str:
        """The most open egress this runtime enforces (`open`), else `none`: a job asking for
        egress is refused where it cannot be enforced."""
        ...

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        """Start the workload; return once its process is running (or raise WorkloadError)."""
        ...

    def poll(self, handle: WorkloadHandle) -> int | None:
        """The exit code once the workload has exited, else None."""
        ...

    def stop(self, handle: WorkloadHandle, grace_seconds: float) -> int | None:
        """SIGTERM, wait up to `grace_seconds`, then SIGKILL; return the exit code if known."""
        ...

    def adopt(self) -> list[WorkloadHandle]:
        """Workloads this runtime started before an agent restart that are still present."""
        ...

    def forget(self, handle: WorkloadHandle) -> None:
        """Remove what the runtime keeps for an ended workload (pid file, container)."""
        ...

    def usage(self, handle: WorkloadHandle) -> Usage:
        """A utilization sample for the running workload."""
        ...

    def wait(self, handle: WorkloadHandle, timeout: float) -> str | None:
        """Block until the workload exits ("exited") or writes output ("output"), or `timeout`
        seconds pass (None); a workload forgotten meanwhile counts as exited. `can_wait`."""
        ...

    def read_output(self, handle: WorkloadHandle, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to `limit` bytes of the job's stdout and stderr from `offset`, and the offset
        after them (the same offset when nothing new was written). `can_read_output`."""
        ...

    def enter(self, handle: WorkloadHandle) -> SandboxEntry:
        """Handles on the running workload's sandbox, to run a command or open a connection
        inside it (agents/sessions.py); a WorkloadError when it is not running. `can_enter`."""
        ...
