"""`pool up --http` serves the HTTP API beside the control plane; `pool admin tenant token`
issues the bearer token it accepts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx


def _pool(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, text=True,
                          capture_output=True, timeout=60, check=False)


def test_pool_up_serves_the_http_api_to_a_token_made_by_the_cli(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env.update(POOL_NATS_PORT="0", POOL_HOME=str(home))
    # NATS and the control plane only: the lease commands need no views
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--json", "--no-postgres",
                             "--http", "127.0.0.1:0"], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        url, admin = info["http_url"], info["http_admin_token"]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        made = _pool("admin", "tenant", "token", "alpha", "--json", env=env)
        assert made.returncode == 0, made.stderr
        token = json.loads(made.stdout)["token"]
        again = _pool("admin", "tenant", "token", "alpha", env=env)
        assert again.returncode == 2 and "--rotate" in again.stderr
        with httpx.Client(base_url=url, timeout=15,
                          headers={"Authorization": f"Bearer {admin}"}) as adm:
            assert adm.post("/v1/admin/pools", json={"pool_id": "p1"}).status_code == 201
            assert adm.post("/v1/admin/tenants",
                            json={"tenant": "alpha", "pool_id": "p1"}).status_code == 200
        with httpx.Client(base_url=url, timeout=15,
                          headers={"Authorization": f"Bearer {token}"}) as alpha:
            r = alpha.post("/v1/compute-leases", json={
                "pool_id": "p1", "shape": {"cpu_millis": 100, "memory_mib": 64},
                "maximum_runtime_seconds": 60})
            assert r.status_code == 201, r.text
            assert r.json()["tenant"] == "alpha"
        rotated = _pool("admin", "tenant", "token", "alpha", "--rotate", env=env)
        assert rotated.returncode == 0
        stale = httpx.get(url + "/v1/balance", headers={"Authorization": f"Bearer {token}"})
        assert stale.status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
