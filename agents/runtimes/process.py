"""The `process` runtime: the job's command inside a bubblewrap sandbox, no engine needed.
The sandbox: docs/security.md; its supervisor: docs/architecture.md#the-node-agent.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

from agents.runtimes import egress as egress_filter
from agents.runtimes import usernet
from agents.runtimes.cgroups import Cgroups, join
from agents.runtimes.contract import (
    RuntimeUnavailable,
    Usage,
    WorkloadError,
    WorkloadHandle,
    WorkloadSpec,
    job_env,
)
from agents.runtimes.enter import EntryRefused, SandboxEntry
from agents.runtimes.events import ProcessEvents
from agents.runtimes.stdin import StdinPipes

# `trap :` installs a handler (reset on exec), so the supervisor outlives a SIGTERM sent to the
# group and still records how the sandboxed command ended. The command's output goes through
# a pipe of which the log keeps the first $POOL_OUTPUT_CAP bytes (written as read: stdbuf),
# then one marker line; the rest is read and dropped, so the job never blocks on it (the
# reader ignores TERM: it lasts as long as the job writes).
_SUPERVISOR = (
    'trap : TERM INT HUP; '
    '{ trap : TERM INT HUP; "$@"; echo $? > "$POOL_EXIT_FILE.tmp"; } 2>&1 | '
    '{ trap "" TERM INT HUP; stdbuf -o0 head -c "$POOL_OUTPUT_CAP"; '
    'if [ "$(head -c 1 | wc -c)" -gt 0 ]; then '
    'printf "\\n[pool: output past %s bytes dropped (max_output_bytes)]\\n" "$POOL_OUTPUT_CAP"; '
    'cat > /dev/null; fi; }; '
    'mv "$POOL_EXIT_FILE.tmp" "$POOL_EXIT_FILE"')
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# what every CUDA process needs besides its GPUs' own /dev/nvidia<minor>
GPU_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
DEV = Path("/dev")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, read from its start (close-on-exec: only
    a child it is passed to gets it)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def volume_args(spec: WorkloadSpec) -> list[str]:
    """bwrap binds of the pool's volumes (read-only unless the pool says otherwise);
    WorkloadError volume_unavailable when one's host path is not a directory here."""
    args: list[str] = []
    for host, target, read_only in spec.volumes:
        if not os.path.isdir(host):
            raise WorkloadError(f"volume at {host} is not a directory on this node",
                                code="volume_unavailable")
        args += ["--ro-bind" if read_only else "--bind", host, target]
    return args


def secret_args(spec: WorkloadSpec) -> tuple[list[str], list[int]]:
    """bwrap arguments that hand the job its secrets, and the memfds they name: the
    variables as `--setenv` pairs read from a memfd (`--args`), so no value is ever in a
    process's command line, and each file copied from a memfd into the sandbox's own
    in-memory /run/secrets (`--file`), so none is ever on the host's disk. The caller closes
    the fds once the sandbox has started; the sandbox's memory goes with it."""
    if not spec.secret_env and not spec.secret_files:
        return [], []
    fds: list[int] = []
    args = ["--perms", "0755", "--dir", "/run/secrets"]
    try:
        for path, data in spec.secret_files:
            fds.append(memfd("pool-secret", data))
            args += ["--perms", "0400", "--file", str(fds[-1]), path]
        if spec.secret_env:
            pairs = b"".join(b"--setenv\0" + k.encode() + b"\0" + v.encode() + b"\0"
                             for k, v in spec.secret_env)
            fds.append(memfd("pool-secret-env", pairs))
            args += ["--args", str(fds[-1])]
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return args, fds


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, a unique identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _group_pids(pgid: int, *, workload_only: bool = False) -> list[int]:
    """Live pids of the process group; `workload_only` leaves out the supervisor and bwrap,
    whose death would tear the sandbox down at once instead of letting the job handle TERM."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) != pgid or fields[0] == "Z":
            continue
        if workload_only and (int(d.name) == pgid or comm == "bwrap"):
            continue
        out.append(int(d.name))
    return out


def gpu_sandbox_args(spec: WorkloadSpec, dev: Path = DEV) -> list[str]:
    """bwrap arguments that give the workload its own GPUs and no other: their /dev/nvidia<minor>
    nodes, the driver's control devices and, for MIG instances, their own capability files
    (CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES: `job_env`). The sandbox's own /dev
    (`--dev`) holds no GPU node, so nothing else is reachable."""
    if spec.gpu_count <= 0:
        return []
    if not spec.gpu_uuids or not spec.gpu_minors:
        raise WorkloadError("a GPU lease reached the process runtime without its devices",
                            code="devices_unbound")
    args: list[str] = []
    missing = []
    nodes = [f"nvidia{m}" for m in sorted(set(spec.gpu_minors))] + list(GPU_CONTROL_DEVICES)
    if spec.gpu_mig:  # the instances' own capability files, never the whole nvidia-caps
        if not spec.gpu_caps:
            raise WorkloadError("a MIG lease reached the process runtime without its "
                                "capability files", code="devices_unbound")
        nodes += [f"nvidia-caps/nvidia-cap{c}" for c in sorted(set(spec.gpu_caps))]
    for name in nodes:
        path = dev / name
        if path.exists():
            args += ["--dev-bind", str(path), f"/dev/{name}"]
        elif name.startswith(("nvidia-caps/", "nvidiactl")) or name[6:].isdigit():
            missing.append(str(path))
    if missing:
        raise WorkloadError(f"GPU device nodes missing on this machine: {', '.join(missing)}",
                            code="device_missing")
    return args


def _processes_of(uid: int) -> int:
    """How many processes the host user `uid` runs now (what RLIMIT_NPROC counts)."""
    n = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    n += 1
            except OSError:
                continue
    return n


class ProcessRuntime:
    """Runs workloads as sandboxed processes; state (pid and exit files) under `state_dir`."""

    name = "process"
    can_wait = True  # pidfd and inotify (agents/runtimes/events.py)
    can_read_output = True
    can_enter = True

    def __init__(self, state_dir: Path, *, bwrap: str | None = None,
                 cgroups: Cgroups | None = None, slirp: str | None = "",
                 dev: Path = DEV) -> None:
        self.state_dir = Path(state_dir) / "process"
        # where the GPUs' device nodes are bound from (a test's stand-in /dev elsewhere)
        self.dev = dev
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.bwrap = bwrap or shutil.which("bwrap")
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._networks: dict[str, subprocess.Popen[bytes]] = {}
        self._events: dict[str, ProcessEvents] = {}  # each workload's exit and output writes
        self.stdin = StdinPipes()  # the write ends of the jobs started with a stdin
        self._classes: tuple[str, ...] | None = None
        self.cgroups = cgroups if cgroups is not None else Cgroups.probe()
        # "" finds slirp4netns on PATH; None: no egress from this runtime
        self.slirp = usernet.available() if slirp == "" else slirp
        # what keeps a sandbox with egress off private ranges, link-local and this host's own
        # addresses (iptables-restore in its namespace); without it, no egress at all
        self.egress_filter = egress_filter.available()
        self.egress_allow: list[str] = []
        self.egress_problem: str | None = None
        try:
            self.egress_allow = egress_filter.allowed_by_operator()
        except ValueError as e:  # a typo must not open more than meant: no egress at all
            self.egress_problem = f"{egress_filter.ALLOW_ENV}: {e}"
            self.egress_filter = None

    # -- capabilities -----------------------------------------------------------------------

    def available(self) -> str | None:
        """None when a sandbox can be started here, else why not."""
        if self.bwrap is None:
            return "bubblewrap (bwrap) is not installed; apt-get install bubblewrap"
        try:
            r = subprocess.run([self.bwrap, *self._sandbox_args(None), "--", "/bin/true"],
                               capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap failed to start: {e}"
        if r.returncode != 0:
            return f"bwrap cannot create a sandbox here: {r.stderr.decode(errors='replace').strip()}"
        return None

    def binds_gpus(self) -> bool:
        """A sandbox sees only the /dev nodes bound into it: GPUs can be given one by one
        wherever the NVIDIA driver's control device exists and a sandbox can start."""
        return (self.dev / "nvidiactl").exists() and bool(self.isolation_classes())

    def network_egress(self) -> str:
        """The most open egress this runtime enforces: `open` through slirp4netns (the host's
        loopback unreachable), else `none` (a job asking for egress is refused)."""
        return "open" if self.slirp and self.egress_filter else "none"

    def limitations(self) -> list[str]:
        """What this runtime cannot enforce here, one line each (said at the agent's start)."""
        out = list(self.cgroups.problems)
        missing = [c for c in ("cpu", "memory", "pids") if c not in self.cgroups.enforced]
        if "cpu" in missing:
            out.append("no CPU limit: a job may use every core")
        if "memory" in missing:
            out.append("memory bounded only by RLIMIT_AS (address space, not residency)")
        if "pids" in missing:
            out.append("processes bounded only by RLIMIT_NPROC (counted per host user)")
        if not self.slirp:
            out.append("no slirp4netns: jobs that ask for egress are refused, none advertised")
        elif self.egress_problem is not None:
            out.append(f"{self.egress_problem}: jobs that ask for egress are refused")
        elif not self.egress_filter:
            out.append("no iptables-restore to keep sandboxes off private and host addresses: "
                       "jobs that ask for egress are refused, none advertised")
        return out

    def isolation_classes(self) -> tuple[str, ...]:
        if self._classes is None:  # probed once: starting a sandbox costs a few milliseconds
            self._classes = ("sandboxed",) if self.available() is None else ()
        return self._classes

    # -- lifecycle --------------------------------------------------------------------------

    def _sandbox_args(self, checkpoint_dir: str | None, tmp_bytes: int = 64 << 20,
                      workdir: str | None = None) -> list[str]:
        args = ["--unshare-all", "--uid", "65534", "--gid", "65534",
                "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            target = Path("/") / link
            if target.is_symlink():
                args += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                args += ["--ro-bind", str(target), f"/{link}"]
        # /tmp is memory: sized to the shape (its pages count against the memory limit too)
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
        if workdir is not None:  # the job's files, read-write, and where it starts
            args += ["--bind", workdir, "/work"]
        args += ["--chdir", "/work" if workdir is not None else "/tmp",
                 "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                 "--setenv", "HOME", "/tmp"]
        if workdir is not None:
            args += ["--setenv", "POOL_WORKDIR", "/work"]
        # never --share-net (the host's own namespace: its loopback services too): egress comes
        # from a user-mode stack attached to the sandbox's own namespace (usernet)
        if checkpoint_dir is not None:
            args += ["--bind", checkpoint_dir, "/checkpoint",
                     "--setenv", "POOL_CHECKPOINT_DIR", "/checkpoint"]
        return args

    def _files(self, key: str) -> tuple[Path, Path]:
        return self.state_dir / f"{key}.json", self.state_dir / f"{key}.exit"

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        if self.bwrap is None:
            raise RuntimeUnavailable("bubblewrap (bwrap) is not installed")
        if not spec.command:
            raise WorkloadError("the job has no command to run", code="job_has_no_command")
        pid_file, exit_file = self._files(spec.key)
        if pid_file.exists():
            raise WorkloadError(f"workload {spec.key} was already started here",
                                code="already_started")
        exit_file.unlink(missing_ok=True)
        if spec.checkpoint_dir is not None:
            Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            os.chmod(spec.checkpoint_dir, 0o777)  # the sandbox's uid 65534 writes there
        egress = spec.network_egress != "none"
        allow = egress_filter.allowed(self.egress_allow, spec.egress_allow) if egress else []
        if egress and not self.slirp:
            raise WorkloadError("this node cannot give a sandbox egress without the host's "
                                "network (no slirp4netns)", code="egress_unavailable")
        if egress and not self.egress_filter:
            raise WorkloadError("this node cannot keep a sandbox's egress off private and host "
                                "addresses (no iptables-restore)", code="egress_unavailable")
        memory = spec.memory_mib * 1024 * 1024
        argv = [self.bwrap, *self._sandbox_args(spec.checkpoint_dir, memory, spec.workdir),
                *gpu_sandbox_args(spec, self.dev)]
        argv += volume_args(spec)
        for k, v in job_env(spec):  # the device variables are the runtime's (contract)
            argv += ["--setenv", k, v]
        try:
            hidden, secret_fds = secret_args(spec)
        except OSError as e:
            raise WorkloadError(f"could not hold the job's secrets in memory: {e}",
                                code="secrets_failed") from e
        argv += hidden
        try:
            return self._start(spec, argv, allow if egress else None, memory, secret_fds,
                               pid_file, exit_file)
        finally:
            for fd in secret_fds:  # the sandbox has its copies (or never started)
                os.close(fd)

    def _start(self, spec: WorkloadSpec, argv: list[str], allow: list[str] | None, memory: int,
               secret_fds: list[int], pid_file: Path, exit_file: Path) -> WorkloadHandle:
        wiring = usernet.Wiring() if allow is not None else None  # None: no egress
        if wiring is not None:
            argv += wiring.bwrap_args()
        argv += ["--setenv", "POOL_LEASE_ID", spec.lease_id, "--", *spec.command]
        try:
            procs_files = self.cgroups.create(spec.key, cpu_millis=spec.cpu_millis,
                                              memory_mib=spec.memory_mib,
                                              pids=spec.pids_limit) if self.cgroups.enforced else []
        except OSError as e:
            if wiring is not None:
                wiring.abandon()
            raise WorkloadError(f"could not set the workload's cgroup limits: {e}",
                                code="limits_failed") from e
        # without a pids cgroup, RLIMIT_NPROC is the floor: it counts every process of the host
        # user the sandbox maps to, so the job gets its own limit on top of what runs already
        nproc = (None if "pids" in self.cgroups.enforced
                 else _processes_of(os.getuid()) + spec.pids_limit)

        def limits() -> None:  # in the child, before exec: inherited by bwrap and the job
            join(procs_files)
            # address space gets headroom over the shape: it counts mappings, not residency
            resource.setrlimit(resource.RLIMIT_AS, (memory * 4, memory * 4))
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if nproc is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

        # the job's stdout and stderr: readable by the node's operator only
        fd = os.open(self.state_dir / f"{spec.key}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        stdin = self.stdin.open(spec.key) if spec.stdin else subprocess.DEVNULL
        with os.fdopen(fd, "ab") as log_file:
            try:
                proc = subprocess.Popen(
                    [*(wiring.prefix() if wiring is not None else []),
                     "/bin/sh", "-c", _SUPERVISOR, "pool-supervisor", *argv],
                    stdin=stdin, stdout=log_file, stderr=subprocess.STDOUT,
                    # the child only joins its cgroups and calls setrlimit before exec
                    start_new_session=True, preexec_fn=limits,  # noqa: PLW1509
                    env={"POOL_EXIT_FILE": str(exit_file), "PATH": "/usr/bin:/bin",
                         "POOL_OUTPUT_CAP": str(max(0, spec.output_cap_bytes))},
                    pass_fds=(*(wiring.child_fds() if wiring is not None else ()),
                              *secret_fds),
                )
            except OSError as e:
                if wiring is not None:
                    wiring.abandon()
                self.stdin.close(spec.key)
                raise WorkloadError(f"could not start the sandbox: {e}") from e
            finally:
                if stdin != subprocess.DEVNULL:  # the job has it now
                    os.close(stdin)
        if wiring is not None:
            assert self.slirp is not None
            try:
                assert self.egress_filter is not None and allow is not None
                rules = egress_filter.ruleset(egress_filter.host_addresses(), allow)
                self._networks[spec.key] = wiring.connect(self.slirp, proc.pid,
                                                          (self.egress_filter, rules))
            except (WorkloadError, OSError) as e:
                self._signal(proc.pid, signal.SIGKILL)
                proc.wait()
                raise WorkloadError(f"could not give the sandbox egress: {e}",
                                    code="egress_failed") from e
        started = time.time()
        handle = WorkloadHandle(
            lease_id=spec.lease_id, epoch=spec.epoch, job_number=spec.job_number,
            runtime=self.name, ref=str(proc.pid), started_at=started,
            extra={"start_ticks": str(_proc_start_ticks(proc.pid) or 0)},
        )
        tmp = pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({**handle.__dict__}))
        tmp.replace(pid_file)
        self._children[handle.key] = proc
        # opened before anything reaps the child: the pid is surely the supervisor's
        self._events[handle.key] = ProcessEvents(proc.pid, self._log(handle.key))
        return handle

    def _log(self, key: str) -> Path:
        return self.state_dir / f"{key}.log"

    def wait(self, handle: WorkloadHandle, timeout: float) -> str | None:
        """Block until the workload exits ("exited") or writes output ("output"), or `timeout`
        seconds pass (None). A workload forgotten meanwhile counts as exited."""
        events = self._events.get(handle.key)
        if events is None:
            return "exited"
        return events.wait(timeout)

    def _alive(self, handle: WorkloadHandle) -> bool:
        pid = int(handle.ref)
        child = self._children.get(handle.key)
        if child is not None:
            return child.poll() is None
        ticks = _proc_start_ticks(pid)
        if ticks is None or _proc_state(pid) == "Z":
            return False
        # a pid reused by another process is not ours
        return str(ticks) == handle.extra.get("start_ticks", str(ticks))

    def poll(self, handle: WorkloadHandle) -> int | None:
        if self._alive(handle):
            return None
        _, exit_file = self._files(handle.key)
        try:
            return int(exit_file.read_text().strip())
        except (OSError, ValueError):
            # the supervisor itself was killed: the workload's end is unknown, call it killed
            return 128 + signal.SIGKILL

    def stop(self, handle: WorkloadHandle, grace_seconds: float) -> int | None:
        pgid = int(handle.ref)
        if self._alive(handle):
            for pid in _group_pids(pgid, workload_only=True):
                self._signal_pid(pid, signal.SIGTERM)
            deadline = time.monotonic() + max(0.0, grace_seconds)
            while time.monotonic() < deadline and self._alive(handle):
                time.sleep(0.05)
            if self._alive(handle):
                self._signal(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and self._alive(handle):
                    time.sleep(0.02)
        # nothing of the group may outlive the stop (the job may have forked), nor anything
        # left in its cgroup (a job that started a session of its own)
        for pid in _group_pids(pgid):
            self._signal_pid(pid, signal.SIGKILL)
        for pid in self.cgroups.pids(handle.key):
            self._signal_pid(pid, signal.SIGKILL)
        return self.poll(handle)

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _signal_pid(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def adopt(self) -> list[WorkloadHandle]:
        # output of workloads forgotten before their log was (an agent stopped in between)
        for f in self.state_dir.glob("*.log"):
            if not f.with_suffix(".json").exists():
                f.unlink(missing_ok=True)
        out = []
        for f in sorted(self.state_dir.glob("*.json")):
            try:
                d = json.loads(f.read_text())
                handle = WorkloadHandle(**d)
            except (OSError, ValueError, TypeError):
                continue
            out.append(handle)
            events = ProcessEvents(int(handle.ref), self._log(handle.key))
            if self._alive(handle):  # checked after the pidfd is open: it is this process's
                self._events[handle.key] = events
            else:
                events.close()
        return out

    def forget(self, handle: WorkloadHandle) -> None:
        pid_file, exit_file = self._files(handle.key)
        child = self._children.pop(handle.key, None)
        if child is not None and child.poll() is None:
            return  # still running: keep its files so it can be adopted
        self.stdin.close(handle.key)
        if child is not None:
            child.wait()
        events = self._events.pop(handle.key, None)
        if events is not None:
            events.close()
        net = self._networks.pop(handle.key, None)
        if net is not None:  # it ends with the sandbox (its exit fd closed); reap it
            try:
                net.wait(5)
            except subprocess.TimeoutExpired:
                net.kill()
                net.wait()
        self.cgroups.remove(handle.key)
        pid_file.unlink(missing_ok=True)
        exit_file.unlink(missing_ok=True)
        self._log(handle.key).unlink(missing_ok=True)  # forgotten once its output was shipped

    def read_output(self, handle: WorkloadHandle, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to `limit` bytes of the job's stdout and stderr from `offset`, and the offset
        after them (the same offset when nothing new was written)."""
        try:
            with open(self._log(handle.key), "rb") as f:
                f.seek(offset)
                data = f.read(limit)
        except FileNotFoundError:
            return b"", offset
        return data, offset + len(data)

    def enter(self, handle: WorkloadHandle) -> SandboxEntry:
        """Handles on the running workload's sandbox, to run a command or open a connection
        inside it (agents/sessions.py); EntryRefused when it is not running."""
        if not self._alive(handle):
            raise EntryRefused("the job's sandbox is not running")
        return SandboxEntry(int(handle.ref), handle.extra.get("start_ticks"),
                            self.cgroups.procs_files(handle.key))

    def usage(self, handle: WorkloadHandle) -> Usage:
        pgid = int(handle.ref)
        ticks = 0
        rss_pages = 0
        for pid in _group_pids(pgid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
            rss_pages += int(fields[21])
        elapsed = max(1e-3, time.time() - handle.started_at)
        cpu_millis = int(ticks / _CLOCK_TICKS / elapsed * 1000)
        return Usage(cpu_millis_used=cpu_millis, memory_mib_used=rss_pages * _PAGE // (1 << 20))
