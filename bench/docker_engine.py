"""Real Docker for the runtime tests: the engine probe, a busybox image built with `docker
import`, and Debian's docker-registry on 127.0.0.1 so images can be run by digest.

Each helper says why it cannot work here instead of failing, so tests skip with that reason.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import struct
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import docker.errors
import requests.exceptions

BUSYBOX = Path("/bin/busybox")
HINT = ".ci/runtimes installs docker.io, busybox-static and docker-registry and starts dockerd"


def engine_unavailable() -> str | None:
    """None when a Docker engine answers, else one line saying why not."""
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"no Docker engine answers ({first[:160]}); {HINT}"
    client.close()
    return None


def _statically_linked(path: Path) -> bool:
    """An ELF with no PT_INTERP program header needs no loader, so it runs in an empty image."""
    with path.open("rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only: enough for Debian's package
            return False
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != 3 for i in range(phnum))


def busybox_unavailable() -> str | None:
    if not BUSYBOX.exists():
        return f"{BUSYBOX} is missing (Debian package busybox-static); {HINT}"
    if not _statically_linked(BUSYBOX):
        return f"{BUSYBOX} is dynamically linked; install busybox-static; {HINT}"
    return None


def busybox_rootfs_tar() -> bytes:
    """A root filesystem of one static busybox and a link per applet, as a tar stream."""
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(str(BUSYBOX), arcname="bin/busybox")
        for applet in applets:
            if applet == "busybox":
                continue
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"),
                           ("etc/group", "root:x:0:\nnogroup:x:65534:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def import_busybox(client: docker.DockerClient, repository: str, tag: str) -> str:
    """`docker import` of the busybox root filesystem; returns the image id."""
    client.api.import_image_from_data(busybox_rootfs_tar(), repository=repository, tag=tag,
                                      changes=["ENV PATH=/bin"])
    return str(client.images.get(f"{repository}:{tag}").id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRegistry:
    """Debian's docker-registry with a config of its own: 127.0.0.1 only, no auth, tmp storage.
    The engine trusts 127.0.0.0/8 registries over plain HTTP without configuration."""

    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"

    def __init__(self, root: Path, *, htpasswd: Path | None = None) -> None:
        self.root = root
        self.htpasswd = htpasswd  # basic auth from this file (bcrypt), when given
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        if not os.access(cls.binary, os.X_OK):
            return f"docker-registry is not installed (Debian package docker-registry); {HINT}"
        return None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n"
            f"http:\n  addr: {self.host}\n"
            + (f"auth:\n  htpasswd:\n    realm: computepool-test\n    path: {self.htpasswd}\n"
               if self.htpasswd else "")
        )
        with open(self.root / "registry.log", "ab") as log:
            self._proc = subprocess.Popen([self.binary, "serve", str(config)], stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {(self.root / 'registry.log').read_text()}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                if e.code == 401 and self.htpasswd:  # up, and asking for its users
                    return
                time.sleep(0.1)
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError(f"docker-registry did not answer on {self.host}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def push(self, client: docker.DockerClient, image_id: str, repo: str, tag: str) -> str:
        """Push under `repo:tag`; returns `HOST/repo@sha256:…`, the digest the registry gave."""
        name = f"{self.host}/{repo}"
        client.images.get(image_id).tag(name, tag)
        digest = None
        for line in client.images.push(name, tag=tag, stream=True, decode=True):
            if "error" in line:
                raise RuntimeError(f"push to {name} failed: {line['error']}")
            digest = (line.get("aux") or {}).get("Digest", digest)
        if digest is None:
            raise RuntimeError(f"push to {name} reported no digest")
        return f"{name}@{digest}"


@contextmanager
def busybox_by_digest(client: docker.DockerClient, root: Path) -> Iterator[str]:
    """`127.0.0.1:PORT/computepool-test/busybox-…@sha256:…`: imported, pushed to a registry of
    its own under `root` and removed locally, so the first start pulls it by digest. Any test
    that needs a real image (the runtime contract, the agent) can use it."""
    registry = LocalRegistry(root)
    registry.start()
    repo, tag = f"computepool-test/busybox-{uuid.uuid4().hex[:8]}", "t"
    image_id = None
    try:
        image_id = import_busybox(client, repo, tag)
        ref = registry.push(client, image_id, repo, tag)
        client.images.remove(f"{repo}:{tag}")
        client.images.remove(f"{registry.host}/{repo}:{tag}")
        yield ref
    finally:
        if image_id is not None:
            try:
                client.images.remove(image_id, force=True)
            except docker.errors.DockerException:
                pass
        registry.stop()
